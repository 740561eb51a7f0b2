"""The operator's worker-image defaults reach the worker pods: `--worker-image-pull-secret`
(what the chart's workerDefaults.imagePullSecrets sets) becomes every worker pod's
imagePullSecrets; without it the pod spec has none."""

from __future__ import annotations

import copy

import pytest

from dynamo_operator import cli
from dynamo_operator.api import DynamoWorker
from dynamo_operator.reconcile.dynamoworker.builders import desired_deployment
from dynamo_operator.reconcile.dynamoworker.settings import ReconcileSettings
from support.api_cases import dynamo_worker

pytestmark = pytest.mark.unit


def stored() -> DynamoWorker:
    body = copy.deepcopy(dynamo_worker())
    body["metadata"] |= {"namespace": "serving", "uid": "u-1", "generation": 1}
    return DynamoWorker.model_validate(body)


def test_pull_secrets_are_set_on_worker_pods() -> None:
    settings = ReconcileSettings(worker_image="r.example/w:1", worker_image_pull_secrets=("a", "b"))
    pod = desired_deployment(stored(), settings)["spec"]["template"]["spec"]
    assert pod["imagePullSecrets"] == [{"name": "a"}, {"name": "b"}]
    pod = desired_deployment(stored(), ReconcileSettings(worker_image="r.example/w:1"))
    assert "imagePullSecrets" not in pod["spec"]["template"]["spec"]


def test_cli_takes_repeated_pull_secrets() -> None:
    args = cli._parser().parse_args(
        ["run", "-A", "--worker-image-pull-secret=a", "--worker-image-pull-secret", "b"]
    )
    assert args.worker_image_pull_secrets == ["a", "b"]
    assert cli._parser().parse_args(["run", "-A"]).worker_image_pull_secrets is None
