"""kvscale-router: a KV- and prefix-aware OpenAI pass-through in front of one InferenceDeployment's
workers (docs/router.md). Cluster-side like the operator and with its dependencies (aiohttp, the
kubernetes client, prometheus-client, xxhash; never torch)."""
