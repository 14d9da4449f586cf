"""The local Kubernetes control plane for tests: build, start, stop, and a stand-in node.

    python e2e/cluster.py up --dir DIR     # prints the kubeconfig path, runs until interrupted
    python e2e/cluster.py down --dir DIR   # stops the one started on DIR

`up` builds e2e/controlplane (a real etcd + kube-apiserver + kube-controller-manager in one Go
binary, from the upstream Kubernetes modules) and kubectl of the same release when they are
missing or stale, starts the control plane, and runs the node stand-in (e2e/node.py) that binds
pods to a node and runs their commands on loopback addresses. From pytest, use the fixtures in
e2e/conftest.py.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
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


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(GO_MODULE.iterdir()):
        if path.suffix == ".go" or path.name in ("go.mod", "go.sum"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def ensure_built(log=print) -> tuple[Path, Path]:
    """Build the control plane and kubectl unless the binaries match the current sources.

    The Go build cache makes a rebuild after a small change quick; the first build of the
    Kubernetes modules on two cores takes many minutes (see docs/testing.md)."""
    stamp = BIN / "sources.sha256"
    digest = _sources_digest()
    if (
        CONTROLPLANE_BIN.is_file()
        and KUBECTL_BIN.is_file()
        and stamp.is_file()
        and stamp.read_text() == digest
    ):
        return CONTROLPLANE_BIN, KUBECTL_BIN
    if shutil.which("go") is None:
        raise RuntimeError("the Go toolchain is needed to build e2e/controlplane (https://go.dev/dl)")
    BIN.mkdir(parents=True, exist_ok=True)
    for target, package in ((CONTROLPLANE_BIN, "."), (KUBECTL_BIN, "k8s.io/kubernetes/cmd/kubectl")):
        started = time.monotonic()
        log(f"building {target.name} (go build {package})...")
        subprocess.run(["go", "build", "-o", str(target), package], cwd=GO_MODULE, check=True)
        log(f"built {target.name} in {time.monotonic() - started:.0f}s")
    stamp.write_text(digest)
    return CONTROLPLANE_BIN, KUBECTL_BIN


@dataclass
class ControlPlane:
    """A running control plane; `kubeconfig` is an admin kubeconfig (group system:masters)."""

    state_dir: Path
    proc: subprocess.Popen
    kubeconfig: Path
    server: str
    startup_s: float

    @classmethod
    def start(cls, state_dir: Path, timeout: float = 180.0) -> ControlPlane:
        binary, _ = ensure_built()
        state_dir.mkdir(parents=True, exist_ok=True)
        log = (state_dir / "controlplane.log").open("ab")
        proc = subprocess.Popen(
            [str(binary), "--dir", str(state_dir)], stdout=subprocess.PIPE, stderr=log, text=True
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


def kubectl(kubeconfig: Path | str, *args: str, input: str | None = None, check: bool = True):
    """Run the kubectl built from the same release, with this kubeconfig."""
    _, binary = ensure_built()
    return subprocess.run(
        [str(binary), "--kubeconfig", str(kubeconfig), *args],
        input=input,
        capture_output=True,
        text=True,
        check=check,
    )


def _up(state_dir: Path) -> int:
    from node import NodeAgent  # e2e/node.py, next to this file

    cp = ControlPlane.start(state_dir)
    agent = NodeAgent(cp.kubeconfig, log_dir=state_dir / "pods")
    agent.start()
    print(cp.kubeconfig, flush=True)
    print(
        f"control plane up in {cp.startup_s:.1f}s at {cp.server}; stop with Ctrl-C or `down`", file=sys.stderr
    )
    stop = False

    def handler(*_):
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    while not stop and cp.proc.poll() is None:
        time.sleep(0.5)
    agent.stop()
    return cp.stop()


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
