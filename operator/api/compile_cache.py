"""The compile cache: a volume the workers share for what they compile at start, so that a model is
compiled once, not once per pod (docs/operator.md, "Caches")."""

from __future__ import annotations

from pydantic import Field

from kvscale.operator.api.validation import CamelModel, ObjectName


class CompileCacheSpec(CamelModel):
    """A PersistentVolumeClaim the workers mount at $KVSCALE_COMPILE_CACHE: the compiled CPU
    forward's packages (keyed by model shape, dtype, block size, torch and CPU features), and on
    GPUs Triton's kernel cache."""

    claim: ObjectName("a PersistentVolumeClaim") = Field(
        description="The claim (ReadWriteMany for workers on several nodes; ReadWriteOnce when they "
        "share one). The first worker to build a package writes it (into a scratch folder, renamed "
        "into place), the others load it before they turn Ready; a package built for other CPU "
        "features sits beside it and is never loaded here."
    )
    read_only: bool = Field(
        default=False,
        description="Mount it read-only (a cache filled beforehand, e.g. by `kvscale-worker compile "
        "--compile-cache-dir`): a worker that finds no package for its CPU there builds one into its "
        "own /tmp instead.",
    )
