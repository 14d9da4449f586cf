"""The GPU check script (`python -m kvscale.worker.bench.gpu`) in its smoke mode: every section
runs on the CPU under the Triton interpreter and reports the keys the GPU run is read by. Figures are
meaningless here; what is checked is that the code paths run and say truthfully what ran."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels

import json

import pytest

pytest.importorskip("triton")

from test_engine_triton import EagerGraphs

from kvscale.worker.bench import gpu as bench
from kvscale.worker.model.cuda_graphs import CUDAGraphRunner

RUN_KEYS = {
    "cuda_graphs_requested", "attention_backend", "cuda_graphs", "graph_replays", "prefill_steps",
    "timed_steps", "whole_batch_steps", "median_step_ms", "mean_step_ms", "min_step_ms", "max_step_ms",
    "tokens_per_s", "async_scheduling", "async_steps",
}  # fmt: skip
RUNS = {name: (graphs, overlap) for name, graphs, overlap in bench.DECODE_STEP_RUNS}


@pytest.fixture
def run_bench(monkeypatch, capsys):
    """main() in this process; the globals it sets (device, sizes) are put back afterwards."""
    monkeypatch.setattr(bench, "DEVICE", bench.DEVICE)
    monkeypatch.setattr(bench, "SIZES", bench.SIZES)

    def run(*argv: str) -> tuple[int, dict]:
        rc = bench.main(list(argv))
        return rc, json.loads(capsys.readouterr().out)

    return run


def check_decode_steps(section: dict, batches: list[int]) -> None:
    assert set(section) >= {
        "model",
        "prompt_len",
        "new_tokens",
        "batches",
        "graphs_ran",
        "async_scheduling_ran",
    }
    assert list(section["batches"]) == [str(b) for b in batches]
    for batch in section["batches"].values():
        assert set(batch) == {*RUNS, "graphs_off_over_on", "async_off_over_on"}
        for name, (graphs, overlap) in RUNS.items():
            run = batch[name]
            assert set(run) == RUN_KEYS
            assert run["cuda_graphs_requested"] is graphs and run["async_scheduling"] is overlap
            # Every token after the first comes from a timed whole-batch decode step.
            assert run["timed_steps"] == section["new_tokens"] - 1 and run["whole_batch_steps"]
            assert run["median_step_ms"] > 0 and run["tokens_per_s"] > 0
            # Async scheduling: every timed step but the last launched the next one ahead.
            assert run["async_steps"] == (run["timed_steps"] - 1 if overlap else 0)
        ms = {name: batch[name]["median_step_ms"] for name in RUNS}
        assert batch["graphs_off_over_on"] == pytest.approx(ms["cuda_graphs_off"] / ms["cuda_graphs_on"])
        assert batch["async_off_over_on"] == pytest.approx(
            ms["cuda_graphs_on"] / ms["cuda_graphs_on_async_scheduling"]
        )
    assert section["async_scheduling_ran"] is True


def test_smoke_runs_every_section_and_says_graphs_did_not_run(run_bench):
    rc, report = run_bench("--smoke", "--json")
    assert rc == 0, report
    assert report["sections"] == list(bench.SECTIONS)
    for name in bench.SECTIONS:
        assert "error" not in report[name], report[name]
    assert report["correctness"]["ok"]
    assert report["end_to_end"]["engine_tokens_per_s"] > 0
    section = report["decode_steps"]
    check_decode_steps(section, list(bench.SMOKE_SIZES["step_batches"]))
    # No CUDA here: no run may claim graphs, and the section says its ratios are eager against eager.
    for batch in section["batches"].values():
        for name in RUNS:
            assert batch[name]["cuda_graphs"] is False and batch[name]["graph_replays"] == 0
    assert section["graphs_ran"] is False and "note" in section


def test_decode_steps_switches_graphs_per_engine_and_counts_replays(run_bench, monkeypatch):
    """With a graph runner that replays eagerly on the CPU, the graphs-on engines capture and replay
    a graph in every timed step, the graphs-off engines capture none, and the environment switch is
    put back afterwards."""

    def maybe_create(cls, runner, max_num_seqs):
        if os.environ.get("KVSCALE_CUDA_GRAPHS", "1") == "0":
            return None
        graphs = EagerGraphs(
            runner.model, runner.kv_caches, runner.backend, max_num_seqs=max_num_seqs,
            max_model_len=runner.max_model_len, block_size=runner.block_size, device=runner.device,
        )  # fmt: skip
        graphs.capture()
        return graphs

    monkeypatch.setattr(CUDAGraphRunner, "maybe_create", classmethod(maybe_create))
    monkeypatch.setitem(bench.SMOKE_SIZES, "step_batches", (2,))
    monkeypatch.delenv("KVSCALE_CUDA_GRAPHS", raising=False)
    rc, report = run_bench("--smoke", "--sections", "decode_steps")
    assert rc == 0, report
    assert report["sections"] == ["decode_steps"] and "correctness" not in report
    section = report["decode_steps"]
    check_decode_steps(section, [2])
    on, off = section["batches"]["2"]["cuda_graphs_on"], section["batches"]["2"]["cuda_graphs_off"]
    assert on["cuda_graphs"] is True and on["graph_replays"] == on["timed_steps"]
    overlapped = section["batches"]["2"]["cuda_graphs_on_async_scheduling"]
    # The last timed step of an async run launches nothing: it takes the step before's outputs.
    assert overlapped["cuda_graphs"] is True and overlapped["graph_replays"] == overlapped["timed_steps"] - 1
    assert off["cuda_graphs"] is False and off["graph_replays"] == 0
    assert section["graphs_ran"] is True and "note" not in section
    assert "KVSCALE_CUDA_GRAPHS" not in os.environ


def test_sections_rejects_an_unknown_name(run_bench):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", "--sections", "decode_steps,nope"])
    assert exit_info.value.code == 2
