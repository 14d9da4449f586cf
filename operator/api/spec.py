"""The InferenceDeployment resource (kvscale.dev/v1alpha1), modelled in pydantic: its spec, made of
the parts in this package (model.py, workers.py, autoscaling.py, routing.py, pod.py).

These models are the single source of truth: `crds/` is generated from them (`kvscale-operator
crd`), the operator parses resources with them, and docs/operator.md's reference comes from their
descriptions. Field names are camelCase on the wire, as Kubernetes expects.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvscale.operator.api.autoscaling import AutoscalingSpec
from kvscale.operator.api.compile_cache import CompileCacheSpec
from kvscale.operator.api.lora import MAX_ADAPTERS, AdapterSpec, LoRASpec
from kvscale.operator.api.model import ModelSpec, SpeculativeSpec
from kvscale.operator.api.pod import (
    Affinity,
    EnvVar,
    LocalObjectReference,
    PodMetadata,
    Toleration,
    TopologySpreadConstraint,
)
from kvscale.operator.api.routing import InferencePoolSpec, RouterSpec
from kvscale.operator.api.validation import CamelModel, LabelMap, ObjectName, Rule, list_map, unique
from kvscale.operator.api.workers import EngineSpec, ParallelismSpec, ResourcesSpec, RolloutSpec, ServerSpec

AUTOSCALED_REPLICAS_MESSAGE = (
    "with autoscaling the operator's autoscaler sets the worker count: leave replicas out "
    "(kubectl scale, an HPA or KEDA cannot scale this resource; change autoscaling.minReplicas "
    "and maxReplicas, or remove autoscaling to scale by hand)"
)


class InferenceDeploymentSpec(CamelModel):
    """An autoscaled, OpenAI-compatible model endpoint: worker pods, a Service and a disruption budget."""

    rules = (
        # `replicas` defaults to 1 (the scale subresource needs it on every object: the API
        # server's GET /scale fails when it is absent), so with autoscaling it must stay at its
        # default: a kubectl scale, HPA or KEDA write is refused here, not silently ignored.
        Rule(
            "!has(self.autoscaling) || !has(self.replicas) || self.replicas == 1",
            AUTOSCALED_REPLICAS_MESSAGE,
            lambda s: s.autoscaling is None or s.replicas == 1,
        ),
        # At zero workers only the router sees a request arrive, and only it asks for a worker.
        Rule(
            "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || "
            "self.autoscaling.minReplicas > 0 || !has(self.router) || !has(self.router.enabled) || "
            "self.router.enabled",
            "autoscaling.minReplicas 0 needs the router (router.enabled): at zero workers only the "
            "router sees a request arrive and asks for a worker",
            lambda s: s.autoscaling is None or s.autoscaling.min_replicas > 0 or s.router.enabled,
        ),
        # A shared router is a router: with it off, the endpoint would never hear of this model.
        Rule(
            "!has(self.router) || !has(self.router.endpoint) || !has(self.router.enabled) || "
            "self.router.enabled",
            "router.endpoint needs router.enabled: the endpoint's router is this model's router",
            lambda s: s.router.endpoint is None or s.router.enabled,
        ),
        # With GPUs a rank is a GPU: a pod's ranks and its GPUs are one number.
        Rule(
            "!has(self.parallelism) || !has(self.resources) || !has(self.resources.gpus) || "
            "self.resources.gpus == 0 || "
            "self.resources.gpus * self.parallelism.nodes == self.parallelism.tensor",
            "resources.gpus must be parallelism.tensor / parallelism.nodes: each pod runs one rank "
            "per GPU (or set gpus 0 for CPU ranks)",
            lambda s: s.parallelism is None or s.resources.gpus in (0, s.ranks_per_pod),
        ),
        # The router wakes a scaled-to-zero resource through a Deployment's /scale.
        Rule(
            "!has(self.parallelism) || self.parallelism.nodes == 1 || !has(self.autoscaling) || "
            "!has(self.autoscaling.minReplicas) || self.autoscaling.minReplicas > 0",
            "autoscaling.minReplicas 0 is not supported with parallelism.nodes above 1: the router "
            "wakes a scaled-to-zero Deployment, not a LeaderWorkerSet group",
            lambda s: s.nodes == 1 or s.autoscaling is None or s.autoscaling.min_replicas > 0,
        ),
        # The worker refuses both (worker/config.py): said here, at apply time, not in a crash loop.
        Rule(
            "!has(self.adapters) || size(self.adapters) == 0 || !has(self.speculative)",
            "adapters cannot be combined with speculative decoding: the proposer would guess without "
            "the adapter (the worker refuses it)",
            lambda s: not s.adapters or s.speculative is None,
        ),
        Rule(
            "!has(self.adapters) || size(self.adapters) == 0 || ((!has(self.parallelism) || "
            "self.parallelism.tensor == 1) && (!has(self.resources) || !has(self.resources.gpus) || "
            "self.resources.gpus <= 1))",
            "adapters need tensor parallelism 1 (one rank per copy of the model) for now",
            lambda s: not s.adapters or s.tensor_parallel_size == 1,
        ),
        # The operator would have to read the API key's Secret to call the load endpoints.
        Rule(
            "!has(self.lora) || !has(self.lora.dynamicLoading) || !self.lora.dynamicLoading || "
            "!has(self.server) || !has(self.server.apiKeySecret)",
            "lora.dynamicLoading is not supported with server.apiKeySecret: the operator does not "
            "read Secrets, so it cannot call the workers' load endpoints; leave dynamicLoading off "
            "(adapter changes then roll the workers out)",
            lambda s: not s.lora.dynamic_loading or s.server.api_key_secret is None,
        ),
    )

    model: ModelSpec = Field(description="The model to serve.")
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (optional).")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings of each worker.")
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=MAX_ADAPTERS,
        json_schema_extra=list_map("name"),
        description="LoRA adapters of the model, each selected by a request's `model` "
        "(docs/lora.md); status.adapters says where each one is served.",
    )
    lora: LoRASpec = Field(
        default_factory=LoRASpec, description="How the workers hold the adapters (with adapters only)."
    )
    compile_cache: CompileCacheSpec | None = Field(
        default=None,
        description="A volume the workers share for their compiled forward (optional). Default: each "
        "pod compiles into its own /tmp, behind the eager forward, unless the image ships the model's "
        "package.",
    )
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec, description="Compute for each worker.")
    parallelism: ParallelismSpec | None = Field(
        default=None,
        description="Tensor parallelism over several GPUs or pods. Default: resources.gpus ranks "
        "in one pod (1 without GPUs). See docs/parallelism.md.",
    )
    image: str | None = Field(
        default=None,
        pattern=r"^\S+$",
        max_length=512,
        description="Worker image. Default: the operator's configured worker image.",
    )
    replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="A fixed number of workers (of groups, with parallelism.nodes above 1): the "
        "field the scale subresource reads and sets (kubectl scale, an HPA, KEDA). Leave it out of "
        "applied manifests when one of those scales the resource. Ignored, and left at its default, "
        "with autoscaling.",
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description="Let the operator scale workers (replicas is then left out: the autoscaler owns "
        "the count).",
    )
    server: ServerSpec = Field(
        default_factory=ServerSpec, description="HTTP server and lifecycle of the workers."
    )
    router: RouterSpec = Field(
        default_factory=RouterSpec, description="The router in front of the workers (on by default)."
    )
    inference_pool: InferencePoolSpec = Field(
        default_factory=InferencePoolSpec,
        description="A Gateway API Inference Extension InferencePool for the workers.",
    )
    rollout: RolloutSpec = Field(
        default_factory=RolloutSpec,
        description="How spec changes replace the workers. Default: start one new worker before "
        "stopping an old one.",
    )
    node_selector: LabelMap = Field(default_factory=dict, description="Node labels the worker pods require.")
    tolerations: list[Toleration] = Field(
        default_factory=list, max_length=32, description="Taints the workers tolerate."
    )
    affinity: Affinity | None = Field(default=None, description="Scheduling affinity of the workers.")
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(
        default_factory=list,
        max_length=8,
        json_schema_extra=list_map("topologyKey", "whenUnsatisfiable"),
        description="How the workers spread across zones or nodes.",
    )
    priority_class_name: ObjectName("a PriorityClass") | None = Field(
        default=None, description="PriorityClass of the worker pods."
    )
    runtime_class_name: ObjectName("a RuntimeClass") | None = Field(
        default=None,
        description="RuntimeClass of the worker pods, e.g. `nvidia` where the NVIDIA container "
        "runtime is not the node's default.",
    )
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list,
        max_length=16,
        json_schema_extra=list_map("name"),
        description="Secrets to pull the worker image with.",
    )
    pod_metadata: PodMetadata = Field(
        default_factory=PodMetadata, description="Labels and annotations of the worker pods."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=list_map("name"),
        description="Extra environment variables of the workers.",
    )

    @field_validator("env")
    @classmethod
    def _env_namesunique(cls, env: list[EnvVar]) -> list[EnvVar]:
        return unique(env, lambda v: v.name, "env names")

    @field_validator("adapters")
    @classmethod
    def _adapters_unique(cls, adapters: list[AdapterSpec]) -> list[AdapterSpec]:
        return unique(adapters, lambda a: a.name, "adapter names")

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secretsunique(cls, refs: list[LocalObjectReference]) -> list[LocalObjectReference]:
        return unique(refs, lambda r: r.name, "imagePullSecrets names")

    @field_validator("topology_spread_constraints")
    @classmethod
    def _spreadunique(cls, cs: list[TopologySpreadConstraint]) -> list[TopologySpreadConstraint]:
        return unique(
            cs, lambda c: (c.topology_key, c.when_unsatisfiable), "topologyKey, whenUnsatisfiable pairs"
        )

    @property
    def desired_replicas(self) -> int | None:
        """The replica count the operator writes; None when the autoscaler owns it."""
        return None if self.autoscaling is not None else self.replicas

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks one copy of the model runs on: parallelism.tensor, else one per GPU (at least 1)."""
        if self.parallelism is not None:
            return self.parallelism.tensor
        return max(1, self.resources.gpus)

    @property
    def nodes(self) -> int:
        """Pods per copy of the model (a LeaderWorkerSet group when above 1)."""
        return self.parallelism.nodes if self.parallelism is not None else 1

    @property
    def ranks_per_pod(self) -> int:
        return self.tensor_parallel_size // self.nodes
