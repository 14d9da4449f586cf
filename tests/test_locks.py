"""requirements/*.txt, the images' pinned dependency layers, cover what pyproject.toml's extras
require: every requirement of the core and the extra (and nothing torch-shaped in the operator's)."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def pins(extra: str) -> dict[str, str]:
    lines = (REPO / "requirements" / f"{extra}.txt").read_text().splitlines()
    found = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
            found[canonicalize_name(name)] = version
    return found


@pytest.mark.parametrize("extra", ["operator", "worker"])
def test_lock_pins_every_requirement_of_the_extra(extra):
    locked = pins(extra)
    for spec in [*PROJECT["dependencies"], *PROJECT["optional-dependencies"][extra]]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in locked, f"requirements/{extra}.txt lacks {req.name} (python e2e/images.py lock)"
        assert req.specifier.contains(locked[name], prereleases=True), (spec, locked[name])


def test_operator_lock_has_no_torch():
    assert not {"torch", "triton", "transformers"} & set(pins("operator"))
