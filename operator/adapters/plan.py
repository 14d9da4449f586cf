"""The adapter sync's decisions, pure: what to load and unload on one worker, and what status says
of each adapter given what every ready worker serves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

MAX_MESSAGE = 256  # a worker's error, as status shows it (a worker is a network peer)


@dataclass(frozen=True)
class Plan:
    unload: tuple[str, ...] = ()
    load: tuple[tuple[str, str], ...] = ()  # (name, path)


def plan_worker(desired: Mapping[str, str], loaded: Mapping[str, str]) -> Plan:
    """Bring a worker serving `loaded` (name -> path) to `desired`: unload what is not wanted or
    now comes from another path (the adapter's uri changed), then load what is missing. Unloads
    first: they free the worker's host slots for the loads."""
    unload = tuple(sorted(n for n, p in loaded.items() if desired.get(n) != p))
    load = tuple(sorted((n, p) for n, p in desired.items() if loaded.get(n) != p))
    return Plan(unload, load)


@dataclass
class WorkerView:
    """One ready worker as the sync saw it: the adapters it serves (None: it could not be read)
    and the loads it refused (name -> its reason)."""

    served: frozenset[str] | None
    refused: dict[str, str] = field(default_factory=dict)


def adapter_status(names: Sequence[str], workers: Sequence[WorkerView]) -> list[dict[str, object]]:
    """status.adapters: each adapter's state over the ready workers read. `Ready`: every one serves
    it; `Loading`: some do not yet; `Failed`: a worker refused it (its reason in `message`);
    `Pending`: no ready worker to serve it (scaled to zero, or none read)."""
    read = [w for w in workers if w.served is not None]
    out: list[dict[str, object]] = []
    for name in names:
        serving = sum(name in w.served for w in read)  # type: ignore[operator]
        refusal = next((w.refused[name] for w in read if name in w.refused), None)
        if refusal is not None:
            state, message = "Failed", refusal[:MAX_MESSAGE]
        elif not read:
            state, message = "Pending", "no ready worker"
        elif serving == len(read):
            state, message = "Ready", ""
        else:
            state, message = "Loading", f"served by {serving} of {len(read)} ready workers"
        out.append({"name": name, "state": state, "readyWorkers": serving, "message": message})
    return out
