"""What `kvscale-operator run` was told, read once at start (its flags and environment) and passed
to the parts that need it: nothing reads the environment, or a module global, on the way."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_WORKER_IMAGE = "ghcr.io/kvscale/kvscale-worker:0.1.0"
DEFAULT_ROUTER_IMAGE = "ghcr.io/kvscale/kvscale-router:0.1.0"
DEFAULT_POLICY_PATH = "/etc/kvscale/policy.yaml"  # manifests/base/deployment.yaml mounts it


@dataclass(frozen=True)
class Settings:
    # The namespaced install's namespaces (--watch-namespace): the resync and the pod cache list
    # in these only, as its Roles allow nothing cluster-wide. Empty: every namespace.
    watch_namespaces: tuple[str, ...] = ()
    # Where the operator's pods run (POD_NAMESPACE): the NetworkPolicies let them scrape the workers.
    operator_namespace: str = "kvscale-system"
    worker_image: str = DEFAULT_WORKER_IMAGE  # for resources that name none (KVSCALE_WORKER_IMAGE)
    router_image: str = DEFAULT_ROUTER_IMAGE  # KVSCALE_ROUTER_IMAGE
    policy_path: Path = Path(DEFAULT_POLICY_PATH)  # the admin policy (KVSCALE_POLICY_FILE)
    resync_s: float = 300.0  # every resource re-synced this often (KVSCALE_RESYNC_SECONDS)
    discovery_s: float = 30.0  # InferencePools and LeaderWorkerSets asked for (KVSCALE_DISCOVERY_SECONDS)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ, **flags: object) -> Settings:
        """The environment's settings (the Deployment sets them), and `flags` over them."""
        return cls(
            operator_namespace=environ.get("POD_NAMESPACE", "kvscale-system"),
            worker_image=environ.get("KVSCALE_WORKER_IMAGE", DEFAULT_WORKER_IMAGE),
            router_image=environ.get("KVSCALE_ROUTER_IMAGE", DEFAULT_ROUTER_IMAGE),
            policy_path=Path(environ.get("KVSCALE_POLICY_FILE", DEFAULT_POLICY_PATH)),
            resync_s=float(environ.get("KVSCALE_RESYNC_SECONDS", "300")),
            discovery_s=float(environ.get("KVSCALE_DISCOVERY_SECONDS", "30")),
            **flags,  # type: ignore[arg-type]
        )
