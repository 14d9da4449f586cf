"""The local Kubernetes cluster for tests: build, start, stop.

    python e2e/cluster.py build            # only build the Go binaries
    python e2e/cluster.py up --dir DIR     # prints the kubeconfig path, runs until interrupted
    python e2e/cluster.py down --dir DIR   # stops the one started on DIR

`build` makes, in one `go build` of e2e/controlplane's module set, the control plane (a real
etcd + kube-apiserver + kube-controller-manager in one binary, from the upstream Kubernetes
modules), kubectl, kubelet, kube-proxy, kube-scheduler of the same release and the pause
program, when they are missing or stale. `up` (as root) also builds both images from the
Dockerfile and starts the real node beside the control plane (e2e/realnode.py); without root it
starts the control plane alone. From pytest, use the fixtures in e2e/conftest.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

E2E = Path(__file__).resolve().parent
GO_MODULE = E2E / "controlplane"
BIN = E2E / ".bin"
CONTROLPLANE_BIN = BIN / "kvscale-controlplane"
KUBECTL_BIN = BIN / "kubectl"
READY_MARK = "KVSCALE_CONTROLPLANE_READY"


# One `go build` makes every binary from the one module set (k8s.io/kubernetes v1.37.2): the
# control plane, kubectl, the node's kubelet, kube-proxy and kube-scheduler (`tool` lines in
# go.mod), and the pods' pause program.
TOOLS = ("kubectl", "kubelet", "kube-proxy", "kube-scheduler")


@dataclass(frozen=True)
class Binaries:
    controlplane: Path
    kubectl: Path
    kubelet: Path
    kube_proxy: Path
    kube_scheduler: Path
    pause: Path


BINARIES = Binaries(
    CONTROLPLANE_BIN, KUBECTL_BIN, BIN / "kubelet", BIN / "kube-proxy", BIN / "kube-scheduler", BIN / "pause"
)


def _sources_digest() -> str:
    h = hashlib.sha256(b"CGO_ENABLED=0 -ldflags version\0")  # the build's settings, below
    for path in sorted(GO_MODULE.rglob("*")):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            h.update(str(path.relative_to(GO_MODULE)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def ensure_built(log=print) -> Binaries:
    """Build every binary unless they all match the current sources.

    The Go build cache makes a rebuild after a small change quick; the first build of the
    Kubernetes modules on two cores takes many minutes (see docs/testing.md)."""
    stamp = BIN / "sources.sha256"
    digest = _sources_digest()
    paths = [getattr(BINARIES, f) for f in BINARIES.__dataclass_fields__]
    if all(p.is_file() for p in paths) and stamp.is_file() and stamp.read_text() == digest:
        return BINARIES
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to build e2e/controlplane (https://go.dev/dl)")
    BIN.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    log(f"building {', '.join(p.name for p in paths)} (one go build)...")
    packages = [".", "./pause", *(f"k8s.io/kubernetes/cmd/{t}" for t in TOOLS)]
    # The release the binaries report (kubectl version, the node's kubeletVersion), as Kubernetes'
    # own build stamps it; without it they say v0.0.0-master.
    release = re.search(r"^\s*k8s\.io/kubernetes (v\S+)", (GO_MODULE / "go.mod").read_text(), re.M)[1]
    major, minor = release.lstrip("v").split(".")[:2]
    ldflags = " ".join(
        f"-X k8s.io/component-base/version.{k}={v}"
        for k, v in (("gitVersion", release), ("gitMajor", major), ("gitMinor", minor))
    )
    subprocess.run(
        ["go", "build", "-ldflags", ldflags, "-o", f"{BIN}/", *packages],
        cwd=GO_MODULE,
        check=True,
        env={**os.environ, "CGO_ENABLED": "0"},  # static: the pause binary runs in an empty image
    )
    (BIN / "controlplane").replace(CONTROLPLANE_BIN)  # `go build -o DIR/ .` names it after the module
    log(f"built in {time.monotonic() - started:.0f}s")
    stamp.write_text(digest)
    return BINARIES


@dataclass
class ControlPlane:
    """A running control plane; `kubeconfig` is an admin kubeconfig (group system:masters)."""

    state_dir: Path
    proc: subprocess.Popen
    kubeconfig: Path
    server: str
    startup_s: float

    @classmethod
    def start(cls, state_dir: Path, timeout: float = 180.0, args: tuple[str, ...] = ()) -> ControlPlane:
        """args: more flags of kvscale-controlplane (--address, --service-cidr, --node-lifecycle)."""
        binary = ensure_built().controlplane
        state_dir.mkdir(parents=True, exist_ok=True)
        log = (state_dir / "controlplane.log").open("ab")
        proc = subprocess.Popen(
            [str(binary), "--dir", str(state_dir), *args], stdout=subprocess.PIPE, stderr=log, text=True
        )
        deadline = time.monotonic() + timeout
        assert proc.stdout is not None
        for line in proc.stdout:  # the binary prints one line once everything answers
            if line.startswith(READY_MARK):
                fields = dict(kv.split("=", 1) for kv in line.split()[1:])
                cp = cls(
                    state_dir, proc, Path(fields["kubeconfig"]), fields["server"], float(fields["startup_s"])
                )
                (state_dir / "controlplane.json").write_text(
                    json.dumps({"pid": proc.pid, "kubeconfig": str(cp.kubeconfig), "server": cp.server})
                )
                return cp
            if time.monotonic() > deadline:
                break
        proc.kill()
        raise RuntimeError(f"the control plane did not start; see {state_dir / 'controlplane.log'}")

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess:
        return kubectl(self.kubeconfig, *args, input=input, check=check)


class KubectlError(subprocess.CalledProcessError):
    """A failed kubectl, with what it said (CalledProcessError's message leaves stderr out)."""

    def __str__(self) -> str:
        return f"{super().__str__()}\n{(self.stderr or '').strip()[-3000:]}"


def kubectl(kubeconfig: Path | str, *args: str, input: str | None = None, check: bool = True):
    """Run the kubectl built from the same release, with this kubeconfig."""
    binary = ensure_built().kubectl
    argv = [str(binary), "--kubeconfig", str(kubeconfig), *args]
    out = subprocess.run(argv, input=input, capture_output=True, text=True)
    if check and out.returncode != 0:
        raise KubectlError(out.returncode, argv, out.stdout, out.stderr)
    return out


def _up(state_dir: Path) -> int:
    """The control plane and, where it can run (root, the Debian packages), the real node with
    both images built and imported (e2e/realnode.py); until SIGTERM / Ctrl-C, then all torn down."""
    import images
    import runtime

    stop = False

    def handler(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)

    def serve(cp: ControlPlane, what: str) -> None:
        print(cp.kubeconfig, flush=True)
        print(f"{what} up at {cp.server}; stop with Ctrl-C or `down`", file=sys.stderr)
        while not stop and cp.proc.poll() is None:
            time.sleep(0.5)

    reason = runtime.unavailable()
    if reason:
        print(f"no real node ({reason}): the control plane alone, pods stay Pending", file=sys.stderr)
        cp = ControlPlane.start(state_dir)
        serve(cp, "control plane")
        return cp.stop()
    from realnode import real_cluster

    ledger = runtime.Ledger(runtime.RUN_DIR / "ledger.json")
    ledger.teardown()  # what a killed run left behind
    try:
        rt = runtime.Runtimes(ledger, state_dir / "runtimes").start()

        def log(message: str) -> None:  # stdout carries the kubeconfig path alone
            print(message, file=sys.stderr, flush=True)

        built = images.build(rt, log)
        with real_cluster(state_dir, rt, built, log) as (cp, node):
            serve(cp, f"control plane and node (ready in {node.startup_s:.0f}s)")
    finally:
        ledger.teardown()
    return 0


def _down(state_dir: Path) -> int:
    """Stop what `up` started on state_dir: the `up` process (which stops its node and control
    plane), or a control plane left behind without one."""
    for name in ("up.pid", "controlplane.json"):
        path = state_dir / name
        if not path.is_file():
            continue
        pid = int(path.read_text()) if name == "up.pid" else json.loads(path.read_text())["pid"]
        if _signal_and_wait(pid):
            return 0
    print(f"nothing running on {state_dir}", file=sys.stderr)
    return 0


def _signal_and_wait(pid: int, timeout: float = 60.0) -> bool:
    """SIGTERM pid and wait for it to exit; False if it was not running."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    os.kill(pid, signal.SIGKILL)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("up", "down", "build"):
        p = sub.add_parser(name)
        if name != "build":
            p.add_argument("--dir", type=Path, required=True, help="state directory of the cluster")
    args = parser.parse_args(argv)
    if args.command == "build":
        ensure_built()
        return 0
    if args.command == "up":
        args.dir.mkdir(parents=True, exist_ok=True)
        (args.dir / "up.pid").write_text(str(os.getpid()))
        return _up(args.dir)
    return _down(args.dir)


if __name__ == "__main__":
    sys.path.insert(0, str(E2E))
    sys.exit(main())
