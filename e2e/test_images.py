"""The Dockerfile, built for real: its images from a locally made base, each started as a user
would run it (uid 1000, read-only root filesystem, a tmpfs /tmp). The operator image imports every
module the operator loads and starts; the worker image serves completions on the fixture model,
eagerly and then compiled (its build behind), and loads the compiled forward it ships for the
built-in model."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from model_fixtures import TARGET
from prometheus_client.parser import text_string_to_metric_families
from test_parallelism import tp1_greedy

pytestmark = pytest.mark.slow

# /tmp as a pod's emptyDir is: writable and not noexec (docker's --tmpfs is noexec unless told `exec`;
# the worker loads the forward inductor compiles from there).
# /tmp as the worker pod has it: writable, exec, and 2 GiB (workers.ephemeralStorage's default); the
# build behind writes inductor's ~160 MB precompiled header there (256 MiB ran out).
LOCKED_DOWN = ["--user", "1000:1000", "--read-only", "--tmpfs", "/tmp:rw,exec,size=2g", "--cap-drop", "ALL"]
IDENTITY = (
    "import os, pathlib; print(os.getuid(), os.getgid());"
    "p = pathlib.Path('/opt/kvscale/x');"
    "\ntry:\n p.write_text('x'); print('rootfs writable')\nexcept OSError as e:\n print('rootfs', e.strerror)"
)


def test_operator_image_imports_everything_it_loads_and_starts(images):
    rt, built = images
    image = built.images["operator"]
    check = (
        "import importlib, pkgutil, sys, kvscale.operator as op\n"
        "mods = [m.name for m in pkgutil.walk_packages(op.__path__, 'kvscale.operator.')]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "import kvscale.operator.main as main\n"
        "assert main.main(['--log-format', 'json', 'crd']) == 0\n"  # the logging setup run uses too
        "assert 'torch' not in sys.modules\n"
        "print('imported', *sorted(m for m in sys.modules if m.startswith('kvscale')), file=sys.stderr)\n"
    )
    result = rt.docker(
        "run", "--rm", "--network=none", *LOCKED_DOWN, "--entrypoint", "python", image, "-c", check,
        capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    for module in (
        "kvscale.operator.autoscaler.scaler",
        "kvscale.operator.handlers",
        "kvscale.operator.kube.leader",
        "kvscale.operator.reconcile.reconciler",
        "kvscale.common.json_logging",
    ):
        assert module in result.stderr
    assert "kind: CustomResourceDefinition" in result.stdout

    # The entrypoint as the Deployment runs it: `run` with no cluster to talk to gets as far as
    # loading the credentials, i.e. past every import, and says so.
    result = rt.docker("run", "--rm", "--network=none", *LOCKED_DOWN, image, "--help", capture=True)
    assert result.returncode == 0 and "kvscale-operator" in result.stdout, result.stderr
    result = rt.docker(
        "run", "--rm", "--network=none", *LOCKED_DOWN, image, "run", "--health-port", "0", capture=True
    )
    assert "ModuleNotFoundError" not in result.stderr and "ImportError" not in result.stderr, result.stderr
    assert "kubernetes.config.config_exception.ConfigException" in result.stderr, result.stderr

    result = rt.docker(
        "run", "--rm", "--network=none", *LOCKED_DOWN, "--entrypoint", "python", image, "-c", IDENTITY,
        capture=True,
    )  # fmt: skip
    assert result.stdout.split("\n")[:2] == ["1000 1000", "rootfs Read-only file system"], result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read().decode() if r.status == 200 else None
    except OSError:
        return None


def _metric(text: str, name: str, **labels: str) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def _complete(base: str, prompt: str, max_tokens: int = 8) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def _run_worker(rt, image: str, port: int, *args: str, volumes: tuple[str, ...] = ()) -> str:
    name = f"kvscale-worker-test-{port}"
    mounts = [a for v in volumes for a in ("--volume", v)]
    result = rt.docker(
        "run", "--detach", "--name", name, "--network=host", *LOCKED_DOWN, *mounts,
        image, "serve", *args, "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "256",
        capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return name


def _wait(rt, name: str, check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        state = rt.docker("inspect", "--format", "{{.State.Running}}", name, capture=True).stdout.strip()
        assert state == "true" and time.monotonic() < deadline, (
            f"{what}: " + rt.docker("logs", name, capture=True).stderr[-4000:]
        )
        time.sleep(0.5)


def _stop(rt, name: str) -> list[dict]:
    stop = rt.docker("stop", "--time", "30", name, capture=True)
    logs = rt.docker("logs", name, capture=True)
    rt.docker("rm", "--force", name, capture=True)
    assert stop.returncode == 0
    assert "Traceback" not in logs.stderr, logs.stderr[-3000:]
    return [json.loads(line) for line in logs.stderr.splitlines() if line.startswith("{")]


def test_worker_image_serves_eagerly_then_switches_to_its_compiled_forward(images):
    """The image's default on CPU, for a model it ships no package for (the fixture model): the
    worker turns Ready on the eager forward (the `ready` line's compile_s is null), builds the
    compiled forward behind it with the image's g++ into its cache on the tmpfs /tmp (HOME=/tmp:
    /tmp/.cache/kvscale/compiled; the root filesystem is read-only), then switches: its metrics and
    log say so, and the tokens are the eager reference's on both sides of the switch."""
    if not TARGET.is_dir():
        pytest.skip(f"{TARGET} is missing")
    rt, built = images
    image, port = built.images["worker"], _free_port()
    base = f"http://127.0.0.1:{port}"
    name = _run_worker(
        rt, image, port, "--model", "/models/tiny-code-target", "--served-model-name", "tiny",
        "--dtype", "float32", volumes=(f"{TARGET}:/models/tiny-code-target:ro",),
    )  # fmt: skip
    expected = tp1_greedy("def fibonacci(n):", 8)
    try:
        _wait(rt, name, lambda: _get(f"{base}/ready", 2) is not None, 120, "Ready")
        metrics = _get(f"{base}/metrics")
        assert metrics is not None and _metric(metrics, "kvscale_forward_compiled") == 0.0  # eager at Ready
        before = _complete(base, "def fibonacci(n):")
        assert before["choices"][0]["text"] == expected and before["usage"]["completion_tokens"] == 8
        # The build behind: ~50-70 s on 2 idle cores (docs/benchmarks.md, "Cold start").
        metrics = _wait(
            rt, name,
            lambda: (m := _get(f"{base}/metrics")) and _metric(m, "kvscale_forward_compiled") == 1.0 and m,
            420, "the switch to the compiled forward",
        )  # fmt: skip
        assert _metric(metrics, "kvscale_forward_compile_seconds") > 0
        assert _metric(metrics, "kvscale_engine_step_seconds_count", forward="eager") > 0
        after = _complete(base, "def fibonacci(n):")
        assert after["choices"][0]["text"] == expected
        metrics = _get(f"{base}/metrics")
        assert _metric(metrics, "kvscale_engine_step_seconds_count", forward="compiled") > 0

        result = rt.docker("exec", name, "python", "-c", IDENTITY, capture=True)
        assert result.stdout.split("\n")[:2] == ["1000 1000", "rootfs Read-only file system"], result
        listed = rt.docker("exec", name, "ls", "/tmp/.cache/kvscale/compiled", capture=True).stdout.split()
        assert len([f for f in listed if not f.startswith(".")]) == 1, listed  # the package, on /tmp
        config = json.loads(rt.docker("inspect", name, capture=True).stdout)[0]
        assert config["HostConfig"]["ReadonlyRootfs"] is True and config["Config"]["User"] == "1000:1000"
    finally:
        lines = _stop(rt, name)
    (ready,) = [line for line in lines if line["msg"] == "ready"]
    assert ready["compile_s"] is None, ready  # Ready on the eager forward
    messages = [line["msg"] for line in lines]
    assert any(
        m.startswith("serving with the eager forward while the compiled one is built") for m in messages
    )
    assert any(m.startswith("compiled the forward in") for m in messages), messages
    assert not any("could not be built" in m for m in messages), messages
    assert not any(m.startswith("eager forward:") for m in messages), messages


def test_worker_image_ships_the_built_in_models_compiled_forward(images):
    """The Dockerfile's compile step (KVSCALE_SHIP_COMPILED=1): `serve` without --model (the
    built-in tiny model, made at start) loads the package the image ships in
    /opt/kvscale/share/kvscale/compiled before Ready and builds nothing."""
    rt, built = images
    image, port = built.images["worker"], _free_port()
    base = f"http://127.0.0.1:{port}"
    name = _run_worker(rt, image, port, "--served-model-name", "tiny")
    try:
        _wait(rt, name, lambda: _get(f"{base}/ready", 2) is not None, 120, "Ready")
        metrics = _get(f"{base}/metrics")
        assert metrics is not None and _metric(metrics, "kvscale_forward_compiled") == 1.0
        answer = _complete(base, "def add(a, b):")
        assert answer["usage"]["completion_tokens"] == 8
        metrics = _get(f"{base}/metrics")
        assert _metric(metrics, "kvscale_engine_step_seconds_count", forward="compiled") > 0
        assert _metric(metrics, "kvscale_engine_step_seconds_count", forward="eager") == 0
    finally:
        lines = _stop(rt, name)
    (ready,) = [line for line in lines if line["msg"] == "ready"]
    assert isinstance(ready["compile_s"], float), ready  # a package loaded before Ready
    messages = [line["msg"] for line in lines]
    loaded = [m for m in messages if m.startswith("loaded the compiled forward from")]
    assert loaded and "/opt/kvscale/share/kvscale/compiled/" in loaded[0], messages
    assert not any(m.startswith("serving with the eager forward") for m in messages), messages


def test_worker_image_on_a_noexec_tmp_says_why_it_runs_eagerly(images):
    """docker's default --tmpfs (noexec) could not load what inductor builds: the worker says so and
    runs eagerly, deciding before it spends a minute compiling."""
    rt, built = images
    image = built.images["worker"]
    check = (
        "import torch; from kvscale.worker.model.compilation import compile_decision;"
        "print(compile_decision(torch.device('cpu'), False, False))"
    )
    noexec = [a.replace(",exec", "") for a in LOCKED_DOWN]
    result = rt.docker(
        "run", "--rm", "--network=none", *noexec, "--entrypoint", "python", image, "-c", check, capture=True
    )
    assert "/tmp/torchinductor is on a noexec mount" in result.stdout, result


def test_router_image_starts_without_torch_and_answers_its_probes(images):
    """The router image (the operator's environment, its own entrypoint) as a Deployment would run
    it: a static endpoint where nothing listens, so /ready is 200 and a completion gets a 503 in
    OpenAI's shape with Retry-After (connection refused: no worker could be reached)."""
    rt, built = images
    image, port = built.images["router"], _free_port()
    check = (
        "import importlib, pkgutil, sys, kvscale.router as r\n"
        "mods = [m.name for m in pkgutil.walk_packages(r.__path__, 'kvscale.router.')]\n"
        "[importlib.import_module(m) for m in mods]\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = rt.docker(
        "run", "--rm", "--network=none", *LOCKED_DOWN, "--entrypoint", "python", image, "-c", check,
        capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    name = f"kvscale-router-test-{port}"
    result = rt.docker(
        "run", "--detach", "--name", name, "--network=host", *LOCKED_DOWN,
        image, "--endpoints", f"http://127.0.0.1:{_free_port()}", "--host", "127.0.0.1", "--port", str(port),
        "--queue-timeout", "1",
        capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, rt.docker("logs", name, capture=True).stderr
            time.sleep(0.3)
        body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 8}
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"]
        assert json.loads(refused.value.read())["error"]["code"] == "no_endpoint"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as r:
            assert 'kvscale_router_requests_total{model="tiny"} 1.0' in r.read().decode()
    finally:
        stop = rt.docker("stop", "--time", "30", name, capture=True)
        logs = rt.docker("logs", name, capture=True)
        rt.docker("rm", "--force", name, capture=True)
    assert stop.returncode == 0
    assert "Traceback" not in logs.stderr, logs.stderr[-3000:]
