"""The trainer's extra checkpoint state (value tracker, sampler, counters) on disk, in formats that cannot run code.

A state is any nested structure of dicts (string keys), lists, tensors, ints, floats, bools, strings and None. It is
stored as two files inside the checkpoint folder:

* `aspo_state.safetensors`: every tensor, numbered and named by its place in the structure (`3:tracker/logps/3`);
* `aspo_state.json`: everything else, with each tensor replaced by `{"__safetensors__": path}`.

Both are written to a temporary file first and moved into place with `os.replace`, the JSON last: a checkpoint has a
state only once its JSON exists, and a reader never sees half a file. Reading validates the structure and names the
file in every error. Nothing is unpickled; the `aspo_state.pt` pickle of unreleased builds is not read, so a checkpoint
holding only that file has no state here.
Every part a resume restores is checked on load with the rules its owner applies on the way in: the value tracker by
its kind's check (`check_event_tracker_state`, `check_visit_tracker_state`, `check_async_event_values_state`), SPO's
stored visits (token ids, masks, finite log-probs), the sampler's counters and the asynchronous trainer's
first-dispatch versions (integers no later than the checkpoint's model version).
"""

from __future__ import annotations

import math
import os
import tempfile
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from trl_aspo.infra.json_files import read_json, write_json_atomic
from trl_aspo.values.event_tracker import check_event_tracker_state
from trl_aspo.values.event_values import check_async_event_values_state
from trl_aspo.values.visit_tracker import check_visit_tracker_state

STATE_JSON = "aspo_state.json"
STATE_TENSORS = "aspo_state.safetensors"
FORMAT_VERSION = 1
_TENSOR_MARKER = "__safetensors__"


def _atomic_write(path: str, write) -> None:
    """Write through `write(temporary_path)`, then rename onto `path` (same folder, so the rename is atomic)."""
    handle, temporary = tempfile.mkstemp(
        dir=os.path.dirname(path) or ".", prefix=".tmp-", suffix=os.path.basename(path)
    )
    os.close(handle)
    try:
        write(temporary)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise


def _split(value: Any, path: str, tensors: dict[str, torch.Tensor]) -> Any:
    """The JSON part of `value`; its tensors go into `tensors` under their path."""
    if isinstance(value, torch.Tensor):
        # Numbered, so that keys containing "/" (user prompt ids) can never make two paths collide.
        name = f"{len(tensors)}:{path}"
        tensors[name] = value.detach().cpu().contiguous()
        return {_TENSOR_MARKER: name}
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise TypeError(f"checkpoint state keys must be strings; {path or '<root>'} has key {key!r}.")
        return {key: _split(item, f"{path}/{key}" if path else key, tensors) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_split(item, f"{path}/{index}" if path else str(index), tensors) for index, item in enumerate(value)]
    if value is None or isinstance(value, bool | int | float | str):
        return value
    raise TypeError(f"checkpoint state at {path or '<root>'} holds a {type(value).__name__}, which cannot be stored.")


def save_checkpoint_state(checkpoint_dir: str, state: dict[str, Any]) -> None:
    """Write `state` into `checkpoint_dir` as safetensors + JSON, each atomically, the JSON last."""
    tensors: dict[str, torch.Tensor] = {}
    document = {"format": FORMAT_VERSION, "state": _split(state, "", tensors)}
    if tensors:
        _atomic_write(os.path.join(checkpoint_dir, STATE_TENSORS), lambda path: save_file(tensors, path))
    write_json_atomic(os.path.join(checkpoint_dir, STATE_JSON), document)


def checkpoint_state_file(checkpoint_dir: str) -> str | None:
    """The state's JSON file in `checkpoint_dir`, or None if it has none. Anything under the name counts (a link, a
    device), so that reading it says what it is instead of "no state"."""
    path = os.path.join(checkpoint_dir, STATE_JSON)
    return path if os.path.lexists(path) else None


def _join(value: Any, tensors: dict[str, torch.Tensor], where: str, field: str = "") -> Any:
    """`value` with its tensors put back; `field` is its place (`tracker.state['a'][0]`) for error messages."""
    if isinstance(value, dict):
        if set(value) == {_TENSOR_MARKER}:
            path = value[_TENSOR_MARKER]
            if path not in tensors:
                raise ValueError(f"{where} refers to tensor {path!r}, which {STATE_TENSORS} does not hold.")
            return tensors[path]
        return {
            key: _join(item, tensors, where, f"{field}[{key!r}]" if "." in field else f"{field}.{key}".lstrip("."))
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [_join(item, tensors, where, f"{field}[{index}]") for index, item in enumerate(value)]
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where}: {field} holds the non-finite number {value!r}; a saved state is always finite.")
    return value


def _load_json_state(path: str) -> dict[str, Any]:
    try:
        document = read_json(path)
    except ValueError as error:
        raise ValueError(f"checkpoint state: {error}") from None
    if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
        got = document.get("format") if isinstance(document, dict) else type(document).__name__
        raise ValueError(f"checkpoint state {path} is not a trl-aspo state of format {FORMAT_VERSION} (got {got!r}).")
    tensors: dict[str, torch.Tensor] = {}
    tensor_path = os.path.join(os.path.dirname(path), STATE_TENSORS)
    if os.path.exists(tensor_path):
        try:
            tensors = load_file(tensor_path)
        except (OSError, SafetensorError) as error:
            raise ValueError(
                f"checkpoint state {tensor_path} cannot be read (truncated or corrupt?): {error}"
            ) from None
    state = _join(document.get("state"), tensors, f"checkpoint state {path}")
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint state {path} must hold an object, got {type(state).__name__}.")
    return state


def _check_counters(state: dict[str, Any], path: str) -> None:
    event = state.get("value_event")
    if isinstance(event, bool) or not isinstance(event, int) or event < 0:
        raise ValueError(f"checkpoint state {path}: value_event must be a non-negative integer, got {event!r}.")
    coefficient = state.get("aspo_kl_coef")
    if isinstance(coefficient, bool) or not isinstance(coefficient, int | float) or not coefficient >= 0:
        raise ValueError(f"checkpoint state {path}: aspo_kl_coef must be a finite number >= 0, got {coefficient!r}.")
    for name in ("tracker", "sampler", "config"):
        if name in state and state[name] is not None and not isinstance(state[name], dict):
            raise ValueError(f"checkpoint state {path}: {name} must be an object, got {type(state[name]).__name__}.")


def _check_tracker(state: dict[str, Any], path: str) -> None:
    """The tracker's own load check by its `type`, the SPO++ events bounded by the trainer's event counter."""
    tracker = state.get("tracker")
    if tracker is None:
        return
    checks = {
        "EventValueTracker": lambda t: check_event_tracker_state(t, max_event=state["value_event"]),
        "VisitValueTracker": check_visit_tracker_state,
        "AsyncEventValues": check_async_event_values_state,
    }
    kind = tracker.get("type")
    if kind not in checks:
        raise ValueError(f"checkpoint state {path}: tracker.type must be one of {sorted(checks)}, got {kind!r}.")
    try:
        checks[kind](tracker)
    except ValueError as error:
        raise ValueError(f"checkpoint state {path}: {error}") from None


def _check_visit_store(state: dict[str, Any], path: str) -> None:
    """SPO's stored visit per prompt: 1-D token ids >= 0, an action mask of the completion's length, and finite
    log-probs of that length (the drift D of the next visit reads them)."""
    store = state.get("visit_store")
    if store is None:
        return
    if not isinstance(store, dict):
        raise ValueError(f"checkpoint state {path}: visit_store must be an object, got {type(store).__name__}.")
    for key, visit in store.items():
        where = f"checkpoint state {path}: visit_store of prompt key {key!r}"
        if not isinstance(visit, dict):
            raise ValueError(f"{where} must be an object, got {type(visit).__name__}.")
        for name in ("prompt_ids", "completion_ids", "action_mask"):
            if not isinstance(visit.get(name), torch.Tensor) or visit[name].dim() != 1:
                raise ValueError(f"{where}: {name} must be a 1-D tensor, got {visit.get(name)!r:.60}.")
        length = len(visit["completion_ids"])
        for name in ("prompt_ids", "completion_ids"):
            ids = visit[name]
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool or (ids < 0).any():
                raise ValueError(f"{where}: {name} must hold token ids (integers >= 0).")
        if len(visit["action_mask"]) != length:
            raise ValueError(f"{where}: action_mask has {len(visit['action_mask'])} entries for {length} tokens.")
        logps = visit.get("logps")
        if logps is not None:
            if not isinstance(logps, torch.Tensor) or not logps.is_floating_point() or logps.shape != (length,):
                raise ValueError(f"{where}: logps must be a float tensor of shape ({length},), got {logps!r:.60}.")
            if not torch.isfinite(logps).all():
                raise ValueError(f"{where}: logps must be finite.")
        if not isinstance(visit.get("multimodal", {}), dict):
            raise ValueError(f"{where}: multimodal must be an object.")


def _check_sampler(state: dict[str, Any], path: str) -> None:
    sampler = state.get("sampler")
    if sampler is None:
        return
    for name, minimum in (("round", 0), ("seed", None)):
        value = sampler.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            bound = " >= 0" if minimum is not None else ""
            raise ValueError(f"checkpoint state {path}: sampler.{name} must be an integer{bound}, got {value!r}.")


def _check_prompt_dispatches(state: dict[str, Any], path: str) -> None:
    """The asynchronous trainer's first-dispatch versions: an object of integer versions by tracker key, each in
    `[0, value_event]`. The trainer saves its model version as `value_event`, and a prompt is dispatched at a model
    version the trainer has already published, so no dispatch is newer than the checkpoint."""
    dispatches = state.get("prompt_dispatches")
    if dispatches is None:
        return
    if not isinstance(dispatches, dict):
        raise ValueError(
            f"checkpoint state {path}: prompt_dispatches must be an object of versions by tracker key, got "
            f"{type(dispatches).__name__}."
        )
    latest = state["value_event"]
    for key, version in dispatches.items():
        if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= latest:
            raise ValueError(
                f"checkpoint state {path}: prompt_dispatches[{key!r}] must be an integer model version in "
                f"[0, {latest}] (value_event, the checkpoint's model version: no prompt is dispatched at a later "
                f"one), got {version!r:.60}."
            )


def load_checkpoint_state(checkpoint_dir: str) -> dict[str, Any]:
    """The trainer state saved in `checkpoint_dir`: `value_event`, `aspo_kl_coef`, and where present `tracker`,
    `sampler` (each class's own `state_dict()`) and `config` (the fields a resume compares).

    Raises `FileNotFoundError` when the folder holds no state and `ValueError` naming the file when a state file is
    truncated, corrupt, not a trl-aspo state, or holds a counter of the wrong type or range, a non-finite number,
    or a tracker, stored visit or sampler state that its own checks refuse (naming the field and the prompt key)."""
    path = checkpoint_state_file(checkpoint_dir)
    if path is None:
        raise FileNotFoundError(f"{checkpoint_dir} holds no trl-aspo state ({STATE_JSON}).")
    state = _load_json_state(path)
    _check_counters(state, path)
    _check_tracker(state, path)
    _check_visit_store(state, path)
    _check_sampler(state, path)
    _check_prompt_dispatches(state, path)
    return state
