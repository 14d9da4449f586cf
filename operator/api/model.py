"""What the workers serve: the model (a path, a PVC, a Hub snapshot or a built-in), its Hub access
and cache, and speculative decoding's draft model or n-gram proposer."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvscale.operator.api.validation import (
    CONFIG_KEY,
    CamelModel,
    ObjectName,
    Quantity,
    Rule,
    checked,
    matches,
    search,
)

# Model sources. pvc:// takes a claim name (a DNS subdomain) and an optional path in it; hf://
# a Hub repository id (ORG/NAME, the Hub's grammar: letters, digits, '-', '_', '.', not starting or
# ending with '-' or '.') and an optional @REVISION (a branch, tag or commit hash).
URI = r"^(/|file:///|pvc://|builtin://|hf://)[^\s]*$"
_HF_PART = r"[A-Za-z0-9_]([-A-Za-z0-9_.]{0,94}[A-Za-z0-9_])?"
HF_URI = rf"^hf://{_HF_PART}/{_HF_PART}(@[A-Za-z0-9_]([-A-Za-z0-9_./]{{0,253}}[A-Za-z0-9_])?)?$"
HF_ENDPOINT = r"^https?://[^\s/?#]+(/[^\s?#]*)?$"
PVC_URI = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*(/[^\s]*)?$"
DOT_DOT = r"(^|/)\.\.(/|$)"


Uri = checked(
    str,
    Rule(
        f"self.matches(r'{URI}')",
        "must be an absolute path, file:///PATH, pvc://CLAIM/PATH, hf://ORG/NAME[@REVISION] or "
        "builtin://NAME",
        matches(URI),
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


class SecretKeyRef(CamelModel):
    name: ObjectName("a Secret") = Field(description="Name of the Secret.")
    key: str = Field(
        default="HF_TOKEN", pattern=CONFIG_KEY, min_length=1, max_length=253, description="Key within it."
    )


class ModelSpec(CamelModel):
    """Which model the workers load and the name clients ask for."""

    rules = (
        Rule(
            "!has(self.cacheReadOnly) || !self.cacheReadOnly || has(self.cacheClaim)",
            "cacheReadOnly needs cacheClaim: the claim the snapshot was downloaded into",
            lambda m: not m.cache_read_only or m.cache_claim is not None,
        ),
    )

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
    cache_read_only: bool = Field(
        default=False,
        description="For hf:// models with cacheClaim: the claim holds the snapshot already, filled "
        "once by the downloader (`kvscale-worker download`, e.g. in a Job; docs/operator.md), and "
        "every pod mounts it read-only (a ReadOnlyMany claim shared by the replicas): the init "
        "container only checks, without the network, that the snapshot is complete there, and says "
        "so in the pod's status when it is not.",
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


class SpeculativeSpec(CamelModel):
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
