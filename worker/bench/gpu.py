"""The GPU check: every Triton kernel against its reference, then timings, then the engine's decode
throughput against transformers `generate` and its decode step time with and without CUDA graphs,
all on the GPU at hand. Prints one JSON object.

    python -m kvscale.worker.bench.gpu --json                          # the whole check, a few minutes
    python -m kvscale.worker.bench.gpu --json --skip-e2e               # kernels only
    python -m kvscale.worker.bench.gpu --json --sections decode_steps  # some sections only

1. Correctness: each kernel on fresh random data in float16 and bfloat16, outputs poisoned with
   NaN first, compared with its plain-torch reference (max relative error, pass/fail).
2. Kernel timings: median of many runs timed with CUDA events; achieved bytes/s (the bytes a kernel
   must move at least) against the card's measured device-to-device copy bandwidth. Goal: paged
   decode attention >= 70% of copy bandwidth at batch 64, 4k context, 8 query heads per KV head.
3. End to end: a ~1B-parameter Llama-shaped model with random weights (bf16, safetensors, built in a
   temporary folder: nothing is downloaded), batch 64 greedy decode, our engine against
   transformers `generate` on the same GPU and weights. Goal: >= 3x.
4. Decode steps: on the same model, the engine's decode step time (median of the
   `engine.step()` calls once the prefill is done) at batch 1 and 64: CUDA graphs on, CUDA graphs
   off, and CUDA graphs on with async scheduling (the host's part of a step hidden behind the
   device's), with the ratios graphs off / on and async off / on per batch.
5. Cold start: three fresh processes each build the engine on the same model and take one token:
   the first with empty Triton and inductor caches, the others with the caches it left (a pod
   with a shared compile-cache volume).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvscale.kernels import kv_cache, norm, paged_attention, rotary

DEVICE = "cuda"  # --smoke on a CPU: "cpu", kernels under the Triton interpreter
DECODE_GOAL_FRACTION = 0.70
E2E_GOAL_SPEEDUP = 3.0
TOLERANCE = {torch.float16: 5e-3, torch.bfloat16: 3e-2}  # max |a - b| / max |b|

# Shapes of every section. SMOKE runs the same code on a CPU in seconds (--smoke, under
# TRITON_INTERPRET=1) so that the script can be checked where no GPU is at hand.
GPU_SIZES = dict(
    heads=(32, 4, 128),  # query heads, KV heads (8 query heads per KV head), head_dim
    check_decode_lens=[1, 15, 16, 17, 511, 512, 513, 4097, 9000],
    check_window=1000,
    check_prefill_heads=(32, 8, 128),
    check_prefill_chunks=[(0, 300), (100, 64), (1000, 5), (4000, 1), (33, 257)],
    check_prefill_window=256,
    check_rows=777,
    hidden=4096,
    decode_goal=(64, 4096),
    decode_sweep=[
        (1, 4096, 16),
        (8, 4096, 16),
        (256, 4096, 16),
        (64, 1024, 16),
        (64, 16384, 16),
        (64, 4096, 8),
        (64, 4096, 32),
        (64, 4096, 64),
        (64, 4096, 128),
    ],
    prefill_chunks=[(1536, 512)] * 8,
    tokens=8192,
    max_position=8192,
    model=dict(
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),  # TinyLlama-1.1B's shape, GQA 8
    batch=64,
    prompt_len=128,
    new_tokens=256,
    max_model_len=1024,
    step_batches=(1, 64),  # decode_steps: a short prompt, then every step a decode of the whole batch
    step_prompt_len=32,
    step_new_tokens=128,
)
SMOKE_SIZES = dict(
    heads=(4, 2, 32), check_decode_lens=[1, 15, 16, 17, 40], check_window=20,
    check_prefill_heads=(4, 2, 32), check_prefill_chunks=[(0, 20), (10, 3), (33, 1)], check_prefill_window=8,
    check_rows=5, hidden=64, decode_goal=(2, 48), decode_sweep=[(1, 40, 8)], prefill_chunks=[(16, 8)] * 2,
    tokens=16, max_position=64,
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=256),
    batch=3, prompt_len=6, new_tokens=3, max_model_len=64,
    step_batches=(1, 3), step_prompt_len=6, step_new_tokens=4,
)  # fmt: skip
SIZES = GPU_SIZES


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def time_cuda(fn: Callable[[], object], iters: int = 50, warmup: int = 5) -> float:
    """Median milliseconds of fn over `iters` runs, each bracketed by CUDA events."""
    if DEVICE == "cpu":  # --smoke: the figures mean nothing, the code paths are what is checked
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


def copy_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), iters=30)
    return 2 * nbytes / (ms / 1e3)


# -- inputs ---------------------------------------------------------------------------------------
def paged_inputs(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_query=None, seed=0):
    """A KV cache holding exactly the sequences' blocks, scattered, and block tables for them."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    need = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(need) + 1
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_cache = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    v_cache = torch.randn(shape, generator=g, device=DEVICE, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=g, device=DEVICE)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.long, device=DEVICE)
    offset = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[offset : offset + n]
        offset += n
    rows = len(seq_lens) if num_query is None else num_query
    query = torch.randn(rows, num_heads, head_dim, generator=g, device=DEVICE, dtype=dtype)
    return query, k_cache, v_cache, tables, torch.tensor(seq_lens, device=DEVICE)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    if actual.isnan().any():
        return float("inf")  # an unwritten (poisoned) element
    scale = expected.float().abs().max().clamp_min(1e-6)
    return float((actual.float() - expected.float()).abs().max() / scale)


# -- 1. correctness -------------------------------------------------------------------------------
def check_kernels() -> dict:
    from kvscale.kernels import triton_kv_cache, triton_norm, triton_paged_attention, triton_rotary

    s = SIZES
    heads, kv_heads, head_dim = s["heads"]
    scale = head_dim**-0.5
    results = {}
    for dtype in (torch.float16, torch.bfloat16):
        errors: dict[str, float] = {}
        # Decode: mixed lengths across block and partition boundaries, GQA, with and without a window.
        for window in (None, s["check_window"]):
            q, kc, vc, bt, sl = paged_inputs(s["check_decode_lens"], heads, kv_heads, head_dim, 16, dtype)
            out = torch.full_like(q, float("nan"))
            triton_paged_attention.paged_decode_attention(q, kc, vc, bt, sl, scale, window, out=out)
            ref = paged_attention.paged_decode_attention(q, kc, vc, bt, sl, scale, window)
            errors[f"paged_decode_attention{'_window' if window else ''}"] = rel_error(out, ref)
        # Prefill: chunks over cached prefixes, a fresh prompt, speculative verification.
        chunks = s["check_prefill_chunks"]
        p_heads, p_kv_heads, p_dim = s["check_prefill_heads"]
        lens = [c + n for c, n in chunks]
        q, kc, vc, bt, sl = paged_inputs(
            lens, p_heads, p_kv_heads, p_dim, 32, dtype, sum(n for _, n in chunks)
        )
        qsl = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0)
        for window in (None, s["check_prefill_window"]):
            out = torch.full_like(q, float("nan"))
            triton_paged_attention.paged_prefill_attention(
                q, kc, vc, bt, qsl, sl, p_dim**-0.5, window, out=out
            )
            ref = paged_attention.paged_prefill_attention(q, kc, vc, bt, qsl, sl, p_dim**-0.5, window)
            errors[f"paged_prefill_attention{'_window' if window else ''}"] = rel_error(out, ref)
        # KV write: an exact copy.
        rows = s["check_rows"]
        key = torch.randn(rows, kv_heads, head_dim, device=DEVICE, dtype=dtype)
        value = torch.randn_like(key)
        num_blocks = -(-2 * rows // 16)
        slots = torch.randperm(num_blocks * 16, device=DEVICE)[:rows]
        caches = [
            torch.full((kv_heads, num_blocks, 16, head_dim), float("nan"), device=DEVICE, dtype=dtype)
            for _ in range(4)
        ]
        triton_kv_cache.write_kv_cache(key, value, caches[0], caches[1], slots)
        kv_cache.write_kv_cache(key, value, caches[2], caches[3], slots)
        same = all(torch.equal(caches[i].nan_to_num(7.0), caches[i + 2].nan_to_num(7.0)) for i in (0, 1))
        errors["write_kv_cache"] = 0.0 if same else float("inf")
        # Norms and rotary: their outputs are fresh tensors; rel_error still catches NaN.
        x = torch.randn(rows, s["hidden"], device=DEVICE, dtype=dtype)
        residual = torch.randn_like(x)
        weight = torch.randn(s["hidden"], device=DEVICE, dtype=dtype)
        errors["rms_norm"] = rel_error(triton_norm.rms_norm(x, weight, 1e-5), norm.rms_norm(x, weight, 1e-5))
        out, res = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5)
        ref_out, ref_res = norm.fused_add_rms_norm(x, residual, weight, 1e-5)
        errors["fused_add_rms_norm"] = max(rel_error(out, ref_out), rel_error(res, ref_res))
        qv, kv, positions, cos, sin = rotary_inputs(rows, dtype)
        got = triton_rotary.apply_rotary_embedding(positions, qv, kv, cos, sin)
        want = rotary.apply_rotary_embedding(positions, qv, kv, cos, sin)
        errors["apply_rotary_embedding"] = max(rel_error(got[0], want[0]), rel_error(got[1], want[1]))
        tol = TOLERANCE[dtype]
        name = str(dtype).removeprefix("torch.")
        results[name] = {k: {"max_rel_error": v, "ok": v <= tol} for k, v in errors.items()}
    results["ok"] = all(r["ok"] for d in results.values() for r in d.values())
    return results


def rotary_inputs(rows: int, dtype: torch.dtype):
    """Q and K as strided views of one fused QKV projection, and neox cos/sin tables."""
    heads, kv_heads, head_dim = SIZES["heads"]
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, device=DEVICE, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(rows, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(rows, kv_heads, head_dim)
    max_position = SIZES["max_position"]
    positions = torch.randint(0, max_position, (rows,), device=DEVICE)
    inv_freq = 10000 ** -torch.linspace(0, 1, head_dim // 2, device=DEVICE)
    angles = torch.arange(max_position, device=DEVICE)[:, None] * inv_freq
    return q, k, positions, angles.cos(), angles.sin()


# -- 2. kernel timings ----------------------------------------------------------------------------
def time_decode(batch, context, num_heads, num_kv_heads, head_dim, block_size, copy_bw, reference=False):
    from kvscale.kernels import triton_paged_attention

    dtype = torch.bfloat16
    q, kc, vc, bt, sl = paged_inputs([context] * batch, num_heads, num_kv_heads, head_dim, block_size, dtype)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ms = time_cuda(
        lambda: triton_paged_attention.paged_decode_attention(
            q, kc, vc, bt, sl, scale, max_seq_len=context, out=out
        )
    )
    # The least a decode step must move: every K and V byte once, the queries in, the outputs out.
    nbytes = (
        2 * batch * context * num_kv_heads * head_dim * kc.element_size() + 2 * q.numel() * q.element_size()
    )
    row = {
        "batch": batch, "context": context, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
        "head_dim": head_dim, "block_size": block_size, "dtype": "bfloat16", "ms": ms,
        "bytes_per_s": nbytes / (ms / 1e3), "fraction_of_copy_bandwidth": nbytes / (ms / 1e3) / copy_bw,
    }  # fmt: skip
    if reference:
        row["torch_reference_ms"] = time_cuda(
            lambda: paged_attention.paged_decode_attention(q, kc, vc, bt, sl, scale), iters=10
        )
    return row


def time_kernels(copy_bw: float) -> dict:
    from kvscale.kernels import triton_kv_cache, triton_norm, triton_paged_attention, triton_rotary

    s = SIZES
    dtype = torch.bfloat16
    heads, kv_heads, head_dim = s["heads"]
    results: dict[str, object] = {}
    goal = time_decode(*s["decode_goal"], heads, kv_heads, head_dim, 16, copy_bw, reference=True)
    goal["goal_fraction"] = DECODE_GOAL_FRACTION
    goal["meets_goal"] = goal["fraction_of_copy_bandwidth"] >= DECODE_GOAL_FRACTION
    results["paged_decode_attention_goal"] = goal
    results["paged_decode_attention_sweep"] = [
        time_decode(b, ctx, heads, kv_heads, head_dim, bs, copy_bw) for b, ctx, bs in s["decode_sweep"]
    ]
    results["paged_decode_attention_mha"] = time_decode(
        *s["decode_goal"], heads, heads, head_dim, 16, copy_bw
    )

    # Prefill: chunks over cached context (chunked prefill).
    chunks = s["prefill_chunks"]
    lens = [c + n for c, n in chunks]
    max_q = max(n for _, n in chunks)
    q, kc, vc, bt, sl = paged_inputs(lens, heads, kv_heads, head_dim, 16, dtype, sum(n for _, n in chunks))
    qsl = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0)
    out = torch.empty_like(q)
    scale = head_dim**-0.5
    ms = time_cuda(
        lambda: triton_paged_attention.paged_prefill_attention(
            q, kc, vc, bt, qsl, sl, scale, max_query_len=max_q, out=out
        )
    )
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in chunks)  # (query, key) pairs under the causal mask
    ref_ms = time_cuda(
        lambda: paged_attention.paged_prefill_attention(q, kc, vc, bt, qsl, sl, scale), iters=10
    )
    results["paged_prefill_attention"] = {
        "chunks_cached_new": chunks[0], "num_chunks": len(chunks), "heads": s["heads"], "ms": ms,
        "tflops": 4 * pairs * heads * head_dim / (ms / 1e3) / 1e12, "torch_reference_ms": ref_ms,
    }  # fmt: skip

    def memory_bound(name, fn, ref_fn, nbytes):
        ms = time_cuda(fn)
        results[name] = {
            "ms": ms,
            "bytes_per_s": nbytes / (ms / 1e3),
            "fraction_of_copy_bandwidth": nbytes / (ms / 1e3) / copy_bw,
            "torch_reference_ms": time_cuda(ref_fn, iters=20),
        }

    tokens = s["tokens"]
    key = torch.randn(tokens, kv_heads, head_dim, device=DEVICE, dtype=dtype)
    value = torch.randn_like(key)
    kc = torch.zeros(kv_heads, -(-tokens // 16), 16, head_dim, device=DEVICE, dtype=dtype)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(tokens, device=DEVICE)
    memory_bound(
        "write_kv_cache",
        lambda: triton_kv_cache.write_kv_cache(key, value, kc, vc, slots),
        lambda: kv_cache.write_kv_cache(key, value, kc, vc, slots),
        4 * key.numel() * key.element_size(),  # K and V, read and written
    )
    x = torch.randn(tokens, s["hidden"], device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.randn(s["hidden"], device=DEVICE, dtype=dtype)
    size = x.numel() * x.element_size()
    memory_bound(
        "rms_norm",
        lambda: triton_norm.rms_norm(x, weight, 1e-5),
        lambda: norm.rms_norm(x, weight, 1e-5),
        2 * size,
    )
    memory_bound(
        "fused_add_rms_norm",
        lambda: triton_norm.fused_add_rms_norm(x, residual, weight, 1e-5),
        lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-5),
        4 * size,
    )
    qv, kv, positions, cos, sin = rotary_inputs(tokens, dtype)
    memory_bound(
        "apply_rotary_embedding",
        lambda: triton_rotary.apply_rotary_embedding(positions, qv, kv, cos, sin),
        lambda: rotary.apply_rotary_embedding(positions, qv, kv, cos, sin),
        2 * (qv.numel() + kv.numel()) * qv.element_size(),
    )
    return results


# -- 3. end to end --------------------------------------------------------------------------------
def build_model(path: Path) -> dict:
    """Random bf16 weights in a local Hugging Face folder; the tokenizer is trained locally."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from kvscale.worker.testing.tiny_model import train_tokenizer

    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(tokenizer), tie_word_embeddings=False, initializer_range=0.02,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, **SIZES["model"],
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(DEVICE):  # random init on the GPU: seconds, not minutes
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)  # safetensors
    params = sum(p.numel() for p in model.parameters())
    del model
    return {"parameters": params, "vocab_size": len(tokenizer), "dtype": "bfloat16", **SIZES["model"]}


def hf_generate(path: Path, prompts: torch.Tensor, new_tokens: int) -> tuple[float, list[list[int]]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to(DEVICE).eval()
    ids = prompts.to(DEVICE)

    def run(n):
        return model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=2,
        )  # fmt: skip

    with torch.inference_mode():
        run(2)  # warm-up
        synchronize()
        start = time.perf_counter()
        out = run(new_tokens)
        synchronize()
        elapsed = time.perf_counter() - start
    return elapsed, out[:, prompts.shape[1] :].tolist()


def make_engine(path: Path, max_num_seqs: int, async_scheduling: bool = False):
    """Our engine on the model folder, as every model section runs it."""
    from kvscale.worker import LLM

    return LLM(
        str(path), dtype="bfloat16", device=DEVICE, max_num_seqs=max_num_seqs,
        async_scheduling=async_scheduling,
        max_model_len=SIZES["max_model_len"], kv_cache_memory_bytes=8 * 2**30 if DEVICE == "cuda" else 2**26,
        attention_backend="auto" if DEVICE == "cuda" else "triton",
        enforce_eager=False,  # graphs follow KVSCALE_CUDA_GRAPHS alone, whatever the environment's default
    )  # fmt: skip


def engine_runner(llm):
    """The engine's model runner, found by type so that renames inside the engine do not break the
    script."""
    return next(
        (v for v in vars(llm.engine).values() if hasattr(v, "backend") and hasattr(v, "kv_caches")), None
    )


def engine_graphs(llm):
    """The runner's CUDAGraphRunner, or None when the engine runs its decode steps eagerly."""
    from kvscale.worker.model.cuda_graphs import CUDAGraphRunner

    runner = engine_runner(llm)
    values = vars(runner).values() if runner is not None else ()
    return next((v for v in values if isinstance(v, CUDAGraphRunner)), None)


def engine_info(llm) -> dict:
    """Which paths the engine runs: its attention backend, and whether it captured CUDA graphs."""
    return {
        "attention_backend": getattr(getattr(engine_runner(llm), "backend", None), "name", None),
        "cuda_graphs": engine_graphs(llm) is not None,
    }


def engine_generate(
    path: Path, prompts: torch.Tensor, new_tokens: int
) -> tuple[float, list[list[int]], dict]:
    from kvscale.worker import SamplingParams

    llm = make_engine(path, prompts.shape[0])
    token_lists = prompts.tolist()
    llm.generate(token_lists, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    synchronize()
    start = time.perf_counter()
    outputs = llm.generate(token_lists, params)
    synchronize()
    elapsed = time.perf_counter() - start
    info = engine_info(llm)
    del llm
    return elapsed, [list(o.outputs[0].token_ids) for o in outputs], info


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


_random_llama: tuple[tempfile.TemporaryDirectory, dict] | None = None


def random_llama() -> tuple[Path, dict]:
    """The random Llama's folder and description, built on first use and shared by the model
    sections (building it trains the tokenizer and writes ~2 GB); main removes it at the end."""
    global _random_llama
    if _random_llama is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvscale-bench-")
        log("building the random Llama")
        _random_llama = (tmp, build_model(Path(tmp.name)))
    tmp, model_info = _random_llama
    return Path(tmp.name), model_info


def remove_random_llama() -> None:
    global _random_llama
    if _random_llama is not None:
        _random_llama[0].cleanup()
        _random_llama = None


def make_prompts(batch: int, prompt_len: int, vocab_size: int) -> torch.Tensor:
    """Seeded random prompts, BOS first, clear of the special tokens."""
    g = torch.Generator().manual_seed(0)
    body = torch.randint(4, vocab_size, (batch, prompt_len - 1), generator=g)
    return torch.cat([torch.zeros(batch, 1, dtype=torch.long), body], dim=1)


def end_to_end() -> dict:
    s = SIZES
    batch, prompt_len, new_tokens = s["batch"], s["prompt_len"], s["new_tokens"]
    path, model_info = random_llama()
    prompts = make_prompts(batch, prompt_len, model_info["vocab_size"])
    log("transformers generate")
    hf_s, hf_tokens = hf_generate(path, prompts, new_tokens)
    free_memory()
    log("kvscale engine")
    ours_s, our_tokens, info = engine_generate(path, prompts, new_tokens)
    free_memory()
    generated = batch * new_tokens
    # Random bf16 weights make near-ties common, so greedy agreement is a sanity figure, not a test.
    agree = []
    for ours, ref in zip(our_tokens, hf_tokens, strict=True):
        same = next((i for i, (a, b) in enumerate(zip(ours, ref, strict=False)) if a != b), len(ref))
        agree.append(same / new_tokens)
    speedup = hf_s / ours_s
    return {
        "model": model_info, "batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens,
        "transformers_s": hf_s, "transformers_tokens_per_s": generated / hf_s,
        "engine_s": ours_s, "engine_tokens_per_s": generated / ours_s,
        "speedup": speedup, "goal_speedup": E2E_GOAL_SPEEDUP, "meets_goal": speedup >= E2E_GOAL_SPEEDUP,
        "greedy_prefix_agreement_mean": statistics.mean(agree), **info,
    }  # fmt: skip


def free_memory() -> None:
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


# -- 4. decode steps ------------------------------------------------------------------------------
@contextlib.contextmanager
def cuda_graphs_env(enabled: bool) -> Iterator[None]:
    """KVSCALE_CUDA_GRAPHS for an engine made inside (the runner reads it once, when it is made;
    EngineArgs has no switch for it), restored afterwards."""
    name = "KVSCALE_CUDA_GRAPHS"
    before = os.environ.get(name)
    os.environ[name] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def time_decode_steps(
    path: Path, prompts: torch.Tensor, new_tokens: int, cuda_graphs: bool, async_scheduling: bool = False
) -> dict:
    """Greedy decode of the whole batch; each engine.step() after the prefill timed on its own. No
    synchronize between steps: each step waits for its tokens on the host anyway (under async
    scheduling, the previous step's), and one would undo the overlap async scheduling makes."""
    from kvscale.worker import SamplingParams

    batch = prompts.shape[0]
    with cuda_graphs_env(cuda_graphs):
        llm = make_engine(path, batch, async_scheduling)
    token_lists = prompts.tolist()
    # Warm-up at this batch size: compiles the eager path's kernels for its shapes.
    llm.generate(token_lists, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    # Count replays, so the report says whether the timed steps ran graphs, not only that they exist.
    graphs = engine_graphs(llm)
    replays = 0
    if graphs is not None:
        replay = graphs.run

        def counted(*args, **kwargs):
            nonlocal replays
            replays += 1
            return replay(*args, **kwargs)

        graphs.run = counted
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [engine.add_request(t, params) for t in token_lists]
    decoding: set[str] = set()
    prefill_steps = 0
    # The prefill: until every request has its first token.
    while len(decoding) < len(ids) and engine.has_unfinished_requests():
        decoding.update(o.request_id for o in engine.step() if o.outputs and o.outputs[0].token_ids)
        prefill_steps += 1
    replays = 0
    async_steps = engine.num_async_steps
    step_ms: list[float] = []
    tokens: list[int] = []  # per timed step: the tokens it produced (batch, in a whole-batch decode)
    synchronize()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        outputs = engine.step()
        step_ms.append((time.perf_counter() - start) * 1e3)
        tokens.append(sum(len(o.outputs[0].token_ids) for o in outputs if o.outputs))
    synchronize()
    async_steps = engine.num_async_steps - async_steps
    failed = engine.take_failed()
    if failed:
        raise next(iter(failed.values()))
    info = engine_info(llm)
    if graphs is not None:
        del graphs.run  # the class's method again
    del llm, graphs
    free_memory()
    return {
        "cuda_graphs_requested": cuda_graphs, **info, "graph_replays": replays,
        "async_scheduling": async_scheduling, "async_steps": async_steps,
        "prefill_steps": prefill_steps, "timed_steps": len(step_ms),
        "whole_batch_steps": all(n == batch for n in tokens),
        "median_step_ms": statistics.median(step_ms), "mean_step_ms": statistics.mean(step_ms),
        "min_step_ms": min(step_ms), "max_step_ms": max(step_ms),
        "tokens_per_s": sum(tokens) / (sum(step_ms) / 1e3),  # over the timed steps
    }  # fmt: skip


# (run name, CUDA graphs, async scheduling) of each batch's decode-step runs.
DECODE_STEP_RUNS = (
    ("cuda_graphs_on", True, False),
    ("cuda_graphs_off", False, False),
    ("cuda_graphs_on_async_scheduling", True, True),
)


def launched_steps(run: dict) -> int:
    """Timed steps that ran a forward: under async scheduling the last one only takes the outputs
    of the step before it (launched, with the first decode, by the last untimed step)."""
    return run["timed_steps"] - (1 if run["async_scheduling"] else 0)


def decode_steps() -> dict:
    s = SIZES
    prompt_len, new_tokens = s["step_prompt_len"], s["step_new_tokens"]
    path, model_info = random_llama()
    batches: dict[str, dict] = {}
    for batch in s["step_batches"]:
        prompts = make_prompts(batch, prompt_len, model_info["vocab_size"])
        row = {}
        for name, graphs, overlap in DECODE_STEP_RUNS:
            log(f"decode steps: batch {batch}, {name}")
            row[name] = time_decode_steps(path, prompts, new_tokens, graphs, overlap)
        ms = {name: run["median_step_ms"] for name, run in row.items()}
        # Above 1: graphs (async scheduling) make the step faster. Compares eager with eager when
        # graphs did not run.
        row["graphs_off_over_on"] = ms["cuda_graphs_off"] / ms["cuda_graphs_on"]
        row["async_off_over_on"] = ms["cuda_graphs_on"] / ms["cuda_graphs_on_async_scheduling"]
        batches[str(batch)] = row
    # Graphs ran: every timed step of each graphs-on run replayed one, and no graphs-off run had any.
    graphs_ran = all(
        b[on]["graph_replays"] == launched_steps(b[on]) > 0 and not b["cuda_graphs_off"]["cuda_graphs"]
        for b in batches.values()
        for on in ("cuda_graphs_on", "cuda_graphs_on_async_scheduling")
    )
    # Async scheduling ran: every timed step of its runs but the last (which launches nothing) was
    # launched ahead of its predecessor's tokens.
    runs = [(b["cuda_graphs_on_async_scheduling"], b["cuda_graphs_on"]) for b in batches.values()]
    async_ran = all(a["async_steps"] >= launched_steps(a) and s["async_steps"] == 0 for a, s in runs)
    result = {
        "model": model_info, "prompt_len": prompt_len, "new_tokens": new_tokens, "batches": batches,
        "graphs_ran": graphs_ran, "async_scheduling_ran": async_ran,
    }  # fmt: skip
    if not graphs_ran:
        result["note"] = (
            "CUDA graphs did not replay in every timed step of the graphs-on runs (they need a CUDA "
            "device and the Triton backend; on a CPU under --smoke they never run): a ratio whose "
            "graphs-on run has graph_replays 0 compares eager with eager"
        )
    return result


# -- cold start ----------------------------------------------------------------------------------
# One fresh process per run, so that nothing of this process (its CUDA context, Triton's in-memory
# kernel cache) is reused: what a new worker pod pays before its first token. The first run gets
# empty Triton and inductor cache folders; the later runs reuse the folders the first one filled,
# which is what a compile-cache volume shared by the replicas gives a pod (issue 29).
COLD_START_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from kvscale.worker import LLM, SamplingParams
imported = time.perf_counter()
path, device, max_model_len, kv_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
llm = LLM(path, dtype="bfloat16", device=device, max_num_seqs=64, max_model_len=max_model_len,
          kv_cache_memory_bytes=kv_bytes, attention_backend="auto" if device == "cuda" else "triton",
          enforce_eager=False)
ready = time.perf_counter()
llm.generate([[0, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
if device == "cuda":
    torch.cuda.synchronize()
first = time.perf_counter()
print(json.dumps({"import_s": imported - start, "engine_ready_s": ready - imported,
                  "first_token_s": first - ready, "total_s": first - start}))
"""


def cold_start() -> dict:
    import subprocess

    path, model_info = random_llama()
    kv_bytes = 8 * 2**30 if DEVICE == "cuda" else 2**26
    runs = []
    with tempfile.TemporaryDirectory(prefix="kvscale-caches-") as caches:
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": os.path.join(caches, "triton"),
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(caches, "inductor"),
        }
        for run in ("cold_caches", "warm_caches", "warm_caches_again"):
            log(f"cold start: {run}")
            args = [sys.executable, "-c", COLD_START_CHILD, str(path), DEVICE,
                    str(SIZES["max_model_len"]), str(kv_bytes)]  # fmt: skip
            wall = time.perf_counter()
            done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - wall
            if done.returncode != 0:
                raise RuntimeError(f"{run}: exit {done.returncode}: {done.stderr[-2000:]}")
            child = json.loads(done.stdout.strip().splitlines()[-1])
            runs.append({"run": run, "process_wall_s": wall, **child})
    warm_over_cold = runs[1]["engine_ready_s"] / runs[0]["engine_ready_s"]
    return {"model": model_info, "runs": runs, "warm_over_cold_engine_ready": warm_over_cold}


# -- main -----------------------------------------------------------------------------------------
SECTIONS = ("correctness", "kernels", "end_to_end", "decode_steps", "cold_start")


def _section(report: dict, name: str, fn: Callable[[], object]) -> None:
    log(name)
    start = time.perf_counter()
    try:
        report[name] = fn()
    except Exception as e:  # keep the other sections' figures
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
    log(f"{name} done in {time.perf_counter() - start:.1f} s")


def parse_sections(value: str) -> list[str]:
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown section(s) {', '.join(unknown) or '(none given)'}; choose from {', '.join(SECTIONS)}"
        )
    return names


def main(argv: list[str] | None = None) -> int:
    global DEVICE, SIZES
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object (also the default)")
    parser.add_argument("--skip-e2e", action="store_true", help="kernels only (no model sections)")
    parser.add_argument(
        "--sections",
        type=parse_sections,
        default=list(SECTIONS),
        help=f"comma-separated sections (default all; they run in this order): {','.join(SECTIONS)}",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes; on a CPU under TRITON_INTERPRET=1 (checks the script)",
    )
    args = parser.parse_args(argv)
    sections = [n for n in SECTIONS if n in args.sections]
    if args.skip_e2e:
        sections = [n for n in sections if n not in ("end_to_end", "decode_steps", "cold_start")]
    if args.smoke:
        SIZES = SMOKE_SIZES
    if not torch.cuda.is_available():
        from kvscale.kernels.dispatch import triton_interpreting

        if not (args.smoke and triton_interpreting()):
            error = (
                "CUDA is not available: this script checks and times the kernels on a GPU; to check the "
                "script itself on a CPU: TRITON_INTERPRET=1 python -m kvscale.worker.bench.gpu --smoke"
            )
            print(json.dumps({"error": error}))
            return 2
        DEVICE = "cpu"
    import triton

    on_gpu = DEVICE == "cuda"
    report: dict[str, object] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if on_gpu else "cpu (Triton interpreter: figures meaningless)",
        "capability": ".".join(map(str, torch.cuda.get_device_capability())) if on_gpu else None,
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if on_gpu else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(
            ["python -m kvscale.worker.bench.gpu", *(sys.argv[1:] if argv is None else argv)]
        ),
        "sections": sections,
    }
    start = time.perf_counter()
    try:
        copy_bw = 0.0  # the kernel timings' yardstick, measured only for them
        if "kernels" in sections:
            copy_bw = report["copy_bandwidth_bytes_per_s"] = copy_bandwidth(2**30 if on_gpu else 2**20)
        run = {
            "correctness": check_kernels,
            "kernels": lambda: time_kernels(copy_bw),
            "end_to_end": end_to_end,
            "decode_steps": decode_steps,
            "cold_start": cold_start,
        }
        for name in sections:
            _section(report, name, run[name])
    finally:
        remove_random_llama()
    report["wall_s"] = time.perf_counter() - start
    print(json.dumps(report, indent=2, default=str))
    failed = [k for k, v in report.items() if isinstance(v, dict) and "error" in v]
    correctness = report.get("correctness", {"ok": True})  # not run: nothing found wrong
    correct = isinstance(correctness, dict) and correctness.get("ok", False)
    return 0 if correct and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
