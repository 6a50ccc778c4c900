{{/* Names and labels. */}}
{{- define "workermon.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- /* At most 47 characters: the longest names built on it are the NATS
StatefulSet's, <fullname>-nats, whose pods' controller-revision-hash label
(name + 11) must fit 63, and its headless Service's, <fullname>-nats-headless,
a DNS label of at most 63. */}}
{{- define "workermon.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 47 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 47 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "workermon.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "workermon.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* selectorLabels: pass (dict "ctx" $ "component" "monitor"). */}}
{{- define "workermon.selectorLabels" -}}
app.kubernetes.io/name: {{ include "workermon.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "workermon.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "workermon.natsImage" -}}
{{- printf "%s:%s" .Values.nats.image.repository (default .Chart.AppVersion .Values.nats.image.tag) -}}
{{- end -}}

{{/* The client URL of NATS: our own cluster's Service, or the external URL. */}}
{{- define "workermon.natsURL" -}}
{{- if .Values.nats.enabled -}}
{{- printf "nats://%s-nats.%s.svc:4222" (include "workermon.fullname" .) .Release.Namespace -}}
{{- else -}}
{{- required "nats.external.url is required when nats.enabled is false" .Values.nats.external.url -}}
{{- end -}}
{{- end -}}

{{/* Where the Secrets of the external NATS are mounted. */}}
{{- define "workermon.natsSecretsDir" -}}/etc/workermon/nats{{- end -}}

{{/*
The NATS client flags of a workermon container: URL and, for an external
cluster, the credentials and TLS files mounted from Secrets. The user,
password and token come as environment variables (workermon.natsEnv).
*/}}
{{- define "workermon.natsArgs" -}}
- --nats-url={{ include "workermon.natsURL" . }}
{{- if not .Values.nats.enabled }}
{{- $ext := .Values.nats.external }}
{{- $dir := include "workermon.natsSecretsDir" . }}
{{- if $ext.credentials.secretName }}
- --nats-creds={{ $dir }}/creds/{{ $ext.credentials.key }}
{{- end }}
{{- if $ext.tls.secretName }}
{{- if $ext.tls.caKey }}
- --nats-tls-ca={{ $dir }}/tls/{{ $ext.tls.caKey }}
{{- end }}
{{- if and $ext.tls.certKey $ext.tls.keyKey }}
- --nats-tls-cert={{ $dir }}/tls/{{ $ext.tls.certKey }}
- --nats-tls-key={{ $dir }}/tls/{{ $ext.tls.keyKey }}
{{- else if or $ext.tls.certKey $ext.tls.keyKey }}
{{- fail "nats.external.tls: certKey and keyKey go together (a client certificate needs its key)" }}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* natsEnv: pass (dict "ctx" $ "role" "monitor"), the role's user of our own NATS. */}}
{{- define "workermon.natsEnv" -}}
{{- $role := .role }}
{{- with .ctx }}
{{- if eq (include "workermon.natsAuth" .) "true" }}
- name: WORKERMON_NATS_USER
  value: {{ $role }}
- name: WORKERMON_NATS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ include "workermon.natsAuthSecret" . }}, key: {{ $role }}-password}
{{- end }}
{{- if not .Values.nats.enabled }}
{{- $ext := .Values.nats.external }}
{{- if $ext.userPassword.secretName }}
- name: WORKERMON_NATS_USER
  valueFrom:
    secretKeyRef: {name: {{ $ext.userPassword.secretName }}, key: {{ $ext.userPassword.userKey }}}
- name: WORKERMON_NATS_PASSWORD
  valueFrom:
    secretKeyRef: {name: {{ $ext.userPassword.secretName }}, key: {{ $ext.userPassword.passwordKey }}}
{{- end }}
{{- if $ext.token.secretName }}
- name: WORKERMON_NATS_TOKEN
  valueFrom:
    secretKeyRef: {name: {{ $ext.token.secretName }}, key: {{ $ext.token.key }}}
{{- end }}
{{- end }}
{{- end }}
{{- end -}}

{{/* natsAuth: "true" when our own NATS has users (nats.auth.enabled). */}}
{{- define "workermon.natsAuth" -}}
{{- and .Values.nats.enabled .Values.nats.auth.enabled -}}
{{- end -}}

{{/* The Secret of our own NATS's passwords: one the chart generates, or nats.auth.existingSecret. */}}
{{- define "workermon.natsAuthSecret" -}}
{{- default (printf "%s-nats-auth" (include "workermon.fullname" .)) .Values.nats.auth.existingSecret -}}
{{- end -}}

{{/*
The users of our own NATS, one per role, with the permissions that
`workermon nats-config --users` prints for the same partitions and prefix
(cmd/workermon/natsconfig.go, natsRoles; the chart's tests compare the two
as nats-server parses them). The server reads each password from its
environment, filled from the Secret.
*/}}
{{- define "workermon.natsUsers" -}}
{{- $pre := .Values.subjectPrefix -}}
{{- $parts := int .Values.partitions -}}
{{- $all := list "workermon-busy" "workermon-thresholds" "workermon-workers" "workermon-leases" "workermon-cordons" "workermon-slo" -}}
{{- $watched := list "workermon-busy" "workermon-workers" -}}
{{- /* monitor: full KV on its six buckets, the takeover's key listing, the migrate requests */ -}}
{{- $mon := list "$JS.API.INFO" -}}
{{- range $b := $all -}}
{{- range $op := list "$KV.%s.>" "$JS.API.STREAM.INFO.KV_%s" "$JS.API.STREAM.CREATE.KV_%s" "$JS.API.CONSUMER.CREATE.KV_%s" "$JS.API.CONSUMER.CREATE.KV_%s.>" "$JS.API.CONSUMER.DELETE.KV_%s.*" "$JS.API.DIRECT.GET.KV_%s" "$JS.API.DIRECT.GET.KV_%s.>" "$JS.FC.KV_%s.>" -}}
{{- $mon = append $mon (printf $op $b) -}}
{{- end -}}
{{- end -}}
{{- $mon = append $mon "$JS.API.CONSUMER.MSG.NEXT.KV_workermon-busy.*" -}}
{{- $mon = append $mon (printf "%s.migrate.>" $pre) -}}
{{- /* router: watches two buckets; its estimates, latency windows and queues (§22) */ -}}
{{- $rt := list "$JS.API.INFO" -}}
{{- range $b := $watched -}}
{{- range $op := list "$JS.API.STREAM.INFO.KV_%s" "$JS.API.CONSUMER.CREATE.KV_%s" "$JS.API.CONSUMER.CREATE.KV_%s.>" "$JS.API.CONSUMER.DELETE.KV_%s.*" "$JS.FC.KV_%s.>" -}}
{{- $rt = append $rt (printf $op $b) -}}
{{- end -}}
{{- end -}}
{{- $rtOwn := list "est.>" "latr.>" "rq.>" -}}
{{- /* engine: every worker id's reports, goodbyes, latency windows and registry entry */ -}}
{{- $engOwn := list "load.*.*.*" "bye.*.*" "lat.*.*" -}}
{{- $eng := list -}}
{{- range $s := $rtOwn }}{{ $rt = append $rt (printf "%s.%s" $pre $s) }}{{ end -}}
{{- range $s := $engOwn }}{{ $eng = append $eng (printf "%s.%s" $pre $s) }}{{ end -}}
{{- if gt $parts 1 -}}
{{- range $s := $rtOwn }}{{ $rt = append $rt (printf "%s.part.*.%s" $pre $s) }}{{ end -}}
{{- range $s := $engOwn }}{{ $eng = append $eng (printf "%s.part.*.%s" $pre $s) }}{{ end -}}
{{- end -}}
{{- $eng = concat $eng (list "$KV.workermon-workers.*.*" "$JS.API.INFO" "$JS.API.STREAM.INFO.KV_workermon-workers" "$JS.API.STREAM.CREATE.KV_workermon-workers") -}}
{{- $roles := list
  (dict "user" "monitor" "publish" $mon "subscribe" (list (printf "%s.>" $pre) "_INBOX.>"))
  (dict "user" "router" "publish" $rt "subscribe" (list "_INBOX.>"))
  (dict "user" "engine" "publish" $eng "subscribe" (list "_INBOX.>" (printf "%s.migrate.*.*" $pre)) "responses" true) -}}
authorization {
  users: [
    {{- range $r := $roles }}
    {
      user: {{ $r.user }}
      password: ${{ printf "WORKERMON_NATS_%s_PASSWORD" (upper $r.user) }}
      permissions: {
        publish: {
          allow: [
            {{- range $r.publish }}
            {{ . | quote }}
            {{- end }}
          ]
        }
        subscribe: {
          allow: [
            {{- range $r.subscribe }}
            {{ . | quote }}
            {{- end }}
          ]
        }
        {{- if $r.responses }}
        allow_responses: true
        {{- end }}
      }
    }
    {{- end }}
  ]
}
{{- end -}}

{{- define "workermon.natsVolumeMounts" -}}
{{- if not .Values.nats.enabled }}
{{- $ext := .Values.nats.external }}
{{- $dir := include "workermon.natsSecretsDir" . }}
{{- if $ext.credentials.secretName }}
- {name: nats-creds, mountPath: {{ $dir }}/creds, readOnly: true}
{{- end }}
{{- if $ext.tls.secretName }}
- {name: nats-tls, mountPath: {{ $dir }}/tls, readOnly: true}
{{- end }}
{{- end }}
{{- end -}}

{{- define "workermon.natsVolumes" -}}
{{- if not .Values.nats.enabled }}
{{- $ext := .Values.nats.external }}
{{- if $ext.credentials.secretName }}
- name: nats-creds
  secret:
    secretName: {{ $ext.credentials.secretName }}
    defaultMode: 0440
    items: [{key: {{ $ext.credentials.key }}, path: {{ $ext.credentials.key }}}]
{{- end }}
{{- if $ext.tls.secretName }}
- name: nats-tls
  secret:
    secretName: {{ $ext.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- end }}
{{- end -}}

{{/* affinity: pass (dict "ctx" $ "component" "monitor" "mode" .Values.monitor.antiAffinity). */}}
{{- define "workermon.antiAffinity" -}}
{{- if eq .mode "preferred" }}
affinity:
  podAntiAffinity:
    preferredDuringSchedulingIgnoredDuringExecution:
      - weight: 100
        podAffinityTerm:
          topologyKey: kubernetes.io/hostname
          labelSelector:
            matchLabels:
              {{- include "workermon.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 14 }}
{{- else if eq .mode "required" }}
affinity:
  podAntiAffinity:
    requiredDuringSchedulingIgnoredDuringExecution:
      - topologyKey: kubernetes.io/hostname
        labelSelector:
          matchLabels:
            {{- include "workermon.selectorLabels" (dict "ctx" .ctx "component" .component) | nindent 12 }}
{{- else if ne .mode "" }}
{{- fail (printf "antiAffinity %q: want preferred, required or \"\"" .mode) }}
{{- end }}
{{- end -}}

{{/*
The subject mappings of contract §10, as `workermon nats-config --partitions P`
prints them (events.PartitionMappings); none for one partition.
*/}}
{{- define "workermon.natsMappings" -}}
{{- $p := int .Values.partitions -}}
{{- $pre := .Values.subjectPrefix -}}
{{- if gt $p 1 }}
mappings {
  {{ printf "%q: %q" (printf "%s.load.*.*.*" $pre) (printf "%s.part.{{partition(%d,1)}}.load.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}" $pre $p) }}
  {{ printf "%q: %q" (printf "%s.bye.*.*" $pre) (printf "%s.part.{{partition(%d,1)}}.bye.{{wildcard(1)}}.{{wildcard(2)}}" $pre $p) }}
  {{ printf "%q: %q" (printf "%s.est.*.*.*" $pre) (printf "%s.part.{{partition(%d,1)}}.est.{{wildcard(1)}}.{{wildcard(2)}}.{{wildcard(3)}}" $pre $p) }}
  {{ printf "%q: %q" (printf "%s.lat.*.*" $pre) (printf "%s.part.{{partition(%d,1)}}.lat.{{wildcard(1)}}.{{wildcard(2)}}" $pre $p) }}
  {{ printf "%q: %q" (printf "%s.latr.*.*" $pre) (printf "%s.part.{{partition(%d,1)}}.latr.{{wildcard(1)}}.{{wildcard(2)}}" $pre $p) }}
  {{ printf "%q: %q" (printf "%s.rq.*" $pre) (printf "%s.part.{{partition(%d,1)}}.rq.{{wildcard(1)}}" $pre $p) }}
}
{{- end }}
{{- end -}}

{{/* The probes of a workermon container on its HTTP port. */}}
{{- define "workermon.probes" -}}
startupProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 2
  failureThreshold: 30
livenessProbe:
  httpGet: {path: /healthz, port: http}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: http}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end -}}
