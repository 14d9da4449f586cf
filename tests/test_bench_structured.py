"""`python -m kvscale.worker.bench structured` at a tiny size: it runs both sides and reports them."""

from __future__ import annotations

import json

from kvscale.worker.bench.__main__ import main


def test_structured_bench_reports_overhead_mask_and_compile_times(target_model, capsys) -> None:
    args = ["structured", "--model", target_model, "--batch", "1,2", "--output-len", "12"]
    assert main([*args, "--repeats", "1", "--compile-repeats", "1", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["batches"]) == {"1", "2"} and result["meets_goal"] is None  # no batch 64 here
    for batch in result["batches"].values():
        assert batch["constrained"] == 1 and min(batch["steps_counted"]) > 0
        assert batch["step_ms_median_unconstrained"] > 0 and batch["step_ms_median_constrained"] > 0
        assert batch["mask_ms_per_step_median"] > 0  # the constrained runs did mask
    assert all(v > 0 for v in result["compile"].values())
