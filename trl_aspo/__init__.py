"""trl-aspo: asymmetric IS loss, tool-position shaping and single-stream value tracking for TRL's GRPOTrainer."""

__version__ = "0.1.0"
