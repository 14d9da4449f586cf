"""The GPU check script (`python -m kvscale.kernels.bench`) in its smoke mode: every section runs on
the CPU under the Triton interpreter and reports the keys the GPU run is read by. Figures are
meaningless here; what is checked is that the code paths run and say truthfully what ran."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports the kernels

import json

import pytest

pytest.importorskip("triton")

from test_engine_triton import EagerGraphs

from kvscale.kernels import bench
from kvscale.worker.model.cuda_graphs import CUDAGraphRunner

RUN_KEYS = {
    "cuda_graphs_requested", "attention_backend", "cuda_graphs", "graph_replays", "prefill_steps",
    "timed_steps", "whole_batch_steps", "median_step_ms", "mean_step_ms", "min_step_ms", "max_step_ms",
    "tokens_per_s",
}  # fmt: skip


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
    assert set(section) >= {"model", "prompt_len", "new_tokens", "batches", "graphs_ran", "async_scheduling"}
    assert section["async_scheduling"]["available"] is False and section["async_scheduling"]["reason"]
    assert list(section["batches"]) == [str(b) for b in batches]
    for batch in section["batches"].values():
        assert set(batch) == {"cuda_graphs_on", "cuda_graphs_off", "graphs_off_over_on"}
        on, off = batch["cuda_graphs_on"], batch["cuda_graphs_off"]
        for run, requested in ((on, True), (off, False)):
            assert set(run) == RUN_KEYS
            assert run["cuda_graphs_requested"] is requested
            # Every token after the first comes from a timed whole-batch decode step.
            assert run["timed_steps"] == section["new_tokens"] - 1 and run["whole_batch_steps"]
            assert run["median_step_ms"] > 0 and run["tokens_per_s"] > 0
        assert batch["graphs_off_over_on"] == pytest.approx(off["median_step_ms"] / on["median_step_ms"])


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
        for run in (batch["cuda_graphs_on"], batch["cuda_graphs_off"]):
            assert run["cuda_graphs"] is False and run["graph_replays"] == 0
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
    assert off["cuda_graphs"] is False and off["graph_replays"] == 0
    assert section["graphs_ran"] is True and "note" not in section
    assert "KVSCALE_CUDA_GRAPHS" not in os.environ


def test_sections_rejects_an_unknown_name(run_bench):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--smoke", "--sections", "decode_steps,nope"])
    assert exit_info.value.code == 2
