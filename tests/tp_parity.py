"""Run one model at tensor-parallel size 1 and N in this process (rank 0; the other ranks are the
engine's own spawned processes) and print what the tests compare, as one JSON line.

    python tests/tp_parity.py MODEL SCENARIOS_JSON TP

A script, not a test module: spawned ranks re-import the main module, and the process group is
process-wide state that should not outlive one model's runs inside pytest.
"""

from __future__ import annotations

import json
import socket
import sys

import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model.forward_batch import SeqChunk


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def logits_of(llm: LLM, prompts: list[list[int]], block_size: int) -> list[list[list[float]]]:
    """Logits of every prompt's last 3 positions, one forward over all prompts (fresh blocks)."""
    chunks, next_block = [], 0
    for p in prompts:
        n = -(-len(p) // block_size)
        chunks.append(SeqChunk(p, 0, list(range(next_block, next_block + n))))
        next_block += n
    with torch.inference_mode():
        logits = llm.engine.runner.forward(chunks, [3] * len(chunks))
    return logits.view(len(prompts), 3, -1).tolist()


def run(model: str, scenario: dict, tp: int) -> dict:
    args = dict(scenario["engine"], device="cpu", tensor_parallel_size=tp, master_port=free_port())
    llm = LLM(model, **args)
    try:
        engine = llm.engine
        result = {
            "logits": logits_of(llm, scenario["prompts"], args.get("block_size", 16)),
            "kv_cache_bytes_per_rank": engine.runner.kv_cache_bytes_per_rank,
            "num_blocks": engine.kv_cache_manager.num_blocks,
        }
        params = SamplingParams(temperature=0, max_tokens=scenario["max_tokens"], ignore_eos=True)
        engine.take_stats()
        passes = []
        for _ in range(2):  # the second pass finds the prompts in the prefix cache
            outs = llm.generate(scenario["prompts"], params)
            passes.append([list(o.outputs[0].token_ids) for o in outs])
        stats = engine.take_stats()
        result.update(
            tokens=passes,
            preemptions=stats.num_preemptions,
            prefix_cache_hits=stats.prefix_cache_hits,
            accepted_tokens=stats.num_accepted_tokens,
        )
        if engine.tp_driver is not None:  # how the steps reached the other ranks
            tp_group = engine.tp_driver.tp
            ring = tp_group.step_ring
            result.update(shm_steps=ring.sent if ring else 0, gloo_steps=tp_group.step_group is not None)
        return result
    finally:
        llm.engine.shutdown()


def main() -> None:
    model, scenarios, tp = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    out = {name: {"tp1": run(model, s, 1), f"tp{tp}": run(model, s, tp)} for name, s in scenarios.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
