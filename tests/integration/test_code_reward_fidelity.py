"""Issue 31 items 6 and 7: correct solutions that scored 0.0 (and one wrong one that scored 1.0) before, and the
judge's memory bounded before it parses a reply. Real subprocesses through `code_unit_test_reward`; each test fails
on the code before issue 31."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from trl_aspo.evaluation.rewards import code_unit_test_reward, prompt_helpers


def _program(source: str) -> str:
    return f"```python\n{textwrap.dedent(source).strip()}\n```"


def _rewards(sources, tests, **kwargs) -> list[float]:
    return code_unit_test_reward([_program(source) for source in sources], tests, timeout=10.0, **kwargs)


# 7(a): `if __name__ == "__main__":` ----------------------------------------------------------------------------------


def test_a_main_block_of_a_correct_solution_does_not_run():
    tail = {
        "input": "    n = int(input())\n    print(add(n, n))",
        "unittest": "    import unittest\n    unittest.main()",
        "argparse": "    import argparse\n    parser = argparse.ArgumentParser()\n"
        "    parser.add_argument('n', type=int)\n    print(add(parser.parse_args().n, 1))",
        "exit": "    raise SystemExit(3)",
    }
    sources = [f"def add(a, b):\n    return a + b\n\nif __name__ == '__main__':\n{body}" for body in tail.values()]
    assert _rewards(sources, [["assert add(2, 3) == 5"]] * len(sources)) == [1.0] * len(sources)


# 7(b): results and arguments of other standard types -----------------------------------------------------------------


def test_generators_and_other_iterators_compare_as_the_tests_use_them():
    source = """
        import itertools
        def evens(n):
            for i in range(n):
                if i % 2 == 0:
                    yield i
        def squares(values):
            return map(lambda v: v * v, values)
        def naturals():
            return itertools.count()
        def pairs(items):
            return zip(items, items[1:])
        class Bag:
            def __init__(self, items):
                self.items = items
            def __iter__(self):
                return iter(self.items)
            def __len__(self):
                return len(self.items)
        def bag(items):
            return Bag(items)
    """
    tests = [
        "assert list(evens(7)) == [0, 2, 4, 6]",
        "assert sorted(squares([3, 1, 2])) == [1, 4, 9]",
        "assert 16 in squares([4])",
        "gen = evens(5)\nassert next(gen) == 0 and next(gen) == 2 and list(gen) == [4]",
        "assert list(itertools.islice(naturals(), 1000)) == list(range(1000))",  # infinite, taken lazily
        "assert list(pairs([1, 2, 3])) == [(1, 2), (2, 3)]",
        "assert sorted(bag([2, 1])) == [1, 2] and bool(bag([])) is False and bool(bag([1]))",
        "assert evens(3) != [0, 2]",  # a generator is not a list, as in one process
    ]
    wrong = "def evens(n):\n    yield from range(0, n, 3)"
    assert _rewards([source], [tests]) == [1.0]
    assert _rewards([wrong], [["assert list(evens(7)) == [0, 2, 4, 6]"]]) == [0.0]


def test_deque_range_dict_views_and_datetime_cross_as_themselves():
    source = """
        import collections, datetime
        def window(items):
            return collections.deque(items, maxlen=2)
        def span(n):
            return range(1, n)
        def keys(table):
            return table.keys()
        def values(table):
            return table.values()
        def items(table):
            return table.items()
        def next_day(day):
            return day + datetime.timedelta(days=1)
        def stamp(moment):
            return moment.replace(tzinfo=datetime.timezone.utc)
        def duration(a, b):
            return b - a
    """
    tests = [
        "import collections, datetime",
        "assert window([1, 2, 3]) == collections.deque([2, 3]) and window([1]).maxlen == 2",
        "assert span(4) == range(1, 4) and list(span(4)) == [1, 2, 3]",
        "assert keys({'b': 1, 'a': 2}) == {'a', 'b'} and list(keys({'b': 1, 'a': 2})) == ['b', 'a']",
        "assert sorted(values({'a': 2, 'b': 1})) == [1, 2]",
        "assert items({'a': 1}) == {('a', 1)}",
        "assert next_day(datetime.date(2020, 2, 28)) == datetime.date(2020, 2, 29)",
        "moment = datetime.datetime(2020, 1, 1, 12, 30, 15, 5)\n"
        "assert stamp(moment) == moment.replace(tzinfo=datetime.timezone.utc)",
        "assert duration(datetime.date(2020, 1, 1), datetime.date(2020, 3, 1)) == datetime.timedelta(days=60)",
    ]
    assert _rewards([source], [tests]) == [1.0]


def test_ordered_dicts_and_counters_compare_as_themselves():
    right = (
        "import collections\ndef tally(text):\n    return collections.OrderedDict((c, text.count(c)) for c in text)"
    )
    wrong = right.replace("OrderedDict(", "OrderedDict(sorted(").replace("in text)", "in text))")
    tests = ["import collections", "assert tally('ba') == collections.OrderedDict([('b', 1), ('a', 1)])"]
    assert _rewards([right, wrong], [tests] * 2) == [1.0, 0.0]  # the wrong order passed as a plain dict
    counter = "import collections\ndef count(items):\n    c = collections.Counter(items)\n    c['z'] = 0\n    return c"
    defaults = "import collections\ndef group(pairs):\n    d = collections.defaultdict(list)\n"
    defaults += "    for k, v in pairs:\n        d[k].append(v)\n    return d"
    assert _rewards(
        [counter, defaults],
        [
            ["import collections", "assert count('aab') == collections.Counter(a=2, b=1)"],
            ["assert group([(1, 'x'), (1, 'y')]) == {1: ['x', 'y']} and group([])[5] == []"],
        ],
    ) == [1.0, 1.0]


# 7(c): large arguments -----------------------------------------------------------------------------------------------


def test_large_int_arguments_cross_in_time():
    """10^6 ints took 4.4 s per call under load (the judge and the worker encoded each int as a tagged pair), and an
    argument over 64 MiB encoded (4.5 * 10^6 ints: 72 MB that way) crashed the worker's reader. A list of ints now
    crosses as one string of numbers (33 MB for those). The bound is loose: the machine is shared."""
    source = "def total(values):\n    return sum(values)\n\ndef double(values):\n    return [2 * v for v in values]"
    tests = [
        "big = list(range(10**6))",
        *["assert total(big) == sum(big)"] * 2,
        "assert double(big)[-1] == 2 * 10**6 - 2",
        "huge = list(range(4_500_000))",
        "assert total(huge) == sum(huge)",
    ]
    started = time.monotonic()
    assert code_unit_test_reward([_program(source)], [tests], timeout=60.0) == [1.0]
    assert time.monotonic() - started < 60


# 7(d): multiprocessing -----------------------------------------------------------------------------------------------


def test_multiprocessing_pool_works_in_the_worker():
    source = """
        import multiprocessing
        def square(x):
            return x * x
        def squares(values):
            with multiprocessing.Pool(2) as pool:
                return pool.map(square, values)
    """
    assert _rewards([source], [["assert squares([1, 2, 3]) == [1, 4, 9]"]]) == [1.0]


# 7(f): helpers the prompt defines ------------------------------------------------------------------------------------

CYCLIC_PROMPT = '''
def encode_cyclic(s: str):
    """returns encoded string by cycling groups of three characters."""
    groups = [s[(3 * i):min((3 * i + 3), len(s))] for i in range((len(s) + 2) // 3)]
    groups = [(group[1:] + group[0]) if len(group) == 3 else group for group in groups]
    return "".join(groups)


def decode_cyclic(s: str):
    """
    takes as input string encoded with encode_cyclic function. Returns decoded string.
    """
'''
CYCLIC_TESTS = """
import random, string

def check(candidate):
    for _ in range(50):
        text = ''.join(random.choice(string.ascii_lowercase) for _ in range(random.randint(10, 20)))
        assert candidate(encode_cyclic(text)) == text
"""


def test_a_helper_the_prompt_defines_is_the_prompts_in_the_tests():
    """HumanEval/38: a solution that redefines `encode_cyclic` as the identity and `decode_cyclic` too passed (the
    tests called its own `encode_cyclic`); with the prompt, the tests call the prompt's."""
    wrong = "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s"
    right = CYCLIC_PROMPT + "    return encode_cyclic(encode_cyclic(s))\n"
    chat = [{"role": "user", "content": f"Complete this function:\n```python\n{CYCLIC_PROMPT}```"}]
    for prompt in (CYCLIC_PROMPT, chat):
        rewards_ = _rewards(
            [wrong, right], [CYCLIC_TESTS] * 2, entry_point=["decode_cyclic"] * 2, prompts=[prompt] * 2
        )
        assert rewards_ == [0.0, 1.0]


# Issue 45 item 2: the function under test is never taken from the prompt ---------------------------------------------

ADD_TESTS = ["assert add(2, 3) == 5", "assert add(-4, 4) == 0", "assert add(10, 32) == 42"]


def test_a_function_the_prompt_asks_to_fix_is_the_solutions():
    """MBPP layout (no entry point), a prompt that shows the function to fix and no stub: the tests call the
    solution's `add`. Before issue 45 they called the prompt's buggy one, and the correct fix scored 0.0."""
    prompt = "Fix the bug in this function:\n```python\ndef add(a, b):\n    return a - b\n```"
    fix = "def add(a, b):\n    return a + b"
    assert _rewards([fix], [ADD_TESTS], prompts=[prompt]) == [1.0]
    assert prompt_helpers(prompt, None, "\n".join(ADD_TESTS)) == ""


def test_a_function_the_prompt_asks_to_rewrite_is_the_solutions():
    """ "Rewrite it without +": the prompt's `add` is correct, so taking it scored `return 42` 1.0 before issue 45."""
    prompt = [{"role": "user", "content": "Rewrite it without +:\n```python\ndef add(a, b):\n    return a + b\n```"}]
    wrong, right = "def add(a, b):\n    return 42", "def add(a, b):\n    return sum((a, b))"
    assert _rewards([wrong, right], [ADD_TESTS] * 2, prompts=[prompt] * 2) == [0.0, 1.0]


MBPP_CYCLIC_PROMPT = CYCLIC_PROMPT.replace("def decode_cyclic(s: str):", "def decode_cyclic(s: str):  # write this")
MBPP_CYCLIC_TESTS = [
    "assert encode_cyclic('abcdef') == 'bcaefd'",
    "assert decode_cyclic(encode_cyclic('abcdefg')) == 'abcdefg'",
    "assert decode_cyclic('bcaefd') == 'abcdef'",
]


def test_with_a_stub_in_the_prompt_its_full_functions_are_helpers_even_when_the_tests_call_them():
    """MBPP layout with a stub `decode_cyclic` and a full `encode_cyclic` that the tests also call: the prompt's
    `encode_cyclic` is the tests', so a wrong identity pair scores 0.0 and a right decoder 1.0."""
    wrong = "def encode_cyclic(s):\n    return s\n\ndef decode_cyclic(s):\n    return s"
    right = CYCLIC_PROMPT + "    return encode_cyclic(encode_cyclic(s))\n"
    rewards_ = _rewards([wrong, right], [MBPP_CYCLIC_TESTS] * 2, prompts=[MBPP_CYCLIC_PROMPT] * 2)
    assert rewards_ == [0.0, 1.0]
    helpers = prompt_helpers(MBPP_CYCLIC_PROMPT, None, "\n".join(MBPP_CYCLIC_TESTS))
    assert "def encode_cyclic" in helpers and "decode_cyclic" not in helpers


# Item 6: the judge's memory ------------------------------------------------------------------------------------------

_FLOOD = r"""
import os, stat, struct
def add(a, b):
    body = b"[" + b"[]," * 20_000_000 + b"[]]"  # 60 MB: 20M empty lists once parsed
    for fd in range(3, 64):
        try:
            if stat.S_ISSOCK(os.fstat(fd).st_mode):
                os.write(fd, struct.pack(">I", len(body)))
                view = memoryview(body)
                while view:
                    view = view[os.write(fd, view):]
        except OSError:
            pass
    os._exit(0)
"""


def test_a_reply_that_would_expand_in_the_judge_is_refused_before_it_is_parsed():
    """A 60 MB reply of 20M empty lists took the judge (outside the run's cgroup) to 1.1-1.3 GiB in json.loads.
    The largest process of the run (judge or worker) stays far below that.

    A child's ru_maxrss starts at its parent's high-water mark (Linux records the old memory's at exec, vfork and
    posix_spawn included), so the script must stay small: the code reward loads no torch (a script that did was
    already at 418-513 MiB before any judge ran)."""
    script = (
        "import resource, sys, warnings\nwarnings.simplefilter('ignore')\n"
        "from trl_aspo.evaluation import code_unit_test_reward\n"
        "assert 'torch' not in sys.modules\n"
        f"source = {_FLOOD!r}\n"
        "print(code_unit_test_reward(['```python\\n' + source + '```'], [['assert add(2, 3) == 5']], timeout=60.0))\n"
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rewards_, peak_kib = result.stdout.split("\n")[:2]
    assert rewards_ == "[0.0]"
    assert int(peak_kib) < 450 * 1024, f"a process of the run reached {int(peak_kib) >> 10} MiB"
