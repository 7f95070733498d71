"""The papers of the methods a run uses, for the model card TRL writes (`GRPOTrainer._paper` mechanism).

TRL's card template names one paper (`title`, `id`) and prints a free-form citation block. :func:`model_card_paper`
names the first method the configuration switches on and cites every one it uses, plus GRPO, whose trainer runs
underneath. With every trl-aspo switch off it returns None: the card stays GRPO's.
"""

from __future__ import annotations

import textwrap
from typing import Any

PAPERS = {
    "aspo": {
        "title": "ASPO: Asymmetric Importance Sampling Policy Optimization",
        "id": "2510.06062",
        "citation": textwrap.dedent("""\
            @article{wang2025aspo,
                title        = {{ASPO: Asymmetric Importance Sampling Policy Optimization}},
                author       = {Jiakang Wang and Runze Liu and Lei Lin and Wenping Hu and Xiu Li and Fuzheng Zhang and
                                Guorui Zhou and Kun Gai},
                year         = 2025,
                eprint       = {arXiv:2510.06062},
            }"""),
    },
    "tool_shaping": {
        "title": "Understanding Tool-Integrated Reasoning",
        "id": "2508.19201",
        "citation": textwrap.dedent("""\
            @article{lin2025understanding,
                title        = {{Understanding Tool-Integrated Reasoning}},
                author       = {Heng Lin and Zhongwen Xu},
                year         = 2025,
                eprint       = {arXiv:2508.19201},
            }"""),
    },
    "spo": {
        "title": "Single-stream Policy Optimization",
        "id": "2509.13232",
        "citation": textwrap.dedent("""\
            @article{xu2025single,
                title        = {{Single-stream Policy Optimization}},
                author       = {Zhongwen Xu and Zihan Ding},
                year         = 2025,
                eprint       = {arXiv:2509.13232},
            }"""),
    },
    "spo++": {
        "title": "SPO++: Stream-Aligned Policy Optimization for Asynchronous Agentic RL",
        "id": "2608.24870",
        "citation": textwrap.dedent("""\
            @article{ruan2026spoplusplus,
                title        = {{SPO++: Stream-Aligned Policy Optimization for Asynchronous Agentic RL}},
                author       = {Kai Ruan and Jinghao Lin and Qianshan Wei and others},
                year         = 2026,
                eprint       = {arXiv:2608.24870},
            }"""),
    },
}


def methods_used(args: Any) -> list[str]:
    """Keys of :data:`PAPERS` for the methods `args` (an ASPOConfig) switches on, in the order the loss is built."""
    used = []
    if args.loss_type == "aspo":
        used.append("aspo")
    if args.tool_shaping:
        used.append("tool_shaping")
    if args.advantage_estimator == "spo++":
        # SPO++ builds on SPO's tracker: cite both.
        used += ["spo++", "spo"]
    elif args.advantage_estimator == "spo":
        used.append("spo")
    return used


def model_card_paper(args: Any, grpo_paper: dict[str, str]) -> dict[str, str] | None:
    """`_paper` for the model card: the first used method's title and arXiv id, every used method's BibTeX followed
    by `grpo_paper`'s; None when no trl-aspo method is used."""
    used = methods_used(args)
    if not used:
        return None
    citations = [PAPERS[name]["citation"] for name in used] + [grpo_paper["citation"]]
    return {"title": PAPERS[used[0]]["title"], "id": PAPERS[used[0]]["id"], "citation": "\n\n".join(citations)}
