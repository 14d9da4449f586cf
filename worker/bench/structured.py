"""Structured outputs' cost: step time with half the batch constrained against none, and grammar
compile time.

For each `--batch` size the same greedy prompts run twice in one process, alternating `--repeats`
times: all unconstrained, then with half of them (at least one) constrained by a JSON schema (an
array of at least 64 bounded integers, so that the grammar does not end early). A step counts
when the whole batch decodes (no prefill, nobody waiting or finished); the overhead is the median
constrained step time over the median unconstrained one, minus 1. The engine's own mask time
(filling and applying the bitmask rows, the `kvscale_structured_output_mask_seconds` metric) is
reported per step too. Compile time: each of a few schemas (the tools' `required` array among
them) compiled cold by a fresh backend (our cache and xgrammar's are both bypassed), median of
`--compile-repeats`.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.bench.longout import StepTimer
from kvscale.worker.bench.workload import code_workload
from kvscale.worker.sample.sampling_params import StructuredOutputsParams
from kvscale.worker.server.tool_calls import required_calls_schema
from kvscale.worker.structured_output.xgrammar_backend import XgrammarBackend

GOAL_OVERHEAD = 0.05  # at batch 64

LONG_ARRAY = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 64}
POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
    "required": ["x", "y"],
}
COMPILE_SCHEMAS: dict[str, Any] = {
    "long_array": LONG_ARRAY,
    "nested_refs": {
        "$defs": {"point": POINT},
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 32},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
            "path": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1},
        },
        "required": ["name", "path"],
    },
    "tools_required": required_calls_schema(
        [
            (
                "get_weather",
                {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
            ),
            ("search", {"type": "object", "properties": {"q": {"type": "string"}, "n": {"type": "integer"}}}),
            ("now", None),
        ],
        parallel=True,
    ),
}


def full_batch_step_times(timer: StepTimer, batch: int) -> list[float]:
    r = timer.records
    return [r[i + 1][0] - r[i][0] for i in range(len(r) - 1) if r[i][3] == batch and r[i + 1][3] == batch]


def run_batch(
    llm: LLM, prompts: list[list[int]], batch: int, constrained: bool, args
) -> tuple[list[float], list]:
    """Step times (s) of the all-decode steps, and the engine's mask times, of one run."""
    plain = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    grammar = SamplingParams(
        temperature=0.0,
        max_tokens=args.output_len,
        structured_outputs=StructuredOutputsParams(json=LONG_ARRAY, disable_any_whitespace=True),
    )
    n_constrained = max(1, batch // 2) if constrained else 0
    params = [grammar] * n_constrained + [plain] * (batch - n_constrained)
    llm.engine.take_stats()
    timer = StepTimer(llm)
    try:
        llm.generate(prompts[:batch], params)
    finally:  # unwrap for the next run (the timer set instance attributes over the methods)
        del llm.engine.step
        del llm.engine.runner.forward
    return full_batch_step_times(timer, batch), llm.engine.take_stats().grammar_mask_times


def compile_times(llm: LLM, repeats: int) -> dict[str, Any]:
    engine = llm.engine
    start = time.perf_counter()
    backend = XgrammarBackend(engine.tokenizer, engine.vocab_size, sorted(engine.eos_token_ids))
    out: dict[str, Any] = {"tokenizer_info_s": round(time.perf_counter() - start, 4)}
    for name, schema in COMPILE_SCHEMAS.items():
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            backend.compile(StructuredOutputsParams(json=schema))
            times.append(time.perf_counter() - start)
        out[f"{name}_ms_median"] = round(statistics.median(times) * 1e3, 3)
    return out


def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    llm = LLM(
        args.model,
        max_num_seqs=max(batches),
        max_model_len=args.prompt_len + args.output_len + 16,
        device="cpu",
        dtype="float32",
    )
    n = args.prompt_len
    prompts = code_workload(llm.get_tokenizer(), max(batches), seed=args.seed, prompt_len=(n, n, n)).prompts
    run_batch(llm, prompts, 1, True, args)  # warm-up: the grammar library's vocabulary tables, the compile
    results: dict[str, Any] = {}
    for batch in batches:
        steps: dict[bool, list[float]] = {False: [], True: []}
        masks: list[float] = []
        pair_overheads = []  # each back-to-back pair's own ratio: the VM's drift cancels within a pair
        for _ in range(args.repeats):
            pair = {}
            for constrained in (False, True):
                times, mask = run_batch(llm, prompts, batch, constrained, args)
                steps[constrained].extend(times)
                pair[constrained] = statistics.median(times)
                if constrained:
                    masks.extend(mask)
            pair_overheads.append(pair[True] / pair[False] - 1)
        plain, grammar = statistics.median(steps[False]), statistics.median(steps[True])
        results[str(batch)] = {
            "constrained": max(1, batch // 2),
            "steps_counted": [len(steps[False]), len(steps[True])],
            "step_ms_median_unconstrained": round(plain * 1e3, 3),
            "step_ms_median_constrained": round(grammar * 1e3, 3),
            "overhead": round(grammar / plain - 1, 4),
            "overhead_per_pair": [round(o, 4) for o in pair_overheads],
            "overhead_median_of_pairs": round(statistics.median(pair_overheads), 4),
            "mask_ms_per_step_median": round(statistics.median(masks) * 1e3, 3) if masks else None,
        }
    return {
        "benchmark": "structured",
        "model": args.model,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "batches": results,
        "compile": compile_times(llm, args.compile_repeats),
        "goal_overhead_max_at_64": GOAL_OVERHEAD,
        "meets_goal": results["64"]["overhead"] <= GOAL_OVERHEAD if "64" in results else None,
    }


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "structured",
        parents=parents,
        help="step-time overhead of constrained decoding (half the batch) and grammar compile time",
    )
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,16,64", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128, help="tokens per request (the grammar needs 128+)")
    p.add_argument("--repeats", type=int, default=5, help="unconstrained/constrained pairs per batch size")
    p.add_argument("--compile-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
