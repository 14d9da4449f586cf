"""A real node beside the local control plane: containerd (CRI), kubelet, kube-proxy and
kube-scheduler, with the CNI bridge, all built from the control plane's module set.

Addresses exist only inside this machine (198.18.0.0/15 is reserved for benchmarking and
routed nowhere): the pods live on the bridge kvscale0 (POD_CIDR, its gateway NODE_IP is the
host's side and also where the API server and the kubelet listen), Services get ClusterIPs in
SERVICE_CIDR, routed onto that same bridge, so a packet kube-proxy did not rewrite never leaves
the machine. Pods have no egress: no default route (only the Service range, via the host), no
masquerading. `start` refuses to run when the machine already routes either range.

Cluster DNS is CoreDNS (e2e/coredns.py), a host process like the others, on NODE_IP:53, behind
the `kube-system/kube-dns` Service at DNS_IP (the kubelet's clusterDNS): pods resolve Services,
pods and the hostname.subdomain names of headless Services (a LeaderWorkerSet leader's address),
and the host's resolver answers the rest (pods still have no egress to use it with).

IPv6 (KVSCALE_E2E_IPV6_FIRST=1): the node is dual-stack with IPv6 as its primary family, as an
IPv6-first cluster is: the bridge also carries NODE_IP6 of POD_CIDR6, pods get an address of
each family (the IPv6 one first: `status.podIP`), the API server binds and advertises NODE_IP6
and the Service ranges are SERVICE_CIDR6 then SERVICE_CIDR (a Service that names no family gets
an IPv6 ClusterIP, its EndpointSlices IPv6 addresses), kube-proxy programs ip6tables too and
CoreDNS answers on both. The IPv6 ranges are a ULA /48 chosen at random (RFC 4193), on our
bridge only, routed nowhere else (the machine's own fd00::/64 is not in it).

Everything created goes into the ledger (e2e/runtime.py) and `RealNode.stop` / `Ledger.teardown`
removes it: the pods first (their shims outlive containerd), then the processes by PID in reverse
order, `kube-proxy --cleanup`, the iptables chains the CNI plugins made, the bridge and route,
the kubelet's mounts and root, and the sysctls put back.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import coredns
import images
from cluster import Binaries, ControlPlane, ensure_built, kubectl
from runtime import ROOT_DIR, RUN_DIR, Ledger, Runtimes, spawn, wait_until

NODE_NAME = "kvscale-node"
POD_CIDR = "198.18.0.0/24"
NODE_IP = "198.18.0.1"  # the bridge's address on the host
SERVICE_CIDR = "198.19.0.0/24"
DNS_IP = "198.19.0.10"  # the kube-dns Service: CoreDNS on the host, at NODE_IP:53 (e2e/coredns.py)
BRIDGE = "kvscale0"
# The IPv6 side (KVSCALE_E2E_IPV6_FIRST=1): a ULA /48 of our own (random global ID fd9f:ecff:2a08).
ULA = "fd9f:ecff:2a08::/48"
POD_CIDR6 = "fd9f:ecff:2a08::/64"
NODE_IP6 = "fd9f:ecff:2a08::1"
SERVICE_CIDR6 = "fd9f:ecff:2a08:1::/112"
DNS_IP6 = "fd9f:ecff:2a08:1::a"
IPV6_FIRST = os.environ.get("KVSCALE_E2E_IPV6_FIRST") == "1"
SYSCTLS = {"net/ipv4/ip_forward": "1", "net/bridge/bridge-nf-call-iptables": "1"}
# IPv6 forwarding: pod -> ClusterIP -> pod is routed by the host. The CNI bridge plugin (a
# gateway of each family) turns on all.forwarding for the families it serves anyway; set here,
# it is recorded and put back at teardown. Harmless on these machines: eth0's IPv6 address and
# default route are static (accept_ra 0), and pods have no default route to leave by.
SYSCTLS6 = {"net/bridge/bridge-nf-call-ip6tables": "1", "net/ipv6/conf/all/forwarding": "1"}
IPTABLES_TABLES = ("filter", "nat", "mangle")
OUR_CHAINS = ("KUBE-", "CNI-")  # kube-proxy's and the kubelet's, the CNI firewall's and portmap's


@dataclass(frozen=True)
class Stack:
    """The node's addresses, primary family first: IPv4 alone, or IPv6-first dual-stack."""

    node_ips: tuple[str, ...]
    pod_cidrs: tuple[str, ...]
    service_cidrs: tuple[str, ...]
    dns_ips: tuple[str, ...]

    @property
    def api_address(self) -> str:  # the API server's and the kubelet's: the primary family's
        return self.node_ips[0]

    @property
    def ipv6(self) -> bool:
        return any(":" in ip for ip in self.node_ips)


IPV4 = Stack((NODE_IP,), (POD_CIDR,), (SERVICE_CIDR,), (DNS_IP,))
IPV6_FIRST_DUAL = Stack(
    (NODE_IP6, NODE_IP), (POD_CIDR6, POD_CIDR), (SERVICE_CIDR6, SERVICE_CIDR), (DNS_IP6, DNS_IP)
)


def stack() -> Stack:
    """The session's: IPv4, or IPv6-first dual-stack with KVSCALE_E2E_IPV6_FIRST=1."""
    return IPV6_FIRST_DUAL if IPV6_FIRST else IPV4


def iptables_chains(binary: str = "iptables") -> dict[str, list[str]]:
    chains = {}
    for table in IPTABLES_TABLES:
        rules = subprocess.run([binary, "-t", table, "-S"], capture_output=True, text=True).stdout
        chains[table] = [line.split()[1] for line in rules.splitlines() if line.startswith("-N ")]
    return chains


def routed_elsewhere(ipv6: bool = False) -> list[str]:
    """Routes of this machine (any table) that overlap our ranges, the default route aside."""
    routes = []
    for family in ("-4", "-6") if ipv6 else ("-4",):
        out = subprocess.run(
            ["ip", "-j", family, "route", "show", "table", "all"], capture_output=True, text=True, check=True
        )
        routes += json.loads(out.stdout or "[]")
    ours = [ipaddress.ip_network(c) for c in (POD_CIDR, SERVICE_CIDR, *((ULA,) if ipv6 else ()))]
    found = []
    for route in routes:
        dst = route.get("dst", "default")
        if dst == "default" or route.get("dev") == BRIDGE:
            continue
        try:
            net = ipaddress.ip_network(dst, strict=False)
        except ValueError:
            continue
        if net.prefixlen > 0 and any(net.version == o.version and net.overlaps(o) for o in ours):
            kind, dev, table = route.get("type", "unicast"), route.get("dev", "-"), route.get("table", "main")
            found.append(f"{dst} ({kind} dev {dev} table {table})")
    return found


def _sysctl(name: str, value: str | None = None) -> str:
    path = Path("/proc/sys") / name
    old = path.read_text().strip()
    if value is not None:
        path.write_text(value)
    return old


def _run(*argv: str) -> None:
    subprocess.run(list(argv), check=True, capture_output=True)


@dataclass
class RealNode:
    ledger: Ledger
    runtimes: Runtimes
    log_dir: Path
    startup_s: float = 0.0
    stack: Stack = IPV4

    @staticmethod
    def prepare_network(ledger: Ledger, stack: Stack = IPV4) -> None:
        """The bridge with the node's addresses (before the API server, which binds to one) and
        the Service ranges' routes onto it; refuses ranges the machine already routes."""
        clash = routed_elsewhere(stack.ipv6)
        if clash:
            raise RuntimeError(
                f"refusing to start: {', '.join(stack.pod_cidrs + stack.service_cidrs)} overlap "
                f"what this machine already routes: {clash}"
            )
        for name, value in {**SYSCTLS, **(SYSCTLS6 if stack.ipv6 else {})}.items():
            old = _sysctl(name)
            if old != value:
                ledger.add(kind="command", argv=["sysctl", "-w", f"{name.replace('/', '.')}={old}"])
                _sysctl(name, value)
        ledger.add(kind="link", name=BRIDGE)
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{NODE_IP}/{POD_CIDR.split('/')[1]}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        # The Service range goes onto our bridge, where nothing answers an address kube-proxy did
        # not rewrite: such a packet never leaves the machine. (Not an `unreachable` route: the
        # host's own connections are routed before kube-proxy's OUTPUT DNAT, so one would refuse
        # every ClusterIP connection from the host with EHOSTUNREACH.)
        ledger.add(kind="route", route=f"{SERVICE_CIDR} dev {BRIDGE}")
        _run("ip", "route", "add", SERVICE_CIDR, "dev", BRIDGE)
        if stack.ipv6:
            # nodad: the address is ours alone on a bridge we just made; no wait for DAD.
            _run("ip", "-6", "addr", "add", f"{NODE_IP6}/{POD_CIDR6.split('/')[1]}", "dev", BRIDGE, "nodad")
            _run("ip", "-6", "route", "add", SERVICE_CIDR6, "dev", BRIDGE)
        # The chains that appear from here on (kubelet, kube-proxy, CNI plugins) and the rules
        # jumping to them go at teardown, after `kube-proxy --cleanup` took its own. Both
        # families in any case: the kubelet makes its canary chains in each.
        for binary in ("iptables", "ip6tables"):
            ledger.add(
                kind="iptables", binary=binary, prefixes=list(OUR_CHAINS), before=iptables_chains(binary)
            )

    def start(self, cp: ControlPlane, binaries: Binaries, built_images: list[str], log=print) -> RealNode:
        started = time.monotonic()
        state = RUN_DIR / "node"
        state.mkdir(parents=True, exist_ok=True)
        images.import_into_containerd(self.runtimes, [images.PAUSE_IMAGE, *built_images], log)
        self._write_cni()
        kubeconfig = str(cp.kubeconfig)

        scheduler = spawn(
            self.ledger,
            "kube-scheduler",
            [str(binaries.kube_scheduler), f"--kubeconfig={kubeconfig}",
             f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
             "--leader-elect=false", "--bind-address=127.0.0.1", "--secure-port=0"],
            self.log_dir,
        )  # fmt: skip

        proxy_config = state / "kube-proxy.yaml"
        proxy_config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                    "kind": "KubeProxyConfiguration",
                    "mode": "iptables",
                    "clientConnection": {"kubeconfig": kubeconfig},
                    "hostnameOverride": NODE_NAME,
                    "clusterCIDR": ",".join(self.stack.pod_cidrs),
                    # The primary family's: kube-proxy takes it for the node's.
                    "bindAddress": self.stack.api_address,
                    "healthzBindAddress": "127.0.0.1:10256",
                    "metricsBindAddress": "127.0.0.1:10249",
                    "nodePortAddresses": [f"{ip}/{128 if ':' in ip else 32}" for ip in self.stack.node_ips],
                    # No permission to set conntrack sysctls on this VM: leave them as they are.
                    "conntrack": {
                        "maxPerCore": 0,
                        "tcpEstablishedTimeout": "0s",
                        "tcpCloseWaitTimeout": "0s",
                    },
                    "iptables": {"localhostNodePorts": False},
                }
            )
        )
        self.ledger.add(
            kind="command", argv=[str(binaries.kube_proxy), "--cleanup", f"--config={proxy_config}"]
        )
        proxy = spawn(
            self.ledger, "kube-proxy", [str(binaries.kube_proxy), f"--config={proxy_config}"], self.log_dir
        )

        # Cluster DNS before the kubelet, so every pod's resolv.conf names a server that answers.
        # CoreDNS's own ledger entry (a process) stops it after the kubelet; the Service and its
        # EndpointSlice live in the control plane's etcd and go with it.
        coredns.start(self.ledger, cp.kubeconfig, list(self.stack.node_ips), state / "coredns", self.log_dir)
        dns = coredns.service_manifests(list(self.stack.dns_ips), list(self.stack.node_ips))
        kubectl(
            cp.kubeconfig,
            "apply",
            "--server-side",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": dns}),
        )

        kubelet_root = ROOT_DIR / "kubelet"
        kubelet_root.mkdir(parents=True, exist_ok=True)
        self.ledger.add(kind="path", path=str(kubelet_root))
        self.ledger.add(kind="mount", path=str(kubelet_root))
        kubelet_config = state / "kubelet.yaml"
        kubelet_config.write_text(
            json.dumps(
                {
                    "apiVersion": "kubelet.config.k8s.io/v1beta1",
                    "kind": "KubeletConfiguration",
                    # This VM has cgroup v1 only, no systemd and swap settings of its own.
                    "failCgroupV1": False,
                    "cgroupDriver": "cgroupfs",
                    "failSwapOn": False,
                    "containerRuntimeEndpoint": f"unix://{self.runtimes.containerd_sock}",
                    "address": self.stack.api_address,  # the API server dials the first InternalIP
                    "readOnlyPort": 0,
                    "healthzBindAddress": "127.0.0.1",
                    # The API server dials the kubelet (logs, exec) without a client certificate.
                    "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
                    "authorization": {"mode": "AlwaysAllow"},
                    "enableControllerAttachDetach": False,
                    "evictionHard": {
                        "memory.available": "100Mi",
                        "nodefs.available": "1%",
                        "imagefs.available": "1%",
                    },
                    "imageGCHighThresholdPercent": 100,
                    "imageGCLowThresholdPercent": 99,
                    "serializeImagePulls": False,
                    "syncFrequency": "10s",
                    "fileCheckFrequency": "10s",
                    "resolvConf": "/etc/resolv.conf",
                    "clusterDNS": list(self.stack.dns_ips),
                    "clusterDomain": coredns.CLUSTER_DOMAIN,
                }
            )
        )
        kubelet = spawn(
            self.ledger,
            "kubelet",
            [str(binaries.kubelet), f"--config={kubelet_config}", f"--kubeconfig={kubeconfig}",
             f"--root-dir={kubelet_root}", f"--hostname-override={NODE_NAME}",
             f"--node-ip={','.join(self.stack.node_ips)}",
             "--v=1"],
            self.log_dir,
            grace=30,
        )  # fmt: skip

        def node_ready() -> bool:
            out = kubectl(cp.kubeconfig, "get", "node", NODE_NAME, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            node = json.loads(out.stdout)
            ready = any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"]["conditions"])
            return ready and not any(
                t["key"] == "node.kubernetes.io/not-ready" for t in node["spec"].get("taints", [])
            )

        wait_until(node_ready, 120, "the kubelet's node to be Ready and untainted", kubelet)
        for proc, what in ((scheduler, "kube-scheduler"), (proxy, "kube-proxy")):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited; see {self.log_dir / (what + '.log')}")
        self.startup_s = time.monotonic() - started
        return self

    def _write_cni(self) -> None:
        conf = {
            "cniVersion": "1.0.0",
            "name": "kvscale",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "ipMasq": False,  # no egress: nothing in a pod needs more than the cluster
                    "hairpinMode": True,  # a pod reaching its own Service
                    "ipam": {
                        "type": "host-local",
                        # One range per family, the primary first (the kubelet orders a pod's
                        # IPs by the node's primary family either way).
                        "ranges": [
                            [{"subnet": cidr, "gateway": gw}]
                            for cidr, gw in zip(self.stack.pod_cidrs, self.stack.node_ips, strict=True)
                        ],
                        # No default route in pods: only their bridge and the Services exist.
                        "routes": [
                            {"dst": cidr, "gw": gw}
                            for cidr, gw in zip(self.stack.service_cidrs, self.stack.node_ips, strict=True)
                        ],
                        "dataDir": str(RUN_DIR / "cni-ipam"),
                    },
                },
                # dockerd elsewhere may set `iptables -P FORWARD DROP`; this accepts pod traffic.
                {"type": "firewall"},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        self.ledger.add(kind="path", path=str(RUN_DIR / "cni-ipam"))
        (self.runtimes.cni_conf / "10-kvscale.conflist").write_text(json.dumps(conf, indent=1))

    def container_pid(self, container_id: str) -> int:
        """The host PID of a container's main process (container_id as in a pod's status)."""
        wanted = container_id.removeprefix("containerd://")
        for line in self.runtimes.ctr("tasks", "list").stdout.splitlines()[1:]:
            task, pid, *_ = line.split()
            if task == wanted:
                return int(pid)
        raise LookupError(f"no task for container {container_id}")

    def delete_pods(self, kubeconfig: Path, timeout: float = 60) -> None:
        """Every pod of the node, before the processes stop (their shims outlive containerd)."""
        kubectl(
            kubeconfig,
            "delete",
            "pods",
            "--all",
            "--all-namespaces",
            "--grace-period=5",
            f"--timeout={int(timeout)}s",
            check=False,
        )
        # Whatever the kubelet could not stop: its sandboxes, straight through CRI.
        listed = self.runtimes.ctr("containers", "list", "--quiet").stdout.split()
        for container in listed:
            self.runtimes.ctr("tasks", "kill", "--signal", "SIGKILL", container)


@contextlib.contextmanager
def real_cluster(state_dir: Path, runtimes: Runtimes, built: images.Built, log=print):
    """The control plane on NODE_IP and a real node running the images of `built` (and the pause
    image); yields (ControlPlane, RealNode). Everything is torn down on exit, also on an error."""
    binaries = ensure_built(log)
    coredns.build()
    images.pause_image(runtimes, binaries.pause)
    ledger = runtimes.ledger
    mark = len(ledger.entries)
    cp = None
    net = stack()
    node = RealNode(ledger, runtimes, state_dir / "node", stack=net)
    try:
        RealNode.prepare_network(ledger, net)
        cp = ControlPlane.start(
            state_dir / "controlplane",
            args=(
                "--address", net.api_address,
                "--service-cidr", ",".join(net.service_cidrs),
                "--node-lifecycle",
            ),
        )  # fmt: skip
        ledger.add(kind="process", name="controlplane", pid=cp.proc.pid, grace=60)
        node.start(cp, binaries, list(built.images.values()), log)
        yield cp, node
    finally:
        if cp is not None and cp.proc.poll() is None:
            node.delete_pods(cp.kubeconfig)
        ledger.teardown_from(mark, log)


def leftovers() -> list[str]:
    """What a teardown should have removed and did not: our bridge and route, iptables chains
    of kube-proxy and the CNI plugins, mounts under the kubelet's root, a live CoreDNS."""
    left = []
    if subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode == 0:
        left.append(f"link {BRIDGE}")
    for cidr in (SERVICE_CIDR, SERVICE_CIDR6):
        routes = subprocess.run(["ip", "route", "show", cidr], capture_output=True, text=True).stdout
        if routes.strip():
            left.append(f"route {routes.strip()}")
    for binary in ("iptables", "ip6tables"):
        for table, chains in iptables_chains(binary).items():
            left += [f"{binary} -t {table} chain {c}" for c in sorted(chains) if c.startswith(OUR_CHAINS)]
    with open("/proc/self/mounts") as f:
        left += [f"mount {line.split()[1]}" for line in f if str(ROOT_DIR / "kubelet") in line.split()[1]]
    left += [f"coredns pid {pid}" for pid in coredns.running()]
    return left
