"""The papers of the methods a run uses, for the model card TRL writes (`GRPOTrainer._paper` mechanism).

TRL's card template names one paper (`title`, `id`) and prints a free-form citation block. :func:`model_card_paper`
names the first paper of the methods the configuration switches on and cites every one, plus GRPO, whose trainer runs
underneath. A registered loss or estimator carries its own papers (`PolicyLoss.papers`); with every trl-aspo switch
off it returns None: the card stays GRPO's.
"""

from __future__ import annotations

from typing import Any

from trl_aspo.algorithms.advantage_estimators import get_advantage_estimator
from trl_aspo.algorithms.papers import TOOL_SHAPING_PAPER, Paper
from trl_aspo.algorithms.policy_losses import get_policy_loss


def papers_used(args: Any) -> list[Paper]:
    """The papers of the methods `args` (an ASPOConfig) switches on, in the order the loss is built: the registered
    loss's, tool shaping's, the advantage estimator's."""
    used: list[Paper] = []
    policy_loss = get_policy_loss(args.loss_type)
    if policy_loss is not None:
        used += policy_loss.papers
    if args.tool_shaping:
        used.append(TOOL_SHAPING_PAPER)
    used += get_advantage_estimator(args.advantage_estimator).papers
    return list(dict.fromkeys(used))


def model_card_paper(args: Any, grpo_paper: dict[str, str]) -> dict[str, str] | None:
    """`_paper` for the model card: the first used paper's title and arXiv id, every used paper's BibTeX followed by
    `grpo_paper`'s; None when no trl-aspo method is used."""
    used = papers_used(args)
    if not used:
        return None
    citations = [paper.bibtex() for paper in used] + [grpo_paper["citation"]]
    return {"title": used[0].title, "id": used[0].arxiv_id, "citation": "\n\n".join(citations)}
