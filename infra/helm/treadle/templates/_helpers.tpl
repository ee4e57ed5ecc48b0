{{/* Chart name, possibly overridden. */}}
{{- define "treadle.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified release name: <release>-treadle unless the release already says treadle. */}}
{{- define "treadle.fullname" -}}
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

{{/* A component's object name, "<fullname>-<component>", within the 63 characters of a
Service or Job name: pass (list . "api"). */}}
{{- define "treadle.componentName" -}}
{{- printf "%s-%s" (include "treadle.fullname" (index . 0)) (index . 1) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The workers' StatefulSet and headless Service: at most 52 characters, so that the label
controller-revision-hash (<name>-<10 characters>) stays within 63, and each pod name
(<name>-<ordinal>), which is its worker id, within the 64 characters of workers.id. */}}
{{- define "treadle.workerName" -}}
{{- printf "%s-worker" (include "treadle.fullname" .) | trunc 52 | trimSuffix "-" }}
{{- end }}

{{- define "treadle.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "treadle.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "treadle.selectorLabels" -}}
app.kubernetes.io/name: {{ include "treadle.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* image: pass (dict "image" .Values.image.api "root" .) */}}
{{- define "treadle.image" -}}
{{- printf "%s:%s" .image.repository (default .root.Chart.AppVersion .image.tag) }}
{{- end }}

{{- define "treadle.secretName" -}}
{{- default (printf "%s-secrets" (include "treadle.fullname" .)) .Values.secrets.existingSecret }}
{{- end }}

{{- define "treadle.configName" -}}
{{- printf "%s-config" (include "treadle.fullname" .) }}
{{- end }}

{{- define "treadle.artifactsClaim" -}}
{{- default (printf "%s-artifacts" (include "treadle.fullname" .)) .Values.artifacts.existingClaim }}
{{- end }}

{{/* Settings and credentials of every Treadle container. */}}
{{- define "treadle.envFrom" -}}
- configMapRef:
    name: {{ include "treadle.configName" . }}
- secretRef:
    name: {{ include "treadle.secretName" . }}
{{- end }}

{{/* Restart pods when settings or credentials change. */}}
{{- define "treadle.checksums" -}}
checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
checksum/secrets: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
{{- end }}
