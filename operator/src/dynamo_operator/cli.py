"""The `dynamo-operator` command line: `crds` prints the CRDs, `run` runs the operator."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynamo-operator", description="A Kubernetes operator for Dynamo LLM workers."
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.add_parser(
        "crds",
        help="print every CRD the operator needs, as multi-document YAML",
        description="Print the CRDs (DynamoWorker, LoRAAdapter, and upstream's "
        "DynamoWorkerMetadata) as multi-document YAML, e.g. for `kubectl apply -f -`.",
    )
    run = commands.add_parser(
        "run",
        help="run the operator",
        description="Run the operator against the cluster of the in-cluster service account, "
        "or of KUBECONFIG.",
    )
    scope = run.add_mutually_exclusive_group(required=True)
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        dest="namespaces",
        metavar="NS",
        help="watch this namespace (repeat for more)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace")
    verbosity = run.add_mutually_exclusive_group()
    verbosity.add_argument("--verbose", "-v", action="store_true", help="log debug details")
    verbosity.add_argument("--quiet", "-q", action="store_true", help="log warnings only")
    run.add_argument(
        "--worker-image",
        default=os.environ.get("DYNAMO_WORKER_IMAGE"),
        help="worker image for DynamoWorkers without spec.image (env DYNAMO_WORKER_IMAGE)",
    )
    run.add_argument(
        "--vllm-worker-image",
        default=os.environ.get("DYNAMO_VLLM_WORKER_IMAGE"),
        help="worker image for vLLM-engine DynamoWorkers without spec.image (build it from "
        "worker_image/Dockerfile.vllm; env DYNAMO_VLLM_WORKER_IMAGE)",
    )
    run.add_argument(
        "--frontend-image",
        default=os.environ.get("DYNAMO_FRONTEND_IMAGE"),
        help="upstream Dynamo frontend image for a spec.frontend without an image "
        "(env DYNAMO_FRONTEND_IMAGE)",
    )
    run.add_argument(
        "--worker-image-pull-secret",
        action="append",
        dest="worker_image_pull_secrets",
        metavar="SECRET",
        help="imagePullSecret of every worker and frontend pod, for a private registry "
        "(repeat for more)",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        default=8080,
        help="port of the operator's /metrics (-1: none; default 8080)",
    )
    run.add_argument(
        "--health-port", type=int, default=8081, help="port of /healthz (default 8081)"
    )
    run.add_argument(
        "--resync-seconds",
        type=float,
        default=30.0,
        help="reconcile every DynamoWorker at least this often (default 30)",
    )
    run.add_argument(
        "--worker-token-file",
        default=None,
        metavar="PATH",
        help="service-account token for the audience dynamo.dev/worker-admin, sent to worker "
        "pods and read again for each request (default: the chart's projected "
        "/var/run/secrets/dynamo.dev/worker-admin/token)",
    )
    run.add_argument(
        "--leader-election",
        action="store_true",
        help="run as one of several replicas: the one holding the Lease --lease-name (in "
        "POD_NAMESPACE, else the first --namespace) reconciles, the others stand by",
    )
    run.add_argument(
        "--lease-name",
        help="the leader-election Lease (default dynamo-operator-leader)",
    )
    run.add_argument(
        "--lease-duration-seconds",
        type=float,
        default=15.0,
        help="how long a leader's Lease lasts without a renew, and so the longest failover "
        "after a leader dies (default 15)",
    )
    run.add_argument(
        "--lease-retry-seconds",
        type=float,
        default=2.0,
        help="how often the leader renews the Lease and a standby reads it; also the leader's "
        "safety margin before its Lease runs out (default 2)",
    )
    run.add_argument(
        "--no-install-crds",
        dest="install_crds",
        action="store_false",
        help="do not install or update the CRDs at startup (install them with the chart)",
    )
    return parser


def _run(args: argparse.Namespace) -> int:
    # Imported here: kopf and the client are only needed to run.
    from dynamo_operator.handlers import OperatorConfig, configure_logging, run
    from dynamo_operator.pods.credentials import DEFAULT_TOKEN_FILE

    try:
        config = OperatorConfig(
            namespaces=tuple(args.namespaces or ()),
            all_namespaces=args.all_namespaces,
            worker_image=args.worker_image,
            vllm_worker_image=args.vllm_worker_image,
            worker_image_pull_secrets=tuple(args.worker_image_pull_secrets or ()),
            frontend_image=args.frontend_image,
            metrics_port=args.metrics_port,
            health_port=args.health_port,
            resync_seconds=args.resync_seconds,
            install_crds=args.install_crds,
            worker_token_file=Path(args.worker_token_file or DEFAULT_TOKEN_FILE),
            operator_namespace=os.environ.get("POD_NAMESPACE") or None,
            leader_election=args.leader_election,
            **({"lease_name": args.lease_name} if args.lease_name else {}),
            lease_duration_seconds=args.lease_duration_seconds,
            lease_retry_seconds=args.lease_retry_seconds,
        )
    except ValueError as err:
        print(f"dynamo-operator run: {err}", file=sys.stderr)
        return 2
    configure_logging(verbose=args.verbose, quiet=args.quiet)
    run(config)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `dynamo-operator` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command == "crds":
        # Imported here so that `--help` does not pay for building the models.
        from dynamo_operator.api.crd import multi_document_yaml

        sys.stdout.write(multi_document_yaml())
        return 0
    if args.command == "run":
        return _run(args)
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
