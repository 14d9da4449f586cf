"""`kvscale-worker download hf://ORG/NAME[@REVISION] --dest DIR`: a model snapshot from the Hugging
Face Hub (or a mirror, HF_ENDPOINT) into DIR, before the worker starts.

The operator runs it as the worker pod's init container `model-download`; the worker then loads
DIR with the Hub unreachable (HF_HUB_OFFLINE=1). No torch here: it starts in a second.

- The token is HF_TOKEN (from the resource's Secret), the endpoint HF_ENDPOINT: huggingface_hub's
  own variables, read at each call so a test can set them after import.
- Progress goes to the log (`kubectl logs POD -c model-download`): the revision resolved, then
  the bytes on disk every few seconds, then the total.
- A failure writes one line saying why to the termination log (/dev/termination-log; the kubelet
  puts it in the container's status, where the operator reads it into a condition) and exits 1:
  a refused token, an unknown revision or repository, an unreachable Hub.
- A branch that moved is downloaded into the same folder: files the new commit no longer has are
  removed (from huggingface_hub's cached tree listing of the commit), so no stale shard stays.
- Idempotent: DIR is an emptyDir or a PVC cache that pods share. huggingface_hub's own local-dir
  metadata (DIR/.cache/huggingface/) skips files already there at the resolved commit, and a
  marker written last (MARKER) records a complete snapshot: a commit-hash revision with a
  matching marker makes no request at all; a branch or tag costs one revision lookup and no file
  request when its commit is the marker's. When the Hub cannot be reached, a complete snapshot
  of the same branch is used as it is (what huggingface_hub itself does).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("kvscale.worker.download")

SCHEME = "hf://"
DEFAULT_REVISION = "main"
DEFAULT_ENDPOINT = "https://huggingface.co"
MARKER = ".kvscale-snapshot.json"  # written last: its presence means every file is in place
TERMINATION_LOG = "/dev/termination-log"
PROGRESS_S = 5.0
_PART = r"[A-Za-z0-9_]([-A-Za-z0-9_.]{0,94}[A-Za-z0-9_])?"
HF_URI = re.compile(
    rf"hf://(?P<repo>{_PART}/{_PART})(@(?P<revision>[A-Za-z0-9_]([-A-Za-z0-9_./]*[A-Za-z0-9_])?))?"
)
COMMIT = re.compile(r"[0-9a-f]{40}")


class DownloadError(Exception):
    """A failure with the one line the termination log says."""


@dataclass(frozen=True)
class HfModel:
    repo: str
    revision: str = DEFAULT_REVISION

    @property
    def pinned(self) -> bool:
        """A commit hash: immutable, so a complete snapshot of it never needs the Hub again."""
        return COMMIT.fullmatch(self.revision) is not None

    def __str__(self) -> str:
        return f"{SCHEME}{self.repo}@{self.revision}"


def parse_uri(uri: str) -> HfModel:
    match = HF_URI.fullmatch(uri)
    if match is None or ".." in uri or "--" in match["repo"]:
        raise ValueError(f"not a Hugging Face model URI: {uri!r} (expected hf://ORG/NAME[@REVISION])")
    return HfModel(match["repo"], match["revision"] or DEFAULT_REVISION)


def read_marker(dest: Path) -> dict | None:
    try:
        return json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _write_marker(dest: Path, model: HfModel, commit: str) -> None:
    scratch = dest / f"{MARKER}.tmp-{os.getpid()}"
    scratch.write_text(json.dumps({"repo": model.repo, "revision": model.revision, "commit": commit}))
    scratch.replace(dest / MARKER)  # atomic: a reader sees no marker or a whole one


def _prune(dest: Path, repo: str, commit: str) -> list[str]:
    """Remove the files of `dest` that `commit` does not have (left by an older commit of a
    branch); huggingface_hub's metadata and our marker stay. The removed paths."""
    from huggingface_hub import get_cached_repo_tree

    keep = {f.path for f in get_cached_repo_tree(repo, revision=commit, local_dir=dest)}
    removed = []
    for path in sorted(dest.rglob("*")):
        rel = path.relative_to(dest)
        if rel.parts[0] == ".cache" or rel.name.startswith(MARKER) or not path.is_file():
            continue
        if str(rel) not in keep:
            path.unlink()
            removed.append(str(rel))
    return removed


def _bytes_on_disk(dest: Path) -> int:
    total = 0
    for root, _, files in os.walk(dest):
        for f in files:
            with contextlib.suppress(OSError):  # renamed from .incomplete meanwhile
                total += os.stat(os.path.join(root, f)).st_size
    return total


def _report_progress(dest: Path, model: HfModel, done: threading.Event, every_s: float) -> None:
    started = time.monotonic()
    while not done.wait(every_s):
        size = _bytes_on_disk(dest)
        logger.info(
            "downloading %s: %.1f MiB on disk after %.0f s",
            model,
            size / 2**20,
            time.monotonic() - started,
            extra={"bytes": size},
        )


def _reason(e: Exception, model: HfModel, endpoint: str, has_token: bool) -> str:
    """The one line a user reads in the pod's status for a failed download."""
    import httpx2
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    if isinstance(e, OfflineModeIsEnabled):
        return f"HF_HUB_OFFLINE is set, so {model} cannot be downloaded: remove it from the download's env"
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, RevisionNotFoundError):
        return f"revision {model.revision!r} not found in {model.repo} on {endpoint}: check model.uri"
    if isinstance(e, GatedRepoError) or (isinstance(e, HfHubHTTPError) and status in (401, 403)):
        if not has_token:
            return (
                f"the Hub refused access to {model.repo} without a token ({status}): it is gated or "
                "private; name a Secret holding a token in model.hfTokenSecret"
            )
        return (
            f"the Hub refused the token for {model.repo} ({status}): check the Secret in "
            "model.hfTokenSecret (a valid token with access to the repository)"
        )
    if isinstance(e, RepositoryNotFoundError):
        return f"repository {model.repo} not found on {endpoint}: check model.uri"
    if isinstance(e, HfHubHTTPError):
        return f"the Hub at {endpoint} answered {status} for {model}: check model.uri and model.hfEndpoint"
    if isinstance(e, httpx2.TransportError | LocalEntryNotFoundError):
        return f"cannot reach the Hub at {endpoint} for {model.repo}: {type(e).__name__}: {e}".splitlines()[0]
    if isinstance(e, OSError):  # the volume: full, read-only, not writable by the pod's user
        return f"writing {model} to the model volume failed: {e}".splitlines()[0]
    return f"downloading {model} failed: {type(e).__name__}: {e}".splitlines()[0]


def _unreachable(e: Exception) -> bool:
    import httpx2
    from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

    return isinstance(e, httpx2.TransportError | LocalEntryNotFoundError | OfflineModeIsEnabled)


def download(model: HfModel, dest: Path, *, progress_s: float = PROGRESS_S) -> str:
    """The snapshot of `model` in `dest`, complete; its commit hash. Raises DownloadError."""
    from huggingface_hub import HfApi, snapshot_download

    endpoint = os.environ.get("HF_ENDPOINT", "").rstrip("/") or DEFAULT_ENDPOINT
    token = os.environ.get("HF_TOKEN") or None
    marker = read_marker(dest) or {}
    have = marker.get("commit") if marker.get("repo") == model.repo else None
    if model.pinned and have == model.revision:
        logger.info("%s is already complete in %s: nothing to fetch", model, dest)
        return model.revision
    try:
        if model.pinned:
            commit = model.revision
        else:
            info = HfApi(endpoint=endpoint, token=token).model_info(model.repo, revision=model.revision)
            commit = info.sha
            if not commit:
                raise DownloadError(f"the Hub at {endpoint} gave no commit for {model}: is it a Hub?")
        if commit == have:
            logger.info("%s (commit %s) is already complete in %s: nothing to fetch", model, commit, dest)
            return commit
        logger.info("downloading %s (commit %s) from %s into %s", model, commit, endpoint, dest)
        dest.mkdir(parents=True, exist_ok=True)
        # The folder is about to change: until the new marker, it is no complete snapshot.
        (dest / MARKER).unlink(missing_ok=True)
        done = threading.Event()
        reporter = threading.Thread(
            target=_report_progress, args=(dest, model, done, progress_s), daemon=True
        )
        reporter.start()
        started = time.monotonic()
        try:
            # A commit hash: every file of one commit, even if the branch moves meanwhile.
            snapshot_download(model.repo, revision=commit, local_dir=dest, endpoint=endpoint, token=token)
        finally:
            done.set()
            reporter.join()
    except DownloadError:
        raise
    except Exception as e:
        if _unreachable(e) and have is not None and marker.get("revision") == model.revision:
            logger.warning(
                "the Hub at %s cannot be reached (%s); using the complete snapshot of %s already in %s "
                "(commit %s)",
                endpoint,
                e,
                model,
                dest,
                have,
            )
            return have
        raise DownloadError(_reason(e, model, endpoint, token is not None)) from e
    for path in _prune(dest, model.repo, commit):
        logger.info("removed %s: commit %s of %s does not have it", path, commit, model)
    _write_marker(dest, model, commit)
    size = _bytes_on_disk(dest)
    logger.info(
        "downloaded %s (commit %s): %.1f MiB in %.1f s",
        model,
        commit,
        size / 2**20,
        time.monotonic() - started,
        extra={"bytes": size, "commit": commit},
    )
    return commit


def check(model: HfModel, dest: Path) -> str:
    """The commit of the complete snapshot of `model` in `dest`, read from its marker alone (no
    network, nothing written: a read-only model cache filled once beforehand); raises
    DownloadError saying how to fill it when there is none."""
    marker = read_marker(dest) or {}
    if marker.get("repo") == model.repo and model.revision in (marker.get("revision"), marker.get("commit")):
        commit = marker["commit"]
        logger.info("%s (commit %s) is complete in the read-only model cache %s", model, commit, dest)
        return commit
    raise DownloadError(
        f"{model} is not in the read-only model cache at {dest} (model.cacheReadOnly): fill the claim "
        f"once with `kvscale-worker download {model} --dest {dest}` (docs/operator.md, Caches)"
    )


def main(uri: str, dest: str, termination_log: str = TERMINATION_LOG, check_only: bool = False) -> int:
    """The `download` subcommand: 0 with the snapshot in `dest`, else 1 with the reason in the
    log and in `termination_log` (the kubelet's terminationMessagePath). `check_only`: only check
    that a complete snapshot is there (`check`)."""
    try:
        model = parse_uri(uri)
        (check if check_only else download)(model, Path(dest))
        return 0
    except (DownloadError, ValueError) as e:
        reason = str(e)
    logger.error("%s", reason)
    try:
        Path(termination_log).write_text(reason + "\n")
    except OSError as e:  # outside a pod the default path may not be writable
        print(f"could not write the termination log {termination_log}: {e}", file=sys.stderr)
    return 1
