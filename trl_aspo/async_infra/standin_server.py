"""A minimal local stand-in of the vLLM server endpoints TRL's async GRPO clients call, on CPU with transformers.

Serves one causal LM with `sample_completion` (standard library `http.server`, one thread per request, one sampling
call at a time). Endpoints, with the JSON vLLM answers them with as far as TRL reads it:

- `GET /health`, `GET /v1/models` (`max_model_len`), `GET /server_info` (dtype; no LoRA; one data-parallel replica),
  `GET /get_world_size`;
- `POST /v1/completions` with token-id prompts (`return_token_ids`, `logprobs`, `seed`, sampling fields), `n=1`;
- `POST /pause`, `POST /resume`: new completions wait while paused; a call already sampling finishes first;
- `POST /load_weights` (not a vLLM endpoint): a safetensors body of `(name, tensor)` pairs copied into the model. It
  is the CPU substitute for vLLM's NCCL weight-transfer endpoints, which answer 501 here with that explanation.

Run it with `python -m trl_aspo.async_infra.standin_server --model DIR [--port 8000]`.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

import torch
from safetensors.torch import load as safetensors_load
from trl.trainer.utils import create_model_from_path

from .generation import load_named_tensors, sample_completion
from .model_paths import resolve_model_path

NCCL_ENDPOINTS = ("/init_weight_transfer_engine", "/start_weight_update", "/update_weights", "/finish_weight_update")


class StandInVLLMServer:
    """Serve the model at `model_path` on `http://host:port` (port 0 picks a free one; see `url`).

    Args:
        model_path: a local model directory (`from_pretrained` format) or `builtin:tiny-calculator`.
        host, port: where to listen.
        dtype: dtype the weights are held in (`float32`, `bfloat16`, `float16`).
        max_model_len: cap on prompt + completion tokens; defaults to the model's `max_position_embeddings`.
    """

    def __init__(
        self,
        model_path: str,
        host: str = "127.0.0.1",
        port: int = 0,
        dtype: str = "float32",
        max_model_len: int | None = None,
    ):
        self.model_path = resolve_model_path(model_path)
        self.model = create_model_from_path(self.model_path, device_map=None, dtype=dtype, attn_implementation="sdpa")
        self.model.requires_grad_(False)
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        stop_ids = self.model.generation_config.eos_token_id
        self.stop_ids = [stop_ids] if isinstance(stop_ids, int) else list(stop_ids or [])
        self.model_lock = threading.Lock()
        self.running = threading.Event()
        self.running.set()
        self.weight_loads = 0
        self.httpd = ThreadingHTTPServer((host, port), _handler_for(self))
        self.httpd.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> StandInVLLMServer:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="standin-vllm-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def complete(self, request: dict) -> dict:
        """Answer a `/v1/completions` request the way vLLM does for a token-id prompt and `n=1`."""
        prompt = request.get("prompt")
        if not isinstance(prompt, list) or not all(isinstance(token, int) for token in prompt) or not prompt:
            raise ValueError("`prompt` must be a non-empty list of token ids (text prompts are not served).")
        if request.get("n", 1) != 1:
            raise ValueError(f"n={request['n']}: the stand-in serves one completion per request.")
        room = self.max_model_len - len(prompt)
        if room <= 0:
            raise ValueError(f"the prompt has {len(prompt)} tokens; max_model_len is {self.max_model_len}.")
        max_tokens = min(int(request.get("max_tokens", 16)), room)
        seed = request.get("seed")
        generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None
        self.running.wait()
        with self.model_lock:
            token_ids, log_probs = sample_completion(
                self.model,
                prompt,
                max_tokens=max_tokens,
                eos_token_ids=self.stop_ids,
                temperature=float(request.get("temperature", 1.0)),
                top_p=float(request.get("top_p", 1.0)),
                top_k=max(int(request.get("top_k", 0)), 0),
                min_p=request.get("min_p"),
                repetition_penalty=float(request.get("repetition_penalty", 1.0)),
                generator=generator,
            )
        finish_reason = "stop" if token_ids and token_ids[-1] in self.stop_ids else "length"
        choice = {
            "index": 0,
            "token_ids": token_ids,
            "logprobs": {"token_logprobs": log_probs},
            "finish_reason": finish_reason,
        }
        return {
            "object": "text_completion",
            "created": int(time.time()),
            "model": request.get("model"),
            "choices": [choice],
        }

    def load_weights(self, body: bytes) -> int:
        with self.model_lock:
            copied = load_named_tensors(self.model, safetensors_load(body).items())
            self.weight_loads += 1
        return copied

    def server_info(self) -> dict:
        return {
            "vllm_config": {
                "model_config": {"dtype": str(self.model.dtype), "max_model_len": self.max_model_len},
                "lora_config": None,
                "parallel_config": {"data_parallel_size": 1},
            }
        }


def _handler_for(server: StandInVLLMServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format, *args):  # noqa: A002 - the base class's signature
            """Quiet: one line per request would drown the training log."""

        def _answer(self, status: HTTPStatus, payload: dict) -> None:
            body = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            path = urlparse(self.path).path
            if path == "/health":
                self._answer(HTTPStatus.OK, {})
            elif path == "/v1/models":
                model = {"id": server.model_path, "object": "model", "max_model_len": server.max_model_len}
                self._answer(HTTPStatus.OK, {"object": "list", "data": [model]})
            elif path == "/server_info":
                self._answer(HTTPStatus.OK, server.server_info())
            elif path == "/get_world_size":
                self._answer(HTTPStatus.OK, {"world_size": 1})
            else:
                self._answer(HTTPStatus.NOT_FOUND, {"error": f"no endpoint GET {path} in the stand-in server"})

        def do_POST(self):
            path = urlparse(self.path).path
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                if path == "/v1/completions":
                    self._answer(HTTPStatus.OK, server.complete(json.loads(body)))
                elif path == "/pause":
                    server.running.clear()
                    self._answer(HTTPStatus.OK, {})
                elif path == "/resume":
                    server.running.set()
                    self._answer(HTTPStatus.OK, {})
                elif path == "/load_weights":
                    self._answer(HTTPStatus.OK, {"loaded": server.load_weights(body)})
                elif path in NCCL_ENDPOINTS:
                    message = (
                        f"{path}: NCCL weight transfer needs GPUs; the CPU stand-in receives weights at "
                        "/load_weights (pass `weight_transfer=HTTPWeightTransfer(url)` to the trainer)."
                    )
                    self._answer(HTTPStatus.NOT_IMPLEMENTED, {"error": message})
                else:
                    self._answer(HTTPStatus.NOT_FOUND, {"error": f"no endpoint POST {path} in the stand-in server"})
            except (ValueError, KeyError, json.JSONDecodeError) as error:
                self._answer(HTTPStatus.BAD_REQUEST, {"error": str(error)})

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m trl_aspo.async_infra.standin_server", description=__doc__)
    parser.add_argument("--model", required=True, help="local model directory to serve, or builtin:tiny-calculator")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max_model_len", type=int, default=None)
    args = parser.parse_args(argv)
    server = StandInVLLMServer(args.model, args.host, args.port, args.dtype, args.max_model_len)
    print(f"Stand-in vLLM server for {args.model} on {server.url}", flush=True)
    try:
        server.httpd.serve_forever()
    except KeyboardInterrupt:
        server.httpd.server_close()


if __name__ == "__main__":
    main()
