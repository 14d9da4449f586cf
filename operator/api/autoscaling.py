"""The autoscaler's knobs: bounds, targets on KV-cache usage and queue depth, stabilisation windows,
steps, scale to zero (docs/autoscaling.md)."""

from __future__ import annotations

from pydantic import Field

from kvscale.operator.api.validation import CamelModel, Rule


class AutoscalingSpec(CamelModel):
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
