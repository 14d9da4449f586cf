"""The names the operator puts on what it makes, which selectors, RBAC, the router and other tools
rely on: field managers, the labels of every child and worker pod, the components' names."""

from kvscale.operator.api.groupversion import GROUP

MANAGER = "kvscale-operator"  # our field manager and the managed-by label
AUTOSCALER_MANAGER = "kvscale-autoscaler"  # the autoscaler's, for the Deployment's replicas
ADAPTERS_MANAGER = "kvscale-adapters"  # the adapter sync's (status.adapters)
LABEL_NAME = "app.kubernetes.io/name"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
LABEL_OWNER = f"{GROUP}/inference-deployment"
LABEL_COMPONENT = "app.kubernetes.io/component"
# An InferenceEndpoint's router pods and children (reconcile/endpoint.py): not LABEL_OWNER, so the
# InferenceDeployments' watches and resync never see them.
LABEL_ENDPOINT = f"{GROUP}/inference-endpoint"
WORKER = "kvscale-worker"
ROUTER = "kvscale-router"
# What the operator's watches and lists select: the objects it made (server-side: only ours are
# streamed). The worker and router pods carry the same labels.
CHILD_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGER},{LABEL_OWNER}"
