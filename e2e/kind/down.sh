#!/usr/bin/env bash
# Delete the kind cluster made by e2e/kind/up.sh (name from $KIND_CLUSTER, default kvscale).
# Safe to run when the cluster does not exist: kind then deletes nothing and succeeds.
set -euo pipefail

cluster="${KIND_CLUSTER:-kvscale}"
kind delete cluster --name "$cluster"
