"""The HTTP side of `AsyncGRPOTrainer` on the Python standard library, for machines without `requests`/`aiohttp`.

TRL talks to its vLLM server through `requests` (`VLLMClient`, trainer side) and `aiohttp` (the spawned rollout
worker's `/v1/completions` calls). Neither is a dependency of this project, and neither is needed to speak the same
JSON over HTTP: `UrllibVLLMClient` is `VLLMClient` over `urllib`, `UrllibRolloutLoop` is TRL's `_AsyncRolloutLoop`
with only its transport (`_run_loops` session, `_post`, `_retry`) moved to `urllib` on a thread, and
`UrllibRolloutWorker` is TRL's `AsyncRolloutWorker` (the spawned child process, its queues, heartbeat and stop) running
that loop. `HTTPWeightTransfer` replaces NCCL weight sync, which needs GPUs, by posting the weights as safetensors
bytes to the stand-in server's `/load_weights` (see `standin_server.py`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from trl.experimental.async_grpo import async_rollout_worker
from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker, _AsyncRolloutLoop
from trl.experimental.async_grpo.vllm_client import VLLMClient

logger = logging.getLogger(__name__)

RETRYABLE_ERRORS = (urllib.error.URLError, ConnectionError, TimeoutError)


def http_request(
    url: str,
    *,
    method: str = "GET",
    json_body: Any = None,
    data: bytes | None = None,
    params: dict[str, str] | None = None,
    timeout: float = 60.0,
) -> Any:
    """One HTTP request; returns the decoded JSON answer (None if empty). A non-2xx status raises `RuntimeError`."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    headers = {}
    if json_body is not None:
        data = json.dumps(json_body).encode()
        headers["Content-Type"] = "application/json"
    elif data is not None:
        headers["Content-Type"] = "application/octet-stream"
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
    except urllib.error.HTTPError as error:
        raise RuntimeError(f"{method} {url} failed: {error.code}, {error.read().decode(errors='replace')}") from None
    return json.loads(body) if body else None


class UrllibVLLMClient(VLLMClient):
    """`VLLMClient` with the same endpoints and answers, over `urllib` instead of `requests`."""

    def __init__(self, server_url: str, server_timeout: float = 240.0):
        self.server_url = server_url.rstrip("/")
        self.server_timeout = server_timeout

    def _get(self, path: str, **kwargs: Any) -> Any:
        return http_request(f"{self.server_url}{path}", **kwargs)

    def _post(self, path: str, **kwargs: Any) -> Any:
        return http_request(f"{self.server_url}{path}", method="POST", **kwargs)

    def wait_for_server_ready(self, poll_interval_s: float = 2.0) -> None:
        start = time.time()
        while True:
            try:
                self._get("/health", timeout=5)
                return
            except (OSError, RuntimeError):
                pass
            if time.time() - start >= self.server_timeout:
                raise TimeoutError(
                    f"Timed out after {self.server_timeout:.0f}s waiting for the server at {self.server_url}. "
                    "Increase `vllm_server_timeout` in your AsyncGRPOConfig if it needs more time to start."
                )
            time.sleep(poll_interval_s)

    def get_max_model_len(self) -> int:
        return self._get("/v1/models")["data"][0]["max_model_len"]

    def get_dtype(self) -> str:
        return self.get_server_info()["model_config"]["dtype"]

    def get_server_info(self) -> dict:
        return self._get("/server_info", params={"config_format": "json"})["vllm_config"]

    def load_lora_adapter(self, lora_name: str, lora_path: str, timeout: int = 1800) -> None:
        body = {"lora_name": lora_name, "lora_path": lora_path, "load_inplace": False}
        self._post("/v1/load_lora_adapter", json_body=body, timeout=timeout)

    def unload_lora_adapter(self, lora_name: str, timeout: int = 1800) -> None:
        self._post("/v1/unload_lora_adapter", json_body={"lora_name": lora_name}, timeout=timeout)

    def get_world_size(self) -> int:
        return self._get("/get_world_size")["world_size"]

    def pause(self, timeout: int = 1800) -> None:
        self._post("/pause", params={"mode": "keep"}, timeout=timeout)

    def resume(self, timeout: int = 1800) -> None:
        self._post("/resume", timeout=timeout)

    def init_weight_transfer_engine(self, init_info: dict, timeout: int = 1800) -> None:
        self._post("/init_weight_transfer_engine", json_body={"init_info": init_info}, timeout=timeout)

    def start_weight_update(self, timeout: int = 1800) -> None:
        self._post("/start_weight_update", json_body={"is_checkpoint_format": True}, timeout=timeout)

    def update_weights(self, update_info: dict, timeout: int = 1800) -> None:
        self._post("/update_weights", json_body={"update_info": update_info}, timeout=timeout)

    def finish_weight_update(self, timeout: int = 1800) -> None:
        self._post("/finish_weight_update", timeout=timeout)


class UrllibRolloutLoop(_AsyncRolloutLoop):
    """TRL's rollout loop (generation, tool loop, scoring, advantages) with its HTTP transport on `urllib`."""

    async def _run_loops(self, stop_event: asyncio.Event) -> None:
        await asyncio.gather(self._generate_loop(stop_event=stop_event), self._score_loop(stop_event=stop_event))

    async def _retry(self, coro_factory: Callable[[], Awaitable], *, label: str, max_attempts: int = 1):
        for attempt in range(max_attempts):
            try:
                return await coro_factory()
            except RETRYABLE_ERRORS as error:
                if attempt >= max_attempts - 1:
                    raise
                self._counters["rollout/vllm_retry_total"] += 1
                logger.warning(f"{label} failed ({type(error).__name__}: {error}); retry {attempt + 1}/{max_attempts}")
                await asyncio.sleep(min(2 ** min(attempt, 4), 16))

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        url = f"{self.vllm_server_url}{path}"

        async def post():
            return await asyncio.to_thread(http_request, url, method="POST", json_body=payload, timeout=timeout) or {}

        return await self._retry(post, label=f"POST {path}", max_attempts=max_retries)


class UrllibRolloutWorker(AsyncRolloutWorker):
    """TRL's `AsyncRolloutWorker` (spawned child process) running `UrllibRolloutLoop`.

    TRL's constructor refuses to build without `vllm` and `aiohttp` installed. The child never imports vLLM (it only
    speaks HTTP to a server) and this loop does not use `aiohttp`, so those two checks are waived while TRL's
    constructor runs; everything it sets up is TRL's.
    """

    _loop_cls = UrllibRolloutLoop

    def __init__(self, **kwargs: Any):
        checks = (async_rollout_worker.is_vllm_available, async_rollout_worker.is_aiohttp_available)
        async_rollout_worker.is_vllm_available = async_rollout_worker.is_aiohttp_available = lambda: True
        try:
            super().__init__(**kwargs)
        finally:
            async_rollout_worker.is_vllm_available, async_rollout_worker.is_aiohttp_available = checks


class HTTPWeightTransfer:
    """`WeightTransferProtocol` that posts the trainer's weights to a stand-in server's `/load_weights` endpoint.

    The CPU substitute for TRL's NCCL `WeightTransferClient`: the whole state is serialized as safetensors bytes in one
    request (fine for small models; a large model would want chunks). `pause`/`resume` are the vLLM endpoints.
    """

    def __init__(self, server_url: str, server_timeout: float = 240.0):
        self.client = UrllibVLLMClient(server_url, server_timeout)

    def init_weight_transfer(self) -> None:
        self.client.wait_for_server_ready()

    def pause(self) -> None:
        self.client.pause()

    def send_weights(self, iterator: Iterator[tuple[str, torch.Tensor]]) -> None:
        state = {name: tensor.detach().cpu().contiguous() for name, tensor in iterator}
        url = f"{self.client.server_url}/load_weights"
        http_request(url, method="POST", data=safetensors_bytes(state), timeout=self.client.server_timeout)

    def resume(self) -> None:
        self.client.resume()

    def destroy(self) -> None:
        """Nothing to release: every request is its own connection."""
