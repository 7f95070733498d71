"""Sharded training really run: FSDP2 and DeepSpeed ZeRO-3 (and ZeRO-2) on two CPU processes (gloo), both trainers.

How accelerate is brought to shard on CPU: the runs use the shipped configs (`configs/accelerate/fsdp2.yaml`,
`deepspeed_zero3.yaml`, `deepspeed_zero2.yaml`) with `--num_processes 2 --mixed_precision no`, and the workers call
`trl_aspo.infra.cpu_sharding.enable_cpu_sharding()` (env `TRL_ASPO_CPU_SHARDING=1`) before building the trainer.
accelerate 1.15 alone never shards on CPU: with `use_cpu` its state is `MULTI_CPU` and the FSDP or DeepSpeed plugin
of the launch is dropped (plain data parallelism). The shim changes only that: once accelerate has built its CPU
state (gloo, `MULTI_CPU`), it sets the distributed type to FSDP with the launch's FSDP plugin, or to DEEPSPEED with
its DeepSpeed plugin, as accelerate's GPU branch does. DeepSpeed also runs with `DS_ACCELERATOR=cpu`.

Each sharded run is compared with the same run on one process and under DDP (`configs/accelerate/ddp.yaml`, two
processes): per-round rewards, advantages, tracker and sampler state, full parameters (gathered from shards), the
before/after and during-training held-out evaluations (which must finish on every rank), the saved model loaded
with `from_pretrained`, and an exact resume from a checkpoint saved under sharding. The asynchronous trainer's
rollout worker runs threads whose timing decides which samples fill a step, so its runs are compared with
themselves (ranks, checkpoint, saved model) and its evaluation with an unsharded evaluation of the saved model.

Run by `make test-sharded` (about 3.5 minutes on 2 CPU cores); `make test` leaves this folder out."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS_DIR = Path(__file__).resolve().parents[1]
REPO_ROOT = TESTS_DIR.parent
WORKERS = Path(__file__).resolve().parent / "workers"
CONFIGS = REPO_ROOT / "configs" / "accelerate"
# Launch config, whether the CPU-sharding shim is on, and the accelerate distributed type each run must end up with.
LAUNCHES = {
    "single": (None, False, "DistributedType.NO"),
    "ddp": ("ddp.yaml", False, "DistributedType.MULTI_CPU"),
    "fsdp2": ("fsdp2.yaml", True, "DistributedType.FSDP"),
    "zero3": ("deepspeed_zero3.yaml", True, "DistributedType.DEEPSPEED"),
    "zero2": ("deepspeed_zero2.yaml", True, "DistributedType.DEEPSPEED"),
}
# The same 8 prompts per round on one process (8 x 1) or two (4 x 2).
PER_DEVICE = {"single": 8}
# Synchronous runs besides the SPO++ one: KL-adaptive rho, which needs SPO (per-visit forgetting).
VARIANTS = {"": {}, "-kl": {"advantage_estimator": "spo", "value_rho_mode": "kl"}}

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _require_deepspeed(launch: str) -> None:
    """A ZeRO launch needs DeepSpeed: skipped without it, failed under `make test-sharded`, which installs it."""
    if launch.startswith("zero") and importlib.util.find_spec("deepspeed") is None:
        if os.environ.get("TRL_ASPO_REQUIRE_DEEPSPEED") == "1":
            pytest.fail("DeepSpeed is not installed: `make test-sharded` installs the pinned `deepspeed` extra")
        pytest.skip("DeepSpeed is not installed (`pip install -e .[deepspeed]`, or `make test-sharded`)")


def _launch(worker: str, out_dir: Path, label: str, launch: str, options: dict) -> list[dict]:
    """Run `workers/<worker>` as `launch` (a key of LAUNCHES); the per-rank records it writes."""
    config, shard, _ = LAUNCHES[launch]
    _require_deepspeed(launch)
    script = [str(WORKERS / worker), str(out_dir), label, json.dumps(options)]
    if config is None:
        command, processes = [sys.executable, *script], 1
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(CONFIGS / config),
            "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()), *script,
        ]  # fmt: skip
        processes = 2
    python_path = os.pathsep.join(filter(None, [str(TESTS_DIR), str(WORKERS), os.environ.get("PYTHONPATH")]))
    env = {
        **os.environ,
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": python_path,
        "DS_ACCELERATOR": "cpu",
        "TRL_ASPO_CPU_SHARDING": "1" if shard else "0",
        # A collective some rank never joins dumps every stack and ends the run before the test's timeout.
        "SHARDED_HANG_SECONDS": "240",
    }
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return [json.loads((out_dir / f"{label}-rank{rank}.json").read_text()) for rank in range(processes)]


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("sharded")


@pytest.fixture(scope="module")
def sync_run(out_dir):
    """`sync_run(launch, resume=False)`: the synchronous worker's records, each run launched once per module."""

    @functools.cache
    def run(launch: str, resume: bool = False, variant: str = "") -> list[dict]:
        overrides = {"per_device_train_batch_size": PER_DEVICE.get(launch, 4), **VARIANTS[variant]}
        label = f"{launch}{variant}"
        if not resume:
            return _launch("sync_worker.py", out_dir, label, launch, {"overrides": overrides})
        run(launch, variant=variant)  # the continuous run saves the checkpoint
        checkpoint = str(out_dir / label / "checkpoint-2")
        return _launch(
            "sync_worker.py", out_dir, f"{label}-resume", launch, {"overrides": overrides, "resume": checkpoint}
        )

    return run


@pytest.fixture(scope="module")
def async_run(out_dir):
    @functools.cache
    def run(launch: str, resume: bool = False) -> list[dict]:
        if not resume:
            return _launch("async_worker.py", out_dir, f"async-{launch}", launch, {})
        run(launch)
        checkpoint = str(out_dir / f"async-{launch}" / "checkpoint-2")
        return _launch("async_worker.py", out_dir, f"async-{launch}-resume", launch, {"resume": checkpoint})

    return run


def _without_nan(value):
    """JSON numbers with NaN (an undefined metric, e.g. a first-call position without calls) as None, so that equal
    summaries compare equal."""
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_without_nan(item) for item in value]
    return None if isinstance(value, float) and math.isnan(value) else value


def _saved_parameter_sum(path: Path) -> float:
    """The parameter sum of the model saved at `path`, loaded with `from_pretrained` in this (unsharded) process."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return sum(parameter.detach().double().sum().item() for parameter in model.parameters())


def _round_view(ranks: list[dict]) -> list[tuple[list[float], list[float]]]:
    """Per round: the gathered rewards (the same on every rank) and every rank's advantages in rank order."""
    view = []
    for rounds in zip(*(rank["rounds"] for rank in ranks), strict=True):
        assert all(one["gathered_rewards"] == rounds[0]["gathered_rewards"] for one in rounds)
        view.append((rounds[0]["gathered_rewards"], [value for one in rounds for value in one["local_advantages"]]))
    return view


SYNC_SHARDED = ["fsdp2", "zero3", "zero2"]


@pytest.mark.parametrize("launch", SYNC_SHARDED)
def test_sync_sharded_training_matches_one_process_and_ddp(sync_run, launch):
    """Same gathered rewards, advantages (rank 0's 4 then rank 1's 4 = the one process's 8), tracker, sampler
    weights and final parameters as on one process and under DDP; finite losses and parameters that moved."""
    single, ddp, sharded = sync_run("single")[0], sync_run("ddp"), sync_run(launch)
    assert [rank["distributed_type"] for rank in sharded] == [LAUNCHES[launch][2]] * 2
    assert [rank["world"] for rank in sharded] == [2, 2] and ddp[0]["distributed_type"] == LAUNCHES["ddp"][2]
    assert len(single["rounds"]) == len(sharded[0]["rounds"]) == 3
    for reference in ([single], ddp):
        expected, ours = _round_view(reference), _round_view(sharded)
        assert [rewards for rewards, _ in ours] == [rewards for rewards, _ in expected]
        for (_, advantages), (_, expected_advantages) in zip(ours, expected, strict=True):
            assert advantages == pytest.approx(expected_advantages, abs=1e-5)
    assert any(any(value != 0 for value in rnd["gathered_rewards"]) for rnd in single["rounds"]), "vacuous rewards"
    for rank in sharded:
        assert rank["tracker"] == single["tracker"] == ddp[0]["tracker"]
        assert rank["sampler_weights"] == single["sampler_weights"]
        assert len(rank["losses"]) == 3 and all(math.isfinite(loss) for loss in rank["losses"])
        assert rank["losses"] == pytest.approx(single["losses"], abs=1e-6)
        assert rank["at_begin"]["parameters_sum"] == single["at_begin"]["parameters_sum"]
        assert abs(rank["parameters_sum"] - rank["at_begin"]["parameters_sum"]) > 1.0, "the parameters did not move"
        # Sharded all-reduces and reduce-scatters sum in another order than one process: float32 rounding.
        assert rank["parameters_sum"] == pytest.approx(single["parameters_sum"], rel=1e-6)
        assert rank["parameters_sum"] == pytest.approx(ddp[0]["parameters_sum"], rel=1e-6)
    assert sharded[0]["parameters_sum"] == sharded[1]["parameters_sum"]


@pytest.mark.parametrize("launch", SYNC_SHARDED)
def test_sync_evaluations_finish_on_every_rank_with_the_unsharded_numbers(sync_run, launch):
    """`BeforeAfterReport` (before and after) and `HeldoutDuringTraining` (step 2) run on every rank of the sharded
    model and give the one process's numbers. Before the fix both generated on the main process alone while the
    other rank waited at a barrier: under FSDP2 gloo failed with a collective mismatch, under ZeRO-3 it hung."""
    single, sharded = sync_run("single")[0], sync_run(launch)
    assert [row["step"] for row in single["heldout_rows"]] == [2]
    assert single["report"]["before"]["mean_reward"] > 0, "vacuous evaluation"
    for rank in sharded:
        assert _without_nan(rank["report"]) == _without_nan(single["report"])
        assert _without_nan(rank["heldout_rows"]) == _without_nan(single["heldout_rows"])


@pytest.mark.parametrize("launch", SYNC_SHARDED)
def test_sync_model_saved_under_sharding_loads_with_from_pretrained(sync_run, out_dir, launch):
    sharded = sync_run(launch)
    assert _saved_parameter_sum(out_dir / launch / "final") == pytest.approx(sharded[0]["parameters_sum"], rel=1e-9)


@pytest.mark.parametrize("launch", ["fsdp2", "zero3"])
def test_sync_resume_from_a_sharded_checkpoint_is_exact(sync_run, launch):
    """Resumed at checkpoint-2 (saved under sharding), step 3 gives the continuous run's round, tracker, sampler
    weights and parameters."""
    continuous, resumed = sync_run(launch), sync_run(launch, resume=True)
    for whole, rank in zip(continuous, resumed, strict=True):
        assert len(rank["rounds"]) == 1 and rank["rounds"][0] == whole["rounds"][-1]
        assert rank["tracker"] == whole["tracker"]
        assert rank["sampler_weights"] == whole["sampler_weights"]
        assert rank["parameters_sum"] == whole["parameters_sum"]


def test_async_fsdp2_trains_with_the_local_worker(async_run, out_dir):
    """AsyncASPOTrainer under FSDP2: finite losses, moved parameters equal on both ranks (gathered from shards), the
    tracker on the main process (which scores every rank's samples), the after-training evaluation finishing on
    both ranks with the numbers of an unsharded evaluation of the saved model, which loads with from_pretrained."""
    from helpers import calculator_tokenizer, digit_share_reward

    from trl_aspo.builtin.task import calculator, make_dataset
    from trl_aspo.evaluation.tool_use import evaluate_tool_use

    ranks = async_run("fsdp2")
    assert [rank["distributed_type"] for rank in ranks] == [LAUNCHES["fsdp2"][2]] * 2
    assert ranks[0]["losses"] == ranks[1]["losses"] and len(ranks[0]["losses"]) == 3
    assert all(math.isfinite(loss) for loss in ranks[0]["losses"])
    assert ranks[0]["parameters_sum"] == ranks[1]["parameters_sum"]
    assert abs(ranks[0]["parameters_sum"] - ranks[0]["at_begin"]["parameters_sum"]) > 1.0
    assert sum(ranks[0]["tracker"]["visits"].values()) >= 3 * 2 * 4  # 3 steps of 2 ranks x 4 samples scored
    final = out_dir / "async-fsdp2" / "final"
    assert _saved_parameter_sum(final) == pytest.approx(ranks[0]["parameters_sum"], rel=1e-9)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32)
    unsharded = evaluate_tool_use(
        model,
        calculator_tokenizer(),
        make_dataset("test", 4, seed=1),
        digit_share_reward,
        [calculator],
        temperature=0.0,
        max_completion_length=48,
        max_tool_calls=1,
        seed=3,
        progress=False,
    )
    unsharded.pop("records")
    for rank in ranks:
        assert _without_nan(rank["report"]["after"]) == _without_nan(unsharded)


def test_async_fsdp2_resume_loads_the_sharded_checkpoint(async_run, out_dir):
    """Resumed at checkpoint-2: when training begins the sharded model holds the checkpoint's weights on both ranks
    and the main process's tracker is the checkpoint's; one more step trains."""
    resumed = async_run("fsdp2", resume=True)
    checkpoint = out_dir / "async-fsdp2" / "checkpoint-2"
    saved = json.loads((checkpoint / "aspo_state.json").read_text())["state"]
    expected_sum = _saved_parameter_sum(checkpoint)
    for rank in resumed:
        assert rank["at_begin"]["global_step"] == 2
        assert rank["at_begin"]["parameters_sum"] == pytest.approx(expected_sum, rel=1e-9)
        assert math.isfinite(rank["losses"][-1]) and len(rank["losses"]) == 3
        assert rank["parameters_sum"] != rank["at_begin"]["parameters_sum"]
    assert resumed[0]["at_begin"]["tracker"] == saved["tracker"]


def _leaves(value, path: str = "") -> dict[str, float]:
    """Every number of a nested JSON value by its path (dict keys and list positions), for approximate comparison."""
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _leaves(item, f"{path}/{key}").items()}
    if isinstance(value, list):
        return {k: v for index, item in enumerate(value) for k, v in _leaves(item, f"{path}/{index}").items()}
    return {path: value}


def test_sync_kl_adaptive_rho_under_fsdp2_matches_one_process(sync_run):
    """SPO with KL-adaptive rho under FSDP2: each rank measures the drift of its own completions with the sharded
    model; the gathered visits (completion ids, masks, post-update log-probs), the tracker they update (rho from
    the drift), the rewards and the final parameters are the one process's, up to float32 rounding."""
    single, sharded = sync_run("single", variant="-kl")[0], sync_run("fsdp2", variant="-kl")
    assert [rank["distributed_type"] for rank in sharded] == [LAUNCHES["fsdp2"][2]] * 2
    assert [rewards for rewards, _ in _round_view(sharded)] == [rewards for rewards, _ in _round_view([single])]
    assert 4 <= len(single["visit_store"]) <= 16
    expected_visits, expected_tracker = _leaves(single["visit_store"]), _leaves(single["tracker"])
    for rank in sharded:
        visits, tracker = _leaves(rank["visit_store"]), _leaves(rank["tracker"])
        assert visits.keys() == expected_visits.keys() and tracker.keys() == expected_tracker.keys()
        # Post-update log-probs of a model updated by sharded reductions: float32 rounding (up to 2e-5 seen).
        assert list(visits.values()) == pytest.approx(list(expected_visits.values()), abs=1e-4)
        assert list(tracker.values()) == pytest.approx(list(expected_tracker.values()), abs=1e-4)
        assert rank["parameters_sum"] == pytest.approx(single["parameters_sum"], rel=1e-6)


@pytest.mark.parametrize("launch", ["fsdp2", "zero3"])
def test_the_train_command_shards_on_cpu_processes(tmp_path, launch):
    """`trl-aspo train --accelerate_config <fsdp2|zero3> --num_processes 2 ... --use_cpu true`, as a user types it:
    the command turns the CPU sharding on by itself (accelerate alone would train plain data parallel and say
    nothing), says so, trains, evaluates before and after on every rank (`--evaluate_before_after`), and the saved
    model loads unsharded."""
    config, _, distributed_type = LAUNCHES[launch]
    _require_deepspeed(launch)
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "trl_aspo.cli.main", "train", "--accelerate_config", str(CONFIGS / config),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()),
        "--config", "configs/smoke.yaml", "--use_cpu", "true", "--output_dir", str(output_dir),
        "--evaluate_before_after", "true",
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    assert f"Sharded on 2 CPU processes: {distributed_type}" in result.stdout + result.stderr
    assert math.isfinite(_saved_parameter_sum(output_dir))
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["before"]["num_problems"] == summary["after"]["num_problems"] == 8  # the smoke config's test split
