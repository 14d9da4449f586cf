"""The Dockerfile, built for real: its images from a locally made base, each started as a user
would run it (uid 1000, read-only root filesystem, a tmpfs /tmp). The operator image imports every
module the operator loads and starts; the worker image serves completions on the fixture model."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from model_fixtures import TARGET
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


def test_worker_image_compiles_its_forward_and_serves_completions_on_the_fixture_model(images):
    """The image's default on CPU: g++ is there, so the worker turns Ready on its eager forward,
    builds the compiled one behind it (no package ships for the fixture model's shape) and switches
    to it; it answers with the eager reference's tokens on the compiled forward."""
    if not TARGET.is_dir():
        pytest.skip(f"{TARGET} is missing")
    rt, built = images
    image, port = built.images["worker"], _free_port()
    name = f"kvscale-worker-test-{port}"
    result = rt.docker(
        "run", "--detach", "--name", name, "--network=host", *LOCKED_DOWN,
        "--volume", f"{TARGET}:/models/tiny-code-target:ro",
        image, "serve", "--model", "/models/tiny-code-target", "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--num-kv-blocks", "256",
        capture=True,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300  # a cold compile took ~55 s on 2 idle cores
        while True:
            try:
                with urllib.request.urlopen(f"{base}/ready", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            state = rt.docker("inspect", "--format", "{{.State.Running}}", name, capture=True).stdout.strip()
            assert state == "true" and time.monotonic() < deadline, rt.docker(
                "logs", name, capture=True
            ).stderr
            time.sleep(0.5)
        # Ready on the eager forward; the build behind (a minute or two at 2 cores) then switches.
        deadline = time.monotonic() + 420
        while "compiled the forward in" not in (logs := rt.docker("logs", name, capture=True).stderr):
            assert "could not be built" not in logs and time.monotonic() < deadline, logs[-3000:]
            time.sleep(2)
        body = {"model": "tiny", "prompt": "def fibonacci(n):", "max_tokens": 8, "temperature": 0}
        request = urllib.request.Request(
            f"{base}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as r:
            answer = json.loads(r.read())
        assert answer["usage"]["completion_tokens"] == 8
        assert answer["choices"][0]["text"] == tp1_greedy("def fibonacci(n):", 8)

        result = rt.docker("exec", name, "python", "-c", IDENTITY, capture=True)
        assert result.stdout.split("\n")[:2] == ["1000 1000", "rootfs Read-only file system"], result
        config = json.loads(rt.docker("inspect", name, capture=True).stdout)[0]
        assert config["HostConfig"]["ReadonlyRootfs"] is True and config["Config"]["User"] == "1000:1000"
    finally:
        stop = rt.docker("stop", "--time", "30", name, capture=True)
        logs = rt.docker("logs", name, capture=True)
        rt.docker("rm", "--force", name, capture=True)
    assert stop.returncode == 0
    assert "Traceback" not in logs.stderr, logs.stderr[-3000:]
    (ready,) = [json.loads(line) for line in logs.stderr.splitlines() if '"msg": "ready"' in line]
    assert ready["compile_s"] is None, ready  # nothing loaded before Ready: built behind
    assert "while the compiled one is built" in logs.stderr and '"msg": "eager forward:' not in logs.stderr

    # docker's default --tmpfs (noexec) could not load what inductor builds: the worker says so and
    # runs eagerly, deciding before it spends a minute compiling.
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
