"""Reconciling DynamoWorkers (no kopf here).

- `builders`: pure `desired_*(dw) -> dict` manifests of the children; `interface`: the worker
  runtime's command, env names, ports and the shutdown arithmetic; `labels`: names and labels.
- `status`: pure `compute_status(dw, observed)`; `observed`: pod summaries; `events`: Events
  for condition transitions.
- `converge`: when to apply a child (semantic subset plus the applied-hash annotation).
- `worker`: one reconcile pass (apply, read back, status); `taints`: model-taint pushes to
  pods; `crds`: CRD installation at startup.
"""
