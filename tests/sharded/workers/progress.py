"""What a sharded-tier worker tells the test about its progress, and how it gives up its stacks (stdlib only, so a
worker can start it before anything heavy is imported).

`Progress(out_dir, label)` opens `OUT/LABEL-rank<k>.progress`, whose first line is the rank's process id and whose
later lines are `<seconds since start> <phase>`, one per completed phase (`mark`), each flushed: the file's
modification time is the rank's last sign of progress. SIGUSR1 writes every thread's stack to
`OUT/LABEL-rank<k>.stacks` and lets the process run on. The test's watchdog (`test_sharded._run_watched`) sends it
to every rank when none has made progress for a while, so a hang leaves each rank's stacks, taken at the same moment,
in a file of its own (a rank killed first would otherwise take the others down before they could tell where they
waited)."""

from __future__ import annotations

import faulthandler
import os
import signal
import time


class Progress:
    def __init__(self, out_dir: str, label: str):
        # torchrun sets RANK in every process it starts; a one-process run has none.
        rank = int(os.environ.get("RANK", "0"))
        self._start = time.monotonic()
        self._stacks = open(f"{out_dir}/{label}-rank{rank}.stacks", "w")  # noqa: SIM115 (open for the process's life)
        faulthandler.register(signal.SIGUSR1, file=self._stacks, all_threads=True)
        self._log = open(f"{out_dir}/{label}-rank{rank}.progress", "w")  # noqa: SIM115
        self._log.write(f"{os.getpid()}\n")
        self.mark("started")

    def mark(self, phase: str) -> None:
        self._log.write(f"{time.monotonic() - self._start:.1f} {phase}\n")
        self._log.flush()
