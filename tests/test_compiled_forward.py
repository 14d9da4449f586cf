"""The compiled CPU forward (worker/model/compilation.py, aot_package.py, compile_behind.py): when it
is used, its packages' keys, that a worker serves eagerly while it is built and switches between
steps, and that it changes no token (against transformers, on both sides of the switch). The
engine-vs-transformers tests run it too."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_compile_cache import vector_flags
from test_engine_vs_hf import assert_greedy_matches, hf_greedy

from kvscale.kernels.kv_cache import write_kv_cache
from kvscale.kernels.paged_attention import paged_decode_attention, paged_decode_attention_unwritten
from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model import model_runner
from kvscale.worker.model.aot_package import KEY_FILE, refusal, required_cpu_flags
from kvscale.worker.model.compilation import CompiledForward, compile_decision
from kvscale.worker.model.forward_batch import (
    MAX_DECODE_PADDING,
    SeqChunk,
    build_forward_batch,
    in_graph_decode,
)

CPU = torch.device("cpu")


def test_compile_decision():
    assert compile_decision(CPU, tensor_parallel=False, enforce_eager=False) is None
    assert "enforce_eager" in compile_decision(CPU, tensor_parallel=False, enforce_eager=True)
    assert "CUDA graphs" in compile_decision(torch.device("cuda"), tensor_parallel=False, enforce_eager=False)
    assert "tensor parallelism" in compile_decision(CPU, tensor_parallel=True, enforce_eager=False)
    assert "triton" in compile_decision(CPU, False, False, attention_backend="triton")


def test_no_compiler_means_eager():
    reason = compile_decision(CPU, tensor_parallel=False, enforce_eager=False, cxx="no-such-c++-compiler")
    assert "no C++ compiler" in reason


def test_a_cache_directory_inductor_cannot_load_from_means_eager(tmp_path, monkeypatch):
    assert compile_decision(CPU, False, False, cache_dir=str(tmp_path / "cache")) is None
    assert (tmp_path / "cache").is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("")
    reason = compile_decision(CPU, False, False, cache_dir=str(blocked / "cache"))
    assert "cannot be made" in reason
    # docker's --tmpfs is noexec unless told otherwise: the built libraries would not load
    statvfs = os.statvfs
    monkeypatch.setattr(os, "statvfs", lambda p: SimpleNamespace(f_flag=statvfs(p).f_flag | os.ST_NOEXEC))
    assert "noexec" in compile_decision(CPU, False, False, cache_dir=str(tmp_path / "cache"))


def test_enforce_eager_default_reads_the_environment(monkeypatch):
    from kvscale.worker.config import EngineArgs

    monkeypatch.setenv("KVSCALE_ENFORCE_EAGER", "0")
    assert EngineArgs().enforce_eager is False
    monkeypatch.setenv("KVSCALE_ENFORCE_EAGER", "1")
    assert EngineArgs().enforce_eager is True


# -- packages: keys and refusal (pure) ------------------------------------------------------------
def test_the_cpu_flags_a_compiler_command_needs():
    assert required_cpu_flags("-mavx512f -mavx512dq -mavx512vl -mavx512bw -mfma -mavx512vnni") == [
        "avx512_vnni",
        "avx512bw",
        "avx512dq",
        "avx512f",
        "avx512vl",
        "fma",
    ]
    assert required_cpu_flags("-mavx2 -mfma -mno-avx512f -march=native") == ["avx2", "fma"]


def test_a_package_for_other_cpu_features_or_another_torch_is_refused():
    saved = {"format": 1, "torch": "2.15.0", "cpu_capability": "AVX512", "dtype": "float32",
             "block_size": 16, "model": {"hidden_size": 8}, "cpu_flags": ["avx512f", "fma"]}  # fmt: skip
    wanted = {k: v for k, v in saved.items() if k != "cpu_flags"}
    host = frozenset({"avx512f", "fma", "sse2"})
    assert refusal(saved, wanted, host) is None
    assert "avx512_vnni" in refusal({**saved, "cpu_flags": ["avx512f", "avx512_vnni"]}, wanted, host)
    assert "torch" in refusal(saved, {**wanted, "torch": "2.16.0"}, host)
    assert "cpu_capability" in refusal(saved, {**wanted, "cpu_capability": "AVX2"}, host)
    assert "model" in refusal(saved, {**wanted, "model": {"hidden_size": 16}}, host)
    assert "block_size" in refusal(saved, {**wanted, "block_size": 32}, host)


# -- a real package for the target model, built once by the real command ----------------------------
KW = dict(num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def package_cache(target_model, tmp_path_factory) -> Path:
    """A compile cache holding the target model's package, built by `kvscale-worker compile`."""
    cache = tmp_path_factory.mktemp("compiled")
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.cli", "compile", "--model", target_model,
         "--compile-cache-dir", str(cache)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiling graph 4/4" in done.stdout  # its progress, line by line
    folder = Path(done.stdout.strip().splitlines()[-1].rsplit(" ", 1)[-1])
    assert folder.parent == cache and (folder / KEY_FILE).is_file()
    # Built from this repository's root (pytest's working directory): with vector code all the same.
    if vector_flags(cache, private=False) != repr(""):
        assert json.loads((folder / KEY_FILE).read_text())["cpu_flags"], "a package without vector code"
    return cache


def test_a_package_found_is_loaded_before_serving(target_model, package_cache):
    """No compile: the runners are loaded at start (a fraction of a second), nothing is built."""
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(package_cache), **KW)
    runner = llm.engine.runner
    assert isinstance(runner.model.compiled, CompiledForward) and runner.compiler is None
    assert runner.compile_seconds < 5
    # The same command again finds it and builds nothing.
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.cli", "compile", "--model", target_model,
         "--compile-cache-dir", str(package_cache)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0 and "found in" in done.stdout and "compiling graph" not in done.stdout


def test_a_refused_package_is_not_loaded_and_is_built_anew(
    target_model, package_cache, tmp_path, monkeypatch
):
    """A package whose key file names a CPU feature this machine lacks (as one built elsewhere and
    copied under this key would): refused, never loaded, and the worker builds its own behind."""
    folder = next(p for p in package_cache.iterdir() if (p / KEY_FILE).is_file())
    cache = tmp_path / "cache"
    shutil.copytree(folder, cache / folder.name)
    key = json.loads((cache / folder.name / KEY_FILE).read_text())
    key["cpu_flags"] = [*key["cpu_flags"], "avx10_9000"]
    (cache / folder.name / KEY_FILE).write_text(json.dumps(key))
    commands = []
    monkeypatch.setattr(
        model_runner,
        "compile_command",
        lambda *a: commands.append(a) or [sys.executable, "-c", "raise SystemExit(3)"],
    )
    threads = torch.get_num_threads()
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(cache), **KW)
    assert llm.engine.runner.model.compiled is None
    assert commands and commands[0][3] == cache  # a build behind, into the same cache
    llm.engine.shutdown()
    # The core the build had is given back: it once stayed taken, and the next engine in this
    # process ran its graphs on another OpenMP team size than the threads it started.
    assert torch.get_num_threads() == threads


def generate(llm: LLM, prompts, **params) -> list[list[int]]:
    out = llm.generate(prompts, SamplingParams(temperature=0.0, ignore_eos=True, **params))
    return [o.outputs[0].token_ids for o in out]


def test_every_step_shape_runs_a_compiled_graph(target_model, package_cache):
    """One stream, 8 streams (2..8 tokens a step), 20 streams with chunked prefill (9+), greedy
    tokens as transformers gives them; no step fell back to eager."""
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(package_cache), **KW)
    forward = llm.engine.runner.model.compiled
    calls = []  # (graph, tokens)
    runners = dict(forward.runners)

    class Spy:
        def __init__(self, name):
            self.name = name

        def boxed_run(self, inputs):
            calls.append((self.name, inputs[0].shape[0]))
            return runners[self.name].boxed_run(inputs)

    forward.runners = {name: Spy(name) for name in runners}
    for prompts, n in (
        ([[0, 11, 12, 13]], 24),
        ([[0, *range(20 + i, 60 + i)] for i in range(8)], 24),
        ([[0, *range(100 + 3 * i, 130 + 7 * i)] for i in range(20)], 16),
    ):
        ours = generate(llm, prompts, max_tokens=n)
        for got, (tokens, logits) in zip(
            ours, hf_greedy(target_model, prompts, [n] * len(prompts)), strict=True
        ):
            assert_greedy_matches(got, tokens, logits)
    graphs = {g for g, _ in calls}
    assert graphs == {"decode1", "decode_small", "decoden", "chunk"}
    assert ("decode1", 1) in calls and ("decode_small", 8) in calls and ("decoden", 20) in calls
    assert max(n for g, n in calls if g == "chunk") > 8
    assert forward.eager_fallbacks == 0


def test_the_decode_graphs_argmax_is_torchs_and_the_runner_takes_it(target_model, package_cache, monkeypatch):
    """The decode graphs return each row's argmax beside the logits (the greedy token, reduced inside
    the graph): it picks what torch.argmax picks of those logits, ties (the first) and NaN (which
    wins) included, at 1, 2-8 and 9+ rows; and a greedy decode step samples it, with no argmax of
    its own on the host."""
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(package_cache), **KW)
    forward = llm.engine.runner.model.compiled
    runners = dict(forward.runners)
    captured: dict[str, list[torch.Tensor]] = {}

    class Capture:
        def __init__(self, name):
            self.name = name

        def boxed_run(self, inputs):
            captured.setdefault(self.name, list(inputs))
            return runners[self.name].boxed_run(inputs)

    host_argmax = []
    monkeypatch.setattr(model_runner, "argmax_rows", lambda x: host_argmax.append(x.shape[0]) or x.argmax(-1))
    forward.runners = {name: Capture(name) for name in runners}
    for k in (1, 5, 12):
        host_argmax.clear()
        ours = generate(llm, [[0, *range(20 + i, 40 + i)] for i in range(k)], max_tokens=6)
        assert all(len(t) == 6 for t in ours)
        assert len(host_argmax) == 1  # the prefill step's alone: every decode step took the graph's
        # Kept for argmax_of, the last logits are not kept alive past their step.
        assert forward._last_decode is not None and forward._last_decode[0]() is None
    forward.runners = runners
    weight = llm.engine.runner.model.lm_head.weight  # the graphs read the model's own tensors
    original = weight.detach().clone()
    for case in ("as computed", "ties", "nan"):
        if case == "ties":
            weight.data.zero_()  # every logit 0: the first index wins
        elif case == "nan":
            weight.data.copy_(original)
            weight.data[[17, 30]] = float("nan")  # NaN logits there: the first NaN wins
        for name in ("decode1", "decode_small", "decoden"):
            logits, argmax = runners[name].boxed_run(list(captured[name]))[:2]
            assert torch.equal(argmax, logits.argmax(dim=-1)), (case, name)
            if case == "ties":
                assert not logits.any() and not argmax.any()
            elif case == "nan":  # (a row whose input is token 17 or 30 has NaN everywhere: index 0)
                partly = ~logits.isnan().all(dim=-1)
                assert partly.any() and (argmax[partly] == 17).all()


def _peak_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))


def test_the_decode_graph_writes_the_step_into_the_cache_in_place(target_model, package_cache):
    """The decode graphs write the step's keys and values into the caches they are given, in
    place: never into a copy of the pool. A copy would touch a pool-sized buffer, so the check is
    the process's peak resident memory around one call (Linux resets it on request), with a pool
    of zero pages that cost no memory until written."""
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(package_cache), **KW)
    forward = llm.engine.runner.model.compiled
    decode1 = forward.runners["decode1"]
    captured = {}

    class Capture:
        def boxed_run(self, inputs):
            captured.setdefault("inputs", list(inputs))
            return decode1.boxed_run(inputs)

    forward.runners["decode1"] = Capture()
    generate(llm, [[0, 11, 12, 13]], max_tokens=4)
    inputs = captured["inputs"]
    caches = inputs[7:]
    assert len(caches) == 2 * llm.engine.runner.spec.num_layers
    slot = int(inputs[6][0])
    heads, _, block_size, head_dim = caches[0].shape
    pool_blocks = (32 << 20) // (heads * block_size * head_dim * caches[0].element_size())
    big = [torch.zeros(heads, pool_blocks, block_size, head_dim, dtype=c.dtype) for c in caches]
    pool_kib = sum(c.numel() * c.element_size() for c in big) >> 10
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from now
    before = _peak_rss_kib()
    logits = decode1.boxed_run(inputs[:7] + big)[0]
    grew = _peak_rss_kib() - before
    assert logits.shape == (1, llm.engine.runner.spec.vocab_size)
    for cache in big:  # the step's keys and values are in the caller's tensors, at its slot
        flat = cache.view(heads, -1, head_dim)
        assert flat[:, slot].abs().sum() > 0
        flat[:, slot] = 0
        assert not cache.any()  # and nowhere else
    assert grew < pool_kib // 8, (
        f"the peak memory grew {grew} KiB in one call: the {pool_kib} KiB pool was copied"
    )


def test_decode_graphs_run_with_the_gil_released(target_model, package_cache):
    """The decode graphs run through the model library's C ABI (model/aoti_runner.py), which lets
    other Python threads run during the forward: torch's own runner holds the GIL for all of it,
    and the server's event loop, beside the engine thread, waited a whole step for it. Counted,
    not timed: with a switch interval far longer than the test, the thread in the forward could
    only let the other one run by releasing the GIL."""
    import threading

    from kvscale.worker.model.aot_package import GIL_FREE_GRAPHS
    from kvscale.worker.model.aoti_runner import ReleasedGILRunner

    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(package_cache), **KW)
    forward = llm.engine.runner.model.compiled
    assert all(isinstance(forward.runners[g], ReleasedGILRunner) for g in GIL_FREE_GRAPHS)
    captured = {}
    decoden = forward.runners["decoden"]

    class Capture:
        def boxed_run(self, inputs):
            captured.setdefault("inputs", list(inputs))
            return decoden.boxed_run(inputs)

    forward.runners["decoden"] = Capture()
    generate(llm, [[0, *range(20 + i, 60 + i)] for i in range(12)], max_tokens=6)
    forward.runners["decoden"] = decoden
    expected = decoden.boxed_run(list(captured["inputs"]))[0]

    ticks, done, during = [0], threading.Event(), {}
    threads = torch.get_num_threads()

    def in_forward():
        # The OpenMP team size is per thread, and a new thread starts at OpenMP's default: the same
        # team as the forward above, or its reductions may split differently (a few bits apart).
        torch.set_num_threads(threads)
        before = ticks[0]
        for _ in range(20):
            during["logits"] = decoden.boxed_run(list(captured["inputs"]))[0]
        during["ticks"] = ticks[0] - before
        done.set()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(30.0)
    try:
        thread = threading.Thread(target=in_forward)
        thread.start()
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.0002)  # blocks: the GIL goes to the forward thread when it wants it
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    # Holding the GIL, torch's runner let the other thread in about once a forward (17 times in 20
    # forwards, measured); released, it ran hundreds of times (1,054 in 20 forwards of 8 rows).
    assert during["ticks"] >= 5 * 20, "the other thread hardly ran during 20 forwards: the GIL was held"
    assert torch.equal(during["logits"], expected)


def test_a_package_the_gil_free_runner_cannot_use_is_refused(package_cache, tmp_path):
    """A package without its model library, or one whose graph wants a parameter the model lacks:
    refused with a reason (load_package turns it into PackageRefused, and the worker builds anew),
    never half loaded."""
    import zipfile

    from kvscale.worker.model.aoti_runner import AOTIError, ReleasedGILRunner

    folder = next(p for p in package_cache.iterdir() if (p / KEY_FILE).is_file())
    empty = tmp_path / "decode1.pt2"
    with zipfile.ZipFile(empty, "w") as archive:
        archive.writestr("decode1/archive_format", "pt2")
    with pytest.raises(AOTIError, match="expected one model library, found 0"):
        ReleasedGILRunner(empty, {})
    with pytest.raises(AOTIError, match="wants a constant this model lacks"):
        ReleasedGILRunner(folder / "decode1.pt2", {})


@pytest.fixture(scope="module")
def lora_package_cache(target_model, tmp_path_factory) -> Path:
    """A compile cache holding the target model's package with the LoRA graphs."""
    cache = tmp_path_factory.mktemp("compiled-lora")
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.cli", "compile", "--model", target_model,
         "--compile-cache-dir", str(cache), "--enable-lora"],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "compiling graph 6/6 (chunk_lora)" in done.stdout
    return cache


def test_decode_steps_with_adapters_run_the_lora_graph(
    target_model, lora_package_cache, tmp_path_factory, monkeypatch
):
    """Issue 30 on the compiled forward: a batch mixing three adapters and the base model, and each
    adapter alone at one stream, decode on the LoRA graphs (so do short steps mixing a prompt's
    chunk with decodes; long prefill runs stay eager) with the same greedy tokens as the eager
    forward. A base worker does not load a LoRA package (its key differs)."""
    from test_lora_peft_parity import ATTENTION, MLP, make_adapter

    from kvscale.worker import LoRARequest

    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora-compiled")
    fields = [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP),
        dict(r=16, lora_alpha=16, target_modules=ATTENTION, use_rslora=True),
        dict(r=4, lora_alpha=8, target_modules=MLP),
    ]
    adapters = [
        LoRARequest(name, i + 1, str(make_adapter(Path(target_model), root / name, seed=i + 20, **f)))
        for i, (name, f) in enumerate(zip("abc", fields, strict=True))
    ]
    lora_kw = dict(enable_lora=True, max_loras=3, max_lora_rank=16, **KW)
    prompts = [[0, *range(30 + 7 * i, 50 + 11 * i)] for i in range(12)]
    loras = [[*adapters, None][i % 4] for i in range(len(prompts))]

    def run(llm: LLM) -> list[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
        mixed = llm.generate(prompts, params, lora_request=loras)
        alone = [llm.generate(prompts[:1], params, lora_request=a)[0] for a in adapters]
        return [o.outputs[0].token_ids for o in [*mixed, *alone]]

    eager = run(LLM(target_model, enforce_eager=True, **lora_kw))
    llm = LLM(target_model, enforce_eager=False, compile_cache_dir=str(lora_package_cache), **lora_kw)
    forward = llm.engine.runner.model.compiled
    assert isinstance(forward, CompiledForward) and forward.serves_lora
    calls = []  # (graph, rows, slots in the window)
    runners = dict(forward.runners)

    class Spy:
        def __init__(self, name):
            self.name = name

        def boxed_run(self, inputs):
            window = (
                # after the 7 decode inputs (compilation.CompiledForward) and the caches
                inputs[7 + 2 * llm.engine.runner.spec.num_layers].shape[0]
                if self.name == "decode_lora"
                else 0
            )
            calls.append((self.name, inputs[0].shape[0], window))
            return runners[self.name].boxed_run(inputs)

    forward.runners = {name: Spy(name) for name in runners}
    assert run(llm) == eager
    lora_calls = [(n, w) for g, n, w in calls if g == "decode_lora"]
    assert max(n for n, _ in lora_calls) == 12 and (1, 1) in lora_calls  # the mixed batch; one stream
    chunks = [n for g, n, _ in calls if g == "chunk_lora"]
    assert max(chunks) > 12  # a step with more tokens than sequences: a short prefill chunk beside decodes
    assert forward.eager_fallbacks == 0
    # A base worker finds no package of its own there (and would build one behind: not here).
    monkeypatch.setattr(model_runner, "compile_command", lambda *a: [sys.executable, "-c", "exit(3)"])
    base = LLM(target_model, enforce_eager=False, compile_cache_dir=str(lora_package_cache), **KW)
    assert base.engine.runner.model.compiled is None  # the LoRA package is not the base one's


def gated_compile(folder: Path, gate: Path) -> list[str]:
    """A stand-in for `kvscale-worker compile` whose build ends when the test opens the gate, then
    names the real package: the switch lands where the test wants it."""
    code = (
        "import os, time\n"
        f"while not os.path.exists({str(gate)!r}): time.sleep(0.005)\n"
        f"print('compiled in 0.0 s, package: {folder}', flush=True)\n"
    )
    return [sys.executable, "-c", code]


SWITCH_MODES = {
    "plain": {},
    "async_scheduling": {"async_scheduling": True},
    "ngram_speculation": {"speculative_method": "ngram", "num_speculative_tokens": 3},
}


@pytest.mark.parametrize("mode", sorted(SWITCH_MODES))
def test_greedy_tokens_match_transformers_across_the_switch(
    target_model, package_cache, tmp_path, monkeypatch, mode
):
    """Must-show 2 of issue 29: long generations that start on the eager forward (the package is
    being built behind) and end on the compiled one, in one batch; every token as transformers
    gives it, on both sides of the switch, which happens between two steps (eager steps, then
    compiled ones, never back)."""
    folder = next(p for p in package_cache.iterdir() if (p / KEY_FILE).is_file())
    gate = tmp_path / "gate"
    monkeypatch.setattr(model_runner, "compile_command", lambda *a: gated_compile(folder, gate))
    threads = torch.get_num_threads()
    llm = LLM(
        target_model,
        enforce_eager=False,
        compile_cache_dir=str(tmp_path / "empty"),
        **KW,
        **SWITCH_MODES[mode],
    )
    engine = llm.engine
    assert engine.runner.model.compiled is None and engine.runner.compiler is not None
    # While it builds, serving leaves it a core (compile_reserve_core); the switch gives it back.
    assert torch.get_num_threads() == max(1, threads - 1)
    prompts = [[0, *range(40 + 5 * i, 60 + 9 * i)] for i in range(3)] + [[0, *([7, 8, 9, 10] * 6)]]
    max_new = [90, 120, 70, 110]
    ids = [
        engine.add_request(p, SamplingParams(temperature=0.0, max_tokens=n))
        for p, n in zip(prompts, max_new, strict=True)
    ]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    kinds = []  # the forward of each step, in order
    steps = 0
    while engine.has_unfinished_requests():
        if steps == 25:
            gate.touch()
            assert engine.runner.compiler.wait(60)  # built and loaded: the next forward installs it
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids
        kinds += [kind for kind, _ in engine.take_stats().step_times]
        steps += 1
    switch = kinds.index("compiled")
    assert 20 <= switch <= 30 and set(kinds[:switch]) == {"eager"} and set(kinds[switch:]) == {"compiled"}
    assert len(kinds) - switch > 30  # most of the generation ran after the switch
    for i, (want, logits) in zip(ids, hf_greedy(target_model, prompts, max_new), strict=True):
        assert_greedy_matches(tokens[i], want, logits)
        assert len(tokens[i]) == len(want)
    assert engine.runner.model.compiled.eager_fallbacks == 0
    assert engine.runner.switched_at is not None and engine.take_stats().forward == "compiled"
    assert torch.get_num_threads() == threads


@pytest.mark.parametrize("sliding_window", [None, 40])
def test_compiled_decode_attention_reads_the_paged_cache_like_the_eager_kernel(sliding_window):
    """The compiled form of paged_decode_attention_unwritten (broadcast products over the indexed
    cache, no gather) against writing the token's K/V and running the eager paged kernel: GQA,
    lengths spread over many blocks (the padding reads block 0), scattered block tables."""
    torch.manual_seed(0)
    kv_heads, heads, dim, block, num_blocks = 2, 6, 16, 16, 64
    lens = [1, 17, 33, 90, 200]
    k_cache = torch.randn(kv_heads, num_blocks, block, dim)
    v_cache = torch.randn(kv_heads, num_blocks, block, dim)
    width = -(-max(lens) // block)
    perm = torch.randperm(num_blocks - 1) + 1  # block 0 is the padding
    tables = torch.zeros(len(lens), width, dtype=torch.long)
    used = 0
    for i, n in enumerate(lens):
        nb = -(-n // block)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
    seq_lens = torch.tensor(lens)
    q, k, v = (
        torch.randn(len(lens), heads, dim),
        torch.randn(len(lens), kv_heads, dim),
        torch.randn(len(lens), kv_heads, dim),
    )
    compiled = torch.compile(paged_decode_attention_unwritten, fullgraph=True, dynamic=True)
    got = compiled(q, k, v, k_cache, v_cache, tables, seq_lens, dim**-0.5, sliding_window)
    positions = seq_lens - 1
    slots = tables.gather(1, (positions // block)[:, None]).squeeze(1) * block + positions % block
    write_kv_cache(k, v, k_cache, v_cache, slots)
    want = paged_decode_attention(q, k_cache, v_cache, tables, seq_lens, dim**-0.5, sliding_window)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_decode_steps_take_the_graph_attention_unless_padding_would_cost_too_much():
    def common(lens, prefill=False):
        chunks = [SeqChunk([1], n - 1, list(range(-(-n // 16)))) for n in lens]
        if prefill:
            chunks.append(SeqChunk([1, 2, 3], 0, [0]))
        return build_forward_batch(chunks, 16, CPU).common

    assert in_graph_decode(common([300]))
    assert in_graph_decode(common([100, 200, 400, 800]))  # 4 x 50 blocks for 97 real: 2.1x
    wide = [32] * 15 + [32 * 16 * int(MAX_DECODE_PADDING)]  # 16 x 64 blocks for 94 real: 10.9x
    assert not in_graph_decode(common(wide))
    assert not in_graph_decode(common([300, 300], prefill=True))  # a prefill chunk: the backend's op
