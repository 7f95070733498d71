"""Shared fixtures: one locally built tiny tokenizer per session, fresh tiny models and small datasets per test."""

from __future__ import annotations

import importlib.util
import os

import pytest
from helpers import tiny_run_fields

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# The vLLM tier needs vLLM's CPU build, which only the environment of `make test-vllm` has.
collect_ignore = [] if importlib.util.find_spec("vllm") else ["vllm_tier"]


@pytest.fixture(scope="session", autouse=True)
def field_table_folder(tmp_path_factory):
    """The session's own field-table cache folder (trl_aspo.cli.field_cache), also for the `trl-aspo` commands the
    tests start (they inherit the environment): no test reads or writes the user's cache."""
    from trl_aspo.cli.field_cache import CACHE_DIR_ENV

    folder = tmp_path_factory.mktemp("field_table_cache")
    previous = os.environ.get(CACHE_DIR_ENV)
    os.environ[CACHE_DIR_ENV] = str(folder)
    yield folder
    if previous is None:
        os.environ.pop(CACHE_DIR_ENV, None)
    else:
        os.environ[CACHE_DIR_ENV] = previous


@pytest.fixture(scope="session")
def field_table_cache(field_table_folder):
    """The field table, built once (a few seconds) before the first test that times a command or checks that it
    answers before torch loads; later commands read it."""
    from trl_aspo.cli.field_cache import cache_file, field_table

    field_table()
    return cache_file()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from trl.chat_template_utils import add_response_schema

    from trl_aspo.builtin import build_tokenizer

    return add_response_schema(build_tokenizer())


@pytest.fixture(scope="session", name="calculator_tokenizer")
def calculator_tokenizer_fixture():
    """The built-in checkpoint's tokenizer with TRL's response schema (`helpers.calculator_tokenizer`), once."""
    from helpers import calculator_tokenizer

    return calculator_tokenizer()


@pytest.fixture
def tiny_model(tiny_tokenizer):
    """A fresh random tiny Qwen2 per test (trainers mutate their model), built with a fixed seed."""
    from trl_aspo.builtin import build_random_model

    return build_random_model(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def calculator_dataset():
    from trl_aspo.builtin.task import make_dataset

    return make_dataset("train", 32, seed=0)


@pytest.fixture
def tiny_config(tmp_path):
    """An ASPOConfig for a few fast CPU steps; keyword overrides replace any field."""
    from trl_aspo import ASPOConfig

    def make(**overrides):
        return ASPOConfig(
            **tiny_run_fields(**{"output_dir": tmp_path / "out", "dataloader_num_workers": 0, **overrides})
        )

    return make


def pytest_addoption(parser):
    parser.addoption(
        "--file-progress",
        action="store_true",
        help="after each test file, print a line with its outcomes, its seconds and the run's count so far",
    )


class FileProgress:
    """`--file-progress` (used by `make test`): the suite runs for minutes, and dots alone do not say where it is. A
    file's line is written once all its tests have reported, so files that pytest-xdist's workers run at the same
    time (`make test` runs two) each get one line."""

    def __init__(self, reporter):
        self.reporter, self.totals, self.done = reporter, {}, 0
        self.started: dict[str, float] = {}
        self.outcomes: dict[str, dict[str, int]] = {}

    def expect(self, nodeids) -> None:
        if self.totals:  # every xdist worker collects the same tests
            return
        for nodeid in nodeids:
            file = nodeid.split("::")[0]
            self.totals[file] = self.totals.get(file, 0) + 1

    def start(self, nodeid: str) -> None:
        import time

        file = nodeid.split("::")[0]
        if file not in self.started:
            self.started[file] = time.monotonic()
            self.outcomes.setdefault(file, {})

    def report(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            file = report.nodeid.split("::")[0]
            outcomes = self.outcomes.setdefault(file, {})
            outcomes[report.outcome] = outcomes.get(report.outcome, 0) + 1
            self.done += 1
            if sum(outcomes.values()) == self.totals.get(file):
                self._line(file)

    def flush(self) -> None:
        for file in list(self.outcomes):
            self._line(file)

    def _line(self, file: str) -> None:
        import time

        outcomes = self.outcomes.pop(file)
        if not outcomes:
            return
        summary = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
        if self.reporter._tw.width_of_current_line:  # in the middle of a line of dots
            self.reporter.write("\n")
        seconds = time.monotonic() - self.started.get(file, time.monotonic())
        self.reporter.write_line(f"[{self.done}/{sum(self.totals.values())}] {file}: {summary} in {seconds:.0f} s")


_file_progress: FileProgress | None = None


def _progress_for(config) -> FileProgress | None:
    global _file_progress
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if _file_progress is None and config.getoption("--file-progress") and reporter is not None:
        _file_progress = FileProgress(reporter)
    return _file_progress


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session):
    progress = _progress_for(session.config)
    if progress is not None and session.items:
        progress.expect(item.nodeid for item in session.items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under pytest-xdist the controller collects nothing itself: each worker sends the ids it collected."""
    progress = _progress_for(node.config)
    if progress is not None:
        progress.expect(ids)


def pytest_runtest_logstart(nodeid, location):
    if _file_progress is not None:
        _file_progress.start(nodeid)


def pytest_runtest_logreport(report):
    if _file_progress is not None:
        _file_progress.report(report)


def pytest_sessionfinish(session, exitstatus):
    if _file_progress is not None:
        _file_progress.flush()
