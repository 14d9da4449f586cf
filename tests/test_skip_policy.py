"""CI's skip policy (the repository's conftest.py): with KVSCALE_CI=1 a skip fails the run unless
ALLOWED_SKIPS explains it; without it a skip is a skip."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def policy():
    spec = importlib.util.spec_from_file_location("skip_policy_under_test", REPO / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_skips_an_allowed_pattern_explains_are_let_through():
    p = policy()
    skips = [("a.py::t", "needs a GPU: no CUDA device"), ("b.py::t", "/shared/models/tiny is missing")]
    assert p.unexplained(skips, {}) == skips
    assert p.unexplained(skips, {r"^needs a GPU": "CI has no GPU"}) == skips[1:]
    assert p.skip_reason(("b.py", 3, "Skipped: model missing")) == "model missing"


def run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_runs():\n    pass\n"
        "def test_skips():\n    pytest.skip('the fixture model is missing')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCALE_CI", "PYTEST_ADDOPTS")}
    if ci:
        env["KVSCALE_CI"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_under_kvscale_ci_an_unexplained_skip_fails_the_run(tmp_path):
    result = run(tmp_path, ci=True)
    assert result.returncode == 1, result.stdout
    assert "1 skips CI does not allow" in result.stdout
    assert "test_x.py::test_skips: the fixture model is missing" in result.stdout


def test_elsewhere_a_skip_is_a_skip(tmp_path):
    result = run(tmp_path, ci=False)
    assert result.returncode == 0, result.stdout
    assert "1 passed, 1 skipped" in result.stdout and "skip policy" not in result.stdout


def test_every_e2e_test_runs_on_one_xdist_worker(tmp_path):
    # Guards the scheduler in conftest.py: with `--dist loadgroup` on pytest 9 the e2e modules were
    # spread over both workers, and each started its own real node on the same bridge.
    shutil.copy(REPO / "conftest.py", tmp_path / "conftest.py")
    record = (
        "import os, pathlib\n"
        "def test_{n}():\n"
        "    nice = os.getpriority(os.PRIO_PROCESS, 0)\n"
        "    pathlib.Path('{n}').write_text(os.environ['PYTEST_XDIST_WORKER'] + f' {{nice}}')\n"
    )
    for d, names in {"e2e": ["a", "b", "c", "d"], "tests": ["e", "f", "g", "h"]}.items():
        (tmp_path / d).mkdir()
        for n in names:
            (tmp_path / d / f"test_{n}.py").write_text(record.format(n=n))
    env = {k: v for k, v in os.environ.items() if k not in ("KVSCALE_CI", "PYTEST_ADDOPTS")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "e2e", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout
    ran = {n: (tmp_path / n).read_text().split() for n in "abcdefgh"}
    workers = {n: worker for n, (worker, _) in ran.items()}
    assert len({workers[n] for n in "abcd"}) == 1, workers
    assert len(set(workers.values())) == 2, workers  # the unit modules ran beside them
    # The unit modules run niced beside the e2e tests (conftest.py's UNIT_NICE), the e2e ones not.
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert {int(ran[n][1]) for n in "abcd"} == {base}, ran
    assert {int(ran[n][1]) for n in "efgh"} == {min(19, base + 10)}, ran
