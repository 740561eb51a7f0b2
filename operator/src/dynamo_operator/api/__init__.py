"""Pydantic models of the operator's kinds and CRD generation (no kopf here).

- `DynamoWorker` and `LoRAAdapter` (dynamo.dev/v1alpha1): the single source of their CRDs
  (`api.crd`), with CEL rules mirrored in Python (`api.base.Rule`).
- `DynamoWorkerMetadata` (nvidia.com/v1alpha1, upstream Dynamo's): read-only views
  (`api.metadata`).
- Status conditions per the Kubernetes API conventions (`api.conditions`).
"""

from dynamo_operator.api.common import API_VERSION, GROUP, VERSION, Condition, ConditionType
from dynamo_operator.api.dynamoworker import DynamoWorker, DynamoWorkerSpec, DynamoWorkerStatus
from dynamo_operator.api.loraadapter import (
    AdapterState,
    LoRAAdapter,
    LoRAAdapterSpec,
    LoRAAdapterStatus,
)
from dynamo_operator.api.metadata import DynamoWorkerMetadata

__all__ = [
    "API_VERSION",
    "GROUP",
    "VERSION",
    "AdapterState",
    "Condition",
    "ConditionType",
    "DynamoWorker",
    "DynamoWorkerMetadata",
    "DynamoWorkerSpec",
    "DynamoWorkerStatus",
    "LoRAAdapter",
    "LoRAAdapterSpec",
    "LoRAAdapterStatus",
]
