"""Greedy outputs of the engine are token-identical to transformers' `generate`.

A divergence is accepted only where the reference logits show the two candidates tied within
float rounding; the comparison stops there (the continuations legitimately differ after it).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from model_fixtures import RANDOM_CONFIGS
from transformers import AutoModelForCausalLM

from kvscale.worker import LLM, SamplingParams

TIE_TOLERANCE = 1e-4


def hf_greedy(model_path: str, prompts: list[list[int]], max_new_tokens: list[int]):
    """Reference: one `generate` call per prompt (no padding), with the logits of every step."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    results = []
    for ids, n in zip(prompts, max_new_tokens, strict=True):
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=model.config.pad_token_id,
        )
        tokens = out.sequences[0, len(ids) :].tolist()
        results.append((tokens, [step[0] for step in out.logits]))
    return results


def assert_greedy_matches(ours: list[int], ref_tokens: list[int], ref_logits: list[torch.Tensor]) -> None:
    for j, (a, b) in enumerate(zip(ours, ref_tokens, strict=False)):
        if a != b:
            gap = abs(ref_logits[j][a].item() - ref_logits[j][b].item())
            assert gap <= TIE_TOLERANCE, f"diverged at token {j}: ours {a}, transformers {b}, logit gap {gap}"
            return
    assert len(ours) == len(ref_tokens), (len(ours), len(ref_tokens))


def mixed_prompts(vocab_size: int, n: int, seed: int, max_len: int = 90) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [1, 2, 15, 16, 17, 33] + [rng.randint(3, max_len) for _ in range(n - 6)]
    return [[0] + [rng.randrange(4, vocab_size) for _ in range(k)] for k in lengths[:n]]


def run_and_compare(model_path: str, prompts: list[list[int]], max_new: list[int], **engine_args) -> LLM:
    # The compiled variants compare compiled steps: start-up waits for the package (built or cached).
    llm = LLM(model_path, compile_in_background=False, **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_new]
    outputs = llm.generate(prompts, params)
    for out, (ref_tokens, ref_logits) in zip(outputs, hf_greedy(model_path, prompts, max_new), strict=True):
        assert_greedy_matches(out.outputs[0].token_ids, ref_tokens, ref_logits)
    assert llm.engine.kv_cache_manager.usage() == 0.0
    return llm


# Both forwards: eager, and compiled (AOTInductor on CPU, worker/model/compilation.py).
FORWARDS = pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "compiled"])


@FORWARDS
@pytest.mark.parametrize("name", sorted(RANDOM_CONFIGS))
def test_random_configs_match_transformers(random_model_factory, name, enforce_eager):
    path = random_model_factory(name)
    vocab_size = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    prompts = mixed_prompts(vocab_size, 8, seed=len(name))
    max_new = [random.Random(i).randint(4, 40) for i in range(len(prompts))]
    # A small token budget forces chunked prefill next to running decodes.
    llm = run_and_compare(
        path, prompts, max_new, num_kv_blocks=256, block_size=8, max_num_batched_tokens=48,
        enforce_eager=enforce_eager,
    )  # fmt: skip
    assert (llm.engine.runner.model.compiled is None) == enforce_eager


@FORWARDS
def test_target_model_batch_of_mixed_lengths(target_model, enforce_eager):
    prompts = mixed_prompts(4096, 10, seed=7, max_len=200)
    max_new = [48, 1, 7, 30, 64, 12, 40, 25, 3, 60]
    run_and_compare(target_model, prompts, max_new, num_kv_blocks=512, enforce_eager=enforce_eager)


@FORWARDS
def test_target_model_under_preemption(target_model, enforce_eager):
    prompts = mixed_prompts(4096, 8, seed=11, max_len=60)
    max_new = [40] * len(prompts)
    # 14 blocks of 16 tokens cannot hold 8 sequences of ~70-100 tokens: preemption must happen.
    llm = run_and_compare(
        target_model,
        prompts,
        max_new,
        num_kv_blocks=14,
        enable_prefix_caching=False,
        enforce_eager=enforce_eager,
    )
    assert llm.engine.scheduler.num_preemptions > 0


@FORWARDS
def test_target_model_under_preemption_with_prefix_caching(target_model, enforce_eager):
    prompts = mixed_prompts(4096, 8, seed=12, max_len=60)
    llm = run_and_compare(
        target_model, prompts, [40] * len(prompts), num_kv_blocks=14, enforce_eager=enforce_eager
    )
    assert llm.engine.scheduler.num_preemptions > 0


@FORWARDS
def test_target_model_prefix_caching_shared_prefixes(target_model, enforce_eager):
    rng = random.Random(3)
    shared = [0] + [rng.randrange(4, 4096) for _ in range(70)]
    prompts = [shared + [rng.randrange(4, 4096) for _ in range(rng.randint(1, 30))] for _ in range(6)]
    prompts.append(list(shared))  # a prompt that is exactly the cached prefix
    max_new = [20] * len(prompts)
    llm = run_and_compare(target_model, prompts, max_new, num_kv_blocks=256, enforce_eager=enforce_eager)
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    assert stats.hits > 0 and stats.hits / stats.queries > 0.3, stats
    # A second round is served from blocks freed by the first (cached, evictable) ones.
    before = stats.hits
    second = llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=20))
    assert stats.hits - before >= 2 * 64
    ref = hf_greedy(target_model, prompts[:2], [20, 20])
    for out, (tokens, logits) in zip(second, ref, strict=True):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logits)
