"""Errors the reconcile layer raises (the handlers map them onto kopf's retry semantics)."""

from __future__ import annotations


class ReconcileError(Exception):
    """Base of the reconcile layer's errors."""


class SpecError(ReconcileError):
    """The DynamoWorker cannot be turned into children as it stands: the message names the
    field and the fix. Retrying does not help until the object (or the operator's
    configuration) changes."""


class TransientError(ReconcileError):
    """The API server could not be reached or asked to retry; the reconcile runs again."""
