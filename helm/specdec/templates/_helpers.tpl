{{/* ------------------------------------------------------------------ names and labels */}}

{{- define "specdec.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* "<release>-<chart>", or the release name alone when it already contains the chart name. */}}
{{- define "specdec.fullname" -}}
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

{{/* Name of one component's objects: (dict "root" $ "component" "target") */}}
{{- define "specdec.componentName" -}}
{{- printf "%s-%s" (include "specdec.fullname" .root | trunc 50 | trimSuffix "-") .component }}
{{- end }}

{{- define "specdec.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels that select one component's pods: (dict "root" $ "component" "target") */}}
{{- define "specdec.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdec.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Every label of one component's objects: (dict "root" $ "component" "target") */}}
{{- define "specdec.labels" -}}
helm.sh/chart: {{ include "specdec.chart" .root }}
{{ include "specdec.selectorLabels" . }}
app.kubernetes.io/part-of: specdec
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end }}

{{- define "specdec.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdec.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The orchestrator's ServiceAccount. With discovery.kubernetes (and serviceAccount.create) it has
its own, the only one bound to the EndpointSlice Role, so no other pod can read the API; else the
chart's shared one.
*/}}
{{- define "specdec.orchestratorServiceAccountName" -}}
{{- if and .Values.discovery.kubernetes .Values.serviceAccount.create }}
{{- include "specdec.componentName" (dict "root" . "component" "orchestrator") }}
{{- else }}
{{- include "specdec.serviceAccountName" . }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ addresses */}}

{{/* "dns:///<headless service>.<namespace>.svc.<domain>:<port>": one name, every ready replica. */}}
{{- define "specdec.dnsAddress" -}}
{{- printf "dns:///%s.%s.svc.%s:%d" (include "specdec.componentName" .) .root.Release.Namespace .root.Values.clusterDomain (int .port) }}
{{- end }}

{{/*
The orchestrator's --target / --draft of one backend: (dict "root" $ "component" "target" "port" 50053).
With discovery.kubernetes, "kubernetes:///<namespace>/<service>:<port>": the orchestrator watches
the Service's EndpointSlices through the API (ready replicas, their nodes and zones, no DNS
caching), and falls back to DNS when the API is unreachable. Otherwise the dns:/// name above.
*/}}
{{- define "specdec.backendAddress" -}}
{{- if .root.Values.discovery.kubernetes }}
{{- printf "kubernetes:///%s/%s:%d" .root.Release.Namespace (include "specdec.componentName" .) (int .port) }}
{{- else }}
{{- include "specdec.dnsAddress" . }}
{{- end }}
{{- end }}

{{/* "<service>.<namespace>.svc.<domain>:<port>" of a ClusterIP Service: (dict "root" $ "component" "orchestrator" "port" 50051) */}}
{{- define "specdec.serviceAddress" -}}
{{- printf "%s.%s.svc.%s:%d" (include "specdec.componentName" .) .root.Release.Namespace .root.Values.clusterDomain (int .port) }}
{{- end }}

{{- define "specdec.redisSecretName" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecret }}
{{- else }}
{{- include "specdec.componentName" (dict "root" . "component" "redis") }}
{{- end }}
{{- end }}

{{- define "specdec.redisSecretKey" -}}
{{- if .Values.redis.auth.existingSecret }}
{{- .Values.redis.auth.existingSecretPasswordKey }}
{{- else -}}
redis-password
{{- end }}
{{- end }}

{{/*
Non-empty when the draft reads the orchestrator's stream of finished outputs (suffix speculation
with draft.suffix.sharedCorpus): it then connects to the orchestrator's Redis, which must have one URL.
*/}}
{{- define "specdec.draftReadsOutputs" -}}
{{- $v := .Values.draft }}
{{- if and $v.enabled (has $v.proposer (list "suffix" "hybrid")) $v.suffix.sharedCorpus }}
{{- if and (not .Values.redis.enabled) (or .Values.redis.external.clusterNodes .Values.redis.external.sentinels) }}
{{- fail "draft.suffix.sharedCorpus reads the orchestrator's outputs stream from one Redis URL, and a Redis Cluster or Sentinel has none: set draft.suffix.sharedCorpus=false (each draft replica learns the sessions it served)" }}
{{- end }}
{{- true }}
{{- end }}
{{- end }}

{{/*
The orchestrator's --redis-url, without credentials: with auth the orchestrator reads the
password from its $REDIS_PASSWORD, which the Secret fills, so it is in no value and no argv.
*/}}
{{- define "specdec.redisUrl" -}}
{{- $url := "" }}
{{- if .Values.redis.enabled }}
{{- $url = printf "redis://%s.%s.svc.%s:%d/0" (include "specdec.componentName" (dict "root" . "component" "redis")) .Release.Namespace .Values.clusterDomain (int .Values.redis.port) }}
{{- else }}
{{- $url = required "redis.external.url is required when redis.enabled is false" .Values.redis.external.url }}
{{- end }}
{{- if .Values.redis.auth.enabled }}
{{- if contains "@" $url }}
{{- fail "redis.external.url must not hold credentials: the password comes from redis.auth.existingSecret" }}
{{- end }}
{{- end }}
{{- $url }}
{{- end }}

{{/*
The orchestrator's Redis flags, as a JSON list: the in-chart Redis or an external one by URL
(--redis-url), an external Redis Cluster (--redis-cluster-nodes) or Redis Sentinel
(--redis-sentinels, --redis-sentinel-master); exactly one of them.
*/}}
{{- define "specdec.redisArgs" -}}
{{- $ext := .Values.redis.external }}
{{- $modes := 0 }}
{{- range (list $ext.url $ext.clusterNodes $ext.sentinels) }}{{ if . }}{{ $modes = add1 $modes }}{{ end }}{{ end }}
{{- if .Values.redis.enabled }}
{{- if or $ext.clusterNodes $ext.sentinels }}
{{- fail "redis.external.clusterNodes and redis.external.sentinels need redis.enabled=false" }}
{{- end }}
{{- list "--redis-url" (include "specdec.redisUrl" .) | toJson }}
{{- else if gt $modes 1 }}
{{- fail "set one of redis.external.url, redis.external.clusterNodes and redis.external.sentinels" }}
{{- else if $ext.clusterNodes }}
{{- concat (list "--redis-cluster-nodes" $ext.clusterNodes) (ternary (list "--redis-tls") list $ext.tls) | toJson }}
{{- else if $ext.sentinels }}
{{- $master := required "redis.external.sentinelMaster is required with redis.external.sentinels" $ext.sentinelMaster }}
{{- concat (list "--redis-sentinels" $ext.sentinels "--redis-sentinel-master" $master) (ternary (list "--redis-tls") list $ext.tls) | toJson }}
{{- else }}
{{- list "--redis-url" (include "specdec.redisUrl" .) | toJson }}
{{- end }}
{{- end }}

{{/* ------------------------------------------------------------------ bearer tokens */}}

{{/*
The Secret holding the public APIs' bearer tokens ("" when none): auth.existingSecret, or its
deprecated alias gateway.auth.existingSecret.
*/}}
{{- define "specdec.authSecret" -}}
{{- $secret := .Values.auth.existingSecret }}
{{- $alias := .Values.gateway.auth.existingSecret }}
{{- if and $secret $alias (ne $secret $alias) }}
{{- fail "auth.existingSecret and gateway.auth.existingSecret name different Secrets: set auth.existingSecret alone (gateway.auth is its deprecated alias)" }}
{{- end }}
{{- default $alias $secret }}
{{- end }}

{{/*
The tokens file of the public APIs, for the orchestrator and the gateway alike: as JSON, the flags
(`--auth-tokens-file`), the pod's volume and the container's read-only mount; empty lists when no
Secret is set.
*/}}
{{- define "specdec.authTokens" -}}
{{- $secret := include "specdec.authSecret" . }}
{{- $out := dict "args" list "volumes" list "mounts" list }}
{{- if $secret }}
{{- $key := ternary .Values.auth.tokensKey .Values.gateway.auth.tokensKey (not (empty .Values.auth.existingSecret)) }}
{{- $dir := "/etc/specdec/auth" }}
{{- $out = dict "args" (list "--auth-tokens-file" (printf "%s/tokens" $dir))
      "volumes" (list (dict "name" "auth-tokens" "secret" (dict "secretName" $secret "defaultMode" 288
        "items" (list (dict "key" $key "path" "tokens")))))
      "mounts" (list (dict "name" "auth-tokens" "mountPath" $dir "readOnly" true)) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* ------------------------------------------------------------------ pods */}}

{{/* image reference of a component: (dict "root" $ "image" .Values.target.image) */}}
{{- define "specdec.image" -}}
{{- $image := merge (deepCopy (default (dict) .image)) .root.Values.image }}
{{- printf "%s:%s" $image.repository (default .root.Chart.AppVersion $image.tag) }}
{{- end }}

{{- define "specdec.imagePullPolicy" -}}
{{- $image := merge (deepCopy (default (dict) .image)) .root.Values.image }}
{{- $image.pullPolicy }}
{{- end }}

{{/* Native gRPC startup, readiness and liveness probes on the standard health service. */}}
{{- define "specdec.grpcProbes" -}}
startupProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  grpc:
    port: {{ .port }}
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/* HTTP probes of the gateway: startup and liveness on the open port, readiness on GET /health. */}}
{{- define "specdec.httpProbes" -}}
startupProbe:
  tcpSocket:
    port: http
  {{- toYaml .probes.startup | nindent 2 }}
readinessProbe:
  httpGet:
    path: /health
    port: http
  {{- toYaml .probes.readiness | nindent 2 }}
livenessProbe:
  tcpSocket:
    port: http
  {{- toYaml .probes.liveness | nindent 2 }}
{{- end }}

{{/* requests/limits with the component's GPUs added: (the component's values) */}}
{{- define "specdec.resources" -}}
{{- $resources := deepCopy (default (dict) .resources) }}
{{- if and .gpu (gt (int .gpu.count) 0) }}
{{- $limits := default (dict) $resources.limits }}
{{- $requests := default (dict) $resources.requests }}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) }}
{{- $_ = set $requests .gpu.resourceName (int .gpu.count) }}
{{- $_ = set $resources "limits" $limits }}
{{- $_ = set $resources "requests" $requests }}
{{- end }}
{{- toYaml $resources }}
{{- end }}

{{/* nodeSelector with the GPU type added: (the component's values) */}}
{{- define "specdec.nodeSelector" -}}
{{- $selector := deepCopy (default (dict) .nodeSelector) }}
{{- if and .gpu .gpu.type }}
{{- $_ := set $selector .gpu.typeLabel .gpu.type }}
{{- end }}
{{- if $selector }}
{{- toYaml $selector }}
{{- end }}
{{- end }}

{{- define "specdec.modelCacheClaimName" -}}
{{- if .Values.modelCache.persistence.existingClaim }}
{{- .Values.modelCache.persistence.existingClaim }}
{{- else }}
{{- include "specdec.componentName" (dict "root" . "component" "model-cache") }}
{{- end }}
{{- end }}

{{/*
One Deployment of a specdec service. Arguments:
  root: $;  component: "draft" | "target" | "orchestrator" | "gateway";  values: its values;
  module: the Python module to run;  args: its flags (list);  env: extra EnvVars (list);
  port: its serving port;  lifecycle: a container lifecycle (map) or nil.
Optional (the gRPC services leave them out):
  portName: name of the serving port (default "grpc");
  probes: rendered startup/readiness/liveness probes (default: gRPC probes on `port`);
  modelCache: mount the model cache and set its variables (default true);
  metrics: pass --metrics-port when metrics are on (default true);
  serviceAccountName: the pod's ServiceAccount (default the chart's);
  automountToken: mount an API token in the pod (default false);
  volumes, volumeMounts: extra volumes of the pod and mounts of its container (lists).
*/}}
{{- define "specdec.deployment" -}}
{{- $root := .root }}
{{- $v := .values }}
{{- $ctx := dict "root" $root "component" .component }}
{{- $portName := default "grpc" .portName }}
{{- $modelCache := ternary .modelCache true (hasKey . "modelCache") }}
{{- $metrics := and $root.Values.metrics.enabled (ternary .metrics true (hasKey . "metrics")) }}
{{- $probes := .probes | default (include "specdec.grpcProbes" (dict "port" .port "probes" $v.probes)) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  {{- if not (and $v.autoscaling $v.autoscaling.enabled) }}
  replicas: {{ $v.replicas }}
  {{- end }}
  revisionHistoryLimit: 5
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
  strategy:
    type: RollingUpdate
    rollingUpdate:
      {{- toYaml $v.rollingUpdate | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "specdec.labels" $ctx | nindent 8 }}
        {{- with $v.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      serviceAccountName: {{ .serviceAccountName | default (include "specdec.serviceAccountName" $root) }}
      automountServiceAccountToken: {{ .automountToken | default false }}
      enableServiceLinks: false
      securityContext:
        {{- toYaml $root.Values.podSecurityContext | nindent 8 }}
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
      {{- with (include "specdec.nodeSelector" $v) }}
      nodeSelector:
        {{- . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ .component }}
          image: {{ include "specdec.image" (dict "root" $root "image" $v.image) }}
          imagePullPolicy: {{ include "specdec.imagePullPolicy" (dict "root" $root "image" $v.image) }}
          command: ["python", "-m", {{ .module | quote }}]
          args:
            {{- if $metrics }}
            - "--metrics-port"
            - {{ $root.Values.metrics.port | quote }}
            {{- end }}
            {{- range .args }}
            - {{ . | quote }}
            {{- end }}
          ports:
            - name: {{ $portName }}
              containerPort: {{ .port }}
              protocol: TCP
            {{- if $metrics }}
            - name: metrics
              containerPort: {{ $root.Values.metrics.port }}
              protocol: TCP
            {{- end }}
          env:
            {{- if $modelCache }}
            - name: SPECDEC_CACHE
              value: {{ $root.Values.modelCache.mountPath | quote }}
            - name: HF_HOME
              value: {{ printf "%s/huggingface" $root.Values.modelCache.mountPath | quote }}
            {{- end }}
            # The root filesystem is read-only: anything a library writes under $HOME lands in /tmp.
            - name: HOME
              value: /tmp
            - name: TMPDIR
              value: /tmp
            {{- if and $modelCache $root.Values.modelCache.allowDownload }}
            - name: SPECDEC_ALLOW_DOWNLOAD
              value: "1"
            {{- end }}
            {{- with .env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $v.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- $probes | nindent 10 }}
          {{- with .lifecycle }}
          lifecycle:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- include "specdec.resources" $v | nindent 12 }}
          securityContext:
            {{- toYaml $root.Values.containerSecurityContext | nindent 12 }}
          volumeMounts:
            {{- if $modelCache }}
            - name: model-cache
              mountPath: {{ $root.Values.modelCache.mountPath }}
            {{- end }}
            - name: tmp
              mountPath: /tmp
            {{- with .volumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        {{- if $modelCache }}
        - name: model-cache
          {{- if $root.Values.modelCache.persistence.enabled }}
          persistentVolumeClaim:
            claimName: {{ include "specdec.modelCacheClaimName" $root }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $root.Values.modelCache.emptyDir.sizeLimit }}
          {{- end }}
        {{- end }}
        {{- with .volumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
        - name: tmp
          emptyDir:
            sizeLimit: {{ $root.Values.tmpSizeLimit }}
{{- end }}

{{/* A PodDisruptionBudget of one component: (dict "root" $ "component" "target" "values" .Values.target) */}}
{{- define "specdec.pdb" -}}
{{- if .values.pdb.enabled }}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ .values.pdb.maxUnavailable }}
  selector:
    matchLabels:
      {{- include "specdec.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- end }}

{{/* A CPU HorizontalPodAutoscaler of one component, when its autoscaling is on: (dict "root" $ "component" "orchestrator" "values" .Values.orchestrator) */}}
{{- define "specdec.hpa" -}}
{{- $a := .values.autoscaling }}
{{- if $a.enabled }}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ include "specdec.componentName" $ctx }}
  minReplicas: {{ $a.minReplicas }}
  maxReplicas: {{ $a.maxReplicas }}
  metrics:
    - type: Resource
      resource:
        name: cpu
        target:
          type: Utilization
          averageUtilization: {{ $a.targetCPUUtilizationPercentage }}
{{- end }}
{{- end }}

{{/* The headless Service of a model service: one DNS name, one A record per ready replica. */}}
{{- define "specdec.headlessService" -}}
{{- $ctx := dict "root" .root "component" .component }}
apiVersion: v1
kind: Service
metadata:
  name: {{ include "specdec.componentName" $ctx }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "specdec.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "specdec.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ .port }}
      targetPort: grpc
      protocol: TCP
      appProtocol: grpc
    {{- with (include "specdec.metricsServicePort" .root) }}{{ . | trim | nindent 4 }}{{ end }}
{{- end }}

{{/* The `metrics` port of a Service, when metrics are on. */}}
{{- define "specdec.metricsServicePort" -}}
{{- if .Values.metrics.enabled }}
- name: metrics
  port: {{ .Values.metrics.port }}
  targetPort: metrics
  protocol: TCP
  appProtocol: http
{{- end }}
{{- end }}

{{/* The NetworkPolicy ingress rule for scraping a service's metrics port, when metrics are on. */}}
{{- define "specdec.metricsIngress" -}}
{{- if .Values.metrics.enabled }}
- ports:
    - protocol: TCP
      port: {{ .Values.metrics.port }}
  {{- with .Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}

{{/* The --device of a model service: its `device` value, else cuda when it is given GPUs, else cpu. */}}
{{- define "specdec.device" -}}
{{- if .device }}{{ .device }}{{- else if and .gpu (gt (int .gpu.count) 0) }}cuda{{- else }}cpu{{- end }}
{{- end }}
