"""The local API server's audit log (e2e/controlplane: every request at Metadata level, one JSON
event a line, written when the response completes): what the tests read to know what the operator
asked the API server, and in what order."""

from __future__ import annotations

import json

OPERATOR_USER = "system:serviceaccount:kvscale-system:kvscale-operator"
CHILDREN = {"deployments", "services", "poddisruptionbudgets"}
WRITES = {"create", "update", "patch", "delete", "deletecollection"}


def audit_lines(cluster) -> int:
    """The log's length: a mark to read what came after."""
    return len((cluster.state_dir / "audit.log").read_text().splitlines())


def operator_requests(cluster, since_line: int, ns: str | None = None) -> list[dict]:
    """The operator's requests in the audit log after line `since_line` (in namespace `ns`), in order."""
    out = []
    for line in (cluster.state_dir / "audit.log").read_text().splitlines()[since_line:]:
        event = json.loads(line)
        ref = event.get("objectRef")
        if event["user"].get("username") != OPERATOR_USER or ref is None:
            continue
        if ns is not None and ref.get("namespace") != ns:
            continue
        out.append(event)
    return out


def resource_of(event: dict) -> str:
    ref = event["objectRef"]
    return ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")


def applied(cluster, since_line: int, ns: str) -> set[tuple[str, str]]:
    """(resource, name) of every child the operator sent a write for in `ns` after `since_line`
    (a server-side apply that changed nothing is a request all the same)."""
    return {
        (e["objectRef"]["resource"], e["objectRef"].get("name", ""))
        for e in operator_requests(cluster, since_line, ns)
        if e["verb"] in WRITES and e["objectRef"]["resource"] in CHILDREN
    }
