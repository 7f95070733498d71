"""The papers of the methods a run uses, for the model card TRL writes (`GRPOTrainer._paper` mechanism).

TRL's card template names one paper (`title`, `id`) and prints a free-form citation block. :func:`model_card_paper`
names the first method the configuration switches on and cites every one it uses, plus GRPO, whose trainer runs
underneath. With every trl-aspo switch off it returns None: the card stays GRPO's.
"""

from __future__ import annotations

from typing import Any


def _bibtex(key: str, title: str, authors: str | None, year: int, arxiv_id: str) -> str:
    author_line = f"    author       = {{{authors}}},\n" if authors else ""
    return (
        f"@article{{{key},\n    title        = {{{{{title}}}}},\n{author_line}"
        f"    year         = {year},\n    eprint       = {{arXiv:{arxiv_id}}},\n}}"
    )


def _paper(key: str, title: str, authors: str | None, year: int, arxiv_id: str) -> dict[str, str]:
    return {"title": title, "id": arxiv_id, "citation": _bibtex(key, title, authors, year, arxiv_id)}


# SPO++'s author list is not cited: it could not be checked against the paper, and a card must not guess it.
PAPERS = {
    "aspo": _paper(
        "wang2025aspo",
        "ASPO: Asymmetric Importance Sampling Policy Optimization",
        "Jiakang Wang and Runze Liu and Lei Lin and Wenping Hu and Xiu Li and Fuzheng Zhang and Guorui Zhou and "
        "Kun Gai",
        2025,
        "2510.06062",
    ),
    "tool_shaping": _paper(
        "lin2025understanding",
        "Understanding Tool-Integrated Reasoning",
        "Heng Lin and Zhongwen Xu",
        2025,
        "2508.19201",
    ),
    "spo": _paper(
        "xu2025single", "Single-stream Policy Optimization", "Zhongwen Xu and Zihan Ding", 2025, "2509.13232"
    ),
    "spo++": _paper("spoplusplus2026", "SPO++", None, 2026, "2608.24870"),
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
