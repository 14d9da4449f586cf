"""Cluster DNS for the local real node: CoreDNS, built from its Go module github.com/coredns/coredns
(fetched through the Go module proxy, as e2e/lws.py fetches the LWS controller), run as a host
process of the node.

    python e2e/coredns.py          # fetch the module (go mod download), print its folder
    python e2e/coredns.py build    # and build it (e2e/.bin/coredns)

The build keeps only the plugins the node's Corefile uses (CoreDNS's own way to trim itself:
plugin.cfg, then `go generate`): the cloud back ends' SDKs (route53, azure, clouddns) would
triple the build for nothing here.

It serves, on the node's bridge address (where pods reach the host), `cluster.local` from the API
server (the harness's kubeconfig): Services, pods (`pods insecure`, the A-B-C-D.NS.pod names) and
the hostname.subdomain records of headless Services (a LeaderWorkerSet's `NAME-0.NAME.NS`), and
forwards every other name to the host's resolver. A selector-less `kube-dns` Service in
kube-system, its EndpointSlice pointing at that address, is what pods' resolv.conf names
(the kubelet's clusterDNS), as on a real cluster.
"""

from __future__ import annotations

import os
import subprocess
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import go_module
from runtime import Ledger, spawn, wait_until

MODULE, VERSION = "github.com/coredns/coredns", "v1.15.0"
BIN = Path(__file__).resolve().parent / ".bin" / "coredns"
# In plugin.cfg's order, which is the order a query goes through them: what the Corefile uses.
PLUGINS = ("bind", "ready", "health", "errors", "log", "cache", "kubernetes", "forward")
CLUSTER_DOMAIN = "cluster.local"
HEALTH_PORT, READY_PORT = 18053, 18054  # on 127.0.0.1
SERVICE_NAME, SERVICE_NAMESPACE = "kube-dns", "kube-system"  # the names kubeadm and kind use


def module_dir() -> Path:
    return go_module.module_dir(MODULE, VERSION)


def fetch(timeout: float = 600) -> Path:
    """The module's folder, downloaded first where needed."""
    return go_module.fetch(MODULE, VERSION, "plugin.cfg", timeout)


def trimmed_plugin_cfg(text: str, keep: tuple[str, ...] = PLUGINS) -> str:
    """plugin.cfg with only the plugins in `keep`, in the file's own order (the query order)."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    kept = [ln for ln in lines if ln.split(":", 1)[0] in keep]
    missing = set(keep) - {ln.split(":", 1)[0] for ln in kept}
    if missing:
        raise ValueError(f"plugin.cfg of {VERSION} has no {sorted(missing)}")
    return "\n".join(kept) + "\n"


def build(timeout: float = 3600) -> Path:
    """e2e/.bin/coredns from the module with the trimmed plugin set, unless built already from
    this version and set. The module cache is read-only: the build runs in a writable copy."""
    stamp = BIN.with_suffix(".version")
    wanted = f"{VERSION} {','.join(PLUGINS)}"
    if BIN.is_file() and stamp.is_file() and stamp.read_text() == wanted:
        return BIN
    source = fetch()
    BIN.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0"}
    with go_module.writable_copy(source) as tree:
        cfg = tree / "plugin.cfg"
        cfg.write_text(trimmed_plugin_cfg(cfg.read_text()))
        # directives_generate.go rewrites core/plugin/zplugin.go and core/dnsserver/zdirectives.go
        subprocess.run(["go", "generate", "coredns.go"], cwd=tree, check=True, timeout=timeout, env=env)
        subprocess.run(["go", "build", "-o", str(BIN), "."], cwd=tree, check=True, timeout=timeout, env=env)
    stamp.write_text(wanted)
    return BIN


def _listens(listen: str | Sequence[str]) -> list[str]:
    return [listen] if isinstance(listen, str) else list(listen)


def corefile(listen: str | Sequence[str], kubeconfig: Path, upstream: str = "/etc/resolv.conf") -> str:
    """The node's Corefile: cluster.local (and reverse lookups of our ranges) from the API server,
    everything else forwarded to the host's resolver; on each address of `listen`."""
    return f"""\
.:53 {{
    bind {" ".join(_listens(listen))}
    errors
    log . "{{remote}} {{type}} {{name}} {{rcode}}"
    health 127.0.0.1:{HEALTH_PORT}
    ready 127.0.0.1:{READY_PORT}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    forward . {upstream}
    cache 5
}}
"""


def service_manifests(dns_ip: str | Sequence[str], listen: str | Sequence[str]) -> list[dict]:
    """The `kube-dns` Service on dns_ip (what pods' resolv.conf names) and, the Service having no
    selector (CoreDNS is a host process, not a pod), its EndpointSlice: listen:53, UDP and TCP.
    With an address of each family (the primary first), a dual-stack Service and a slice per
    family (a slice holds one family)."""
    ports = [("dns", "UDP"), ("dns-tcp", "TCP")]
    labels = {"k8s-app": SERVICE_NAME, "kubernetes.io/name": "CoreDNS"}
    ips, listens = _listens(dns_ip), _listens(listen)
    spec: dict = {
        "clusterIP": ips[0],
        "ports": [{"name": n, "protocol": p, "port": 53, "targetPort": 53} for n, p in ports],
    }
    if len(ips) > 1:
        spec["clusterIPs"] = ips
        spec["ipFamilyPolicy"] = "RequireDualStack"
        spec["ipFamilies"] = ["IPv6" if ":" in ip else "IPv4" for ip in ips]
    slices = []
    for address in listens:
        family = "IPv6" if ":" in address else "IPv4"
        slices.append(
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": f"{SERVICE_NAME}-host" + ("-ipv6" if family == "IPv6" else ""),
                    "namespace": SERVICE_NAMESPACE,
                    "labels": {
                        "kubernetes.io/service-name": SERVICE_NAME,
                        "endpointslice.kubernetes.io/managed-by": "kvscale-e2e",
                    },
                },
                "addressType": family,
                "endpoints": [{"addresses": [address], "conditions": {"ready": True}}],
                "ports": [{"name": n, "protocol": p, "port": 53} for n, p in ports],
            }
        )
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE_NAME, "namespace": SERVICE_NAMESPACE, "labels": labels},
        "spec": spec,
    }
    return [service, *slices]


def start(
    ledger: Ledger,
    kubeconfig: Path,
    listen: str | Sequence[str],
    state: Path,
    log_dir: Path,
    timeout: float = 60,
):
    """CoreDNS on listen:53, each address of it (a process in the ledger), once its kubernetes
    plugin has synced with the API server (`ready`): a pod started after this resolves from its
    first query."""
    binary = build()
    state.mkdir(parents=True, exist_ok=True)
    (state / "Corefile").write_text(corefile(listen, kubeconfig))
    proc = spawn(ledger, "coredns", [str(binary), "-conf", str(state / "Corefile")], log_dir)

    def ready() -> bool:
        with urllib.request.urlopen(f"http://127.0.0.1:{READY_PORT}/ready", timeout=2) as r:
            return r.status == 200

    wait_until(ready, timeout, f"CoreDNS to be ready (see {log_dir / 'coredns.log'})", proc)
    return proc


def running() -> list[int]:
    """PIDs of processes running our CoreDNS binary (a teardown leaves none)."""
    found = []
    for exe in Path("/proc").glob("[0-9]*/exe"):
        try:
            if os.readlink(exe) == str(BIN):
                found.append(int(exe.parent.name))
        except OSError:
            continue
    return found


if __name__ == "__main__":
    import sys

    print(build() if sys.argv[1:] == ["build"] else fetch())
