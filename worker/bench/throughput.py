"""Offline throughput: our engine against static batching and transformers, same prompts, same
per-request output lengths (EOS ignored), greedy, one process, one run.

(a) engine: continuous batching, up to --batch-size sequences at once;
(b) engine_static: the same engine fed one batch at a time, each waiting for its slowest member;
(c) hf_generate: transformers `generate` on left-padded static batches of --batch-size;
(d) hf_continuous_batching: transformers' own continuous batching manager (what `generate_batch`
    runs), with per-request max_new_tokens, at most --batch-size requests per batch.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.bench.workload import Workload

GOALS = {"engine/hf_generate": 3.0, "engine/hf_continuous_batching": 1.5, "mean_kv_utilization": 0.96}


def run_engine(llm: LLM, workload: Workload, static_batch: int | None = None) -> dict[str, Any]:
    engine = llm.engine
    kv, sched = engine.kv_cache_manager, engine.scheduler
    kv.block_pool.reset_prefix_cache()  # no run may reuse another run's prompts
    preemptions_before = sched.num_preemptions
    requests = list(zip(workload.prompts, workload.output_lens, strict=True))
    batches = [requests] if static_batch is None else [
        requests[i : i + static_batch] for i in range(0, len(requests), static_batch)
    ]  # fmt: skip
    held_tokens = held_slots = steps = 0
    peak_seqs, peak_blocks = 0, 0
    outputs = {}
    start = time.perf_counter()
    for batch in batches:
        for prompt, n in batch:
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        while engine.has_unfinished_requests():
            for out in engine.step():  # deltas: count each request's new tokens
                outputs[out.request_id] = outputs.get(out.request_id, 0) + len(out.outputs[0].token_ids)
            steps += 1
            # KV utilisation: tokens whose K/V is stored over the slots of the blocks held.
            blocks = kv.block_pool.num_used_blocks
            held_tokens += sum(r.num_computed_tokens for r in sched.running)
            held_slots += blocks * kv.block_size
            if len(sched.running) > peak_seqs:
                peak_seqs, peak_blocks = len(sched.running), blocks
    elapsed = time.perf_counter() - start
    lens = list(outputs.values())
    assert sorted(lens) == sorted(workload.output_lens), "an output length differs from the requested one"
    max_len = engine.max_model_len
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(workload.num_output_tokens / elapsed, 1),
        "steps": steps,
        "mean_kv_utilization": round(held_tokens / held_slots, 4) if held_slots else None,
        "peak_running_seqs": peak_seqs,
        "kv_tokens_held_at_peak": peak_blocks * kv.block_size,
        # The memory our peak batch occupied, reserved contiguously at max_model_len per sequence.
        "contiguous_max_len_seqs_in_same_memory": peak_blocks * kv.block_size // max_len,
        "num_preemptions": sched.num_preemptions - preemptions_before,
    }


def _hf_model(model_path: str, device: torch.device, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(device)
    model.eval()
    return model


def run_hf_generate(model, workload: Workload, batch_size: int, pad_id: int) -> dict[str, Any]:
    from transformers import GenerationConfig

    device = model.device
    requests = list(zip(workload.prompts, workload.output_lens, strict=True))
    computed = 0
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, (p, _) in enumerate(batch):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        new = max(n for _, n in batch)
        config = GenerationConfig(
            do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad_id
        )
        with torch.inference_mode():
            out = model.generate(ids.to(device), attention_mask=mask.to(device), generation_config=config)
        assert out.shape[1] - width == new, "transformers stopped early"
        computed += new * len(batch)
    elapsed = time.perf_counter() - start
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(workload.num_output_tokens / elapsed, 1),
        # Every row of a static batch runs until its slowest member ends.
        "wasted_token_fraction": round(1 - workload.num_output_tokens / computed, 4),
    }


def run_hf_continuous_batching(
    model, workload: Workload, batch_size: int, max_batch_tokens: int
) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(workload.output_lens), eos_token_id=-1)
    cb = ContinuousBatchingConfig(max_requests_per_batch=batch_size, max_batch_tokens=max_batch_tokens)
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    manager.start()
    try:
        _collect(manager, {"warmup": ([0, 5, 6, 7], 4)})  # start-up cost is not throughput
        requests = {
            f"r{i}": (p, n)
            for i, (p, n) in enumerate(zip(workload.prompts, workload.output_lens, strict=True))
        }
        start = time.perf_counter()
        results = _collect(manager, requests)
        elapsed = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    for rid, (_, n) in requests.items():
        assert len(results[rid].generated_tokens) == n, "transformers produced another length"
    return {
        "elapsed_s": round(elapsed, 3),
        "output_tokens_per_s": round(workload.num_output_tokens / elapsed, 1),
    }


def _collect(manager, requests: dict[str, tuple[list[int], int]]) -> dict:
    for rid, (prompt, n) in requests.items():
        manager.add_request(prompt, request_id=rid, max_new_tokens=n, eos_token_id=-1)
    done = {}
    while len(done) < len(requests):
        result = manager.get_result(timeout=1)
        if result is not None and result.is_finished():
            done[result.request_id] = result
    return done


def run(args) -> dict[str, Any]:
    from kvscale.worker.bench.workload import code_workload

    llm = LLM(
        args.model,
        max_num_seqs=args.batch_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        device=args.device,
        dtype=args.dtype,
    )
    workload = code_workload(llm.get_tokenizer(), args.num_requests, seed=args.seed)
    llm.generate([[0, 5, 6, 7]] * 2, SamplingParams(max_tokens=4))  # warm-up
    result: dict[str, Any] = {
        "model": args.model,
        "device": str(llm.engine.runner.device),
        "dtype": str(llm.engine.runner.dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "num_requests": args.num_requests,
            "batch_size": args.batch_size,
            "prompt_tokens": sum(len(p) for p in workload.prompts),
            "output_tokens": workload.num_output_tokens,
            "output_len_min_median_max": _min_median_max(workload.output_lens),
            "prompt_len_min_median_max": _min_median_max([len(p) for p in workload.prompts]),
            "seed": args.seed,
        },
        "engine": run_engine(llm, workload),
        "engine_static": run_engine(llm, workload, static_batch=args.batch_size),
    }
    if not args.skip_hf:
        runner = llm.engine.runner
        model = _hf_model(args.model, runner.device, runner.dtype)
        pad = llm.get_tokenizer().pad_token_id or 0
        result["hf_generate"] = run_hf_generate(model, workload, args.batch_size, pad)
        result["hf_continuous_batching"] = run_hf_continuous_batching(
            model, workload, args.batch_size, args.max_num_batched_tokens
        )
    ours = result["engine"]["output_tokens_per_s"]
    result["ratios"] = {
        f"engine/{peer}": round(ours / result[peer]["output_tokens_per_s"], 2)
        for peer in ("engine_static", "hf_generate", "hf_continuous_batching")
        if peer in result
    }
    measured = {**result["ratios"], "mean_kv_utilization": result["engine"]["mean_kv_utilization"]}
    result["goals"] = {
        k: {"goal": g, "value": measured.get(k), "met": (measured.get(k) or 0) >= g} for k, g in GOALS.items()
    }
    return result


def _min_median_max(values: list[int]) -> list[int]:
    s = sorted(values)
    return [s[0], s[len(s) // 2], s[-1]]


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "throughput", parents=parents, help="offline throughput against static batching and transformers"
    )
    p.add_argument("--model", required=True)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32, help="max sequences at once, for every contender")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-hf", action="store_true", help="only our engine (no transformers peers)")
    p.set_defaults(func=run)
