"""Under ``cargo xtask test`` (``ATTN_TEST_NO_SKIP=1``, see ``strict.py``) a skipped test is
a failure: that command installs everything the suite needs."""

import pytest

from strict import NO_SKIP


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = (
            f"skipped under cargo xtask test ({reason}): that command installs everything "
            "the suite needs, so no test may skip there"
        )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    # A module skipped as a whole (``pytest.importorskip`` at its top, say) fails too.
    outcome = yield
    report = outcome.get_result()
    if NO_SKIP and report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome = "failed"
        report.longrepr = f"skipped under cargo xtask test ({reason}): no module may skip there"
