"""Tool-call detection (`first_tool_call_positions`) measured against a linear pass over the same tensors.

    python scripts/bench_tool_detection.py [--tokens 1 4 8] [--width 1024] [--repeats 7] [--threads 1]
                                           [--step_seconds quickstart=S archer2_math=S]

Detection compacts each row with a per-row sort (O(T log T) per row), so its time could grow faster than the
tokens it reads. The reference is the cheapest pass any detector needs: one elementwise compare of the token ids
with the opener and one cumsum over the same (B, T) tensors. Both run on random batches of `--width`-token rows
(ids in a 1,000-token vocabulary, 80 % model tokens, 1-token opener, a whitespace set of 20 ids), at each size in
`--tokens` (millions), interleaved (reference, detection, reference, ...) `--repeats` times so that load from other
processes hits both alike; the median is reported, in ms per million tokens, with the growth between sizes.

Decision rule (issue 43 item 2): replace the per-row sort by a linear compaction only if detection's growth from 4M
to 8M tokens exceeds the reference's by more than 1.3x. The compaction is timed on its own too, the sort beside the
linear alternative (a scatter of each token to its rank), so the rule replaces the sort only when the sort is what
grows and the scatter is faster.

The recipe sizes are the batches detection runs on once per generation round and process: the quickstart (16 x 64
tokens) and the Archer2.0 math recipe (steps_per_generation 128 x 1 completion x 32,768 tokens = 4.2M tokens per
process). With `--step_seconds NAME=S` (the step time measured for that recipe, e.g. by scripts/bench_step.py),
detection's share of a step is printed too: once per round, so per step its time divided by the round's steps
(quickstart: 2; Archer2.0: 128 micro-batches / 32 accumulation = 4 optimizer steps).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from trl_aspo.algorithms.tool_metrics import first_tool_call_positions

OPENER = [7]
WHITESPACE = list(range(20))
# name -> (rows, width, optimizer steps per round): the batch detection sees once per round on one process.
RECIPES = {"quickstart": (16, 64, 2), "archer2_math": (128, 32768, 4)}


def batch(tokens: int, width: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    rows = max(tokens // width, 1)
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 1000, (rows, width), generator=generator)
    tool_mask = (torch.rand(rows, width, generator=generator) < 0.8).long()
    lengths = torch.randint(width // 2, width + 1, (rows,), generator=generator)
    completion_mask = (torch.arange(width) < lengths.unsqueeze(1)).long()
    return ids, tool_mask, completion_mask


def reference(ids: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """One elementwise compare and one cumsum over the same tensors: a linear lower bound."""
    return (ids == OPENER[0]).long().cumsum(dim=1)


def detection(ids: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor):
    return first_tool_call_positions(ids, tool_mask, completion_mask, OPENER, WHITESPACE)


def sort_compaction(ids: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """Detection's compaction alone: the stable per-row sort that moves each row's action tokens to the left."""
    action = (completion_mask * tool_mask).bool()
    return torch.sort((~action).to(torch.uint8), dim=1, stable=True).indices


def scatter_compaction(ids: torch.Tensor, tool_mask: torch.Tensor, completion_mask: torch.Tensor) -> torch.Tensor:
    """The linear alternative: the same permutation by a scatter to each token's rank (among the action tokens, else
    after them)."""
    action = (completion_mask * tool_mask).bool()
    rank = torch.where(
        action, action.long().cumsum(dim=1) - 1, action.sum(dim=1, keepdim=True) + (~action).long().cumsum(dim=1) - 1
    )
    index = torch.arange(ids.shape[1]).expand_as(rank)
    return torch.empty_like(rank).scatter_(1, rank, index)


PASSES = {"reference": reference, "detection": detection, "sort": sort_compaction, "scatter": scatter_compaction}


def timed(function, tensors) -> float:
    start = time.perf_counter()
    function(*tensors)
    return time.perf_counter() - start


def medians(tensors, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in PASSES}
    for function in PASSES.values():  # warm-up (allocator, kernels)
        timed(function, tensors)
    for _ in range(repeats):
        for name, function in PASSES.items():
            times[name].append(timed(function, tensors))
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, nargs="+", default=[1, 4, 8], help="sizes in millions of tokens")
    parser.add_argument("--width", type=int, default=1024, help="tokens per row")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step_seconds", nargs="*", default=[], help="NAME=S: a recipe's measured step time")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {args.threads} thread(s), "
          f"load {load:.2f} at start; median of {args.repeats} interleaved runs")  # fmt: skip
    rows = {}
    print(f"{'tokens':>8}" + "".join(f"{name + ' ms/M':>16}" for name in PASSES) + f"{'detection/reference':>21}")
    for millions in args.tokens:
        tensors = batch(int(millions * 1_000_000), args.width)
        tokens = tensors[0].numel()
        found = medians(tensors, args.repeats)
        rows[millions] = found
        per_million = "".join(f"{1000 * found[name] / (tokens / 1e6):>16.2f}" for name in PASSES)
        print(f"{tokens / 1e6:>7.2f}M{per_million}{found['detection'] / found['reference']:>21.1f}")
    sizes = sorted(rows)
    for low, high in zip(sizes, sizes[1:], strict=False):
        growth = {name: rows[high][name] / rows[low][name] for name in PASSES}
        print(f"growth {low:g}M -> {high:g}M tokens: " + ", ".join(f"{n} {g:.2f}x" for n, g in growth.items())
              + f" (detection's growth / reference's: {growth['detection'] / growth['reference']:.2f})")  # fmt: skip
    if 4 in rows and 8 in rows:
        growth = {name: rows[8][name] / rows[4][name] for name in PASSES}
        ratio = growth["detection"] / growth["reference"]
        if ratio <= 1.3:
            verdict = "keep the per-row sort"
        elif growth["sort"] / growth["reference"] > 1.3 and rows[8]["scatter"] < rows[8]["sort"]:
            verdict = "replace the per-row sort (it grows faster than the reference, and the scatter is faster)"
        else:
            verdict = "keep the per-row sort: the growth is not the sort's, or the scatter is slower"
        print(f"decision (4M -> 8M, threshold 1.3): {ratio:.2f} -> {verdict}")
    step_seconds = dict(item.split("=", 1) for item in args.step_seconds)
    for name, (count, width, steps) in RECIPES.items():
        seconds = medians(batch(count * width, width), args.repeats)["detection"]
        line = f"{name}: detection {1000 * seconds:.2f} ms per round ({count} x {width} tokens)"
        if name in step_seconds:
            share = seconds / steps / float(step_seconds[name])
            line += f", {100 * share:.3f} % of a {float(step_seconds[name]):g} s step ({steps} steps per round)"
        print(line)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"load {load:.2f} at end")


if __name__ == "__main__":
    main()
