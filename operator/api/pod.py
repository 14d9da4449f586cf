"""The worker pods' template fields a user sets: environment, tolerations, labels and annotations,
affinity, topology spread, image pull secrets (Kubernetes' own fields, their rules checked at
apply)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from kvscale.operator.api.groupversion import GROUP
from kvscale.operator.api.labels import LABEL_INSTANCE, LABEL_MANAGED_BY, LABEL_NAME
from kvscale.operator.api.validation import (
    CONFIG_KEY,
    ENV_NAME,
    KEYS_RULE,
    CamelModel,
    LabelKey,
    LabelValue,
    ObjectName,
    Rule,
    checked,
)


class KeyRef(CamelModel):
    name: ObjectName("a Secret or ConfigMap") = Field(description="Name of the Secret or ConfigMap.")
    key: str = Field(pattern=CONFIG_KEY, min_length=1, max_length=253, description="Key within it.")


class EnvSource(CamelModel):
    rules = (
        Rule(
            "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "set exactly one of secretKeyRef, configMapKeyRef",
            lambda s: (s.secret_key_ref is None) != (s.config_map_key_ref is None),
        ),
    )

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


class EnvVar(CamelModel):
    rules = (
        Rule(
            "has(self.value) != has(self.valueFrom)",
            "set exactly one of value, valueFrom",
            lambda s: (s.value is None) != (s.value_from is None),
        ),
    )

    name: str = Field(
        pattern=ENV_NAME,
        max_length=256,
        description="Variable name. One the operator sets too (HOME, HF_HOME, HF_HUB_OFFLINE, "
        "XDG_CACHE_HOME, TRITON_CACHE_DIR, KVSCALE_API_KEY) replaces the operator's value.",
    )
    value: str | None = Field(default=None, description="Literal value.")
    value_from: EnvSource | None = Field(default=None, description="Value from a Secret or ConfigMap key.")


class Toleration(CamelModel):
    """A toleration of the worker pods (the Kubernetes field, with its rules checked at apply)."""

    rules = (
        Rule(
            "has(self.key) || self.operator == 'Exists'",
            "operator must be Exists when key is empty (which tolerates every taint)",
            lambda t: t.key is not None or t.operator == "Exists",
        ),
        Rule(
            "self.operator != 'Exists' || !has(self.value) || self.value == ''",
            "value must be empty when operator is Exists",
            lambda t: t.operator != "Exists" or not t.value,
        ),
        Rule(
            "!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
            "tolerationSeconds needs effect NoExecute",
            lambda t: t.toleration_seconds is None or t.effect == "NoExecute",
        ),
    )

    key: LabelKey | None = Field(
        default=None, description="Taint key (empty with operator Exists: all taints)."
    )
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: LabelValue | None = Field(default=None, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (empty: all)."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


# The pod labels the operator sets; the Deployment, Service and PDB select the workers by the
# first two. A user label may not take them (refused at apply, rather than silently dropped).
RESERVED_LABELS = (LABEL_NAME, LABEL_INSTANCE, LABEL_MANAGED_BY)
RESERVED_PREFIX = f"{GROUP}/"
_RESERVED_RULE = Rule(
    "!self.exists(k, k in ["
    + ", ".join(f"'{k}'" for k in RESERVED_LABELS)
    + f"] || k.startsWith('{RESERVED_PREFIX}'))",
    f"{', '.join(RESERVED_LABELS)} and {RESERVED_PREFIX}* are the operator's labels (the "
    "Deployment, Service and PodDisruptionBudget select the workers by them)",
    lambda m: not any(k in RESERVED_LABELS or k.startswith(RESERVED_PREFIX) for k in m),
)
PodLabels = checked(dict[str, LabelValue], KEYS_RULE, _RESERVED_RULE, max_length=64)
Annotations = checked(dict[str, str], KEYS_RULE, max_length=64)


class PodMetadata(CamelModel):
    """Labels and annotations added to every worker pod."""

    labels: PodLabels = Field(
        default_factory=dict,
        description="Labels of the worker pods. The operator's own (app.kubernetes.io/name, "
        "/instance, /managed-by and kvscale.dev/*) are refused.",
    )
    annotations: Annotations = Field(
        default_factory=dict,
        description="Annotations of the worker pods. One the operator sets too (the prometheus.io "
        "scrape annotations) takes the user's value. Changing them rolls the workers.",
    )


# Kubernetes-typed pass-through: kept as they are, checked by the API server on the Deployment
# (a mistake there is reported on the resource's status, not at apply).
_OPEN = {"x-kubernetes-preserve-unknown-fields": True}


class Affinity(CamelModel):
    """Scheduling affinity of the worker pods: the pod spec's `affinity`, passed through."""

    node_affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_OPEN,
        description="Node affinity (see `kubectl explain pod.spec.affinity.nodeAffinity`).",
    )
    pod_affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_OPEN,
        description="Pod affinity (see `kubectl explain pod.spec.affinity.podAffinity`).",
    )
    pod_anti_affinity: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_OPEN,
        description="Pod anti-affinity, e.g. one worker per node (see `kubectl explain "
        "pod.spec.affinity.podAntiAffinity`).",
    )


class TopologySpreadConstraint(CamelModel):
    """How the workers spread across zones or nodes (the pod spec's field)."""

    rules = (
        Rule(
            "!has(self.minDomains) || self.whenUnsatisfiable == 'DoNotSchedule'",
            "minDomains needs whenUnsatisfiable DoNotSchedule",
            lambda c: c.min_domains is None or c.when_unsatisfiable == "DoNotSchedule",
        ),
    )

    max_skew: int = Field(ge=1, le=1000, description="Most workers one domain may have beyond another.")
    topology_key: LabelKey = Field(
        description="Node label that defines the domains, e.g. topology.kubernetes.io/zone."
    )
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="DoNotSchedule: keep the worker pending; ScheduleAnyway: prefer, do not require."
    )
    label_selector: dict[str, Any] | None = Field(
        default=None,
        json_schema_extra=_OPEN,
        description="Pods counted in each domain (a LabelSelector). Default: this resource's workers.",
    )
    match_label_keys: list[LabelKey] = Field(
        default_factory=list,
        max_length=16,
        description="Pod label keys whose values also select the counted pods (e.g. "
        "pod-template-hash: spread each rollout's pods).",
    )
    min_domains: int | None = Field(default=None, ge=1, le=1000, description="Fewest eligible domains.")
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether the pod's node affinity limits the domains."
    )
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether node taints limit the domains."
    )


class LocalObjectReference(CamelModel):
    name: ObjectName("a Secret") = Field(description="Name of the Secret.")
