{{/*
The operator's permissions, derived from what it does (operator/src/dynamo_operator: handlers/
for kopf's watches, reconcile/ for the children it applies, k8s/client.py for the requests).
No wildcards, no Secrets, no escalate/bind/impersonate. tests/unit/test_chart.py checks these
rules against the code.
*/}}

{{/* Rules on namespaced kinds: in the ClusterRole (cluster scope) or in each watched namespace's Role. */}}
{{- define "dynamo-operator.namespacedRules" -}}
# DynamoWorkers: kopf lists and watches them, and patches them to keep its finalizer (its
# per-object daemon is stopped before the object goes); the autoscaler patches spec.replicas
# of those with spec.autoscaling (never of the others).
- apiGroups: ["dynamo.dev"]
  resources: ["dynamoworkers"]
  verbs: ["list", "watch", "patch"]
# DynamoWorker status: observedGeneration, replica counts, conditions, per-pod summary.
- apiGroups: ["dynamo.dev"]
  resources: ["dynamoworkers/status"]
  verbs: ["patch"]
# Children carry owner references with blockOwnerDeletion; clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (e.g. OpenShift) ask for this.
- apiGroups: ["dynamo.dev"]
  resources: ["dynamoworkers/finalizers"]
  verbs: ["update"]
# LoRAAdapters: kopf lists and watches them, and patches them for its finalizer (the adapter
# is unloaded from every pod before the object goes) and its progress annotations.
- apiGroups: ["dynamo.dev"]
  resources: ["loraadapters"]
  verbs: ["list", "watch", "patch"]
# LoRAAdapter status: per-pod adapter states, loaded/target replica counts.
- apiGroups: ["dynamo.dev"]
  resources: ["loraadapters/status"]
  verbs: ["patch"]
# Worker pods: watched (kopf index) for status and to reconcile when one changes. patch: the
# autoscaler sets controller.kubernetes.io/pod-deletion-cost (a merge patch of that one
# annotation) on a DynamoWorker's pods before lowering its replicas, so the least busy go.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch"]
# The fill pods of spec.model.cache: their log holds the fill's progress and nothing else (the
# operator reads the last lines of the fill container while it runs).
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
# Worker pod status: only the condition of the LoRA-adapters readiness gate
# (dynamo.dev/lora-adapters-ready), while a LoRAAdapter with requiredForReadiness targets them.
- apiGroups: [""]
  resources: ["pods/status"]
  verbs: ["patch"]
# The worker and frontend Deployments: watched (kopf index: reconciles read them from memory,
# and one that changes wakes its DynamoWorker), server-side applied when they differ (an
# apply that creates the object needs create as well as patch), and the frontend's deleted
# when spec.frontend is removed. Every child kind is watched the same way; get is the read
# of a kind the operator does not watch (PodMonitors whose CRD came after its start).
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The other children, watched and server-side applied: the workers' headless Service,
# ServiceAccount, Role and RoleBinding, the PodDisruptionBudget, and the frontend's Service,
# ServiceAccount, Role and RoleBinding (deleted when spec.frontend is removed).
- apiGroups: [""]
  resources: ["services", "serviceaccounts"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# spec.model.cache: the claim the operator creates (size), watched, server-side applied, and
# deleted when the spec stops asking for it; an existing claim (claimName) read to tell
# whether it exists. The fill and prune Jobs, watched, created by server-side apply (never
# applied again: a Job's pod template is immutable), and deleted to retry a failed fill or
# once a prune is done.
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The worker pods' NetworkPolicy: watched, server-side applied, and deleted when
# spec.networkPolicy.enabled is false.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# EndpointSlices: the frontend's and the activator's Roles let them list and watch them
# (upstream's Kubernetes discovery: a worker is routable while its pod is ready in its
# Service's slices), and the activator's lets it get and patch its own slice: RBAC lets the
# operator grant only what it holds. The operator creates (server-side apply), watches and
# deletes that one slice per DynamoWorker that may scale to zero, which the activator fills
# with its address while it stands in for the pods.
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# PodMonitor (when the Prometheus Operator's CRD exists): watched and applied like the other
# children, and deleted when spec.metrics stops asking for one.
- apiGroups: ["monitoring.coreos.com"]
  resources: ["podmonitors"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# DynamoWorkerMetadata, the records the worker pods write: watched (kopf index) to fill
# DynamoWorker status. get/create/patch/update/delete because the workers' Role grants them
# (and list/watch the frontend's), and RBAC lets the operator grant only what it holds itself
# (it has no escalate).
- apiGroups: ["nvidia.com"]
  resources: ["dynamoworkermetadatas"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
# Worker admin routes (POST/DELETE /v1/loras, /engine/*): each worker admits the operator's
# projected token (audience dynamo.dev/worker-admin) only if a SubjectAccessReview allows
# this verb on this subresource. No such object exists: it only names the permission.
- apiGroups: ["dynamo.dev"]
  resources: ["dynamoworkers/admin"]
  verbs: ["update"]
# The workers' Role lets them ask that question in their own namespace only
# (LocalSubjectAccessReview), and RBAC lets the operator grant only what it holds.
- apiGroups: ["authorization.k8s.io"]
  resources: ["localsubjectaccessreviews"]
  verbs: ["create"]
# Events: kopf posts core/v1 Events for handler warnings and errors; the reconciler records
# events.k8s.io/v1 Events on condition transitions.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Rules on cluster-scoped kinds (always in a ClusterRole). */}}
{{- define "dynamo-operator.clusterRules" -}}
# Whether the Prometheus Operator's PodMonitor CRD exists (spec.metrics.podMonitor Auto). Only
# that CRD, only get: the chart installs the operator's own CRDs (the operator runs with
# --no-install-crds).
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  resourceNames: ["podmonitors.monitoring.coreos.com"]
  verbs: ["get"]
{{- end }}

{{/*
Worker pods validate callers' tokens with a TokenReview. Why this binding and no other:
- TokenReview is cluster-scoped, so only a ClusterRoleBinding can grant it (a RoleBinding
  grants nothing outside its namespace, and a TokenReview has none).
- The workers' ServiceAccounts are made by the operator per DynamoWorker at run time, so a
  binding made at install time can name them only by group: system:serviceaccounts:<ns>
  for each watched namespace (rbac.scope=namespaced), system:serviceaccounts when every
  namespace is watched (cluster scope).
- The alternative, the operator creating a ClusterRoleBinding per DynamoWorker, would give
  the operator create/delete on clusterrolebindings cluster-wide (in both scopes): a far
  larger power than this one.
- What the group gains is small: a TokenReview only says whether a token the caller already
  holds is valid and whose it is (the same ClusterRole as system:auth-delegator's first
  rule, which kube-rbac-proxy sidecars hold). SubjectAccessReview is NOT granted here: the
  workers ask it as a LocalSubjectAccessReview through their per-DynamoWorker Role, so no
  pod learns anything about permissions in another namespace.
*/}}
{{- define "dynamo-operator.workerTokenReviewRules" -}}
- apiGroups: ["authentication.k8s.io"]
  resources: ["tokenreviews"]
  verbs: ["create"]
{{- end }}
