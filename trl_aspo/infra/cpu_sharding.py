"""Sharded training (FSDP2, DeepSpeed ZeRO) on CPU processes, for tests and for trying a sharded config without GPUs.

accelerate 1.15 never shards on CPU. With `cpu=True` (TRL's `use_cpu`, or `ACCELERATE_USE_CPU`) `PartialState`
takes `DistributedType.MULTI_CPU` over gloo, and `AcceleratorState.__init__` turns a distributed type into FSDP or
DEEPSPEED only from the GPU-like types (`MULTI_GPU`, `MULTI_XPU`, ...) or when `cpu` is false: the FSDP plugin and
the DeepSpeed plugin built from `accelerate launch`'s environment are silently dropped, and the run is plain data
parallelism. Without `cpu` on a machine with no accelerator, `_prepare_backend` finds no backend, so the state is
`DistributedType.NO` with `num_processes == 1` while DeepSpeed's own world has every process.

`enable_cpu_sharding()` changes exactly one thing: after `AcceleratorState.__init__` has run (gloo process group
up, `MULTI_CPU`), it applies accelerate's own GPU branch to the CPU state, that is, when the `Accelerator` passes an
FSDP plugin (built from `accelerate launch`'s `ACCELERATE_USE_FSDP=true` and `FSDP_*` settings, or given) the state
becomes `DistributedType.FSDP` with that plugin (mixed precision set on it as accelerate does), and when it passes a
DeepSpeed plugin (`ACCELERATE_USE_DEEPSPEED=true`, or given) it becomes `DistributedType.DEEPSPEED` with that
plugin selected (accelerate leaves mixed precision to DeepSpeed's config).
Everything else (process group, ranks, device `cpu`) is what accelerate built. DeepSpeed additionally needs
`DS_ACCELERATOR=cpu` in the environment before it is imported, so that it uses its CPU accelerator.

Call it once per process before the trainer (so before the first `Accelerator`) is built; it is idempotent.
"""

from __future__ import annotations

_PATCHED = "_trl_aspo_cpu_sharding"
_SHARDED_TYPE = "_trl_aspo_sharded_type"


def shard_cpu_state(state, fsdp_plugin=None, deepspeed_plugin=None) -> None:
    """Turn an initialized `MULTI_CPU` `AcceleratorState` into FSDP or DEEPSPEED (accelerate's GPU branch) when the
    `Accelerator` passed it a plugin (it builds one from `accelerate launch`'s `ACCELERATE_USE_FSDP` /
    `ACCELERATE_USE_DEEPSPEED`); any other state, or one built without a plugin, is left as it is.

    Every later `AcceleratorState()` (accelerate's `set_seed`, TRL, transformers) copies `PartialState`'s
    `MULTI_CPU` back over the shared distributed type, so a state sharded once is given its sharded type again."""
    from accelerate.utils import DistributedType

    if state.distributed_type != DistributedType.MULTI_CPU:
        return
    sharded = state.__dict__.get(_SHARDED_TYPE)
    if sharded is not None:
        state.distributed_type = sharded
        return
    if deepspeed_plugin is not None:
        plugins = list(deepspeed_plugin.values()) if isinstance(deepspeed_plugin, dict) else [deepspeed_plugin]
        for plugin in plugins:
            plugin.set_mixed_precision(state._mixed_precision)
        # The first plugin passed is the active one (as in accelerate).
        plugins[0].select(_from_accelerator_state=True)
        state.deepspeed_plugins = deepspeed_plugin
        state._mixed_precision = "no"
        sharded = DistributedType.DEEPSPEED
    elif fsdp_plugin is not None:
        if state._mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(state._mixed_precision)
        state.fsdp_plugin = fsdp_plugin
        sharded = DistributedType.FSDP
    else:
        return
    state.distributed_type = sharded
    # In the shared state, so `AcceleratorState._reset_state()` forgets it with the rest.
    state.__dict__[_SHARDED_TYPE] = sharded


def enable_cpu_sharding() -> None:
    """Let accelerate shard on CPU processes (FSDP or DeepSpeed from `accelerate launch`'s environment or the
    plugins passed to `Accelerator`); see the module docstring for exactly what changes."""
    from accelerate.state import AcceleratorState

    original = AcceleratorState.__init__
    if getattr(original, _PATCHED, False):
        return

    def init(self, *args, deepspeed_plugin=None, fsdp_plugin=None, **kwargs):
        original(self, *args, deepspeed_plugin=deepspeed_plugin, fsdp_plugin=fsdp_plugin, **kwargs)
        shard_cpu_state(self, fsdp_plugin=fsdp_plugin, deepspeed_plugin=deepspeed_plugin)

    setattr(init, _PATCHED, True)
    AcceleratorState.__init__ = init
