"""Clients of the worker pods' system ports (no kopf here): the operator's second I/O layer
beside `k8s`.

- `routes`: the system server's port and routes.
- `adapters`: `GET`/`POST`/`DELETE /v1/loras` (list, load, unload LoRA adapters).
- `taints`: `POST /engine/update/model_taints` pushes, in the background.
- `credentials`: the projected token every request carries (workers authorize it).

Requests are addressed by pod IP, bounded in concurrency and timed; failures come back as
values, never as exceptions.
"""
