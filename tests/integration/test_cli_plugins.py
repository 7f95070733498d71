"""`plugins`: a loss registered in the user's own module trains through `trl-aspo train` in both trainers, named
in `plugins` (YAML or flag); without it the name is refused before torch loads with a hint, and a plugin that cannot
be found or raises is named."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import REPO_ROOT

CONFIGS = {"sync": REPO_ROOT / "configs" / "quickstart.yaml", "async": REPO_ROOT / "configs" / "quickstart_async.yaml"}


def train(cwd, *argv) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "trl_aspo.cli.main", "train", *map(str, argv)]
    # A suite started in the background by a non-interactive shell runs with SIGINT ignored, which children inherit
    # (and the Ctrl-C case then never sees its signal): the command gets the default disposition, as in a terminal.
    return subprocess.run(
        command,
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


@pytest.fixture
def user_folder(tmp_path):
    """A working folder holding the user's loss module (the example file, as `my_losses.py`)."""
    shutil.copy(REPO_ROOT / "examples" / "clipped_is_loss.py", tmp_path / "my_losses.py")
    return tmp_path


@pytest.mark.parametrize("trainer", ["sync", "async"])
def test_a_loss_registered_in_a_plugin_trains_through_the_cli(user_folder, trainer):
    """Named in the YAML (the asynchronous run) or by flag (the synchronous one): two steps, the loss's stat logged."""
    config = user_folder / "run.yaml"
    plugins_flag = ()
    if trainer == "async":
        config.write_text(
            CONFIGS[trainer].read_text().replace("loss_type: aspo", "loss_type: clipped_is\nplugins: [my_losses]")
        )
    else:
        config.write_text(CONFIGS[trainer].read_text().replace("loss_type: aspo", "loss_type: clipped_is"))
        plugins_flag = ("--plugins", "my_losses")
    output_dir = user_folder / "out"
    result = train(
        user_folder,
        *("--config", config, *plugins_flag, "--epsilon_high", "5.0", "--max_steps", "2", "--logging_steps", "1"),
        *("--evaluate_before_after", "false", "--plot", "false", "--save_steps", "2", "--output_dir", output_dir),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    logs = json.loads((output_dir / "checkpoint-2" / "trainer_state.json").read_text())["log_history"]
    stats = [log["clipped_is/clipped_mean"] for log in logs if "clipped_is/clipped_mean" in log]
    assert len(stats) == 2 and all(0.0 <= stat <= 1.0 for stat in stats)


def test_a_registered_name_without_its_plugin_and_a_bad_plugin_are_refused_naming_them(user_folder):
    (user_folder / "broken.py").write_text("import math\n\nraise RuntimeError('no GPU here')\n")
    flags = ("--config", CONFIGS["sync"], "--output_dir", user_folder / "out")
    result = train(user_folder, *flags, "--loss_type", "clipped_is")
    assert result.returncode == 2
    line = result.stderr.splitlines()[0]
    assert line.startswith("trl-aspo train: loss_type (command line): 'clipped_is' is not one of ['aspo', ")
    assert line.endswith("] (or a name that a module listed in plugins registers)")

    result = train(
        user_folder, *flags, "--plugins", "my_losses", "no_such_module", "broken", "--loss_type", "clipped_is"
    )
    assert result.returncode == 2
    assert result.stderr.splitlines()[:3] == [
        "trl-aspo train: 2 configuration errors:",
        f"  plugins entry 'no_such_module': No module named 'no_such_module' (a dotted module name, found on the "
        f"Python path or in the working folder {user_folder})",
        f"  plugins entry 'broken': importing it raised RuntimeError: no GPU here ({user_folder / 'broken.py'}, "
        "line 3)",
    ]


@pytest.mark.parametrize(
    ("body", "status", "message"),
    [
        # A plugin exiting 0 made the command exit 0 without training and without a word.
        (
            "import sys\n\nsys.exit(0)\n",
            2,
            "plugins entry 'quitter': importing it raised SystemExit(0) ({path}, line 3); a plugin must only define "
            "and register",
        ),
        (
            "raise KeyboardInterrupt\n",
            2,
            "plugins entry 'quitter': importing it raised KeyboardInterrupt ({path}, line 1); a plugin must only "
            "define and register",
        ),
        # The user's Ctrl-C while the plugin imports (here the plugin sends the SIGINT itself): 130, naming it.
        (
            "import os\nimport signal\nimport time\n\nos.kill(os.getpid(), signal.SIGINT)\ntime.sleep(30)\n",
            130,
            "interrupted (Ctrl-C) while importing plugins entry 'quitter'",
        ),
    ],
    ids=["sys.exit(0)", "raised KeyboardInterrupt", "Ctrl-C"],
)
def test_a_plugin_that_exits_or_is_interrupted_is_named(user_folder, body, status, message):
    """Issue 45 item 7: any BaseException of a plugin's import is a configuration error naming it; only the user's
    Ctrl-C stops the command, with status 130."""
    path = user_folder / "quitter.py"
    path.write_text(body)
    result = train(user_folder, "--config", CONFIGS["sync"], "--plugins", "quitter", "--output_dir", user_folder / "o")
    assert result.returncode == status, result.stderr[-3000:]
    assert message.format(path=path) in result.stderr
