"""The InferenceDeployment resource (kvscale.dev/v1alpha1), modelled in pydantic.

These models are the single source of truth: `crds/` is generated from them (`kvscale-operator
crd`), the operator parses resources with them, and docs/operator.md's reference comes from their
descriptions. Field names are camelCase on the wire, as Kubernetes expects.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP, VERSION, KIND, PLURAL = "kvscale.dev", "v1alpha1", "InferenceDeployment", "inferencedeployments"

# Kubernetes' own name and value grammars (k8s.io/apimachinery/pkg/util/validation), written so
# that RE2 (CEL's `matches`, in the API server) and Python's `re` read them the same way.
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"  # RFC 1035: Service names
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"  # most object names
LABEL_KEY = (  # a qualified name: an optional DNS-subdomain prefix and `/`, a name of at most 63
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"  # and at most 63 characters
CONFIG_KEY = r"^[-._a-zA-Z0-9]+$"  # a key of a Secret or ConfigMap
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"
# resource.Quantity's grammar (ParseQuantity): a signed decimal, then a binary-SI, decimal-SI or
# integer-exponent suffix. CEL's isQuantity() is the API server's check; this is the models'.
QUANTITY = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?[0-9]+)?$"
# Model sources. pvc:// takes a claim name (a DNS subdomain) and an optional path in it; hf://
# a Hub repository id (ORG/NAME, the Hub's grammar: letters, digits, '-', '_', '.', not starting or
# ending with '-' or '.') and an optional @REVISION (a branch, tag or commit hash).
URI = r"^(/|file:///|pvc://|builtin://|hf://)[^\s]*$"
_HF_PART = r"[A-Za-z0-9_]([-A-Za-z0-9_.]{0,94}[A-Za-z0-9_])?"
HF_URI = rf"^hf://{_HF_PART}/{_HF_PART}(@[A-Za-z0-9_]([-A-Za-z0-9_./]{{0,253}}[A-Za-z0-9_])?)?$"
HF_ENDPOINT = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"
PVC_URI = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*(/[^\s]*)?$"
DOT_DOT = r"(^|/)\.\.(/|$)"
NAME_MAX = 63  # the resource's name is a label value and the Service's name


@dataclass(frozen=True)
class Rule:
    """One validation rule, twice: CEL for the API server (refused at apply, with `message`) and
    Python for the models (specs stored under an older CRD, and the unit tests)."""

    cel: str
    message: str
    check: Callable[[Any], bool]
    optional_old_self: bool = False  # `oldSelf` is an optional: none on create

    def schema(self) -> dict[str, Any]:
        out: dict[str, Any] = {"rule": self.cel, "message": self.message}
        if self.optional_old_self:
            out["optionalOldSelf"] = True
        return out


@functools.cache
def _compiled(pattern: str) -> re.Pattern[str]:
    # RE2's `$` (CEL's `matches`) is the end of the text; Python's also matches before a final
    # newline. `\Z` is RE2's `$` in Python.
    return re.compile(pattern.replace("$", r"\Z"))


def search(pattern: str, value: str) -> bool:
    """CEL's `value.matches(pattern)`, in Python."""
    return _compiled(pattern).search(value) is not None


def _matches(pattern: str) -> Callable[[Any], bool]:
    return lambda value: search(pattern, value)


def _cel(*rules: Rule) -> dict[str, Any]:
    return {"x-kubernetes-validations": [r.schema() for r in rules]}


def _checked(base: Any, *rules: Rule, **field: Any) -> Any:
    """`base` with `rules`: in the CRD as x-kubernetes-validations, in the models as a validator."""

    def validate(value: Any) -> Any:
        for rule in rules:
            if not rule.check(value):
                raise ValueError(rule.message)
        return value

    return Annotated[base, Field(json_schema_extra=_cel(*rules), **field), AfterValidator(validate)]


def _quantity_positive(value: str) -> bool:
    match = _compiled(QUANTITY).search(value)
    return match is not None and not value.startswith("-") and float(match.group(1)) > 0


def Quantity(what: str) -> Any:
    return _checked(
        str,
        Rule(
            # isGreaterThan, not sign(): measured on kube-apiserver v1.37, checking a field's
            # default against the rule finds "no matching overload for 'sign'" and refuses the CRD.
            "isQuantity(self) && quantity(self).isGreaterThan(quantity('0'))",
            f"must be a positive Kubernetes quantity such as {what}",
            _quantity_positive,
        ),
        max_length=64,
    )


def ObjectName(what: str, max_length: int = 253) -> Any:
    return _checked(
        str,
        Rule(
            f"self.matches(r'{DNS_SUBDOMAIN}')",
            f"must be the name of {what}: lowercase letters, digits, '-' and '.', starting and "
            "ending with a letter or digit",
            _matches(DNS_SUBDOMAIN),
        ),
        min_length=1,
        max_length=max_length,
    )


LabelValue = _checked(
    str,
    Rule(
        f"self.matches(r'{LABEL_VALUE}')",
        "must be a label value: at most 63 letters, digits, '-', '_' and '.', starting and ending "
        "with a letter or digit",
        _matches(LABEL_VALUE),
    ),
    max_length=63,
)

_KEYS_RULE = Rule(
    f"self.all(k, size(k) <= 317 && k.matches(r'{LABEL_KEY}'))",
    "keys must be label keys: an optional DNS-subdomain prefix and '/', then at most 63 letters, "
    "digits, '-', '_' and '.', starting and ending with a letter or digit",
    lambda m: all(len(k) <= 317 and search(LABEL_KEY, k) for k in m),
)
# A map whose keys are label keys (node selectors, pod labels and annotations).
LabelMap = _checked(dict[str, LabelValue], _KEYS_RULE, max_length=64)

# The resource's name becomes the children's names, the Service's (a DNS-1035 label) included,
# and a label value on every worker (at most 63). A rule on metadata.name must sit at the root,
# where every status write runs it too: checked on create only (a name never changes), so a
# resource created under an older CRD still takes status writes.
NAME_RULE = Rule(
    f"oldSelf.hasValue() || (size(self.metadata.name) <= {NAME_MAX} && "
    f"self.metadata.name.matches(r'{DNS_LABEL}'))",
    f"metadata.name must be at most {NAME_MAX} lowercase letters, digits and '-', starting with a "
    "letter and ending with a letter or digit: it names the workers' Service and is a label value",
    lambda name: len(name) <= NAME_MAX and search(DNS_LABEL, name),
    optional_old_self=True,
)


def name_problem(name: str) -> str | None:
    """Why a resource's name cannot name its children (None: it can). The CRD refuses such names;
    this is for resources stored under an older CRD."""
    return None if NAME_RULE.check(name) else NAME_RULE.message


class _Model(BaseModel):
    """camelCase on the wire; `rules` are object-level rules, in the CRD and in the models."""

    rules: ClassVar[tuple[Rule, ...]] = ()

    @staticmethod
    def _rules_schema(schema: dict[str, Any], cls: type) -> None:
        if getattr(cls, "rules", ()):
            schema.update(_cel(*cls.rules))

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        json_schema_extra=_rules_schema,
    )

    @model_validator(mode="after")
    def _check_rules(self) -> _Model:
        for rule in type(self).rules:
            if not rule.check(self):
                raise ValueError(rule.message)
        return self


Uri = _checked(
    str,
    Rule(
        f"self.matches(r'{URI}')",
        "must be an absolute path, file:///PATH, pvc://CLAIM/PATH, hf://ORG/NAME[@REVISION] or "
        "builtin://NAME",
        _matches(URI),
    ),
    Rule(
        f"!self.startsWith('pvc://') || self.matches(r'{PVC_URI}')",
        "pvc:// needs the name of a PersistentVolumeClaim (lowercase letters, digits, '-' and '.'), "
        "as in pvc://CLAIM/PATH",
        lambda v: not v.startswith("pvc://") or search(PVC_URI, v),
    ),
    Rule(
        r"!self.matches(r'^pvc://[^/]{254,}')",
        "the claim name in pvc://CLAIM/PATH must be at most 253 characters",
        lambda v: not search(r"^pvc://[^/]{254,}", v),
    ),
    Rule(
        f"!self.matches(r'{DOT_DOT}')",
        "must not contain '..' path segments",
        lambda v: not search(DOT_DOT, v),
    ),
    Rule(
        f"!self.startsWith('hf://') || (self.matches(r'{HF_URI}') && !self.contains('..') && "
        "!self.matches(r'^hf://[^@]*--'))",
        "hf:// needs a Hugging Face repository, as in hf://ORG/NAME or hf://ORG/NAME@REVISION: ORG and "
        "NAME of letters, digits, '-', '_' and '.' (no '--' or '..'), a REVISION (branch, tag or commit) "
        "after '@' if any",
        lambda v: (
            not v.startswith("hf://") or (search(HF_URI, v) and ".." not in v and "--" not in v.split("@")[0])
        ),
    ),
    max_length=1024,
)


def is_hf(uri: str | None) -> bool:
    return uri is not None and uri.startswith("hf://")


class SecretKeyRef(_Model):
    name: ObjectName("a Secret") = Field(description="Name of the Secret.")
    key: str = Field(
        default="HF_TOKEN", pattern=CONFIG_KEY, min_length=1, max_length=253, description="Key within it."
    )


class ModelSpec(_Model):
    """Which model the workers load and the name clients ask for."""

    uri: Uri = Field(
        description="Where the model folder is: an absolute path inside the worker container "
        "(`/models/llama`, also `file:///models/llama`), or `pvc://CLAIM/SUBPATH` to mount a "
        "PersistentVolumeClaim read-only at /models/CLAIM and load SUBPATH from it, or "
        "`hf://ORG/NAME[@REVISION]` to download that Hugging Face Hub snapshot (default revision: "
        "main; a commit hash pins it) in an init container before the worker starts. The folder is a "
        "Hugging Face model folder (config.json, tokenizer, safetensors). `builtin://tiny-llama` is a "
        "tiny random model each worker builds at start (no download; for trying things out).",
    )
    hf_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="For hf:// models (and an hf:// draft model): the Secret key holding a Hub token "
        "(default key HF_TOKEN), given to the download as HF_TOKEN. Needed for gated and private "
        "repositories.",
    )
    hf_endpoint: str | None = Field(
        default=None,
        pattern=HF_ENDPOINT,
        max_length=512,
        description="For hf:// models: the Hub's URL (HF_ENDPOINT), e.g. a mirror or a proxy such as "
        "https://hf-mirror.example.com. Default: https://huggingface.co.",
    )
    cache_claim: ObjectName("a PersistentVolumeClaim") | None = Field(
        default=None,
        description="For hf:// models: a PersistentVolumeClaim to download into, shared by the "
        "workers (ReadWriteMany across nodes): a snapshot already complete there is not fetched "
        "again. Default: an emptyDir per pod, sized by cacheSize.",
    )
    cache_size: Quantity("20Gi") = Field(
        default="20Gi",
        description="For hf:// models without cacheClaim: the size limit of the emptyDir the "
        "snapshot is downloaded into (the kubelet evicts a pod whose download outgrows it).",
    )
    served_name: str | None = Field(
        default=None,
        max_length=256,
        description="The model name clients pass as `model` in OpenAI requests. Default: the "
        "resource's name.",
    )


class SpeculativeSpec(_Model):
    """Speculative decoding: a cheap proposer guesses tokens, the model verifies them in one pass."""

    rules = (
        Rule(
            "self.method != 'draft' || has(self.draftModelUri)",
            "method draft needs draftModelUri",
            lambda s: s.method != "draft" or s.draft_model_uri is not None,
        ),
    )

    method: Literal["draft", "ngram"] = Field(
        description="`draft`: a small model with the same tokenizer proposes; `ngram`: tokens that "
        "followed the last n tokens earlier in the prompt or output are proposed (no model)."
    )
    draft_model_uri: Uri | None = Field(
        default=None,
        description="The draft model for method `draft`, in the same forms as model.uri (an hf:// "
        "one uses model's hfTokenSecret, hfEndpoint and cache).",
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


MAX_GPUS = 8  # the most GPUs a node has: a pod's ranks share one node
GPUS_MESSAGE = (
    f"gpus must be at most {MAX_GPUS}: one pod's tensor-parallel ranks share one node, and no node "
    "has more; for a larger model set parallelism.nodes to spread the ranks over a group of pods"
)
Gpus = _checked(int, Rule(f"self <= {MAX_GPUS}", GPUS_MESSAGE, lambda gpus: gpus <= MAX_GPUS), ge=0)


class ResourcesSpec(_Model):
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


class ParallelismSpec(_Model):
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


class AutoscalingSpec(_Model):
    """Scale workers on KV-cache occupancy and queue depth (the operator's own autoscaler)."""

    rules = (
        Rule(
            "self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas",
            lambda s: s.min_replicas <= s.max_replicas,
        ),
    )

    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        description="Fewest workers. 0: an idle resource scales to zero (after "
        "scaleToZeroAfterSeconds) and its router asks for a worker when a request arrives.",
    )
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
    scale_to_zero_after_seconds: int = Field(
        default=300,
        ge=0,
        le=86_400,
        description="With minReplicas 0: scale to zero once nothing arrived, queued or ran this "
        "long (the router's counts and the workers' alike).",
    )


class RouterSpec(_Model):
    """The router in front of the workers (kvscale-router): per-request picking by prefix
    affinity, KV usage and queue depth, flow control, scale from zero."""

    enabled: bool = Field(
        default=True,
        description="Deploy the router and its Service (NAME-router). Off: clients use the "
        "workers' Service, and minReplicas 0 has nothing to wake the workers.",
    )
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


class EndpointPickerRef(_Model):
    """A Gateway API Inference Extension endpoint picker (EPP) Service for the InferencePool."""

    name: ObjectName("a Service") = Field(description="The endpoint picker's Service.")
    port: int = Field(default=9002, ge=1, le=65535, description="Its ext_proc port (GIE's default).")
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the picker does not answer (GIE's field).",
    )


class InferencePoolSpec(_Model):
    """The InferencePool (inference.networking.k8s.io/v1) applied where its CRD is installed."""

    enabled: bool = Field(
        default=True, description="Apply an InferencePool selecting the workers where the CRD is installed."
    )
    endpoint_picker: EndpointPickerRef | None = Field(
        default=None,
        description="The pool's endpointPickerRef: a GIE endpoint picker deployed for this pool. "
        "Unset: none (most gateways then refuse the pool until one is set; docs/router.md).",
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
    api_key_secret: ObjectName("a Secret") | None = Field(
        default=None,
        description="Name of a Secret whose key `api-key` the workers require as a Bearer token.",
    )


class KeyRef(_Model):
    name: ObjectName("a Secret or ConfigMap") = Field(description="Name of the Secret or ConfigMap.")
    key: str = Field(pattern=CONFIG_KEY, min_length=1, max_length=253, description="Key within it.")


class EnvSource(_Model):
    rules = (
        Rule(
            "has(self.secretKeyRef) != has(self.configMapKeyRef)",
            "set exactly one of secretKeyRef, configMapKeyRef",
            lambda s: (s.secret_key_ref is None) != (s.config_map_key_ref is None),
        ),
    )

    secret_key_ref: KeyRef | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeyRef | None = Field(default=None, description="A key of a ConfigMap.")


class EnvVar(_Model):
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


LabelKey = _checked(
    str,
    Rule(
        f"self.matches(r'{LABEL_KEY}')",
        "must be a label key: an optional DNS-subdomain prefix and '/', then at most 63 letters, "
        "digits, '-', '_' and '.', starting and ending with a letter or digit",
        _matches(LABEL_KEY),
    ),
    max_length=317,
)


class Toleration(_Model):
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
RESERVED_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
)
RESERVED_PREFIX = f"{GROUP}/"
_RESERVED_RULE = Rule(
    "!self.exists(k, k in ["
    + ", ".join(f"'{k}'" for k in RESERVED_LABELS)
    + f"] || k.startsWith('{RESERVED_PREFIX}'))",
    f"{', '.join(RESERVED_LABELS)} and {RESERVED_PREFIX}* are the operator's labels (the "
    "Deployment, Service and PodDisruptionBudget select the workers by them)",
    lambda m: not any(k in RESERVED_LABELS or k.startswith(RESERVED_PREFIX) for k in m),
)
PodLabels = _checked(dict[str, LabelValue], _KEYS_RULE, _RESERVED_RULE, max_length=64)
Annotations = _checked(dict[str, str], _KEYS_RULE, max_length=64)


class PodMetadata(_Model):
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


class Affinity(_Model):
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


class TopologySpreadConstraint(_Model):
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


class LocalObjectReference(_Model):
    name: ObjectName("a Secret") = Field(description="Name of the Secret.")


class RolloutSpec(_Model):
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


def _unique(items: list[Any], key: Callable[[Any], Any], what: str) -> list[Any]:
    keys = [key(i) for i in items]
    dupes = sorted({str(k) for k in keys if keys.count(k) > 1})
    if dupes:
        raise ValueError(f"{what} must be unique: {', '.join(dupes)} repeated")
    return items


def _list_map(*keys: str) -> dict[str, Any]:
    """A list merged by key (server-side apply, strategic merge), whose keys the API server
    refuses to see twice."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": list(keys)}


AUTOSCALED_REPLICAS_MESSAGE = (
    "with autoscaling the operator's autoscaler sets the worker count: leave replicas out "
    "(kubectl scale, an HPA or KEDA cannot scale this resource; change autoscaling.minReplicas "
    "and maxReplicas, or remove autoscaling to scale by hand)"
)


class InferenceDeploymentSpec(_Model):
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
    )

    model: ModelSpec = Field(description="The model to serve.")
    speculative: SpeculativeSpec | None = Field(default=None, description="Speculative decoding (optional).")
    engine: EngineSpec = Field(default_factory=EngineSpec, description="Engine settings of each worker.")
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
        json_schema_extra=_list_map("topologyKey", "whenUnsatisfiable"),
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
        json_schema_extra=_list_map("name"),
        description="Secrets to pull the worker image with.",
    )
    pod_metadata: PodMetadata = Field(
        default_factory=PodMetadata, description="Labels and annotations of the worker pods."
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra=_list_map("name"),
        description="Extra environment variables of the workers.",
    )

    @field_validator("env")
    @classmethod
    def _env_names_unique(cls, env: list[EnvVar]) -> list[EnvVar]:
        return _unique(env, lambda v: v.name, "env names")

    @field_validator("image_pull_secrets")
    @classmethod
    def _pull_secrets_unique(cls, refs: list[LocalObjectReference]) -> list[LocalObjectReference]:
        return _unique(refs, lambda r: r.name, "imagePullSecrets names")

    @field_validator("topology_spread_constraints")
    @classmethod
    def _spread_unique(cls, cs: list[TopologySpreadConstraint]) -> list[TopologySpreadConstraint]:
        return _unique(
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


# Condition types are open (metav1.Condition's grammar, no enum): an older CRD must accept the
# status a newer operator writes, with condition types it does not know yet.
CONDITION_TYPE = LABEL_KEY


class Condition(_Model):
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
    conditions: list[Condition] = Field(
        default_factory=list,
        # A map keyed by type: each status writer's server-side apply owns its own conditions.
        json_schema_extra=_list_map("type"),
        description="Ready, Progressing, Degraded, ScalingActive: one per type.",
    )


class InferenceDeployment(_Model):
    model_config = ConfigDict(extra="ignore")

    spec: InferenceDeploymentSpec
    status: InferenceDeploymentStatus = Field(default_factory=InferenceDeploymentStatus)
