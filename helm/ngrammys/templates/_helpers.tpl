{{/* Names and labels. */}}
{{- define "ngrammys.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ngrammys.fullname" -}}
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

{{- define "ngrammys.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ngrammys.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ngrammys.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ngrammys.labels" -}}
helm.sh/chart: {{ include "ngrammys.chart" . }}
{{ include "ngrammys.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The LeaderWorkerSet: not the Service's name, which its controller takes for the group's
headless Service (the pods' DNS names, LWS_LEADER_ADDRESS). */}}
{{- define "ngrammys.groupName" -}}
{{- printf "%s-lws" (include "ngrammys.fullname" . | trunc 59 | trimSuffix "-") }}
{{- end }}

{{/* The pods that serve HTTP: all of the Deployment's, or the groups' leaders. */}}
{{- define "ngrammys.servingSelectorLabels" -}}
{{ include "ngrammys.selectorLabels" . }}
{{- if .Values.leaderWorkerSet.enabled }}
app.kubernetes.io/component: leader
{{- end }}
{{- end }}

{{/* What the HPA or KEDA scales: the Deployment, or the LeaderWorkerSet by whole groups (its
scale subresource counts groups and selects the leaders). */}}
{{- define "ngrammys.scaleTargetRef" -}}
{{- if .Values.leaderWorkerSet.enabled -}}
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
name: {{ include "ngrammys.groupName" . }}
{{- else -}}
apiVersion: apps/v1
kind: Deployment
name: {{ include "ngrammys.fullname" . }}
{{- end }}
{{- end }}

{{- define "ngrammys.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ngrammys.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ngrammys.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* NGRAMMYS_MODEL: empty for the embedded model of the image. */}}
{{- define "ngrammys.modelPath" -}}
{{- if ne .Values.model.source "image" }}
{{- printf "/models/%s" (trimPrefix "/" .Values.model.path) | trimSuffix "/" }}
{{- end }}
{{- end }}

{{/* The PromQL query KEDA scales on: requests waiting, summed over this release's serving pods
(a Deployment's <name>-<hash>-<id>, or a LeaderWorkerSet's leaders <name>-<group>). */}}
{{- define "ngrammys.queueQuery" -}}
{{- if .Values.autoscaling.keda.query }}
{{- tpl .Values.autoscaling.keda.query . }}
{{- else if .Values.leaderWorkerSet.enabled }}
{{- printf "sum(ngrammys_num_requests_waiting{namespace=\"%s\",pod=~\"%s-[0-9]+\"}) or vector(0)" .Release.Namespace (include "ngrammys.groupName" .) }}
{{- else }}
{{- printf "sum(ngrammys_num_requests_waiting{namespace=\"%s\",pod=~\"%s-[a-z0-9]+-[a-z0-9]+\"}) or vector(0)" .Release.Namespace (include "ngrammys.fullname" .) }}
{{- end }}
{{- end }}

{{/* Seconds the kubelet waits after SIGTERM: the preStop sleep, the drain, and a margin. */}}
{{- define "ngrammys.terminationGracePeriod" -}}
{{- add .Values.server.preStopSleepSeconds .Values.server.drainTimeoutSeconds 10 }}
{{- end }}

{{/* Checks the schema cannot express. */}}
{{/*
The batch store is on the chart's claim (SQLite, one server) rather than at a PostgreSQL URL:
"true" or empty.
*/}}
{{- define "ngrammys.batchClaim" -}}
{{- if and .Values.batchStore.enabled (not .Values.batchStore.url.secretName) }}true{{ end }}
{{- end }}

{{- define "ngrammys.validate" -}}
{{- if eq (trimSuffix "/" .Values.cache.mountPath) (trimSuffix "/" .Values.image.cacheDir) }}
{{- fail "cache.mountPath must differ from image.cacheDir: the volume would hide the baked cache" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (lt (int .Values.autoscaling.maxReplicas) (int .Values.autoscaling.minReplicas)) }}
{{- fail "autoscaling.maxReplicas must be at least autoscaling.minReplicas" }}
{{- end }}
{{- $cpuScaling := or (not .Values.autoscaling.keda.enabled) .Values.autoscaling.keda.cpuTrigger }}
{{- if and .Values.autoscaling.enabled $cpuScaling (not (and .Values.resources.requests .Values.resources.requests.cpu)) }}
{{- fail "scaling on CPU needs resources.requests.cpu" }}
{{- end }}
{{- $tp := int .Values.tensorParallelSize }}
{{- if and .Values.gpu.enabled (gt $tp 1) (ne (int .Values.gpu.count) 1) (ne (int .Values.gpu.count) $tp) }}
{{- fail (printf "gpu.count (%d) and tensorParallelSize (%d) disagree: each rank takes one GPU, so a pod gets tensorParallelSize GPUs (leave gpu.count at 1)" (int .Values.gpu.count) $tp) }}
{{- end }}
{{- if and .Values.leaderWorkerSet.enabled (not .Values.gpu.enabled) }}
{{- fail "leaderWorkerSet.enabled needs gpu.enabled: the ranks of a group talk over NCCL, one GPU each" }}
{{- end }}
{{- if include "ngrammys.batchClaim" . }}
{{- $owner := "one server owns a batch store on a claim (a file lock; another answers 503 on the batch routes; batchStore.url shares a PostgreSQL store between replicas)" }}
{{- if gt (int .Values.replicaCount) 1 }}
{{- fail (printf "batchStore.enabled needs replicaCount 1, not %d: %s" (int .Values.replicaCount) $owner) }}
{{- end }}
{{- if .Values.autoscaling.enabled }}
{{- fail (printf "batchStore.enabled cannot be combined with autoscaling.enabled (HPA or KEDA): %s" $owner) }}
{{- end }}
{{- if .Values.leaderWorkerSet.enabled }}
{{- fail (printf "batchStore.enabled needs the Deployment, not leaderWorkerSet.enabled: %s, and a group's rollout cannot Recreate" $owner) }}
{{- end }}
{{- if eq (trimSuffix "/" .Values.batchStore.mountPath) (trimSuffix "/" .Values.cache.mountPath) }}
{{- fail "batchStore.mountPath must differ from cache.mountPath: two volumes cannot share a mount path" }}
{{- end }}
{{- end }}
{{- end }}
