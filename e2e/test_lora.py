"""LoRA adapters end to end on the real node (issue 30): an InferenceDeployment whose two adapters
come from a `pvc://` claim (a hostPath PersistentVolume of PEFT folders made here on the fixture
model), loaded by the operator into both workers through their load endpoints (dynamic loading);
a completion for each adapter through the router's Service; a third adapter added to the spec
reaches both workers without a rollout; and the router sends each adapter's requests to the
worker that holds it in its slot (its /metrics and the workers' per-adapter counters show it)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from kubernetes import client
from model_fixtures import TARGET
from prometheus_client.parser import text_string_to_metric_families
from test_controlplane import wait_for
from test_operator import (  # noqa: F401 (fixtures)
    apply,
    example,
    get_cr,
    models_volume,
    namespace,
    operator,
    wait_ready,
)
from test_router import complete, wait_router, worker_pods

ADAPTER_CLAIM = "adapters"
NAMES = ("sql", "doc", "w3")


@pytest.fixture(scope="module")
def adapter_folders():
    """PEFT adapters on the fixture model in a folder the worker pods (non-root) can read."""
    pytest.importorskip("peft")
    from test_lora_peft_parity import ATTENTION, MLP, make_adapter  # tests/ is on the path (conftest)

    root = Path(tempfile.mkdtemp(prefix="kvscale-e2e-adapters-"))
    targets = {"sql": ATTENTION + MLP, "doc": ATTENTION, "w3": MLP}
    for seed, (name, modules) in enumerate(targets.items(), 1):
        make_adapter(TARGET, root / name, seed=seed, r=8, target_modules=modules)
    for folder, _, files in os.walk(root):
        os.chmod(folder, 0o755)
        for f in files:
            os.chmod(os.path.join(folder, f), 0o644)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def adapters_of(cr: dict) -> dict[str, dict]:
    return {a["name"]: a for a in (cr.get("status") or {}).get("adapters") or []}


def wait_adapters(cluster, name: str, ns: str, names: tuple[str, ...], workers: int) -> dict:
    def ready():
        shown = adapters_of(get_cr(cluster, name, ns))
        ok = set(shown) == set(names) and all(
            a["state"] == "Ready" and a["readyWorkers"] == workers for a in shown.values()
        )
        return shown if ok else None

    return wait_for(ready, timeout=120, interval=1, what=f"adapters {names} Ready on {workers} workers")


def metric_samples(url: str) -> list:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def test_adapters_from_a_claim_load_route_and_grow_without_a_rollout(operator, namespace, adapter_folders):  # noqa: F811
    ns, name = namespace, "lora"
    models_volume(operator, ns, adapter_folders, claim=ADAPTER_CLAIM)
    adapters = [{"name": n, "uri": f"pvc://{ADAPTER_CLAIM}/{n}"} for n in NAMES]
    doc = example(
        name,
        ns,
        replicas=2,
        adapters=adapters[:2],
        lora={"dynamicLoading": True, "maxLoras": 2, "maxLoraRank": 16},
    )
    apply(operator, doc)
    wait_ready(operator, name, ns, replicas=2, timeout=300)
    wait_adapters(operator, name, ns, NAMES[:2], workers=2)
    ip = wait_router(operator, name, ns)
    apps = client.AppsV1Api(operator.api)
    generation = apps.read_namespaced_deployment(name, ns).metadata.generation

    answers = {}
    for model in (name, *NAMES[:2]):
        code, body = complete(ip, model)
        assert code == 200, body
        out = json.loads(body)
        assert out["model"] == model
        answers[model] = out["choices"][0]["text"]
    assert len(set(answers.values())) == 3, answers  # each adapter changes the greedy answer

    # A third adapter: loaded into the running workers (the Deployment's template is unchanged).
    apply(operator, {**doc, "spec": {**doc["spec"], "adapters": adapters}})
    wait_adapters(operator, name, ns, NAMES, workers=2)
    assert apps.read_namespaced_deployment(name, ns).metadata.generation == generation
    code, body = complete(ip, "w3")
    assert code == 200 and json.loads(body)["model"] == "w3", body

    # Affinity: sql and doc alternate, sequentially; each goes to a worker holding it in a slot
    # (two slots per worker, three adapters: a worker may hold both).
    for i in range(16):
        code, body = complete(ip, NAMES[i % 2])
        assert code == 200, body
    finished: dict[str, Counter] = {}
    resident: dict[str, set[str]] = {}
    for pod in worker_pods(operator, ns):
        for s in metric_samples(f"http://{pod.status.pod_ip}:8000/metrics"):
            if s.name == "kvscale_lora_requests_finished_total" and s.value:
                finished.setdefault(s.labels["lora_name"], Counter())[pod.metadata.name] += s.value
            if s.name == "kvscale_lora_adapter_resident" and s.value == 1:
                resident.setdefault(s.labels["lora_name"], set()).add(pod.metadata.name)
    print(json.dumps({"finished": finished, "resident": {k: sorted(v) for k, v in resident.items()}}))
    for adapter in NAMES[:2]:
        (where, count), *_ = finished[adapter].most_common()
        assert count >= 8 and where in resident[adapter], (finished, resident)  # 8 of its 9
    picks: Counter = Counter()
    routers = client.CoreV1Api(operator.api).list_namespaced_pod(
        ns, label_selector=f"app.kubernetes.io/name=kvscale-router,app.kubernetes.io/instance={name}"
    )
    for router in routers.items:
        for s in metric_samples(f"http://{router.status.pod_ip}:8000/metrics"):
            if s.name == "kvscale_router_adapter_picks_total":
                picks[s.labels["affinity"]] += s.value
    print(json.dumps({"router_adapter_picks": picks}))
    assert picks["resident"] >= 14 and sum(picks.values()) >= 19, picks  # 16 + w3 + sql and doc
