"""Per-step engine overhead at long outputs against short ones: does a step cost what it produces?

The engine's own work per step (scheduling, speculative proposals, sampling and penalties,
detokenization, building outputs, and what `LLM.generate` does with them between steps) should
not grow with how much each request has already generated. This benchmark runs one batch of
`--batch` requests to `--long-len` output tokens and one to `--short-len`, greedy, EOS ignored,
with repetition, presence and frequency penalties and logprobs on, and compares the overhead per
step late in the long run with the overhead per step of the short run.

Overhead of one step = the wall time from the start of that `engine.step()` to the start of the
next (so the consumer's work on its outputs counts) minus the time spent inside the forward passes
(`ModelRunner.forward`, and the draft model's forward when there is one: input tensors, the model,
logits). Only steps with the whole batch decoding count: the long run's window is the steps whose
mean output length is within `--window` tokens of the last step the whole batch ran (`--long-len`
without speculation; with it, requests finish at different steps); the short run's is every
all-decode step. The model is a random one-layer Llama (hidden 32) with the given model's
tokenizer and room for the long outputs, so that 64 × 8k tokens run in minutes on a CPU; its
forward is excluded anyway.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.bench.workload import code_workload
from kvscale.worker.testing.tiny_model import build_tiny_model

GOAL_RATIO = 1.2  # long-output overhead per step within 1.2x of short-output overhead

CONFIGS = {
    "plain": {},
    "ngram": {"speculative_method": "ngram", "num_speculative_tokens": 4, "speculative_adaptive": False},
    "draft": {"speculative_method": "draft", "num_speculative_tokens": 4, "speculative_adaptive": False},
}


def build_models(folder: Path, tokenizer_from: str, max_len: int) -> tuple[str, str]:
    common = dict(
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=max_len,
        tokenizer_from=tokenizer_from,
    )
    target = build_tiny_model(folder / "target", seed=0, **common)
    draft = build_tiny_model(folder / "draft", seed=1, **common)
    return str(target), str(draft)


class StepTimer:
    """Wraps engine.step and the forwards; one record per step: (start, forward seconds, mean
    output length of the running requests before the step, their number)."""

    def __init__(self, llm: LLM) -> None:
        engine = self.engine = llm.engine
        self.records: list[tuple[float, float, float, int]] = []
        self._forward_s = 0.0
        self._real_step = engine.step
        engine.step = self._step
        self._wrap(engine.runner)
        if engine.runner.draft is not None:
            self._wrap(engine.runner.draft)

    def _wrap(self, owner) -> None:
        real = owner.forward

        def forward(*args, **kwargs):
            start = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                self._forward_s += time.perf_counter() - start

        owner.forward = forward

    def _step(self):
        running = self.engine.scheduler.running
        mean_len = statistics.fmean(r.num_output_tokens for r in running) if running else 0.0
        all_decode = bool(running) and not self.engine.scheduler.waiting
        self._forward_s = 0.0
        start = time.perf_counter()
        out = self._real_step()
        self.records.append((start, self._forward_s, mean_len, len(running) if all_decode else 0))
        return out

    def last_full_batch_len(self, batch: int) -> float:
        """The mean output length before the last step at which all `batch` requests decoded."""
        return max((r[2] for r in self.records if r[3] == batch), default=0.0)

    def window(self, batch: int, lo: float, hi: float) -> list[tuple[float, float]]:
        """(overhead, tokens per sequence) of each step with `batch` decoding requests whose mean
        output length is in [lo, hi); the last step has no successor and is left out."""
        r = self.records
        return [
            (r[i + 1][0] - r[i][0] - r[i][1], r[i + 1][2] - r[i][2])
            for i in range(len(r) - 1)
            if r[i][3] == batch and lo <= r[i][2] < hi and r[i][2] > 0 and r[i + 1][3] == batch
        ]


def run_config(name: str, target: str, draft: str, args, prompts: list[list[int]]) -> dict[str, Any]:
    extra = dict(CONFIGS[name])
    if name == "draft":
        extra["draft_model"] = draft
    result: dict[str, Any] = {}
    for label, length in (("short", args.short_len), ("long", args.long_len)):
        llm = LLM(
            target,
            max_num_seqs=args.batch,
            max_num_batched_tokens=max(2048, args.batch * (args.prompt_len + 8)),
            max_model_len=args.prompt_len + args.long_len + 16,
            device="cpu",
            seed=args.seed,
            **extra,
        )
        timer = StepTimer(llm)
        params = SamplingParams(
            temperature=0.0,
            max_tokens=length,
            ignore_eos=True,
            repetition_penalty=1.1,
            presence_penalty=0.1,
            frequency_penalty=0.1,
            logprobs=1,
        )
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == length for o in outputs)
        # With speculation, requests reach `length` at different steps: the long run's window
        # ends at the last step the whole batch still ran (its mean output length then: `hi`).
        hi = timer.last_full_batch_len(args.batch)
        lo = 1 if label == "short" else hi - args.window
        window = timer.window(args.batch, lo, hi + 1)
        overheads = [o for o, _ in window]
        # Speculation emits several tokens per sequence in some steps (more in the long run's
        # repetitive tail): overhead per emitted token is the fairer figure there.
        per_token = [o / t for o, t in window if t > 0]
        steps = len(timer.records)
        result[label] = {
            "output_len": length,
            "steps": steps,
            "elapsed_s": round(elapsed, 2),
            "forward_s": round(sum(r[1] for r in timer.records), 2),
            "window_steps": len(overheads),
            "window_mean_output_len": [round(lo, 1), round(hi, 1)],
            "overhead_ms_per_step_median": round(statistics.median(overheads) * 1e3, 3),
            "overhead_ms_per_step_mean": round(statistics.fmean(overheads) * 1e3, 3),
            "tokens_per_seq_per_step": round(statistics.fmean(t for _, t in window), 3),
            "overhead_us_per_seq_token_median": round(statistics.median(per_token) * 1e6, 1),
        }
        del llm, timer
        print(f"longout {name} {label}: {result[label]}", file=sys.stderr, flush=True)
    ratio = result["long"]["overhead_ms_per_step_median"] / result["short"]["overhead_ms_per_step_median"]
    result["long_vs_short_overhead"] = round(ratio, 3)
    per_token = [result[k]["overhead_us_per_seq_token_median"] for k in ("long", "short")]
    result["long_vs_short_overhead_per_token"] = round(per_token[0] / per_token[1], 3)
    result["meets_goal"] = ratio <= GOAL_RATIO
    return result


def run(args) -> dict[str, Any]:
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="kvscale-longout-") as tmp:
        target, draft = build_models(Path(tmp), args.model, args.prompt_len + args.long_len + 64)
        tokenizer = LLM(target, num_kv_blocks=4, device="cpu").get_tokenizer()
        n = args.prompt_len
        prompts = code_workload(tokenizer, args.batch, seed=args.seed, prompt_len=(n, n, n)).prompts
        configs = {name: run_config(name, target, draft, args, prompts) for name in args.configs.split(",")}
    return {
        "benchmark": "longout",
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "window": args.window,
        "torch_threads": torch.get_num_threads(),
        "goal_long_vs_short_overhead_max": GOAL_RATIO,
        "configs": configs,
    }


def add_parser(sub, parents: list) -> None:
    p = sub.add_parser(
        "longout",
        parents=parents,
        help="per-step engine overhead (step time minus forward time) at long vs short outputs",
    )
    p.add_argument("--model", required=True, help="model folder whose tokenizer the random models use")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--long-len", type=int, default=8192)
    p.add_argument("--short-len", type=int, default=64)
    p.add_argument("--window", type=int, default=256, help="long run: the last this many output positions")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--configs", default="plain,ngram", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0: torch's default); on a shared CPU a multi-threaded small op waits "
        "for a descheduled thread, which swamps the overhead being measured",
    )
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run)
