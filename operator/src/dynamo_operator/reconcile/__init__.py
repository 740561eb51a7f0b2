"""Pure builders (desired_* -> dict) and reconcile logic (no kopf here)."""
