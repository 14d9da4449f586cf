"""The operator's side of LoRA adapters (issue 30): spec.adapters into the worker pods (mounts,
downloads, `--lora-modules` or the dynamic-loading flags), the adapter sync's pure decisions, and
the sync against the real worker server: loads, unloads, a path change, a refusal in status; and
against a hostile peer (huge, slow, not JSON), which reads as unreadable, never as a hang."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from kubernetes import client

from kvscale.operator.adapters import sync
from kvscale.operator.adapters.plan import Plan, WorkerView, adapter_status, plan_worker
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.reconcile.children import Owner, adapter_paths, pod_template

OWNER = Owner("tiny", "ns", "uid-1")


def spec(**fields) -> InferenceDeploymentSpec:
    return InferenceDeploymentSpec.model_validate({"model": {"uri": "pvc://models/tiny"}, **fields})


def worker(template: dict) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == "worker")


def flag_values(args: list[str], flag: str) -> list[str]:
    rest = args[args.index(flag) + 1 :]
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


ADAPTERS = [
    {"name": "sql", "uri": "pvc://adapters/sql"},
    {"name": "org/chat@v2", "uri": "hf://org/chat@v2"},
    {"name": "baked", "uri": "/opt/adapters/baked"},
]


# --- the pod ----------------------------------------------------------------------------------


def test_static_adapters_are_lora_modules_with_their_mounts_and_downloads():
    s = spec(adapters=ADAPTERS, lora={"maxLoras": 2, "maxLoraRank": 64, "maxCpuLoras": 8})
    template = pod_template(OWNER, s, "img")
    args = worker(template)["args"]
    assert flag_values(args, "--lora-modules") == [
        "sql=/models/adapters/sql",
        "org/chat@v2=/models/hf/org/chat/v2",
        "baked=/opt/adapters/baked",
    ]
    assert args[args.index("--max-loras") + 1] == "2" and args[args.index("--max-lora-rank") + 1] == "64"
    assert args[args.index("--max-cpu-loras") + 1] == "8" and "--enable-lora" in args
    assert "--enable-lora-runtime-updating" not in args  # off unless asked, as in vLLM
    volumes = {v["name"]: v for v in template["spec"]["volumes"]}
    assert volumes["pvc-adapters"]["persistentVolumeClaim"] == {"claimName": "adapters", "readOnly": True}
    mounts = {m["name"]: m for m in worker(template)["volumeMounts"]}
    assert mounts["pvc-adapters"] == {
        "name": "pvc-adapters",
        "mountPath": "/models/adapters",
        "readOnly": True,
    }
    assert mounts["hf-models"]["readOnly"] is True
    (download,) = template["spec"]["initContainers"]  # the hf:// one only
    assert download["args"][3:6] == ["hf://org/chat@v2", "--dest", "/models/hf/org/chat/v2"]
    assert adapter_paths(s) == dict(a.split("=", 1) for a in flag_values(args, "--lora-modules"))


def test_a_user_flag_wins_over_the_lora_flags():
    s = spec(adapters=ADAPTERS[:1], engine={"extraArgs": ["--max-loras", "3"]})
    args = worker(pod_template(OWNER, s, "img"))["args"]
    assert args.index("--max-loras") < len(args) - 2 and args[-2:] == ["--max-loras", "3"]


def test_no_adapters_no_lora_flags():
    args = worker(pod_template(OWNER, spec(), "img"))["args"]
    assert not [a for a in args if "lora" in a]


def test_download_names_do_not_depend_on_the_order_of_the_adapters():
    hf = [{"name": "a", "uri": "hf://org/a"}, {"name": "b", "uri": "hf://org/b@v1"}]
    one = pod_template(OWNER, spec(adapters=hf), "img")["spec"]["initContainers"]
    two = pod_template(OWNER, spec(adapters=hf[::-1]), "img")["spec"]["initContainers"]
    assert sorted(c["name"] for c in one) == sorted(c["name"] for c in two)
    assert len({c["name"] for c in one}) == 2
    shared = pod_template(OWNER, spec(adapters=[hf[0], {"name": "a2", "uri": "hf://org/a"}]), "img")
    assert len(shared["spec"]["initContainers"]) == 1  # one URI, one download


def test_dynamic_loading_keeps_the_pods_when_adapters_change_on_mounted_sources():
    """The whole point of dynamic loading: adding or removing an adapter on a claim (or an image
    folder) the pods already mount leaves the pod template as it was (no rollout); the worker
    may read only under the adapters' roots. Without it, the same change is a new template."""
    lora = {"dynamicLoading": True, "maxLoras": 2}
    before = [{"name": "a", "uri": "pvc://adapters/a"}, {"name": "b", "uri": "/opt/adapters/b"}]
    after = [before[1], {"name": "c", "uri": "pvc://adapters/c"}, {"name": "d", "uri": "/opt/adapters/d"}]
    one = pod_template(OWNER, spec(adapters=before, lora=lora), "img")
    two = pod_template(OWNER, spec(adapters=after, lora=lora), "img")
    assert one == two
    args = worker(one)["args"]
    assert "--lora-modules" not in args and "--enable-lora-runtime-updating" in args
    assert flag_values(args, "--lora-allowed-roots") == ["/models/adapters", "/opt/adapters"]
    static = [pod_template(OWNER, spec(adapters=a), "img") for a in (before, after)]
    assert static[0] != static[1]
    # A claim the pods do not mount yet is a new volume: a new template either way.
    other = pod_template(
        OWNER, spec(adapters=[*after, {"name": "e", "uri": "pvc://more/e"}], lora=lora), "img"
    )
    assert other != two


# --- the pure decisions -----------------------------------------------------------------------


def test_plan_unloads_what_is_gone_or_moved_and_loads_what_is_missing():
    desired = {"a": "/x/a", "b": "/x/b2", "c": "/x/c"}
    loaded = {"a": "/x/a", "b": "/x/b", "old": "/x/old"}
    assert plan_worker(desired, loaded) == Plan(("b", "old"), (("b", "/x/b2"), ("c", "/x/c")))
    assert plan_worker(desired, desired) == Plan()
    assert plan_worker({}, loaded) == Plan(("a", "b", "old"), ())


def test_adapter_status_over_the_ready_workers():
    views = [
        WorkerView(frozenset({"a", "b"})),
        WorkerView(frozenset({"a"}), {"c": "rank 64 is above --max-lora-rank 16 " + "x" * 500}),
        WorkerView(None),  # unreadable: counted nowhere
    ]
    a, b, c = adapter_status(["a", "b", "c"], views)
    assert a == {"name": "a", "state": "Ready", "readyWorkers": 2, "message": ""}
    assert b == {
        "name": "b",
        "state": "Loading",
        "readyWorkers": 1,
        "message": "served by 1 of 2 ready workers",
    }
    assert c["state"] == "Failed" and c["message"].startswith("rank 64") and len(c["message"]) == 256
    assert adapter_status(["a"], [WorkerView(None)])[0]["state"] == "Pending"
    assert adapter_status(["a"], [])[0] == {
        "name": "a",
        "state": "Pending",
        "readyWorkers": 0,
        "message": "no ready worker",
    }


def test_static_mode_reads_the_adapters_from_the_pod_args():
    template = pod_template(OWNER, spec(adapters=ADAPTERS), "img")
    container = worker(template)
    pod = client.V1Pod(
        spec=client.V1PodSpec(containers=[client.V1Container(name="worker", args=container["args"])])
    )
    assert sync.modules_of(pod) == {"sql", "org/chat@v2", "baked"}
    bare = client.V1Pod(spec=client.V1PodSpec(containers=[client.V1Container(name="worker", args=["serve"])]))
    assert sync.modules_of(bare) == frozenset()


# --- the sync against the real worker ---------------------------------------------------------


@pytest.fixture(scope="module")
def adapters(target_model, tmp_path_factory) -> dict[str, Path]:
    pytest.importorskip("peft")
    from test_lora_peft_parity import ATTENTION, MLP, make_adapter

    root = tmp_path_factory.mktemp("operator-adapters") / "adapters"
    target = Path(target_model)
    return {
        "root": root,
        "sql": make_adapter(target, root / "sql", seed=1, r=8, target_modules=ATTENTION),
        "doc": make_adapter(target, root / "doc", seed=2, r=8, target_modules=MLP),
        "doc2": make_adapter(target, root / "doc2", seed=3, r=16, target_modules=ATTENTION + MLP),
        "rank64": make_adapter(target, root / "rank64", seed=4, r=64, target_modules=MLP),
    }


@pytest.fixture(scope="module")
def dynamic_worker(target_model, adapters, tmp_path_factory):
    from server_fixtures import start_server

    proc = start_server(
        target_model,
        tmp_path_factory.mktemp("operator-adapters-log"),
        "--num-kv-blocks", "128",
        "--enable-lora", "--max-loras", "2", "--max-lora-rank", "16",
        "--enable-lora-runtime-updating", "--lora-allowed-roots", str(adapters["root"]),
    )  # fmt: skip
    yield proc
    assert proc.stop() == 0, proc.log()


def run_sync(port: int, desired: dict[str, str]) -> sync.WorkerView:
    async def go() -> sync.WorkerView:
        async with aiohttp.ClientSession() as session:
            return await sync.sync_worker(session, "127.0.0.1", desired, dynamic=True, port=port)

    return asyncio.run(go())


def served(port: int) -> dict[str, str] | None:
    async def go() -> dict[str, str] | None:
        async with aiohttp.ClientSession() as session:
            return await sync.served_adapters(session, "127.0.0.1", port)

    return asyncio.run(go())


def test_the_sync_brings_a_real_worker_to_the_spec(dynamic_worker, adapters):
    port = dynamic_worker.port
    paths = {k: str(v) for k, v in adapters.items()}
    view = run_sync(port, {"sql": paths["sql"], "doc": paths["doc"]})
    assert view.served == {"sql", "doc"} and view.refused == {}
    assert served(port) == {"sql": paths["sql"], "doc": paths["doc"]}
    # doc moves to another folder (its uri changed), sql goes, a rank-64 adapter is refused by the
    # worker (max rank 16): said in status, the rest served.
    view = run_sync(port, {"doc": paths["doc2"], "big": paths["rank64"]})
    assert served(port) == {"doc": paths["doc2"]}
    assert view.served == {"doc"} and set(view.refused) == {"big"}
    assert "rank" in view.refused["big"], view.refused
    (status,) = [s for s in adapter_status(["doc", "big"], [view]) if s["name"] == "big"]
    assert status["state"] == "Failed"
    # The same spec again: nothing to do, nothing refused twice over.
    assert run_sync(port, {"doc": paths["doc2"]}).served == {"doc"}
    status, body = dynamic_worker.get("/v1/models")
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]][1:] == ["doc"]


# --- a hostile peer ---------------------------------------------------------------------------


@pytest.fixture
def hostile():
    """A stand-in for a worker gone bad (a tenant cannot reach this path: pods are owner-checked,
    but the sync must not trust what a peer sends): routes by the test's choice."""
    behaviours: dict[str, web.Response | float] = {}

    async def models(request: web.Request) -> web.StreamResponse:
        what = behaviours["models"]
        if isinstance(what, float):
            await asyncio.sleep(what)
            return web.json_response({"data": []})
        return what

    async def run(coro_factory):
        app = web.Application()
        app.router.add_get("/v1/models", models)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        try:
            async with aiohttp.ClientSession(auto_decompress=False) as session:
                return await coro_factory(session, port)
        finally:
            await runner.cleanup()

    return behaviours, run


@pytest.mark.parametrize(
    "answer",
    [
        web.Response(body=b'{"data": [' + b'{"id": "x", "root": "/", "parent": "m"},' * 60_000 + b"{}]}"),
        web.Response(body=b"not json"),
        web.json_response({"data": "not a list of cards"}),
        web.Response(status=500),
        0.5,  # slower than the read deadline
    ],
    ids=["huge", "not-json", "bad-shape", "error", "slow"],
)
def test_a_hostile_worker_reads_as_unreadable(hostile, answer, monkeypatch):
    monkeypatch.setattr(sync, "READ_TIMEOUT_S", 0.2)
    behaviours, run = hostile
    behaviours["models"] = answer

    async def go(session, port):
        started = asyncio.get_running_loop().time()
        view = await sync.sync_worker(session, "127.0.0.1", {"a": "/x/a"}, dynamic=True, port=port)
        return view, asyncio.get_running_loop().time() - started

    view, took = asyncio.run(run(go))
    assert view.served is None and took < 2.0
    assert adapter_status(["a"], [view])[0]["state"] == "Pending"
