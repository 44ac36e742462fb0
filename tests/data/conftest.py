"""The support log hook for the chat-format tests (tests/families/support_log.py): a test that takes the
``support`` fixture and calls ``support("chat:<format>", "prepare")`` logs its outcome for the chat-format
table of docs/support_matrix.md."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
from support_log import SupportRecord, write_line  # noqa: E402


@pytest.fixture
def support(request) -> SupportRecord:
    record = SupportRecord()
    request.node._support_record = record
    return record


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    record = getattr(item, "_support_record", None)
    if record is None or record.family is None or record.stage is None:
        return
    if report.when == "call" or (report.when == "setup" and report.failed):
        write_line(record, report.passed, item.nodeid)
