"""StepScoringDataset (trl_aspo.infra.step_batches): one optimizer step's samples scored together, with the members of
its groups outside the step handed over as context (issue 31 item 10), and filtered samples left out."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from trl_aspo.infra.step_batches import StepScoringDataset


def rows(spec: str) -> list[SimpleNamespace]:
    """Samples from "0a 0b 0b 1c": group id then conversation (a repeated conversation is a forked one's rows)."""
    return [
        SimpleNamespace(group_id=int(token[:-1]), rollout=token[-1], name=f"{token}#{i}")
        for i, token in enumerate(spec.split())
    ]


def run(samples, step_size, group_size, drop=lambda sample: False):
    """The scoring calls (step names, context names) and the yielded items' names and advantages."""
    recorder = SimpleNamespace(last=None)

    def source():
        for sample in samples:
            recorder.last = sample
            yield {"name": sample.name}

    calls = []

    def score(step, context):
        calls.append(([s.name for s in step], [s.name for s in context]))
        return torch.arange(len(step), dtype=torch.float64)

    dataset = StepScoringDataset(
        source(),
        recorder,
        step_size,
        score,
        drop,
        group_size=group_size,
        conversation=lambda sample: (sample.group_id, sample.rollout),
    )
    items = list(dataset)
    return calls, [(item["name"], item["advantage"]) for item in items]


def test_a_group_split_two_by_two_gets_its_other_half_as_context():
    calls, items = run(rows("0a 0b 0c 0d 1e 1f 1g 1h"), step_size=2, group_size=4)
    assert calls[:2] == [
        (["0a#0", "0b#1"], ["0c#2", "0d#3"]),  # the rest of group 0 read ahead
        (["0c#2", "0d#3"], ["0a#0", "0b#1"]),  # group 0's members of the previous step
    ]
    assert len(calls) == 4 and [name for name, _ in items][:4] == ["0a#0", "0b#1", "0c#2", "0d#3"]
    assert [advantage for _, advantage in items] == [0.0, 1.0] * 4


def test_whole_groups_in_a_step_need_no_context():
    calls, _ = run(rows("0a 0b 1c 1d 2e 2f 3g 3h"), step_size=4, group_size=2)
    assert calls == [(["0a#0", "0b#1", "1c#2", "1d#3"], []), (["2e#4", "2f#5", "3g#6", "3h#7"], [])]


def test_a_forked_conversation_counts_once_and_a_group_may_span_steps():
    # Group 0 has 4 conversations in 5 rows (b forked); group 1 has 4.
    calls, items = run(rows("0a 0b 0b 0c 0d 1e 1f 1g 1h"), step_size=4, group_size=4)
    assert calls == [
        (["0a#0", "0b#1", "0b#2", "0c#3"], ["0d#4"]),  # 3 conversations in the step: d is read ahead
        (["0d#4", "1e#5", "1f#6", "1g#7"], ["0a#0", "0b#1", "0b#2", "0c#3", "1h#8"]),
    ]
    assert [name for name, _ in items] == ["0a#0", "0b#1", "0b#2", "0c#3", "0d#4", "1e#5", "1f#6", "1g#7"]


def test_reading_ahead_stops_where_another_group_begins_or_the_stream_ends():
    # Group 0 ends after 3 of its 4 conversations (a worker that dropped one): 1d starts the next step, no context.
    calls, _ = run(rows("0a 0b 0c 1d 1e 1f 1g"), step_size=2, group_size=4)
    assert calls[0] == (["0a#0", "0b#1"], ["0c#2"])
    assert calls[1] == (["0c#2", "1d#3"], ["0a#0", "0b#1", "1e#4", "1f#5", "1g#6"])
    # The stream ends while group 1 is read ahead: its step is scored with what arrived.
    calls, _ = run(rows("0a 0b 1c 1d 1e"), step_size=4, group_size=4)
    assert calls == [(["0a#0", "0b#1", "1c#2", "1d#3"], ["1e#4"])]


def test_one_completion_per_prompt_reads_nothing_ahead():
    calls, _ = run(rows("0a 1b 2c 3d"), step_size=2, group_size=1)
    assert calls == [(["0a#0", "1b#1"], []), (["2c#2", "3d#3"], [])]


def test_dropped_samples_are_left_out_and_their_share_logged():
    shares = []
    recorder = SimpleNamespace(last=None)
    samples = rows("0a 0b 1c 1d 2e 2f")

    def source():
        for sample in samples:
            recorder.last = sample
            yield {"name": sample.name}

    dataset = StepScoringDataset(
        source(),
        recorder,
        2,
        lambda step, context: torch.zeros(len(step)),
        lambda s: s.group_id == 1,
        shares.append,
        group_size=2,
    )
    assert [item["name"] for item in dataset] == ["0a#0", "0b#1", "2e#4", "2f#5"]
    assert shares == [0.0, 0.5]
