"""Reconciling the operator's kinds (no kopf here): one package per kind, and what both share.

- `dynamoworker/`, `loraadapter/`: each kind's reconciler, pure planners and builders, status.
- `converge`: when to apply a child (semantic subset plus the applied-hash annotation).
- `status_writer`: status patches only when the status changed, for both kinds.
- `events`: the one Event builder and recorder.
- `errors`: what the reconcilers raise; `crds`: CRD installation at startup.

Imports `api`, `k8s` and `pods`; never `handlers` or kopf.
"""
