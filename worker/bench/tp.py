"""Tensor parallelism: decode throughput and latency at TP = 1 against TP = N on one model.

    python -m kvscale.worker.bench tp --model PATH --tp-sizes 1,2 --batch-sizes 1,32 --json

For each size, one engine (its ranks spawned on this host: cuda:0..N-1 on GPUs, gloo on the CPU),
a warm-up, then per batch size: that many requests of --prompt-len random tokens each decode
--output-len tokens (EOS ignored, greedy). Decode is timed from the step after the last prefill;
step times are the inter-token latencies. Greedy tokens are checked identical across sizes. The
CPU path only shows it runs (gloo over two cores proves correctness, not speed).
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvscale.worker import LLM, SamplingParams


def decode_run(llm: LLM, batch: int, prompt_len: int, output_len: int, seed: int) -> dict[str, Any]:
    engine = llm.engine
    engine.kv_cache_manager.block_pool.reset_prefix_cache()
    rng = random.Random(seed)
    vocab = engine.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    step_s: list[float] = []
    started = time.perf_counter()
    decode_started = None
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        if decode_started is not None:
            step_s.append(time.perf_counter() - t)
        for out in outs:
            tokens[out.request_id].extend(out.outputs[0].token_ids)
        if decode_started is None and all(tokens[i] for i in ids):  # every prefill done
            decode_started = time.perf_counter()
            first_token_s = decode_started - started
    decode_s = time.perf_counter() - decode_started
    decoded = sum(len(t) - 1 for t in tokens.values())
    return {
        "batch_size": batch,
        "decode_tokens_per_s": round(decoded / decode_s, 1) if decode_s > 0 else None,
        "step_ms_p50": round(1000 * statistics.median(step_s), 3) if step_s else None,
        "step_ms_p90": round(1000 * statistics.quantiles(step_s, n=10)[-1], 3) if len(step_s) > 1 else None,
        "time_to_all_first_tokens_s": round(first_token_s, 4),
        "tokens": [tokens[i] for i in ids],
    }


def run(args) -> dict[str, Any]:
    sizes = [int(s) for s in args.tp_sizes.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    results: dict[str, Any] = {"model": args.model, "device": args.device, "dtype": args.dtype, "runs": {}}
    tokens_by_size = {}
    for tp in sizes:
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            tensor_parallel_size=tp,
            master_port=args.master_port,
            max_num_seqs=max(batches),
            max_model_len=args.prompt_len + args.output_len + 16,
            num_kv_blocks=args.num_kv_blocks,
            enable_prefix_caching=False,
        )
        try:
            decode_run(llm, min(batches), args.prompt_len, 4, seed=99)  # warm-up
            runs = [decode_run(llm, b, args.prompt_len, args.output_len, seed=b) for b in batches]
            kv_bytes = llm.engine.runner.kv_cache_bytes_per_rank
        finally:
            llm.engine.shutdown()
        tokens_by_size[tp] = [r.pop("tokens") for r in runs]
        results["runs"][f"tp{tp}"] = {"kv_cache_bytes_per_rank": kv_bytes, "batches": runs}
    base = sizes[0]
    results["greedy_tokens_identical"] = all(tokens_by_size[s] == tokens_by_size[base] for s in sizes)
    runs = results["runs"]
    results[f"speedup_vs_tp{base}"] = {
        f"tp{s}": {
            str(b): _ratio(runs[f"tp{s}"]["batches"][k], runs[f"tp{base}"]["batches"][k])
            for k, b in enumerate(batches)
        }
        for s in sizes[1:]
    }
    return results


def _ratio(run: dict, base: dict) -> float | None:
    a, b = run["decode_tokens_per_s"], base["decode_tokens_per_s"]
    return round(a / b, 3) if a and b else None


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser("tp", parents=parents, help="tensor parallelism: TP=1 against TP=N decode speed")
    p.add_argument("--model", required=True)
    p.add_argument("--tp-sizes", default="1,2", help="comma-separated, the first is the baseline")
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from free memory")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--master-port", type=int, default=29517)
    p.set_defaults(func=run)
