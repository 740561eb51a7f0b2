"""Reconciling LoRAAdapters (no kopf here).

- `targeting`: which DynamoWorkers an adapter targets, name clashes between adapters.
- `model`: the records the planner reads and remembers (pods, tracks, requests, backoff).
- `reasons`: the worker-reason table (the fix for each failure reason, their order).
- `plan`: pure `plan(adapter, observation) -> Plan` (requests to start, tracks, status).
- `status`: the status a plan writes.
- `wake`: which adapters and workers a watch event wakes.
- `reconciler`: one `LoraReconciler` per operator: lists the pods' adapters, runs the plan,
  starts the requests (`pods.adapters`), writes status, unloads on deletion.
"""
