"""The engine arguments a DynamoWorker's spec implies, beyond the worker's own flags.

Every engine gets --model, --served-model-name, --max-loras (spec.lora) and the data-parallel
flags (spec.dataParallel) from the worker (`interface.worker_args`, and the env it reads);
vLLM takes those under the same names. The vLLM engine also gets, ahead of
spec.engine.extraArgs (which may not repeat them: `api.dynamoworker.OWNED_FLAGS`):

* --tensor-parallel-size: spec.resources.gpusPerPod over spec.dataParallel.size, the GPUs
  each data-parallel rank runs on (none on the CPU, gpusPerPod 0);
* --max-model-len: spec.tokenBudget.combinedLimit, so that vLLM's context is the budget the
  worker publishes (vLLM's own context is the default budget otherwise);
* --kv-transfer-config: each role's side of the KV transfer, with spec.prefill
  (`disaggregation`).
"""

from __future__ import annotations

from dynamo_operator.api.dynamoworker import (
    MAX_MODEL_LEN_FLAG,
    TENSOR_PARALLEL_FLAG,
    DynamoWorkerSpec,
    WorkerRole,
)
from dynamo_operator.reconcile.dynamoworker.disaggregation import kv_transfer_args


def engine_args(spec: DynamoWorkerSpec, role: WorkerRole | None = None) -> list[str]:
    """The engine flags derived from `spec` (the role's, for the pods of `role`), passed
    before spec.engine.extraArgs."""
    if not spec.engine.is_vllm:
        return []
    args: list[str] = []
    gpus = spec.resources.gpus_per_pod
    if gpus > 0:
        args += [TENSOR_PARALLEL_FLAG, str(gpus // spec.data_parallel.size)]
    budget = spec.token_budget
    if budget is not None and budget.combined_limit > 0:
        args += [MAX_MODEL_LEN_FLAG, str(budget.combined_limit)]
    return args + kv_transfer_args(role)
