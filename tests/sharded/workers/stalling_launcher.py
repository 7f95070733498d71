"""Run by test_sharded.py's watchdog test: a stand-in for `accelerate launch` that starts two "ranks" (this file
again, with RANK set); each reports progress, then waits forever in a function its stacks must name, as a rank waits
in a collective the other never joins.

    PYTHONPATH=tests/sharded/workers python tests/sharded/workers/stalling_launcher.py OUT LABEL
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from progress import Progress


def waits_in_a_collective_never_joined() -> None:
    threading.Event().wait()


if __name__ == "__main__":
    if "RANK" in os.environ:
        Progress(sys.argv[1], sys.argv[2]).mark("step 1")
        waits_in_a_collective_never_joined()
    ranks = [subprocess.Popen([sys.executable, *sys.argv], env={**os.environ, "RANK": str(k)}) for k in (0, 1)]
    for process in ranks:
        process.wait()
