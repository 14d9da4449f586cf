"""What fronts the workers: the router (kvscale-router) and a Gateway API Inference Extension
InferencePool."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvscale.operator.api.validation import (
    DNS_LABEL,
    NAME_MAX,
    CamelModel,
    ObjectName,
    Quantity,
    Rule,
    checked,
    matches,
)

# An InferenceEndpoint's name names its Service too: a DNS label (NAME_RULE's grammar).
EndpointName = checked(
    str,
    Rule(
        f"self.matches(r'{DNS_LABEL}')",
        "must be the name of an InferenceEndpoint: lowercase letters, digits and '-', starting "
        "with a letter and ending with a letter or digit",
        matches(DNS_LABEL),
    ),
    min_length=1,
    max_length=NAME_MAX,
)


class RouterSettings(CamelModel):
    """A router's pods and how it knows the workers' caches: the settings an InferenceDeployment's
    own router and a shared InferenceEndpoint's have in common."""

    replicas: int = Field(
        default=2,
        ge=1,
        le=100,
        description="Router pods (2: one keeps serving while the other restarts or is evicted; "
        "its PodDisruptionBudget lets one go at a time).",
    )
    image: str | None = Field(
        default=None,
        pattern=r"^\S+$",
        max_length=512,
        description="Router image. Default: the operator's configured router image.",
    )
    cpu: Quantity("500m or 2") = Field(
        default="1", description="CPU limit per router pod (its request: 100m, or the limit when lower)."
    )
    memory: Quantity("256Mi") = Field(default="256Mi", description="Memory request and limit per router pod.")
    prefix_index: Literal["precise", "approximate"] = Field(
        default="precise",
        description="How the router knows what each worker has cached. precise: the workers "
        "publish their KV-cache events (vLLM's format, ports 5557 and 5558) and every router "
        "replica keeps their exact index, tokenizing with the model's tokenizer fetched from a "
        "worker (about 40 MB more router memory). approximate: the router remembers where it "
        "sent each prompt's leading characters (no events, no tokenizer). docs/router.md.",
    )


class RouterSpec(RouterSettings):
    """The router in front of the workers (kvscale-router): per-request picking by prefix
    affinity, KV usage and queue depth, flow control, scale from zero."""

    enabled: bool = Field(
        default=True,
        description="Deploy the router and its Service (NAME-router). Off: clients use the "
        "workers' Service, and minReplicas 0 has nothing to wake the workers.",
    )
    endpoint: EndpointName | None = Field(
        default=None,
        description="Serve this model behind the shared router of the InferenceEndpoint of this "
        "name (same namespace), beside the other models that name it, instead of a router of its "
        "own: one URL for many models, `model` in the request picks the workers. The other "
        "router fields are then the endpoint's (its spec.router); prefixIndex still says whether "
        "these workers publish KV events. docs/operator.md.",
    )


class EndpointPickerRef(CamelModel):
    """A Gateway API Inference Extension endpoint picker (EPP) Service for the InferencePool."""

    name: ObjectName("a Service") = Field(description="The endpoint picker's Service.")
    port: int = Field(default=9002, ge=1, le=65535, description="Its ext_proc port (GIE's default).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the picker does not answer (GIE's field).",
    )


class InferencePoolSpec(CamelModel):
    """The InferencePool (inference.networking.k8s.io/v1) applied where its CRD is installed."""

    enabled: bool = Field(
        default=True, description="Apply an InferencePool selecting the workers where the CRD is installed."
    )
    endpoint_picker: EndpointPickerRef | None = Field(
        default=None,
        description="The pool's endpointPickerRef: a GIE endpoint picker deployed for this pool. "
        "Unset: none (most gateways then refuse the pool until one is set; docs/router.md).",
    )
