"""The `trl-aspo` command line: `train`, `evaluate`, `values`, `compare`, `plot`
(entry point: `trl_aspo.cli.main:main`).

Importing it sets `OMP_WAIT_POLICY=PASSIVE` unless the environment sets a policy: torch's OpenMP threads (libgomp)
otherwise spin at every parallel region's end while they wait for each other, and on a CPU that other jobs share a
spinning thread takes the core from the one it waits for. 4-step `configs/smoke.yaml` runs on a shared 2-core
machine trained in 16-77 s with the spinning default (72-207 s with 4 more busy processes) against 2-6 s (10-16 s)
waiting passively, as fast as one thread (README, Training on a shared CPU). libgomp reads the variable when torch
loads, so it is set here, before any command imports torch, and the processes `accelerate launch` starts inherit it."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
