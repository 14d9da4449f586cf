"""LoRA adapters in the engine beyond PEFT parity (issue 30): more adapters than device slots and
host copies (LRU eviction, read again from disk) with every adapter's tokens unchanged, a prefix
cache that never serves one adapter's KV to another's request (or to the base model's), the
resident-adapter gauge the router's affinity reads following the slots, and speculative decoding
refused with adapters (the draft would guess the base model's tokens)."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_lora_peft_parity import ATTENTION, MLP, make_adapter

from kvscale.worker import LLM, LoRARequest, SamplingParams
from kvscale.worker.config import EngineArgs
from kvscale.worker.metrics.prometheus import EngineMetrics

pytest.importorskip("peft")

PROMPT = "def parse_config(path):\n    with open(path) as f:\n        data = json.load(f)\n    return"


@pytest.fixture(scope="module")
def adapters(target_model, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora-engine")
    fields = [
        dict(r=8, lora_alpha=16, target_modules=ATTENTION + MLP),
        dict(r=16, lora_alpha=16, target_modules=ATTENTION, use_rslora=True),
        dict(r=4, lora_alpha=8, target_modules=MLP),
    ]
    return {
        name: LoRARequest(name, i + 1, str(make_adapter(Path(target_model), root / name, seed=i + 10, **f)))
        for i, (name, f) in enumerate(zip(["a", "b", "c"], fields, strict=True))
    }


def engine(target_model: str, **kwargs) -> LLM:
    return LLM(target_model, device="cpu", num_kv_blocks=256, block_size=8, enable_lora=True, **kwargs)


def texts(outputs) -> list[str]:
    return [o.outputs[0].text for o in outputs]


def test_more_adapters_than_slots_and_host_copies_keep_their_tokens(target_model, adapters):
    """One device slot and two host copies for three adapters: a mixed batch runs them one after
    another (the scheduler admits one adapter at a time), evicting slots and host copies; every
    prompt's greedy tokens equal those of the adapter running alone in an engine with room for all."""
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    order = ["a", "b", None, "c", "a", "b", "c", None]
    roomy = engine(target_model, max_loras=3, max_lora_rank=16)
    alone = {
        name: texts(roomy.generate([PROMPT], params, lora_request=adapters.get(name)))[0]
        for name in ["a", "b", "c", None]
    }
    assert len(set(alone.values())) == 4, alone  # every adapter changes the base model's tokens
    del roomy

    tight = engine(target_model, max_loras=1, max_lora_rank=16, max_cpu_loras=2)
    mixed = texts(
        tight.generate([PROMPT] * len(order), params, lora_request=[adapters.get(n) for n in order])
    )
    assert mixed == [alone[n] for n in order]
    again = {n: texts(tight.generate([PROMPT], params, lora_request=adapters[n]))[0] for n in ["c", "a", "b"]}
    assert again == {n: alone[n] for n in again}
    stats = tight.engine.runner.lora.stats
    assert stats.slot_evictions >= 2, stats  # one slot, three adapters in one batch
    assert stats.host_evictions >= 1 and stats.disk_loads >= 4, stats  # two host copies, three adapters
    assert tight.engine.runner.lora.num_host <= 2
    assert tight.engine.kv_cache_manager.usage() == 0.0


def test_the_prefix_cache_keys_by_adapter(target_model, adapters):
    """The same prompt under adapter a, the base model and adapter b computes its KV anew each
    time; under a again it hits. The tokens are what a fresh engine gives (no KV crossed over)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = engine(target_model, max_loras=2, max_lora_rank=16)
    stats = llm.engine.kv_cache_manager.prefix_cache_stats
    hits = []
    answers = []
    for name in ["a", None, "b", "a", None]:
        before = stats.hits
        answers.append(texts(llm.generate([PROMPT], params, lora_request=adapters.get(name)))[0])
        hits.append(stats.hits - before)
    assert hits[:3] == [0, 0, 0], hits  # a, base, b: nothing shared
    assert hits[3] > 0 and hits[4] > 0, hits  # a again and the base again: their own blocks
    fresh = engine(target_model, max_loras=2, max_lora_rank=16)
    assert answers[:3] == [
        texts(fresh.generate([PROMPT], params, lora_request=adapters.get(n)))[0] for n in ["a", None, "b"]
    ]
    assert answers[3] == answers[0] and answers[4] == answers[1]


def test_the_resident_gauge_follows_the_device_slots(target_model, adapters):
    """kvscale_lora_adapter_resident, fed as the server feeds it (the engine's take_stats into
    EngineMetrics.record), has one series at 1 per adapter in a device slot and none for the rest:
    two slots, three adapters; the least recently used one leaves its slot for the third (still in
    host memory, known, but not resident), a base-model request moves nothing, and an unloaded
    adapter's series goes at once, even while a request still runs on it in its slot."""
    llm = engine(target_model, max_loras=2, max_lora_rank=16, max_cpu_loras=3)
    metrics = EngineMetrics("tiny")
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)

    def resident_after(*names: str | None) -> dict[str, float]:
        for name in names:
            llm.generate([PROMPT], params, lora_request=adapters.get(name))
        e = llm.engine
        metrics.record(e.take_stats(), e.scheduler.stats(), e.kv_cache_manager.num_blocks)
        page = text_string_to_metric_families(metrics.render().decode())
        samples = [s for f in page if f.name == "kvscale_lora_adapter_resident" for s in f.samples]
        return {s.labels["lora_name"]: s.value for s in samples}

    assert resident_after() == {}
    assert resident_after("a", "b") == {"a": 1, "b": 1}
    assert resident_after("c") == {"b": 1, "c": 1}  # a, least recently used, left its slot
    assert llm.engine.runner.lora.is_loaded(adapters["a"].lora_int_id)  # known, in host memory
    assert resident_after(None) == {"b": 1, "c": 1}
    assert llm.engine.remove_lora(adapters["b"].lora_int_id)
    assert resident_after() == {"c": 1}
    # Unloaded while a request runs on it: it keeps its slot until that request ends, but takes no
    # new one, so it is no longer listed (the router would send it requests that get a 404).
    e, c = llm.engine, adapters["c"]
    e.add_request(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), lora_request=c)
    e.step()
    assert e.remove_lora(c.lora_int_id)
    assert resident_after() == {} and e.runner.lora.resident() == [c.lora_int_id]
    while e.has_unfinished_requests():
        e.step()
    assert resident_after() == {} and e.runner.lora.resident() == []


@pytest.mark.parametrize("spec", [{"speculative_method": "ngram"}, {"draft_model": "unused-path"}])
def test_speculative_decoding_with_adapters_is_refused(spec):
    with pytest.raises(ValueError, match="speculative decoding with LoRA adapters is not supported"):
        EngineArgs(model="m", enable_lora=True, **spec)
