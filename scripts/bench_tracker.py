"""Per-round cost of the value tracker and of the prioritized sampler against the number of prompts.

    python scripts/bench_tracker.py [--prompts 10000 100000 1000000] [--batch 64] [--rounds 20]

One simulated generation round does what `ASPOTrainer` does per round with `advantage_estimator: spo++` and
`prioritized_sampling: true`, without a model:

* tracker: read the dispatched prompts' values, observe their outcomes;
* sampler: draw the round's prompts (`PrioritizedRepeatSampler.draw`), refresh the weights after the round's outcomes,
  and the logged `effective_num_prompts`.

The refresh is timed both ways on the same tracker in the same run: "full" recomputes every prompt's value (the
previous behaviour), "incremental" only the prompts observed in the round (`update_values`, what the trainer does
now); the script checks that both give the same weights. Prints the median seconds per round over `--rounds`.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

from trl_aspo.values.event_tracker import EventValueTracker
from trl_aspo.values.sampler import PrioritizedRepeatSampler, effective_num_prompts


def bench(num_prompts: int, batch: int, rounds: int, seed: int = 0) -> dict[str, float]:
    keys = [f"prompt-{index}" for index in range(num_prompts)]
    rows_of_key = {key: [row] for row, key in enumerate(keys)}
    tracker = EventValueTracker()
    generator = torch.Generator().manual_seed(seed)
    incremental = PrioritizedRepeatSampler(num_prompts, 1, batch, seed=seed, deferred=True)
    incremental.set_values(tracker.value(keys, 0))
    timings: dict[str, list[float]] = {"tracker": [], "draw": [], "full": [], "incremental": [], "effective": []}
    for event in range(rounds):
        start = time.perf_counter()
        drawn = incremental.draw(event)
        timings["draw"].append(time.perf_counter() - start)
        round_keys = [keys[row] for row in drawn]
        outcomes = torch.rand(batch, generator=generator, dtype=torch.float64)

        start = time.perf_counter()
        tracker.value(round_keys, event)
        tracker.observe(round_keys, outcomes, event)
        timings["tracker"].append(time.perf_counter() - start)

        start = time.perf_counter()
        full_values = tracker.value(keys, event)
        full = PrioritizedRepeatSampler(num_prompts, 1, batch, seed=seed)
        full.set_values(full_values)
        timings["full"].append(time.perf_counter() - start)

        start = time.perf_counter()
        rows = [row for key in set(round_keys) for row in rows_of_key[key]]
        incremental.update_values(rows, tracker.value([keys[row] for row in rows], event))
        timings["incremental"].append(time.perf_counter() - start)

        start = time.perf_counter()
        effective_num_prompts(incremental.weights)
        timings["effective"].append(time.perf_counter() - start)
        if not torch.equal(incremental.weights, full.weights):
            raise AssertionError(f"incremental and full weights differ at round {event} ({num_prompts} prompts)")
    return {name: statistics.median(values) for name, values in timings.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--batch", type=int, default=64, help="prompts per round")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    machine = platform.processor() or platform.machine()
    print(f"{machine}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, torch {torch.__version__}")
    print(f"median seconds per round, {args.batch} prompts per round, {args.rounds} rounds")
    header = ("prompts", "tracker", "draw", "refresh full (old)", "refresh incremental (new)", "effective_prompts")
    print("| " + " | ".join(header) + " |")
    print("|" + "---:|" * len(header))
    for num_prompts in args.prompts:
        result = bench(num_prompts, args.batch, args.rounds)
        cells = [f"{num_prompts:,}"] + [
            f"{result[name]:.2e}" for name in ("tracker", "draw", "full", "incremental", "effective")
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
