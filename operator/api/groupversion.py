"""The API group, version and kind of the resource (kubebuilder's groupversion_info)."""

GROUP, VERSION, KIND, PLURAL = "kvscale.dev", "v1alpha1", "InferenceDeployment", "inferencedeployments"
