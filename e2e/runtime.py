"""Processes the real node is made of, and a ledger that lets anything started be stopped again.

Everything this harness starts (containerd, dockerd, the kubelet, ...) is a child process whose
PID goes into a ledger file in the run directory, with every network object it creates (bridge,
routes, iptables chains) and every mount. `Ledger.teardown()` undoes the ledger in reverse order;
a later run finds a ledger left behind by a killed one and tears it down before starting.

The runtimes here are our own instances, never the machine's: containerd (with its CRI plugin,
for the kubelet) and dockerd on top of it (for `docker build`), with their own sockets under
RUN_DIR and their own roots under ROOT_DIR (kept between runs: images and the pip cache of the
image builds live there).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

ROOT_DIR = Path(os.environ.get("KVSCALE_E2E_ROOT", "/var/lib/kvscale-e2e"))
RUN_DIR = Path(os.environ.get("KVSCALE_E2E_RUN", "/run/kvscale-e2e"))
DOCKER = "/usr/bin/docker" if Path("/usr/bin/docker").is_file() else "docker"  # not a buildx-less shadow
PAUSE_IMAGE = "kvscale.local/pause:e2e"


def unavailable() -> str | None:
    """Why the real node cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "the real node needs root (containerd, kubelet, iptables, mounts)"
    missing = [
        b for b in ("containerd", "dockerd", "runc", "ctr", "containerd-shim-runc-v2") if not _which(b)
    ]
    if missing:
        return f"the real node needs the Debian package docker.io (missing: {', '.join(missing)})"
    if not Path("/usr/lib/cni/bridge").is_file():
        return "the real node needs the Debian package containernetworking-plugins (/usr/lib/cni)"
    if not _which("iptables"):
        return "the real node needs the Debian package iptables"
    return None


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


class Ledger:
    """What a run created, on disk (RUN_DIR/ledger.json), undone in reverse by teardown()."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: list[dict] = json.loads(path.read_text()) if path.is_file() else []

    def add(self, **entry) -> None:
        self.entries.append(entry)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.entries, indent=1))

    def teardown(self, log: Callable[[str], None] = print) -> None:
        self.teardown_from(0, log)

    def teardown_from(self, mark: int, log: Callable[[str], None] = print) -> None:
        """Undo the entries added since len(entries) was `mark`, newest first."""
        for entry in reversed(self.entries[mark:]):
            try:
                _undo(entry)
            except Exception as e:  # keep going: the rest must still go
                log(f"teardown of {entry}: {type(e).__name__}: {e}")
        del self.entries[mark:]
        if self.entries:
            self.path.write_text(json.dumps(self.entries, indent=1))
        else:
            self.path.unlink(missing_ok=True)


def _undo(entry: dict) -> None:
    kind = entry["kind"]
    if kind == "process":
        stop_pid(entry["pid"], entry.get("grace", 20))
    elif kind == "command":  # a cleanup command recorded by the step that needs it
        subprocess.run(entry["argv"], capture_output=True, timeout=120)
    elif kind == "mount":
        for target in _mounts_under(entry["path"]):
            subprocess.run(["umount", "-l", target], capture_output=True)
    elif kind == "link":
        subprocess.run(["ip", "link", "delete", entry["name"]], capture_output=True)
    elif kind == "route":
        subprocess.run(["ip", "route", "delete", *entry["route"].split()], capture_output=True)
    elif kind == "iptables":  # chains named with one of `prefixes` that were not there `before`
        for table, before in entry["before"].items():
            _drop_new_chains(table, set(before), tuple(entry["prefixes"]), entry.get("binary", "iptables"))
    elif kind == "ipset":  # sets named with one of `prefixes` that were not there `before`
        listed = subprocess.run(["ipset", "list", "-n"], capture_output=True, text=True).stdout.split()
        for name in set(listed) - set(entry["before"]):
            if name.startswith(tuple(entry["prefixes"])):
                subprocess.run(["ipset", "destroy", name], capture_output=True)
    elif kind == "path":
        shutil.rmtree(entry["path"], ignore_errors=True)


def _drop_new_chains(
    table: str, before: set[str], prefixes: tuple[str, ...], binary: str = "iptables"
) -> None:
    def iptables(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([binary, "-t", table, *args], capture_output=True, text=True)

    rules = iptables("-S").stdout.splitlines()
    new = {r.split()[1] for r in rules if r.startswith("-N ")} - before
    new = {c for c in new if c.startswith(prefixes)}
    for rule in rules:  # rules of other chains that jump into ours
        words = shlex.split(rule)
        if words[0] == "-A" and words[1] not in new and any(w in new for w in words[2:]):
            iptables("-D", *words[1:])
    for chain in new:
        iptables("-F", chain)
    for chain in new:
        iptables("-X", chain)


def _mounts_under(path: str) -> list[str]:
    """Mount points at or below path, deepest first."""
    found = []
    with open("/proc/self/mounts") as f:
        for line in f:
            target = line.split()[1].replace("\\040", " ")
            if target == path or target.startswith(path.rstrip("/") + "/"):
                found.append(target)
    return sorted(found, key=len, reverse=True)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return False
    return True


def stop_pid(pid: int, grace: float = 20) -> None:
    """SIGTERM, then SIGKILL after `grace` seconds; a PID that no longer runs is left alone."""
    if not alive(pid):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def spawn(
    ledger: Ledger, name: str, argv: list[str], log_dir: Path, grace: float = 20, **kw
) -> subprocess.Popen:
    log_dir.mkdir(parents=True, exist_ok=True)
    with (log_dir / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, **kw)
    ledger.add(kind="process", name=name, pid=proc.pid, grace=grace)
    return proc


def wait_until(check: Callable[[], bool], timeout: float, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what}: the process exited ({proc.returncode})")
        with contextlib.suppress(Exception):
            if check():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what}: not ready after {timeout:.0f}s")


CONTAINERD_CONFIG = """\
version = 2
root = "{root}"
state = "{state}"
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  # Never pulled: imported by e2e/images.py.
  sandbox_image = "{pause}"
  # This VM lacks CAP_SYS_RESOURCE: without it runc cannot lower oom_score_adj and every sandbox
  # fails ("can't get final child's PID from pipe").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni_conf}"
"""


class Runtimes:
    """Our containerd (CRI on) and a dockerd on top of it, until stop()."""

    def __init__(self, ledger: Ledger, log_dir: Path) -> None:
        self.ledger, self.log_dir = ledger, log_dir
        self.containerd_sock = RUN_DIR / "containerd.sock"
        self.docker_host = f"unix://{RUN_DIR / 'docker.sock'}"
        self.cni_conf = RUN_DIR / "cni"
        self.env = {**os.environ, "DOCKER_HOST": self.docker_host, "DOCKER_BUILDKIT": "1"}

    def start(self) -> Runtimes:
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self.cni_conf.mkdir(parents=True, exist_ok=True)
        config = RUN_DIR / "containerd.toml"
        config.write_text(
            CONTAINERD_CONFIG.format(
                root=ROOT_DIR / "containerd",
                state=RUN_DIR / "containerd",
                sock=self.containerd_sock,
                pause=PAUSE_IMAGE,
                cni_conf=self.cni_conf,
            )
        )
        # An import cut short (a killed run) leaves its partial blob in the content store's ingest
        # folder, where containerd 1.6 keeps it for a day: a 6 GB worker image each time. Nothing
        # writes there before containerd starts (a run first tears down what an earlier one left).
        ingest = ROOT_DIR / "containerd" / "io.containerd.content.v1.content" / "ingest"
        shutil.rmtree(ingest, ignore_errors=True)
        # containerd mounts the snapshots of running containers under its state directory.
        self.ledger.add(kind="mount", path=str(RUN_DIR / "containerd"))
        proc = spawn(self.ledger, "containerd", ["containerd", "--config", str(config)], self.log_dir)
        wait_until(lambda: self.ctr("version").returncode == 0, 60, "containerd", proc)
        self.ledger.add(kind="mount", path=str(RUN_DIR / "docker"))
        docker_argv = [
            "dockerd",
            f"--host={self.docker_host}",
            f"--containerd={self.containerd_sock}",
            f"--data-root={ROOT_DIR / 'docker'}",
            f"--exec-root={RUN_DIR / 'docker'}",
            f"--pidfile={RUN_DIR / 'docker.pid'}",
            "--storage-driver=overlay2",
            "--exec-opt=native.cgroupdriver=cgroupfs",
            # No docker0, no iptables rules: builds and test containers use the host network,
            # so dockerd changes nothing in the machine's network.
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip-forward=false",
        ]
        proc = spawn(self.ledger, "dockerd", docker_argv, self.log_dir)
        wait_until(lambda: self.docker("info", capture=True).returncode == 0, 60, "dockerd", proc)
        return self

    def ctr(self, *args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ctr", "--address", str(self.containerd_sock), "--namespace", "k8s.io", *args],
            capture_output=True,
            text=True,
            **kw,
        )

    def docker(
        self, *args: str, capture: bool = False, check: bool = False, **kw
    ) -> subprocess.CompletedProcess:
        return subprocess.run(
            [DOCKER, *args], env=self.env, capture_output=capture, text=True, check=check, **kw
        )
