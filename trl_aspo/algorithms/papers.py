"""The papers trl-aspo's methods come from, as a registered loss or estimator cites them (`PolicyLoss.papers`,
`AdvantageEstimator.papers`); the trainers put the ones a run uses on its model card (trl_aspo.trainers.citations)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Paper:
    """One paper: a BibTeX key, its title, its authors (None when they could not be checked against the paper: a
    model card must not guess them), its year and arXiv id."""

    key: str
    title: str
    authors: str | None
    year: int
    arxiv_id: str

    def bibtex(self) -> str:
        author_line = f"    author       = {{{self.authors}}},\n" if self.authors else ""
        return (
            f"@article{{{self.key},\n    title        = {{{{{self.title}}}}},\n{author_line}"
            f"    year         = {self.year},\n    eprint       = {{arXiv:{self.arxiv_id}}},\n}}"
        )


ASPO_PAPER = Paper(
    "wang2025aspo",
    "ASPO: Asymmetric Importance Sampling Policy Optimization",
    "Jiakang Wang and Runze Liu and Lei Lin and Wenping Hu and Xiu Li and Fuzheng Zhang and Guorui Zhou and Kun Gai",
    2025,
    "2510.06062",
)
TOOL_SHAPING_PAPER = Paper(
    "lin2025understanding", "Understanding Tool-Integrated Reasoning", "Heng Lin and Zhongwen Xu", 2025, "2508.19201"
)
SPO_PAPER = Paper(
    "xu2025single", "Single-stream Policy Optimization", "Zhongwen Xu and Zihan Ding", 2025, "2509.13232"
)
SPO_PLUS_PLUS_PAPER = Paper("spoplusplus2026", "SPO++", None, 2026, "2608.24870")
