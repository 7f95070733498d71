"""The vLLM tier: a real `trl vllm-serve` (vLLM's CPU build) on 127.0.0.1 for the session, started and stopped by
process id, serving the built-in checkpoint in float32. `make test-vllm` runs these tests in their own environment."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import die_with_parent  # noqa: E402  (tests/ is on sys.path from the line above)

SERVER_START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tokenizer_only_dir(model_dir: Path, target: Path) -> Path:
    """vLLM picks a wrong tokenizer class for the checkpoint folder (its config says qwen2): give it a folder with the
    tokenizer files only, so text it tokenizes itself matches the trainer's ids."""
    target.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, target / name)
    return target


class VLLMServer:
    """`trl vllm-serve` in its own process group; `stop` ends the whole group, and the server ends itself when the
    test process dies without stopping it (`die_with_parent`)."""

    def __init__(self, model_dir: Path, work_dir: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = work_dir / "vllm-serve.log"
        command = [
            str(Path(sys.executable).with_name("trl")),
            "vllm-serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--enforce_eager",
            "true",
            "--max_model_len",
            "512",
            "--log_level",
            "warning",
            "--tokenizer",
            str(tokenizer_only_dir(model_dir, work_dir / "tokenizer")),
        ]
        with open(self.log_path, "w") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent
            )

    def wait_until_healthy(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm-serve exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            time.sleep(2)
        self.stop()
        raise TimeoutError(f"vllm-serve not healthy after {SERVER_START_TIMEOUT_S} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory):
    from trl_aspo.builtin import CHECKPOINT_DIR

    server = VLLMServer(Path(CHECKPOINT_DIR), tmp_path_factory.mktemp("vllm-server"))
    try:
        server.wait_until_healthy()
        yield server
    finally:
        server.stop()
