"""LoRA adapters at the HTTP edge (issue 30), on the real server through the real `openai` client:
`--lora-modules`, the request's `model` picking the adapter, `/v1/models` with `parent`, vLLM's
load/unload endpoints behind their flag and the API key, `vllm:lora_requests_info`, the
per-adapter metrics and the resident-adapter gauge (an unloaded adapter leaves it while idle);
and the attack surface: every bad adapter a client can name (outside the allowed roots, through a
symlink, rank above the max, wrong target modules, another model's shapes, a bad name, a
duplicate) is a 400 in OpenAI's error shape that leaves the server serving."""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import start_server
from test_lora_peft_parity import ATTENTION, MLP, make_adapter

from kvscale.worker import LLM, LoRARequest, SamplingParams

pytest.importorskip("peft")

KEY = "lora-test-key"
PROMPT = "def read_lines(path):\n    with open(path) as f:\n        return"
MAX_TOKENS = 12
BASE = "tiny-code"  # --served-model-name
LONG = 160  # tokens of the streams that run while adapters are loaded and unloaded
ADAPTERS = ["sql", "doc", "w3", "w4"]


@pytest.fixture(scope="module")
def folders(target_model, tmp_path_factory) -> dict[str, Path]:
    """Adapters on the target model inside the allowed root, and the bad ones."""
    root = tmp_path_factory.mktemp("lora-server")
    allowed, outside = root / "allowed", root / "outside"
    target = Path(target_model)
    found = {
        "root": allowed,
        "sql": make_adapter(
            target, allowed / "sql", seed=1, r=8, lora_alpha=16, target_modules=ATTENTION + MLP
        ),
        "doc": make_adapter(target, allowed / "doc", seed=2, r=16, lora_alpha=32, target_modules=ATTENTION),
        "rank64": make_adapter(target, allowed / "rank64", seed=3, r=64, lora_alpha=16, target_modules=MLP),
        "outside": make_adapter(target, outside / "sql", seed=1, r=8, lora_alpha=16, target_modules=MLP),
        # An adapter of the draft model (hidden size 128, not 384): every tensor's shape is wrong.
        "other-model": make_adapter(
            target.parent / "tiny-code-draft", allowed / "other-model", seed=4, r=8, target_modules=ATTENTION
        ),
    }
    for i, name in enumerate(["w3", "w4"]):
        found[name] = make_adapter(
            target, allowed / name, seed=5 + i, r=8 * (i + 1), target_modules=ATTENTION + MLP
        )
    embed = allowed / "embed"
    shutil.copytree(found["sql"], embed)
    config = json.loads((embed / "adapter_config.json").read_text())
    config["target_modules"] = ["embed_tokens", "q_proj"]
    (embed / "adapter_config.json").write_text(json.dumps(config))
    found["embed"] = embed
    # Huge: a 64 GiB sparse weights file (refused by its size, before a byte is read), and a
    # safetensors header that claims 1 TiB of JSON.
    for name, make in {
        "huge": lambda f: os.truncate(f, 64 * 2**30),
        "header-bomb": lambda f: f.write_bytes(struct.pack("<Q", 2**40) + b"{}"),
    }.items():
        shutil.copytree(found["sql"], allowed / name)
        weights = allowed / name / "adapter_model.safetensors"
        make(weights)
        found[name] = allowed / name
    (allowed / "escape").symlink_to(found["outside"], target_is_directory=True)
    found["escape"] = allowed / "escape"
    return found


# Every test of this server runs twice: the engine in the server's thread, and in its own process
# (adapters load, unload and report their metrics across the process boundary).
@pytest.fixture(scope="module", params=[(), ("--engine-process",)], ids=["engine-thread", "engine-process"])
def lora_server(target_model, folders, tmp_path_factory, request):
    proc = start_server(
        target_model,
        tmp_path_factory.mktemp("lora-server-log"),
        "--num-kv-blocks", "256",
        "--served-model-name", BASE,
        "--api-key", KEY,
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--lora-modules", f"sql={folders['sql']}",
        "--lora-allowed-roots", str(folders["root"]),
        "--enable-lora-runtime-updating",
        *request.param,
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def lora_client(lora_server):
    return openai.OpenAI(base_url=lora_server.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(target_model, folders) -> dict[tuple[str | None, int], str]:
    """Each adapter's greedy answers (short and long) from the offline engine (the same code behind
    no server), by (adapter, max_tokens)."""
    llm = LLM(target_model, device="cpu", num_kv_blocks=256, enable_lora=True, max_loras=2, max_lora_rank=16)
    answers = {}
    for i, name in enumerate([None, *ADAPTERS]):
        lora = None if name is None else LoRARequest(name, i, str(folders[name]))
        for max_tokens in (MAX_TOKENS, LONG):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            answers[name, max_tokens] = llm.generate([PROMPT], params, lora_request=lora)[0].outputs[0].text
    assert len(set(answers.values())) == 2 * (1 + len(ADAPTERS)), answers  # each adapter changes it
    return answers


def complete(client: openai.OpenAI, model: str, max_tokens: int = MAX_TOKENS) -> str:
    out = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert out.model == model
    return out.choices[0].text


def post(server, path: str, body: dict, key: str | None = KEY) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(
        server.base_url + path, json.dumps(body).encode(), headers, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def metrics(server) -> dict:
    with urllib.request.urlopen(server.base_url + "/metrics", timeout=10) as r:
        return {f.name: f for f in text_string_to_metric_families(r.read().decode())}


def test_the_request_model_picks_the_adapter(lora_server, lora_client, reference):
    assert complete(lora_client, "sql") == reference["sql", MAX_TOKENS]
    assert complete(lora_client, BASE) == reference[None, MAX_TOKENS]
    chat = lora_client.chat.completions.create(
        model="sql", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0
    )
    assert chat.model == "sql" and chat.choices[0].message.content is not None
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        complete(lora_client, "doc")  # not loaded yet


def test_models_lists_adapters_with_their_parent(lora_client, folders):
    cards = {m.id: m for m in lora_client.models.list().data}
    assert set(cards) == {BASE, "sql"}
    assert cards["sql"].model_extra["parent"] == BASE
    assert cards["sql"].model_extra["root"] == str(folders["sql"])


def test_load_and_unload_at_run_time(lora_server, lora_client, folders, reference):
    body = {"lora_name": "doc", "lora_path": str(folders["doc"])}
    status, error = post(lora_server, "/v1/load_lora_adapter", body, key=None)
    assert status == 401, error
    status, text = post(lora_server, "/v1/load_lora_adapter", body)
    assert status == 200, text
    assert complete(lora_client, "doc") == reference["doc", MAX_TOKENS]
    assert "doc" in {m.id for m in lora_client.models.list().data}
    status, error = post(lora_server, "/v1/load_lora_adapter", body)
    assert status == 400 and "already been loaded" in error["error"]["message"], error

    assert "doc" in resident(lora_server) and "doc" in served(lora_server)
    status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "doc"})
    assert status == 200, text
    assert "doc" not in served(lora_server) and "sql" in served(lora_server)  # at once: no step needed
    # Gone from the resident gauge while the server idles (no step follows the unload), so the
    # router's adapter affinity does not keep sending doc here.
    deadline = time.monotonic() + 10
    while "doc" in resident(lora_server):
        assert time.monotonic() < deadline, "the unloaded adapter still shows as resident"
        time.sleep(0.02)  # a poll interval
    assert "sql" in resident(lora_server)
    with pytest.raises(openai.NotFoundError):
        complete(lora_client, "doc")
    status, error = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "doc"})
    assert status == 404 and error["error"]["param"] == "lora_name", error
    assert complete(lora_client, "sql") == reference["sql", MAX_TOKENS]


@pytest.mark.parametrize(
    ("name", "folder", "says"),
    [
        ("out", "outside", "outside the allowed roots"),
        ("link", "escape", "outside the allowed roots"),
        ("big", "rank64", "above --max-lora-rank 16"),
        ("embed", "embed", "not supported"),
        ("draft", "other-model", "has shape"),
        ("huge", "huge", "more than the"),
        ("bomb", "header-bomb", "not a safetensors file this size"),
        ("missing", "/nonexistent/adapter", "outside the allowed roots"),
        ("a,b", "doc", "not allowed"),
        ("sql", "doc", "already been loaded"),
    ],
)
def test_a_bad_adapter_is_a_400_and_the_server_keeps_serving(
    lora_server, lora_client, folders, reference, name, folder, says
):
    path = str(folders.get(folder, folder))
    status, error = post(lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
    assert status == 400, error
    assert set(error["error"]) == {"message", "type", "param", "code"}, error  # OpenAI's shape
    assert says in error["error"]["message"], error
    assert {m.id for m in lora_client.models.list().data} == {BASE, "sql"}
    assert complete(lora_client, "sql") == reference["sql", MAX_TOKENS]


def test_an_adapter_named_like_the_base_model_is_refused(lora_server, folders):
    status, error = post(
        lora_server, "/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": str(folders["doc"])}
    )
    assert status == 400 and "base model" in error["error"]["message"], error


def test_metrics_name_the_adapters(lora_server, lora_client):
    """vllm:lora_requests_info carries max_lora and the running adapter while a request of it runs;
    the per-adapter counters count its requests and tokens."""
    before = metrics(lora_server)

    def finished(families) -> float:
        family = families.get("kvscale_lora_requests_finished")
        return sum(
            s.value
            for s in (family.samples if family else [])
            if s.labels.get("lora_name") == "sql" and s.name.endswith("_total")
        )

    stream = lora_client.completions.create(
        model="sql",
        prompt=PROMPT,
        max_tokens=400,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with stream:
        next(iter(stream))
        deadline = time.monotonic() + 30
        while True:
            (info,) = metrics(lora_server)["vllm:lora_requests_info"].samples
            if info.labels["running_lora_adapters"] == "sql" or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # a poll interval, not a wait the assertion depends on
        assert info.labels == {"max_lora": "2", "running_lora_adapters": "sql", "waiting_lora_adapters": ""}
    complete(lora_client, "sql")
    after = metrics(lora_server)
    assert finished(after) >= finished(before) + 1
    # Each served adapter with its weights' digest: the router's precise index roots its hashes there.
    digests = {
        s.labels["lora_name"]: s.labels["digest"] for s in after["kvscale_lora_adapter_served"].samples
    }
    assert re.fullmatch("[0-9a-f]{64}", digests["sql"]) and len(set(digests.values())) == len(digests)
    tokens = after["kvscale_lora_generation_tokens"].samples
    assert any(
        s.name.endswith("_total") and s.labels["lora_name"] == "sql" and s.value >= MAX_TOKENS for s in tokens
    ), tokens
    deadline = time.monotonic() + 30  # the aborted stream leaves the running list
    while metrics(lora_server)["vllm:lora_requests_info"].samples[0].labels["running_lora_adapters"]:
        assert time.monotonic() < deadline, "the cancelled stream's adapter still shows as running"
        time.sleep(0.05)


def test_without_the_flag_there_are_no_load_endpoints(server):
    status, _ = server.get("/v1/models")
    assert status == 200
    request = urllib.request.Request(
        server.base_url + "/v1/load_lora_adapter",
        json.dumps({"lora_name": "x", "lora_path": "/tmp"}).encode(),
        {"Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code in (404, 405)


def test_four_adapters_in_two_slots_loaded_and_unloaded_while_others_stream(
    lora_server, lora_client, folders, reference
):
    """Must-show 2: four adapters on two device slots and two host copies. While sql and doc
    stream, w3 and w4 are loaded; their requests wait for a slot (the scheduler runs at most two
    adapters at once) and, while w4's streams, doc and w3 are unloaded. Every answer is the offline
    engine's, token for token, through slot evictions and host evictions (read back from disk)."""
    assert (
        post(lora_server, "/v1/load_lora_adapter", {"lora_name": "doc", "lora_path": str(folders["doc"])})[0]
        == 200
    )
    before = metrics(lora_server)
    streamed: dict[str, str] = {}

    def stream(name: str) -> None:
        chunks = lora_client.completions.create(
            model=name,
            prompt=PROMPT,
            max_tokens=LONG,
            temperature=0.0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        streamed[name] = "".join(c.choices[0].text for c in chunks if c.choices)

    def start(*names: str) -> list[threading.Thread]:
        threads = [threading.Thread(target=stream, args=(name,)) for name in names]
        for t in threads:
            t.start()
        return threads

    def wait_running(names: str) -> None:
        deadline = time.monotonic() + 60
        while running(lora_server) != names:
            assert time.monotonic() < deadline, running(lora_server)
            time.sleep(0.02)  # a poll interval

    first = start("sql", "doc")
    wait_running("doc,sql")
    for name in ("w3", "w4"):
        status, text = post(
            lora_server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folders[name])}
        )
        assert status == 200, text
    assert running(lora_server) == "doc,sql"  # both loads came while both streamed
    second = start("w3", "w4")
    for t in first:
        t.join(timeout=120)
    wait_running("w3,w4")
    for name in ("doc", "w3"):  # unloaded while w3 and w4 stream: w3's request finishes on it
        status, text = post(lora_server, "/v1/unload_lora_adapter", {"lora_name": name})
        assert status == 200, text
    assert running(lora_server) == "w3,w4"
    for t in second:
        t.join(timeout=120)
    assert streamed == {name: reference[name, LONG] for name in ADAPTERS}
    # sql's host copy was evicted (two host copies, four adapters): read back, same tokens.
    assert complete(lora_client, "sql") == reference["sql", MAX_TOKENS]
    after = metrics(lora_server)
    for kind in ("slot_evictions", "host_evictions"):
        assert counter(after, f"kvscale_lora_{kind}") >= counter(before, f"kvscale_lora_{kind}") + 1, kind
    with pytest.raises(openai.NotFoundError):
        complete(lora_client, "w3")
    assert post(lora_server, "/v1/unload_lora_adapter", {"lora_name": "w4"})[0] == 200
    assert {m.id for m in lora_client.models.list().data} == {BASE, "sql"}


def running(server) -> str:
    (info,) = metrics(server)["vllm:lora_requests_info"].samples
    return info.labels["running_lora_adapters"]


def resident(server) -> set[str]:
    """The adapters kvscale_lora_adapter_resident lists (in a device slot now)."""
    family = metrics(server).get("kvscale_lora_adapter_resident")
    return {s.labels["lora_name"] for s in (family.samples if family else []) if s.value == 1}


def served(server) -> set[str]:
    """The adapters kvscale_lora_adapter_served lists (served by name now)."""
    family = metrics(server).get("kvscale_lora_adapter_served")
    return {s.labels["lora_name"] for s in (family.samples if family else []) if s.value == 1}


def counter(families: dict, name: str) -> float:
    return sum(s.value for s in families[name].samples if s.name.endswith("_total"))
