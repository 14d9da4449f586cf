"""Who a request is from: the router's API keys (`--api-key-file`, one per line, from a mounted
Secret) and the key flow control's fairness counts by (`client_key`).

A key is checked by its SHA-256 digest against every key's digest with `hmac.compare_digest`,
never stopping at the first match, so the answer's timing says neither how much of a key matched
nor which line it is on. A key's identity (what fairness and the logs see) is a digest prefix,
never the key itself. The file is re-read when it changes (the kubelet updates a mounted Secret in
place), checked at most every `recheck_s`; a file that cannot be read keeps the keys last read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

BEARER = "Bearer "


def parse_keys(text: str) -> list[str]:
    """One key a line; blank lines and `#` comments skipped, surrounding whitespace dropped."""
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _digest(key: str) -> bytes:
    # surrogatepass: any str a header can decode to is encodable, so a hostile header cannot raise
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def identity(digest: bytes) -> str:
    return "key:" + digest.hex()[:12]


def match(authorization: str, digests: list[bytes]) -> str | None:
    """The identity of the key `Authorization: Bearer KEY` carries, or None; constant time in
    where (and whether) it matches."""
    if not authorization.startswith(BEARER):
        return None
    presented = _digest(authorization[len(BEARER) :])
    found: bytes | None = None
    for d in digests:
        if hmac.compare_digest(presented, d):
            found = d
    return identity(found) if found is not None else None


class KeyFile:
    """The keys of one file, re-read when its mtime or size changes."""

    def __init__(
        self, path: str | os.PathLike, recheck_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ):
        self.path, self.recheck_s, self.clock = Path(path), recheck_s, clock
        self._stamp: tuple[int, int] | None = None
        self._checked = float("-inf")
        self.keys: list[str] = []
        self.digests: list[bytes] = []
        self._load(first=True)

    def _load(self, first: bool = False) -> None:
        try:
            st = self.path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
            if stamp == self._stamp:
                return
            keys = parse_keys(self.path.read_text())
        except OSError as e:
            if first:
                raise
            logger.warning("cannot re-read the API key file; keeping its last keys", extra={"error": repr(e)})
            return
        self._stamp, self.keys = stamp, keys
        self.digests = [_digest(k) for k in keys]
        if not keys:
            logger.warning(
                "the API key file holds no key: every request is refused", extra={"path": str(self.path)}
            )

    def refresh(self) -> None:
        now = self.clock()
        if now - self._checked >= self.recheck_s:
            self._checked = now
            self._load()

    def identify(self, authorization: str) -> str | None:
        self.refresh()
        return match(authorization, self.digests)

    def first(self) -> str | None:
        self.refresh()
        return self.keys[0] if self.keys else None


def client_key(identity_: str | None, peer: str | None) -> str:
    """Fairness per client: its API key's identity, else its peer address (a proxy in front makes
    all its clients one: the router trusts no X-Forwarded-For, which any client can write)."""
    if identity_ is not None:
        return identity_
    return f"peer:{peer or 'unknown'}"
