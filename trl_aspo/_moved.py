"""Import paths of the flat layout before 0.2 (`trl_aspo.losses`, `trl_aspo.trainer`, ...), kept for existing code.

`import trl_aspo.losses` returns the module object of `trl_aspo.algorithms.losses` itself (not a copy), so patching an
attribute through either name patches the same module. A `DeprecationWarning` names the new path.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

MOVED_MODULES = {
    "advantage_checks": "algorithms.advantage_checks",
    "aspo_metrics": "algorithms.aspo_metrics",
    "filters": "algorithms.filters",
    "kl": "algorithms.kl",
    "losses": "algorithms.losses",
    "lr_schedule": "algorithms.lr_schedule",
    "normalize": "algorithms.normalize",
    "packed": "algorithms.packed",
    "shaping": "algorithms.shaping",
    "tool_metrics": "algorithms.tool_metrics",
    "weight_map": "algorithms.weight_map",
    "event_values": "values.event_values",
    "prompt_ids": "values.prompt_ids",
    "sampler": "values.sampler",
    "tracker": "values.tracker",
    "value_init": "values.value_init",
    # The scoring half of the old single_stream module (StepScorer, normalize_advantages, tool_shaping_bias, ...).
    "single_stream": "values.scoring",
    "async_config": "config.async_config",
    "trainer": "trainers.aspo_trainer",
    "async_trainer": "trainers.async_aspo_trainer",
    "checkpoint_state": "trainers.checkpoint_state",
    "async_infra": "infra",
    "prompt_stream": "infra.prompt_stream",
    "vllm_cpu": "infra.vllm_cpu",
    "rewards": "evaluation.rewards",
    "report": "evaluation.report",
    "train": "cli.train",
}


class _MovedModuleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self):
        self._own_specs = {}

    def find_spec(self, fullname, path=None, target=None):
        old = fullname.removeprefix("trl_aspo.")
        if fullname == old or old not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        new = f"trl_aspo.{MOVED_MODULES[spec.name.removeprefix('trl_aspo.')]}"
        warnings.warn(f"{spec.name} moved to {new}; import it from there.", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._own_specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module):
        # The import machinery stamps the alias's spec on the module it returned: give the module its own back.
        alias = module.__spec__.name
        module.__spec__ = self._own_specs.pop(alias)
        sys.modules[alias] = module


def install() -> None:
    if not any(isinstance(finder, _MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModuleFinder())
