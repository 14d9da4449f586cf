"""The worker's statistics and their Prometheus exporter: the engine and the scheduler fill
stats.py each step; prometheus.py exports them (ours and vLLM's names), which the server serves.
Below both the engine and the server, so neither imports the other for them."""
