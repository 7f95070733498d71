"""Single-stream training (SPO / SPO++) through `ASPOTrainer` on the tiny random model.

Every check recomputes what the trainer should have done from what it was given (the gathered rewards of each
generation round, recorded by wrapping TRL's `_calculate_rewards`) with hand-written formulas, independent of the
tracker, normalization and sampler modules.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest
import torch
from helpers import digit_share_reward

from trl_aspo import ASPOTrainer
from trl_aspo.trainers.checkpoint_state import load_checkpoint_state
from trl_aspo.values import EventValueTracker, VisitValueTracker
from trl_aspo.values.prompt_ids import prompt_key
from trl_aspo.values.sampler import PrioritizedRepeatSampler

RHO = 0.875
PRIOR = 0.5


def is_sum(prompt) -> bool:
    return "+" in prompt[-1]["content"]


class Recorder:
    """Records, per generation round, the prompt keys, the gathered rewards and the trainer's output batch.

    Wraps the instance's TRL hooks: the trainer calls `self._calculate_rewards(...)`, so an instance attribute takes
    precedence over the class method."""

    def __init__(self, trainer: ASPOTrainer) -> None:
        self.rounds: list[dict] = []
        calculate_rewards = trainer._calculate_rewards
        generate_and_score = trainer._generate_and_score_completions

        def recording_calculate_rewards(inputs, prompts, completions, completion_ids_list):
            rewards_per_func = calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self.rounds.append(
                {"keys": [prompt_key(p) for p in prompts], "prompts": prompts, "rewards": rewards_per_func.clone()}
            )
            return rewards_per_func

        def recording_generate_and_score(inputs):
            output = generate_and_score(inputs)
            self.rounds[-1]["output"] = output
            return output

        trainer._calculate_rewards = recording_calculate_rewards
        trainer._generate_and_score_completions = recording_generate_and_score

    def total_rewards(self, index: int) -> torch.Tensor:
        """Round `index`'s total rewards (weights 1, NaN where every function abstained), float64."""
        rewards = self.rounds[index]["rewards"].double()
        total = rewards.nansum(dim=1)
        total[torch.isnan(rewards).all(dim=1)] = torch.nan
        return total


def spo_plus_plus_value(history: list[tuple[int, float]], event: int, rho: float = RHO, entered: int = 0) -> float:
    """docs/design.md section 3 by hand: Beta(0.5, 0.5) prior from the prompt's first dispatch `entered` plus outcomes
    aged rho^(q - z_i)."""
    alpha = beta = PRIOR * rho ** (event - entered)
    for z, reward in history:
        alpha += rho ** (event - z) * reward
        beta += rho ** (event - z) * (1 - reward)
    return alpha / (alpha + beta)


def token_measure(advantages: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The action-token-measure normalization by hand (weighted mean, divisor sum(L) - 1)."""
    mu = (lengths * advantages).sum() / lengths.sum()
    sigma = ((lengths * (advantages - mu) ** 2).sum() / (lengths.sum() - 1)).sqrt()
    return (advantages - mu) / (sigma + 1e-8)


def logged_steps(trainer: ASPOTrainer) -> list[dict]:
    return [row for row in trainer.state.log_history if "loss" in row]


@pytest.fixture
def small_dataset(calculator_dataset):
    """Eight prompts: with 8 completions per round, every round dispatches each prompt once."""
    return calculator_dataset.select(range(8))


@pytest.fixture
def make_trainer(tiny_config, tiny_tokenizer, small_dataset):
    """A single-stream trainer (spo++, one completion per prompt, 8 prompts per round) on a fresh tiny model."""
    from trl_aspo.builtin import build_random_model

    def make(dataset=None, reward_funcs=(digit_share_reward,), **overrides) -> ASPOTrainer:
        fields = dict(advantage_estimator="spo++", num_generations=1, max_steps=3, max_completion_length=12)
        fields.update(overrides)
        return ASPOTrainer(
            model=build_random_model(tiny_tokenizer, seed=0),
            reward_funcs=list(reward_funcs),
            args=tiny_config(**fields),
            train_dataset=small_dataset if dataset is None else dataset,
            processing_class=tiny_tokenizer,
        )

    return make


@pytest.mark.slow
def test_spo_plus_plus_values_and_frozen_advantages(make_trainer):
    trainer = make_trainer()
    recorder = Recorder(trainer)
    trainer.train()

    steps = logged_steps(trainer)
    assert len(steps) == len(recorder.rounds) == 3
    history: dict[str, list[tuple[int, float]]] = defaultdict(list)
    for event, (record, step) in enumerate(zip(recorder.rounds, steps, strict=True)):
        assert sorted(record["keys"]) == sorted(set(record["keys"])) and len(record["keys"]) == 8
        rewards = recorder.total_rewards(event)
        # Values read at dispatch: only the outcomes of earlier rounds are visible.
        values = torch.tensor(
            [spo_plus_plus_value(history[key], event) for key in record["keys"]], dtype=torch.float64
        )
        output = record["output"]
        lengths = (output["completion_mask"] * output.get("tool_mask", 1)).sum(dim=1).double()
        expected = token_measure(rewards - values, lengths)
        torch.testing.assert_close(output["advantages"].double(), expected, atol=1e-5, rtol=1e-5)
        assert step["value/mean"] == pytest.approx(values.mean().item(), abs=1e-6)
        assert step["value/rho_mean"] == pytest.approx(RHO)
        zero_share = torch.isclose(expected, torch.zeros_like(expected), atol=1e-6).double().mean().item()
        assert step["zero_advantage_share"] == pytest.approx(zero_share)
        for key, reward in zip(record["keys"], rewards.tolist(), strict=True):
            history[key].append((event, reward))
    # Prompts enter the tracker (their prior anchored) at their first dispatch.
    assert [step["value/tracked_prompts"] for step in steps] == [8.0, 8.0, 8.0]

    tracker = trainer._values.tracker
    assert isinstance(tracker, EventValueTracker) and tracker.num_tracked == 8
    assert trainer._value_event == 3
    keys = sorted(history)
    expected = torch.tensor([spo_plus_plus_value(history[key], 3) for key in keys], dtype=torch.float64)
    torch.testing.assert_close(tracker.value(keys, 3), expected, atol=1e-12, rtol=0)
    # One prompt's pseudo-counts in full, aged to the next dispatch.
    key = keys[0]
    alpha = PRIOR * RHO**3 + sum(RHO ** (3 - z) * r for z, r in history[key])
    beta = PRIOR * RHO**3 + sum(RHO ** (3 - z) * (1 - r) for z, r in history[key])
    counts = tracker.pseudo_counts([key], 3)
    assert (counts[0].item(), counts[1].item()) == pytest.approx((alpha, beta), abs=1e-12)


def independent_completion_logps(model, visit: dict, temperature: float) -> torch.Tensor:
    """Log-probs of a stored visit's completion tokens by a plain forward of prompt + completion (no TRL helper)."""
    prompt, completion = visit["prompt_ids"].long(), visit["completion_ids"].long()
    ids = torch.cat([prompt, completion])[None]
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : ids.size(1) - 1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, completion[:, None]).squeeze(-1)


@pytest.mark.slow
def test_spo_kl_adaptive_rho_measures_drift_since_previous_visit(make_trainer):
    """Issue 11 item 1: D compares a prompt's stored completion from its previous visit (its log-probs right after
    that visit's update) with the current policy; a first visit has D = 0, so rho = rho_max."""
    trainer = make_trainer(advantage_estimator="spo", value_rho_mode="kl", learning_rate=1e-2, max_steps=4)
    recorder = Recorder(trainer)
    closures: list[dict] = []
    close_pending = trainer._values.close_pending_round
    tracker_observe = trainer._values.tracker.observe

    def spying_observe_pending():
        pending = trainer._values.pending_visit
        if pending is not None:
            model, temperature = trainer.model, trainer.args.temperature
            drift, post = [], []
            for key, own in zip(pending["keys"], pending["completions"], strict=True):
                stored = trainer._values.visit_store.get(key)
                if stored is None:
                    drift.append(0.0)
                else:
                    now = independent_completion_logps(model, stored, temperature)
                    mask = stored["action_mask"]
                    drift.append(((stored["logps"] - now).abs()[mask].sum() / mask.sum().clamp(min=1)).item())
                post.append(independent_completion_logps(model, own, temperature))
            first = [trainer._values.visit_store.get(key) is None for key in pending["keys"]]
            closures.append({"keys": list(pending["keys"]), "drift": drift, "post": post, "first": first})
        return close_pending()

    def spying_tracker_observe(keys, rewards, rho):
        closures[-1].update(rho=torch.as_tensor(rho), rewards=torch.as_tensor(rewards), observed_keys=list(keys))
        tracker_observe(keys, rewards, rho)

    trainer._values.close_pending_round = spying_observe_pending
    trainer._values.tracker.observe = spying_tracker_observe
    trainer.train()

    # Rounds 0..2 were closed at the dispatch of rounds 1..3; round 3 still waits for its update's effect.
    assert len(closures) == 3 and trainer._values.pending_visit is not None
    args = trainer.args
    steps = logged_steps(trainer)
    for event, record in enumerate(closures):
        assert record["observed_keys"] == record["keys"] == recorder.rounds[event]["keys"]
        # Every prompt is drawn every round: round 0 is all first visits, later rounds none.
        assert record["first"] == [event == 0] * 8
        drift = torch.tensor(record["drift"], dtype=torch.float64)
        if event == 0:
            assert (drift == 0).all()
        else:
            assert (drift > 1e-4).all()  # lr 1e-2 moves the policy between visits
        expected_rho = (2.0 ** (-drift / 0.06)).clamp(args.value_rho_min, args.value_rho_max)
        torch.testing.assert_close(record["rho"], expected_rho, atol=1e-5, rtol=0)
        torch.testing.assert_close(record["rewards"], recorder.total_rewards(event))
        step = steps[event + 1]
        assert step["value/kl_drift"] == pytest.approx(drift.mean().item(), abs=1e-5)
        assert step["value/first_visit_frac"] == (1.0 if event == 0 else 0.0)
        clipped = ((2.0 ** (-drift / 0.06)) != expected_rho).double().mean().item()
        assert step["value/rho_clip_frac"] == pytest.approx(clipped)
        assert step["value/rho_mean"] == pytest.approx(expected_rho.mean().item(), abs=1e-5)
    # The store holds each prompt's last visit (round 2's completions) with their log-probs after round 2's update.
    last = closures[-1]
    assert sorted(trainer._values.visit_store) == sorted(last["keys"])
    for key, post in zip(last["keys"], last["post"], strict=True):
        visit = trainer._values.visit_store[key]
        assert visit["logps"].dtype == torch.float32 and visit["completion_ids"].dtype == torch.int32
        torch.testing.assert_close(visit["logps"], post, atol=1e-5, rtol=0)

    # SPO's per-visit update by hand for one prompt: alpha <- rho*alpha + R, beta <- rho*beta + (1 - R).
    key = closures[0]["keys"][0]
    alpha = beta = PRIOR
    for record in closures:
        index = record["keys"].index(key)
        rho, reward = record["rho"][index].item(), record["rewards"][index].item()
        alpha, beta = rho * alpha + reward, rho * beta + 1 - reward
    counts = trainer._values.tracker.pseudo_counts([key])
    assert (counts[0].item(), counts[1].item()) == pytest.approx((alpha, beta), abs=1e-12)


@pytest.mark.slow
def test_prioritized_sampling_follows_the_tracker(make_trainer, calculator_dataset, monkeypatch):
    draws: list[dict] = []
    draw = PrioritizedRepeatSampler.draw

    def recording_draw(self, *args):
        weights = self.weights.clone()
        indices = draw(self, *args)
        draws.append({"weights": weights, "indices": indices})
        return indices

    monkeypatch.setattr(PrioritizedRepeatSampler, "draw", recording_draw)
    trainer = make_trainer(dataset=calculator_dataset, prioritized_sampling=True)
    recorder = Recorder(trainer)
    trainer.train()

    sampler = trainer._priority_sampler
    keys = trainer._values.dataset_keys
    # Each round dispatched the prompts of one prioritized draw, in order.
    for record, drawn in zip(recorder.rounds, draws, strict=False):
        assert record["keys"] == [keys[i] for i in drawn["indices"]]
    # After the last round the weights are sqrt(v (1 - v)) + epsilon of the tracker's values (recomputed by hand).
    history: dict[str, list[tuple[int, float]]] = defaultdict(list)
    entered: dict[str, int] = {}
    weights_after = []
    for event, record in enumerate(recorder.rounds):
        for key, reward in zip(record["keys"], recorder.total_rewards(event).tolist(), strict=True):
            history[key].append((event, reward))
            entered.setdefault(key, event)
        # Each prompt's prior ages from its first dispatch (issue 11 item 2), not from event 0.
        values = torch.tensor(
            [spo_plus_plus_value(history[key], event + 1, entered=entered.get(key, 0)) for key in keys],
            dtype=torch.float64,
        )
        weights_after.append((values * (1 - values)).sqrt() + 0.05)
    torch.testing.assert_close(sampler.weights, weights_after[-1], atol=1e-12, rtol=0)
    assert sampler.weights.std() > 0
    # Each round is drawn at its dispatch, so a draw sees the outcomes of every earlier round.
    assert len(draws) == len(recorder.rounds)
    for index, drawn in enumerate(draws[1:], start=1):
        torch.testing.assert_close(drawn["weights"], weights_after[index - 1], atol=1e-12, rtol=0)
    assert all("value/effective_prompts" in step for step in logged_steps(trainer))

    # Every rank draws the same: two samplers holding the same state yield the same indices.
    ranks = [PrioritizedRepeatSampler(len(keys), 1, batch_size=8, seed=trainer.args.seed) for _ in range(2)]
    for rank in ranks:
        rank.load_state_dict(sampler.state_dict())
    assert list(ranks[0]) == list(ranks[1])


@pytest.mark.slow
def test_rewards_outside_the_unit_interval_are_refused(make_trainer):
    def too_large(completions, **kwargs):
        return [1.5] * len(completions)

    trainer = make_trainer(reward_funcs=[too_large], max_steps=1)
    with pytest.raises(ValueError, match=r"got 1\.5\. Set ASPOConfig\.value_reward_range"):
        trainer.train()


@pytest.mark.slow
def test_value_reward_range_maps_rewards(make_trainer):
    def shifted(completions, **kwargs):
        return [1.0 + share for share in digit_share_reward(completions)]

    trainer = make_trainer(reward_funcs=[shifted], value_reward_range=[0.0, 2.0], max_steps=1)
    recorder = Recorder(trainer)
    trainer.train()
    record = recorder.rounds[0]
    mapped = recorder.total_rewards(0) / 2.0
    expected = [spo_plus_plus_value([(0, r)], 1) for r in mapped.tolist()]
    torch.testing.assert_close(
        trainer._values.tracker.value(record["keys"], 1), torch.tensor(expected, dtype=torch.float64)
    )
    assert (trainer._values.tracker.value(record["keys"], 1) >= 0.5).all()


@pytest.mark.slow
def test_abstained_rewards_do_not_touch_the_tracker(make_trainer, small_dataset):
    def abstain_on_sums(prompts, completions, **kwargs):
        shares = digit_share_reward(completions)
        return [None if is_sum(p) else share for p, share in zip(prompts, shares, strict=True)]

    trainer = make_trainer(reward_funcs=[abstain_on_sums], max_steps=2)
    recorder = Recorder(trainer)
    trainer.train()

    sums = {prompt_key(row["prompt"]) for row in small_dataset if is_sum(row["prompt"])}
    assert sums and len(sums) < 8
    # Abstained prompts entered the tracker at dispatch (their prior is anchored) but no outcome of theirs was seen.
    visits = trainer._values.tracker.state_dict()["visits"]
    assert set(visits) == {prompt_key(row["prompt"]) for row in small_dataset} - sums
    assert (trainer._values.tracker.value(sorted(sums), 2) == 0.5).all()
    for record in recorder.rounds:
        abstained = torch.tensor([key in sums for key in record["keys"]])
        assert (record["output"]["advantages"][abstained] == 0).all()
        assert (record["output"]["advantages"][~abstained] != 0).any()


@pytest.mark.slow
@pytest.mark.parametrize("estimator", ["spo++", "spo"])
def test_checkpoint_round_trip(make_trainer, calculator_dataset, tmp_path, estimator):
    overrides = dict(
        dataset=calculator_dataset.select(range(16)),
        advantage_estimator=estimator,
        prioritized_sampling=True,
        save_strategy="steps",
        save_steps=1,
        output_dir=str(tmp_path / "run"),
    )
    if estimator == "spo":
        overrides["value_rho_mode"] = "kl"
    first = make_trainer(max_steps=2, **overrides)
    first.train()
    checkpoint = os.path.join(tmp_path / "run", "checkpoint-2")
    saved = load_checkpoint_state(checkpoint)
    assert saved["value_event"] == first._value_event == 2
    tracker = first._values.tracker
    if estimator == "spo":
        # KL-adaptive rho: the checkpoint closes the pending last round (with the final model) on a copy.
        assert first._values.pending_visit is not None
        live = tracker.state_dict()
        tracker = VisitValueTracker()
        tracker.load_state_dict(live)
        live_store = dict(first._values.visit_store)
        visit_store = dict(live_store)
        first._values.visit_drift.close(first._values.pending_visit, tracker, visit_store)
        assert saved["tracker"] != live and first._values.visit_store == live_store
        # The stored visits travel with the checkpoint: every prompt seen so far, tensors exactly.
        assert sorted(saved["visit_store"]) == sorted(visit_store)
        for key, visit in visit_store.items():
            for name, tensor in visit.items():
                assert torch.equal(saved["visit_store"][key][name], tensor)
    assert saved["tracker"] == tracker.state_dict()
    values = (
        tracker.value(first._values.dataset_keys, 2)
        if estimator == "spo++"
        else tracker.value(first._values.dataset_keys)
    )
    live_sampler = first._priority_sampler.state_dict()
    assert (saved["sampler"]["round"], saved["sampler"]["seed"]) == (live_sampler["round"], live_sampler["seed"])
    assert saved["sampler"]["weights"] == pytest.approx(((values * (1 - values)).sqrt() + 0.05).tolist(), abs=1e-12)

    second = make_trainer(max_steps=3, **overrides)
    restored: dict = {}
    load = second._load_optimizer_and_scheduler

    def recording_load(path):
        load(path)
        restored.update(
            tracker=second._values.tracker.state_dict(),
            event=second._value_event,
            sampler=second._priority_sampler.state_dict(),
            pending=second._values.pending_visit,
            visit_store=dict(second._values.visit_store),
        )

    second._load_optimizer_and_scheduler = recording_load
    second.train(resume_from_checkpoint=checkpoint)
    assert restored["tracker"] == saved["tracker"]
    assert restored["event"] == saved["value_event"]
    assert restored["pending"] is None
    if estimator == "spo":
        assert sorted(restored["visit_store"]) == sorted(saved["visit_store"])
        key = next(iter(saved["visit_store"]))
        assert torch.equal(restored["visit_store"][key]["logps"], saved["visit_store"][key]["logps"])
    assert restored["sampler"]["weights"] == pytest.approx(saved["sampler"]["weights"], abs=1e-12)
    assert (restored["sampler"]["round"], restored["sampler"]["seed"]) == (live_sampler["round"], live_sampler["seed"])
    assert second.state.global_step == 3 and second._value_event == 3


def record_dispatch_values(trainer: ASPOTrainer) -> list[dict[str, float]]:
    """Per generation round, the tracker value each dispatched prompt was given (read once per round)."""
    dispatched: list[dict[str, float]] = []
    tracker_values = trainer._values.values

    def recording_tracker_values(keys, event):
        values = tracker_values(keys, event)
        dispatched.append(dict(zip(keys, values.tolist(), strict=True)))
        return values

    trainer._values.values = recording_tracker_values
    return dispatched


@pytest.mark.slow
def test_resumed_run_dispatches_what_the_uninterrupted_run_dispatched(make_trainer, tmp_path):
    overrides = dict(save_strategy="steps", save_steps=1, output_dir=str(tmp_path / "run"))
    uninterrupted = make_trainer(**overrides)
    full = record_dispatch_values(uninterrupted)
    uninterrupted.train()
    resumed = make_trainer(**overrides)
    tail = record_dispatch_values(resumed)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert len(full) == 3 and len(tail) == 1
    assert tail[0] == pytest.approx(full[2], abs=1e-12)
    assert len(set(full[2].values())) > 1


def _write(path, content) -> str:
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return str(path)


@pytest.mark.parametrize("estimator", ["spo++", "spo"])
def test_value_init_file_sets_jeffreys_priors(make_trainer, small_dataset, tmp_path, estimator):
    prompts = [row["prompt"] for row in small_dataset]
    records = [
        {"prompt": prompts[0], "successes": 3, "trials": 4},
        {"prompt_id": prompt_key(prompts[1]), "successes": 0.5, "trials": 2},
    ]
    trainer = make_trainer(
        advantage_estimator=estimator,
        value_init_file=_write(tmp_path / "init.json", records),
        value_prior_strength=8.0,
    )
    keys = [prompt_key(prompts[0]), prompt_key(prompts[1]), prompt_key(prompts[2])]
    tracker = trainer._values.tracker
    alpha, beta = tracker.pseudo_counts(keys, 0) if estimator == "spo++" else tracker.pseudo_counts(keys)
    # alpha0 = N0 (s + 0.5) / (n0 + 1), beta0 = N0 (n0 - s + 0.5) / (n0 + 1); a prompt with no record: Beta(0.5, 0.5).
    assert alpha.tolist() == pytest.approx([8 * 3.5 / 5, 8 * 1.0 / 3, 0.5])
    assert beta.tolist() == pytest.approx([8 * 1.5 / 5, 8 * 2.0 / 3, 0.5])
    assert tracker.num_tracked == 2


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ({"successes": 1, "trials": 2}, "must hold a JSON list of records"),
        ([{"prompt": "x", "successes": 1}], r"record 0 must be an object with 'successes', 'trials'"),
        (["x"], r"record 0 must be an object .* got a str"),
        ([{"prompt": "x", "successes": "1", "trials": 2}], "needs numeric 'successes' and 'trials'"),
        ([{"prompt": "x", "successes": 3, "trials": 2}], r"successes 3\.0 .* must lie in \[0, trials=2\.0\]"),
        ([{"prompt": "x", "successes": 0, "trials": 1}, {"prompt": "x", "successes": 1, "trials": 1}], "repeats"),
    ],
)
def test_malformed_value_init_file_is_refused(make_trainer, tmp_path, content, message):
    path = _write(tmp_path / "init.json", content)
    with pytest.raises(ValueError, match=rf"value_init_file='{path}'.*{message}"):
        make_trainer(value_init_file=path)


def test_missing_value_init_file_is_refused(make_trainer, tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        make_trainer(value_init_file=str(tmp_path / "missing.json"))


@pytest.mark.slow
def test_zero_advantage_share_of_the_group_estimator(make_trainer):
    def flat_on_sums(prompts, completions, **kwargs):
        shares = digit_share_reward(completions)
        return [0.0 if is_sum(p) else share for p, share in zip(prompts, shares, strict=True)]

    trainer = make_trainer(advantage_estimator="group", num_generations=4, max_steps=2, reward_funcs=[flat_on_sums])
    recorder = Recorder(trainer)
    trainer.train()
    for event, step in enumerate(logged_steps(trainer)):
        grouped = recorder.total_rewards(event).view(-1, 4)
        centered = grouped - grouped.mean(dim=1, keepdim=True)
        share = torch.isclose(centered, torch.zeros_like(centered), atol=1e-6).double().mean().item()
        assert step["zero_advantage_share"] == pytest.approx(share, abs=1e-6)
    assert any(is_sum(p) for record in recorder.rounds for p in record["prompts"])
    assert max(step["zero_advantage_share"] for step in logged_steps(trainer)) > 0


@pytest.mark.slow
def test_zero_advantage_share_is_measured_after_normalization(make_trainer):
    """Every reward 0 and every value 0.5: R - v = -0.5 everywhere, which normalization turns into no signal."""

    def zero(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = make_trainer(reward_funcs=[zero], max_steps=1)
    recorder = Recorder(trainer)
    trainer.train()
    assert (recorder.rounds[0]["output"]["advantages"] == 0).all()
    assert logged_steps(trainer)[0]["zero_advantage_share"] == 1.0


@pytest.mark.slow
def test_value_init_prepass(make_trainer, calculator_dataset):
    dataset = calculator_dataset.select(range(5))
    trainer = make_trainer(dataset=dataset, value_init_samples=3, per_device_train_batch_size=4, max_steps=1)
    recorder = Recorder(trainer)
    at_first_dispatch: dict = {}
    generate_and_score = trainer._generate_and_score_completions

    def snapshot(inputs):
        at_first_dispatch.setdefault("tracker", trainer._values.tracker.state_dict())
        return generate_and_score(inputs)

    trainer._generate_and_score_completions = snapshot
    trainer.train()

    # 5 prompts x 3 samples = 15 rows, padded to 16: four generation batches of 4 rows before training starts.
    prepass = recorder.rounds[:4]
    assert len(recorder.rounds) == 5
    successes: dict[str, float] = defaultdict(float)
    trials: dict[str, int] = defaultdict(int)
    for index, record in enumerate(prepass):
        for position, (key, reward) in enumerate(
            zip(record["keys"], recorder.total_rewards(index).tolist(), strict=True)
        ):
            if 4 * index + position < 15:  # the 16th row is padding
                successes[key] += reward
                trials[key] += 1
    keys = [prompt_key(row["prompt"]) for row in dataset]
    assert sorted(successes) == sorted(keys) and set(trials.values()) == {3}
    expected = EventValueTracker(rho=RHO)
    expected.init_from_counts(keys, [successes[k] for k in keys], [3] * 5, prior_strength=8.0)
    assert at_first_dispatch["tracker"] == expected.state_dict()
    values = expected.value(keys, 0)
    assert (values != 0.5).all()
    # The pre-pass is not training: its rewards are not logged.
    assert logged_steps(trainer)[0]["reward"] == pytest.approx(recorder.total_rewards(4).mean().item(), abs=1e-6)
