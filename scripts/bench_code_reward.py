"""Benchmark `code_unit_test_reward` at batch scale (issue 44): each batch judged with `max_concurrency=1` (one
completion after another, the code before issue 44) and at the default, side by side in one run.

Batches (MBPP-style rows of two asserts; "stuck" completions never return):

- 16, 64 and 256 correct completions (timeout 10 s);
- 64 with 8 stuck at timeout 2 s, sleeping and spinning;
- 128 at the Archer2 code recipe's timeout (10 s) with 0%, 2% and 10% stuck (sleeping);
- a group of 16 with 2 stuck sleeping at 10 s: the asynchronous trainer's local worker scores one group at a time,
  so its concurrency acts within a group;
- 64 correct on 1 CPU and on every usable CPU (the process's affinity), at the default: the speed-up with cores.

The default concurrency depends on `memory_limit_mb` (each run charged twice it against the memory available at the
first call): the batches run at 512 MiB, and the two batches of 64 also at the recipe's 4096 MiB. The machine's load
(/proc/loadavg) is recorded at the start and the end: on a shared machine the ratios of one run are what compares.

Usage: python scripts/bench_code_reward.py [--output results.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import warnings
from pathlib import Path

from trl_aspo.evaluation import concurrency, isolation
from trl_aspo.evaluation.rewards import code_unit_test_reward

TESTS = ["assert add(2, 3) == 5", "assert add(-1, 1) == 0"]
RIGHT = "```python\ndef add(a, b):\n    return a + b\n```"
STUCK = {
    "sleeping": "```python\nimport time\ntime.sleep(3600)\n```",
    "spinning": "```python\nwhile True:\n    pass\n```",
}


def _batch(size: int, stuck: int, kind: str = "sleeping") -> list[str]:
    """`size` completions, `stuck` of them stuck, spread evenly (as a GRPO batch's failures would be)."""
    batch = [RIGHT] * size
    for index in range(stuck):
        batch[(index * size) // stuck] = STUCK[kind]
    return batch


def _timed(batch: list[str], timeout: float, **options) -> tuple[float, float]:
    """Wall seconds of one call, and the share of completions scored 1.0."""
    started = time.monotonic()
    rewards = code_unit_test_reward(batch, [TESTS] * len(batch), timeout=timeout, **options)
    return time.monotonic() - started, sum(rewards) / len(rewards)


def _side_by_side(name: str, batch: list[str], timeout: float, memory_limit_mb: int) -> dict:
    sequential, scored = _timed(batch, timeout, max_concurrency=1, memory_limit_mb=memory_limit_mb)
    concurrent, scored_too = _timed(batch, timeout, memory_limit_mb=memory_limit_mb)
    assert scored == scored_too, f"{name}: the verdicts differ ({scored} against {scored_too})"
    row = {
        "batch": name,
        "timeout_s": timeout,
        "memory_limit_mb": memory_limit_mb,
        "default_concurrency": _default(memory_limit_mb),
        "sequential_s": round(sequential, 2),
        "default_s": round(concurrent, 2),
        "speedup": round(sequential / concurrent, 2),
        "passed": scored,
    }
    print(json.dumps(row), flush=True)
    return row


def _default(memory_limit_mb: int) -> int:
    return concurrency.process_limit(None, memory_limit_mb, _counts_cpu(), True, False)


def _counts_cpu() -> bool:
    parents = isolation.sandbox_cgroup()
    return isinstance(parents, isolation.CgroupParents) and parents.counts_cpu


def _with_cores(batch: list[str], cores: set[int], memory_limit_mb: int) -> dict:
    """The default's time for `batch` with this process (and so every run it starts) bound to `cores`."""
    every = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        elapsed, _ = _timed(batch, 10.0, memory_limit_mb=memory_limit_mb)
        row = {"batch": f"{len(batch)} correct", "cores": len(cores), "default_concurrency": _default(memory_limit_mb)}
    finally:
        os.sched_setaffinity(0, every)
    row["default_s"] = round(elapsed, 2)
    print(json.dumps(row), flush=True)
    return row


def _load() -> list[str]:
    return Path("/proc/loadavg").read_text().split()[:3]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", help="write the results as JSON here too")
    parser.add_argument("--quick", action="store_true", help="the small batches only (16 and 64, 64 with 8 stuck)")
    arguments = parser.parse_args()
    warnings.simplefilter("ignore", RuntimeWarning)  # the isolation warning, once per process
    results = {
        "machine": platform.platform(),
        "usable_cpus": concurrency.usable_cpus(),
        "available_memory_mb": concurrency.available_memory_mb(),
        "load_start": _load(),
        "rows": [],
    }
    print(json.dumps({key: value for key, value in results.items() if key != "rows"}), flush=True)
    rows = results["rows"]
    sizes = (16, 64) if arguments.quick else (16, 64, 256)
    rows.extend(_side_by_side(f"{size} correct", _batch(size, 0), 10.0, 512) for size in sizes)
    for kind in STUCK:
        rows.append(_side_by_side(f"64, 8 stuck {kind}", _batch(64, 8, kind), 2.0, 512))
    if not arguments.quick:
        for percent, stuck in ((0, 0), (2, 3), (10, 13)):
            rows.append(_side_by_side(f"128, {percent}% stuck ({stuck})", _batch(128, stuck), 10.0, 512))
        rows.append(_side_by_side("group of 16, 2 stuck (async worker)", _batch(16, 2), 10.0, 512))
    # The recipe's memory_limit_mb (4096): fewer runs at once fit the memory available.
    rows.append(_side_by_side("64 correct", _batch(64, 0), 10.0, 4096))
    rows.append(_side_by_side("64, 8 stuck sleeping", _batch(64, 8), 2.0, 4096))
    every = os.sched_getaffinity(0)
    for cores in ({min(every)}, every):
        rows.append(_with_cores(_batch(64, 0), cores, 512))
    results["load_end"] = _load()
    print(json.dumps({"load_end": results["load_end"]}), flush=True)
    if arguments.output:
        with open(arguments.output, "w") as file:
            json.dump(results, file, indent=2)


if __name__ == "__main__":
    main()
