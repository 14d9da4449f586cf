"""The images of the real node, made without a registry.

- the base: `debootstrap --variant=minbase bookworm` + python3, python3-venv, ca-certificates,
  imported as BASE_IMAGE and handed to the Dockerfile as `--build-arg PYTHON_IMAGE` (the
  Dockerfile's default is python:3.11-slim-bookworm from Docker Hub, unreachable here);
- the pause image (the pods' sandbox) from e2e/controlplane/pause, a static Go program;
- the operator and worker images, built from the repository's Dockerfile by our dockerd
  (e2e/runtime.py) and tagged with the names manifests/ uses, so manifests apply unchanged;
- `import_into_containerd`: `docker save | ctr images import`, so the kubelet finds them
  (imagePullPolicy IfNotPresent: nothing is ever pulled).

If the machine trusts extra CAs in /usr/local/share/ca-certificates (an intercepting proxy, as
on our CI machines), they are copied into the base's root filesystem when it is made so that pip
and apt work inside the builds. They stay in that local image: never in the Dockerfile or git.

    python e2e/images.py build  # (root) start our containerd + dockerd, build, stop them again
    python e2e/images.py lock   # regenerate requirements/*.txt from the installed venv
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from runtime import DOCKER, PAUSE_IMAGE, ROOT_DIR, Runtimes

REPO = Path(__file__).resolve().parents[1]
BASE_IMAGE = "kvscale.local/python:3.11-bookworm"
OPERATOR_IMAGE = "ghcr.io/kvscale/kvscale-operator:0.1.0"
WORKER_IMAGE = "ghcr.io/kvscale/kvscale-worker:0.1.0"
ROUTER_IMAGE = "ghcr.io/kvscale/kvscale-router:0.1.0"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
ID_LABEL = "kvscale.dev/docker-image-id"


@dataclass
class Built:
    """What a build produced and how long each step took (seconds)."""

    images: dict[str, str] = field(default_factory=dict)  # target -> tag
    seconds: dict[str, float] = field(default_factory=dict)
    sizes: dict[str, int] = field(default_factory=dict)  # tag -> bytes


def _exists(rt: Runtimes, image: str) -> bool:
    return rt.docker("image", "inspect", image, capture=True).returncode == 0


def base_image(rt: Runtimes, log=print) -> str:
    if _exists(rt, BASE_IMAGE):
        return BASE_IMAGE
    with tempfile.TemporaryDirectory(prefix="kvscale-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        started = time.monotonic()
        subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                "--include=python3,python3-venv,ca-certificates",
                "bookworm",
                str(rootfs),
                DEBIAN_MIRROR,
            ],
            check=True,
            capture_output=True,
        )
        extra_cas = sorted(Path("/usr/local/share/ca-certificates").glob("*.crt"))
        if extra_cas:
            dest = rootfs / "usr/local/share/ca-certificates"
            dest.mkdir(parents=True, exist_ok=True)
            for ca in extra_cas:
                shutil.copy(ca, dest / ca.name)
            subprocess.run(["chroot", str(rootfs), "update-ca-certificates"], check=True, capture_output=True)
        subprocess.run(["rm", "-rf", *(str(p) for p in (rootfs / "var/cache/apt/archives").glob("*.deb"))])
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        rt.docker("import", "-", BASE_IMAGE, stdin=tar.stdout, check=True, capture=True)
        tar.wait()
        log(f"base image {BASE_IMAGE} made in {time.monotonic() - started:.0f}s")
    return BASE_IMAGE


def pause_image(rt: Runtimes, pause_binary: Path) -> str:
    with tempfile.TemporaryDirectory(prefix="kvscale-pause-") as tmp:
        shutil.copy(pause_binary, Path(tmp) / "pause")
        tar = subprocess.Popen(["tar", "-C", tmp, "-c", "pause"], stdout=subprocess.PIPE)
        rt.docker(
            "import",
            "--change",
            'ENTRYPOINT ["/pause"]',
            "-",
            PAUSE_IMAGE,
            stdin=tar.stdout,
            check=True,
            capture=True,
        )
        tar.wait()
    return PAUSE_IMAGE


def build(rt: Runtimes, log=print) -> Built:
    """The Dockerfile's targets on the local base (BuildKit's layer and pip caches make a
    rebuild with unchanged dependencies take seconds)."""
    built = Built()
    started = time.monotonic()
    base = base_image(rt, log)
    built.seconds["base"] = time.monotonic() - started
    for target, tag in (("operator", OPERATOR_IMAGE), ("router", ROUTER_IMAGE), ("worker", WORKER_IMAGE)):
        started = time.monotonic()
        log(f"building {tag} (--target {target})...")
        result = rt.docker(
            "build",
            "--network=host",  # our dockerd has no bridge; builds reach the registries as the host does
            "--build-arg",
            f"PYTHON_IMAGE={base}",
            "--target",
            target,
            "--tag",
            tag,
            str(REPO),
            capture=True,
        )
        if result.returncode != 0:
            raise RuntimeError(f"docker build --target {target} failed:\n{result.stderr[-6000:]}")
        built.seconds[target] = time.monotonic() - started
        built.images[target] = tag
        # The image this tag named before is dangling now; its unshared layers (GBs for the
        # worker) would stay on disk run after run. BuildKit's cache keeps what rebuilds need.
        rt.docker("image", "prune", "--force", capture=True)
        size = rt.docker("image", "inspect", "--format", "{{.Size}}", tag, capture=True, check=True)
        built.sizes[tag] = int(size.stdout.strip())
        log(f"built {tag} in {built.seconds[target]:.0f}s ({built.sizes[tag] / 1e9:.2f} GB)")
    return built


def import_into_containerd(rt: Runtimes, images: list[str], log=print) -> float:
    """Copy the images dockerd has into containerd's k8s.io namespace, unless it has the same ones
    (each import is labelled with dockerd's image ID; a 6 GB worker image takes minutes)."""
    started = time.monotonic()
    listed = [line.split() for line in rt.ctr("images", "list").stdout.splitlines()[1:]]
    wanted = {}
    for image in images:
        image_id = rt.docker("image", "inspect", "--format", "{{.Id}}", image, capture=True, check=True)
        label = f"{ID_LABEL}={image_id.stdout.strip()}"
        if not any(fields[:1] == [image] and label in " ".join(fields) for fields in listed):
            wanted[image] = label
    if wanted:
        # The copies being replaced go first: containerd frees their layers (a changed dependency
        # layer is GBs, twice over: the blob and its unpacked snapshot) before `docker save` needs
        # room for a whole copy of the image in dockerd's temp folder. A disk that was full this
        # way made the import fail on the CI machine.
        for stale in stale_refs(listed, wanted):
            rt.ctr("images", "remove", stale)
        save = subprocess.Popen(
            [DOCKER, "save", *wanted], env=rt.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        result = rt.ctr("images", "import", "-", stdin=save.stdout)
        # Our copy of the pipe's read end: closed, so that docker save gets EPIPE and ends when ctr
        # stopped reading early (a full disk), instead of blocking on the pipe forever.
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        save.wait()
        if result.returncode != 0 or save.returncode != 0:
            free = shutil.disk_usage(ROOT_DIR).free / 1e9
            raise RuntimeError(
                f"docker save | ctr images import ({free:.1f} GB free under {ROOT_DIR}):\n"
                f"docker save: {save_err.strip()}\nctr: {result.stderr.strip()}"
            )
        for image, label in wanted.items():
            # docker save writes short names (docker.io/library/... for unqualified ones).
            rt.ctr("images", "label", image, label)
        log(f"imported {', '.join(wanted)} into containerd in {time.monotonic() - started:.0f}s")
    return time.monotonic() - started


def stale_refs(listed: list[list[str]], wanted: dict[str, str]) -> list[str]:
    """The containerd refs of the copies `wanted` replaces: each name and the `sha256:<image id>`
    ref the CRI plugin keeps beside it (the ID from our label), which alone would keep the layers."""
    refs = []
    for fields in listed:
        if fields[:1] and fields[0] in wanted:
            refs.append(fields[0])
            labels = ",".join(fields).split(",")
            refs += [f"sha256:{x.rsplit(':', 1)[1]}" for x in labels if x.startswith(ID_LABEL)]
    return refs


def lock() -> None:
    """requirements/{operator,worker}.txt: the installed distributions each extra needs, pinned
    (run with the venv's python after `pip install -e '.[test]'`)."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def closure(extra: str) -> list[str]:
        todo = [(Requirement(r), "") for r in distribution("kvscale").requires or []]
        todo = [(r, "") for r, _ in todo if r.marker is None or r.marker.evaluate({"extra": extra})]
        pins: dict[str, str] = {}
        done: set[tuple[str, str]] = set()
        while todo:
            req, _ = todo.pop()
            dist = distribution(req.name)
            name = canonicalize_name(req.name)
            pins[name] = f"{dist.metadata['Name']}=={dist.version}"
            for extra_name in {"", *req.extras}:
                if (name, extra_name) in done:
                    continue
                done.add((name, extra_name))
                for spec in dist.requires or []:
                    sub = Requirement(spec)
                    if sub.marker is None or sub.marker.evaluate({"extra": extra_name}):
                        todo.append((sub, ""))
        return [pins[k] for k in sorted(pins)]

    for extra in ("operator", "worker"):
        path = REPO / "requirements" / f"{extra}.txt"
        header = [line for line in path.read_text().splitlines() if line.startswith("#")]
        path.write_text("\n".join([*header, *closure(extra)]) + "\n")
        print(f"wrote {path}")


def _build_cli() -> int:
    """Both images (not the pause image: it needs the Go build, which .ci/run runs beside this,
    and the real node's session makes it from the built binary, e2e/realnode.py)."""
    import runtime

    reason = runtime.unavailable()
    if reason:
        print(f"not building the images: {reason}", file=sys.stderr)
        return 0
    ledger = runtime.Ledger(runtime.RUN_DIR / "ledger.json")
    ledger.teardown()
    try:
        rt = Runtimes(ledger, runtime.RUN_DIR / "logs").start()
        built = build(rt)
        for tag, size in built.sizes.items():
            print(f"{tag}: {size / 1e9:.2f} GB")
        print(" ".join(f"{k}={v:.0f}s" for k, v in built.seconds.items()))
    finally:
        ledger.teardown()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1:] == ["lock"]:
        lock()
    elif sys.argv[1:] == ["build"]:
        sys.exit(_build_cli())
    else:
        sys.exit(__doc__)
