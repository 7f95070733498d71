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

Those runs are on-policy (ratio 1), where the aspo loss equals TRL's. Two off-policy runs (FSDP2, ZeRO-3: each round
trained twice, tokens in every clip region) are checked step by step against an SGD update recomputed here from the
loss's equations on the micro-batches each rank trained.

Each run is watched for progress (`_run_watched`), not timed as a whole: it fails when no rank has made progress
for QUIET_SECONDS, with every rank's stacks.

Run by `make test-sharded` (about 3.5 minutes on 2 CPU cores); `make test` leaves this folder out."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
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

# A run fails when no rank has shown progress for this long (a completed micro-batch, step, log, checkpoint or stage
# of the worker, or any output): long enough for one stage of a ZeRO-3 run on a machine loaded 6 times over its cores
# (docs/many_gpus.md), short enough that a collective some rank never joins fails the test within minutes.
QUIET_SECONDS = 240

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


@functools.cache
def _build_deepspeed_op() -> None:
    """Build DeepSpeed's CPU communication op (`deepspeed_shm_comm`) once, before the first ZeRO run: a new install
    compiles it in the run's first collective setup, which took 58 s on a quiet machine and 235 s at load average
    13 on 2 cores, without a line of output, longer than a run may stay silent (QUIET_SECONDS). The ranks then load
    it from the same `TORCH_EXTENSIONS_DIR`."""
    code = "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]


def _launch(worker: str, out_dir: Path, label: str, launch: str, options: dict) -> list[dict]:
    """Run `workers/<worker>` as `launch` (a key of LAUNCHES); the per-rank records it writes."""
    config, shard, _ = LAUNCHES[launch]
    _require_deepspeed(launch)
    if launch.startswith("zero"):
        _build_deepspeed_op()
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
    }
    _run_watched(command, env, out_dir, label, processes)
    return [json.loads((out_dir / f"{label}-rank{rank}.json").read_text()) for rank in range(processes)]


def _run_watched(command: list[str], env: dict, out_dir: Path, label: str, processes: int) -> None:
    """Run `command` until it ends, or until neither its output nor any rank's progress file
    (`workers/progress.py`) has changed for QUIET_SECONDS: then every rank is asked for its stacks (SIGUSR1, into
    `LABEL-rank<k>.stacks`, all at the same moment) and the run is killed. A failure shows each rank's last
    progress and stacks in full, then the ends of the output."""
    stdout_path, stderr_path = out_dir / f"{label}.stdout", out_dir / f"{label}.stderr"
    progress = [out_dir / f"{label}-rank{rank}.progress" for rank in range(processes)]
    stacks = [out_dir / f"{label}-rank{rank}.stacks" for rank in range(processes)]
    started = time.time()
    with open(stdout_path, "w") as stdout, open(stderr_path, "w") as stderr:
        # Its own session, so that the launcher and every rank can be killed together.
        process = subprocess.Popen(
            command, stdout=stdout, stderr=stderr, env=env, cwd=REPO_ROOT, start_new_session=True
        )
        stalled = None
        while process.poll() is None:
            time.sleep(1.0)
            signs = [path.stat().st_mtime for path in [stdout_path, stderr_path, *progress] if path.exists()]
            quiet = time.time() - max([started, *signs])
            if quiet > QUIET_SECONDS:
                stalled = f"no progress on any rank for {quiet:.0f} s (after {time.time() - started:.0f} s)"
                for path in progress:
                    # A rank that has already ended has nothing to tell.
                    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                        os.kill(int(path.read_text().split()[0]), signal.SIGUSR1)
                # Written by faulthandler's signal handler, in C, even while the rank blocks in a collective.
                deadline = time.time() + 5.0
                while time.time() < deadline and not all(path.exists() and path.stat().st_size for path in stacks):
                    time.sleep(0.2)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    if stalled is None and process.returncode == 0:
        return
    report = [stalled or f"exit status {process.returncode}"]
    for rank, (progress_path, stacks_path) in enumerate(zip(progress, stacks, strict=True)):
        lines = progress_path.read_text().splitlines()[1:] if progress_path.exists() else []
        report.append(f"--- rank {rank}: last progress {lines[-5:]}")
        if stacks_path.exists() and stacks_path.stat().st_size:
            report.append(f"--- rank {rank} stacks:\n{stacks_path.read_text()}")
    report.append(f"--- stdout (end):\n{stdout_path.read_text()[-3000:]}")
    report.append(f"--- stderr (end):\n{stderr_path.read_text()[-6000:]}")
    pytest.fail("\n".join(report), pytrace=False)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This process's own model work (loads, the unsharded evaluation, the recomputed updates) on one intra-op
    thread, as the ranks (`OMP_NUM_THREADS=1`): at load average 9 on 2 cores, a forward and backward of the tiny
    model on a micro-batch took 2.8 s with torch's default 2 threads and 0.11 s with 1."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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
    if launch.startswith("zero"):
        _build_deepspeed_op()
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "trl_aspo.cli.main", "train", "--accelerate_config", str(CONFIGS / config),
        "--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(_free_port()),
        "--config", "configs/smoke.yaml", "--use_cpu", "true", "--output_dir", str(output_dir),
        "--evaluate_before_after", "true",
    ]  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    # The command's ranks keep no progress files: its output is the only sign of progress the watchdog reads.
    _run_watched(command, env, tmp_path, "train", processes=0)
    output = (tmp_path / "train.stdout").read_text() + (tmp_path / "train.stderr").read_text()
    assert f"Sharded on 2 CPU processes: {distributed_type}" in output
    assert math.isfinite(_saved_parameter_sum(output_dir))
    summary = json.loads((output_dir / "summary.json").read_text())
    assert summary["before"]["num_problems"] == summary["after"]["num_problems"] == 8  # the smoke config's test split


# The off-policy runs: each round (2 prompts per micro-batch x 2 micro-batches x 2 ranks) is trained twice
# (num_iterations=2), so steps 2 and 4 train on completions of the policy before steps 1 and 3. Plain SGD at a large
# rate moves the log-probs far in one step, and small clip offsets and dual-clip constant put tokens of the second
# passes in every clip region; no gradient clipping, constant rate, no KL term.
OFF_POLICY = dict(
    per_device_train_batch_size=2,
    gradient_accumulation_steps=2,
    steps_per_generation=2,
    num_iterations=2,
    max_steps=4,
    save_strategy="no",
    optim="sgd",
    lr_scheduler_type="constant",
    learning_rate=2.0,
    max_grad_norm=0.0,
    beta=0.0,
    epsilon=0.01,
    epsilon_high=0.01,
    aspo_dual_clip_pos=1.03,
    aspo_dual_clip_neg=1.005,
)
# The aspo loss's regions (docs/asymmetric_loss.md) and the `aspo/*_frac` metric that counts each ("flipped" counts
# every positive-advantage token; the standard-PPO region of negative tokens has no metric).
REGION_METRICS = {
    "flipped": "aspo/flipped_frac",
    "hard_clip_pos": "aspo/hard_clip_pos_frac",
    "dual_clip_pos": "aspo/dual_clip_pos_frac",
    "ppo_neg": None,
    "hard_clip_neg": "aspo/hard_clip_neg_frac",
    "dual_clip_neg": "aspo/dual_clip_neg_frac",
}


def _completion_logps(model, batch: dict) -> torch.Tensor:
    """(B, T) log-probs of the completion tokens under `model` from one plain forward of prompt and completion
    (temperature 1: the run's default; top_k shapes only the sampling)."""
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    length = batch["completion_ids"].size(1)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, -length - 1 : -1]
    return logits.log_softmax(-1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)


def _aspo_weights(ratio, advantages, fields: dict, flip: bool = True):
    """The table of docs/asymmetric_loss.md read off directly: each token's region and its weight w in
    d loss / d lp = -A * w (flipped 1/r, hard-clipped 0, dual-clipped C, negative r), with the offsets and the
    dual-clip constants of `fields` (one for each sign). `flip=False` gives the flipped region PPO's weight r
    instead: the loss without its asymmetry, which the test must tell apart."""
    eps_low, eps_high = fields["epsilon"], fields["epsilon_high"]
    dual_pos, dual_neg = fields["aspo_dual_clip_pos"], fields["aspo_dual_clip_neg"]
    a = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1)).expand_as(ratio)
    pos, neg = a > 0, a < 0
    regions = {
        "flipped": pos & (ratio >= 1 / dual_pos) & (ratio <= 1 + eps_high),
        "hard_clip_pos": pos & (ratio > 1 + eps_high),
        "dual_clip_pos": pos & (ratio < 1 / dual_pos),
        "ppo_neg": neg & (ratio >= 1 - eps_low) & (ratio <= dual_neg),
        "hard_clip_neg": neg & (ratio < 1 - eps_low),
        "dual_clip_neg": neg & (ratio > dual_neg),
    }
    zero = torch.zeros_like(ratio)
    weight = (
        torch.where(regions["flipped"], 1 / ratio if flip else ratio, zero)
        + torch.where(regions["dual_clip_pos"], dual_pos, zero)
        + torch.where(regions["dual_clip_neg"], dual_neg, zero)
        + torch.where(regions["ppo_neg"], ratio, zero)
    )
    return a, weight, regions


def _reference_step(model, parameters: dict, rank_batches: list[list[dict]], fields: dict, flip: bool = True):
    """One optimizer step recomputed from `parameters` on the micro-batches each rank trained: per rank, the token
    gradient -A * w / normalizer pushed through the log-probs of each micro-batch and summed (gradient
    accumulation), with TRL's dapo normalizer (the generation batch's action tokens `num_items_in_batch`, gathered
    over ranks, per rank and per accumulation window); the ranks' gradients averaged (data parallel); one plain SGD
    step. Returns the expected update (name -> tensor) and the action tokens of each region (with |log r|)."""
    world = len(rank_batches)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(parameters[name])
    model.zero_grad()
    found = {name: [] for name in REGION_METRICS}
    for batches in rank_batches:
        for batch in batches:
            logps = _completion_logps(model, batch)
            mask = batch["completion_mask"] * batch.get("tool_mask", 1)
            ratio = torch.exp((logps.detach() - batch["old_per_token_logps"]).clamp(-20, 20))
            advantages, weight, regions = _aspo_weights(ratio, batch["advantages"], fields, flip)
            normalizer = (
                batch["num_items_in_batch"]
                / world
                * fields["gradient_accumulation_steps"]
                / fields["steps_per_generation"]
            )
            logps.backward(-advantages * weight * mask / normalizer)
            for name, region in regions.items():
                found[name].append(ratio[region & mask.bool()].log().abs())
    update = {name: -fields["learning_rate"] * parameter.grad / world for name, parameter in model.named_parameters()}
    return update, {name: torch.cat(values) for name, values in found.items()}


def test_the_watchdog_fails_a_stalled_run_with_every_rank_stacks(tmp_path, monkeypatch):
    """A run whose ranks stop making progress is killed once it has been quiet for QUIET_SECONDS (3 s here), and
    the failure shows each rank's last progress and its stacks, both naming where the rank waits."""
    monkeypatch.setattr(sys.modules[__name__], "QUIET_SECONDS", 3)
    env = {**os.environ, "PYTHONPATH": str(WORKERS)}
    command = [sys.executable, str(WORKERS / "stalling_launcher.py"), str(tmp_path), "stall"]
    started = time.time()
    with pytest.raises(pytest.fail.Exception) as failure:
        _run_watched(command, env, tmp_path, "stall", processes=2)
    assert time.time() - started < 60
    message = str(failure.value)
    assert message.startswith("no progress on any rank for")
    for rank in (0, 1):
        assert f"--- rank {rank}: last progress ['0.0 started', " in message
        stacks = message.split(f"--- rank {rank} stacks:")[1].split("--- ")[0]
        assert "waits_in_a_collective_never_joined" in stacks


def _relative_error(observed: dict, expected: dict) -> float:
    """|observed - expected| / |expected| over every parameter (the updates of one step, name -> tensor)."""
    difference = torch.cat([(observed[name] - expected[name]).flatten() for name in expected])
    return (difference.norm() / torch.cat([tensor.flatten() for tensor in expected.values()]).norm()).item()


@pytest.mark.parametrize("launch", ["fsdp2", "zero3"])
def test_offpolicy_aspo_steps_under_sharding_are_the_equations_update(out_dir, launch):
    """Off-policy aspo under FSDP2 and ZeRO-3: after every optimizer step the gathered parameters are the previous
    ones plus an SGD step recomputed here on the micro-batches each rank trained, with the gradient written from the
    table of docs/asymmetric_loss.md (not the project's loss), within 1e-3 of the update's norm (float32 rounding
    left 2e-5 to 5.5e-5). The second passes hold tokens in every region (the logged `aspo/*_frac` too), and the
    check can see the flip: with PPO's weight r in the flipped region instead of 1/r the same comparison is off by
    more than 3e-3 (3.9e-3 here); a loss scaled by 0.5 would be off by 0.5."""
    from helpers import MODEL
    from transformers import AutoModelForCausalLM

    label = f"offpolicy-{launch}"
    ranks = _launch("offpolicy_worker.py", out_dir, label, launch, {"overrides": OFF_POLICY})
    assert [rank["distributed_type"] for rank in ranks] == [LAUNCHES[launch][2]] * 2
    snapshots = torch.load(out_dir / f"{label}-parameters.pt")
    batches = [torch.load(out_dir / f"{label}-rank{rank}-batches.pt") for rank in range(2)]
    assert len(snapshots) == OFF_POLICY["max_steps"] + 1
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    second_passes = {name: [] for name in REGION_METRICS}
    unflipped_errors = []
    for step in range(OFF_POLICY["max_steps"]):
        trained = [[batch for batch in rank if batch["step"] == step] for rank in batches]
        assert [len(rank) for rank in trained] == [OFF_POLICY["gradient_accumulation_steps"]] * 2
        observed = {name: snapshots[step + 1][name] - snapshots[step][name] for name in snapshots[0]}
        update, regions = _reference_step(model, snapshots[step], trained, OFF_POLICY)
        assert _relative_error(observed, update) < 1e-3, f"step {step + 1}"
        unflipped, _ = _reference_step(model, snapshots[step], trained, OFF_POLICY, flip=False)
        unflipped_errors.append(_relative_error(observed, unflipped))
        if step % OFF_POLICY["num_iterations"] == 0:
            # A round's first pass: the policy that generated it, so every ratio is 1 and the flipped weight too.
            assert all(tokens.max() < 1e-4 for tokens in regions.values() if len(tokens))
        else:
            for name, tokens in regions.items():
                second_passes[name].append(tokens)
    for name, metric in REGION_METRICS.items():
        tokens = torch.cat(second_passes[name])
        assert len(tokens) > 0, f"no token in the region {name}"
        if metric is not None:
            assert max(row.get(metric, 0.0) for row in ranks[0]["log_history"]) > 0, metric
    # The flipped tokens moved (their weight 1/r is not PPO's r), and some moved far past every clip boundary.
    assert torch.cat(second_passes["flipped"]).max() > 1e-3
    assert torch.cat(second_passes["hard_clip_pos"]).max() > 1.0
    assert max(unflipped_errors) > 3e-3


def test_a_nan_loss_on_one_rank_under_zero2_stops_every_rank_before_the_backward_pass(tmp_path):
    """DeepSpeed steps its optimizer inside the backward pass, so the loss is checked before it, the flag summed over
    ranks (issue 43 item 4): rank 1's NaN loss alone stops both ranks at step 1, naming it, with no checkpoint
    written; the run ends (no rank waits in a collective the other left)."""
    _require_deepspeed("zero2")
    _build_deepspeed_op()
    output_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "trl_aspo.cli.main", "train", "--accelerate_config",
        str(CONFIGS / "deepspeed_zero2.yaml"), "--num_processes", "2", "--mixed_precision", "no",
        "--main_process_port", str(_free_port()), "--config", "configs/smoke.yaml", "--use_cpu", "true",
        "--output_dir", str(output_dir), "--evaluate_before_after", "false", "--plot", "false",
        "--plugins", "nonfinite_losses", "--loss_type", "nan_on_rank_1", "--save_strategy", "steps",
        "--save_steps", "1", "--skip_nonfinite_grad_steps", "false",
    ]  # fmt: skip
    python_path = os.pathsep.join(
        filter(None, [str(TESTS_DIR / "integration" / "workers"), os.environ.get("PYTHONPATH")])
    )
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, cwd=REPO_ROOT, env={**env, "PYTHONPATH": python_path}
    )
    assert result.returncode != 0
    assert "Optimizer step 1 (checked before DeepSpeed's backward pass, which steps the optimizer)" in result.stderr
    assert "rank 1: loss nan (in the policy loss (loss_type='nan_on_rank_1'))" in result.stderr, result.stderr[-3000:]
    assert not any(path.name.startswith("checkpoint-") for path in output_dir.glob("*"))
