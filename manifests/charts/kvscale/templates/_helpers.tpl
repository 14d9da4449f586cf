{{/*
Every object's labels: the kustomize install's (app.kubernetes.io/name, part-of) and Helm's own
(chart, instance, version, managed-by), which tests/test_helm_chart.py leaves out of its diff.
Pod templates get none of Helm's: adopting a kustomize install, or changing the chart's version,
rolls no pod.
*/}}
{{- define "kvscale.labels" -}}
app.kubernetes.io/name: kvscale-operator
app.kubernetes.io/part-of: kvscale
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end }}

{{/* The operator's identity in RBAC subjects and in the admission policy. */}}
{{- define "kvscale.subject" -}}
- kind: ServiceAccount
  name: kvscale-operator
  namespace: {{ .Release.Namespace }}
{{- end }}

{{- define "kvscale.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Whether the cluster-wide install is rendered (else the namespaced one). */}}
{{- define "kvscale.clusterScope" -}}
{{- if eq .Values.scope "cluster" }}true{{ end -}}
{{- end }}

{{/*
The operator's rights in the namespaces it serves: manifests/rbac.yaml's ClusterRole less the
cluster-scoped rule (CRDs), and manifests/namespaced/rbac.yaml's Role (which also patches pods:
the scale-down's marks). Why each verb is there: the comments of manifests/rbac.yaml. Argument:
a dict with podVerbs.
*/}}
{{- define "kvscale.rules" -}}
- apiGroups: [kvscale.dev]
  resources: [inferencedeployments]
  verbs: [get, list, watch]
- apiGroups: [kvscale.dev]
  resources: [inferencedeployments/status]
  verbs: [patch]
- apiGroups: [kvscale.dev]
  resources: [inferencedeployments/finalizers]
  verbs: [update]
# The InferenceEndpoints (manifests/rbac.yaml).
- apiGroups: [kvscale.dev]
  resources: [inferenceendpoints]
  verbs: [get, list, watch]
- apiGroups: [kvscale.dev]
  resources: [inferenceendpoints/status]
  verbs: [patch]
- apiGroups: [kvscale.dev]
  resources: [inferenceendpoints/finalizers]
  verbs: [update]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [get, list, watch, patch, create]
- apiGroups: [apps]
  resources: [deployments/scale]
  verbs: [get, patch, update]
- apiGroups: [apps]
  resources: [replicasets, statefulsets]
  verbs: [get]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [get, list, watch]
- apiGroups: [""]
  resources: [serviceaccounts]
  verbs: [get, list, watch, patch, create, delete]
- apiGroups: [rbac.authorization.k8s.io]
  resources: [roles, rolebindings]
  verbs: [get, list, watch, patch, create, delete]
- apiGroups: [""]
  resources: [pods]
  verbs: [{{ .podVerbs }}]
- apiGroups: [""]
  resources: [services]
  verbs: [get, list, watch, patch, create]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [get, list, watch, patch, create]
- apiGroups: [""]
  resources: [events]
  verbs: [create]
- apiGroups: [apps]
  resources: [deployments]
  verbs: [delete]
- apiGroups: [""]
  resources: [services]
  verbs: [delete]
- apiGroups: [policy]
  resources: [poddisruptionbudgets]
  verbs: [delete]
- apiGroups: [networking.k8s.io]
  resources: [networkpolicies]
  verbs: [get, list, watch, patch, create, delete]
- apiGroups: [inference.networking.k8s.io]
  resources: [inferencepools]
  verbs: [get, list, patch, create, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets]
  verbs: [get, list, patch, create, delete]
- apiGroups: [leaderworkerset.x-k8s.io]
  resources: [leaderworkersets/scale]
  verbs: [get, patch]
{{- end }}
