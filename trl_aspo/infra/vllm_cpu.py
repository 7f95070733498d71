"""New policy weights into a vLLM engine that runs on a CPU, for both trainers; GPU runs keep TRL's NCCL sync.

TRL pushes weights into vLLM over NCCL: `VLLMClient.init_communicator` raises on a non-CUDA device, the asynchronous
trainer's `WeightTransferClient` fails on the server (HTTP 500, "Cannot access accelerator device"), and colocate
mode's `model.load_weights` on the engine's model fails on vLLM's CPU build once it has repacked its linear layers
(`'Parameter' object has no attribute 'weight_loader'`). vLLM's own `reload_weights` worker method goes through its
layer-wise reload machinery and works there. This module uses it:

- server mode (synchronous `CPUVLLMClient`, asynchronous `CPUWeightTransfer`): the tensors go into one safetensors
  file in a fresh directory private to the trainer (removed once the server has read it); then `/pause?mode=keep`
  (in-flight requests freeze and continue after the resume instead of being aborted: an aborted, empty turn can
  crash TRL's rollout worker),
  `/collective_rpc` `reload_weights(weights_path=...)`, `/reset_prefix_cache` (cached prefixes were computed by the
  old weights), `/resume`. The server must run with `VLLM_SERVER_DEV_MODE=1`, as `trl vllm-serve` starts it;
- colocate mode (`CPUVLLMGeneration`): the same `reload_weights` in-process, from a tensor iterator, and the engine
  runs in the policy's dtype (vLLM's "auto" would take the checkpoint's, e.g. bfloat16 under a float32 policy).

A tied output layer (`lm_head` sharing the input embedding, as in Qwen2 models up to 3B) keeps vLLM's repacked copy of
the old weights on CPU unless `lm_head.weight` is among the reloaded tensors, so tied names are written out
explicitly (`tied_parameter_aliases`). Measured on the built-in model: log-prob error 0.85 after a reload without the
alias, 8e-6 with it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

WEIGHTS_FILE = "model.safetensors"


def tied_parameter_aliases(model: torch.nn.Module) -> dict[str, str]:
    """`{alias: name}` for every parameter registered under more than one name (tied weights), `name` being the one
    `named_parameters()` yields; e.g. `{"lm_head.weight": "model.embed_tokens.weight"}` for a tied Qwen2."""
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    first_name: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first_name:
            aliases[name] = first_name[id(param)]
        else:
            first_name[id(param)] = name
    return aliases


def with_tied_aliases(
    named_tensors: Iterable[tuple[str, torch.Tensor]], aliases: dict[str, str]
) -> dict[str, torch.Tensor]:
    """The tensors as a `{name: contiguous CPU tensor}` dict, plus a copy under each alias whose source is present
    (safetensors refuses two names on one storage, hence the copy)."""
    tensors = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
    for alias, name in aliases.items():
        if name in tensors and alias not in tensors:
            tensors[alias] = tensors[name].clone()
    return tensors


def on_cpu(device: torch.device | str) -> bool:
    """Whether a device is the CPU, where TRL's NCCL weight sync cannot run."""
    return torch.device(device).type == "cpu"


class VLLMServerReload:
    """Reloads a vLLM server's weights from a safetensors file (the HTTP sequence in the module docstring).

    Args:
        base_url: the server's address, e.g. `http://127.0.0.1:8000`.
        aliases: tied names to write out, from `tied_parameter_aliases`.
        timeout: seconds allowed for each request.
    """

    def __init__(self, base_url: str, aliases: dict[str, str] | None = None, timeout: float = 300.0):
        import requests

        self.base_url = base_url.rstrip("/")
        self.aliases = dict(aliases or {})
        self.timeout = timeout
        self._session = requests.Session()
        self._served_dtype: str | None = None

    def _request(self, method: str, path: str, **kwargs) -> dict:
        response = self._session.request(method, f"{self.base_url}{path}", timeout=self.timeout, **kwargs)
        if response.status_code == 404 and path in ("/collective_rpc", "/pause", "/server_info"):
            raise RuntimeError(
                f"The vLLM server at {self.base_url} has no {path} endpoint: the CPU weight sync needs its "
                "development endpoints. Start it with `VLLM_SERVER_DEV_MODE=1` in its environment (`trl vllm-serve` "
                "does)."
            )
        if response.status_code != 200:
            raise RuntimeError(f"{method} {self.base_url}{path} failed: HTTP {response.status_code}, {response.text}")
        return response.json() if response.content else {}

    def wait_until_ready(self, total_timeout: float) -> None:
        """Poll `/health` until the server answers 200; raise naming the address after `total_timeout` seconds."""
        import requests

        deadline = time.monotonic() + total_timeout
        while True:
            try:
                if self._session.get(f"{self.base_url}/health", timeout=10).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise ConnectionError(
                    f"The vLLM server at {self.base_url} did not answer /health within {total_timeout} s."
                )
            time.sleep(1.0)

    def served_models(self) -> list[str]:
        """The model names the server answers to (`/v1/models`)."""
        return [entry["id"] for entry in self._request("GET", "/v1/models")["data"]]

    def served_dtype(self) -> str:
        """The dtype the server computes in, e.g. 'float32' (from `/server_info`, a development endpoint; asked once,
        since a server's dtype is fixed when it starts)."""
        if self._served_dtype is None:
            info = self._request("GET", "/server_info", params={"config_format": "json"})["vllm_config"]
            self._served_dtype = str(info["model_config"]["dtype"]).removeprefix("torch.")
        return self._served_dtype

    def pause(self) -> None:
        self._request("POST", "/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._request("POST", "/resume")

    def reload(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Write the tensors (with their tied aliases) and make the server load them; the server stays as it was
        (paused or not).

        The file lives only for this call, in a fresh private directory removed before it returns, whether the
        server answered or not: `reload_weights` loads eagerly, and no exit path (a normal end, an exception, a
        trainer that never calls `close`) can leave a copy of the policy in the temporary directory."""
        from safetensors.torch import save_file

        directory = tempfile.mkdtemp(prefix="trl-aspo-vllm-weights-")
        try:
            save_file(with_tied_aliases(named_tensors, self.aliases), str(Path(directory) / WEIGHTS_FILE))
            self._request(
                "POST",
                "/collective_rpc",
                json={"method": "reload_weights", "kwargs": {"weights_path": directory}},
            )
        finally:
            shutil.rmtree(directory, ignore_errors=True)
        self._request("POST", "/reset_prefix_cache")

    def close(self) -> None:
        """End the HTTP session (each reload already removed its weights directory)."""
        self._session.close()


def warn_on_dtype_mismatch(served: str, trained: str, where: str) -> None:
    """The importance ratio is biased when trainer and generator compute in different precisions: say so once."""
    if served != trained:
        warnings.warn(
            f"The vLLM server at {where} computes in {served} but the policy trains in {trained}: their log-probs "
            f"differ by the precision gap. Start the server with `--dtype {trained}` to match.",
            UserWarning,
            stacklevel=3,
        )


def _vllm_client_class():
    from trl.generation.vllm_client import VLLMClient

    class CPUVLLMClient(VLLMClient):
        """TRL's `VLLMClient` whose weight updates are a safetensors reload instead of an NCCL broadcast."""

        def __init__(self, *args, aliases: dict[str, str] | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.weight_reload = VLLMServerReload(self.base_url, aliases)

        def init_communicator(self, device: torch.device | str | int = 0):
            # No NCCL group: only check that the development endpoints the reload needs are there.
            self.weight_reload.served_dtype()
            atexit.register(self.close_communicator)

        def update_named_params(self, metadata, named_params: Iterator[tuple[str, torch.Tensor]]):
            self.weight_reload.pause()
            try:
                self.weight_reload.reload(named_params)
            finally:
                self.weight_reload.resume()

        def close_communicator(self):
            self.weight_reload.close()

    return CPUVLLMClient


def _vllm_generation_class():
    from trl.generation import vllm_generation
    from trl.generation.vllm_generation import VLLMGeneration

    class CPUVLLMGeneration(VLLMGeneration):
        """TRL's `VLLMGeneration` with the CPU weight sync; on a CUDA device every method is TRL's own."""

        def _init_vllm(self):
            self._tied_aliases = tied_parameter_aliases(self.model)
            if not on_cpu(self.accelerator.device):
                return super()._init_vllm()
            if self.mode == "server":
                # TRL's server branch with the CPU client (TRL's would open an NCCL group, which needs CUDA).
                if self.accelerator.is_main_process:
                    base_url = self.server_base_url or f"http://{self.server_host}:{self.server_port}"
                    self.vllm_client = _vllm_client_class()(
                        base_url=base_url,
                        group_port=self.group_port,
                        connection_timeout=self.server_timeout,
                        aliases=self._tied_aliases,
                    )
                    self.vllm_client.init_communicator(device=self.accelerator.device)
                    warn_on_dtype_mismatch(
                        self.vllm_client.weight_reload.served_dtype(),
                        str(self.model.dtype).removeprefix("torch."),
                        base_url,
                    )
                self.accelerator.wait_for_everyone()
                return None
            # TRL builds the engine without a dtype; on CPU it follows the policy's, so their log-probs agree.
            dtype = str(self.model.dtype).removeprefix("torch.")
            engine = vllm_generation.LLM
            vllm_generation.LLM = functools.partial(engine, dtype=dtype)
            try:
                return super()._init_vllm()
            finally:
                vllm_generation.LLM = engine

        def sync_weights(self):
            if not (self.mode == "colocate" and on_cpu(self.accelerator.device)):
                return super().sync_weights()
            tensors = with_tied_aliases(self._iter_named_params(), self._tied_aliases)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(tensors.items())})
            self.llm.reset_prefix_cache()
            return None

    return CPUVLLMGeneration


@contextlib.contextmanager
def cpu_weight_sync(use_vllm: bool):
    """While `GRPOTrainer.__init__` runs, have it build `CPUVLLMGeneration` (which is TRL's class on CUDA devices).

    GRPOTrainer constructs its vLLM backend inline in `__init__`, so the class it names is swapped for that call."""
    if not use_vllm:
        yield
        return
    from trl.trainer import grpo_trainer

    original = grpo_trainer.VLLMGeneration
    grpo_trainer.VLLMGeneration = _vllm_generation_class()
    try:
        yield
    finally:
        grpo_trainer.VLLMGeneration = original


class CPUWeightTransfer:
    """`WeightTransferProtocol` for `AsyncGRPOTrainer` with a CPU vLLM server: the safetensors reload.

    Args:
        server_url: the vLLM server (`vllm_server_base_url`).
        aliases: tied names to write out; `AsyncASPOTrainer` sets them from its model.
        trained_dtype: the policy's dtype, to warn when the server computes in another.
        server_timeout: seconds to wait for the server at the start of training.
        model_name: the name TRL's rollout worker asks the server for (the policy's `name_or_path`); a server that
            serves another name would answer 404 to every request, which TRL's worker retries for minutes.
    """

    def __init__(
        self,
        server_url: str,
        aliases: dict[str, str] | None = None,
        trained_dtype: str | None = None,
        server_timeout: float = 240.0,
    ):
        self.reload = VLLMServerReload(server_url, aliases)
        self.trained_dtype = trained_dtype
        self.server_timeout = server_timeout
        self.model_name: str | None = None

    @property
    def aliases(self) -> dict[str, str]:
        return self.reload.aliases

    @aliases.setter
    def aliases(self, aliases: dict[str, str]) -> None:
        self.reload.aliases = dict(aliases)

    def init_weight_transfer(self) -> None:
        self.reload.wait_until_ready(self.server_timeout)
        served = self.reload.served_dtype()  # first: it names a server without the development endpoints
        served_models = self.reload.served_models()
        if self.model_name is not None and self.model_name not in served_models:
            raise ValueError(
                f"The vLLM server at {self.reload.base_url} serves {served_models}, but the rollout worker asks for "
                f"{self.model_name!r}: start the server with `--model {self.model_name}` (the same path or hub id as "
                "the trainer's model), or pass `--served-model-name` to it."
            )
        if self.trained_dtype is not None:
            warn_on_dtype_mismatch(served, self.trained_dtype, self.reload.base_url)

    def pause(self) -> None:
        self.reload.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.reload.reload(iterator)

    def resume(self) -> None:
        self.reload.resume()

    def destroy(self) -> None:
        self.reload.close()
