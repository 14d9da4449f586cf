"""What the whole suite shares, tests/ and e2e/ alike: how pytest-xdist splits it, and CI's skip policy.

pyproject.toml runs the suite on two pytest-xdist workers (`-n 2 --dist loadgroup`). Every e2e
test is in one group, so one worker runs them all, in order, against the one real node a machine
can have (its bridge, addresses and image tags are machine-wide), while the other runs the unit
modules; those mostly use the CPU, the e2e tests mostly wait on pods. Each unit module is a group
of its own, so its module-scoped fixtures (a server, an LLM) are built once.

CI's skip policy: with KVSCALE_CI=1 (.ci/run sets it) a skipped test
fails the run unless its reason matches an entry of ALLOWED_SKIPS, each with why CI may skip it.

.ci/run installs everything the tests need (the Debian packages, Go and the binaries it builds,
the images, ../shared/models beside the clone), so on a CI machine a skip is a dependency gone
missing or broken (a fixture model not found, a binary not built, a crash reported as "not
available"), never a fact about the machine. Elsewhere (a laptop without root or Docker, kind)
skips stay skips. docs/testing.md, "What CI may skip".
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

# reason (a regular expression, searched in the skip's reason) -> why CI may skip it. Empty: no
# test has a reason to skip on a CI machine. An entry belongs here only when no CI machine can
# run the test (say, one that needs a GPU, when CI has none), never for a missing dependency.
ALLOWED_SKIPS: dict[str, str] = {}

_skips: list[tuple[str, str]] = []  # (test or module, reason), in the controller process


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        parts = Path(item.path).relative_to(config.rootpath).parts
        item.add_marker(pytest.mark.xdist_group("e2e" if parts[0] == "e2e" else "/".join(parts)))


def skip_reason(longrepr) -> str:
    """The reason of a skip report: pytest keeps (path, line, "Skipped: reason")."""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def unexplained(skips: list[tuple[str, str]], allowed: dict[str, str]) -> list[tuple[str, str]]:
    """The skips whose reason no allowed pattern matches."""
    return [(where, why) for where, why in skips if not any(re.search(p, why) for p in allowed)]


def _enforced(config) -> bool:
    # Under pytest-xdist the controller sees every worker's reports and decides; workers do not.
    return os.environ.get("KVSCALE_CI") == "1" and not hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, skip_reason(report.longrepr)))


def pytest_collectreport(report) -> None:
    if report.skipped:  # a module that skipped itself (pytest.skip(allow_module_level=True), importorskip)
        _skips.append((report.nodeid, skip_reason(report.longrepr)))


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    if _enforced(session.config) and unexplained(_skips, ALLOWED_SKIPS) and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    if not _enforced(config):
        return
    bad = unexplained(_skips, ALLOWED_SKIPS)
    terminalreporter.section("KVSCALE_CI skip policy")
    if not bad:
        terminalreporter.write_line(f"{len(_skips)} skipped, all allowed (conftest.py ALLOWED_SKIPS)")
        return
    terminalreporter.write_line(
        f"FAILED: {len(bad)} skips CI does not allow (a missing or broken dependency; conftest.py):", red=True
    )
    for where, why in bad:
        terminalreporter.write_line(f"  {where}: {why}")
