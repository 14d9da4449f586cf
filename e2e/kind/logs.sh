#!/usr/bin/env bash
# Collect what is needed to understand a failed e2e run on the kind cluster into one folder:
#
#   e2e/kind/logs.sh OUT_DIR
#
# Best effort: each command that fails is noted in its file and the rest still run, since this
# is what runs after something already went wrong (CI uploads OUT_DIR as an artifact).
set -euo pipefail

out="${1:?usage: e2e/kind/logs.sh OUT_DIR}"
cluster="${KIND_CLUSTER:-kvscale}"
mkdir -p "$out/pods"

# Same rule as up.sh: talk only to the kind cluster, through a private kubeconfig.
kubeconfig="$(mktemp "${TMPDIR:-/tmp}/kvscale-kind-kubeconfig.XXXXXX")"
trap 'rm -f "$kubeconfig"' EXIT
export KUBECONFIG="$kubeconfig"
if ! kind get kubeconfig --name "$cluster" >"$kubeconfig"; then
    echo "e2e/kind/logs.sh: no kind cluster '$cluster': nothing to collect" >&2
    exit 0
fi

# capture FILE CMD...: run CMD with its stdout and stderr into OUT_DIR/FILE, never fail.
capture() {
    local file="$out/$1"; shift
    "$@" >"$file" 2>&1 || echo "(exit $?: $*)" >>"$file"
}

capture get-all.txt kubectl get all -A -o wide
capture describe-pods.txt kubectl describe pods -A
capture events.txt kubectl get events -A --sort-by=.lastTimestamp
capture nodes.txt kubectl describe nodes
capture inferencedeployments.yaml kubectl get inferencedeployments.kvscale.dev -A -o yaml

# Logs of every container of every pod, and of the previous run of any that restarted.
kubectl get pods -A --no-headers -o custom-columns=NS:.metadata.namespace,NAME:.metadata.name |
    while read -r ns name; do
        capture "pods/$ns.$name.log" kubectl -n "$ns" logs "$name" --all-containers --prefix
        capture "pods/$ns.$name.previous.log" kubectl -n "$ns" logs "$name" --all-containers --prefix --previous
    done

# Node-level logs (kubelet, containerd, journal) from inside the kind node containers.
capture kind-export.txt kind export logs "$out/kind" --name "$cluster"
echo "e2e/kind/logs.sh: wrote $out"
