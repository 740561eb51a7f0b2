"""Reconciling DynamoWorkers (no kopf here).

- `labels`: names and labels of the children; `interface`: the worker runtime's command, env
  names, ports and the shutdown arithmetic; `settings`: operator-wide inputs of the builders.
- `builders`: pure `desired_*(dw) -> dict` manifests of the worker's children; `frontend`:
  those of upstream's frontend (spec.frontend); `manifests`: the pieces both are built from.
- `pods`: what the watch says about each worker pod (`PodSummary`), and the pods joined to
  their DynamoWorkerMetadata.
- `adapter_gate`: the LoRA-adapters readiness gate condition of each pod.
- `handover`: at zero, whether the last pod waits for the activator to stand in (pure).
- `status`: pure `compute_status(dw, observation)`; `transitions`: which condition changes
  are worth an Event.
- `reconciler`: one reconcile pass (apply, read back, push taints, set gates, write status).
"""
