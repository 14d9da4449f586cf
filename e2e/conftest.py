"""Fixtures for tests against a real Kubernetes API server.

By default the session starts the local control plane (e2e/cluster.py) and, as root with the
Debian packages of docs/testing.md, a real node beside it (e2e/realnode.py) running the images
built from the Dockerfile (e2e/images.py). With KVSCALE_E2E_KUBECONFIG set, the same tests run
against that cluster instead (kind, see e2e/kind/).
"""

from __future__ import annotations

import os
import shutil
import signal
from dataclasses import dataclass
from pathlib import Path

import pytest
import runtime
from cluster import BIN, ControlPlane, ensure_built, kubectl
from kubernetes import client, config

# As in tests/conftest.py: engines made here (a TP=1 reference) run eagerly, not compiling for tens
# of seconds. Pods get the same through test_operator.example (e2e/test_worker_compile.py and
# e2e/test_images.py run the image's default, the compiled forward).
os.environ.setdefault("KVSCALE_ENFORCE_EAGER", "1")


# e2e/test_ipv6_node.py needs a session whose real node is IPv6-first (KVSCALE_E2E_IPV6_FIRST=1;
# .ci/run runs it in a session of its own after the main one): elsewhere it is not collected.
collect_ignore = [] if os.environ.get("KVSCALE_E2E_IPV6_FIRST") == "1" else ["test_ipv6_node.py"]


@dataclass
class Cluster:
    kubeconfig: Path
    api: client.ApiClient
    local: bool  # our control plane (False: an external cluster)
    state_dir: Path | None = None  # local only: the control plane's logs and audit log
    node: object | None = None  # local only: the real node (realnode.RealNode) the pods run on
    images: object | None = None  # local only: images.Built, the images the real node runs
    no_node: str | None = None  # local only: why there is no real node (its tests skip)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        return kubectl(self.kubeconfig, *args, input=input, check=check)

    def require_node(self) -> None:
        """Skip the calling test where pods cannot run: a local control plane without a node."""
        if self.local and self.node is None:
            pytest.skip(self.no_node or "no node")


@pytest.fixture(scope="session")
def cluster(request, tmp_path_factory):
    """The session's cluster. Local: the control plane on an address pods reach and a real node
    (e2e/realnode.py) where this machine can run one; elsewhere the control plane alone, and the
    tests that need pods skip with the reason. With KVSCALE_E2E_KUBECONFIG: that cluster (kind)."""
    external = os.environ.get("KVSCALE_E2E_KUBECONFIG")
    if external:
        yield Cluster(Path(external), config.new_client_from_config(external), local=False)
        return
    if shutil.which("go") is None and not (BIN / "kvscale-controlplane").is_file():
        pytest.skip("needs Go to build the local control plane (or KVSCALE_E2E_KUBECONFIG)")
    reason = runtime.unavailable()
    if reason is None:
        yield request.getfixturevalue("node_cluster")
        return
    state = tmp_path_factory.mktemp("cluster")
    cp = ControlPlane.start(state)
    try:
        yield Cluster(
            cp.kubeconfig,
            config.new_client_from_config(str(cp.kubeconfig)),
            local=True,
            state_dir=state,
            no_node=reason,
        )
    finally:
        assert cp.stop() == 0, (state / "controlplane.log").read_text()[-3000:]


def pytest_collection_modifyitems(items):
    """The RBAC audit test checks that every granted verb was used, the autoscaler's included
    (e2e/test_autoscaling.py): it runs after every other test of the session."""
    last = [i for i in items if i.name == "test_operator_uses_exactly_its_rbac_and_is_never_forbidden"]
    items[:] = [i for i in items if i not in last] + last


@pytest.fixture(scope="session")
def runtimes(tmp_path_factory):
    """Our containerd and dockerd (e2e/runtime.py), torn down with everything in the ledger at the
    end of the session, also on failure, Ctrl-C or SIGTERM; a ledger a killed run left behind is
    torn down first."""
    reason = runtime.unavailable()
    if reason:
        pytest.skip(reason)
    ledger = runtime.Ledger(runtime.RUN_DIR / "ledger.json")
    ledger.teardown()  # whatever a killed run left
    previous = signal.getsignal(signal.SIGTERM)

    def interrupted(*_):
        raise KeyboardInterrupt("SIGTERM")

    signal.signal(signal.SIGTERM, interrupted)
    try:
        rt = runtime.Runtimes(ledger, tmp_path_factory.mktemp("runtimes")).start()
        yield rt
    finally:
        ledger.teardown()
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def images(runtimes):
    """Both images built from the Dockerfile on the local base, and the pause image; (runtimes,
    images.Built)."""
    import images as images_module

    ensure_built()
    return runtimes, images_module.build(runtimes)


@pytest.fixture(scope="session")
def node_cluster(images, tmp_path_factory):
    """The control plane reachable from pods and a real node (e2e/realnode.py): containerd,
    kubelet, kube-proxy, kube-scheduler, the CNI bridge, the images imported. Torn down at the
    end of the session; the teardown fails the session if it left anything behind."""
    from realnode import real_cluster

    runtimes, built = images
    state = tmp_path_factory.mktemp("node-cluster")
    with real_cluster(state, runtimes, built) as (cp, node):
        yield Cluster(
            cp.kubeconfig,
            config.new_client_from_config(str(cp.kubeconfig)),
            local=True,
            state_dir=cp.state_dir,
            node=node,
            images=built,
        )
    from realnode import leftovers

    left = leftovers()
    assert not left, f"the real node's teardown left: {left}"
