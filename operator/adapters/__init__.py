"""LoRA adapters on running workers: the pure decisions (plan.py) and the per-resource task that
loads, unloads and reports them (sync.py)."""
