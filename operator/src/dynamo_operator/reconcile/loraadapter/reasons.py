"""The worker-reason table: what each CamelCase reason a pod's failure carries means to the
user (the fix), which one conditions report first, and how a worker's message is made fit
for status and Events. The reasons themselves come from the worker's answers
(`pods.adapters`).
"""

from __future__ import annotations

import re

# How much of a worker's message status and Events keep.
WORKER_MESSAGE_MAX = 600

# What the user does about each reason (`{worker}`: the DynamoWorker's name).
FIXES: dict[str, str] = {
    "CapacityExceeded": "the pod holds its maximum number of adapters; raise spec.lora.maxLoras "
    "on DynamoWorker {worker}, delete a LoRAAdapter it serves, or use spec.placement.policy: "
    "Count",
    "DigestMismatch": "the adapter files do not match spec.source.sha256; set sha256 to the "
    "digest of the intended files or point spec.source.uri at them",
    "InvalidDigest": "spec.source.sha256 must be 64 lowercase hexadecimal digits",
    "SourceNotFound": "nothing was found at spec.source.uri; check the bucket and prefix "
    "(s3://), the repository and revision (hf://) or the path (file://)",
    "AuthFailed": "the storage refused the worker's credentials; check the Secret that "
    "DynamoWorker {worker} references in spec.credentials (its keys and their access rights); "
    "pods read it when they start, so restart them after fixing it "
    "(kubectl rollout restart deployment {worker})",
    "InvalidSource": "spec.source.uri cannot be used as it is; fix its form",
    "InvalidAdapter": "the files at spec.source.uri are not a PEFT LoRA adapter "
    "(adapter_config.json and adapter weights are expected)",
    "UnsafeSource": "the source holds paths that leave the adapter directory, or too many "
    "files; fix the files at spec.source.uri",
    "DownloadTimeout": "the download took too long; check that the storage is reachable from "
    "the pods and not overloaded",
    "DownloadFailed": "check that the storage endpoint (spec.credentials on DynamoWorker "
    "{worker}) is reachable from the pods",
    "HubOffline": "HF_HUB_OFFLINE is set on the pods and the adapter is not cached; unset it "
    "or pre-fill the cache",
    "LoRADisabled": "set spec.lora.enabled: true on DynamoWorker {worker}",
    "EngineError": "the engine could not load the adapter; check that it was trained for the "
    "base model (base model, rank, target modules) and read the pod's log",
    "WorkerUnreachable": "the pod's system port did not answer; read the pod's log",
    "RequestTimeout": "the worker did not answer in time; read the pod's log",
    "NotListed": "the worker accepted the load but does not list the adapter; read the pod's log",
    "UnloadFailed": "the worker did not unload the adapter; read the pod's log",
    "OperatorNotAdmitted": "give the operator update on dynamoworkers/admin in the namespace "
    "and its projected token for the audience dynamo.dev/worker-admin (the chart does both)",
}
DEFAULT_FIX = "read the pod's log (kubectl logs <pod> -c main)"
# When pods fail for different reasons, conditions report the first in this order.
REASON_ORDER = (
    "LoRADisabled",
    "AuthFailed",
    "SourceNotFound",
    "DigestMismatch",
    "InvalidDigest",
    "InvalidSource",
    "InvalidAdapter",
    "UnsafeSource",
    "HubOffline",
    "DownloadFailed",
    "DownloadTimeout",
    "EngineError",
    "CapacityExceeded",
)


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]*@")
_SECRET_ASSIGNMENT = re.compile(
    r"(?i)\b([A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|ACCESS_KEY|CREDENTIAL)[A-Z0-9_]*)\s*[=:]\s*\S+"
)
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{8,}\b")


def scrub(text: str, limit: int = WORKER_MESSAGE_MAX) -> str:
    """A worker's message fit for status and Events: credential-shaped parts (URI userinfo,
    `...SECRET...=value`, Hugging Face tokens) masked, whitespace collapsed, length bounded."""
    text = _USERINFO.sub(r"\1***@", text)
    text = _SECRET_ASSIGNMENT.sub(r"\1=***", text)
    text = _HF_TOKEN.sub("hf_***", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fix_for(reason: str, worker: str) -> str:
    """What the user does about `reason`."""
    return FIXES.get(reason, DEFAULT_FIX).format(worker=worker or "<worker>")
