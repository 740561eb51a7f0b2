{{/*
Names and labels, as `helm create` lays them out.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "dynamo-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name of the release's objects: fullnameOverride, else the release name when it already
contains the chart name, else release-chart. Truncated to 63 characters (DNS label limit).
*/}}
{{- define "dynamo-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "dynamo-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels of every object of the release. */}}
{{- define "dynamo-operator.labels" -}}
helm.sh/chart: {{ include "dynamo-operator.chart" . }}
{{ include "dynamo-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Labels that select the operator pod (never change them: a Deployment's selector is immutable). */}}
{{- define "dynamo-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dynamo-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The operator's ServiceAccount name. */}}
{{- define "dynamo-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dynamo-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The operator image reference: repository:tag, the tag defaulting to the appVersion. */}}
{{- define "dynamo-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* A workerDefaults image: as given when it names a tag or a digest, else the repository with the appVersion as its tag (the release publishes every image under the chart's appVersion). Call with (dict "ref" VALUE "root" $). */}}
{{- define "dynamo-operator.defaultImage" -}}
{{- $name := last (splitList "/" .ref) }}
{{- if or (contains ":" $name) (contains "@" $name) }}
{{- .ref }}
{{- else }}
{{- printf "%s:%s" .ref .root.Chart.AppVersion }}
{{- end }}
{{- end }}

{{/* The namespaces watched: every namespace (an empty list) in cluster scope; else watchNamespaces, or the release namespace. */}}
{{- define "dynamo-operator.watchNamespaces" -}}
{{- if eq .Values.rbac.scope "namespaced" }}
{{- default (list .Release.Namespace) .Values.rbac.watchNamespaces | uniq | toJson }}
{{- else }}
{{- list | toJson }}
{{- end }}
{{- end }}

{{/*
"true" when the live object (first element) carries this release's ownership annotations
(second element: the root context), else empty. Used with `lookup` to install upstream's
DynamoWorkerMetadata CRD only when no copy exists that this release does not own.
*/}}
{{- define "dynamo-operator.ownedByRelease" -}}
{{- $live := index . 0 }}
{{- $root := index . 1 }}
{{- $annotations := default dict $live.metadata.annotations }}
{{- if and (eq (get $annotations "meta.helm.sh/release-name") $root.Release.Name) (eq (get $annotations "meta.helm.sh/release-namespace") $root.Release.Namespace) -}}
true
{{- end }}
{{- end }}
