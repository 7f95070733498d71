"""The generator log-prob check on the asynchronous trainer's rollout samples (issue 45 item 4): the rule per sample,
whole groups dropped by the queue the trainer reads, and the truncate modes' default upper bound."""

from __future__ import annotations

import logging
import math
import queue
import re
from types import SimpleNamespace

import numpy as np
import pytest

from trl_aspo.infra.sample_checks import MIN_LOG_PROB, CheckedRolloutQueue, logprob_problem

IDS = [1, 2, 3, 4, 5]
MASK = [0, 0, 1, 1, 1]  # a two-token prompt, then three completion tokens
GOOD = [0.0, 0.0, -0.5, -2.0, -80.0]


def test_min_log_prob_is_log_of_float32_smallest_normal():
    assert pytest.approx(-126 * math.log(2)) == MIN_LOG_PROB  # float32's smallest normal is 2**-126: -87.3365
    assert pytest.approx(-87.3365, abs=1e-4) == MIN_LOG_PROB


@pytest.mark.parametrize(
    ("log_probs", "position", "message"),
    [
        ([0.0, 0.0, -0.5, math.nan, -1.0], 3, r"nan at completion token 3 must be finite"),
        ([0.0, 0.0, -0.5, -1.0, -math.inf], 4, r"-inf at completion token 4 must be finite"),
        ([0.0, 0.0, -1e30, -1.0, -1.0], 2, r"-1e\+30 at completion token 2 must be >= -87.34"),
        ([0.0, 0.0, -0.5, 0.25, -1.0], 3, r"0.25 at completion token 3 must be <= 0"),
        ([0.0, 0.0, -0.5, -87.4, -1.0], 3, r"-87.4 at completion token 3 must be >= -87.34"),
        ([0.0, 0.0, -0.5, -1.0], 4, r"4 generator log-probs \(old_log_probs\) for 5 input_ids"),
        ([*GOOD, -1.0], 5, r"6 generator log-probs \(old_log_probs\) for 5 input_ids"),
    ],
    ids=["nan", "-inf", "-1e30", "positive", "below-normal", "shorter", "longer"],
)
def test_each_bad_log_prob_is_named_with_its_position(log_probs, position, message):
    found = logprob_problem(IDS, MASK, np.asarray(log_probs, dtype=np.float32))
    assert found is not None and found[0] == position
    assert re.search(message, found[1]), found[1]


def test_good_log_probs_and_prompt_or_tool_positions_pass():
    assert logprob_problem(IDS, MASK, GOOD) is None
    # Prompt and tool-output positions (mask 0) are not read: TRL writes 0.0 there, a worker may write anything.
    assert logprob_problem(IDS, MASK, [math.nan, 5.0, -0.5, -2.0, MIN_LOG_PROB]) is None
    assert logprob_problem(IDS, MASK, [0.0, 0.0, 0.0, -0.0, -1.0]) is None  # probability 1 is allowed
    found = logprob_problem(IDS, [0, 1, 1], GOOD)
    assert found == (3, "3 completion_mask entries for 5 input_ids")


def _sample(group_id, log_probs=GOOD):
    return SimpleNamespace(
        group_id=group_id, input_ids=IDS, completion_mask=MASK, old_log_probs=log_probs, model_version=7
    )


BAD = [0.0, 0.0, -0.5, -1e30, -1.0]


def _drain(checked, count):
    return [checked.get(timeout=0) for _ in range(count)]


def test_queue_drops_the_whole_group_of_a_bad_sample_and_warns_once(caplog):
    stream = [_sample(0), _sample(0), _sample(1), _sample(1, BAD), _sample(2, BAD), _sample(2), _sample(3), _sample(3)]
    source = queue.Queue()
    for sample in stream:
        source.put(sample)
    dropped = []
    checked = CheckedRolloutQueue(source, dropped.append, group_size=2)
    with caplog.at_level(logging.WARNING, logger="trl_aspo.infra.sample_checks"):
        out = _drain(checked, 4)
        with pytest.raises(queue.Empty):
            checked.get(timeout=0)
    assert [sample.group_id for sample in out] == [0, 0, 3, 3]
    assert dropped == [1, 2]
    (record,) = caplog.records
    assert "group 1 (model version 7, 5 tokens): generator log-prob -1e+30 at completion token 3" in record.message
    assert "Its group (2 sample(s)) is dropped" in record.message
    assert checked.qsize() == 0  # anything else is the underlying queue's


def test_queue_closes_a_group_at_the_next_group_or_its_count():
    """Without a count reached (forked rows share a conversation), the next group closes the held one."""
    source = queue.Queue()
    for sample in [_sample(0), _sample(0, BAD), _sample(0), _sample(1), _sample(1)]:
        source.put(sample)
    dropped = []
    conversations = iter(["a", "a", "a", "c", "d"])  # group 0: one conversation in three rows
    stamped = {}

    def conversation(sample):
        if id(sample) not in stamped:
            stamped[id(sample)] = next(conversations)
        return stamped[id(sample)]

    checked = CheckedRolloutQueue(source, dropped.append, group_size=2, conversation=conversation)
    assert [sample.group_id for sample in _drain(checked, 2)] == [1, 1]
    assert dropped == [0]


def test_a_late_row_follows_its_counted_group():
    """A row arriving after its group was closed by the count: dropped with a dropped group (not counted twice),
    checked alone after a released one."""
    source = queue.Queue()
    stream = [_sample(0, BAD), _sample(0), _sample(0), _sample(1), _sample(1), _sample(1, BAD), _sample(1)]
    for sample in [*stream, _sample(2), _sample(2)]:
        source.put(sample)
    dropped = []
    checked = CheckedRolloutQueue(source, dropped.append, group_size=2)
    assert [sample.group_id for sample in _drain(checked, 5)] == [1, 1, 1, 2, 2]
    assert dropped == [0, 1]


def test_truncate_modes_default_clip_max_to_two_with_a_warning(tmp_path):
    from trl_aspo import AsyncASPOConfig

    fields = dict(output_dir=str(tmp_path), use_cpu=True, report_to="none", vllm_importance_sampling_correction=True)
    for mode in ("token_truncate", "sequence_truncate"):
        with pytest.warns(
            UserWarning, match=r"clip_max=None would leave the rollout weight unbounded above; it is set"
        ):
            config = AsyncASPOConfig(
                **fields,
                vllm_importance_sampling_mode=mode,
                vllm_importance_sampling_clip_min=0.5,
                vllm_importance_sampling_clip_max=None,
            )
        assert config.vllm_importance_sampling_clip_max == 2.0
    masked = AsyncASPOConfig(
        **fields,
        vllm_importance_sampling_mode="token_mask",
        vllm_importance_sampling_clip_min=0.5,
        vllm_importance_sampling_clip_max=None,
    )
    assert masked.vllm_importance_sampling_clip_max is None  # a mask without an upper bound weighs kept tokens by rho
