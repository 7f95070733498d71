"""Regenerate the configuration reference (docs/configuration.md) from ASPOConfig's help texts.

python scripts/config_reference.py          # rewrite the block between the markers in docs/configuration.md
python scripts/config_reference.py --check  # exit 1 if docs/configuration.md is out of date (run by the tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

from trl import GRPOConfig

from trl_aspo import ASPOConfig

REFERENCE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def reference_table() -> str:
    inherited = {f.name for f in dataclasses.fields(GRPOConfig)}
    rows = ["| field | default | meaning |", "|---|---|---|"]
    for config_field in dataclasses.fields(ASPOConfig):
        if config_field.name in inherited:
            continue
        help_text = " ".join(config_field.metadata.get("help", "").split()).replace("|", "\\|")
        rows.append(f"| `{config_field.name}` | `{config_field.default!r}` | {help_text} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that docs/configuration.md is up to date")
    args = parser.parse_args()
    text = REFERENCE.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    updated = f"{head}{BEGIN}\n{reference_table()}\n{END}{tail}"
    if args.check:
        if updated != text:
            print("docs/configuration.md is stale: run `python scripts/config_reference.py`.")
            return 1
        return 0
    REFERENCE.write_text(updated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
