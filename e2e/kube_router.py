"""A NetworkPolicy engine for the real node: kube-router's network-policy controller, built from
its Go module github.com/cloudnativelabs/kube-router/v2 (fetched through the Go module proxy, as
e2e/coredns.py fetches CoreDNS), run as a host process of the node with its routing (BGP) and
service proxy controllers off: kube-proxy stays the service proxy, the CNI bridge the network.

    python e2e/kube_router.py          # fetch the module (go mod download), print its folder
    python e2e/kube_router.py build    # and build it (e2e/.bin/kube-router)

Why this engine (docs/operator.md#networkpolicies): it enforces with iptables (filter table,
FORWARD/INPUT/OUTPUT, physdev for bridged pod traffic) and ipset (hash:ip, hash:net), all of
which this kernel has. sigs.k8s.io/kube-network-policies (v0.8.0) sends packets to user space
through nftables' `queue` expression, which this kernel lacks (CONFIG_NFT_QUEUE: `nft add rule
... queue num 100` fails with ENOENT here), so it cannot enforce on these machines.

v2.1.0 is the newest version the module proxy serves here, and security reports are filed
against it; it is a test-only enforcer on a node whose addresses exist only on this machine,
never shipped in an image or manifest.

Cleanup is ours: `kube-router --cleanup-config` in v2.1.0 runs the policy controller's Cleanup on
an empty controller, which removes nothing. The ledger drops its chains (KUBE-ROUTER-*,
KUBE-NWPLCY-*, KUBE-POD-FW-*, and the jumps to them) and its ipsets (KUBE-SRC-*, KUBE-DST-*).
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from pathlib import Path

import go_module
from runtime import Ledger, spawn, wait_until

MODULE, VERSION = "github.com/cloudnativelabs/kube-router/v2", "v2.1.0"
BIN = Path(__file__).resolve().parent / ".bin" / "kube-router"
HEALTH_PORT = 20244  # its default; it listens on every address of the host
CHAINS = ("KUBE-ROUTER-", "KUBE-NWPLCY-", "KUBE-POD-FW-")
IPSETS = ("KUBE-SRC-", "KUBE-DST-", "TMP-", "inet6:KUBE-SRC-", "inet6:KUBE-DST-", "inet6:TMP-")


def fetch(timeout: float = 600) -> Path:
    """The module's folder, downloaded first where needed."""
    return go_module.fetch(MODULE, VERSION, "cmd/kube-router/kube-router.go", timeout)


def build(timeout: float = 3600) -> Path:
    """e2e/.bin/kube-router from the module's cmd/kube-router, unless built from this version
    already (the version stamp beside it). The module cache is read-only: the build runs in a
    writable copy."""
    stamp = BIN.with_suffix(".version")
    if BIN.is_file() and stamp.is_file() and stamp.read_text() == VERSION:
        return BIN
    source = fetch()
    BIN.parent.mkdir(parents=True, exist_ok=True)
    version = f"-X {MODULE}/pkg/version.Version={VERSION}"
    with go_module.writable_copy(source) as tree:
        subprocess.run(
            ["go", "build", "-ldflags", version, "-o", str(BIN), "./cmd/kube-router"],
            cwd=tree,
            check=True,
            timeout=timeout,
            env={**os.environ, "CGO_ENABLED": "0"},
        )
    stamp.write_text(VERSION)
    return BIN


def argv(binary: Path, kubeconfig: Path, node_name: str, service_cidrs: list[str]) -> list[str]:
    """The policy controller alone: no BGP routing, no service proxy (kube-proxy is the node's),
    no CNI config of its own, no metrics; IPv6 rules too when a Service range is IPv6."""
    ipv6 = any(":" in c for c in service_cidrs)
    ipv4 = any(":" not in c for c in service_cidrs)
    return [
        str(binary),
        f"--kubeconfig={kubeconfig}",
        f"--hostname-override={node_name}",
        "--run-firewall=true",
        "--run-router=false",
        "--run-service-proxy=false",
        "--run-loadbalancer=false",
        "--enable-cni=false",
        f"--enable-ipv4={str(ipv4).lower()}",
        f"--enable-ipv6={str(ipv6).lower()}",
        f"--service-cluster-ip-range={','.join(service_cidrs)}",
        f"--health-port={HEALTH_PORT}",
        "--metrics-port=0",
    ]


def iptables_chains(binary: str = "iptables") -> dict[str, list[str]]:
    rules = subprocess.run([binary, "-t", "filter", "-S"], capture_output=True, text=True).stdout
    return {"filter": [line.split()[1] for line in rules.splitlines() if line.startswith("-N ")]}


def start(
    ledger: Ledger,
    kubeconfig: Path,
    node_name: str,
    service_cidrs: list[str],
    log_dir: Path,
    timeout: float = 60,
) -> subprocess.Popen:
    """kube-router's policy controller (a process in the ledger, with its chains and ipsets to
    drop after it stops), once its health check answers: its informers have synced and the
    controller has run its first full sync."""
    binary = build()
    families = ["iptables"] + (["ip6tables"] if any(":" in c for c in service_cidrs) else [])
    # Undone in reverse: the process, then its rules, then the sets they referenced (a set in use
    # cannot be destroyed).
    ledger.add(kind="ipset", prefixes=list(IPSETS), before=ipsets())
    for tool in families:
        ledger.add(kind="iptables", binary=tool, prefixes=list(CHAINS), before=iptables_chains(tool))
    proc = spawn(ledger, "kube-router", argv(binary, kubeconfig, node_name, service_cidrs), log_dir)

    def healthy() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{HEALTH_PORT}/healthz", timeout=2) as r:
            return r.status == 200

    wait_until(healthy, timeout, f"kube-router to be healthy (see {log_dir / 'kube-router.log'})", proc)
    return proc


def ipsets() -> list[str]:
    out = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True)
    return out.stdout.split() if out.returncode == 0 else []


def leftovers() -> list[str]:
    """Its chains and ipsets still there (a teardown leaves none)."""
    left = [f"iptables chain {c}" for c in iptables_chains()["filter"] if c.startswith(CHAINS)]
    left += [f"ipset {s}" for s in ipsets() if s.startswith(IPSETS)]
    return left


if __name__ == "__main__":
    import sys

    print(build() if sys.argv[1:] == ["build"] else fetch())
