"""The OpenAI-compatible HTTP server on aiohttp: app, serving, protocol, Prometheus metrics, JSON logs."""
