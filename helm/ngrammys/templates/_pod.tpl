{{/*
The pod template of the Deployment and of the LeaderWorkerSet's leader and workers:
  include "ngrammys.podTemplate" (dict "root" $ "role" "server")
role: server (the Deployment's pod), leader (a group's rank-0 pod: the HTTP server) or worker
(the other pods of a group: leaderWorkerSet.workerCommand, no HTTP port, no probes).
*/}}
{{- define "ngrammys.podTemplate" -}}
{{- $root := .root -}}
{{- $role := .role -}}
{{- $values := $root.Values -}}
{{- $serves := ne $role "worker" -}}
{{- $grouped := ne $role "server" -}}
{{- $resources := deepCopy (default (dict) $values.resources) -}}
{{- if $values.gpu.enabled -}}
{{- $limits := deepCopy (default (dict) $resources.limits) -}}
{{- $_ := set $limits $values.gpu.resourceName (include "ngrammys.gpuCount" $root) -}}
{{- $_ := set $resources "limits" $limits -}}
{{- end -}}
metadata:
  annotations:
    checksum/config: {{ include (print $root.Template.BasePath "/configmap.yaml") $root | sha256sum }}
    {{- if and $serves $values.metrics.podAnnotations }}
    prometheus.io/scrape: "true"
    prometheus.io/port: {{ $values.server.port | quote }}
    prometheus.io/path: /metrics
    {{- end }}
    {{- with $values.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  labels:
    {{- include "ngrammys.labels" $root | nindent 4 }}
    {{- if $grouped }}
    app.kubernetes.io/component: {{ $role }}
    {{- end }}
    {{- if and $serves $values.inferencePool.enabled }}
    # The Endpoint Picker reads this pod's metrics under the names it configures for this engine.
    inference.networking.k8s.io/engine-type: {{ $values.inferencePool.engineType }}
    {{- end }}
    {{- with $values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ngrammys.serviceAccountName" $root }}
  automountServiceAccountToken: false
  {{- with $values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with $values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $values.podSecurityContext | nindent 4 }}
  # preStop sleep + the server's drain + a margin.
  terminationGracePeriodSeconds: {{ include "ngrammys.terminationGracePeriod" $root }}
  {{- if or $values.cache.seedFromImage (eq $values.model.source "initContainer") }}
  initContainers:
    {{- if $values.cache.seedFromImage }}
    # Links the image's baked cache and tables into the writable cache: nothing is copied,
    # and the server finds them without reading the GGUF's metadata or recomputing.
    - name: seed-cache
      image: {{ include "ngrammys.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      command: ["cp", "-rsf", {{ printf "%s/." (trimSuffix "/" $values.image.cacheDir) | quote }}, {{ printf "%s/" (trimSuffix "/" $values.cache.mountPath) | quote }}]
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      resources:
        requests:
          cpu: 10m
          memory: 32Mi
        limits:
          memory: 64Mi
      volumeMounts:
        - name: cache
          mountPath: {{ $values.cache.mountPath }}
    {{- end }}
    {{- if eq $values.model.source "initContainer" }}
    - name: fetch-model
      image: {{ $values.model.initContainer.image }}
      imagePullPolicy: {{ $values.model.initContainer.pullPolicy }}
      command:
        {{- toYaml $values.model.initContainer.command | nindent 8 }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      volumeMounts:
        - name: models
          mountPath: /models
    {{- end }}
  {{- end }}
  containers:
    - name: {{ ternary "ngrammys" "ngrammys-worker" $serves }}
      image: {{ include "ngrammys.image" $root }}
      imagePullPolicy: {{ $values.image.pullPolicy }}
      {{- if not $serves }}
      # The rest of the group's ranks, started by this pod's worker; the leader's server
      # drives them (deploy/README.md, "Scaling out").
      command:
        {{- toYaml $values.leaderWorkerSet.workerCommand | nindent 8 }}
      {{- end }}
      securityContext:
        {{- toYaml $values.securityContext | nindent 8 }}
      envFrom:
        - configMapRef:
            name: {{ include "ngrammys.fullname" $root }}
      env:
        # The root filesystem is read-only: scratch files go to the /tmp volume.
        - name: HOME
          value: /tmp
        - name: MPLCONFIGDIR
          value: /tmp/matplotlib
        {{- if $grouped }}
        # torch.distributed's rendezvous (env://) at the group's leader. LeaderWorkerSet puts
        # LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX first in every container's env.
        - name: MASTER_ADDR
          value: $(LWS_LEADER_ADDRESS)
        - name: MASTER_PORT
          value: {{ $values.leaderWorkerSet.rendezvousPort | quote }}
        {{- end }}
        {{- if and $serves $values.batchStore.enabled $values.batchStore.url.secretName }}
        # Batch jobs' store: the PostgreSQL URL the replicas share, from its Secret (it carries
        # the password).
        - name: NGRAMMYS_BATCH_STORE
          valueFrom:
            secretKeyRef:
              name: {{ $values.batchStore.url.secretName }}
              key: {{ $values.batchStore.url.key }}
        {{- end }}
        {{- with $values.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- if or $serves (eq $role "leader") }}
      ports:
        - name: http
          containerPort: {{ $values.server.port }}
          protocol: TCP
        {{- if eq $role "leader" }}
        - name: rendezvous
          containerPort: {{ $values.leaderWorkerSet.rendezvousPort }}
          protocol: TCP
        {{- end }}
      {{- end }}
      {{- if $serves }}
      startupProbe:
        httpGet:
          path: /ready
          port: http
        {{- toYaml $values.probes.startup | nindent 8 }}
      livenessProbe:
        httpGet:
          path: /health
          port: http
        {{- toYaml $values.probes.liveness | nindent 8 }}
      readinessProbe:
        httpGet:
          path: /ready
          port: http
        {{- toYaml $values.probes.readiness | nindent 8 }}
      {{- if gt (int $values.server.preStopSleepSeconds) 0 }}
      lifecycle:
        preStop:
          exec:
            command: ["sleep", {{ $values.server.preStopSleepSeconds | toString | quote }}]
      {{- end }}
      {{- end }}
      resources:
        {{- toYaml $resources | nindent 8 }}
      volumeMounts:
        - name: cache
          mountPath: {{ $values.cache.mountPath }}
        - name: tmp
          mountPath: /tmp
        {{- if include "ngrammys.sharedMemory" $root }}
        - name: shm
          mountPath: /dev/shm
        {{- end }}
        {{- if ne $values.model.source "image" }}
        - name: models
          mountPath: /models
          readOnly: true
          {{- if and (eq $values.model.source "pvc") $values.model.pvc.subPath }}
          subPath: {{ $values.model.pvc.subPath }}
          {{- end }}
        {{- end }}
        {{- if and $serves $values.apiKey.existingSecret }}
        - name: api-key
          mountPath: {{ $values.apiKey.mountPath }}
          readOnly: true
        {{- end }}
        {{- if and $serves (include "ngrammys.batchClaim" $root) }}
        - name: batch-store
          mountPath: {{ $values.batchStore.mountPath }}
        {{- end }}
  volumes:
    - name: cache
      {{- if $values.cache.persistence.enabled }}
      persistentVolumeClaim:
        claimName: {{ default (printf "%s-cache" (include "ngrammys.fullname" $root)) $values.cache.persistence.existingClaim }}
      {{- else }}
      emptyDir:
        sizeLimit: {{ $values.cache.emptyDir.sizeLimit }}
      {{- end }}
    - name: tmp
      emptyDir:
        sizeLimit: 1Gi
    {{- if include "ngrammys.sharedMemory" $root }}
    # NCCL's buffers between the ranks of this pod. Memory-backed: counted in the memory limit.
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ $values.sharedMemory.sizeLimit }}
    {{- end }}
    {{- if eq $values.model.source "pvc" }}
    - name: models
      persistentVolumeClaim:
        claimName: {{ $values.model.pvc.claimName }}
        readOnly: true
    {{- else if eq $values.model.source "initContainer" }}
    - name: models
      emptyDir:
        sizeLimit: {{ $values.model.initContainer.sizeLimit }}
    {{- end }}
    {{- if and $serves $values.apiKey.existingSecret }}
    - name: api-key
      secret:
        secretName: {{ $values.apiKey.existingSecret }}
        defaultMode: 0440
        items:
          - key: {{ $values.apiKey.secretKey }}
            path: {{ $values.apiKey.secretKey }}
    {{- end }}
    {{- if and $serves (include "ngrammys.batchClaim" $root) }}
    # Batch jobs' store: SQLite and the files, owned by this pod's server (a file lock).
    - name: batch-store
      persistentVolumeClaim:
        claimName: {{ default (printf "%s-batches" (include "ngrammys.fullname" $root)) $values.batchStore.existingClaim }}
    {{- end }}
  {{- with $values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{/* GPUs per pod: one per tensor-parallel rank, else gpu.count. */}}
{{- define "ngrammys.gpuCount" -}}
{{- if gt (int .Values.tensorParallelSize) 1 }}{{ .Values.tensorParallelSize }}{{ else }}{{ .Values.gpu.count }}{{ end -}}
{{- end }}

{{/* Non-empty when the pod gets a memory-backed /dev/shm: ranks talk through it (NCCL). */}}
{{- define "ngrammys.sharedMemory" -}}
{{- if or (gt (int .Values.tensorParallelSize) 1) .Values.leaderWorkerSet.enabled }}true{{ end -}}
{{- end }}
