#!/usr/bin/env bash
# Bring up a kind cluster with kvscale installed, then run the end-to-end tests against it.
#
#   e2e/kind/up.sh [extra pytest arguments]
#
# Environment (all optional):
#   KIND_CLUSTER                 cluster name (default: kvscale)
#   KIND_NODE_IMAGE              node image instead of the one pinned in cluster.yaml
#   KVSCALE_OPERATOR_IMAGE       the Dockerfile's `operator` target (default: ghcr.io/kvscale/kvscale-operator:0.1.0)
#   KVSCALE_WORKER_IMAGE         the Dockerfile's `worker` target (default: ghcr.io/kvscale/kvscale-worker:0.1.0)
#   KVSCALE_ROUTER_IMAGE         the Dockerfile's `router` target (default: ghcr.io/kvscale/kvscale-router:0.1.0)
#   KVSCALE_NAMESPACE            namespace of the operator in manifests/ (default: kvscale-system)
#   KVSCALE_OPERATOR_DEPLOYMENT  the operator's Deployment in manifests/ (default: kvscale-operator)
#
# The cluster is left running so that a failure can be looked at; e2e/kind/down.sh deletes it.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/../.."  # the repository root: every path below is relative to it

cluster="${KIND_CLUSTER:-kvscale}"
# The same two images, under the same names, as the local real node (e2e/images.py): the names
# manifests/ uses, so the operator Deployment runs unchanged. Not ':latest': for a ':latest' tag
# the kubelet defaults to imagePullPolicy Always and would try to pull from a registry an image
# that exists only inside the kind nodes.
operator_image="${KVSCALE_OPERATOR_IMAGE:-ghcr.io/kvscale/kvscale-operator:0.1.0}"
worker_image="${KVSCALE_WORKER_IMAGE:-ghcr.io/kvscale/kvscale-worker:0.1.0}"
router_image="${KVSCALE_ROUTER_IMAGE:-ghcr.io/kvscale/kvscale-router:0.1.0}"
namespace="${KVSCALE_NAMESPACE:-kvscale-system}"
operator="${KVSCALE_OPERATOR_DEPLOYMENT:-kvscale-operator}"
example="manifests/examples/tiny-cpu.yaml"
manager="kvscale-e2e"  # server-side apply field manager, so that reruns update our own fields

step() { printf '\n==> %s\n' "$*"; }
die() { printf 'e2e/kind/up.sh: %s\n' "$*" >&2; exit 1; }

# Check everything we need before creating anything: a cluster takes a minute to create, a
# missing file takes no time to report.
for tool in docker kind kubectl; do
    command -v "$tool" >/dev/null || die "'$tool' is not on PATH (prerequisites: e2e/kind/README.md)"
done
[[ -f Dockerfile ]] ||
    die "no Dockerfile at the repository root: the images (operator, worker) cannot be built yet"
[[ -f manifests/kustomization.yaml || -f manifests/kustomization.yml || -f manifests/Kustomization ]] ||
    die "no kustomization in manifests/: the operator's kustomize base is missing"
compgen -G 'crds/*.yaml' >/dev/null || die "no CRD YAML in crds/"
[[ -x .venv/bin/pytest ]] ||
    die "no .venv/bin/pytest: run python3 -m venv .venv && .venv/bin/pip install -e '.[test]'"

# Every kubectl below talks to this file alone (through KUBECONFIG), never to the caller's
# current context: an apply meant for a throwaway cluster must not land on a real one.
# (kind dropped 'get kubeconfig-path' long ago; 'get kubeconfig' prints the file instead.)
kubeconfig="$(mktemp "${TMPDIR:-/tmp}/kvscale-kind-kubeconfig.XXXXXX")"
trap 'rm -f "$kubeconfig"' EXIT
export KUBECONFIG="$kubeconfig"

if kind get clusters 2>/dev/null | grep -qx "$cluster"; then
    step "kind cluster '$cluster' exists: reusing it"
else
    step "creating kind cluster '$cluster'"
    # --kubeconfig: write the new context to our file, not into ~/.kube/config.
    kind create cluster --name "$cluster" --config "$here/cluster.yaml" \
        ${KIND_NODE_IMAGE:+--image "$KIND_NODE_IMAGE"} --kubeconfig "$kubeconfig" --wait 3m
fi
kind get kubeconfig --name "$cluster" >"$kubeconfig"
kubectl wait --for=condition=Ready nodes --all --timeout=3m

# The build context is the repository root, where .venv (PyTorch, gigabytes) also lives.
grep -qsE '^/?\.venv/?$' .dockerignore ||
    echo "e2e/kind/up.sh: warning: .dockerignore does not exclude .venv: the build context will be huge" >&2
for target in operator router worker; do
    image_var="${target}_image"
    step "building ${!image_var} (--target $target) from ./Dockerfile"
    DOCKER_BUILDKIT=1 docker build --target "$target" --tag "${!image_var}" .
    # kind nodes have their own containerd and cannot see the host's images: copy it into each node.
    kind load docker-image "${!image_var}" --name "$cluster"
done

step "installing the CRDs"
kubectl apply --server-side --field-manager="$manager" -f crds/
kubectl wait --for=condition=Established --timeout=60s -f crds/

step "installing the operator (manifests/), image $operator_image"
# --force-conflicts: a rerun takes the image field back from 'kubectl set image' below.
kubectl apply --server-side --force-conflicts --field-manager="$manager" -k manifests/
# By default the names are manifests/' own and these change nothing; other names (a registry of
# yours) point the operator at them. '*' needs no container name. KVSCALE_WORKER_IMAGE is the
# operator's default image for the worker pods it creates (spec.image overrides it).
kubectl -n "$namespace" set image "deployment/$operator" "*=$operator_image"
kubectl -n "$namespace" set env "deployment/$operator" "KVSCALE_WORKER_IMAGE=$worker_image" \
    "KVSCALE_ROUTER_IMAGE=$router_image"
# rollout status waits for the pods of the latest template (the one with our image), not for
# whatever ReplicaSet happened to be available first.
kubectl -n "$namespace" rollout status "deployment/$operator" --timeout=5m
kubectl -n "$namespace" wait --for=condition=Available "deployment/$operator" --timeout=1m

if [[ -f "$example" ]]; then
    step "applying $example"
    kubectl apply --server-side --field-manager="$manager" -f "$example"
    # A smoke test before the suite: the operator turns it into worker pods that become ready.
    kubectl wait --for=condition=Ready inferencedeployments.kvscale.dev --all --all-namespaces \
        --timeout=10m
else
    step "no $example: skipping the example"
fi

step "running the end-to-end tests against kind cluster '$cluster'"
# The contract with e2e/: when KVSCALE_E2E_KUBECONFIG is set, the e2e tests use the cluster it
# points to instead of starting the local control plane (e2e/controlplane), and put
# KVSCALE_E2E_IMAGE in the InferenceDeployments they create.
KVSCALE_E2E_KUBECONFIG="$kubeconfig" KVSCALE_E2E_IMAGE="$worker_image" .venv/bin/pytest e2e -q "$@"
