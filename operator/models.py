"""The InferenceDeployment resource (kvscale.dev/v1alpha1), modelled in pydantic.

These models are the single source of truth: `crds/` is generated from them (`kvscale-operator
crd`), the operator parses resources with them, and docs/operator.md's reference comes from their
descriptions. Field names are camelCase on the wire, as Kubernetes expects.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

GROUP, VERSION, KIND, PLURAL = "kvscale.dev", "v1alpha1", "InferenceDeployment", "inferencedeployments"
QUANTITY = r"^([+]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$"
URI = r"^(/|file:///|pvc://|builtin://)[^\s]*$"
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class ModelSpec(_Model):
    """Which model the workers load and the name clients ask for."""

    uri: str = Field(
        pattern=URI,
        max_length=1024,
        description="Where the model folder is: an absolute path inside the worker container "
        "(`/models/llama`, also `file:///models/llama`), or `pvc://CLAIM/SUBPATH` to mount a "
        "PersistentVolumeClaim read-only at /models/CLAIM and load SUBPATH from it. The folder is a "
        "Hugging Face model folder (config.json, tokenizer, safetensors). `builtin://tiny-llama` is a "
        "tiny random model each worker builds at start (no download; for trying things out).",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="The model name clients pass as `model` in OpenAI requests. Default: the "
        "resource's name.",
    )


class SpeculativeSpec(_Model):
    """Speculative decoding: a cheap proposer guesses tokens, the model verifies them in one pass."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "self.method != 'draft' || has(self.draftModelUri)", "method draft needs draftModelUri"
        )
    )

    method: Literal["draft", "ngram"] = Field(
        description="`draft`: a small model with the same tokenizer proposes; `ngram`: tokens that "
        "followed the last n tokens earlier in the prompt or output are proposed (no model)."
    )
    draft_model_uri: str | None = Field(
        default=None,
        pattern=URI,
        max_length=1024,
        description="The draft model for method `draft`, in the same forms as model.uri.",
    )
    num_speculative_tokens: int = Field(
        default=4, ge=1, le=16, description="Tokens proposed per step (the lookahead k)."
    )


class EngineSpec(_Model):
    """Engine settings of each worker (the flags of `kvscale-worker serve`)."""

    block_size: Literal[8, 16, 32, 64, 128] = Field(default=16, description="Tokens per KV-cache block.")
    max_num_seqs: int = Field(default=256, ge=1, le=4096, description="Most sequences in one batch.")
    max_num_batched_tokens: int = Field(
        default=2048,
        ge=1,
        le=1_048_576,
        description="Token budget of one engine step (prefill is chunked to it).",
    )
    max_model_len: int | None = Field(
        default=None,
        ge=1,
        le=1_048_576,
        description="Longest prompt + completion. Default: the model's limit.",
    )
    kv_cache_memory_fraction: float | None = Field(
        default=None,
        gt=0.0,
        le=1.0,
        description="Share of the device memory left after the weights that the KV cache takes. "
        "Default: 0.9 on GPUs; on CPU a 4 GiB budget.",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse KV blocks of shared prompt prefixes."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights and KV dtype. auto: the checkpoint's on GPU, float32 on CPU."
    )
    extra_args: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list,
        max_length=64,
        description="More `kvscale-worker serve` flags, passed as they are.",
    )


class ResourcesSpec(_Model):
    """Compute for each worker pod."""

    gpus: int = Field(default=0, ge=0, le=16, description="NVIDIA GPUs per worker (nvidia.com/gpu).")
    cpu: str = Field(default="2", pattern=QUANTITY, description="CPU request and limit per worker.")
    memory: str = Field(default="8Gi", pattern=QUANTITY, description="Memory request and limit per worker.")


class AutoscalingSpec(_Model):
    """Scale workers on KV-cache occupancy and queue depth (the operator's own autoscaler)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "self.minReplicas <= self.maxReplicas", "minReplicas must not exceed maxReplicas"
        )
    )

    min_replicas: int = Field(default=1, ge=1, le=1000, description="Fewest workers.")
    max_replicas: int = Field(ge=1, le=1000, description="Most workers.")
    target_kv_cache_usage: float = Field(
        default=0.5,
        gt=0.0,
        le=1.0,
        description="KV-cache occupancy per worker to aim for (0-1). Headroom above it absorbs "
        "bursts while new workers load.",
    )
    target_queue_length: float = Field(
        default=2.0,
        ge=0.0,
        le=10_000.0,
        description="Waiting requests per worker to aim for (0: scale on KV-cache usage alone).",
    )
    scale_up_stabilization_seconds: int = Field(
        default=4,
        ge=0,
        le=3600,
        description="Scale up only when the signals stayed above target this long (the lowest "
        "recommendation in the window wins), so a single burst does not add workers.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=60,
        ge=0,
        le=86_400,
        description="Scale down only when the load fitted on fewer workers this whole time (the "
        "highest recommendation in the window wins).",
    )
    max_scale_up_step: int = Field(
        default=4, ge=1, le=1000, description="Most workers added by one decision."
    )
    max_scale_down_step: int = Field(
        default=1, ge=1, le=1000, description="Most workers removed by one decision."
    )


class ServerSpec(_Model):
    """The worker's HTTP server and lifecycle."""

    drain_timeout_seconds: int = Field(
        default=30, ge=1, le=3600, description="After SIGTERM, how long in-flight requests may finish."
    )
    startup_timeout_seconds: int = Field(
        default=600,
        ge=10,
        le=86_400,
        description="How long a worker may take to load its model before restart.",
    )
    api_key_secret: str | None = Field(
        default=None,
        max_length=253,
        description="Name of a Secret whose key `api-key` the workers require as a Bearer token.",
    )


class KeyRef(_Model):
    name: str = Field(max_length=253, description="Name of the Secret or ConfigMap.")
    key: str = Field(max_length=253, description="Key within it.")


class EnvSource(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "set exactly one of secretKeyRef, configMapKeyRef",
        )
    )

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


class EnvVar(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "has(self.value) != has(self.valueFrom)", "set exactly one of value, valueFrom"
        )
    )

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256, description="Variable name.")
    value: str | None = Field(default=None, description="Literal value.")
    value_from: EnvSource | None = Field(default=None, description="Value from a Secret or ConfigMap key.")


class Toleration(_Model):
    key: str | None = Field(default=None, description="Taint key (empty with operator Exists: all taints).")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str | None = Field(default=None, description="Taint value for Equal.")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to tolerate (empty: all)."
    )
    toleration_seconds: int | None = Field(
        default=None, ge=0, description="How long a NoExecute taint is tolerated."
    )


class InferenceDeploymentSpec(_Model):
    """An autoscaled, OpenAI-compatible model endpoint: worker pods, a Service and a disruption budget."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            "!(has(self.replicas) && has(self.autoscaling))",
            "set either replicas or autoscaling, not both",
        )
    )

    model: ModelSpec = Field(description="The model to serve.")
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (optional).")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings of each worker.")
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Compute for each worker.")
    image: str | None = Field(
        default=None,
        max_length=512,
        description="Worker image. Default: the operator's configured worker image.",
    )
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="A fixed number of workers (default 1). Mutually exclusive with autoscaling; this is "
        "also the field the scale subresource (HPA, KEDA, kubectl scale) sets.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None, description="Let the operator scale workers. Mutually exclusive with replicas."
    )
    server: ServerSpec = Field(
        default_factory=ServerSpec, description="HTTP server and lifecycle of the workers."
    )
    node_selector: dict[str, Annotated[str, Field(max_length=63)]] = Field(
        default_factory=dict, description="Node labels the worker pods require."
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the workers tolerate."
    )
    env: list[EnvVar] = Field(
        default_factory=list, max_length=64, description="Extra environment variables of the workers."
    )

    @property
    def desired_replicas(self) -> int | None:
        """The replica count the operator writes; None when the autoscaler owns it."""
        if self.autoscaling is not None:
            return None
        return 1 if self.replicas is None else self.replicas


class Condition(_Model):
    type: Literal["Ready", "Progressing", "Degraded", "ScalingActive"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase reason.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: str | None = Field(default=None, description="When status last changed (RFC 3339).")
    observed_generation: int | None = Field(
        default=None, description="The generation this condition reflects."
    )


class ScalingDecision(_Model):
    time: str = Field(description="When (RFC 3339).")
    from_replicas: int = Field(description="Workers before.")
    to_replicas: int = Field(description="Workers after.")
    reason: str = Field(description="Why, with the signals that decided it.")


class AutoscalingStatus(_Model):
    """What the autoscaler saw at its last scrape and what it did recently."""

    desired_replicas: int | None = Field(default=None, description="Workers the autoscaler wants.")
    ready_workers: int = Field(default=0, description="Ready workers scraped.")
    starting_workers: int = Field(default=0, description="Workers not ready yet (loading).")
    unreadable_workers: int = Field(
        default=0,
        description="Ready workers whose metrics could not be read at the last scrape (counted as "
        "exactly at target; no scale-down while any is).",
    )
    lookahead_seconds: float = Field(
        default=0.0,
        description="How far ahead a rising arrival rate is projected: the workers' median startup "
        "(container start to first Ready), at most server.startupTimeoutSeconds.",
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


class InferenceDeploymentStatus(_Model):
    """What the operator observed; written by the operator only."""

    model_config = ConfigDict(extra="allow")  # kopf keeps its bookkeeping under status.kopf

    observed_generation: int | None = Field(default=None, description="The spec generation last acted on.")
    replicas: int = Field(default=0, description="Worker pods (all versions).")
    ready_replicas: int = Field(default=0, description="Worker pods passing their readiness probe.")
    updated_replicas: int = Field(default=0, description="Worker pods of the current spec.")
    ready: str = Field(default="0/0", description="Ready / desired workers, for `kubectl get`.")
    selector: str = Field(
        default="", description="Label selector of the worker pods (for the scale subresource)."
    )
    kv_cache_usage: float | None = Field(
        default=None, description="Mean KV-cache occupancy of the ready workers (0-1)."
    )
    autoscaling: AutoscalingStatus | None = Field(
        default=None, description="The autoscaler's signals and its last decisions."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Progressing, Degraded, ScalingActive."
    )


class InferenceDeployment(_Model):
    model_config = ConfigDict(extra="ignore")

    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)
