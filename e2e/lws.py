"""LeaderWorkerSet (kubernetes-sigs/lws) for the e2e tests: its upstream CRD and its controller,
from the Go module sigs.k8s.io/lws fetched through the Go module proxy (as e2e/controlplane's
modules are), never a hand-written copy.

    python e2e/lws.py          # fetch the module (go mod download), print the CRD's path
    python e2e/lws.py build    # and build its controller (e2e/.bin/lws-manager)

The module lands in the Go module cache (GOMODCACHE, ~/go/pkg/mod): read-only, verified against
the checksum database, shared with every later run.

The controller runs as a process beside the control plane (`controller`), with the admin
kubeconfig. Its webhooks are not optional: the pod webhook gives each group's pods their labels
(worker index, group index) and the LWS_* variables, so they are served on 127.0.0.1 (the API
server runs on this host) with a serving certificate made here, and registered with `url`
client configs instead of the in-cluster Service the upstream manifests name; the controller's
own certificate management (which writes that Service's Secret) is off.
"""

from __future__ import annotations

import base64
import contextlib
import os
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import certs
import go_module
import yaml

MODULE, VERSION = "sigs.k8s.io/lws", "v0.8.0"
CRD = "config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml"
WEBHOOKS = "config/webhook/manifests.yaml"
MANAGER_BIN = Path(__file__).resolve().parent / ".bin" / "lws-manager"
WEBHOOK_PORT, HEALTH_PORT = 19443, 18081
# Only the pods the controller makes go through its pod webhooks (the upstream kustomize patch).
POD_SELECTOR = {"matchExpressions": [{"key": "leaderworkerset.sigs.k8s.io/name", "operator": "Exists"}]}


def module_dir() -> Path:
    """Where the module's source is once fetched (it may not be yet)."""
    return go_module.module_dir(MODULE, VERSION)


def lws_crd_path() -> Path:
    return module_dir() / CRD


def fetch(timeout: float = 600) -> Path:
    """The module's folder, downloaded first where needed."""
    return go_module.fetch(MODULE, VERSION, CRD, timeout)


def build(timeout: float = 3600) -> Path:
    """e2e/.bin/lws-manager from the module (its ./cmd), unless built from this version already.
    The module cache is read-only: the build runs in a writable copy."""
    stamp = MANAGER_BIN.with_suffix(".version")
    if MANAGER_BIN.is_file() and stamp.is_file() and stamp.read_text() == VERSION:
        return MANAGER_BIN
    source = fetch()
    MANAGER_BIN.parent.mkdir(parents=True, exist_ok=True)
    with go_module.writable_copy(source) as tree:
        subprocess.run(
            ["go", "build", "-o", str(MANAGER_BIN), "./cmd"],
            cwd=tree,
            check=True,
            timeout=timeout,
            env={**os.environ, "CGO_ENABLED": "0"},
        )
    stamp.write_text(VERSION)
    return MANAGER_BIN


def webhook_configurations(ca: bytes, port: int = WEBHOOK_PORT) -> list[dict]:
    """The module's webhook configurations, served by a controller on 127.0.0.1:port."""
    docs = [d for d in yaml.safe_load_all((module_dir() / WEBHOOKS).read_text()) if d]
    for doc in docs:
        doc["metadata"] = {"name": f"lws-e2e-{doc['metadata']['name']}"}
        for hook in doc["webhooks"]:
            path = hook["clientConfig"]["service"]["path"]
            hook["clientConfig"] = {
                "url": f"https://127.0.0.1:{port}{path}",
                "caBundle": base64.b64encode(ca).decode(),
            }
            if any("pods" in r["resources"] for r in hook["rules"]):
                hook["objectSelector"] = POD_SELECTOR
    return docs


@contextlib.contextmanager
def controller(
    kubectl, kubeconfig: Path, state_dir: Path, timeout: float = 120
) -> Iterator[subprocess.Popen]:
    """The LWS controller, running with its webhooks registered, until the block ends (then the
    webhook configurations go first: a pod webhook left without its server refuses every pod)."""
    binary = build()
    ca = certs.serving_cert(state_dir / "certs", ["IP:127.0.0.1"], name="lws-e2e")
    config = {
        "apiVersion": "config.lws.x-k8s.io/v1alpha1",
        "kind": "Configuration",
        "internalCertManagement": {"enable": False},
        "leaderElection": {"leaderElect": False},
        "webhook": {"port": WEBHOOK_PORT, "host": "127.0.0.1", "certDir": str(state_dir / "certs")},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{HEALTH_PORT}"},
        "metrics": {"bindAddress": "0"},
    }
    (state_dir / "lws-config.yaml").write_text(yaml.safe_dump(config))
    log = (state_dir / "lws-manager.log").open("w")
    proc = subprocess.Popen(
        [str(binary), "--config", str(state_dir / "lws-config.yaml"), "--kubeconfig", str(kubeconfig)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    hooks = webhook_configurations(ca)
    try:
        deadline = time.monotonic() + timeout
        while True:  # ready: its webhook server and controllers are up
            if proc.poll() is not None:
                raise RuntimeError(f"lws-manager exited {proc.returncode}: {_tail(state_dir)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{HEALTH_PORT}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"lws-manager not ready in {timeout}s: {_tail(state_dir)}")
            time.sleep(1)
        kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump_all(hooks))
        yield proc
    finally:
        for doc in hooks:
            kind = doc["kind"].lower()
            kubectl("delete", kind, doc["metadata"]["name"], "--ignore-not-found", check=False)
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _tail(state_dir: Path) -> str:
    return (state_dir / "lws-manager.log").read_text()[-3000:]


if __name__ == "__main__":
    import sys

    print(build() if sys.argv[1:] == ["build"] else fetch() / CRD)
