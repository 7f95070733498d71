"""trl-aspo: asymmetric IS loss, tool-position shaping and single-stream value tracking for TRL's GRPOTrainer."""

from .config import ASPOConfig
from .trainer import ASPOTrainer

__version__ = "0.1.0"
__all__ = ["ASPOConfig", "ASPOTrainer", "__version__"]
