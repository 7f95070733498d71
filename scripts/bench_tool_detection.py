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
to 8M tokens exceeds the reference's by more than 1.3x.

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


def timed(function, tensors) -> float:
    start = time.perf_counter()
    function(*tensors)
    return time.perf_counter() - start


def medians(tensors, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {"reference": [], "detection": []}
    timed(reference, tensors), timed(detection, tensors)  # warm-up (allocator, kernels)
    for _ in range(repeats):
        times["reference"].append(timed(reference, tensors))
        times["detection"].append(timed(detection, tensors))
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
    print(f"{'tokens':>8} {'reference ms/M':>15} {'detection ms/M':>15} {'detection/reference':>20}")
    for millions in args.tokens:
        tensors = batch(int(millions * 1_000_000), args.width)
        tokens = tensors[0].numel()
        found = medians(tensors, args.repeats)
        rows[millions] = {name: seconds for name, seconds in found.items()}
        per_million = {name: 1000 * seconds / (tokens / 1e6) for name, seconds in found.items()}
        print(f"{tokens / 1e6:>7.2f}M {per_million['reference']:>15.2f} {per_million['detection']:>15.2f} "
              f"{found['detection'] / found['reference']:>20.1f}")  # fmt: skip
    sizes = sorted(rows)
    for low, high in zip(sizes, sizes[1:], strict=False):
        growth = {name: rows[high][name] / rows[low][name] for name in ("reference", "detection")}
        ratio = growth["detection"] / growth["reference"]
        print(f"growth {low:g}M -> {high:g}M tokens: reference {growth['reference']:.2f}x, detection "
              f"{growth['detection']:.2f}x (detection's growth / reference's: {ratio:.2f})")  # fmt: skip
    if 4 in rows and 8 in rows:
        ratio = (rows[8]["detection"] / rows[4]["detection"]) / (rows[8]["reference"] / rows[4]["reference"])
        verdict = "replace the per-row sort" if ratio > 1.3 else "keep the per-row sort"
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
