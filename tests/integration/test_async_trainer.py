"""AsyncASPOTrainer on the local rollout worker (CPU): drop-in equivalence, single-stream scoring, the aspo loss."""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import (
    MODEL,
    base_fields,
    calculator_tokenizer,
    losses,
    parameters,
    scripted_samples,
    scripted_trainer,
    trainer_with_local_worker,
)

from trl_aspo.builtin.task import correctness_reward, make_dataset
from trl_aspo.infra import NoOpWeightTransfer, ReplayRolloutWorker, install_cpu_fallbacks


@pytest.fixture(scope="module")
def tokenizer():
    return calculator_tokenizer()


def make_trainer(trainer_class, args, tokenizer, jitter_s=0.0):
    from helpers import digit_share_reward

    dataset = make_dataset("train", 32, seed=0)
    reward_funcs = [correctness_reward, digit_share_reward]
    return trainer_with_local_worker(trainer_class, args, tokenizer, dataset, reward_funcs, jitter_s=jitter_s)


def test_everything_off_computes_what_async_grpo_computes(tmp_path, tokenizer):
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)])  # one version per step
    runs = []
    for trainer_class, config_class in ((AsyncGRPOTrainer, AsyncGRPOConfig), (AsyncASPOTrainer, AsyncASPOConfig)):
        trainer = scripted_trainer(
            trainer_class, config_class(**base_fields(tmp_path, max_steps=3)), tokenizer, samples
        )
        trainer.train()
        runs.append((losses(trainer), parameters(trainer.model)))
    (plain_losses, plain_parameters), (aspo_losses, aspo_parameters) = runs
    assert len(plain_losses) == 3 and all(loss != 0 for loss in plain_losses)
    assert aspo_losses == plain_losses
    for name, value in plain_parameters.items():
        torch.testing.assert_close(aspo_parameters[name], value, rtol=0, atol=0, msg=name)


def test_single_completion_spo_plus_plus_with_aspo_loss_and_shaping_trains(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=3, num_generations=1),
        advantage_estimator="spo++",
        loss_type="aspo",
        tool_shaping=True,
        value_reward_range=[0.0, 2.0],  # correctness + digit share
    )
    trainer = make_trainer(AsyncASPOTrainer, args, tokenizer, jitter_s=0.05)
    scored, trained = [], []
    score_step, compute_loss = trainer._score_step, trainer.compute_loss

    def recording_score_step(samples, context=()):
        advantages = score_step(samples, context)
        scored.append(advantages)
        return advantages

    def recording_compute_loss(model, inputs, *args, **kwargs):
        selected = inputs["token_index"] >= 0
        trained.append(inputs["advantages"][selected].detach().clone())
        return compute_loss(model, inputs, *args, **kwargs)

    trainer._score_step, trainer.compute_loss = recording_score_step, recording_compute_loss
    before = parameters(trainer.model)
    trainer.train()

    assert any(bool((step != 0).any()) for step in scored)  # one completion per prompt, yet a signal
    assert all(step.numel() == 4 for step in scored)  # one optimizer step's samples at a time
    # Each trained token carries its sample's scored advantage (float32 in the packed batch).
    scored_values = torch.cat(scored).float()
    for step in trained:
        assert bool(torch.isclose(step.unsqueeze(1), scored_values.unsqueeze(0), atol=1e-6).any(1).all())
    assert any(not torch.equal(value, before[name]) for name, value in parameters(trainer.model).items())
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(math.isfinite(log["loss"]) for log in logs)
    for key in ("aspo/flipped_frac", "aspo/flip_weight_mean", "value/mean", "zero_advantage_share", "policy_loss"):
        assert key in logs[0]
    assert trainer._values.tracker.num_tracked > 0


def test_trainer_refuses_a_plain_async_grpo_config(tmp_path, tokenizer):
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_aspo import AsyncASPOTrainer

    with pytest.raises(TypeError, match="AsyncASPOTrainer needs an AsyncASPOConfig as `args`, got AsyncGRPOConfig"):
        AsyncASPOTrainer(MODEL, reward_funcs=correctness_reward, args=AsyncGRPOConfig(**base_fields(tmp_path)))


def test_event_time_advantages_of_out_of_order_stale_samples(tmp_path, tokenizer):
    """Samples of three prompts arrive with versions out of order; each step's advantages are R - v(x, z) from the
    outcomes of earlier steps with z_i < z (written out below), normalized under the action-token measure."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    versions = [1, 0, 1, 0, 2, 0, 1, 2, 3, 1, 2, 3, 3, 4, 2, 4]
    rows = [0, 1, 0, 2, 0, 1, 2, 1, 0, 0, 2, 1, 2, 0, 1, 2]
    samples = scripted_samples(tokenizer, versions, prompt_rows=rows)
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=3, num_generations=1, max_staleness=10),
        advantage_estimator="spo++",
        value_rho=0.5,
    )
    trainer = scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples)
    scored = []
    score_step = trainer._score_step

    def recording_score_step(step_samples, context=()):
        scored.append((list(step_samples), score_step(step_samples, context)))
        return scored[-1][1]

    trainer._score_step = recording_score_step
    trainer.train()

    index_of = {id(sample): index for index, sample in enumerate(samples)}
    assert [index_of[id(sample)] for step, _ in scored for sample in step] == list(range(4 * len(scored)))
    seen, entry = {}, {}  # row -> [(z, R)] observed in earlier steps; row -> earliest version scored
    for step, advantages in scored:
        for sample, row in zip(step, (rows[index_of[id(s)]] for s in step), strict=True):
            entry[row] = min(entry.get(row, sample.model_version), sample.model_version)
        raw = []
        for sample in step:
            row, z = rows[index_of[id(sample)]], sample.model_version
            visible = [(zi, r) for zi, r in seen.get(row, []) if zi < z]
            alpha = 0.5 ** (z - entry[row]) * 0.5 + sum(0.5 ** (z - zi) * r for zi, r in visible)
            beta = 0.5 ** (z - entry[row]) * 0.5 + sum(0.5 ** (z - zi) * (1 - r) for zi, r in visible)
            raw.append(sample.metrics["reward"] - alpha / (alpha + beta))
        for sample in step:
            seen.setdefault(rows[index_of[id(sample)]], []).append((sample.model_version, sample.metrics["reward"]))
        counts = [int(sample.completion_mask.sum()) for sample in step]
        mu = sum(c * a for c, a in zip(counts, raw, strict=True)) / sum(counts)
        sigma = (sum(c * (a - mu) ** 2 for c, a in zip(counts, raw, strict=True)) / (sum(counts) - 1)) ** 0.5
        expected = torch.tensor([(a - mu) / (sigma + 1e-8) for a in raw], dtype=torch.float64)
        torch.testing.assert_close(advantages, expected, rtol=0, atol=1e-9)
    assert len(scored) >= 3


def test_resume_continues_with_the_saved_tracker(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.trainers.checkpoint_state import load_checkpoint_state

    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)], prompt_rows=[i % 5 for i in range(24)])

    def config(max_steps):
        fields = base_fields(tmp_path, max_steps=max_steps, num_generations=1, save_strategy="steps", save_steps=2)
        return AsyncASPOConfig(**fields, advantage_estimator="spo++")

    first = scripted_trainer(AsyncASPOTrainer, config(2), tokenizer, samples)
    before_scoring = []
    first_score_step = first._score_step
    first._score_step = lambda step, context=(): (
        before_scoring.append(first._values.tracker.state_dict()) or first_score_step(step, context)
    )
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    saved = load_checkpoint_state(str(checkpoint))["tracker"]
    # The data loader scored a third step ahead of training; the checkpoint holds the tracker of the two trained.
    assert len(before_scoring) == 3 and sum(first._values.tracker.state_dict()["visits"].values()) == 12
    assert saved == before_scoring[2] and sum(saved["visits"].values()) == 8 and len(saved["prior"]) == 5

    # The resumed stream starts at the untrained third step (as the worker regenerates it from its first prompt).
    resumed = scripted_trainer(AsyncASPOTrainer, config(3), tokenizer, samples[8:])
    at_first_score = []
    score_step = resumed._score_step

    def recording_score_step(step_samples, context=()):
        if not at_first_score:
            at_first_score.append(resumed._values.tracker.state_dict())
        return score_step(step_samples, context)

    resumed._score_step = recording_score_step
    resumed.train(resume_from_checkpoint=str(checkpoint))
    assert at_first_score == [saved]
    assert resumed._values.tracker.visits(["unused"]).tolist() == [0]
    assert sum(resumed._values.tracker.state_dict()["visits"].values()) > sum(saved["visits"].values())


def test_resume_without_tracker_state_is_refused(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    samples = scripted_samples(tokenizer, [index // 4 for index in range(16)])
    plain = base_fields(tmp_path, max_steps=2, save_strategy="steps", save_steps=2)
    scripted_trainer(AsyncASPOTrainer, AsyncASPOConfig(**plain), tokenizer, samples).train()
    fields = base_fields(tmp_path, max_steps=3, num_generations=1)
    resumed = scripted_trainer(
        AsyncASPOTrainer, AsyncASPOConfig(**fields, advantage_estimator="spo++"), tokenizer, samples
    )
    with pytest.raises(ValueError, match="checkpoint-2 holds no trl-aspo state .* advantage_estimator='spo\\+\\+'"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))


def test_resume_policy_is_the_synchronous_trainers(tmp_path, tokenizer):
    """The async trainer resumes under the same rules as ASPOTrainer (trl_aspo.trainers.project_state): a changed
    estimator is refused naming both values unless `value_reset_on_resume`, which starts a fresh tracker on purpose."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)], prompt_rows=[i % 5 for i in range(24)])

    def config(**overrides):
        fields = base_fields(tmp_path, num_generations=1, save_strategy="steps", save_steps=2)
        return AsyncASPOConfig(**{**fields, "advantage_estimator": "spo++", **overrides})

    scripted_trainer(AsyncASPOTrainer, config(max_steps=2), tokenizer, samples).train()
    checkpoint = str(tmp_path / "out" / "checkpoint-2")

    changed = scripted_trainer(AsyncASPOTrainer, config(max_steps=3, advantage_estimator="spo"), tokenizer, samples)
    with pytest.raises(
        ValueError, match=r"advantage_estimator='spo', but the checkpoint was trained with .*'spo\+\+'"
    ):
        changed.train(resume_from_checkpoint=checkpoint)

    reset = config(max_steps=3, advantage_estimator="spo", value_reset_on_resume=True)
    fresh = scripted_trainer(AsyncASPOTrainer, reset, tokenizer, samples[12:])
    at_first_score = []
    score_step = fresh._score_step
    fresh._score_step = lambda step, context=(): (
        at_first_score.append(fresh._values.tracker.num_tracked) or score_step(step, context)
    )
    fresh.train(resume_from_checkpoint=checkpoint)
    assert at_first_score[0] == 0 and fresh._values.tracker.num_tracked > 0


def test_progressive_flip_threshold_decays_over_optimizer_steps(tmp_path, tokenizer, monkeypatch):
    """`aspo_flip_threshold_start` / `aspo_flip_decay_steps` act in the packed loss as in ASPOTrainer: the threshold
    falls linearly from 0.4 at step 0 to 0 at step 2."""
    import trl_aspo.algorithms.aspo_policy_loss as async_trainer
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.algorithms.losses import asymmetric_policy_loss

    thresholds = []

    def spy(*args, flip_threshold=0.0, **kwargs):
        thresholds.append(flip_threshold)
        return asymmetric_policy_loss(*args, flip_threshold=flip_threshold, **kwargs)

    monkeypatch.setattr(async_trainer, "asymmetric_policy_loss", spy)
    samples = scripted_samples(tokenizer, [index // 4 for index in range(16)], prompt_rows=[i % 5 for i in range(16)])
    fields = base_fields(tmp_path, max_steps=3, num_generations=1)
    args = AsyncASPOConfig(
        **fields,
        advantage_estimator="spo++",
        loss_type="aspo",
        aspo_flip_threshold_start=0.4,
        aspo_flip_decay_steps=2,
    )
    scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples).train()
    assert thresholds == pytest.approx([0.4, 0.2, 0.0])


def test_tool_shaping_correct_reward_must_name_a_scored_function(tmp_path, tokenizer):
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    samples = scripted_samples(tokenizer, [0] * 8)
    for sample in samples:
        sample.metrics["rewards/correctness_reward"] = sample.metrics["reward"]
    fields = base_fields(tmp_path, max_steps=1, num_generations=1)
    args = AsyncASPOConfig(
        **fields, advantage_estimator="spo++", tool_shaping=True, tool_shaping_correct_reward="accuracy"
    )
    with pytest.raises(
        ValueError, match=r"tool_shaping_correct_reward='accuracy' names no .*\['correctness_reward'\]"
    ):
        scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples).train()


def test_per_completion_loss_options_in_the_packed_loss(tmp_path, tokenizer, monkeypatch):
    """Sequence aggregation, the per-completion entropy split and the unflipped share act on the packed batch's
    samples (`segment_id`), checked against a per-sample recomputation from the flat packed targets."""
    import trl_aspo.algorithms.aspo_policy_loss as async_trainer
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.algorithms.losses import asymmetric_policy_loss, entropy_split_mask

    calls = []

    def loss_spy(*args, **kwargs):
        per_token_loss, stats = asymmetric_policy_loss(*args, **kwargs)
        calls.append({"args": args, "kwargs": kwargs, "per_token_loss": per_token_loss.detach()})
        return per_token_loss, stats

    def split_spy(entropies, mask, quantile):
        calls_split.append((entropies, mask, quantile))
        return entropy_split_mask(entropies, mask, quantile)

    calls_split = []
    monkeypatch.setattr(async_trainer, "asymmetric_policy_loss", loss_spy)
    monkeypatch.setattr(async_trainer, "entropy_split_mask", split_spy)
    samples = scripted_samples(tokenizer, [0] * 12, groups_of=1, prompt_rows=list(range(12)))
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=2, num_generations=1),
        advantage_estimator="spo++",
        loss_type="aspo",
        aspo_aggregation="sequence",
        aspo_entropy_quantile=0.5,
        aspo_unflipped_fraction=0.5,
    )
    trainer = scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples)
    batches, returned = [], []
    compute_loss = trainer.compute_loss

    def recording_compute_loss(model, inputs, *rest, **kwargs):
        batches.append({key: value.detach().clone() for key, value in inputs.items() if torch.is_tensor(value)})
        loss = compute_loss(model, inputs, *rest, **kwargs)
        returned.append(loss.detach())
        return loss

    trainer.compute_loss = recording_compute_loss
    trainer.train()

    assert len(calls) == len(batches) == 2 and len(calls_split) == 2
    assert max(int((call["args"][2][:, 0] > 0).sum()) for call in calls) >= 2, "the unflipped draw would be vacuous"
    for call, batch, loss, (entropies, mask, _) in zip(calls, batches, returned, calls_split, strict=True):
        selected = batch["token_index"] >= 0
        segment_id = batch["segment_id"][selected].tolist()
        flat_old = batch["old_log_probs"][selected]
        flat_advantages = batch["advantages"][selected]
        old_rows, advantage_rows = call["args"][1], call["args"][2]
        per_token_loss = call["per_token_loss"]
        sample_means = []
        for sample in sorted(set(segment_id)):
            targets = [m for m, s in enumerate(segment_id) if s == sample]
            count = len(targets)
            torch.testing.assert_close(old_rows[sample, :count], flat_old[targets])
            torch.testing.assert_close(advantage_rows[sample, :count], flat_advantages[targets])
            assert bool(mask[sample, :count].all()) and not bool(mask[sample, count:].any())
            # Entropy split: strictly above the sample's own median (torch.quantile, linear interpolation).
            own = entropies[sample, :count]
            expected_high = own > torch.quantile(own.float(), 0.5)
            assert call["kwargs"]["high_entropy_mask"][sample, :count].tolist() == expected_high.tolist()
            sample_means.append(per_token_loss[sample, :count].sum() / count)
        # Sequence aggregation: the mean over samples of each sample's token mean (one accumulation step).
        torch.testing.assert_close(loss, torch.stack(sample_means).mean().to(loss.dtype))
        positives = int((advantage_rows[:, 0] > 0).sum())
        unflipped = call["kwargs"]["unflipped_mask"]
        assert int(unflipped.sum()) == round(0.5 * positives)
        assert bool((advantage_rows[:, 0][unflipped] > 0).all())


def test_zero_variance_groups_are_dropped_before_they_fill_a_step(tmp_path, tokenizer):
    """Async `filter_zero_variance_groups`: samples of all-equal groups (the worker's `reward_std` is 0) never reach
    a step, which fills with informative samples instead, and their groups count as consumed."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    samples = scripted_samples(tokenizer, [0] * 24, groups_of=2)  # groups 0..11, two samples each; spare read-ahead
    for sample in samples:
        if sample.group_id in (1, 4):
            sample.metrics["reward_std"] = 0.0
    args = AsyncASPOConfig(**base_fields(tmp_path, max_steps=2), filter_zero_variance_groups=True)
    trainer = scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples)
    scored, shares = [], []
    score_step = trainer._score_step

    def recording_score_step(step, context=()):
        scored.append([sample.group_id for sample in step])
        shares.append(trainer._metrics["train"]["filter/zero_variance_dropped_share"][-1])  # this step's share
        return score_step(step, context)

    trainer._score_step = recording_score_step
    trainer.train()
    assert scored[:2] == [[0, 0, 2, 2], [3, 3, 5, 5]]
    assert shares[:2] == pytest.approx([2 / 6, 2 / 6])  # each step: 2 dropped of the 6 samples taken
    assert {1, 4} <= trainer._trained_groups


def resuming_async_grpo_trainer():
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    from trl_aspo.trainers import LocalWorkerResumeMixin

    class ResumingAsyncGRPOTrainer(LocalWorkerResumeMixin, AsyncGRPOTrainer):
        pass

    return ResumingAsyncGRPOTrainer


@pytest.mark.slow
@pytest.mark.parametrize("trainer_name", ["AsyncASPOTrainer", "AsyncGRPOTrainer with LocalWorkerResumeMixin"])
def test_local_worker_resumes_at_the_first_untrained_prompt(tmp_path, tokenizer, trainer_name):
    """Save at step 2 of a 3-step run, resume from it: the resumed local worker's groups are the prompts the
    uninterrupted run generated from the checkpoint's first untrained group on, and model versions count on."""
    import json

    from trl.experimental.async_grpo import AsyncGRPOConfig

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    def run(resume_from_checkpoint=None):
        fields = base_fields(tmp_path, max_steps=3, num_generations=1, save_strategy="steps", save_steps=2)
        if trainer_name == "AsyncASPOTrainer":
            args = AsyncASPOConfig(**fields, advantage_estimator="spo++", value_reward_range=[0.0, 2.0])
            trainer = make_trainer(AsyncASPOTrainer, args, tokenizer)
        else:
            fields["num_generations"] = 2  # TRL's group z-score
            trainer = make_trainer(resuming_async_grpo_trainer(), AsyncGRPOConfig(**fields), tokenizer)
        arrivals = {}  # group id -> (prompt, model version) of every sample the trainer took
        take = trainer.rollout_worker.rollout_buffer.get

        def recording_get(*args, **kwargs):
            sample = take(*args, **kwargs)
            arrivals.setdefault(sample.group_id, (sample.prompt, sample.model_version))
            return sample

        trainer.rollout_worker.rollout_buffer.get = recording_get
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        return arrivals

    uninterrupted = run()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    rollout_state = json.loads((checkpoint / "rollout_state.json").read_text())
    first_untrained = rollout_state["prompt_index"]
    # 2 steps of 4 samples in groups of 1 (or 2), plus any group dropped as stale.
    assert first_untrained >= (8 if trainer_name == "AsyncASPOTrainer" else 4)
    assert rollout_state["model_version"] == 3  # the cold sync makes version 1, then one sync per step
    resumed = run(str(checkpoint))

    dataset = make_dataset("train", 32, seed=0)
    assert resumed[0][0] == dataset[first_untrained]["prompt"] != dataset[0]["prompt"]
    assert resumed[0][1] >= 3  # versions count on from the checkpoint's
    shared = [group for group in resumed if first_untrained + group in uninterrupted]
    assert 0 in shared
    assert all(resumed[group][0] == uninterrupted[first_untrained + group][0] for group in shared)


def test_a_resume_with_trls_worker_numbers_versions_as_async_grpo_does(tmp_path, tokenizer):
    """Issue 31 item 19: TRL's own worker class (here replaying fixed samples), every feature off. The checkpoint
    after 2 steps holds model version 3 (the cold sync, then one sync per step); a resumed `AsyncGRPOTrainer` hands
    its worker 3 (restored), then 4 (the cold sync) and 5 (the one resumed step), and `AsyncASPOTrainer` the same."""
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    class ReplayingTRLWorker(ReplayRolloutWorker, AsyncRolloutWorker):
        """TRL's worker class to the trainers (so they write and read `rollout_state.json`), fixed samples inside."""

        def __init__(self, samples):
            super().__init__(samples)
            self._loop_kwargs = {"dataset_start_index": 0}
            self.published = []

        def update_model_version(self, model_version):
            self.published.append(model_version)

    samples = scripted_samples(tokenizer, [index // 4 for index in range(24)])  # one version per step

    def trainer(trainer_class, config_class, max_steps, samples):
        install_cpu_fallbacks()
        fields = base_fields(tmp_path, max_steps=max_steps, save_strategy="steps", save_steps=2)
        return trainer_class(
            MODEL,
            reward_funcs=correctness_reward,
            args=config_class(**fields),
            train_dataset=make_dataset("train", 8, seed=0),
            processing_class=tokenizer,
            rollout_worker=ReplayingTRLWorker(samples),
            weight_transfer=NoOpWeightTransfer(),
        )

    first = trainer(AsyncGRPOTrainer, AsyncGRPOConfig, 2, samples)
    first.train()
    checkpoint = tmp_path / "out" / "checkpoint-2"
    assert json.loads((checkpoint / "rollout_state.json").read_text())["model_version"] == 3
    published = {}
    for trainer_class, config_class in ((AsyncGRPOTrainer, AsyncGRPOConfig), (AsyncASPOTrainer, AsyncASPOConfig)):
        resumed = trainer(trainer_class, config_class, 3, samples[8:])
        resumed.train(resume_from_checkpoint=str(checkpoint))
        published[trainer_class.__name__] = resumed.rollout_worker.published
    assert published["AsyncGRPOTrainer"] == [3, 4, 5]
    assert published["AsyncASPOTrainer"] == published["AsyncGRPOTrainer"]


def test_prompt_id_column_keys_the_tracker_by_the_rows_id(tmp_path, tokenizer):
    """Samples carry their prompt, not their row: with `prompt_id_column` the trainer finds the row's id by the
    prompt's content, so two rows with one id share a tracker entry; ambiguous and unknown prompts are refused."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer

    install_cpu_fallbacks()
    dataset = make_dataset("train", 8, seed=0)
    dataset = dataset.add_column("problem", ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"])
    samples = scripted_samples(tokenizer, [0] * 16, groups_of=1, prompt_rows=[i % 4 for i in range(16)])
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=1, num_generations=1), advantage_estimator="spo", prompt_id_column="problem"
    )

    def trainer_on(train_dataset, stream):
        return AsyncASPOTrainer(
            MODEL,
            reward_funcs=correctness_reward,
            args=args,
            train_dataset=train_dataset,
            processing_class=tokenizer,
            rollout_worker=ReplayRolloutWorker(stream),
            weight_transfer=NoOpWeightTransfer(),
        )

    trainer = trainer_on(dataset, samples)
    trainer.train()
    # Each scored step holds rows 0..3 (ids p0, p0, p1, p1): four prompts, two tracker entries, equal visits.
    assert trainer._values.tracker.num_tracked == 2
    p0, p1 = trainer._values.tracker.visits(["p0", "p1"]).tolist()
    assert p0 == p1 and p0 % 2 == 0 and p0 > 0

    ambiguous = dataset.map(lambda row, index: {"problem": f"q{index}"}, with_indices=True)
    ambiguous = ambiguous.add_item({**ambiguous[0], "problem": "other"})
    with pytest.raises(ValueError, match=r"prompt_id_column='problem': one prompt appears under the ids 'q0' and"):
        trainer_on(ambiguous, samples)

    unknown = scripted_samples(tokenizer, [0] * 16, groups_of=1, prompt_rows=[8 + i % 8 for i in range(16)])
    with pytest.raises(ValueError, match=r"prompt_id_column='problem': a sample's prompt matches no train_dataset"):
        trainer_on(dataset, unknown).train()


def quarter_penalty_per_call(texts, positions, lengths, num_calls, interactive_turns, advantages):
    """A `tool_shaping_penalty` for the test below: 0.25 per tool call."""
    return 0.25 * num_calls.double()


@pytest.mark.parametrize("pattern", [None, r"<tool_call>"])
def test_tool_shaping_extras_and_pattern(tmp_path, tokenizer, pattern):
    """`tool_call_pattern`, `tool_shaping_interactive_bonus` and `tool_shaping_penalty` act in async scoring as in
    ASPOTrainer: calls found in each sample's completion (by tokens or by regex), extras added to the bias."""
    import numpy as np

    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.algorithms.tool_metrics import resolve_call_token_ids

    samples = scripted_samples(tokenizer, [0] * 16, groups_of=1, prompt_rows=list(range(16)))
    call = resolve_call_token_ids(tokenizer, "<tool_call>")
    text = tokenizer.encode("12", add_special_tokens=False)
    for sample in samples[::2]:  # every other sample: two text tokens, then the call opener, then one more token
        start = int(np.flatnonzero(sample.completion_mask)[0])
        tail = [*text[:2], *call, text[0]]
        sample.input_ids = np.asarray([*sample.input_ids[:start], *tail], dtype=np.int64)
        sample.completion_mask = np.asarray([0] * start + [1] * len(tail), dtype=np.int64)
        sample.old_log_probs = np.asarray([0.0] * start + [-1.0] * len(tail), dtype=np.float32)
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=1, num_generations=1),
        advantage_estimator="spo++",
        tool_shaping=True,
        tool_call_pattern=pattern,
        tool_shaping_interactive_bonus=0.1,
        tool_shaping_penalty=f"{__name__}.quarter_penalty_per_call",
    )
    trainer = scripted_trainer(AsyncASPOTrainer, args, tokenizer, samples)
    calls = []
    score = trainer._scorer.score
    trainer._scorer.score = lambda **kwargs: calls.append(kwargs) or score(**kwargs)
    trainer.train()

    kwargs = calls[0]
    positions, lengths, num_calls, turns = kwargs["tool_stats"].unbind(dim=1)
    assert positions.tolist() == [len(text[:2]), -1] * 2
    advantages = torch.tensor([0.5, -0.5, 0.2, 0.0], dtype=torch.float64)
    # Calls 1 and interactive turns 1 (text before the call) on the crafted samples; the bonus only where A > 0.
    expected = torch.tensor([0.1 - 0.25, 0.0, 0.1 - 0.25, 0.0], dtype=torch.float64)
    texts = kwargs["texts"]()
    extras = [
        hook(texts, positions, lengths, num_calls, turns, advantages)
        for hook in trainer._scorer.pipeline.shaping_hooks
    ]
    torch.testing.assert_close(sum(extras).double(), expected)


def test_value_init_prepass_sets_priors_from_the_starting_policy(tmp_path, tokenizer, monkeypatch):
    """`value_init_samples` in async: before training, each training prompt is rolled out that many times with the
    tools on the starting policy, scored by the summed reward functions, and the tracker's priors are the Jeffreys
    priors of those counts (an independent tracker built from the recorded rollouts must match at the first step)."""
    import trl_aspo.trainers.async_aspo_trainer as async_trainer
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.evaluation.tool_use import evaluate_tool_use
    from trl_aspo.values.event_values import AsyncEventValues
    from trl_aspo.values.prompt_ids import prompt_key

    results = []

    def recording_evaluate(*args, **kwargs):
        results.append(evaluate_tool_use(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(async_trainer, "evaluate_tool_use", recording_evaluate)
    args = AsyncASPOConfig(
        **base_fields(tmp_path, max_steps=1, num_generations=1),
        advantage_estimator="spo++",
        value_init_samples=2,
        value_reward_range=[0.0, 2.0],  # correctness + digit share
    )
    trainer = make_trainer(AsyncASPOTrainer, args, tokenizer)
    at_first_score = []
    score_step = trainer._score_step
    trainer._score_step = lambda step, context=(): (
        at_first_score.append(trainer._values.tracker.state_dict()) or score_step(step, context)
    )
    trainer.train()

    (result,) = results
    dataset = make_dataset("train", 32, seed=0)
    keys = [prompt_key(row["prompt"]) for row in dataset]
    assert result["num_problems"] == 32 and len(result["records"]) == 64
    successes, trials = dict.fromkeys(keys, 0.0), dict.fromkeys(keys, 0)
    for record in result["records"]:
        successes[keys[record["problem"]]] += record["reward"] / 2.0
        trials[keys[record["problem"]]] += 1
    assert set(trials.values()) == {2} and 0 < sum(successes.values()) < 64
    expected = AsyncEventValues(rho=args.value_rho)
    expected.init_from_counts(keys, [successes[k] for k in keys], [2] * 32, prior_strength=args.value_prior_strength)
    assert at_first_score[0] == expected.state_dict()


def test_a_resumed_local_run_continues_with_the_uninterrupted_tracker_and_version(tmp_path, tokenizer):
    """Kill after checkpoint 2 of a 4-step run and resume from it: the data loader scores one step ahead of
    training, yet the resumed run ends with the uninterrupted run's tracker observations (count and visits per
    prompt) and model version. (No sample is stale enough to drop, so both runs train groups 0, 1, 2, ... in order.)
    Also: every row the local worker emits carries its prompt's first dispatch version, the prior's anchor."""
    from trl_aspo import AsyncASPOConfig, AsyncASPOTrainer
    from trl_aspo.trainers.checkpoint_state import load_checkpoint_state
    from trl_aspo.values.prompt_ids import prompt_key

    def run(output, resume_from_checkpoint=None):
        fields = base_fields(
            tmp_path / output, max_steps=4, num_generations=1, save_strategy="steps", save_steps=2, max_staleness=100
        )
        args = AsyncASPOConfig(**fields, advantage_estimator="spo++", value_reward_range=[0.0, 2.0])
        trainer = make_trainer(AsyncASPOTrainer, args, tokenizer)
        scored, score_step = [], trainer._score_step
        trainer._score_step = lambda step, context=(): scored.extend(step) or score_step(step, context)
        trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        return trainer, scored

    uninterrupted, uninterrupted_samples = run("uninterrupted")
    checkpoint = tmp_path / "uninterrupted" / "out" / "checkpoint-2"
    saved = load_checkpoint_state(str(checkpoint))["tracker"]
    # Checkpoint 2 holds the outcomes of its 2 trained steps of 4 samples, not those of the step fetched ahead.
    assert sum(saved["visits"].values()) == 8
    resumed, resumed_samples = run("resumed", str(checkpoint))

    expected = uninterrupted._values.tracker.state_dict()["visits"]
    # 4 trained steps and the one fetched ahead of the end: 5 x 4 outcomes, each prompt once.
    assert sum(expected.values()) == 20 and set(expected.values()) == {1}
    assert resumed._values.tracker.state_dict()["visits"] == expected
    assert uninterrupted.model_version == 5  # the cold sync, then one sync per step
    assert resumed.model_version == uninterrupted.model_version

    # SPO++ priors are anchored at each prompt's first dispatch, which the worker recorded (and stamped on its rows)
    # when it handed the group out; the checkpoint carries every dispatch so far, and the resumed run keeps them.
    saved_dispatches = load_checkpoint_state(str(checkpoint))["prompt_dispatches"]
    assert set(saved["prior"]) <= set(saved_dispatches)
    for trainer, scored in ((uninterrupted, uninterrupted_samples), (resumed, resumed_samples)):
        dispatches = trainer._values.prompt_dispatches.state_dict()
        priors = trainer._values.tracker.state_dict()["prior"]
        assert all(type(sample).__name__ == "TrackedRolloutSample" for sample in scored)
        for sample in scored:
            key = prompt_key(sample.prompt)
            assert sample.prompt_dispatch_version == dispatches[key] == priors[key][2] <= sample.model_version
    resumed_dispatches = resumed._values.prompt_dispatches.state_dict()
    assert {key: resumed_dispatches[key] for key in saved_dispatches} == saved_dispatches
