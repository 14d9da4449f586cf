"""The kubelet acts on the probes the operator gives the workers: a worker that stops answering,
or whose engine thread hangs while its HTTP server still answers, is restarted by its liveness
probe; a worker that never finishes loading its model is restarted once the startup probe's budget
(spec.server.startupTimeoutSeconds) is spent."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import threading
import time
import urllib.error
import urllib.request
from collections import Counter

import pytest
from kubernetes import client
from model_fixtures import TARGET
from test_controlplane import wait_for
from test_operator import apply, example, models_volume, namespace, operator, wait_ready  # noqa: F401
from thread_stop import ThreadStopper

pytestmark = pytest.mark.slow

ENGINE_THREAD = "kvscale-engine"  # the engine thread's OS name (worker/engine/async_llm.py)
WORKER_PORT = 8000


def worker_pod(cluster, ns: str, name: str):
    pods = client.CoreV1Api(cluster.api).list_namespaced_pod(
        ns, label_selector=f"kvscale.dev/inference-deployment={name}"
    )
    (pod,) = [p for p in pods.items if p.metadata.deletion_timestamp is None]
    return pod


def events_of(cluster, ns: str, pod: str) -> str:
    return cluster.kubectl("get", "events", "-n", ns, "--field-selector", f"involvedObject.name={pod}").stdout


def test_a_worker_that_stops_answering_is_restarted_by_its_liveness_probe(operator, namespace):  # noqa: F811
    if not operator.local:
        pytest.skip("freezes a worker process on the local node")
    apply(operator, example("frozen", namespace, replicas=1))
    wait_ready(operator, "frozen", namespace, replicas=1)
    pod = worker_pod(operator, namespace, "frozen")
    status = pod.status.container_statuses[0]
    assert status.restart_count == 0
    # The whole worker process stops (its engine thread included): /health no longer answers.
    os.kill(operator.node.container_pid(status.container_id), signal.SIGSTOP)

    def restarted():
        p = worker_pod(operator, namespace, "frozen")
        s = p.status.container_statuses[0]
        return p if s.restart_count >= 1 and s.ready else None

    # Liveness: every 10 s, 5 s timeout, 3 failures; then the kill, the restart and the model load.
    again = wait_for(restarted, timeout=180, interval=1, what="the kubelet to restart the frozen worker")
    assert again.metadata.uid == pod.metadata.uid  # the same pod: a container restart, not a new pod
    events = events_of(operator, namespace, pod.metadata.name)
    assert "Liveness probe failed" in events and "will be restarted" in events, events


def health(address: str, timeout: float = 2.0) -> tuple[int, str] | None:
    """(status, body) of a worker's /health; None when it does not answer within timeout."""
    try:
        with urllib.request.urlopen(f"http://{address}/health", timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return None


def running(address: str) -> float:
    """The worker's kvscale_requests_running gauge."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvscale_requests_running"):
                return float(line.split()[-1])
    return 0.0


def keep_busy(address: str, model: str, n: int = 4) -> list[str]:
    """n clients sending long completions back to back, so the engine owes progress wherever its
    thread is frozen: mid-step, or idle between two requests (then the next add is what it owes;
    a cold CI run once froze it idle after one round of requests had finished, and /health rightly
    stayed 200). Each client stops at its first error (they die with the container: expected);
    returns the list those errors land in."""
    errors: list[str] = []
    # 900 tokens: the example's maxModelLen is 1024; at 500m of CPU that is many seconds of work.
    body = json.dumps({"model": model, "prompt": "def f(x):", "max_tokens": 900, "ignore_eos": True})

    def send_back_to_back() -> None:
        while True:
            request = urllib.request.Request(
                f"http://{address}/v1/completions", body.encode(), {"Content-Type": "application/json"}
            )
            try:
                urllib.request.urlopen(request, timeout=300).read()
            except urllib.error.HTTPError as e:
                errors.append(f"{e.code}: {e.read()[:300]!r}")
                return
            except OSError as e:
                errors.append(repr(e))
                return

    for _ in range(n):
        threading.Thread(target=send_back_to_back, daemon=True).start()
    return errors


def test_a_worker_whose_engine_thread_hangs_is_restarted_by_its_liveness_probe(operator, namespace):  # noqa: F811
    """Only the engine thread is frozen (ptrace, from outside the container): the HTTP server goes
    on answering, so the probe must be failed by /health's own stuck check (500), not a timeout."""
    if not operator.local:
        pytest.skip("freezes a thread of a worker process on the local node")
    doc = example("hung", namespace, replicas=1)
    doc["spec"]["engine"] = {
        **doc["spec"].get("engine", {}),
        "extraArgs": ["--engine-iteration-timeout", "3"],
    }
    doc["spec"]["server"] = {"drainTimeoutSeconds": 2}
    apply(operator, doc)
    wait_ready(operator, "hung", namespace, replicas=1)
    pod = worker_pod(operator, namespace, "hung")
    status = pod.status.container_statuses[0]
    assert status.restart_count == 0
    address = f"{pod.status.pod_ip}:{WORKER_PORT}"
    errors = keep_busy(address, model="hung")  # served under the resource's name
    wait_for(
        lambda: running(address) >= 1, timeout=30, interval=0.2, what=f"the engine to be mid-work ({errors})"
    )
    stopper = ThreadStopper(operator.node.container_pid(status.container_id), ENGINE_THREAD)
    try:
        # A thread frozen while it holds the GIL freezes the server too (the SIGSTOP case above),
        # and one frozen in a futex wait may hold a Python lock the event loop needs next (a cold
        # CI run froze it so: /health never answered again). Thaw and freeze again until it is
        # frozen in native code without the GIL (a torch kernel), which is where real hangs sit.
        # Tried for up to two minutes at random moments (a fixed rhythm can keep meeting the same
        # phase of a step: 200 quick tries once never caught one), counting where it was caught.
        caught: Counter[str] = Counter()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert stopper.stop() == "stopped"
            where = stopper.where_stopped()
            if where == "-1" and health(address, timeout=1.0) is not None:
                break
            caught["holding the GIL" if where == "-1" else f"syscall {where}"] += 1
            stopper.cont()
            time.sleep(random.uniform(0.0, 0.05))
        else:
            pytest.fail(f"the engine thread was never frozen in native code without the GIL: {dict(caught)}")
        stopper.wait_exit_in_background()
        seen: list[tuple[int, str] | None] = []

        def stuck() -> tuple[int, str] | None:
            seen.append(a := health(address))
            return a if a is not None and a[0] == 500 else None

        try:
            answers = wait_for(stuck, timeout=30, interval=0.5, what="/health to report the stuck engine")
        except AssertionError as e:
            raise AssertionError(f"{e}; /health answered {sorted(set(map(str, seen)))}") from None
        assert '"stuck"' in answers[1], answers

        def restarted():
            p = worker_pod(operator, namespace, "hung")
            s = p.status.container_statuses[0]
            return p if s.restart_count >= 1 and s.ready else None

        again = wait_for(restarted, timeout=240, interval=1, what="the kubelet to restart the hung worker")
        assert again.metadata.uid == pod.metadata.uid
        events = events_of(operator, namespace, pod.metadata.name)
        assert "Liveness probe failed: HTTP probe failed with statuscode: 500" in events, events
        assert "will be restarted" in events, events
        # The restarted worker serves again.
        assert health(f"{again.status.pod_ip}:{WORKER_PORT}") == (200, '{"status": "ok"}')
    finally:
        stopper.close()
    client.CustomObjectsApi(operator.api).delete_namespaced_custom_object(
        "kvscale.dev", "v1alpha1", namespace, "inferencedeployments", "hung"
    )


def test_a_worker_that_never_loads_is_restarted_after_the_startup_budget(operator, namespace, tmp_path):  # noqa: F811
    if not operator.local:
        pytest.skip("mounts a model folder made on this machine")
    # The fixture model, but its weights are a FIFO nobody writes: loading blocks for ever while
    # the server answers /health (alive) and /ready 503 (loading).
    model = tmp_path / "models" / "never-loads"
    model.mkdir(parents=True)
    for f in TARGET.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, model / f.name)
    os.mkfifo(model / "model.safetensors")
    for path in (tmp_path, model.parent, model):
        path.chmod(0o755)
    models_volume(operator, namespace, model.parent, claim="stuck")
    doc = example("stuck", namespace, replicas=1)
    doc["spec"]["model"]["uri"] = "pvc://stuck/never-loads"
    doc["spec"]["server"] = {"startupTimeoutSeconds": 10, "drainTimeoutSeconds": 2}
    apply(operator, doc)

    def restarted():
        try:
            p = worker_pod(operator, namespace, "stuck")
        except ValueError:
            return None
        statuses = p.status.container_statuses or []
        return p if statuses and statuses[0].restart_count >= 1 else None

    pod = wait_for(restarted, timeout=240, interval=1, what="the kubelet to restart the never-loading worker")
    status = pod.status.container_statuses[0]
    assert not status.ready and not status.started
    events = events_of(operator, namespace, pod.metadata.name)
    assert "Startup probe failed" in events and "will be restarted" in events, events
    assert "Liveness probe failed" not in events  # the startup probe held liveness off
    client.CustomObjectsApi(operator.api).delete_namespaced_custom_object(
        "kvscale.dev", "v1alpha1", namespace, "inferencedeployments", "stuck"
    )
