"""A dense reward in [0, 1] for tests on the untrained tiny model, whose groups would otherwise rarely carry signal."""

from __future__ import annotations


def digit_share_reward(completions, **kwargs) -> list[float]:
    """Share of digit characters in the completion's final text."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]
