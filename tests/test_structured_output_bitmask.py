"""Our CPU bitmask apply against xgrammar's own kernel, on random masks: the same logits, bit for
bit, for every dtype, a vocabulary that is not a multiple of 32, padded logits and any row subset."""

from __future__ import annotations

import pytest
import torch

xgr = pytest.importorskip("xgrammar")

from kvscale.worker.structured_output.bitmask import apply_bitmask_cpu  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("vocab_size", "padded"), [(4096, 4096), (1000, 1000), (1000, 1024), (37, 40)])
def test_matches_xgrammar_kernel(dtype, vocab_size, padded):
    g = torch.Generator().manual_seed(vocab_size + padded)
    for trial in range(5):
        batch = 1 + trial * 3
        logits = torch.randn(batch, padded, generator=g).to(dtype)
        bitmask = xgr.allocate_token_bitmask(batch, vocab_size)
        bitmask.copy_(torch.randint(-(2**31), 2**31 - 1, bitmask.shape, generator=g, dtype=torch.int32))
        if trial == 1:
            bitmask[0].zero_()  # a row that allows nothing
        rows = [i for i in range(batch) if (i + trial) % 3]  # some rows, not others
        ours, theirs = logits.clone(), logits.clone()
        apply_bitmask_cpu(ours, bitmask, rows, vocab_size)
        xgr.apply_token_bitmask_inplace(theirs, bitmask, vocab_size=vocab_size, indices=rows)
        assert torch.equal(ours, theirs), (dtype, vocab_size, padded, trial)
        untouched = [i for i in range(batch) if i not in rows]
        assert torch.equal(ours[untouched], logits[untouched])
        if rows:
            assert torch.isneginf(ours[rows, :vocab_size]).any()


def test_a_bit_allows_exactly_its_token():
    logits = torch.zeros(1, 64)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 5  # token 32 + 5
    apply_bitmask_cpu(logits, bitmask, [0], 64)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [37]
