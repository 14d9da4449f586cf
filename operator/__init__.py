"""kvscale operator: the InferenceDeployment resource, its reconciliation and its autoscaler.

Imports nothing heavy (no torch): the operator image carries only kopf, kubernetes and pydantic.
"""
