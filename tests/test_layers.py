"""The tree is the architecture: no module imports from a layer above its own.

Every module of every package in pyproject.toml is parsed (ast; nothing is imported) and each of
its imports of kvscale is checked against the order below. A module may import its own layer,
the layers below it in its own stack, and the stacks its stack is built on; nothing else. Imports
under `if TYPE_CHECKING:` are exempt: they name the type of an object a caller passes in and load
nothing (the sampler is given requests; it does not import core/).
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Each product is a stack of layers, bottom first; a layer is a set of module prefixes (a package
# or a module). A stack's package itself (its __init__: the public API, e.g. `from kvscale.worker
# import LLM`) sits in the top layer, with the entry points.
STACKS: dict[str, list[tuple[str, ...]]] = {
    # What the HTTP edges share: the OpenAI error shape, bounded body reads, JSON logs.
    "common": [("kvscale.common",)],
    # Triton kernels and their torch references: nothing of the worker.
    "kernels": [("kvscale.kernels",)],
    # The worker, vLLM V1's order: the vocabulary (config, sampling params, statistics), the
    # grammar, the requests and their scheduling, the collectives, the model, speculation, the
    # rank processes, the engine, the server, and the entry points that use all of it.
    "worker": [
        ("kvscale.worker.config", "kvscale.worker.metrics"),
        ("kvscale.worker.sample", "kvscale.worker.lora.request"),  # SamplingParams, the sampler, logprobs
        ("kvscale.worker.structured_output",),
        ("kvscale.worker.core",),  # a Request holds its SamplingParams and its grammar
        ("kvscale.worker.distributed",),
        ("kvscale.worker.model", "kvscale.worker.lora"),  # its layers call distributed/'s collectives
        ("kvscale.worker.spec_decode",),
        ("kvscale.worker.executor",),  # the rank processes run the model runner
        ("kvscale.worker.engine",),
        ("kvscale.worker.server",),
        (
            "kvscale.worker.llm",
            "kvscale.worker.cli",
            "kvscale.worker.testing",
            "kvscale.worker.bench",
            "kvscale.worker",
        ),
    ],
    # The operator: its metrics and settings, the CRD's models, the Kubernetes API, the pure
    # reconciliation and the reconciler, the autoscaler (which reads the reconciler's
    # children and status helpers), and at the top kopf's handlers and the command.
    "operator": [
        ("kvscale.operator.metrics", "kvscale.operator.settings"),
        ("kvscale.operator.api",),
        ("kvscale.operator.kube",),
        ("kvscale.operator.reconcile",),
        ("kvscale.operator.autoscaler",),
        ("kvscale.operator.adapters",),  # reads the autoscaler's pod cache and pod states
        ("kvscale.operator.handlers", "kvscale.operator.health", "kvscale.operator.main", "kvscale.operator"),
    ],
    # The router: pure picking and bookkeeping, its view of the endpoints, its I/O, a pool of
    # workers (one model's), the server.
    "router": [
        (
            "kvscale.router.picker",
            "kvscale.router.prefix_index",
            "kvscale.router.kv_index",
            "kvscale.router.queue",
            "kvscale.router.auth",
        ),
        ("kvscale.router.state",),
        (
            "kvscale.router.scrape",
            "kvscale.router.endpoints",
            "kvscale.router.wake",
            "kvscale.router.kv_events",
            "kvscale.router.tokenizer",
        ),
        ("kvscale.router.pool",),  # one model's workers: its state, source, queue, waker, ...
        ("kvscale.router.server",),
        ("kvscale.router.main", "kvscale.router"),
    ],
}
# Whole stacks a stack may import. The router and the operator know the worker only through its
# HTTP API and metric names (no import): each ships in an image without torch.
BUILT_ON = {
    "common": (),
    "kernels": (),
    "worker": ("common", "kernels"),
    "operator": ("common",),
    "router": ("common",),
}


def package_roots() -> dict[str, str]:
    """Folder -> import name, from pyproject's package-dir."""
    tool = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {folder: name for name, folder in tool["package-dir"].items()}


def modules() -> dict[str, Path]:
    out = {}
    for folder, name in package_roots().items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = [name, *path.relative_to(REPO / folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def layer_of(module: str) -> tuple[str, int] | None:
    """(stack, rank) of the longest prefix that names the module; a stack's root package matches
    itself only (a new subpackage must be placed, not fall to the top)."""
    best: tuple[int, str, int] | None = None
    for stack, layers in STACKS.items():
        for rank, prefixes in enumerate(layers):
            for prefix in prefixes:
                exact = len(layers) > 1 and prefix == f"kvscale.{stack}"
                hit = module == prefix or (not exact and module.startswith(prefix + "."))
                if hit and (best is None or len(prefix) > best[0]):
                    best = (len(prefix), stack, rank)
    return None if best is None else (best[1], best[2])


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports(path: Path, module: str, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported kvscale module) for every import outside `if TYPE_CHECKING:`, at any
    depth (a function's lazy import is an import too)."""
    is_package = path.name == "__init__.py"
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend((node.lineno, a.name) for a in node.names if a.name.startswith("kvscale"))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.startswith("kvscale"):
                for alias in node.names:  # `from pkg import module` imports that module
                    sub = f"{target}.{alias.name}"
                    found.append((node.lineno, sub if sub in known else target))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text()))
    return sorted(set(found))


def violations() -> tuple[list[str], list[str]]:
    """(modules no layer names, imports that go up or across)."""
    mods = modules()
    known = set(mods)
    unplaced = [m for m in mods if layer_of(m) is None]
    wrong = []
    for module, path in mods.items():
        here = layer_of(module)
        if here is None:
            continue
        for line, target in imports(path, module, known):
            there = layer_of(target)
            if there is None:
                continue  # reported as unplaced (or not ours)
            same_stack = there[0] == here[0]
            if (same_stack and there[1] > here[1]) or (not same_stack and there[0] not in BUILT_ON[here[0]]):
                wrong.append(f"{path.relative_to(REPO)}:{line}: {module} -> {target}")
    return unplaced, wrong


def test_every_module_has_a_layer():
    walked = modules()
    # The walk found every product (a wrong package-dir would walk nothing, and pass).
    for module in ("kvscale.worker.engine.llm_engine", "kvscale.operator.main", "kvscale.router.main"):
        assert module in walked, module
    unplaced, _ = violations()
    assert unplaced == [], f"place these in STACKS (tests/test_layers.py): {unplaced}"


def test_no_module_imports_from_a_layer_above_its_own():
    _, wrong = violations()
    assert wrong == [], "imports from a higher layer or another product:\n" + "\n".join(wrong)


def test_the_checker_sees_an_upward_import_a_lazy_one_and_skips_type_checking(tmp_path):
    """The checker itself: a lazy (function-level) import counts; TYPE_CHECKING does not."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from kvscale.worker.core.request import Request\n"
        "if TYPE_CHECKING:\n"
        "    from kvscale.worker.engine.llm_engine import LLMEngine\n"
        "def f():\n"
        "    from kvscale.worker.server import api_server\n"
    )
    path = tmp_path / "x.py"
    path.write_text(source)
    known = {"kvscale.worker.server.api_server"}
    found = imports(path, "kvscale.worker.sample.x", known)
    assert [t for _, t in found] == ["kvscale.worker.core.request", "kvscale.worker.server.api_server"]
    assert layer_of("kvscale.worker.sample.x") == ("worker", 1)
    assert layer_of("kvscale.worker.core.request")[1] > 1  # an upward import, which the test reports
    assert layer_of("kvscale.worker.newpackage") is None  # a new subpackage must be placed
