"""Reconciliation: an InferenceDeployment's spec to its children (children.py, pure), their
status (status.py, pure), drift, refusals and backoff (heal.py, pure), the admin policy
(admin_policy.py), and the reconciler that applies them through kube/ (reconciler.py)."""
