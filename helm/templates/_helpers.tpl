{{/*
Named templates shared by every manifest. Names follow `helm create`, so a reader (or a
parent chart) finds them where they expect.
*/}}

{{/*
A resource name made of fullname and a suffix ("redis", "headless"...), cutting the prefix so
the whole stays within 52 characters: a StatefulSet's controller-revision-hash label adds 11.
Call with (list $ "suffix").
*/}}
{{- define "lora-gateway.suffixedName" -}}
{{- $ctx := index . 0 }}
{{- $suffix := index . 1 }}
{{- $prefix := include "lora-gateway.fullname" $ctx | trunc (int (sub 51 (len $suffix))) | trimSuffix "-" }}
{{- printf "%s-%s" $prefix $suffix }}
{{- end }}

{{/* The chart name, unless overridden: "lora-gateway". */}}
{{- define "lora-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The prefix of every resource name: the release name, plus the chart name unless the release
name already contains it. Truncated to 63 characters (a DNS label).
*/}}
{{- define "lora-gateway.fullname" -}}
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

{{/* "NAME-VERSION" for the helm.sh/chart label. */}}
{{- define "lora-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object the chart creates. */}}
{{- define "lora-gateway.labels" -}}
helm.sh/chart: {{ include "lora-gateway.chart" . }}
{{ include "lora-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | toString | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: lora-gateway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* The stable subset of labels that selects the chart's pods; never change it on upgrade. */}}
{{- define "lora-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "lora-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of the gateway (component: gateway). */}}
{{- define "lora-gateway.gateway.labels" -}}
{{ include "lora-gateway.labels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{- define "lora-gateway.gateway.selectorLabels" -}}
{{ include "lora-gateway.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end }}

{{/* Labels of the in-chart Redis (component: redis). */}}
{{- define "lora-gateway.redis.labels" -}}
{{ include "lora-gateway.labels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{- define "lora-gateway.redis.selectorLabels" -}}
{{ include "lora-gateway.selectorLabels" . }}
app.kubernetes.io/component: redis
{{- end }}

{{/* The gateway's ServiceAccount name. */}}
{{- define "lora-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "lora-gateway.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The gateway image reference; the tag defaults to the chart's appVersion. */}}
{{- define "lora-gateway.image" -}}
{{- $suffix := eq (include "lora-gateway.device" .) "cpu" | ternary "-cpu" "" }}
{{- $tag := .Values.image.tag | default (printf "%s%s" .Chart.AppVersion $suffix) | toString }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}
{{- end }}

{{/* The Secret that holds the keys: the chart's own, or auth.existingSecret. */}}
{{- define "lora-gateway.secretName" -}}
{{- if .Values.auth.existingSecret }}
{{- .Values.auth.existingSecret }}
{{- else }}
{{- include "lora-gateway.suffixedName" (list . "auth") }}
{{- end }}
{{- end }}

{{/* Name of the in-chart Redis StatefulSet and of its (headless) Service. */}}
{{- define "lora-gateway.redis.fullname" -}}
{{- include "lora-gateway.suffixedName" (list . "redis") }}
{{- end }}

{{/*
The Redis URL passed as --redis-url: the in-chart Redis's Service, or redis.externalUrl
(required when redis.enabled is false).
*/}}
{{- define "lora-gateway.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s:%d/%d" (include "lora-gateway.redis.fullname" .) (int .Values.redis.port) (int .Values.redis.database) }}
{{- else }}
{{- required "redis.externalUrl is required when redis.enabled is false (e.g. redis://my-redis:6379/0)" .Values.redis.externalUrl }}
{{- end }}
{{- end }}

{{/* GPUs per replica: gpu.count, or engine.tensorParallelSize (one GPU per rank) when unset. */}}
{{- define "lora-gateway.gpuCount" -}}
{{- if kindIs "invalid" .Values.gpu.count }}
{{- .Values.engine.tensorParallelSize | default 1 | int }}
{{- else }}
{{- .Values.gpu.count | int }}
{{- end }}
{{- end }}

{{/* The device flag: gpu.count > 0 means cuda, else cpu, unless engine.device says otherwise. */}}
{{- define "lora-gateway.device" -}}
{{- if .Values.engine.device }}
{{- .Values.engine.device }}
{{- else if gt (int (include "lora-gateway.gpuCount" .)) 0 }}
{{- "cuda" }}
{{- else }}
{{- "cpu" }}
{{- end }}
{{- end }}

{{/* The PVC behind the data volume: persistence.existingClaim or the chart's own. */}}
{{- define "lora-gateway.claimName" -}}
{{- if .Values.persistence.existingClaim }}
{{- .Values.persistence.existingClaim }}
{{- else }}
{{- include "lora-gateway.suffixedName" (list . "data") }}
{{- end }}
{{- end }}

{{/*
The gateway container's resources: resources from values, with gpu.count of
gpu.resourceName added to both requests and limits (extended resources must match).
*/}}
{{- define "lora-gateway.resources" -}}
{{- $res := deepCopy (.Values.resources | default dict) }}
{{- $gpus := int (include "lora-gateway.gpuCount" .) }}
{{- if gt $gpus 0 }}
{{- $limits := get $res "limits" | default dict }}
{{- $_ := set $limits .Values.gpu.resourceName $gpus }}
{{- $_ := set $res "limits" $limits }}
{{- $requests := get $res "requests" | default dict }}
{{- $_ := set $requests .Values.gpu.resourceName $gpus }}
{{- $_ := set $res "requests" $requests }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{/* Name of the InferencePool (inferenceExtension.poolName, or the full name). */}}
{{- define "lora-gateway.inferencePoolName" -}}
{{- .Values.inferenceExtension.poolName | default (include "lora-gateway.fullname" .) }}
{{- end }}
