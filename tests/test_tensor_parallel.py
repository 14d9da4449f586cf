"""Tensor parallelism on CPU with gloo, TP = 2 against TP = 1 (docs/parallelism.md): logits within
1e-4 and greedy tokens identical over 64 tokens, with paged KV under preemption, prefix-cache reuse,
chunked prefill and n-gram speculation; each rank's KV is half of one rank's at TP = 1; KV heads
replicated when TP > num_kv_heads; sizes that do not divide the heads refused.

Each model runs in a subprocess (tests/tp_parity.py) which is rank 0 and spawns rank 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from model_fixtures import DRAFT, TARGET
from server_fixtures import free_port
from transformers import AutoConfig

from kvscale.worker.model.layers.tp_layout import tp_layout
from kvscale.worker.model.llama import DecoderSpec

HERE = Path(__file__).resolve().parent
NEW_TOKENS = 64


def prompts(vocab: int, lengths: list[int]) -> list[list[int]]:
    """Token ids with a repeated motif (so n-gram lookup finds proposals), distinct per prompt."""
    out = []
    for i, n in enumerate(lengths):
        motif = [(17 * i + 5 * j + 3) % (vocab - 10) + 10 for j in range(7)]
        out.append([(motif * n)[k] if k % 11 else 10 + i for k in range(n)])
    return out


# Four prompts of 40 tokens + 64 new need 28 blocks of 16; 16 blocks force preemptions. A 24-token
# batch budget splits every prompt's prefill into chunks.
PAGED = dict(block_size=16, num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=24, max_num_seqs=4)
NGRAM = dict(
    block_size=16,
    num_kv_blocks=64,
    max_num_batched_tokens=64,
    speculative_method="ngram",
    num_speculative_tokens=3,
    speculative_adaptive=False,
)


def run_parity(model: str, scenarios: dict, tp: int = 2) -> dict:
    proc = subprocess.run(
        [sys.executable, str(HERE / "tp_parity.py"), model, json.dumps(scenarios), str(tp)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def max_abs_diff(a, b) -> float:
    import torch

    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def check_parity(result: dict, vocab_kv_heads: tuple[int, int]) -> None:
    one, two = result["tp1"], result["tp2"]
    assert max_abs_diff(one["logits"], two["logits"]) < 1e-4
    assert one["num_blocks"] == two["num_blocks"]
    for pass_one, pass_two in zip(one["tokens"], two["tokens"], strict=True):
        assert all(len(t) == NEW_TOKENS for t in pass_two)
        assert pass_one == pass_two
    assert one["tokens"][0] == one["tokens"][1]  # the prefix-cached pass too
    # One host: rank 1 got every step from the shared-memory ring, none over gloo.
    assert two["shm_steps"] > 0 and not two["gloo_steps"]
    # Each rank holds its share of the KV heads: half, or all of one head replicated.
    _, kv_heads = vocab_kv_heads
    per_rank = one["kv_cache_bytes_per_rank"][0] * max(1, kv_heads // 2) // kv_heads
    assert two["kv_cache_bytes_per_rank"] == [per_rank, per_rank]


# The draft model runs on rank 0 alone (on its device, unsharded); the target's ranks verify.
DRAFT_SPEC = dict(
    block_size=16,
    num_kv_blocks=64,
    max_num_batched_tokens=64,
    draft_model=str(DRAFT),
    num_speculative_tokens=3,
    speculative_adaptive=False,
)


def scenarios_for(vocab: int, *names: str) -> dict:
    chosen = {"paged": PAGED, "ngram": NGRAM, "draft": DRAFT_SPEC}
    ps = prompts(vocab, [40, 40, 37, 40])
    return {n: {"engine": chosen[n], "prompts": ps, "max_tokens": NEW_TOKENS} for n in names}


def test_fixture_model_tp2_matches_tp1(target_model):
    """Paged (preemption, prefix cache, chunked prefill), n-gram and draft-model speculation."""
    if not DRAFT.is_dir():
        pytest.skip(f"{DRAFT} is missing")
    result = run_parity(target_model, scenarios_for(4096, "paged", "ngram", "draft"))
    for name in ("paged", "ngram", "draft"):
        check_parity(result[name], (4096, 2))
    paged, ngram, draft = result["paged"], result["ngram"], result["draft"]
    for tp in ("tp1", "tp2"):
        assert paged[tp]["preemptions"] > 0 and paged[tp]["prefix_cache_hits"] > 0
        assert ngram[tp]["accepted_tokens"] > 0 and draft[tp]["accepted_tokens"] > 0
    assert paged["tp1"]["kv_cache_bytes_per_rank"][0] == 2 * paged["tp2"]["kv_cache_bytes_per_rank"][0]


# llama3-rope has one KV head (replicated on both ranks), qwen2 attention biases, mistral-sliding a
# 24-token window (shorter than the sequences), qwen3 per-head q/k norms; all GQA.
# llama-mha-untied: an LM head of its own, sliced like the embedding (paged scenario only).
@pytest.mark.parametrize(
    ("name", "scenarios"),
    [
        ("llama3-rope", ("paged", "ngram")),
        ("qwen2", ("paged", "ngram")),
        ("mistral-sliding", ("paged", "ngram")),
        ("qwen3", ("paged", "ngram")),
        ("llama-mha-untied", ("paged",)),
    ],
)
def test_random_configs_tp2_match_tp1(random_model_factory, name, scenarios):
    path = random_model_factory(name)
    config = AutoConfig.from_pretrained(path)
    result = run_parity(path, scenarios_for(config.vocab_size, *scenarios))
    for scenario in scenarios:
        check_parity(result[scenario], (config.vocab_size, config.num_key_value_heads))
    assert result["paged"]["tp2"]["preemptions"] > 0
    if "ngram" in scenarios:
        assert result["ngram"]["tp2"]["accepted_tokens"] > 0


def test_layout_splits_heads_and_replicates_kv_heads():
    # 6 query heads, 2 KV heads (the fixture model) over 2 ranks: 3 and 1 each.
    a, b = (tp_layout(num_heads=6, num_kv_heads=2, intermediate_size=1024, vocab_size=4097, rank=r, size=2)
            for r in (0, 1))  # fmt: skip
    assert (a.num_heads, a.num_kv_heads, a.kv_head_start, b.kv_head_start) == (3, 1, 0, 1)
    assert (a.vocab_per_rank, b.vocab_start) == (2049, 2049)
    # 8 query heads, 2 KV heads over 4 ranks: each rank one KV head, ranks 0-1 head 0, 2-3 head 1,
    # which is the KV head of each rank's query heads (query head j uses KV head j // 4).
    for r in range(4):
        layout = tp_layout(num_heads=8, num_kv_heads=2, intermediate_size=64, vocab_size=64, rank=r, size=4)
        first_query_head = r * layout.num_heads
        assert layout.num_kv_heads == 1 and layout.kv_head_start == first_query_head // 4


@pytest.mark.parametrize(
    ("heads", "kv_heads", "size", "message"),
    [
        (6, 2, 4, "does not divide the model's 6 attention heads"),
        (6, 6, 3, None),
        (12, 8, 3, "does not divide the model's 8 KV heads"),
        (10, 5, 5, "does not divide the MLP's intermediate size 96"),
        (12, 4, 6, "is not a multiple of the model's 4 KV heads"),
    ],
)
def test_layout_refuses_sizes_the_heads_do_not_split_into(heads, kv_heads, size, message):
    kwargs = dict(num_heads=heads, num_kv_heads=kv_heads, intermediate_size=96, vocab_size=100, size=size)
    if message is None:
        assert tp_layout(rank=0, **kwargs).num_heads == heads // size
        return
    with pytest.raises(ValueError, match=message):
        tp_layout(rank=0, **kwargs)


def test_engine_refuses_tp_that_does_not_divide_the_heads_before_starting_ranks(target_model):
    from kvscale.worker import LLM

    spec = DecoderSpec.from_hf_config(AutoConfig.from_pretrained(TARGET))
    assert spec.num_heads == 6
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's 6 attention"):
        LLM(target_model, device="cpu", num_kv_blocks=8, tensor_parallel_size=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size must be positive"),
        (dict(tensor_parallel_size=3, nnodes=2), "must be a multiple of nnodes 2"),
        (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), r"node_rank must be in \[0, 2\)"),
    ],
)
def test_parallel_flags_are_checked(kwargs, message):
    from kvscale.worker.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(model="m", **kwargs)


def test_tp_benchmark_cpu_path_runs(target_model):
    """The GPU script (`python -m kvscale.worker.bench tp`), tiny on the CPU: it runs and its TP=2
    greedy tokens equal TP=1's; its speed here means nothing."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.bench", "tp", "--model", target_model, "--device", "cpu",
         "--batch-sizes", "1,2", "--prompt-len", "8", "--output-len", "4", "--num-kv-blocks", "16",
         "--master-port", str(free_port()), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["greedy_tokens_identical"] is True
    assert set(result["runs"]) == {"tp1", "tp2"} and "2" in result["speedup_vs_tp1"]["tp2"]
    one, two = (result["runs"][k]["kv_cache_bytes_per_rank"] for k in ("tp1", "tp2"))
    assert two == [one[0] // 2] * 2


@pytest.mark.parametrize("name", ["fixture", "llama3-rope"])
def test_a_rank_loads_its_slice_of_each_tensor(target_model, random_model_factory, name):
    """Rank 1 of 2 through the real loader (no process group is needed to load): every parameter
    is its slice of the checkpoint; with one KV head, rank 1 holds that head (replicated)."""
    from types import SimpleNamespace

    import torch
    from safetensors import safe_open

    from kvscale.worker.model.loader import load_config, load_model

    path = target_model if name == "fixture" else random_model_factory(name)
    config = load_config(path)
    tp = SimpleNamespace(rank=1, world_size=2, is_driver=False)
    model = load_model(path, config, 256, torch.device("cpu"), torch.float32, tp)
    with safe_open(Path(path, "model.safetensors"), framework="pt") as f:
        full = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)
    spec, layout = model.spec, model.layout
    hd, q, inter = spec.head_dim, layout.num_heads * spec.head_dim, layout.intermediate_size
    kv0 = layout.kv_head_start * hd
    assert layout.kv_head_start == (1 if spec.num_kv_heads == 2 else 0)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    pre = "model.layers.0."
    assert torch.equal(
        attn.qkv_proj.weight,
        torch.cat([full[pre + "self_attn.q_proj.weight"][q : 2 * q],
                   full[pre + "self_attn.k_proj.weight"][kv0 : kv0 + hd * layout.num_kv_heads],
                   full[pre + "self_attn.v_proj.weight"][kv0 : kv0 + hd * layout.num_kv_heads]]),
    )  # fmt: skip
    assert torch.equal(attn.o_proj.weight, full[pre + "self_attn.o_proj.weight"][:, q : 2 * q])
    assert torch.equal(
        mlp.gate_up_proj.weight,
        torch.cat([full[pre + "mlp.gate_proj.weight"][inter:], full[pre + "mlp.up_proj.weight"][inter:]]),
    )
    assert torch.equal(mlp.down_proj.weight, full[pre + "mlp.down_proj.weight"][:, inter:])
    embed, v = full["model.embed_tokens.weight"], layout.vocab_per_rank
    assert torch.equal(model.model.embed_tokens.weight[: spec.vocab_size - v], embed[v:])
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied


def test_tp1_starts_no_process_and_no_process_group(target_model):
    import multiprocessing

    import torch.distributed as dist

    from kvscale.worker import LLM

    llm = LLM(target_model, device="cpu", num_kv_blocks=8)
    assert llm.engine.tp_driver is None and llm.engine.runner.tp is None
    assert not dist.is_initialized() and multiprocessing.active_children() == []
    assert llm.engine.runner.cuda_graphs is None  # (CPU) and the layers have no group:
    assert all(getattr(m, "tp", None) is None for m in llm.engine.runner.model.modules())
