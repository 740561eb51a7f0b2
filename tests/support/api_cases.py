"""Manifests of DynamoWorker and LoRAAdapter, good and bad, shared by the unit tests (the Python
models must refuse each bad one) and the cluster tests (the API server must refuse it too).

Each bad case names the field users would have to fix; where a CEL rule refuses it, the case
also carries the rule's message, which both the models and the API server must report.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from dynamo_operator.api import DynamoWorker

API_VERSION = "dynamo.dev/v1alpha1"


def merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`base` with `patch` merged in recursively (a JSON merge patch without deletions)."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def dynamo_worker(name: str = "llm", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A minimal valid DynamoWorker, with `spec` merged in."""
    base = {"model": {"name": "Qwen/Qwen3-0.6B", "source": "hf://Qwen/Qwen3-0.6B@main"}}
    return {
        "apiVersion": API_VERSION,
        "kind": "DynamoWorker",
        "metadata": {"name": name},
        "spec": merge(base, spec or {}),
    }


def stored(manifest: dict[str, Any], namespace: str = "serving") -> DynamoWorker:
    """The DynamoWorker `manifest` as the API server hands it out (namespace, uid, generation
    set), validated."""
    body = copy.deepcopy(manifest)
    body["metadata"] |= {
        "namespace": namespace,
        "uid": "0f8e5c1a-5b7e-4c39-9d59-2f6d1b8e0c11",
        "generation": 1,
    }
    return DynamoWorker.model_validate(body)


def lora_adapter(name: str = "sql-adapter", spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A minimal valid LoRAAdapter, with `spec` merged in."""
    base = {"workerRef": {"name": "llm"}, "source": {"uri": "s3://adapters/sql/v1"}}
    return {
        "apiVersion": API_VERSION,
        "kind": "LoRAAdapter",
        "metadata": {"name": name},
        "spec": merge(base, spec or {}),
    }


FULL_DYNAMO_WORKER = dynamo_worker(
    "llm-full",
    {
        "model": {
            "name": "Qwen/Qwen3-0.6B",
            "source": "/models/qwen3-0.6b",
            "servedModelName": "qwen3",
            "aliases": ["qwen3-small", "default"],
        },
        "image": "registry.example.com/dynamo-worker:1.0",
        "imagePullPolicy": "IfNotPresent",
        "replicas": 3,
        "engine": {"class": "dynamo.engines.reference:ReferenceEngine", "extraArgs": ["--x", "1"]},
        "resources": {"gpusPerPod": 2, "cpu": 8, "memory": "64Gi", "sharedMemorySize": "16Gi"},
        "dataParallel": {"size": 2, "startRank": 4},
        "lora": {"enabled": True, "maxLoras": 8, "cache": {"emptyDir": {"sizeLimit": "20Gi"}}},
        "tokenBudget": {"combinedLimit": 4096, "rejectPromptOverflow": True},
        "modelTaints": ["gpu=h100", "team=search"],
        "drain": {"gracePeriodSeconds": 10, "drainTimeoutSeconds": 600},
        "credentials": {
            "s3": {"secretName": "s3-creds", "endpoint": "http://minio.storage:9000"},
            "huggingFace": {"secretName": "hf-token", "tokenKey": "token"},
        },
        "pod": {
            "nodeSelector": {"nvidia.com/gpu.product": "H100"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                {"key": "spot", "value": "true", "effect": "NoExecute", "tolerationSeconds": 60},
            ],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {"key": "zone", "operator": "In", "values": ["a"]}
                                ]
                            }
                        ]
                    }
                }
            },
            "priorityClassName": "inference",
            "labels": {"team": "search"},
            "annotations": {"example.com/owner": "search"},
            "env": [
                {"name": "DYN_LOG", "value": "debug"},
                {"name": "API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "v"}}},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ],
        },
        "metrics": {"podMonitor": "Disabled"},
        "frontend": {
            "image": "registry.example.com/dynamo-frontend:1.6.1",
            "imagePullPolicy": "IfNotPresent",
            "replicas": 2,
            "routerMode": "kv",
            "command": ["/opt/venv/bin/python", "-m", "dynamo.frontend"],
            "extraArgs": ["--migration-limit", "3"],
            "resources": {"cpu": 2, "memory": "4Gi"},
            "pod": {
                "nodeSelector": {"node-role": "cpu"},
                "labels": {"team": "search"},
                "env": [{"name": "DYN_LOG", "value": "info"}],
            },
        },
    },
)

FULL_LORA_ADAPTER = lora_adapter(
    "sql-full",
    {
        "workerRef": None,
        "workerSelector": {
            "matchLabels": {"team": "search"},
            "matchExpressions": [{"key": "tier", "operator": "In", "values": ["gold"]}],
        },
        "adapterName": "sql-expert.v2",
        "source": {"uri": "hf://org/sql-lora@refs/pr/7", "sha256": "a" * 64},
        "placement": {"policy": "Count", "replicas": 2},
    },
)
_VALID = [
    ("dw-minimal", dynamo_worker()),
    ("dw-full", FULL_DYNAMO_WORKER),
    (
        "dw-cpu-dp",
        dynamo_worker(spec={"resources": {"gpusPerPod": 0}, "dataParallel": {"size": 4}}),
    ),
    ("dw-s3-source", dynamo_worker(spec={"model": {"source": "s3://models/qwen"}})),
    ("dw-file-source", dynamo_worker(spec={"model": {"source": "file:///models/qwen"}})),
    (
        "dw-lora-pvc",
        dynamo_worker(
            spec={
                "lora": {
                    "enabled": True,
                    "cache": {"persistentVolumeClaim": {"claimName": "loras"}},
                }
            }
        ),
    ),
    ("dw-budget-no-reject", dynamo_worker(spec={"tokenBudget": {"combinedLimit": 0}})),
    (
        "dw-network-policy",
        dynamo_worker(
            spec={
                "networkPolicy": {
                    "systemPortNamespaces": ["monitoring"],
                    "clientNamespaces": ["gateway"],
                },
                # Private and loopback endpoints (an in-cluster MinIO) are fine.
                "credentials": {"s3": {"secretName": "s3", "endpoint": "http://10.0.0.5:9000"}},
            }
        ),
    ),
    ("dw-network-policy-off", dynamo_worker(spec={"networkPolicy": {"enabled": False}})),
    (
        "dw-vllm",
        dynamo_worker(
            spec={
                "engine": {
                    "name": "vllm",
                    "extraArgs": ["--gpu-memory-utilization", "0.9", "--enable-prefix-caching"],
                },
                "resources": {"gpusPerPod": 4},
                "dataParallel": {"size": 2},
                "lora": {"enabled": True, "maxLoras": 8},
                "tokenBudget": {"combinedLimit": 4096},
            }
        ),
    ),
    # An engine without extraArgs (the rules on repeated flags must not need the list).
    ("dw-engine-name-only", dynamo_worker(spec={"engine": {"name": "vllm"}})),
    (
        "dw-engine-class-only",
        dynamo_worker(spec={"engine": {"class": "dynamo.engines.vllm:VllmEngine"}}),
    ),
    (
        # On the CPU the spec sets no tensor parallelism, so extraArgs may.
        "dw-vllm-cpu-tensor-parallel",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm", "extraArgs": ["--tensor-parallel-size", "2"]},
                "resources": {"gpusPerPod": 0},
            }
        ),
    ),
    (
        # Only the vLLM engine takes its context from the token budget.
        "dw-reference-engine-max-model-len",
        dynamo_worker(
            spec={
                "engine": {"name": "transformers", "extraArgs": ["--max-model-len", "512"]},
                "tokenBudget": {"combinedLimit": 4096},
            }
        ),
    ),
    (
        "dw-model-cache-owned",
        dynamo_worker(
            spec={
                "model": {
                    "source": "s3://models/qwen",
                    "cache": {
                        "size": "100Gi",
                        "storageClassName": "fast-rwx",
                        "accessMode": "ReadWriteMany",
                    },
                }
            }
        ),
    ),
    (
        "dw-model-cache-claim",
        dynamo_worker(
            spec={"model": {"source": "hf://Qwen/Qwen3-0.6B@main", "cache": {"claimName": "w"}}}
        ),
    ),
    (
        # Disaggregated: each prefill field unset takes the decode role's (dataParallel here).
        "dw-disaggregated",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm", "extraArgs": ["--gpu-memory-utilization", "0.9"]},
                "resources": {"gpusPerPod": 2},
                "dataParallel": {"size": 2},
                "prefill": {
                    "replicas": 2,
                    "resources": {"gpusPerPod": 4},
                    "engine": {"extraArgs": ["--enforce-eager"]},
                    "pod": {"nodeSelector": {"gpu": "h100"}},
                },
            }
        ),
    ),
    ("dw-disaggregated-defaults", dynamo_worker(spec={"engine": {"name": "vllm"}, "prefill": {}})),
    (
        # Without spec.prefill the KV transfer is the user's (e.g. an offloading connector).
        "dw-aggregated-kv-transfer",
        dynamo_worker(
            spec={
                "engine": {
                    "name": "vllm",
                    "extraArgs": ["--kv-transfer-config", '{"kv_connector":"LMCacheConnectorV1"}'],
                }
            }
        ),
    ),
    ("lora-minimal", lora_adapter()),
    ("lora-full", FULL_LORA_ADAPTER),
    ("lora-hf-bare-repo", lora_adapter(spec={"source": {"uri": "hf://gpt2-lora@main"}})),
    ("lora-file", lora_adapter(spec={"source": {"uri": "file:///adapters/sql"}})),
    ("lora-required", lora_adapter(spec={"requiredForReadiness": True})),
]


@dataclass(frozen=True)
class Invalid:
    """A manifest both the models and the API server refuse.

    `field` is the path the API server reports (and the models' error location); `message`,
    when set, is the CEL rule's message, reported by both.
    """

    id: str
    manifest: dict[str, Any]
    field: str
    message: str | None = None


_INVALID = [
    Invalid(
        "dw-model-cache-size-zero",
        dynamo_worker(spec={"model": {"source": "s3://m/q", "cache": {"size": "0Gi"}}}),
        "spec.model.cache.size",
        "spec.model.cache.size must be above zero, e.g. 100Gi",
    ),
    Invalid(
        "dw-model-cache-size-negative",
        dynamo_worker(spec={"model": {"source": "s3://m/q", "cache": {"size": "-1Gi"}}}),
        "spec.model.cache.size",
    ),
    Invalid(
        "dw-model-cache-claim-and-storage-class",
        dynamo_worker(
            spec={
                "model": {
                    "source": "s3://m/q",
                    "cache": {"claimName": "weights", "storageClassName": "fast"},
                }
            }
        ),
        "spec.model.cache.storageClassName",
        "spec.model.cache.storageClassName applies to a claim the operator creates (size); "
        "an existing claim (claimName) has its own storage class",
    ),
    Invalid(
        "dw-model-cache-claim-and-size",
        dynamo_worker(
            spec={"model": {"source": "s3://m/q", "cache": {"claimName": "w", "size": "1Gi"}}}
        ),
        "spec.model.cache",
        "spec.model.cache: set claimName (an existing claim) or size (a claim the operator "
        "creates), exactly one",
    ),
    Invalid(
        "dw-model-cache-local-source",
        dynamo_worker(spec={"model": {"source": "file:///models/q", "cache": {"size": "1Gi"}}}),
        "spec.model.cache",
        "spec.model.cache needs a source to fetch (s3:// or hf://); a path or file:// source "
        "is already local: remove spec.model.cache",
    ),
    Invalid("dw-replicas-too-many", dynamo_worker(spec={"replicas": 5000}), "spec.replicas"),
    Invalid(
        "dw-prefill-reference-engine",
        dynamo_worker(spec={"prefill": {}}),
        "spec.prefill",
        "spec.prefill needs the vLLM engine (its NixlConnector moves the KV cache from the "
        "prefill pods to the decode pods): set spec.engine.name: vllm",
    ),
    Invalid(
        "dw-disaggregation-mode-in-engine",
        dynamo_worker(spec={"engine": {"extraArgs": ["--disaggregation-mode=prefill"]}}),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --disaggregation-mode: spec.prefill sets it; change "
        "that field instead",
    ),
    Invalid(
        "dw-prefill-kv-transfer-in-engine",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm", "extraArgs": ['--kv_transfer_config={"kv_role":"x"}']},
                "prefill": {},
            }
        ),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --kv-transfer-config: spec.prefill (the operator "
        "connects the prefill and decode pods) sets it; change that field instead",
    ),
    Invalid(
        "dw-prefill-kv-transfer-in-prefill",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "prefill": {"engine": {"extraArgs": ["--kv-transfer-config", "{}"]}},
            }
        ),
        "spec.prefill.engine.extraArgs",
        "spec.prefill.engine.extraArgs must not set --kv-transfer-config: spec.prefill (the "
        "operator connects the prefill and decode pods) sets it; change that field instead",
    ),
    Invalid(
        "dw-prefill-owned-flag",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "prefill": {"engine": {"extraArgs": ["--served_model_name=other"]}},
            }
        ),
        "spec.prefill.engine.extraArgs",
        "spec.prefill.engine.extraArgs must not set --served-model-name: spec.model "
        "(servedModelName, else name) sets it; change that field instead",
    ),
    Invalid(
        "dw-prefill-tensor-parallel",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "resources": {"gpusPerPod": 0},
                "prefill": {"resources": {"gpusPerPod": 2}, "engine": {"extraArgs": ["-tp=2"]}},
            }
        ),
        "spec.prefill.engine.extraArgs",
        "spec.prefill.engine.extraArgs must not set --tensor-parallel-size: "
        "spec.prefill.resources.gpusPerPod (over its dataParallel.size) sets it",
    ),
    Invalid(
        "dw-prefill-ranks-above-inherited-gpus",
        dynamo_worker(spec={"engine": {"name": "vllm"}, "prefill": {"dataParallel": {"size": 2}}}),
        "spec.prefill.dataParallel.size",
        "spec.prefill.dataParallel.size must not exceed spec.prefill.resources.gpusPerPod",
    ),
    Invalid(
        "dw-prefill-gpus-not-a-multiple-of-inherited-ranks",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "resources": {"gpusPerPod": 4},
                "dataParallel": {"size": 2},
                "prefill": {"resources": {"gpusPerPod": 3}},
            }
        ),
        "spec.prefill.resources.gpusPerPod",
        "spec.prefill.resources.gpusPerPod must be a multiple of spec.prefill.dataParallel.size "
        "with the vLLM engine",
    ),
    Invalid(
        "dw-prefill-with-autoscaling",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "autoscaling": {"maxReplicas": 2, "targetInFlightPerPod": 4},
                "prefill": {},
            }
        ),
        "spec.autoscaling",
        "spec.autoscaling does not yet apply to a disaggregated DynamoWorker (spec.prefill); "
        "set the replicas of each role",
    ),
    Invalid(
        "dw-prefill-replicas-too-many",
        dynamo_worker(spec={"engine": {"name": "vllm"}, "prefill": {"replicas": 5000}}),
        "spec.prefill.replicas",
    ),
    Invalid(
        "dw-autoscaling-min-above-max",
        dynamo_worker(
            spec={"autoscaling": {"minReplicas": 3, "maxReplicas": 2, "targetInFlightPerPod": 4}}
        ),
        "spec.autoscaling.minReplicas",
        "spec.autoscaling.minReplicas must not exceed spec.autoscaling.maxReplicas",
    ),
    Invalid(
        "dw-autoscaling-no-target",
        dynamo_worker(spec={"autoscaling": {"minReplicas": 0, "maxReplicas": 2}}),
        "spec.autoscaling",
        "spec.autoscaling needs a target: set targetInFlightPerPod, targetKvCachePercent or "
        "ttftP90Milliseconds",
    ),
    Invalid(
        "dw-autoscaling-target-zero",
        dynamo_worker(spec={"autoscaling": {"maxReplicas": 2, "targetInFlightPerPod": 0}}),
        "spec.autoscaling.targetInFlightPerPod",
    ),
    Invalid(
        "dw-autoscaling-window-negative",
        dynamo_worker(
            spec={
                "autoscaling": {
                    "maxReplicas": 2,
                    "targetKvCachePercent": 70,
                    "scaleDownWindowSeconds": -1,
                }
            }
        ),
        "spec.autoscaling.scaleDownWindowSeconds",
    ),
    Invalid(
        "dw-source-scheme",
        dynamo_worker(spec={"model": {"source": "gs://bucket/model"}}),
        "spec.model.source",
        "spec.model.source: use an absolute path in the pod, s3://, hf:// or file://",
    ),
    Invalid(
        "dw-source-credentials",
        dynamo_worker(spec={"model": {"source": "s3://AKIAEXAMPLE:s3cr3t@models/qwen"}}),
        "spec.model.source",
        "spec.model.source must not contain credentials (user:password@); "
        "reference a Secret on the DynamoWorker instead",
    ),
    Invalid(
        "dw-dp-beyond-world",
        dynamo_worker(
            spec={"resources": {"gpusPerPod": 16}, "dataParallel": {"size": 16, "startRank": 1015}}
        ),
        "spec.dataParallel",
        "spec.dataParallel.startRank + size must not exceed 1024",
    ),
    Invalid(
        "dw-dp-more-ranks-than-gpus",
        dynamo_worker(spec={"resources": {"gpusPerPod": 2}, "dataParallel": {"size": 4}}),
        "spec.dataParallel.size",
        "spec.dataParallel.size must not exceed spec.resources.gpusPerPod",
    ),
    Invalid(
        "dw-maxloras-without-lora",
        dynamo_worker(spec={"lora": {"maxLoras": 8}}),
        "spec.lora.maxLoras",
        "spec.lora.maxLoras requires spec.lora.enabled: true",
    ),
    Invalid(
        "dw-lora-cache-two-kinds",
        dynamo_worker(
            spec={
                "lora": {
                    "enabled": True,
                    "cache": {"emptyDir": {}, "persistentVolumeClaim": {"claimName": "loras"}},
                }
            }
        ),
        "spec.lora.cache",
        "spec.lora.cache: set exactly one of emptyDir or persistentVolumeClaim",
    ),
    Invalid(
        "dw-budget-zero-rejecting",
        dynamo_worker(spec={"tokenBudget": {"combinedLimit": 0, "rejectTotalOverflow": True}}),
        "spec.tokenBudget.combinedLimit",
        "spec.tokenBudget.combinedLimit must be greater than 0",
    ),
    Invalid(
        "dw-budget-negative",
        dynamo_worker(spec={"tokenBudget": {"combinedLimit": -1}}),
        "spec.tokenBudget.combinedLimit",
    ),
    Invalid(
        "dw-topology-taint",
        dynamo_worker(spec={"modelTaints": ["gpu=h100", "dynamo.topology/zone=a"]}),
        "spec.modelTaints",
        "spec.modelTaints: the dynamo.topology/ prefix is reserved",
    ),
    Invalid(
        "dw-taint-with-space",
        dynamo_worker(spec={"modelTaints": ["gpu h100"]}),
        "spec.modelTaints[0]",
    ),
    Invalid(
        "dw-engine-class",
        dynamo_worker(spec={"engine": {"class": "not a class"}}),
        "spec.engine.class",
    ),
    Invalid(
        "dw-engine-name-and-class",
        dynamo_worker(spec={"engine": {"name": "vllm", "class": "my.engines:Fast"}}),
        "spec.engine",
        "spec.engine: set name or class, not both",
    ),
    Invalid(
        "dw-engine-name-unknown",
        dynamo_worker(spec={"engine": {"name": "sglang"}}),
        "spec.engine.name",
    ),
    Invalid(
        "dw-vllm-tensor-parallel-repeated",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm", "extraArgs": ["--tensor-parallel-size=2"]},
                "resources": {"gpusPerPod": 2},
            }
        ),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --tensor-parallel-size: spec.resources.gpusPerPod",
    ),
    Invalid(
        "dw-vllm-class-tensor-parallel-alias",
        dynamo_worker(
            spec={"engine": {"class": "dynamo.engines.vllm:VllmEngine", "extraArgs": ["-tp", "1"]}}
        ),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --tensor-parallel-size",
    ),
    Invalid(
        "dw-vllm-max-model-len-repeated",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm", "extraArgs": ["--max_model_len", "8192"]},
                "tokenBudget": {"combinedLimit": 4096},
            }
        ),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --max-model-len: spec.tokenBudget.combinedLimit",
    ),
    Invalid(
        "dw-extra-args-max-loras",
        dynamo_worker(
            spec={"engine": {"extraArgs": ["--max-loras", "3"]}, "lora": {"enabled": True}}
        ),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --max-loras: spec.lora.maxLoras",
    ),
    Invalid(
        "dw-extra-args-model",
        dynamo_worker(spec={"engine": {"extraArgs": ["--model", "/elsewhere"]}}),
        "spec.engine.extraArgs",
        "spec.engine.extraArgs must not set --model: spec.model.source",
    ),
    Invalid(
        "dw-vllm-gpus-not-a-multiple-of-ranks",
        dynamo_worker(
            spec={
                "engine": {"name": "vllm"},
                "resources": {"gpusPerPod": 3},
                "dataParallel": {"size": 2},
            }
        ),
        "spec.resources.gpusPerPod",
        "spec.resources.gpusPerPod must be a multiple of spec.dataParallel.size",
    ),
    Invalid(
        "dw-memory", dynamo_worker(spec={"resources": {"memory": "lots"}}), "spec.resources.memory"
    ),
    Invalid(
        "dw-pod-monitor-mode",
        dynamo_worker(spec={"metrics": {"podMonitor": "Sometimes"}}),
        "spec.metrics.podMonitor",
    ),
    Invalid(
        "dw-alias-repeats-name",
        dynamo_worker(spec={"model": {"aliases": ["Qwen/Qwen3-0.6B"]}}),
        "spec.model.aliases",
        "spec.model.aliases must not repeat the served model name",
    ),
    Invalid(
        "dw-reserved-label",
        dynamo_worker(spec={"pod": {"labels": {"dynamo.dev/worker": "x"}}}),
        "spec.pod.labels",
        "labels: keys under dynamo.dev/ and nvidia.com/dynamo- are set by the operator",
    ),
    Invalid(
        "dw-env-value-and-source",
        dynamo_worker(
            spec={
                "pod": {
                    "env": [
                        {
                            "name": "X",
                            "value": "1",
                            "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                        }
                    ]
                }
            }
        ),
        "spec.pod.env[0]",
        "env[]: set value or valueFrom, not both",
    ),
    Invalid(
        "dw-env-empty-source",
        dynamo_worker(spec={"pod": {"env": [{"name": "X", "valueFrom": {}}]}}),
        "spec.pod.env[0].valueFrom",
        "env[].valueFrom: set exactly one of",
    ),
    Invalid(
        "dw-toleration-exists-with-value",
        dynamo_worker(
            spec={"pod": {"tolerations": [{"key": "k", "operator": "Exists", "value": "v"}]}}
        ),
        "spec.pod.tolerations[0]",
        "tolerations[].value must be empty when operator is Exists",
    ),
    Invalid(
        "dw-frontend-router-mode",
        dynamo_worker(spec={"frontend": {"routerMode": "sticky"}}),
        "spec.frontend.routerMode",
    ),
    Invalid(
        "dw-frontend-replicas",
        dynamo_worker(spec={"frontend": {"replicas": 65}}),
        "spec.frontend.replicas",
    ),
    Invalid(
        "dw-frontend-reserved-label",
        dynamo_worker(spec={"frontend": {"pod": {"labels": {"dynamo.dev/frontend": "x"}}}}),
        "spec.frontend.pod.labels",
        "labels: keys under dynamo.dev/ and nvidia.com/dynamo- are set by the operator",
    ),
    Invalid(
        "dw-s3-endpoint-credentials",
        dynamo_worker(
            spec={"credentials": {"s3": {"secretName": "s3", "endpoint": "http://u:p@minio:9000"}}}
        ),
        "spec.credentials.s3.endpoint",
        "spec.credentials.s3.endpoint: use http://host[:port] or https://host[:port]",
    ),
    # A link-local or cloud metadata address, however it is spelled.
    *(
        Invalid(
            f"dw-s3-endpoint-{case}",
            dynamo_worker(spec={"credentials": {"s3": {"secretName": "s", "endpoint": url}}}),
            "spec.credentials.s3.endpoint",
            "spec.credentials.s3.endpoint: must not point at a link-local or cloud metadata",
        )
        for case, url in (
            ("metadata", "http://169.254.169.254"),
            ("aws-ipv6-metadata", "http://[fd00:ec2::254]:80"),
            ("link-local-v6", "https://[fe80::1]"),
            ("numeric-metadata", "http://2852039166"),
            ("hex-metadata", "http://0xa9.0xfe.0xa9.0xfe"),
            ("mapped-metadata", "http://[::ffff:169.254.169.254]"),
            ("metadata-name", "http://Metadata.Google.Internal."),
        )
    ),
    Invalid(
        "dw-network-policy-namespace",
        dynamo_worker(spec={"networkPolicy": {"systemPortNamespaces": ["Not_A_Namespace"]}}),
        "spec.networkPolicy.systemPortNamespaces[0]",
    ),
    Invalid(
        "dw-name-with-dot",
        dynamo_worker(name="llm.v1"),
        "metadata.name",
        "metadata.name: a DynamoWorker name has at most 50 characters",
    ),
    Invalid("dw-unknown-field", dynamo_worker(spec={"replica": 3}), "spec.replica"),
    Invalid(
        "lora-no-target",
        lora_adapter(spec={"workerRef": None}),
        "spec",
        "spec: set exactly one of workerRef or workerSelector",
    ),
    Invalid(
        "lora-two-targets",
        lora_adapter(spec={"workerSelector": {"matchLabels": {"a": "b"}}}),
        "spec",
        "spec: set exactly one of workerRef or workerSelector",
    ),
    Invalid(
        "lora-https-uri",
        lora_adapter(spec={"source": {"uri": "https://example.com/adapter.tar"}}),
        "spec.source.uri",
        "spec.source.uri: use s3://, hf:// or file://",
    ),
    Invalid(
        "lora-uri-credentials",
        lora_adapter(spec={"source": {"uri": "s3://AKIAEXAMPLE:s3cr3t@adapters/sql"}}),
        "spec.source.uri",
        "spec.source.uri must not contain credentials (user:password@); "
        "reference a Secret on the DynamoWorker instead",
    ),
    Invalid(
        "lora-hf-shape",
        lora_adapter(spec={"source": {"uri": "hf://org/repo/extra path"}}),
        "spec.source.uri",
        "spec.source.uri: hf:// URIs take the form hf://org/repo",
    ),
    Invalid(
        "lora-file-relative",
        lora_adapter(spec={"source": {"uri": "file://adapters/sql"}}),
        "spec.source.uri",
        "spec.source.uri: file:// URIs take an absolute path",
    ),
    Invalid(
        "lora-sha256-shape",
        lora_adapter(spec={"source": {"sha256": "ABCDEF"}}),
        "spec.source.sha256",
    ),
    Invalid(
        "lora-count-without-replicas",
        lora_adapter(spec={"placement": {"policy": "Count"}}),
        "spec.placement.replicas",
        "spec.placement.replicas is required when spec.placement.policy is Count",
    ),
    Invalid(
        "lora-required-with-count",
        lora_adapter(
            spec={"requiredForReadiness": True, "placement": {"policy": "Count", "replicas": 1}}
        ),
        "spec.requiredForReadiness",
        "spec.requiredForReadiness needs spec.placement.policy AllReplicas",
    ),
    Invalid(
        "lora-replicas-without-count",
        lora_adapter(spec={"placement": {"replicas": 2}}),
        "spec.placement.replicas",
        "spec.placement.replicas is only used with policy: Count",
    ),
    Invalid(
        "lora-adapter-name", lora_adapter(spec={"adapterName": "sql expert"}), "spec.adapterName"
    ),
    Invalid(
        "lora-selector-in-without-values",
        lora_adapter(
            spec={
                "workerRef": None,
                "workerSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]},
            }
        ),
        "spec.workerSelector.matchExpressions[0]",
        "matchExpressions[].values: In and NotIn need values",
    ),
]


def without_nulls(manifest: dict[str, Any]) -> dict[str, Any]:
    """`manifest` with None values removed (the cases use None to drop a base field)."""
    return {
        k: without_nulls(v) if isinstance(v, dict) else v
        for k, v in manifest.items()
        if v is not None
    }


VALID = [(case_id, without_nulls(m)) for case_id, m in _VALID]
INVALID = [Invalid(c.id, without_nulls(c.manifest), c.field, c.message) for c in _INVALID]
