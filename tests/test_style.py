"""The tree stays ruff clean (lint and format), so CI catches style drift like any other failure."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    exe = Path(sys.executable).with_name("ruff")
    if exe.is_file():
        return [str(exe)]
    if shutil.which("ruff"):
        return ["ruff"]
    pytest.skip("ruff is not installed (it is in the [test] extra)")


@pytest.mark.parametrize("args", [["check", "."], ["format", "--check", "."]])
def test_ruff(args):
    result = subprocess.run([*ruff(), *args], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
