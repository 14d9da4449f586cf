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


# The router image is the operator's plus its own layer (Dockerfile, target router).
LAYERS = {"operator": ["operator"], "worker": ["worker"], "router": ["operator", "router"]}


def pins(extra: str) -> dict[str, str]:
    lines = [
        line for f in LAYERS[extra] for line in (REPO / "requirements" / f"{f}.txt").read_text().splitlines()
    ]
    found = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, version = re.fullmatch(r"([A-Za-z0-9_.\-]+)==(\S+)", line).groups()
            found[canonicalize_name(name)] = version
    return found


@pytest.mark.parametrize("extra", ["operator", "worker", "router"])
def test_lock_pins_every_requirement_of_the_extra(extra):
    locked = pins(extra)
    extras = LAYERS[extra] if extra == "router" else [extra]
    for spec in [*PROJECT["dependencies"], *(r for e in extras for r in PROJECT["optional-dependencies"][e])]:
        req = Requirement(spec)
        name = canonicalize_name(req.name)
        assert name in locked, f"requirements/{extra}.txt lacks {req.name} (python e2e/images.py lock)"
        assert req.specifier.contains(locked[name], prereleases=True), (spec, locked[name])


def test_operator_lock_has_no_torch():
    assert not {"torch", "triton", "transformers"} & set(pins("operator"))


def test_router_layer_has_no_torch_and_agrees_with_the_worker_lock():
    """transformers without torch, at the versions the worker image has (one tokenizer library)."""
    router, worker, operator = pins("router"), pins("worker"), pins("operator")
    layer = {k: v for k, v in router.items() if k not in operator}
    assert all(router[k] == v for k, v in operator.items()), "the layer re-pins an operator package"
    assert layer
    assert "transformers" in router and not {"torch", "triton"} & set(router)
    assert router["transformers"] == worker["transformers"] and router["tokenizers"] == worker["tokenizers"]
