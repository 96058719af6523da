{{/*
Names. The RayCluster is named <fullname>; KubeRay names its head Service <fullname>-head-svc and
the chart adds <fullname>-worker-metrics, so the full name stays within 47 characters.
*/}}
{{- define "radixmesh.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 47 | trimSuffix "-" -}}
{{- end -}}

{{- define "radixmesh.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "radixmesh.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "radixmesh.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* Pods of this RayCluster, as KubeRay labels them (ray.io/cluster cannot be overridden). */}}
{{- define "radixmesh.clusterSelector" -}}
ray.io/cluster: {{ include "radixmesh.fullname" . }}
{{- end -}}

{{- define "radixmesh.headSelector" -}}
{{ include "radixmesh.clusterSelector" . }}
ray.io/node-type: head
{{- end -}}

{{- define "radixmesh.workerSelector" -}}
{{ include "radixmesh.clusterSelector" . }}
ray.io/node-type: worker
{{- end -}}

{{- define "radixmesh.gpu" -}}
{{- if gt (int .Values.worker.gpus) 0 }}true{{ end -}}
{{- end -}}

{{- define "radixmesh.image" -}}
{{- $flavor := ternary "cuda" "cpu" (eq (include "radixmesh.gpu" .) "true") -}}
{{- $tag := .Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $flavor) -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}

{{/* radixmesh workers: config.workers.count, or replicas x workers per pod. */}}
{{- define "radixmesh.workerCount" -}}
{{- $perPod := ternary (int .Values.worker.gpus) (int .Values.worker.cpuWorkersPerPod) (eq (include "radixmesh.gpu" .) "true") -}}
{{- .Values.config.workers.count | default (mul (int .Values.worker.replicas) $perPod) | int -}}
{{- end -}}

{{- define "radixmesh.modelSource" -}}
{{- $source := .Values.model.source -}}
{{- if or (eq $source "default") (hasPrefix "/" $source) -}}
{{- $source -}}
{{- else -}}
{{- printf "%s/%s" (trimSuffix "/" .Values.model.volume.mountPath) $source -}}
{{- end -}}
{{- end -}}

{{/*
The model id clients send to the HTTP API: config.model.served_name, else radixmesh's default
(cluster/config.py ModelSection.name): SmolLM2-135M-Instruct for "default", else the source's
last path element, less a ".gguf" suffix.
*/}}
{{- define "radixmesh.servedName" -}}
{{- $source := include "radixmesh.modelSource" . -}}
{{- if .Values.config.model.served_name -}}
{{- .Values.config.model.served_name -}}
{{- else if eq $source "default" -}}
SmolLM2-135M-Instruct
{{- else -}}
{{- $base := base (regexReplaceAll "/+$" $source "") -}}
{{- trimSuffix ".gguf" $base | default $source -}}
{{- end -}}
{{- end -}}

{{/* The router's HTTP port (config.router.http_port); empty when the HTTP API is off. */}}
{{- define "radixmesh.httpPort" -}}
{{- with .Values.config.router.http_port }}{{ int . }}{{ end -}}
{{- end -}}

{{- define "radixmesh.tlsServerName" -}}
{{- .Values.tls.serverName | default (printf "%s.%s.svc" (include "radixmesh.fullname" .) .Release.Namespace) -}}
{{- end -}}

{{- define "radixmesh.rayAuthSecret" -}}
{{- .Values.ray.auth.existingSecret | default (printf "%s-ray-auth" (include "radixmesh.fullname" .)) -}}
{{- end -}}

{{- define "radixmesh.tokensSecret" -}}
{{- .Values.auth.existingSecret | default (printf "%s-tokens" (include "radixmesh.fullname" .)) -}}
{{- end -}}

{{/* Seconds the pods get to stop: serve's drain, plus margin for Ray to stop. */}}
{{- define "radixmesh.drainSeconds" -}}
{{- add (int (ceil .Values.config.drain_timeout_s)) 5 -}}
{{- end -}}

{{/*
The radixmesh config file. Everything under .Values.config, plus the keys the chart owns. Tokens
are merged in at start by the render-config init container (they live in a Secret).
*/}}
{{- define "radixmesh.config" -}}
{{- $cfg := deepCopy .Values.config -}}
{{- $model := $cfg.model | default dict -}}
{{- $_ := set $model "source" (include "radixmesh.modelSource" .) -}}
{{- if eq ($model.device | default "auto") "auto" -}}
{{- $_ := set $model "device" (ternary "cuda" "cpu" (eq (include "radixmesh.gpu" .) "true")) -}}
{{- end -}}
{{- $_ := set $cfg "model" $model -}}
{{- if .Values.kvCache.persistence.enabled -}}
{{- $engine := $cfg.engine | default dict -}}
{{- $_ := set $engine "persist_dir" .Values.kvCache.persistence.mountPath -}}
{{- $_ := set $cfg "engine" $engine -}}
{{- end -}}
{{- $workers := $cfg.workers | default dict -}}
{{- $_ := set $workers "host" "0.0.0.0" -}}
{{- $_ := set $workers "count" (include "radixmesh.workerCount" . | int) -}}
{{- $_ := set $cfg "workers" $workers -}}
{{- $router := $cfg.router | default dict -}}
{{- $_ := set $router "host" "0.0.0.0" -}}
{{- $_ := set $router "resource" .Values.ray.routerResource -}}
{{- if .Values.routerState.persistence.enabled -}}
{{- $_ := set $router "state_dir" .Values.routerState.persistence.mountPath -}}
{{- end -}}
{{- /* Written even when null: helm drops a null key, and radixmesh's default (8000) would
       turn the HTTP API back on. */ -}}
{{- if not (hasKey $router "http_port") -}}
{{- $_ := set $router "http_port" nil -}}
{{- end -}}
{{- $_ := set $cfg "router" $router -}}
{{- $metrics := $cfg.metrics | default dict -}}
{{- $_ := set $metrics "host" "0.0.0.0" -}}
{{- $_ := set $cfg "metrics" $metrics -}}
{{- $security := dict "auth_tokens" dict -}}
{{- if .Values.tls.enabled -}}
{{- $_ := set $security "tls_cert" "/etc/radixmesh/tls/tls.crt" -}}
{{- $_ := set $security "tls_key" "/etc/radixmesh/tls/tls.key" -}}
{{- if .Values.tls.clientAuth -}}
{{- $_ := set $security "tls_client_ca" (ternary "/etc/radixmesh/client-ca/ca.crt" "/etc/radixmesh/tls/ca.crt" (ne .Values.tls.clientCASecret "")) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $cfg "security" $security -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/* The environment every Ray process needs: Ray token authentication. */}}
{{- define "radixmesh.rayAuthEnv" -}}
{{- if .Values.ray.auth.enabled }}
- name: RAY_AUTH_MODE
  value: token
- name: RAY_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "radixmesh.rayAuthSecret" . }}
      key: auth_token
{{- else }}
- name: RAY_AUTH_MODE
  value: disabled
{{- end }}
{{- end -}}

{{/*
Arguments of health_check.py (exec probes, TLS): the gRPC health service `service` on `port`
(default: config.router.port), or with `http` the HTTP API's GET of that path.
*/}}
{{- define "radixmesh.healthCheckArgs" -}}
- --port
- {{ .port | default .root.Values.config.router.port | int | quote }}
{{- if .http }}
- --http
- {{ .http | quote }}
{{- else }}
- --service
- {{ .service | quote }}
{{- end }}
{{- if .root.Values.tls.enabled }}
- --tls-ca
- /etc/radixmesh/tls/ca.crt
- --server-name
- {{ include "radixmesh.tlsServerName" .root }}
{{- if .root.Values.tls.clientAuth }}
{{- $dir := ternary "/etc/radixmesh/probe-tls" "/etc/radixmesh/tls" (ne .root.Values.tls.probeClientSecret "") }}
- --tls-cert
- {{ $dir }}/tls.crt
- --tls-key
- {{ $dir }}/tls.key
{{- end }}
{{- end }}
{{- end -}}

{{/*
A probe of the router's standard gRPC health service: Kubernetes' native gRPC probe, or, with TLS
(which the kubelet's gRPC probe does not speak), health_check.py from the chart's ConfigMap.
*/}}
{{- define "radixmesh.probe" -}}
{{- if .root.Values.tls.enabled -}}
exec:
  command:
    - python
    - /etc/radixmesh/chart/health_check.py
{{ include "radixmesh.healthCheckArgs" . | indent 4 }}
{{- else -}}
grpc:
  port: {{ int .root.Values.config.router.port }}
  service: {{ .service | quote }}
{{- end }}
{{ toYaml .timing }}
{{- end -}}

{{/*
The readiness probe: does the router have a worker to serve with? With the HTTP API on, its
GET /health (200 while a worker is attached, 503 with none or while draining): the kubelet's
httpGet (HTTPS under TLS; it does not verify the certificate), or, under mutual TLS (the kubelet
has no client certificate to present), health_check.py --http. With the HTTP API off, the gRPC
health of radixmesh.v1.Serving. The port is a number: a probe resolves a port name only among
its own container's ports, and the router's are on ray-head.
*/}}
{{- define "radixmesh.readinessProbe" -}}
{{- $http := include "radixmesh.httpPort" .root -}}
{{- if and $http .root.Values.tls.clientAuth -}}
exec:
  command:
    - python
    - /etc/radixmesh/chart/health_check.py
{{ include "radixmesh.healthCheckArgs" (dict "root" .root "port" $http "http" "/health") | indent 4 }}
{{ toYaml .timing }}
{{- else if $http -}}
httpGet:
  path: /health
  port: {{ int $http }}
  scheme: {{ ternary "HTTPS" "HTTP" .root.Values.tls.enabled }}
{{ toYaml .timing }}
{{- else -}}
{{ include "radixmesh.probe" (dict "root" .root "service" "radixmesh.v1.Serving" "timing" .timing) }}
{{- end }}
{{- end -}}

{{/* Fail on values that render valid YAML but a cluster that cannot work. */}}
{{- define "radixmesh.validate" -}}
{{- $w := .Values.worker -}}
{{- if or (gt (int $w.minReplicas) (int $w.replicas)) (lt (int $w.maxReplicas) (int $w.replicas)) -}}
{{- fail (printf "worker: need minReplicas (%v) <= replicas (%v) <= maxReplicas (%v)" $w.minReplicas $w.replicas $w.maxReplicas) -}}
{{- end -}}
{{- if lt (include "radixmesh.workerCount" . | int) 1 -}}
{{- fail "no radixmesh worker: set worker.replicas (and worker.gpus or worker.cpuWorkersPerPod) or config.workers.count" -}}
{{- end -}}
{{- if and (ne .Values.model.source "default") (not (hasPrefix "/" .Values.model.source)) (eq .Values.model.volume.type "none") -}}
{{- fail (printf "model.source %q is a path on the model volume, but model.volume.type is none" .Values.model.source) -}}
{{- end -}}
{{- if and (eq .Values.model.volume.type "persistentVolumeClaim") (not .Values.model.volume.claimName) -}}
{{- fail "model.volume.type persistentVolumeClaim needs model.volume.claimName" -}}
{{- end -}}
{{- if and (eq .Values.model.volume.type "hostPath") (not .Values.model.volume.hostPath) -}}
{{- fail "model.volume.type hostPath needs model.volume.hostPath" -}}
{{- end -}}
{{- if and .Values.tls.enabled (not .Values.tls.existingSecret) -}}
{{- fail "tls.enabled needs tls.existingSecret (a kubernetes.io/tls Secret with tls.crt, tls.key and ca.crt)" -}}
{{- end -}}
{{- if and .Values.tls.clientAuth (not .Values.tls.enabled) -}}
{{- fail "tls.clientAuth needs tls.enabled" -}}
{{- end -}}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) (not .Values.auth.tokens) -}}
{{- fail "auth.enabled needs auth.existingSecret (key tokens.yaml) or auth.tokens" -}}
{{- end -}}
{{- $cpu := "" -}}
{{- with $w.resources.limits }}{{ $cpu = toString (.cpu | default "") }}{{ end -}}
{{- if regexMatch "^[0-9]+(\\.[0-9]+)?$" $cpu -}}
{{- $perPod := ternary (int $w.gpus) (int $w.cpuWorkersPerPod) (eq (include "radixmesh.gpu" .) "true") -}}
{{- $need := mulf (float64 .Values.config.workers.cpus_per_worker) (float64 $perPod) -}}
{{- if lt (ceil (float64 $cpu)) $need -}}
{{- fail (printf "worker.resources.limits.cpu %s is fewer CPUs than the %d worker(s) of a pod need (%v each, config.workers.cpus_per_worker)" $cpu $perPod .Values.config.workers.cpus_per_worker) -}}
{{- end -}}
{{- end -}}
{{- with include "radixmesh.httpPort" . -}}
{{- $taken := dict (toString (int $.Values.config.router.port)) "config.router.port" "6379" "Ray's GCS" "8265" "Ray's dashboard" "10001" "Ray's client server" "8080" "Ray's metrics" -}}
{{- if $.Values.config.metrics.enabled -}}
{{- $_ := set $taken (toString (int $.Values.config.metrics.router_port)) "config.metrics.router_port" -}}
{{- end -}}
{{- with get $taken . -}}
{{- fail (printf "config.router.http_port %s collides with %s on the head pod" (include "radixmesh.httpPort" $) .) -}}
{{- end -}}
{{- end -}}
{{- $e := .Values.config.engine | default dict -}}
{{- $pageSize := int (get $e "page_size" | default 16) -}}
{{- $blockSize := int (get $e "block_size" | default 16) -}}
{{- if mod $blockSize $pageSize -}}
{{- fail (printf "config.engine.block_size %d is not a multiple of page_size %d (16 where unset): a routing block must end on a page boundary" $blockSize $pageSize) -}}
{{- end -}}
{{- $m := .Values.config.metrics -}}
{{- if and $m.enabled (or (eq (int $m.router_port) 0) (eq (int $m.worker_port) 0)) -}}
{{- fail "config.metrics: ports 0 (any free port) cannot be scraped through a Service; set fixed ports or enabled: false" -}}
{{- end -}}
{{- end -}}
