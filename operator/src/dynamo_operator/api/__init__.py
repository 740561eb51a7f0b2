"""Pydantic models of the operator's kinds and CRD generation (no kopf here)."""
