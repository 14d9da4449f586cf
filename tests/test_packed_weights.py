"""oneDNN-packed CPU weights (layers/linear.py pack_weights): which weights are packed, that a packed
product is the plain one's, that a loaded bfloat16 model serves on packed weights eagerly, and
that its compiled package takes them (every graph, the same tokens as the eager forward)."""

from __future__ import annotations

import json

import pytest
import torch

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model.aot_package import KEY_FILE
from kvscale.worker.model.layers.linear import Linear, pack_weights, packs
from kvscale.worker.model.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(not packs(torch.bfloat16), reason="torch without oneDNN")


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = VocabParallelEmbedding(1000, 64)
        self.proj = Linear(64, 256, bias=True)
        self.head = ParallelLMHead(64, 1000, 1000)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("rows", [1, 2, 8, 64, 150])
def test_a_packed_product_is_the_plain_one(rows):
    torch.manual_seed(0)
    layer = Linear(384, 1024, bias=True).to(torch.bfloat16)
    x = torch.randn(rows, 384, dtype=torch.bfloat16)
    with torch.inference_mode():
        plain = torch.nn.functional.linear(x, layer.weight, layer.bias)
        layer.pack()
        packed = layer(x)
    assert layer.weight.is_mkldnn and layer.weight.shape == (1024, 384)
    torch.testing.assert_close(packed, plain, atol=2e-2, rtol=2e-2)


def test_only_bfloat16_cpu_linears_are_packed_and_a_tied_head_gets_its_own_copy():
    model = Tied().to(torch.bfloat16)
    table = model.embed.weight.detach().clone()
    assert pack_weights(model) == 2
    assert model.proj.weight.is_mkldnn and model.head.weight.is_mkldnn
    assert not model.embed.weight.is_mkldnn and torch.equal(model.embed.weight, table)
    assert pack_weights(model) == 0  # packed once
    assert pack_weights(Tied()) == 0  # float32: the one-row graph's reduction needs the plain weight


def _tokens_and_logprobs(llm: LLM, prompts, n: int):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
    return [
        (o.outputs[0].token_ids, [lp.top[0][1] for lp in o.outputs[0].logprobs])
        for o in llm.generate(prompts, params)
    ]


def assert_same_greedy_run(ours, eager, gap: float = 0.25):
    """Token for token the same until a near-tie (bfloat16 rounds differently in the graph's
    fused loops than eagerly); the top logprobs within `gap` meanwhile. Measured with these prompts:
    at most 0.11 apart, 7 runs of 29 parting at a near-tie, with packed weights and without (oneDNN
    multiplies a plain bfloat16 weight with the same kernel, after packing it on every call)."""
    for (tokens, lps), (ref_tokens, ref_lps) in zip(ours, eager, strict=True):
        for j, (a, b) in enumerate(zip(tokens, ref_tokens, strict=True)):
            assert abs(lps[j] - ref_lps[j]) < gap, (j, lps[j], ref_lps[j])
            if a != b:
                break


def test_a_bfloat16_package_runs_every_graph_on_the_packed_weights(target_model, tmp_path):
    kw = dict(dtype="bfloat16", num_kv_blocks=256, max_num_seqs=32, max_num_batched_tokens=256)
    prompts_by_streams = [
        [[0, 11, 12, 13]],
        [[0, *range(20 + i, 60 + i)] for i in range(8)],
        [[0, *range(100 + 3 * i, 130 + 7 * i)] for i in range(20)],
    ]
    eager = LLM(target_model, enforce_eager=True, **kw)
    assert all(m.weight.is_mkldnn for m in eager.engine.runner.model.modules() if isinstance(m, Linear))
    expected = [_tokens_and_logprobs(eager, prompts, 16) for prompts in prompts_by_streams]
    del eager

    llm = LLM(
        target_model, enforce_eager=False, compile_cache_dir=str(tmp_path), compile_in_background=False, **kw
    )
    (folder,) = [p for p in tmp_path.iterdir() if (p / KEY_FILE).is_file()]
    assert json.loads((folder / KEY_FILE).read_text())["packed_weights"] is True
    forward = llm.engine.runner.model.compiled
    runners, calls = dict(forward.runners), []

    class Spy:
        def __init__(self, name):
            self.name = name

        def boxed_run(self, inputs):
            calls.append(self.name)
            return runners[self.name].boxed_run(inputs)

    forward.runners = {name: Spy(name) for name in runners}
    for prompts, ref in zip(prompts_by_streams, expected, strict=True):
        assert_same_greedy_run(_tokens_and_logprobs(llm, prompts, 16), ref)
    assert set(calls) == {"decode1", "decode_small", "decoden", "chunk"}
    assert forward.eager_fallbacks == 0
