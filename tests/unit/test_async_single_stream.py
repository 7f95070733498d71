"""StepScorer: trainer-side scoring of one optimizer step's samples (baseline, normalization, tool shaping)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from trl_aspo.config.async_config import AsyncASPOConfig
from trl_aspo.trainers.value_tracking import ValueTracking
from trl_aspo.values.prompt_ids import prompt_key
from trl_aspo.values.scoring import StepScorer

# (prompt key, model version, reward, action tokens, group id), per optimizer step, in a canonical order.
STEPS = [
    [("x", 0, 1.0, 4, 0), ("x", 0, 0.0, 6, 0), ("y", 0, 1.0, 3, 1), ("x", 1, 1.0, 5, 2)],
    [("x", 1, 0.0, 2, 3), ("y", 2, 1.0, 7, 4), ("x", 2, 1.0, 4, 5), ("y", 1, 0.0, 3, 6)],
    [("x", 3, 1.0, 4, 7), ("y", 3, 0.0, 5, 8), ("x", 2, 0.0, 3, 9)],
]


def config(tmp_path, **overrides):
    return AsyncASPOConfig(output_dir=str(tmp_path), use_cpu=True, token_budget=0, **overrides)


def make_scorer(args) -> StepScorer:
    """The asynchronous trainer's scorer of `args`, with the tracker its value tracking holds (priors from
    `value_init_file` included)."""
    values = ValueTracking.start(args, None, asynchronous=True)
    return StepScorer(args, None if values is None else values.tracker)


def score_step(scorer, step, worker_advantages=None, tool_positions=None, in_step=None):
    size = len(step)
    return scorer.score(
        keys=[s[0] for s in step],
        rewards=torch.tensor([s[2] for s in step], dtype=torch.float64),
        versions=[s[1] for s in step],
        token_counts=torch.tensor([s[3] for s in step]),
        group_ids=torch.tensor([s[4] for s in step]),
        worker_advantages=torch.zeros(size) if worker_advantages is None else worker_advantages,
        tool_positions=tool_positions,
        in_step=in_step,
    )


def run(tmp_path, estimator, seed):
    """Advantages of every sample, in canonical order, when each step's samples arrive in a shuffled order."""
    scorer = make_scorer(config(tmp_path, advantage_estimator=estimator, num_generations=1))
    rng = random.Random(seed)
    out = []
    for step in STEPS:
        order = list(range(len(step)))
        rng.shuffle(order)
        advantages = score_step(scorer, [step[i] for i in order]).advantages
        canonical = torch.empty_like(advantages)
        canonical[order] = advantages
        out.append(canonical)
    return torch.cat(out)


def test_spo_plus_plus_is_invariant_to_arrival_order_and_spo_is_not(tmp_path):
    spo_pp = [run(tmp_path, "spo++", seed) for seed in range(4)]
    for other in spo_pp[1:]:
        torch.testing.assert_close(other, spo_pp[0], rtol=0, atol=1e-9)
    spo = [run(tmp_path, "spo", seed) for seed in range(4)]
    assert any((other - spo[0]).abs().max() > 1e-3 for other in spo[1:])


def test_spo_plus_plus_values_by_hand(tmp_path):
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1, value_rho=0.5))
    scorer.tracker_baseline(["x", "x", "y", "x"], torch.tensor([1.0, 0.0, 1.0, 1.0]), [0, 0, 0, 1])
    advantages, metrics = scorer.tracker_baseline(["x", "x"], torch.tensor([0.0, 1.0]), [1, 2])
    # x at z=1 sees the two version-0 outcomes: alpha = .5*.5 + .5*1 + .5*0 = .75, beta = .25 + 0 + .5 = .75 -> v = .5
    # x at z=2 also sees the version-1 outcome (1.0) of step 1: alpha = .25*.5 + .25 + .5 = .875,
    # beta = .125 + .25 = .375 -> v = .7; its batch-mate at z=1 (0.0) is observed only after scoring
    torch.testing.assert_close(advantages, torch.tensor([-0.5, 1 - 0.7], dtype=torch.float64))
    assert metrics["value/tracked_prompts"] == 2.0


def test_token_normalization_and_single_completion_advantages_are_nonzero(tmp_path):
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1))
    result = score_step(scorer, STEPS[0])
    # Step 0: every value is the prior 0.5 except x at z=1, which sees x's two z=0 outcomes (mean 0.5): A = R - 0.5.
    raw = torch.tensor([0.5, -0.5, 0.5, 0.5], dtype=torch.float64)
    counts = torch.tensor([4.0, 6.0, 3.0, 5.0], dtype=torch.float64)
    mu = (counts * raw).sum() / counts.sum()
    sigma = ((counts * (raw - mu) ** 2).sum() / (counts.sum() - 1)).sqrt()
    torch.testing.assert_close(result.advantages, (raw - mu) / (sigma + 1e-8))
    assert (counts * result.advantages).sum().abs() < 1e-9
    assert result.metrics["zero_advantage_share"] == 0.0


def test_group_baseline_is_computed_from_the_raw_rewards_for_batch_normalization(tmp_path):
    """The group estimator gets each group's raw rewards, not the worker's z-score (given nonsense here)."""
    scorer = make_scorer(config(tmp_path, advantage_normalization="batch", num_generations=2))
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=torch.float64)  # groups {0, 1} and {2, 3}
    step = [("a", 0, 1.0, 3, 0), ("a", 0, 0.0, 3, 0), ("b", 0, 1.0, 3, 1), ("b", 0, 1.0, 3, 1)]
    result = score_step(scorer, step, worker_advantages=torch.tensor([7.0, -7.0, 3.0, 3.0]))
    centered = rewards - torch.tensor([0.5, 0.5, 1.0, 1.0], dtype=torch.float64)
    expected = (centered - centered.mean()) / (centered.std() + 1e-8)
    torch.testing.assert_close(result.advantages, expected)


def test_unscorable_samples_get_zero_and_are_not_observed(tmp_path):
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo", num_generations=1))
    step = [("x", 0, float("nan"), 3, 0), ("x", 0, 1.0, 3, 1), ("y", 0, 0.0, 3, 2)]
    result = score_step(scorer, step)
    assert result.advantages[0] == 0.0
    assert scorer.tracker.visits(["x", "y"]).tolist() == [1, 1]


def test_tool_shaping_over_the_step_with_one_completion_per_prompt(tmp_path):
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1, tool_shaping=True))
    step = [("a", 0, 1.0, 10, 0), ("b", 0, 1.0, 10, 1), ("c", 0, 0.0, 10, 2)]
    plain = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1))
    base = score_step(plain, step).advantages
    result = score_step(scorer, step, tool_positions=torch.tensor([2, 6, 1]))
    # Eligible: a and b (correct, with a call); mean position 4, mean length 10: b_i = -2 (p - 4) / 10 = -+0.4,
    # clipped to 0.7 |A|. Across groups: one completion per prompt makes the step one group.
    bias = torch.tensor([0.4, -0.4, 0.0], dtype=torch.float64)
    bound = 0.7 * base.abs()
    torch.testing.assert_close(result.advantages, base + torch.maximum(torch.minimum(bias, bound), -bound))
    assert result.metrics["shaping/eligible_frac"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="tool_shaping needs the position"):
        score_step(scorer, step)


def test_rewards_outside_unit_range_are_refused_or_mapped(tmp_path):
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1))
    with pytest.raises(
        ValueError, match=r"needs total rewards in \[0, 1\]; got 2.0. Set AsyncASPOConfig.value_reward_range"
    ):
        score_step(scorer, [("x", 0, 2.0, 3, 0)])
    mapped = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1, value_reward_range=[0, 2]))
    # Mapped rewards 1 and 0 against the prior 0.5: A = +-0.5; token measure with L = 3, 3: sigma^2 = 1.5 / 5
    assert score_step(mapped, [("x", 0, 2.0, 3, 0), ("y", 0, 0.0, 3, 1)]).advantages.tolist() == pytest.approx(
        [0.5 / 0.3**0.5, -0.5 / 0.3**0.5], abs=1e-6
    )


def test_value_init_file_sets_priors(tmp_path):
    init = tmp_path / "init.jsonl"
    key = prompt_key([{"role": "user", "content": "hi"}])
    init.write_text(json.dumps({"prompt_id": key, "alpha": 3.0, "beta": 1.0}) + "\n")
    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1, value_init_file=str(init)))
    advantages, _ = scorer.tracker_baseline([key], torch.tensor([1.0]), [0])
    assert advantages.tolist() == pytest.approx([0.25])


@pytest.mark.parametrize("estimator", ["spo", "spo++"])
def test_rows_of_one_forked_conversation_are_one_outcome(tmp_path, estimator):
    """TRL's worker splits a conversation whose re-tokenization drifts into several rows sharing one reward: the
    tracker sees that outcome once and no row sees it, also when the rows fall into two optimizer steps."""
    scorer = make_scorer(config(tmp_path, advantage_estimator=estimator, num_generations=1, value_rho=0.5))
    # x's conversation "c1" is forked into three rows: two in this step, one in the next.
    first = scorer.tracker_baseline(["x", "x", "y"], torch.tensor([1.0, 1.0, 0.0]), [0, 0, 0], ["c1", "c1", "c2"])[0]
    # Every value is the prior 0.5 (nothing of x observed before): each row of c1 gets 1 - 0.5.
    torch.testing.assert_close(first, torch.tensor([0.5, 0.5, -0.5], dtype=torch.float64))
    assert scorer.tracker.visits(["x", "y"]).tolist() == [1, 1]
    second = scorer.tracker_baseline(["x", "x"], torch.tensor([1.0, 0.0]), [0, 1], ["c1", "c3"])[0]
    # c1's third row reuses its R - v; c3 (x at version 1) sees c1 once. spo++: alpha = .5*.5 + .5*1 = .75,
    # beta = .5*.5 = .25 -> v = .75. spo (alpha <- rho alpha + R): alpha = .25 + 1, beta = .25 -> v = 5/6.
    value = 0.75 if estimator == "spo++" else 5 / 6
    torch.testing.assert_close(second, torch.tensor([0.5, -value], dtype=torch.float64))
    assert scorer.tracker.visits(["x"]).tolist() == [2]


def test_tool_shaping_reads_correctness_from_the_named_reward(tmp_path):
    """With `correctness_scores` (the `tool_shaping_correct_reward` function's rewards), a sample whose total reward
    is high but whose named reward is below the threshold is not eligible."""
    fields = dict(advantage_estimator="spo++", num_generations=1, tool_shaping=True)
    scorer = make_scorer(config(tmp_path, **fields, tool_shaping_correct_reward="correct"))
    step = [("a", 0, 1.0, 10, 0), ("b", 0, 1.0, 10, 1), ("c", 0, 0.0, 10, 2)]
    size = len(step)
    result = scorer.score(
        keys=[s[0] for s in step],
        rewards=torch.tensor([s[2] for s in step], dtype=torch.float64),
        versions=[0] * size,
        token_counts=torch.full((size,), 10),
        group_ids=torch.arange(size),
        worker_advantages=torch.zeros(size),
        tool_positions=torch.tensor([2, 6, 1]),
        correctness_scores=torch.tensor([1.0, 0.0, 1.0], dtype=torch.float64),
    )
    # Eligible by the named reward: a and c (b's is 0, although its total is 1). Mean position 1.5, mean length 10:
    # b_a = -2 (2 - 1.5) / 10 = -0.1, b_c = -2 (1 - 1.5) / 10 = +0.1, each clipped to 0.7 |A|.
    base = score_step(make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1)), step).advantages
    bound = 0.7 * base.abs()
    bias = torch.tensor([-0.1, 0.0, 0.1], dtype=torch.float64)
    torch.testing.assert_close(result.advantages, base + torch.maximum(torch.minimum(bias, bound), -bound))
    assert result.metrics["shaping/eligible_frac"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    ("estimator", "normalization"), [("spo++", "token"), ("spo", "batch"), ("group", "batch"), ("group", "group")]
)
def test_infinite_rewards_leave_their_samples_unscored(tmp_path, estimator, normalization):
    """As in ASPOTrainer, an infinite total reward is TRL's None: its sample gets 0 and every other advantage stays
    finite, including its group-mates' (the worker's z-score of that group is NaN)."""
    generations = 1 if estimator != "group" else 2
    scorer = make_scorer(
        config(
            tmp_path,
            advantage_estimator=estimator,
            advantage_normalization=normalization,
            num_generations=generations,
            value_reward_range=[0, 2] if estimator != "group" else None,
        )
    )
    step = [("x", 0, float("inf"), 3, 0), ("x", 0, 1.0, 3, 0), ("y", 0, 0.0, 3, 1), ("y", 0, 2.0, 3, 1)]
    worker = torch.tensor([float("nan"), float("nan"), -1.0, 1.0])
    result = score_step(scorer, step, worker_advantages=worker)
    assert bool(torch.isfinite(result.advantages).all())
    assert result.advantages[0] == 0.0
    if scorer.tracker is not None:
        assert scorer.tracker.visits(["x"]).tolist() == [1]  # the infinite one was not observed


def test_spo_plus_plus_prior_is_anchored_at_the_first_dispatch_whatever_the_arrival_order(tmp_path):
    """x was first dispatched at version 3. Its outcome of version 6 (R = 1) is observed; a stale x@3 then arrives
    in x@8's step or a step later. Anchored at the first dispatch (as the worker stamps it), v(x@8) is the same in
    both orders; anchored at the earliest scored version it was 0.7994 in one and 0.75 in the other."""
    # z0 = 3, rho = 0.875, relative to the newest event 6: alpha = 0.875^3 * 0.5 + 1 = 1.3349609375,
    # beta = 0.875^3 * 0.5 = 0.3349609375 (x@3 is not visible to x@8 in the same step, nor in the later one's order)
    anchored = 1.3349609375 / 1.669921875
    assert anchored == pytest.approx(0.7994152, abs=1e-7)

    def value_at_8(same_step: bool, entry: int | None):
        scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=1))

        def step(versions, rewards):
            entries = None if entry is None else [entry] * len(versions)
            return scorer.tracker_baseline(
                ["x"] * len(versions), torch.tensor(rewards, dtype=torch.float64), versions, entry_versions=entries
            )[0]

        step([6], [1.0])
        if same_step:
            advantages = step([8, 3], [0.0, 1.0])
        else:
            advantages = step([8], [0.0])
            step([3], [1.0])
        return -advantages[0].item()  # R = 0, so A = -v

    for same_step in (True, False):
        assert value_at_8(same_step, entry=3) == pytest.approx(anchored, abs=1e-12)
    # Without the dispatch version (a worker that does not stamp it) the anchor follows the arrivals.
    assert value_at_8(True, entry=None) == pytest.approx(anchored, abs=1e-12)
    assert value_at_8(False, entry=None) == pytest.approx(0.75, abs=1e-12)


def test_identical_completions_of_a_group_are_separate_outcomes_and_forked_rows_one(tmp_path):
    """Four rollouts of one group that all wrote "42" (R = 1) are four outcomes: the next value is
    (0.5 + 4) / (1 + 4) = 0.9 under spo++ (0.75 were they one). The conversation id is the rollout's (TRL's
    rollout_id), which a conversation's forked rows share: the two rows of one conversation below count once."""
    from types import SimpleNamespace

    from trl_aspo.trainers.async_aspo_trainer import _conversation_id

    scorer = make_scorer(config(tmp_path, advantage_estimator="spo++", num_generations=4))
    # Rollouts r0..r3 of group 0 at version 0; r1 forked into two rows.
    rows = [
        SimpleNamespace(group_id=0, model_version=0, rollout_id=rollout, completion="42")
        for rollout in ("r0", "r1", "r1", "r2", "r3")
    ]
    first, _ = scorer.tracker_baseline(
        ["x"] * 5,
        torch.ones(5, dtype=torch.float64),
        [0] * 5,
        [_conversation_id(row) for row in rows],
        entry_versions=[0] * 5,
    )
    torch.testing.assert_close(first, torch.full((5,), 0.5, dtype=torch.float64))  # every row: 1 - prior 0.5
    assert scorer.tracker.visits(["x"]).tolist() == [4]
    nxt, _ = scorer.tracker_baseline(["x"], torch.zeros(1, dtype=torch.float64), [1], entry_versions=[0])
    # At version 1, relative to the newest event 0: alpha = 0.5 + 4, beta = 0.5.
    assert -nxt.item() == pytest.approx(0.9, abs=1e-12)
    # A row without a rollout id (a worker that does not stamp it) is its own rollout.
    unstamped = SimpleNamespace(group_id=0, model_version=0, completion="42")
    assert _conversation_id(unstamped) != _conversation_id(unstamped)


def test_a_group_split_across_two_steps_is_shaped_with_the_whole_group(tmp_path):
    """The reviewer's group (issue 31 item 10): 4 correct callers at positions 2, 10, 30, 40 of 50 action tokens, each
    with advantage 0.8 (the worker's, kept by advantage_normalization='group'), scored as two steps of 2. Whole group:
    mean position 20.5, b_i = -2 (p_i - 20.5) / 50 = 0.74, 0.42, -0.38, -0.78, clipped to 0.7 x 0.8 = 0.56, so
    1.36, 1.22, 0.42, 0.24. Each half alone (mean positions 6 and 35) gave 0.96, 0.64, 1.00, 0.60."""
    scorer = make_scorer(config(tmp_path, num_generations=4, tool_shaping=True))
    group = [("x", 0, 1.0, 50, 0)] * 4
    positions = torch.tensor([2, 10, 30, 40])
    advantages = torch.full((4,), 0.8, dtype=torch.float64)
    in_step = torch.tensor([True, True, False, False])

    first = score_step(scorer, group, advantages, positions, in_step).advantages
    second = score_step(scorer, group, advantages, positions[[2, 3, 0, 1]], in_step).advantages
    assert first.tolist() == pytest.approx([1.36, 1.22], abs=1e-12)
    assert second.tolist() == pytest.approx([0.42, 0.24], abs=1e-12)
    alone = [score_step(scorer, group[:2], advantages[:2], positions[i : i + 2]) for i in (0, 2)]
    assert [value for part in alone for value in part.advantages.tolist()] == pytest.approx([0.96, 0.64, 1.0, 0.6])


def test_a_group_estimator_gets_each_groups_raw_rewards_with_members_outside_the_step(tmp_path):
    """Group 0 is split: its rows 0, 1 are in the step, rows 2, 3 (another step's) only enter its mean; a forked
    conversation's two rows count once. Group 0's conversations: 1.0, 0.0 (forked into rows 1 and 3), 0.5 -> mean 0.5;
    the unscored row 4 of group 1 takes part in nothing: group 1's mean is 0.2, its own."""
    scorer = make_scorer(config(tmp_path, num_generations=3, advantage_normalization="batch"))
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.0, float("nan"), 0.2], dtype=torch.float64)
    centered = scorer.group_baseline(rewards, torch.tensor([0, 0, 0, 0, 1, 1]), ["a", "b", "c", "b", "d", "e"])
    assert centered.tolist() == pytest.approx([0.5, -0.5, 0.0, -0.5, 0.0, 0.0], abs=1e-15)
    scored = scorer.score(
        keys=["x"] * 6,
        rewards=rewards,
        versions=[0] * 6,
        token_counts=torch.full((6,), 3),
        group_ids=torch.tensor([0, 0, 0, 0, 1, 1]),
        worker_advantages=torch.zeros(6),
        conversations=["a", "b", "c", "b", "d", "e"],
        in_step=torch.tensor([True, True, False, False, True, True]),
    )
    # Normalized over the step's scorable rows only: 0.5, -0.5, 0.0 (mean 0, unbiased std 0.5); the unscored row 0.
    assert scored.advantages.tolist() == pytest.approx([1.0, -1.0, 0.0, 0.0], abs=1e-6)
    # zero_advantage_share over the step's three scorable rows (the unscored one and the other step's are not counted).
    assert scored.metrics["zero_advantage_share"] == pytest.approx(1 / 3)


def test_an_unscorable_sample_takes_part_in_no_statistic(tmp_path):
    """issue 31 item 12: in a round of 8 with one unscored sample, `zero_advantage_share` is over the 7 scorable ones:
    group x (1, 1, 1, unscored) gives three zero advantages, group y (1, 0, 1, 0) none, so 3/7 (counting the unscored
    sample's 0, as before, gave 4/8); shaping's eligible share is over the 7 too (5/7, not 5/8)."""
    scorer = make_scorer(config(tmp_path, num_generations=4, advantage_normalization="batch", tool_shaping=True))
    step = [("x", 0, r, 10, 0) for r in (1.0, 1.0, 1.0, float("nan"))] + [("y", 0, r, 10, 1) for r in (1.0, 0.0) * 2]
    # Every completion calls a tool at position 1; the correct scorable ones (x's three, y's two) are eligible.
    scored = score_step(scorer, step, tool_positions=torch.ones(8, dtype=torch.long))
    assert scored.metrics["zero_advantage_share"] == pytest.approx(3 / 7)
    assert scored.metrics["shaping/eligible_frac"] == pytest.approx(5 / 7)
    assert scored.advantages[3] == 0.0


@pytest.mark.parametrize("value_reward_range", [None, [0.0, 1.0]])
def test_reward_range_message_says_an_environment_reward_adds_to_the_total(tmp_path, value_reward_range):
    """Issue 45 item 6: TRL adds an environment's get_reward (weight 1) to the reward functions' total, which is what
    leaves [0, 1] when both score 1; the message says so, in both trainers' configs."""
    from trl_aspo import ASPOConfig
    from trl_aspo.values.single_stream import tracker_rewards

    for args in (
        config(tmp_path, advantage_estimator="spo++", num_generations=1, value_reward_range=value_reward_range),
        ASPOConfig(
            output_dir=str(tmp_path),
            advantage_estimator="spo++",
            num_generations=1,
            use_cpu=True,
            report_to="none",
            value_reward_range=value_reward_range,
        ),
    ):
        with pytest.raises(ValueError, match=r"environment.*get_reward.*adds to the reward functions' total"):
            tracker_rewards(torch.tensor([1.0, 2.0]), args)
