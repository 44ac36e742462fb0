"""The support log hook of the family tests (see support_log.py)."""

from __future__ import annotations

import pytest

from support_log import SupportRecord, write_line


@pytest.fixture
def support(request) -> SupportRecord:
    record = SupportRecord()
    record.family = getattr(getattr(request.node, "callspec", None), "params", {}).get("family")
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
