"""Request state, the KV block pool and its prefix-cache index, per-request block tables, the scheduler."""
