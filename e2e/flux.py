"""Flux's source-controller and kustomize-controller for the e2e tests, built from their Go modules
(github.com/fluxcd/source-controller, github.com/fluxcd/kustomize-controller; v1.9.6, the newest
that builds with Go 1.26) fetched through the module proxy, as e2e/lws.py builds the LeaderWorkerSet
controller; their CRDs are the modules' own (config/crd/bases).

    python e2e/flux.py build    # e2e/.bin/source-controller and e2e/.bin/kustomize-controller

Both run as processes beside the control plane (`controllers`), with the admin kubeconfig, as
Flux runs them in-cluster but without leader election: the source-controller serves the
artifacts it builds from the git repository on 127.0.0.1, where the kustomize-controller (on
the same host) fetches them. The git repository is served by `git http-backend` (smart HTTP:
Flux's go-git speaks no dumb HTTP) behind a small HTTP server of the stdlib (`git_server`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import go_module
from host_process import free_port, processes

VERSION = "v1.9.6"
CONTROLLERS = {
    "source-controller": "github.com/fluxcd/source-controller",
    "kustomize-controller": "github.com/fluxcd/kustomize-controller",
}
# go.mod edits before each build. The api/ submodule is replaced by a local folder that module
# zips leave out: the published api module, which go.mod names, is used instead. The proxy here
# refuses github.com/fluxcd/pkg/artifact v0.18.3 and serves v0.18.0 (same minor; the controller
# builds and runs on it). v1.10.x needs Go 1.27 and modules the proxy refuses (cosign v3.1.4, a
# go-digest/blake3 pseudo-version, with no served stand-in).
GO_MOD_EDITS = {
    "source-controller": [
        "-dropreplace=github.com/fluxcd/source-controller/api",
        "-replace=github.com/fluxcd/pkg/artifact=github.com/fluxcd/pkg/artifact@v0.18.0",
    ],
    "kustomize-controller": ["-dropreplace=github.com/fluxcd/kustomize-controller/api"],
}
BIN = Path(__file__).resolve().parent / ".bin"


def binary(name: str) -> Path:
    return BIN / name


def crds() -> list[Path]:
    """The CRDs of both controllers, from their modules."""
    return sorted(
        p
        for module in CONTROLLERS.values()
        for p in (go_module.fetch(module, VERSION, "main.go") / "config" / "crd" / "bases").glob("*.yaml")
    )


def build(timeout: float = 3600) -> dict[str, Path]:
    """Each controller's binary, unless built from this version already (the module cache is
    read-only: the builds run in writable copies)."""
    out = {}
    for name, module in CONTROLLERS.items():
        exe, stamp = binary(name), binary(name).with_suffix(".version")
        out[name] = exe
        if exe.is_file() and stamp.is_file() and stamp.read_text() == VERSION:
            continue
        source = go_module.fetch(module, VERSION, "main.go")
        BIN.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CGO_ENABLED": "0", "GOFLAGS": "-mod=mod"}
        with go_module.writable_copy(source) as tree:
            subprocess.run(["go", "mod", "edit", *GO_MOD_EDITS[name]], cwd=tree, check=True, env=env)
            build_cmd = ["go", "build", "-o", str(exe), "."]
            subprocess.run(build_cmd, cwd=tree, check=True, timeout=timeout, env=env)
        stamp.write_text(VERSION)
    return out


@contextlib.contextmanager
def controllers(kubeconfig: Path, workdir: Path, timeout: float = 90) -> Iterator[dict[str, Path]]:
    """Both controllers running against the cluster until the block ends; yields each one's log."""
    exes = build()
    storage, health = free_port(), {name: free_port() for name in CONTROLLERS}
    programs = {}
    for name, exe in exes.items():
        argv = [
            str(exe),
            f"--metrics-addr=127.0.0.1:{free_port()}",
            f"--health-addr=127.0.0.1:{health[name]}",
            "--log-level=debug",
        ]
        if name == "kustomize-controller":  # a commit moves all three Kustomizations of the test
            argv.append("--requeue-dependency=5s")
        if name == "source-controller":
            (workdir / "storage").mkdir(parents=True, exist_ok=True)
            argv += [
                f"--storage-path={workdir / 'storage'}",
                f"--storage-addr=127.0.0.1:{storage}",
                f"--storage-adv-addr=127.0.0.1:{storage}",
            ]
        programs[name] = (argv, f"http://127.0.0.1:{health[name]}/readyz")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "RUNTIME_NAMESPACE": "flux-system"}
    with processes(programs, env, workdir, timeout) as logs:
        yield logs


class _GitBackend(BaseHTTPRequestHandler):
    """One request through `git http-backend` (CGI) for the repositories under `root`."""

    root: Path

    def do_GET(self) -> None:
        self._backend()

    def do_POST(self) -> None:
        self._backend()

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _backend(self) -> None:
        path, _, query = self.path.partition("?")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = b""
            while size := int(self.rfile.readline().strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            self.rfile.readline()
        else:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {
            "PATH": os.environ["PATH"],
            "GIT_PROJECT_ROOT": str(self.root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "REQUEST_METHOD": self.command,
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_ADDR": self.client_address[0],
        }
        for header in ("Content-Encoding", "Git-Protocol"):
            if header in self.headers:
                env["HTTP_" + header.upper().replace("-", "_")] = self.headers[header]
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60)
        head, _, payload = out.stdout.partition(b"\r\n\r\n")
        status, headers = 200, []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            elif name:
                headers.append((name, value))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


@contextlib.contextmanager
def git_server(root: Path) -> Iterator[str]:
    """Smart HTTP for the bare repositories under root; yields the base URL (http://127.0.0.1:PORT)."""
    handler = type("GitBackend", (_GitBackend,), {"root": root})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    if sys.argv[1:] != ["build"]:
        sys.exit(__doc__)
    print(build())
