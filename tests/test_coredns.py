"""The local node's CoreDNS (e2e/coredns.py): the trimmed plugin set, its Corefile and the kube-dns
Service. The binary is checked where it is built (`python e2e/coredns.py build`; .ci/run does);
that it resolves the cluster's names is e2e/test_parallelism.py's (a follower resolving its
leader) on the real node."""

from __future__ import annotations

import subprocess

import coredns
import pytest

CFG = coredns.module_dir() / "plugin.cfg"


@pytest.mark.skipif(not CFG.is_file(), reason="no copy of CoreDNS: python e2e/coredns.py fetches one")
def test_the_trimmed_plugin_cfg_keeps_the_modules_order():
    full = CFG.read_text()
    trimmed = coredns.trimmed_plugin_cfg(full).splitlines()
    assert [line.split(":")[0] for line in trimmed] == list(coredns.PLUGINS)
    assert all(line in full.splitlines() for line in trimmed)  # the module's own lines, verbatim
    with pytest.raises(ValueError, match="no-such-plugin"):
        coredns.trimmed_plugin_cfg(full, ("kubernetes", "no-such-plugin"))


def test_the_corefile_names_only_built_plugins():
    text = coredns.corefile("198.18.0.1", "/run/k/kubeconfig")
    assert "bind 198.18.0.1" in text and "kubeconfig /run/k/kubeconfig" in text
    assert "pods insecure" in text and "forward . /etc/resolv.conf" in text
    # The server block's directives (indented once; the kubernetes block's options twice).
    directives = {ln.split()[0] for ln in text.splitlines() if ln.startswith("    ") and ln[4] != " "}
    directives -= {"}"}
    assert directives == set(coredns.PLUGINS)


def test_the_kube_dns_service_points_at_the_host():
    svc, slice_ = coredns.service_manifests("198.19.0.10", "198.18.0.1")
    assert svc["metadata"] == {
        "name": "kube-dns",
        "namespace": "kube-system",
        "labels": {"k8s-app": "kube-dns", "kubernetes.io/name": "CoreDNS"},
    }
    assert "selector" not in svc["spec"] and svc["spec"]["clusterIP"] == "198.19.0.10"
    assert slice_["metadata"]["labels"]["kubernetes.io/service-name"] == "kube-dns"
    assert slice_["endpoints"] == [{"addresses": ["198.18.0.1"], "conditions": {"ready": True}}]
    assert (
        {(p["name"], p["protocol"]) for p in svc["spec"]["ports"]}
        == {(p["name"], p["protocol"]) for p in slice_["ports"]}
        == {("dns", "UDP"), ("dns-tcp", "TCP")}
    )


@pytest.mark.skipif(not coredns.BIN.is_file(), reason="CoreDNS not built: python e2e/coredns.py build")
def test_the_built_binary_has_the_trimmed_plugins_only():
    out = subprocess.run([str(coredns.BIN), "-plugins"], capture_output=True, text=True, check=True)
    plugins = set(out.stdout.split())
    assert set(coredns.PLUGINS) <= plugins
    # What they import registers itself too (forward: dnstap, metadata; cache: prometheus), but
    # none of the cloud back ends whose SDKs the trimming leaves out.
    assert plugins - set(coredns.PLUGINS) <= {"debug", "dnstap", "metadata", "prometheus", "transfer"}
    assert not {"route53", "azure", "clouddns", "etcd"} & plugins


def test_on_a_dual_stack_node_the_service_and_its_slices_have_both_families():
    svc, v6, v4 = coredns.service_manifests(
        ["fd9f:ecff:2a08:1::a", "198.19.0.10"], ["fd9f:ecff:2a08::1", "198.18.0.1"]
    )
    assert svc["spec"]["clusterIPs"] == ["fd9f:ecff:2a08:1::a", "198.19.0.10"]
    assert (
        svc["spec"]["ipFamilies"] == ["IPv6", "IPv4"] and svc["spec"]["ipFamilyPolicy"] == "RequireDualStack"
    )
    assert (v6["addressType"], v6["endpoints"][0]["addresses"]) == ("IPv6", ["fd9f:ecff:2a08::1"])
    assert (v4["addressType"], v4["endpoints"][0]["addresses"]) == ("IPv4", ["198.18.0.1"])
    assert v6["metadata"]["name"] != v4["metadata"]["name"]
    assert "bind fd9f:ecff:2a08::1 198.18.0.1\n" in coredns.corefile(
        ["fd9f:ecff:2a08::1", "198.18.0.1"], "/k"
    )
