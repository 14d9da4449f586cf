"""The engine gives the same greedy tokens with the Triton attention backend (run by the Triton
interpreter on the CPU) as with the plain-torch backend: chunked prefill, prefix-cache hits,
mixed decode/prefill steps, GQA and sliding windows all go through the Triton kernels."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels

import random

import pytest

pytest.importorskip("triton")

from kvscale.worker import LLM, SamplingParams
from kvscale.worker.model.attention.triton_backend import TritonAttentionBackend
from kvscale.worker.model.cuda_graphs import CUDAGraphRunner


def prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(4, vocab_size) for _ in range(20)]
    return [
        [0, *shared, *(rng.randrange(4, vocab_size) for _ in range(9))],
        [0, *shared, 5],  # a prefix-cache hit on the first prompt's blocks
        [0, *(rng.randrange(4, vocab_size) for _ in range(40))],  # chunked over several steps
        [0],
    ]


@pytest.mark.parametrize("model_name", ["llama-gqa", "mistral-sliding"])
def test_triton_backend_greedy_tokens_match_torch(random_model_factory, model_name, monkeypatch):
    path = random_model_factory(model_name)
    calls = []
    forward = TritonAttentionBackend.forward
    monkeypatch.setattr(
        TritonAttentionBackend,
        "forward",
        lambda self, *a: calls.append(a[5].num_prefills) or forward(self, *a),
    )
    engine_args = dict(
        block_size=8, num_kv_blocks=64, max_num_batched_tokens=24, max_num_seqs=4, device="cpu"
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for backend in ("torch", "triton"):
        llm = LLM(path, attention_backend=backend, **engine_args)
        batch = prompts(llm.get_tokenizer().vocab_size)
        results[backend] = [out.outputs[0].token_ids for out in llm.generate(batch, params)]
    assert calls and any(calls) and not all(calls), "the Triton backend ran no prefill or no decode-only step"
    assert results["triton"] == results["torch"]


class EagerGraphs(CUDAGraphRunner):
    """The CUDA-graph runner with each 'graph' replayed eagerly: checks its static buffers,
    padding and metadata on the CPU (the capture itself needs a GPU)."""

    def _capture_graph(self, size):
        def replay():
            self.outputs[size] = self._forward(size)

        return replay


def test_cuda_graph_runner_pads_and_matches_eager(random_model_factory):
    import torch

    from kvscale.worker.model.attention.backend import CommonAttentionMetadata
    from kvscale.worker.model.loader import load_config, load_model

    path = random_model_factory("llama-gqa")
    config = load_config(path)
    cpu = torch.device("cpu")
    model = load_model(path, config, 64, cpu, torch.float32)
    spec, block_size, num_blocks = model.spec, 8, 12
    g = torch.Generator().manual_seed(0)
    shape = (spec.num_kv_heads, num_blocks, block_size, spec.head_dim)
    history = [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(spec.num_layers)
    ]

    # Three decodes (a batch padded to the captured size 4), contexts crossing block boundaries.
    seq_lens = [5, 9, 17]
    tables = torch.tensor([[3, 0, 0], [1, 7, 0], [2, 4, 6]])
    positions = torch.tensor([n - 1 for n in seq_lens])
    slots = torch.tensor(
        [int(tables[i, p // block_size]) * block_size + p % block_size for i, p in enumerate(positions)]
    )
    common = CommonAttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(4),
        seq_lens=torch.tensor(seq_lens),
        block_tables=tables,
        num_decodes=3,
        block_size=block_size,
    )
    input_ids = torch.tensor([5, 6, 7])
    backend = TritonAttentionBackend()
    with torch.inference_mode():
        eager_caches = [(k.clone(), v.clone()) for k, v in history]
        expected = model(input_ids, positions, eager_caches, backend, backend.prepare(common))
        graph_caches = [(k.clone(), v.clone()) for k, v in history]
        graphs = EagerGraphs(
            model, graph_caches, backend, max_num_seqs=3, max_model_len=64, block_size=block_size,
            device=cpu, capture_sizes=(1, 2, 4, 8),
        )  # fmt: skip
        graphs.capture()
        assert graphs.sizes == [1, 2, 4] and graphs.can_run(common)
        hidden = graphs.run(input_ids, positions, common)
    # Batch 4 vs batch 3 matmuls may round differently: close, not equal.
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-5)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    for (k0, v0), (k1, v1), (k, v) in zip(graph_caches, eager_caches, history, strict=True):
        torch.testing.assert_close((k0, v0), (k1, v1), atol=1e-5, rtol=1e-5)
        # The padded row (slot -1) wrote nothing: every other slot still holds its history.
        for new, old in ((k0, k), (v0, v)):
            flat_new = new.reshape(spec.num_kv_heads, -1, spec.head_dim)
            flat_old = old.reshape(spec.num_kv_heads, -1, spec.head_dim)
            assert torch.equal(flat_new[:, untouched], flat_old[:, untouched])
