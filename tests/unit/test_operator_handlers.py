"""The kopf glue without a cluster: settings chosen on purpose, every handler registered with a
stable id, the liveness check on watchers, and the `run` command line."""

from __future__ import annotations

import copy
import logging

import kopf
import pytest

from dynamo_operator import cli
from dynamo_operator.handlers import OperatorConfig, OperatorContext, build_registry
from dynamo_operator.handlers.lifecycle import operator_settings, watcher_problem

pytestmark = pytest.mark.unit


def test_settings_use_our_names_and_deliberate_timeouts() -> None:
    settings = operator_settings()
    assert settings.persistence.finalizer == "dynamo.dev/finalizer"
    assert isinstance(settings.persistence.progress_storage, kopf.AnnotationsProgressStorage)
    assert settings.persistence.progress_storage.prefix == "dynamo.dev"
    assert isinstance(settings.persistence.diffbase_storage, kopf.AnnotationsDiffBaseStorage)
    assert settings.persistence.diffbase_storage.prefix == "dynamo.dev"
    assert settings.posting.level == logging.WARNING
    assert settings.peering.standalone is True
    assert settings.scanning.disabled is True
    assert settings.watching.server_timeout == 300
    assert settings.watching.client_timeout == 330
    assert settings.watching.inactivity_timeout == 70
    assert settings.networking.request_timeout == 60


def test_every_handler_is_registered_with_a_stable_id() -> None:
    registry = build_registry()
    ids = {
        "changing": {h.id for h in registry._changing.get_all_handlers()},
        "spawning": {h.id for h in registry._spawning.get_all_handlers()},
        "indexing": {h.id for h in registry._indexing.get_all_handlers()},
        "watching": {h.id for h in registry._watching.get_all_handlers()},
        "activities": {h.id for h in registry._activities.get_all_handlers()},
    }
    assert ids == {
        "changing": {"reconcile", "lora_unload"},
        "spawning": {"resync", "lora_sync"},
        "indexing": {
            "worker_pods",
            "pod_workers",
            "worker_metadata",
            "dynamo_workers",
            "lora_adapters",
        },
        "watching": {
            "deployment_changed",
            "pod_changed",
            "metadata_changed",
            "lora_changed",
            "lora_pod_changed",
            "lora_worker_changed",
        },
        "activities": {"login", "start", "stop", "watching"},
    }
    reasons = {h.reason for h in registry._changing.get_all_handlers()}
    initial = {h.initial for h in registry._changing.get_all_handlers()}
    assert reasons == {"create", "update", "delete", None}  # resume handlers carry no reason
    assert True in initial


@pytest.mark.parametrize(
    ("tasks", "namespaces", "problem"),
    [
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@a"], ("a",), None),
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@a"], ("a", "b"), "namespace(s) b"),
        (["watcher for pods.v1@a", "poster of events"], ("a",), "namespace(s) a"),
        (["watcher for dynamoworkers.v1alpha1.dynamo.dev@None"], (), None),
        ([], (), "namespace(s) None"),
    ],
)
def test_watcher_problem(
    tasks: list[str], namespaces: tuple[str, ...], problem: str | None
) -> None:
    found = watcher_problem(tasks, namespaces)
    if problem is None:
        assert found is None
    else:
        assert found is not None
        assert problem in found


def test_context_is_shared_across_kopfs_copies() -> None:
    ctx = OperatorContext(OperatorConfig(namespaces=("a",)))
    assert copy.copy(ctx) is ctx
    with pytest.raises(RuntimeError, match="not started"):
        _ = ctx.services


@pytest.mark.parametrize(
    "argv",
    [["run"], ["run", "-n", "a", "--all-namespaces"], ["run", "-n", "a", "-v", "-q"]],
)
def test_run_refuses_an_unclear_scope_or_verbosity(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with" in err or "is required" in err


def test_config_refuses_a_bad_resync_period() -> None:
    with pytest.raises(ValueError, match="--resync-seconds"):
        OperatorConfig(namespaces=("a",), resync_seconds=0)
    with pytest.raises(ValueError, match="--namespace"):
        OperatorConfig()
