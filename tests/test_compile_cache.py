"""A compile cache shared by the replicas (a PVC at $KVSCALE_COMPILE_CACHE, docs/operator.md): one
package per CPU flavour side by side, each worker loading the one its CPU may run; two builders at
once leave one package; a cache the worker cannot write (mounted read-only) sends the build to the
worker's private cache. No compiler runs here: torch.export and AOTInductor are replaced by stubs
that write placeholder files (tests/test_compiled_forward.py builds real packages)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvscale.worker import LLM
from kvscale.worker.model import aot_package, model_runner
from kvscale.worker.model.aot_package import (
    GRAPHS,
    KEY_FILE,
    artefact_key,
    build_package,
    find_package,
    package_folder,
)
from kvscale.worker.model.llama import LlamaForCausalLM
from kvscale.worker.model.loader import allocate_parameters, load_config

KEY = {"format": 1, "model": {"hidden_size": 8}, "dtype": "float32", "block_size": 16, "torch": "2.x",
       "cpu_capability": "AVX512"}  # fmt: skip
AVX512 = ["avx512bw", "avx512dq", "avx512f", "avx512vl", "fma"]
AMX = [*AVX512, "amx_bf16", "amx_int8", "amx_tile"]


def fake_package(cache: Path, flags: list[str]) -> Path:
    folder = package_folder(cache, KEY, flags)
    folder.mkdir(parents=True)
    for graph in GRAPHS:
        (folder / f"{graph}.pt2").write_bytes(b"pt2")
    (folder / KEY_FILE).write_text(json.dumps({**KEY, "cpu_flags": flags}))
    return folder


def test_packages_for_two_cpus_sit_side_by_side_and_each_worker_finds_its_own(tmp_path, caplog):
    """A mixed fleet sharing one cache: the AMX node's package and the AVX-512 node's live in two
    folders under one key; an AVX-512 host skips the AMX one (logged) and an AMX host takes the one
    built for the most of its features. Before, both went to one folder, and each CPU replaced the
    other's package every time it started."""
    plain, amx = fake_package(tmp_path, AVX512), fake_package(tmp_path, AMX)
    assert plain != amx and plain.parent == amx.parent == tmp_path
    with caplog.at_level(logging.INFO, logger=aot_package.__name__):
        assert find_package(KEY, [tmp_path], frozenset(AVX512)) == plain
    assert "amx_bf16" in caplog.text and amx.name in caplog.text
    assert find_package(KEY, [tmp_path], frozenset(AMX)) == amx
    assert find_package(KEY, [tmp_path], frozenset(["avx2", "fma"])) is None
    assert find_package({**KEY, "torch": "2.y"}, [tmp_path], frozenset(AMX)) is None


def test_an_incomplete_or_hidden_folder_is_never_a_package(tmp_path):
    folder = fake_package(tmp_path, AVX512)
    (folder / "chunk.pt2").unlink()
    assert find_package(KEY, [tmp_path], frozenset(AVX512)) is None
    scratch = tmp_path / f".{folder.name}.abc"  # a build in progress
    scratch.mkdir()
    (scratch / KEY_FILE).write_text(json.dumps({**KEY, "cpu_flags": AVX512}))
    assert find_package(KEY, [tmp_path], frozenset(AVX512)) is None


@pytest.fixture
def stub_compiler(monkeypatch):
    """torch.export and AOTInductor replaced: each 'package' is a file naming its builder."""
    builds = []

    def package(exported, package_path, inductor_configs):
        Path(package_path).write_text(str(len(builds)))
        builds.append(package_path)

    monkeypatch.setattr(torch.export, "export", lambda *a, **k: None)
    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", package)
    return builds


def tiny_model(path: str):
    config = load_config(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_position=64)
    model.tie_weights()
    allocate_parameters(model, torch.device("cpu"), torch.float32)
    model.init_rope(torch.device("cpu"))
    return model


def test_two_builders_at_once_leave_one_whole_package(target_model, tmp_path, stub_compiler):
    """Two pods built the same package into a shared cache: the first rename puts its folder in
    place, the second finds it there, keeps it and drops its own copy; no scratch folder is left."""
    model = tiny_model(target_model)
    first = build_package(model, torch.float32, 16, tmp_path, progress=lambda _: None)
    second = build_package(model, torch.float32, 16, tmp_path, progress=lambda _: None)
    assert first == second and len(stub_compiler) == 2 * len(GRAPHS)
    assert (first / "chunk.pt2").read_text() == str(GRAPHS.index("chunk"))  # the first builder's
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]
    key = json.loads((first / KEY_FILE).read_text())
    assert {k: v for k, v in key.items() if k != "cpu_flags"} == json.loads(
        json.dumps(artefact_key(model.spec, torch.float32, 16))
    )
    assert first.stat().st_mode & 0o055 == 0o055  # other users of the volume may read it
    # A forced rebuild replaces it.
    build_package(model, torch.float32, 16, tmp_path, progress=lambda _: None, replace=True)
    assert (first / "chunk.pt2").read_text() == str(len(GRAPHS) * 2 + GRAPHS.index("chunk"))
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]


def test_builds_in_one_cache_take_turns_and_the_later_one_loads_the_first(
    target_model, tmp_path, stub_compiler, monkeypatch
):
    """Three bench workers started together each compiled the same package side by side: 3x the
    CPU, and inductor's shared files raced (one package held another build's empty
    kernel_metadata.json and never loaded). A build now holds the cache's lock: the second waits,
    says so, then finds the first one's package and builds nothing."""
    import threading

    started, release = threading.Event(), threading.Event()
    real = torch._inductor.aoti_compile_and_package

    def slow(*a, **k):
        started.set()
        assert release.wait(30)
        return real(*a, **k)

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", slow)
    monkeypatch.setattr(aot_package, "load_package", lambda folder, *a: {})  # stub packages
    said: dict[str, list[str]] = {"first": [], "second": []}
    results = {}

    def build(who: str) -> None:
        results[who] = aot_package.build_for_model(
            target_model, "float32", 16, tmp_path, progress=said[who].append
        )

    first = threading.Thread(target=build, args=("first",))
    first.start()
    assert started.wait(30)
    second = threading.Thread(target=build, args=("second",))
    second.start()
    deadline = 100
    while not any("waiting" in m for m in said["second"]) and deadline:
        deadline -= 1
        threading.Event().wait(0.05)
    assert any("another build holds" in m for m in said["second"]), said
    assert not any("compiling" in m for m in said["second"])
    release.set()
    first.join(30)
    second.join(30)
    (folder, built), (again, built_again) = results["first"], results["second"]
    assert built and not built_again and again == folder
    assert len(stub_compiler) == len(GRAPHS)  # one build


def test_a_build_keeps_inductors_files_to_itself_and_removes_them():
    """`kvscale-worker compile` runs inside private_inductor_cache: a fresh folder inside inductor's
    own (so its checks hold), the variable restored and the folder gone afterwards."""
    import os

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with aot_package.private_inductor_cache() as scratch:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == scratch and Path(scratch).is_dir()
        assert Path(scratch).name.startswith("kvscale-build-")
        (Path(scratch) / "kernel_metadata.json").write_text("{}")
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before
    assert not Path(scratch).exists()


def builds_into(monkeypatch, target_model, compile_cache_dir: Path, home: Path):
    """The folder a worker hands its build behind (None: no build)."""
    commands = []
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(
        model_runner,
        "compile_command",
        lambda *a: commands.append(a) or [sys.executable, "-c", "raise SystemExit(3)"],
    )
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(compile_cache_dir), num_kv_blocks=64)
    try:
        assert llm.engine.runner.model.compiled is None
        return commands[0][3] if commands else None
    finally:
        llm.engine.shutdown()


def test_a_compile_cache_the_worker_cannot_write_sends_its_build_to_its_own(
    target_model, tmp_path, monkeypatch, caplog
):
    """A compile cache mounted read-only without this CPU's package: the worker serves eagerly
    and builds into its private cache (the pod's /tmp), saying why; with no writable folder at all
    it stays eager and says so. (A path under a file: unwritable even for root.)"""
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        into = builds_into(monkeypatch, target_model, blocked / "compiled", tmp_path / "home")
    assert into == tmp_path / "home" / ".cache" / "kvscale" / "compiled"
    assert "cannot be made" in caplog.text and "for this worker alone" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert builds_into(monkeypatch, target_model, blocked / "compiled", blocked / "home") is None
    assert "eager forward: the compile cache" in caplog.text


def test_the_private_cache_is_searched_only_when_the_compile_cache_is_read_only(
    target_model, tmp_path, monkeypatch
):
    """The private cache holds what a worker built while its compile cache was read-only: searched
    then (a restarted container finds its own build), never beside a writable compile cache, where
    a package left by other runs would stand in for the cache's (CI: ~/.cache/kvscale/compiled,
    filled by earlier tests, made a worker given an empty compile cache start compiled)."""
    searched = []

    def spy(key, dirs, host_flags=None):
        searched.append(dirs)
        return None

    monkeypatch.setattr(model_runner, "find_package", spy)
    private = tmp_path / "home" / ".cache" / "kvscale" / "compiled"
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    builds_into(monkeypatch, target_model, tmp_path / "cache", tmp_path / "home")
    builds_into(monkeypatch, target_model, blocked / "compiled", tmp_path / "home")
    assert searched == [
        [tmp_path / "cache", model_runner.SHIPPED_DIR],
        [blocked / "compiled", private, model_runner.SHIPPED_DIR],
    ]


def vector_flags(cwd: Path, private: bool) -> str:
    """What a fresh process started in `cwd` compiles CPU code with (inductor's vector ISA flags),
    inside a build's private_inductor_cache or not."""
    code = (
        "from kvscale.worker.model.aot_package import cpu_arch_flags, private_inductor_cache\n"
        + ("with private_inductor_cache():\n    " if private else "")
        + "print(repr(cpu_arch_flags()))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_a_build_from_the_repository_root_has_vector_code(tmp_path):
    """Inductor checks the CPU's vector ISA in a child that inherits sys.path; from this repository's
    root ('' first in it) the repository's `operator/` replaced the standard `operator` module there,
    the check failed and every package was built without vector code (2x slower steps). A build's
    private_inductor_cache gives the children a path without such entries."""
    import os

    repo = Path(__file__).resolve().parents[1]
    assert aot_package.shadows_stdlib(str(repo), frozenset())
    assert str(repo) not in aot_package.probe_pythonpath().split(os.pathsep)
    elsewhere = vector_flags(tmp_path, private=False)
    if elsewhere == repr(""):
        pytest.skip("this CPU has no vector ISA inductor uses")
    assert vector_flags(repo, private=True) == elsewhere
