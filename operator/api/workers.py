"""How each worker runs: its engine flags, its HTTP server and lifecycle, its compute, tensor
parallelism over GPUs or pods, and how a spec change replaces the workers (the rollout)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from kvscale.operator.api.validation import CamelModel, ObjectName, Quantity, Rule, checked


class EngineSpec(CamelModel):
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


MAX_GPUS = 8  # the most GPUs a node has: a pod's ranks share one node
GPUS_MESSAGE = (
    f"gpus must be at most {MAX_GPUS}: one pod's tensor-parallel ranks share one node, and no node "
    "has more; for a larger model set parallelism.nodes to spread the ranks over a group of pods"
)
Gpus = checked(int, Rule(f"self <= {MAX_GPUS}", GPUS_MESSAGE, lambda gpus: gpus <= MAX_GPUS), ge=0)


class ResourcesSpec(CamelModel):
    """Compute for each worker pod."""

    gpus: Gpus = Field(
        default=0,
        description="NVIDIA GPUs per worker pod (nvidia.com/gpu), at most 8. More than 1: the pod "
        "runs one tensor-parallel rank per GPU (--tensor-parallel-size gpus, unless parallelism "
        "says otherwise).",
    )
    cpu: Quantity("500m or 2") = Field(default="2", description="CPU request and limit per worker.")
    memory: Quantity("512Mi or 8Gi") = Field(
        default="8Gi", description="Memory request and limit per worker."
    )
    ephemeral_storage: Quantity("2Gi") = Field(
        default="2Gi",
        description="Local disk per worker: its ephemeral-storage request (the scheduler reserves "
        "it on the node) and the size limit of the /tmp emptyDir that holds the caches (the kubelet "
        "evicts a worker whose /tmp outgrows it).",
    )
    shared_memory: Quantity("1Gi") = Field(
        default="1Gi",
        description="Memory-backed /dev/shm per rank (torch's and NCCL's shared memory, the step "
        "inputs rank 0 hands the other ranks of its pod): the /dev/shm emptyDir of a GPU worker or a "
        "pod of several ranks is sized this times the pod's ranks; what it holds counts toward the "
        "memory limit.",
    )


MAX_TENSOR = 64
MAX_NODES = 16


class ParallelismSpec(CamelModel):
    """Tensor parallelism: one model split over `tensor` ranks, in groups of `nodes` pods."""

    rules = (
        Rule(
            "self.tensor % self.nodes == 0",
            "parallelism.tensor must be a multiple of parallelism.nodes: each pod of a group runs "
            "tensor / nodes ranks",
            lambda p: p.tensor % p.nodes == 0,
        ),
    )

    tensor: int = Field(
        ge=1,
        le=MAX_TENSOR,
        description="Tensor-parallel size: the ranks one copy of the model is split over (each holds "
        "1/tensor of the attention heads and MLP; it must divide the model's heads or their KV "
        "heads, which the worker checks at start).",
    )
    nodes: int = Field(
        default=1,
        ge=1,
        le=MAX_NODES,
        description="Pods per group (one per node). 1: the ranks run in one pod (a Deployment). "
        "More: a LeaderWorkerSet of groups of this many pods, tensor / nodes ranks in each, which "
        "needs the LeaderWorkerSet CRD and controller (leaderworkerset.x-k8s.io) in the cluster.",
    )


class ServerSpec(CamelModel):
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
    api_key_secret: ObjectName("a Secret") | None = Field(
        default=None,
        description="Name of a Secret whose key `api-key` the workers require as a Bearer token.",
    )


class RolloutSpec(CamelModel):
    """How a spec change replaces the workers (the Deployment's RollingUpdate)."""

    rules = (
        Rule(
            "self.maxSurge > 0 || self.maxUnavailable > 0",
            "maxSurge and maxUnavailable cannot both be 0: the rollout could never start",
            lambda r: r.max_surge > 0 or r.max_unavailable > 0,
        ),
    )

    max_surge: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Extra workers started above the wanted count during a rollout. 0 for a full "
        "GPU pool (with maxUnavailable 1: stop one old worker, then start its replacement).",
    )
    max_unavailable: int = Field(
        default=0,
        ge=0,
        le=1000,
        description="Workers below the wanted count allowed during a rollout.",
    )
