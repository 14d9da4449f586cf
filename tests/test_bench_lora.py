"""`python -m kvscale.worker.bench lora` (issue 30, must-show 3; figures in docs/benchmarks.md): a
small run that checks every contender ran, the requests were spread over the adapters and the
ratios are computed from the rounds' own figures (each round its median pair)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("peft")


def test_bench_lora_reports_adapters_against_the_base_model_and_peft(target_model, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "kvscale.worker.bench", "lora", "--json", "--model", target_model,
         "--num-requests", "8", "--adapters", "2", "--rank", "8", "--output-len", "4", "--rounds", "2",
         "--pairs", "3", "--enforce-eager"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert result["forward"]["base"] == "eager"
    assert (
        result["forward"]["lora_steps"]["on_the_lora_graph"] == 0 < result["forward"]["lora_steps"]["eager"]
    )
    assert result["workload"] | {"output_tokens": 32} == result["workload"]  # 8 requests x 4 tokens
    assert len(result["rounds"]) == 2
    for r in result["rounds"]:
        ratio = r["lora"]["output_tokens_per_s"] / r["base"]["output_tokens_per_s"]
        assert r["lora/base"] == pytest.approx(ratio, abs=1e-3) and r["lora"]["output_tokens_per_s"] > 0
        assert len(r["pair_ratios"]) == 3 and sorted(r["pair_ratios"])[1] == r["lora/base"]  # the median
    assert result["met_in_every_round"] == all(r["lora/base"] >= 0.8 for r in result["rounds"])
    assert result["peft"]["output_tokens_per_s"] > 0 and result["lora/peft"] > 0
