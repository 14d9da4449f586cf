"""The worker image's default on a CPU node: the worker compiles its forward (torch.compile with
inductor's C++ wrapper, built by the image's g++ into its cache on the pod's /tmp emptyDir) before
it turns Ready, and serves the tokens of the eager reference. Every other e2e worker runs eagerly
(test_operator.example sets KVSCALE_ENFORCE_EAGER=1: a cold compile is ~2 min a pod at 500m)."""

from __future__ import annotations

import json

import pytest
from kubernetes import client
from test_operator import (  # noqa: F401 (fixtures)
    apply,
    complete_when_routed,
    example,
    explain,
    namespace,
    operator,
    wait_ready,
)
from test_parallelism import tp1_greedy

pytestmark = pytest.mark.slow


def test_a_worker_pod_compiles_its_forward_by_default(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("mounts the fixture model from this machine")
    doc = example("compiled", namespace, replicas=1)
    del doc["spec"]["env"]  # the image's default: no KVSCALE_ENFORCE_EAGER
    apply(operator, doc)
    # Measured cold at 500m: ~115 s of compiling (~55 s at 2 CPUs); the startup probe allows 600 s.
    cr = wait_ready(operator, "compiled", namespace, replicas=1, timeout=420)

    core = client.CoreV1Api(operator.api)
    (pod,) = core.list_namespaced_pod(namespace, label_selector=cr["status"]["selector"]).items
    logs = operator.kubectl("logs", pod.metadata.name, "-n", namespace, "-c", "worker").stdout
    lines = [json.loads(line) for line in logs.splitlines() if line.startswith("{")]
    (ready,) = [line for line in lines if line["msg"] == "ready"]
    # compile_s is None when the forward runs eagerly (no g++, a failed compile, a noexec cache).
    assert isinstance(ready["compile_s"], float) and ready["compile_s"] > 0, explain(
        operator, "compiled", namespace
    )
    assert any(line["msg"].startswith("compiled the forward in") for line in lines), logs
    assert "eager forward" not in logs and "torch.compile failed" not in logs, logs

    service = core.read_namespaced_service("compiled", namespace)
    answer = complete_when_routed(f"{service.spec.cluster_ip}:{service.spec.ports[0].port}", "compiled")
    assert answer["usage"]["completion_tokens"] == 8
    assert answer["choices"][0]["text"] == tp1_greedy("def fibonacci(n):", 8)
