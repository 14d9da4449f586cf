"""What the operator reports on the resource: conditions, worker counts, the endpoint, and the
autoscaler's signals and last decisions; and which of the two writers owns which fields.

Three writers share the status, each through server-side apply under its own field manager and
each sending only its own fields (`conditions` is a map keyed by `type`, so a writer owns its
entries, not the list): the reconciler, the autoscaler and the adapter sync. `status_apply`
refuses a body with another writer's field: sending one would make the writer a co-owner and let
it overwrite the other's value."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field

from kvscale.operator.api.groupversion import GROUP, KIND, VERSION
from kvscale.operator.api.labels import ADAPTERS_MANAGER, AUTOSCALER_MANAGER, MANAGER
from kvscale.operator.api.spec import InferenceDeploymentSpec
from kvscale.operator.api.validation import LABEL_KEY, CamelModel, list_map

# Condition types are open (metav1.Condition's grammar, no enum): an older CRD must accept the
# status a newer operator writes, with condition types it does not know yet.
CONDITION_TYPE = LABEL_KEY


class Condition(CamelModel):
    type: str = Field(
        pattern=CONDITION_TYPE,
        max_length=316,
        description="Ready, Progressing, Degraded or ScalingActive (newer operators may add types).",
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="The generation this condition reflects."
    )


class ScalingDecision(CamelModel):
    time: str = Field(description="When (RFC 3339).")
    from_replicas: int = Field(description="Workers before.")
    to_replicas: int = Field(description="Workers after.")
    reason: str = Field(description="Why, with the signals that decided it.")


class AutoscalingStatus(CamelModel):
    """What the autoscaler saw at its last scrape and what it did recently."""

    desired_replicas: int | None = Field(default=None, description="Workers the autoscaler wants.")
    ready_workers: int = Field(default=0, description="Ready workers scraped.")
    starting_workers: int = Field(default=0, description="Workers not ready yet (loading).")
    unreadable_workers: int = Field(
        default=0,
        description="Ready workers whose metrics could not be read at the last scrape (counted as "
        "exactly at target; no scale-down while any is).",
    )
    unschedulable_workers: int = Field(
        default=0,
        description="Worker pods the scheduler cannot place (PodScheduled False, Unschedulable): "
        "not counted as starting, removed first by a scale-down.",
    )
    crash_looping_workers: int = Field(
        default=0,
        description="Worker pods whose container crash-loops (CrashLoopBackOff, or restarted 3 times).",
    )
    stalled_workers: int = Field(
        default=0,
        description="Worker pods that cannot start (an image or config error) or were not Ready "
        "within server.startupTimeoutSeconds.",
    )
    lookahead_seconds: float = Field(
        default=0.0,
        description="How far ahead a rising arrival rate is projected: the workers' median startup "
        "(container start to first Ready), plus, where they build their compiled forward behind "
        "the eager one, the part of the wait for compiled steps their eager capacity does not "
        "cover; at most server.startupTimeoutSeconds.",
    )
    kv_cache_usage: float | None = Field(
        default=None, description="Mean KV-cache occupancy of the ready workers (0-1)."
    )
    waiting_requests: float | None = Field(
        default=None, description="Mean requests waiting per ready worker."
    )
    last_scrape_time: str | None = Field(default=None, description="When the workers were last scraped.")
    last_decisions: list[ScalingDecision] = Field(
        default_factory=list, description="The last few scaling decisions, newest last."
    )


class AdapterStatus(CamelModel):
    """Where one of spec.adapters is served (operator/adapters/)."""

    name: str = Field(description="The adapter's name.")
    state: Literal["Ready", "Loading", "Failed", "Pending"] = Field(
        description="Ready: every ready worker serves it; Loading: some do not yet; Failed: a worker "
        "refused it (see message); Pending: no ready worker."
    )
    ready_workers: int = Field(default=0, description="Ready workers serving it.")
    message: str = Field(default="", description="Why it is not Ready.")


class InferenceDeploymentStatus(CamelModel):
    """What the operator observed; written by the operator only."""

    model_config = ConfigDict(extra="allow")  # kopf keeps its bookkeeping under status.kopf

    observed_generation: int | None = Field(default=None, description="The spec generation last acted on.")
    replicas: int = Field(
        default=0, description="Worker pods (all versions); groups of pods with parallelism.nodes above 1."
    )
    ready_replicas: int = Field(
        default=0, description="Worker pods passing their readiness probe (groups whose every pod does)."
    )
    updated_replicas: int = Field(default=0, description="Worker pods (or groups) of the current spec.")
    ready: str = Field(default="0/0", description="Ready / desired workers, for `kubectl get`.")
    selector: str = Field(
        default="", description="Label selector of the worker pods (for the scale subresource)."
    )
    endpoint: str | None = Field(
        default=None,
        description="The OpenAI endpoint clients use: the router's Service, or the workers' "
        "without the router.",
    )
    kv_cache_usage: float | None = Field(
        default=None, description="Mean KV-cache occupancy of the ready workers (0-1)."
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The autoscaler's signals and its last decisions."
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        json_schema_extra=list_map("name"),
        description="Each of spec.adapters: whether the ready workers serve it.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        # A map keyed by type: each status writer's server-side apply owns its own conditions.
        json_schema_extra=list_map("type"),
        description="Ready, Progressing, Degraded, ScalingActive: one per type.",
    )


class InferenceDeployment(CamelModel):
    model_config = ConfigDict(extra="ignore")

    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)


@dataclass(frozen=True)
class Fields:
    """The top-level status fields and the condition types one writer owns."""

    fields: frozenset[str]
    conditions: frozenset[str]


OWNED = {
    MANAGER: Fields(
        frozenset(
            {
                "observedGeneration",
                "replicas",
                "readyReplicas",
                "updatedReplicas",
                "ready",
                "selector",
                "endpoint",
                "conditions",
            }
        ),
        frozenset({"Ready", "Progressing", "Degraded"}),
    ),
    AUTOSCALER_MANAGER: Fields(
        frozenset({"kvCacheUsage", "autoscaling", "conditions"}), frozenset({"ScalingActive"})
    ),
    ADAPTERS_MANAGER: Fields(frozenset({"adapters"}), frozenset()),
}


def pruned(value: Any) -> Any:
    """Without None values: in an apply, an absent field is "not mine", and null fails the schema."""
    if isinstance(value, dict):
        return {k: pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [pruned(v) for v in value]
    return value


def status_apply(name: str, namespace: str, status: dict[str, Any], manager: str) -> dict[str, Any]:
    """The server-side apply body of `status` for `manager`; refuses another writer's fields
    (sending one would make this writer a co-owner and let it overwrite the other's value)."""
    own = OWNED[manager]
    foreign = set(status) - own.fields
    foreign |= {
        f"conditions[{c['type']}]" for c in status.get("conditions", []) if c["type"] not in own.conditions
    }
    if foreign:
        raise ValueError(f"{manager} does not own status fields {sorted(foreign)}")
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "metadata": {"name": name, "namespace": namespace},
        "status": pruned(status),
    }
