"""Fixtures for tests against a real Kubernetes API server.

By default the session starts the local control plane (e2e/cluster.py) and the node stand-in
(e2e/node.py). With KVSCALE_E2E_KUBECONFIG set, the same tests run against that cluster instead
(kind, see e2e/kind/), where real kubelets run the pods.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster import BIN, ControlPlane, kubectl
from kubernetes import client, config


@dataclass
class Cluster:
    kubeconfig: Path
    api: client.ApiClient
    local: bool  # our control plane and node stand-in (False: an external cluster)
    state_dir: Path | None = None  # local only: logs, the audit log, each pod's output under pods/

    def kubectl(self, *args: str, input: str | None = None, check: bool = True):
        return kubectl(self.kubeconfig, *args, input=input, check=check)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    external = os.environ.get("KVSCALE_E2E_KUBECONFIG")
    if external:
        yield Cluster(Path(external), config.new_client_from_config(external), local=False)
        return
    if shutil.which("go") is None and not (BIN / "kvscale-controlplane").is_file():
        pytest.skip("needs Go to build the local control plane (or KVSCALE_E2E_KUBECONFIG)")
    from node import NodeAgent

    state = tmp_path_factory.mktemp("cluster")
    cp = ControlPlane.start(state)
    agent = NodeAgent(cp.kubeconfig, log_dir=state / "pods")
    agent.start()
    try:
        yield Cluster(
            cp.kubeconfig, config.new_client_from_config(str(cp.kubeconfig)), local=True, state_dir=state
        )
    finally:
        agent.stop()
        assert cp.stop() == 0, (state / "controlplane.log").read_text()[-3000:]


def pytest_collection_modifyitems(items):
    """The RBAC audit test checks that every granted verb was used, the autoscaler's included
    (e2e/test_autoscaling.py): it runs after every other test of the session."""
    last = [i for i in items if i.name == "test_operator_uses_exactly_its_rbac_and_is_never_forbidden"]
    items[:] = [i for i in items if i not in last] + last
