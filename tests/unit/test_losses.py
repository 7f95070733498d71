"""Tests for trl_aspo.algorithms.losses: every expected number is computed independently of the fused
implementation."""

import math

import pytest
import torch

from trl_aspo.algorithms.losses import (
    aggregate_loss,
    asymmetric_policy_loss,
    entropy_split_mask,
    progressive_flip_threshold,
    repetition_rate,
    step_loss_normalizer,
    unflipped_sample_mask,
)

EL, EH, C = 0.2, 0.2, 3.0


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _uniform(shape, low, high, g):
    return low + (high - low) * torch.rand(shape, generator=g, dtype=torch.float64)


def _logps_with_ratios(ratio: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Current log-probs (leaf, requires grad) and old log-probs such that exp(lp - old) == ratio."""
    lp = _uniform(ratio.shape, -3.0, -0.1, g)
    old = lp - ratio.log()
    return lp.requires_grad_(), old


def _loss_and_grad(lp, old, adv, **kwargs):
    loss, stats = asymmetric_policy_loss(lp, old, adv, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    return loss.detach(), grad, stats


# (sign of A, ratio range, expected w(r, lp), expected value(A, r, lp), stats key set to 1)
TABLE = {
    "pos_flip": (1, (1 / C + 1e-3, 1 + EH - 1e-3), lambda r: 1 / r, lambda a, r, lp: -a / r, "flipped"),
    "pos_hard": (1, (1 + EH + 1e-3, 5.0), lambda r: 0 * r, lambda a, r, lp: -a / (1 + EH), "hard_clip_pos"),
    "pos_dual": (1, (1e-3, 1 / C - 1e-3), lambda r: C + 0 * r, lambda a, r, lp: -a * C * lp, "dual_clip_pos"),
    "neg_ppo": (-1, (1 - EL + 1e-3, C - 1e-3), lambda r: r, lambda a, r, lp: -a * r, None),
    "neg_hard": (-1, (1e-3, 1 - EL - 1e-3), lambda r: 0 * r, lambda a, r, lp: -a * (1 - EL), "hard_clip_neg"),
    "neg_dual": (-1, (C + 1e-3, 20.0), lambda r: C + 0 * r, lambda a, r, lp: -a * C * lp, "dual_clip_neg"),
    "zero": (0, (1e-3, 20.0), lambda r: 0 * r, lambda a, r, lp: 0 * r, None),
}


@pytest.mark.parametrize("per_token_adv", [False, True])
@pytest.mark.parametrize("row", list(TABLE))
def test_gradient_weight_table(row, per_token_adv):
    sign, (low, high), weight, value, stat_key = TABLE[row]
    g = _gen(list(TABLE).index(row))
    batch, seq = 4, 16
    ratio = _uniform((batch, seq), low, high, g)
    lp, old = _logps_with_ratios(ratio, g)
    adv_shape = (batch, seq) if per_token_adv else (batch,)
    adv = sign * _uniform(adv_shape, 0.5, 2.0, g)
    adv_bt = adv if per_token_adv else adv[:, None].expand(batch, seq)

    loss, grad, stats = _loss_and_grad(lp, old, adv, epsilon_low=EL, epsilon_high=EH, dual_clip=C)

    torch.testing.assert_close(grad, -adv_bt * weight(ratio), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(loss, value(adv_bt, ratio, lp.detach()), rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(stats["ratio"], ratio.float())
    indicator_keys = ["flipped", "hard_clip_pos", "hard_clip_neg", "dual_clip_pos", "dual_clip_neg"]
    expected_on = {stat_key} | ({"flipped"} if sign > 0 else set())
    for key in indicator_keys:
        assert stats[key].dtype == torch.float32
        assert torch.all(stats[key] == float(key in expected_on)), key
    expected_flip_weight = weight(ratio) if sign > 0 else torch.zeros_like(ratio)
    torch.testing.assert_close(stats["flip_weight"], expected_flip_weight.float())


def _reference_loss(lp, old, adv, el, eh, dual, flip_threshold=0.0, unflipped_mask=None):
    """The docs/design.md expressions written literally with autograd ops."""
    adv = adv[:, None] if adv.dim() == 1 else adv
    r = torch.exp(torch.clamp(lp - old, -20, 20))
    c = torch.min(r, 1 + eh)
    flip_term = -adv * c / c.detach() / c.detach()
    dual_term = -adv * dual * lp
    ppo_term = -torch.min(r * adv, torch.clamp(r, 1 - el, 1 + eh) * adv)
    c_neg = torch.max(r, 1 - el)
    neg_term = -adv * c_neg
    flipped = adv > flip_threshold
    if unflipped_mask is not None:
        flipped = flipped & ~(unflipped_mask[:, None] if unflipped_mask.dim() == 1 else unflipped_mask)
    pos_flipped = torch.where(r < 1 / dual, dual_term, flip_term)
    negative = torch.where(r > dual, dual_term, neg_term)
    loss = torch.where(adv < 0, negative, torch.zeros_like(r))
    loss = torch.where(adv > 0, ppo_term, loss)
    return torch.where(flipped, pos_flipped, loss)


@pytest.mark.parametrize("options", ["plain", "entropy_split", "progressive", "unflipped"])
def test_fused_matches_literal_reference(options):
    g = _gen(1)
    batch, seq = 8, 64
    lp = _uniform((batch, seq), -4.0, -0.05, g).requires_grad_()
    old = lp.detach() + 1.2 * torch.randn((batch, seq), generator=g, dtype=torch.float64)
    adv = torch.randn((batch, seq), generator=g, dtype=torch.float64)
    adv[0, :8] = 0.0
    el = torch.full((batch, seq), EL, dtype=torch.float64)
    eh = torch.full((batch, seq), EH, dtype=torch.float64)
    kwargs, ref_kwargs = {}, {}
    if options == "entropy_split":
        hem = torch.rand((batch, seq), generator=g) < 0.3
        kwargs = dict(high_entropy_mask=hem, epsilon_low_high_entropy=0.4, epsilon_high_high_entropy=0.35)
        el = torch.where(hem, 0.4, el)
        eh = torch.where(hem, 0.35, eh)
    elif options == "progressive":
        kwargs = ref_kwargs = dict(flip_threshold=0.7)
    elif options == "unflipped":
        kwargs = ref_kwargs = dict(unflipped_mask=torch.tensor([True, False] * (batch // 2)))

    loss, grad, _ = _loss_and_grad(lp, old, adv, epsilon_low=EL, epsilon_high=EH, dual_clip=C, **kwargs)
    ref = _reference_loss(lp, old, adv, el, eh, C, **ref_kwargs)
    (ref_grad,) = torch.autograd.grad(ref.sum(), lp)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("adv_dim", [1, 2])
def test_on_policy_gradient_equals_trl_dapo_surrogate(adv_dim):
    g = _gen(2)
    batch, seq = 6, 32
    lp = _uniform((batch, seq), -5.0, -0.01, g).requires_grad_()
    adv = torch.randn((batch,) if adv_dim == 1 else (batch, seq), generator=g, dtype=torch.float64)
    mask = (torch.rand((batch, seq), generator=g) < 0.8).double()
    normalizer = 37.5  # any global count the trainer would pass

    ours, _ = asymmetric_policy_loss(lp, lp.detach(), adv, epsilon_low=0.2, epsilon_high=0.28)
    (grad,) = torch.autograd.grad(aggregate_loss(ours, mask, "token", normalizer), lp)

    a = adv[:, None] if adv_dim == 1 else adv
    coef_1 = torch.exp(lp - lp.detach())
    coef_2 = torch.clamp(coef_1, 1 - 0.2, 1 + 0.28)
    trl_loss = -torch.min(coef_1 * a, coef_2 * a)
    (trl_grad,) = torch.autograd.grad((trl_loss * mask).sum() / normalizer, lp)
    torch.testing.assert_close(grad, trl_grad, rtol=1e-6, atol=1e-6)


def test_numerical_safety_extreme_ratios_padding_and_zero_advantages():
    lp = torch.tensor([[-1.0, -2.0, 0.0, 0.0], [-0.5, -1.0, -3.0, 0.0]], requires_grad=True)
    # +-50 log-ratios, and padding where old log-probs are a large negative fill value.
    old = torch.tensor([[-51.0, 48.0, -1e4, -1e4], [49.5, -51.0, -3.0, -1e4]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    for adv in (torch.tensor([1.5, -2.0]), torch.tensor([-1.0, 3.0]), torch.zeros(2), torch.zeros(2, 4)):
        loss, stats = asymmetric_policy_loss(lp, old, adv)
        assert torch.isfinite(loss).all()
        assert all(torch.isfinite(v).all() for v in stats.values())
        assert stats["ratio"].max() <= math.exp(20) * (1 + 1e-6)
        for aggregation in ("token", "sequence"):
            (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, aggregation), lp, retain_graph=True)
            assert torch.isfinite(grad).all()
            assert torch.all(grad[mask == 0] == 0)
            if not adv.any():
                assert torch.all(grad == 0)


def test_masked_tokens_get_no_gradient_and_saved_tensors_are_compact():
    g = _gen(3)
    lp = torch.randn((4, 10), generator=g).requires_grad_()
    old = lp.detach() + torch.randn((4, 10), generator=g)
    mask = torch.ones(4, 10)
    mask[:, 6:] = 0
    mask[3] = 0  # a completion with no valid token
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        loss, _ = asymmetric_policy_loss(lp, old, torch.randn(4, generator=g))
    assert len(saved) == 1 and saved[0].shape == (4, 10)
    (grad,) = torch.autograd.grad(aggregate_loss(loss, mask, "sequence"), lp)
    assert torch.all(grad[mask == 0] == 0) and torch.any(grad[mask == 1] != 0)


def test_entropy_split_mask_hand_example_and_torch_quantile():
    entropies = torch.tensor([[0.1, 0.5, 0.3, 0.9, 0.7], [0.2, 0.6, 0.4, 5.0, 5.0], [1.0, 2.0, 3.0, 4.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    # row 0: sorted (.1 .3 .5 .7 .9), position 0.8*4 = 3.2 -> 0.74; row 1: (.2 .4 .6), 1.6 -> 0.52.
    expected = torch.tensor([[0, 0, 0, 1, 0], [0, 1, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert torch.equal(entropy_split_mask(entropies, mask, 0.8), expected)
    # Ties at the threshold are not "strictly above".
    assert not entropy_split_mask(torch.ones(1, 4), torch.ones(1, 4), 0.5).any()

    g = _gen(4)
    ent = torch.rand((6, 30), generator=g)
    valid = torch.rand((6, 30), generator=g) < 0.6
    for q in (0.0, 0.3, 0.8, 1.0):
        got = entropy_split_mask(ent, valid, q)
        for row in range(6):
            threshold = torch.quantile(ent[row][valid[row]], q)
            assert torch.equal(got[row], valid[row] & (ent[row] > threshold))


def test_wide_offsets_apply_exactly_on_high_entropy_tokens():
    ratio = torch.tensor([[1.3, 1.3, 0.7, 0.7]], dtype=torch.float64)
    lp, old = _logps_with_ratios(ratio, _gen(5))
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]], dtype=torch.float64)
    hem = torch.tensor([[True, False, True, False]])
    _, grad, stats = _loss_and_grad(
        lp, old, adv, high_entropy_mask=hem, epsilon_low_high_entropy=0.4, epsilon_high_high_entropy=0.4
    )
    # Wide offsets (0.4): 1.3 is inside [1/3, 1.4] -> flip weight 1/1.3; 0.7 is inside [0.6, 3] -> weight 0.7.
    expected = torch.tensor([[-2.0 / 1.3, 0.0, 2.0 * 0.7, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected)
    assert stats["hard_clip_pos"].tolist() == [[0, 1, 0, 0]]
    assert stats["hard_clip_neg"].tolist() == [[0, 0, 0, 1]]
    # Only one wide offset given: the other keeps the normal value.
    _, grad, _ = _loss_and_grad(lp, old, adv, high_entropy_mask=hem, epsilon_high_high_entropy=0.4)
    torch.testing.assert_close(grad, torch.tensor([[-2.0 / 1.3, 0.0, 0.0, 0.0]], dtype=torch.float64))


def test_progressive_flip_threshold_schedule_and_effect():
    assert progressive_flip_threshold(0, 1.0, 100) == 1.0
    assert progressive_flip_threshold(25, 1.0, 100) == 0.75
    assert progressive_flip_threshold(100, 1.0, 100) == 0.0
    assert progressive_flip_threshold(150, 1.0, 100) == 0.0
    assert progressive_flip_threshold(10, 1.0, 0) == 0.0
    with pytest.raises(ValueError, match="decay_steps"):
        progressive_flip_threshold(0, 1.0, -1)

    ratio = torch.full((1, 4), 0.5, dtype=torch.float64)
    lp, old = _logps_with_ratios(ratio, _gen(6))
    adv = torch.tensor([[0.3, 0.5, 0.8, -0.5]], dtype=torch.float64)
    loss, grad, stats = _loss_and_grad(lp, old, adv, flip_threshold=0.5)
    # 0.3 and 0.5 (<= threshold): PPO, w = r = 0.5; 0.8: flipped, w = 1/r = 2; -0.5: r < 0.8, hard clip.
    torch.testing.assert_close(grad, torch.tensor([[-0.15, -0.25, -1.6, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(loss, torch.tensor([[-0.15, -0.25, -1.6, 0.4]], dtype=torch.float64))
    assert stats["flipped"].tolist() == [[0, 0, 1, 0]]
    assert stats["flip_weight"].tolist() == [[0, 0, 2, 0]]


def test_unflipped_sample_mask_and_effect():
    # Five of the eight samples have A > 0 (indices 0, 2, 4, 6, 7): 0.4 of them is 2, drawn among those five only.
    sample_advantages = torch.tensor([0.5, -1.0, 0.2, 0.0, 0.3, -0.1, 0.9, 0.4])
    positive = torch.tensor([0, 2, 4, 6, 7])
    mask = unflipped_sample_mask(sample_advantages, 0.4, _gen(7))
    assert mask.dtype == torch.bool and mask.shape == (8,) and int(mask.sum()) == 2
    assert not mask[sample_advantages <= 0].any()
    expected = torch.zeros(8, dtype=torch.bool)
    expected[positive[torch.randperm(5, generator=_gen(7))[:2]]] = True
    assert torch.equal(mask, expected)
    assert int(unflipped_sample_mask(sample_advantages, 0.5, _gen(0)).sum()) == round(2.5)
    assert torch.equal(unflipped_sample_mask(sample_advantages, 1.0, _gen(0)), sample_advantages > 0)
    assert not unflipped_sample_mask(sample_advantages, 0.0, _gen(0)).any()
    assert not unflipped_sample_mask(-sample_advantages.abs(), 1.0, _gen(0)).any()
    with pytest.raises(ValueError, match="fraction"):
        unflipped_sample_mask(sample_advantages, 1.5, _gen(0))
    with pytest.raises(ValueError, match="1-D"):
        unflipped_sample_mask(sample_advantages.view(2, 4), 0.5, _gen(0))

    # r = 0.5 and 2.0: unflipped positives use PPO (w = r, hard clip above 1.2), flipped ones w = 1/r.
    ratio = torch.tensor([[0.5, 2.0], [0.5, 2.0], [0.5, 2.0]], dtype=torch.float64)
    lp, old = _logps_with_ratios(ratio, _gen(8))
    adv = torch.tensor([1.0, 1.0, -1.0], dtype=torch.float64)
    unflipped = torch.tensor([True, False, True])
    loss, grad, stats = _loss_and_grad(lp, old, adv, unflipped_mask=unflipped)
    torch.testing.assert_close(grad, torch.tensor([[-0.5, 0.0], [-2.0, 0.0], [0.0, 2.0]], dtype=torch.float64))
    torch.testing.assert_close(loss[0], torch.tensor([-0.5, -1.2], dtype=torch.float64))
    assert stats["flipped"].tolist() == [[0, 0], [1, 1], [0, 0]]


def test_infinite_dual_clip_disables_it():
    ratio = torch.tensor([[0.1, 10.0]], dtype=torch.float64)
    lp, old = _logps_with_ratios(ratio, _gen(9))
    loss, grad, stats = _loss_and_grad(lp, old, torch.tensor([[1.0, -1.0]], dtype=torch.float64), dual_clip=math.inf)
    torch.testing.assert_close(grad, torch.tensor([[-10.0, 10.0]], dtype=torch.float64))
    assert torch.isfinite(loss).all() and stats["flip_weight"].tolist() == [[pytest.approx(10.0), 0.0]]


def test_separate_dual_clip_constants_per_sign():
    # r = 0.25 and 0.4 on positive tokens (1/r = 4 and 2.5), r = 2.5 and 4 on negative ones; C_pos = 2, C_neg = 5.
    ratio = torch.tensor([[0.25, 0.4, 2.5, 4.0]], dtype=torch.float64)
    lp, old = _logps_with_ratios(ratio, _gen(10))
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]], dtype=torch.float64)
    loss, grad, stats = _loss_and_grad(lp, old, adv, dual_clip=3.0, dual_clip_pos=2.0, dual_clip_neg=5.0)
    # 1/0.25 = 4 > C_pos = 2: weight 2; 1/0.4 = 2.5 > 2: weight 2; r = 2.5 and 4 < C_neg = 5: PPO weight r.
    torch.testing.assert_close(grad, torch.tensor([[-2.0, -2.0, 2.5, 4.0]], dtype=torch.float64))
    assert stats["dual_clip_pos"].tolist() == [[1, 1, 0, 0]] and stats["dual_clip_neg"].tolist() == [[0, 0, 0, 0]]
    assert stats["flip_weight"].tolist() == [[2.0, 2.0, 0.0, 0.0]]
    torch.testing.assert_close(loss[0, :2], -2.0 * lp.detach()[0, :2])
    # Only the negative constant set: C_pos falls back to the shared C = 3 (1/0.25 = 4 > 3, 1/0.4 = 2.5 < 3).
    _, grad, _ = _loss_and_grad(lp, old, adv, dual_clip=3.0, dual_clip_neg=3.5)
    torch.testing.assert_close(grad, torch.tensor([[-3.0, -2.5, 2.5, 3.5]], dtype=torch.float64))
    with pytest.raises(ValueError, match="dual_clip_neg"):
        asymmetric_policy_loss(lp, old, adv, dual_clip_neg=1.0)


def test_low_precision_inputs_keep_gradient_dtype():
    lp = torch.randn(2, 8, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = asymmetric_policy_loss(lp, lp.detach().float() + 0.1, torch.ones(2))
    loss.sum().backward()
    assert loss.dtype == torch.float32 and lp.grad.dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (dict(old_per_token_logps=torch.zeros(2, 4)), "old_per_token_logps"),
        (dict(advantages=torch.zeros(3)), "advantages"),
        (dict(advantages=torch.zeros(2, 4, 1)), "advantages"),
        (dict(dual_clip=1.0), "dual_clip"),
        (dict(dual_clip=0.5), "dual_clip"),
        (dict(epsilon_low=-0.1), "epsilon_low"),
        (dict(epsilon_high=-0.1), "epsilon_high"),
        (dict(flip_threshold=-1.0), "flip_threshold"),
        (dict(high_entropy_mask=torch.ones(2, 3, dtype=torch.bool)), "high_entropy_mask"),
        (
            dict(high_entropy_mask=torch.ones(2, 5, dtype=torch.bool), epsilon_low_high_entropy=-0.4),
            "epsilon_low_high_entropy",
        ),
        (dict(unflipped_mask=torch.ones(5, dtype=torch.bool)), "unflipped_mask"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_argument(kwargs, name):
    args = dict(
        per_token_logps=torch.zeros(2, 5, requires_grad=True),
        old_per_token_logps=torch.zeros(2, 5),
        advantages=torch.ones(2),
    )
    args.update(kwargs)
    with pytest.raises(ValueError, match=f"`{name}`"):
        asymmetric_policy_loss(**args)


def test_aggregate_loss_hand_numbers():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate_loss(loss, mask, "token").item() == pytest.approx(7 / 3)
    assert aggregate_loss(loss, mask, "token", normalizer=7.0).item() == pytest.approx(1.0)
    assert aggregate_loss(loss, mask, "sequence").item() == pytest.approx((1.5 + 4.0) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate_loss(loss, mask, "dapo")
    assert aggregate_loss(loss, mask, "sequence", normalizer=4.0).item() == pytest.approx((1.5 + 4.0) / 4)


def _step_weights(micro_batches, aggregation):
    """Gradient weight of every token of one optimizer step: `micro_batches[m][r]` is the per-completion token
    counts of rank r's micro-batch m. Each rank's loss uses `step_loss_normalizer` over the whole step; DDP averages
    the ranks' gradients and accumulation sums the micro-batches, as in training."""
    world = len(micro_batches[0])
    units = [count for batch in micro_batches for rank in batch for count in rank]
    step_units = sum(units) if aggregation == "token" else len(units)
    values, total = [], 0.0
    for batch in micro_batches:
        for counts in batch:
            mask = torch.zeros(len(counts), max(counts))
            for row, count in enumerate(counts):
                mask[row, :count] = 1
            per_token = torch.zeros_like(mask, requires_grad=True)
            total = total + aggregate_loss(per_token, mask, aggregation, step_loss_normalizer(step_units, world))
            values.append((per_token, mask))
    (total / world).backward()
    return [per_token.grad[mask.bool()].tolist() for per_token, mask in values]


def test_sequence_aggregation_weighs_every_completion_of_the_step_alike():
    # TRL's batcher gives rank 0 one long completion and rank 1 seven short ones: each weighs 1/8 of the step
    # (a per-rank mean averaged by DDP gave 0.5 and 0.5/7 = 0.071).
    long, shorts = _step_weights([[[12], [2] * 7]], "sequence")
    assert sum(long) == pytest.approx(0.125)
    assert [sum(shorts[2 * i : 2 * i + 2]) for i in range(7)] == pytest.approx([0.125] * 7)


def test_token_aggregation_weighs_every_token_of_the_step_alike():
    # Two micro-batches of 10 and 30 action tokens on one rank: every token weighs 1/40 = 0.025 (a per-micro-batch
    # mean halved for two accumulation steps gave 0.05 and 0.0167); the same over two ranks with unequal shares.
    first, second = _step_weights([[[4, 6]], [[30]]], "token")
    assert first + second == pytest.approx([0.025] * 40)
    weights = _step_weights([[[4, 6], [1]], [[29], [2, 3]]], "token")
    assert [w for rank in weights for w in rank] == pytest.approx([1 / 45] * 45)


def test_repetition_rate_hand_example():
    ids = torch.tensor(
        [
            [1, 2, 3, 4, 1, 2, 3, 4, 0],
            [1, 2, 3, 4, 5, 6, 7, 8, 9],
            [1, 2, 3, 4, 9, 1, 2, 3, 4],  # the repeat is broken by a masked (tool-output) token
            [5, 5, 5, 5, 5, 0, 0, 0, 0],  # overlapping repeat of (5, 5, 5, 5)
        ]
    )
    mask = torch.ones_like(ids)
    mask[2, 7] = 0
    mask[3, 5:] = 0
    assert repetition_rate(ids, mask, n=4).item() == pytest.approx(2 / 4)
    assert repetition_rate(ids, mask, n=2).item() == pytest.approx(3 / 4)
    assert repetition_rate(ids[:, :3], mask[:, :3], n=4).item() == 0.0


def test_repetition_rate_matches_a_per_row_count():
    """The batched count against a plain Python count of each row's distinct valid n-grams."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 3, (16, 12), generator=generator)
    mask = (torch.rand(16, 12, generator=generator) > 0.15).long()
    for n in (1, 2, 3, 4):
        expected = []
        for row, row_mask in zip(ids.tolist(), mask.tolist(), strict=True):
            grams = [tuple(row[i : i + n]) for i in range(len(row) - n + 1) if all(row_mask[i : i + n])]
            expected.append(len(set(grams)) < len(grams))
        assert repetition_rate(ids, mask, n=n).item() == pytest.approx(sum(expected) / len(expected))
