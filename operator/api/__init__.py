"""The InferenceDeployment API: the resource's models (pydantic), the single source of its CRD and
reference docs. Pure: no I/O, no Kubernetes client."""
