"""What the whole suite shares, tests/ and e2e/ alike: how pytest-xdist splits it, and CI's skip policy.

pyproject.toml runs the suite on two pytest-xdist workers (`-n 2`). pytest_xdist_make_scheduler
makes every e2e test one work unit, so one worker runs them all, in order, against the one real
node a machine can have (its bridge, addresses and image tags are machine-wide), while the other
runs the unit modules; those mostly use the CPU, the e2e tests mostly wait on pods. Each unit module is a work
unit of its own, so its module-scoped fixtures (a server, an LLM) are built once.

CI's skip policy: with KVSCALE_CI=1 (.ci/run sets it) a skipped test
fails the run unless its reason matches an entry of ALLOWED_SKIPS, each with why CI may skip it.

.ci/run installs everything the tests need (the Debian packages, Go and the binaries it builds,
the images, ../shared/models beside the clone), so on a CI machine a skip is a dependency gone
missing or broken (a fixture model not found, a binary not built, a crash reported as "not
available"), never a fact about the machine. Elsewhere (a laptop without root or Docker, kind)
skips stay skips. docs/testing.md, "What CI may skip".
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path

import pytest

# reason (a regular expression, searched in the skip's reason) -> why CI may skip it. Empty: no
# test has a reason to skip on a CI machine. An entry belongs here only when no CI machine can
# run the test (say, one that needs a GPU, when CI has none), never for a missing dependency.
ALLOWED_SKIPS: dict[str, str] = {}

_skips: list[tuple[str, str]] = []  # (test or module, reason), in the controller process


def work_unit(nodeid: str) -> str:
    """The tests one xdist worker runs together: every e2e test as one unit, else a module."""
    return "e2e" if nodeid.startswith("e2e/") else nodeid.split("::", 1)[0]


class XdistScheduling:
    """Registered only where pytest-xdist is loaded: its hook is unknown elsewhere (`-p no:xdist`)."""

    # Our own scope split rather than `--dist loadgroup`: xdist 3.8 marks groups by renaming
    # item._nodeid, which pytest 9 no longer reads (nodeid comes from item._id), so every
    # xdist_group is silently ignored and e2e tests would start two real nodes at once.
    @staticmethod
    def pytest_xdist_make_scheduler(config, log):
        from xdist.scheduler import LoadScopeScheduling

        class E2EOnOneWorker(LoadScopeScheduling):
            def _split_scope(self, nodeid: str) -> str:
                return work_unit(nodeid)

        return E2EOnOneWorker(config, log)


# Niceness of a worker that runs unit modules beside the e2e worker. The e2e tests time real pods,
# probes and drains (liveness within 30 s, a drain within 90 s); at equal priority the unit
# modules' CPU made them miss (three different e2e tests failed in two cold CI runs, none when
# run alone). Niced, the unit modules take the CPU the real node leaves: most of it, as the e2e
# tests mostly wait.
UNIT_NICE = 10
_niced = False


def nice_this_process(increment: int) -> None:
    """Raise every thread's niceness (Linux keeps one per thread; threads and processes started
    later inherit it from theirs)."""
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError, ValueError):
            tid = int(task.name)
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + increment)


def pytest_runtest_setup(item) -> None:
    global _niced
    if not _niced and os.environ.get("PYTEST_XDIST_WORKER") and not item.nodeid.startswith("e2e/"):
        _niced = True  # an e2e worker only takes unit modules after the e2e unit: nothing to protect then
        nice_this_process(UNIT_NICE)


def pytest_configure(config) -> None:
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(XdistScheduling(), "kvscale-xdist-scheduling")


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
