"""`python -m kvscale.worker.bench steps`: the compiled forward against the eager one, step by step.
Figures mean nothing on a shared test machine; what is checked is that every case runs in both
modes and that the path reported is the one the engine took."""

from __future__ import annotations

import json

from kvscale.worker.bench.__main__ import main
from kvscale.worker.bench.steps import CASES, case_chunks


def test_case_chunks_give_each_sequence_its_own_blocks():
    chunks = case_chunks([20, 33], 16)
    assert [(c.token_ids, c.start, c.block_ids) for c in chunks] == [([5], 19, [1, 2]), ([5], 32, [3, 4, 5])]
    (prefill,) = case_chunks(40, 16)
    assert len(prefill.token_ids) == 40 and prefill.start == 0 and prefill.block_ids == [1, 2, 3]


def test_steps_reports_both_modes_and_each_case_path(target_model, capsys):
    cases = ["b1_L300", "b8_spread", "b64_one_long", "prefill_150"]
    assert main(["steps", "--model", target_model, "--iters", "1", "--cases", ",".join(cases), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    compiled, eager = result["modes"]["compiled"], result["modes"]["eager"]
    assert compiled["compile_s"] > 0 and eager["compile_s"] is None
    paths = {name: row["path"] for name, row in compiled["cases"].items()}
    # One length, and spread lengths within the padding limit: attention in the graph; one long
    # sequence among short ones, and a prefill chunk: the backend's op (length buckets, prefill).
    assert paths == {
        "b1_L300": "graph",
        "b8_spread": "graph",
        "b64_one_long": "backend_op",
        "prefill_150": "backend_op",
    }
    assert {row["path"] for row in eager["cases"].values()} == {"eager"}
    assert set(result["eager_over_compiled"]) == set(cases) and set(cases) <= set(CASES)
    assert all(row["ms"] > 0 for mode in (compiled, eager) for row in mode["cases"].values())
