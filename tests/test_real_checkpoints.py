"""Real checkpoints' shapes: Llama 3.1, Qwen2.5, Qwen3 and Mistral, loaded and served as published.

Each config.json (and generation_config.json) below is the published one of a real model with its
sizes cut down, every feature kept: hidden size, layers and vocabulary shrink, lengths
(max_position_embeddings, sliding_window, original_max_position_embeddings) are divided by 128, so
that a test goes past the sliding window and past the original RoPE length in a few hundred
tokens. initializer_range is raised from 0.02 to 0.1 so that random attention is sharp enough for a
wrong mask to change greedy tokens. Weights are random, saved as transformers saves real ones:
bfloat16, sharded, with model.safetensors.index.json. Greedy tokens are compared with transformers
(float32 on the CPU, loaded from the same bf16 files; our engine with dtype float32).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from model_fixtures import TARGET
from test_engine_vs_hf import assert_greedy_matches, hf_greedy
from transformers import AutoConfig, AutoModelForCausalLM

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model.loader import load_generation_defaults, read_safetensors_header
from kvscale.worker.model.mapped_reader import LOAD_THREADS
from kvscale.worker.model.model_runner import resolve_max_model_len

VOCAB = 4096  # the fixture tokenizer's (tests/model_fixtures.py TARGET); trained locally without it

# meta-llama/Llama-3.1-8B-Instruct: hidden 4096 -> 128, 32 layers -> 2, heads 32/8 -> 4/1,
# positions 131072 -> 1024, original 8192 -> 64.
LLAMA_3_1 = {
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": [1, 8, 9],
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.1,
    "intermediate_size": 448,
    "max_position_embeddings": 1024,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 64,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
}
LLAMA_3_1_GENERATION = {
    "bos_token_id": 0,
    "do_sample": True,
    "eos_token_id": [1, 8, 9],  # 128001 <|end_of_text|>, 128008 <|eom_id|>, 128009 <|eot_id|>
    "temperature": 0.6,
    "top_p": 0.9,
}

# Qwen/Qwen2.5-0.5B-Instruct: hidden 896 -> 112, 24 layers -> 2, heads 14/2 -> 7/1 (head_dim 64 ->
# 16), positions 32768 -> 256; the vocabulary is padded past the tokenizer's, as Qwen's is.
QWEN2_5 = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 112,
    "initializer_range": 0.1,
    "intermediate_size": 608,
    "max_position_embeddings": 256,
    "max_window_layers": 21,
    "model_type": "qwen2",
    "num_attention_heads": 7,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 256,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB + 64,
}
QWEN2_5_GENERATION = {
    "bos_token_id": 0,
    "pad_token_id": 0,
    "do_sample": True,
    "eos_token_id": [1, 0],  # 151645 <|im_end|>, 151643 <|endoftext|>
    "repetition_penalty": 1.1,
    "temperature": 0.7,
    "top_p": 0.8,
    "top_k": 20,
}
# The same with Qwen2's sliding window switched on: layers from max_window_layers on slide.
QWEN2_5_SLIDING = {**QWEN2_5, "use_sliding_window": True, "sliding_window": 32, "max_window_layers": 1}

# Qwen/Qwen3-0.6B: hidden 1024 -> 128, 28 layers -> 2, heads 16/8 -> 4/2, head_dim 128 -> 64 (so
# heads x head_dim = 256 != hidden), positions 40960 -> 320; per-head q/k norms.
QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.1,
    "intermediate_size": 384,
    "max_position_embeddings": 320,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": VOCAB,
}
QWEN3_GENERATION = {
    "bos_token_id": 0,
    "do_sample": True,
    "eos_token_id": [1, 0],
    "pad_token_id": 0,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
}

# mistralai/Mistral-7B-v0.1: hidden 4096 -> 128, 32 layers -> 2, heads 32/8 -> 4/1, positions
# 32768 -> 256, sliding window 4096 -> 32.
MISTRAL = {
    "architectures": ["MistralForCausalLM"],
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hidden_act": "silu",
    "hidden_size": 128,
    "initializer_range": 0.1,
    "intermediate_size": 448,
    "max_position_embeddings": 256,
    "model_type": "mistral",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "sliding_window": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "vocab_size": VOCAB,
}
MISTRAL_GENERATION = {"bos_token_id": 0, "eos_token_id": 1}

CHECKPOINTS = {
    "llama-3.1": (LLAMA_3_1, LLAMA_3_1_GENERATION),
    "qwen2.5": (QWEN2_5, QWEN2_5_GENERATION),
    "qwen2.5-sliding": (QWEN2_5_SLIDING, QWEN2_5_GENERATION),
    "qwen3": (QWEN3, QWEN3_GENERATION),
    "mistral": (MISTRAL, MISTRAL_GENERATION),
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def save_tokenizer(path: Path) -> None:
    if TARGET.is_dir():
        for name in TOKENIZER_FILES:
            if (TARGET / name).is_file():
                (path / name).write_bytes((TARGET / name).read_bytes())
        return
    from kvscale.worker.testing.tiny_model import train_tokenizer

    train_tokenizer(vocab_size=VOCAB).save_pretrained(path)


def build_checkpoint(
    path: Path, config: dict, generation: dict, *, dtype=torch.bfloat16, max_shard_size="1MB", seed=0
) -> Path:
    """A Hugging Face folder as transformers writes real ones: config, generation config,
    tokenizer, weights in `dtype` split into shards listed by model.safetensors.index.json."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    model.to(dtype).save_pretrained(path, max_shard_size=max_shard_size)
    (path / "config.json").write_text(json.dumps(config, indent=2))  # exactly as published
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            config, generation = CHECKPOINTS[name]
            built[name] = build_checkpoint(tmp_path_factory.mktemp(name), config, generation)
        return built[name]

    return get


def long_prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(4, VOCAB) for _ in range(48)]
    prompts = [[0] + [rng.randrange(4, VOCAB) for _ in range(n - 1)] for n in lengths]
    # Two prompts share a 49-token prefix (longer than the 32-token windows): prefix-cache hits
    # whose cached blocks reach outside the window of the tokens that follow.
    prompts += [[0, *shared, *(rng.randrange(4, VOCAB) for _ in range(k))] for k in (30, 7)]
    return prompts


def assert_matches_transformers(path: Path, prompts: list[list[int]], max_new: list[int], **engine_args):
    llm = LLM(str(path), dtype="float32", device="cpu", **engine_args)
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in max_new]
    outputs = llm.generate(prompts, params)
    for out, (tokens, logits) in zip(outputs, hf_greedy(str(path), prompts, max_new), strict=True):
        assert_greedy_matches(out.outputs[0].token_ids, tokens, logits)
    return llm, outputs


def test_checkpoints_are_bf16_and_sharded(checkpoint):
    for name in CHECKPOINTS:
        path = checkpoint(name)
        index = json.loads((path / "model.safetensors.index.json").read_text())
        shards = set(index["weight_map"].values())
        assert len(shards) >= 2 and all((path / s).is_file() for s in shards), name
        header_len = int.from_bytes((path / min(shards)).read_bytes()[:8], "little")
        header = json.loads((path / min(shards)).read_bytes()[8 : 8 + header_len])
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}, name


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_greedy_parity_beyond_window_and_original_rope_length(checkpoint, name):
    """Prompts of 40-150 tokens and up to 48 new ones: past Mistral's and Qwen2.5-sliding's
    32-token windows (prefill, chunked prefill with an 40-token budget, decode and prefix hits) and
    past Llama 3.1's 64-token original RoPE length."""
    path = checkpoint(name)
    prompts = long_prompts(seed=len(name), lengths=[1, 40, 70, 100, 150])
    max_new = [48, 40, 30, 48, 20, 40, 24]
    assert_matches_transformers(
        path, prompts, max_new, block_size=8, num_kv_blocks=256, max_num_batched_tokens=40
    )


def test_eos_list_from_generation_config(checkpoint, tmp_path):
    """Llama 3.1 lists three EOS ids in generation_config.json: the engine stops at the second one
    of them, as transformers does."""
    config, generation = CHECKPOINTS["llama-3.1"]
    prompt = long_prompts(seed=3, lengths=[20])[0]
    path = checkpoint("llama-3.1")
    ((reference, _),) = hf_greedy(str(path), [prompt], [12])
    # An eos list whose second id is the 6th greedy token (and appears nowhere before it).
    stop_at = next(j for j in range(5, 12) if reference[j] not in reference[:j] and reference[j] > 9)
    eos = [1, reference[stop_at], 9]
    folder = build_checkpoint(
        tmp_path / "llama", {**config, "eos_token_id": eos}, {**generation, "eos_token_id": eos}
    )
    llm, (out,) = assert_matches_transformers(folder, [prompt], [12])
    assert llm.engine.eos_token_ids == frozenset(eos)
    # The EOS token ends the output (its id is listed, as vLLM does; it adds no text).
    assert out.outputs[0].token_ids == reference[: stop_at + 1] and out.outputs[0].finish_reason == "stop"


# -- memory while loading ---------------------------------------------------------------------------
MEASURE_LOAD = textwrap.dedent(
    """
    import json, sys, torch
    from kvscale.worker.model.loader import load_config, load_model

    def status():
        rows = (line.split(":", 1) for line in open("/proc/self/status"))
        return {k: int(v.split()[0]) * 1024 for k, v in rows if v.strip().endswith("kB")}

    warm, path, dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    load_model(warm, load_config(warm), 64, torch.device("cpu"), dtype)  # first-use costs, off the books
    config = load_config(path)
    open("/proc/self/clear_refs", "w").write("5")  # the peak RSS (VmHWM) restarts from the current RSS
    before = status()
    model = load_model(path, config, 64, torch.device("cpu"), dtype)
    peak = status()["VmHWM"] - before["VmRSS"]
    served = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"peak_growth": peak, "served": served}))
    """
)
# 33M parameters: 66 MB in bf16, well above the noise of a Python process' RSS.
LARGE = {
    **LLAMA_3_1,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "head_dim": 128,
}


def measure_load(warm: Path, path: Path, dtype: str) -> dict:
    """Peak RSS growth while load_model reads `path`, in a fresh process. MALLOC_PERTURB_ makes
    malloc fill what it hands out, so memory allocated counts in the RSS as soon as it is
    allocated, as on a GPU (untouched pages would otherwise hide an allocation never written)."""
    env = {**os.environ, "MALLOC_PERTURB_": "165", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", MEASURE_LOAD, str(warm), str(path), dtype],
        capture_output=True, text=True, env=env, timeout=300, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def checkpoint_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


@pytest.fixture(scope="module")
def large_checkpoints(tmp_path_factory, checkpoint):
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux's /proc/self/clear_refs to reset the peak RSS")
    root = tmp_path_factory.mktemp("large")
    return {
        "warm": checkpoint("mistral"),
        "bf16-sharded": build_checkpoint(root / "bf16-sharded", LARGE, {}, max_shard_size="12MB"),
        "bf16-single": build_checkpoint(root / "bf16-single", LARGE, {}, max_shard_size="1GB"),
        "f32-single": build_checkpoint(
            root / "f32-single", LARGE, {}, dtype=torch.float32, max_shard_size="1GB"
        ),
    }


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["bf16-sharded", "bf16-single"])
def test_bf16_checkpoint_loads_within_its_own_size(large_checkpoints, folder):
    """Served in bf16, a bf16 checkpoint costs its own size plus one tensor's staging, not a float32
    copy of the model first (meta-device modules materialised at the default dtype) nor a memory
    map of the whole file."""
    path = large_checkpoints[folder]
    result = measure_load(large_checkpoints["warm"], path, "bfloat16")
    size = checkpoint_bytes(path)
    assert result["served"] <= size
    assert result["peak_growth"] < 1.5 * size, (result, size)


@pytest.mark.slow
def test_float32_checkpoint_served_in_bf16_is_never_held_in_float32(large_checkpoints):
    """A float32 checkpoint served in bf16: the weights are cast tensor by tensor as they are read,
    so the peak is the bf16 model (half the checkpoint) plus the float32 tensors in flight (one per
    loader thread, each dropped from the map after its copy), far from the float32 model."""
    path = large_checkpoints["f32-single"]
    result = measure_load(large_checkpoints["warm"], path, "bfloat16")
    size = checkpoint_bytes(path)
    _, header = read_safetensors_header(path / "model.safetensors")
    largest = max(end - begin for begin, end in (t["data_offsets"] for t in header.values()))
    assert result["served"] <= 0.51 * size
    assert result["peak_growth"] < result["served"] + LOAD_THREADS * largest, (result, size, largest)
    # Held in float32 it would be 1.0 of the checkpoint, plus the bf16 copy; measured 0.8-0.9 (eight
    # loader threads' float32 tensors in flight; a cold CI run saw 0.901).
    assert result["peak_growth"] < size, (result, size)


# -- max_model_len against the RoPE configuration ---------------------------------------------------
def hf_config(tmp_path: Path, config: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "rope_scaling,declared,limit",
    [
        (None, 32768, 32768),  # Mistral, Qwen2.5 as published
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}, 131072, 131072),  # Llama 3.1: not 8 x 8192
        # Qwen2.5's documented long-context setting:
        ({"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 32768, 131072),
        ({"rope_type": "linear", "factor": 2.0}, 4096, 8192),
        ({"rope_type": "dynamic", "factor": 2.0}, 4096, 4096),
    ],
)  # fmt: skip
def test_max_model_len_is_what_the_rope_supports(tmp_path, rope_scaling, declared, limit):
    config = hf_config(
        tmp_path, {**MISTRAL, "max_position_embeddings": declared, "rope_scaling": rope_scaling}
    )
    assert resolve_max_model_len(None, config) == limit
    assert resolve_max_model_len(limit, config) == limit
    with pytest.raises(
        ValueError, match=f"max_model_len {limit + 1} exceeds what the model's RoPE supports: {limit}"
    ):
        resolve_max_model_len(limit + 1, config)


def test_engine_refuses_max_model_len_past_the_rope(checkpoint):
    with pytest.raises(ValueError, match="rope_type default: max_position_embeddings 256"):
        LLM(str(checkpoint("mistral")), max_model_len=257, device="cpu")


# -- generation_config.json sampling defaults -------------------------------------------------------
def test_generation_config_defaults_fill_unset_fields(checkpoint):
    path = checkpoint("qwen2.5")
    assert load_generation_defaults(str(path)) == {
        "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1
    }  # fmt: skip
    llm = LLM(str(path), device="cpu", num_kv_blocks=16)
    assert llm.get_default_sampling_params().top_k == 20

    def effective(params: SamplingParams | None) -> SamplingParams:
        return llm.engine.make_request([0, 5, 6], params).children[0].sampling_params

    unset = effective(None)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.repetition_penalty) == (
        0.7, 0.8, 20, 0.0, 1.1
    )  # fmt: skip
    # A field the request sets wins, even at its neutral value; the others still come from the model.
    own = effective(SamplingParams(temperature=1.0, top_k=0, max_tokens=4))
    assert (own.temperature, own.top_p, own.top_k, own.repetition_penalty) == (1.0, 0.8, 0, 1.1)
    assert effective(dataclasses.replace(SamplingParams(), top_p=0.5)).top_p == 0.5
    # The server's request bodies leave unset fields unset, so they get the same defaults.
    from kvscale.worker.server.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=0.3)
    served = effective(body.sampling_params(max_tokens=4, logprobs=None))
    assert (served.temperature, served.top_p, served.top_k, served.repetition_penalty) == (0.3, 0.8, 20, 1.1)


def test_generation_config_top_k_1_makes_unset_requests_greedy(checkpoint, tmp_path):
    """Black-box: a model whose generation_config.json says top_k 1 answers requests that do not
    set top_k greedily, even at temperature 1."""
    config, generation = CHECKPOINTS["mistral"]
    path = build_checkpoint(tmp_path / "mistral-top1", config, {**generation, "top_k": 1})
    llm = LLM(str(path), device="cpu", num_kv_blocks=64)
    prompts = long_prompts(seed=5, lengths=[10, 30])
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    sampled = llm.generate(prompts, SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in sampled] == [o.outputs[0].token_ids for o in greedy]
    explicit = llm.generate(prompts, SamplingParams(top_k=0, seed=1, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in explicit] != [o.outputs[0].token_ids for o in greedy]
