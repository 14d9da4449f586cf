"""The NetworkPolicy engine of the real node (e2e/kube_router.py): kube-router with its policy
controller alone. That it enforces the operator's policies is e2e/test_network_policy.py's."""

from __future__ import annotations

import subprocess

import kube_router
import pytest


def test_only_the_policy_controller_runs_and_the_families_follow_the_service_ranges():
    args = kube_router.argv(kube_router.BIN, "/k", "node", ["198.19.0.0/24"])
    assert {"--run-firewall=true", "--run-router=false", "--run-service-proxy=false"} <= set(args)
    assert {"--enable-ipv4=true", "--enable-ipv6=false", "--enable-cni=false"} <= set(args)
    dual = kube_router.argv(kube_router.BIN, "/k", "node", ["fd9f:ecff:2a08:1::/112", "198.19.0.0/24"])
    assert {"--enable-ipv4=true", "--enable-ipv6=true"} <= set(dual)
    assert "--service-cluster-ip-range=fd9f:ecff:2a08:1::/112,198.19.0.0/24" in dual


@pytest.mark.skipif(not kube_router.BIN.is_file(), reason="not built: python e2e/kube_router.py build")
def test_the_built_binary_is_the_pinned_version():
    out = subprocess.run([str(kube_router.BIN), "--version"], capture_output=True, text=True, check=True)
    assert kube_router.VERSION in out.stdout + out.stderr
