"""The autoscaler: the pure policy (policy.py: samples in, replicas out; the simulator in
tests/simulate.py drives the same object), what a pod is to it (pod_state.py), reading a worker's
or router's metrics (scrape.py), and the per-resource tasks that scale and report (scaler.py)."""
