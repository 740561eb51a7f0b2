"""The `dynamo-operator` command line: `crds` prints the CRDs, `run` runs the operator."""

from __future__ import annotations

import argparse
import sys


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
    commands.add_parser("run", help="run the operator (not implemented yet)")
    return parser


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
        print(
            "dynamo-operator run: not implemented yet (the operator lands with its own issue)",
            file=sys.stderr,
        )
        return 2
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
