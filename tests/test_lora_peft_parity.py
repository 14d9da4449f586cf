"""Issue 30, must-show 1: LoRA adapters against PEFT. On each family's random real-config model
(tests/test_real_checkpoints.py: Llama 3.1, Qwen2.5, Qwen3, Mistral shapes), four random PEFT
adapters of ranks 8 and 64 (all seven projections; rsLoRA scaling; attention only; MLP only on one
layer) and the base model share one batch of 16 prompts: every prompt's greedy tokens are
`PeftModel.generate`'s (a divergence is accepted only where PEFT's own logits tie, as in
test_engine_vs_hf.py). Each adapter is also checked to change the base model's tokens, so that a
forward ignoring adapters could not pass."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from test_engine_vs_hf import assert_greedy_matches
from test_real_checkpoints import CHECKPOINTS, VOCAB, build_checkpoint
from transformers import AutoModelForCausalLM

from kvscale.worker import LLM, LoRARequest, SamplingParams

peft = pytest.importorskip("peft")

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# name -> LoraConfig fields: ranks 8 and 64, every module set and both scalings.
ADAPTERS = {
    "all-r8": dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP),
    "all-r64-rslora": dict(r=64, lora_alpha=16, target_modules=ATTENTION + MLP, use_rslora=True),
    "attn-r8": dict(r=8, lora_alpha=32, target_modules=ATTENTION),
    "mlp-r64-layer1": dict(r=64, lora_alpha=128, target_modules=MLP, layers_to_transform=[1]),
}
FAMILIES = ["llama-3.1", "qwen2.5", "qwen3", "mistral"]


def make_adapter(base_path: Path, out: Path, seed: int, **fields) -> Path:
    """A PEFT adapter with random A and B (init_lora_weights=False: B is not zero), saved as PEFT
    saves one (adapter_config.json + adapter_model.safetensors)."""
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(task_type="CAUSAL_LM", init_lora_weights=False, lora_dropout=0.0, **fields)
    peft.get_peft_model(base, config).save_pretrained(out)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    return out


def greedy(model, prompts: list[list[int]], max_new: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """One `generate` per prompt (no padding), with each step's logits."""
    results = []
    for ids in prompts:
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
        results.append((out.sequences[0, len(ids) :].tolist(), [step[0] for step in out.logits]))
    return results


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    built: dict[str, tuple[Path, dict[str, Path]]] = {}

    def get(name: str):
        if name not in built:
            root = tmp_path_factory.mktemp(f"lora-{name}")
            config, generation = CHECKPOINTS[name]
            base = build_checkpoint(root / "base", config, generation)
            adapters = {
                a: make_adapter(base, root / a, seed=i + 1, **fields)
                for i, (a, fields) in enumerate(ADAPTERS.items())
            }
            built[name] = (base, adapters)
        return built[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_adapter_batch_matches_peft(family_models, family):
    base_path, adapters = family_models(family)
    rng = random.Random(len(family))
    prompts = [[0] + [rng.randrange(4, VOCAB) for _ in range(rng.randint(0, 60))] for _ in range(16)]
    names: list[str | None] = [[*ADAPTERS, None][i % 5] for i in range(len(prompts))]
    requests = {a: LoRARequest(a, i + 1, str(adapters[a])) for i, a in enumerate(ADAPTERS)}
    max_new = 20

    llm = LLM(
        str(base_path), dtype="float32", device="cpu", num_kv_blocks=256, block_size=8,
        enable_lora=True, max_loras=4, max_lora_rank=64,
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    outputs = llm.generate(prompts, params, lora_request=[requests.get(n) for n in names])  # one batch

    base_model = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
    for adapter in [*ADAPTERS, None]:
        rows = [i for i, n in enumerate(names) if n == adapter]
        model = base_model
        if adapter is not None:
            fresh = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32)
            model = peft.PeftModel.from_pretrained(fresh, adapters[adapter])
        reference = greedy(model, [prompts[i] for i in rows], max_new)
        for i, (tokens, logits) in zip(rows, reference, strict=True):
            assert_greedy_matches(outputs[i].outputs[0].token_ids, tokens, logits)
        if adapter is not None:  # the adapter matters: the base model's tokens differ somewhere
            plain = greedy(base_model, [prompts[i] for i in rows], max_new)
            assert any(p[0] != r[0] for p, r in zip(plain, reference, strict=True)), adapter
    assert llm.engine.kv_cache_manager.usage() == 0.0
    lora = llm.engine.runner.lora
    assert sorted(lora.resident()) == [1, 2, 3, 4] and lora.stats.disk_loads == 4
