"""The tree stays ruff clean (lint and format), so CI catches style drift like any other failure."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    """ruff as this interpreter's module (the [test] extra installs it): found whatever the venv's
    bin/ holds or PATH says."""
    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the [test] extra)")
    return [sys.executable, "-m", "ruff"]


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    result = subprocess.run([*ruff(), *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
