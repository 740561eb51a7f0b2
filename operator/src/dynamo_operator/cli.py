"""The `dynamo-operator` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point; the operator's commands land with the DynamoWorker operator issue."""
    del argv
    print("dynamo-operator: not implemented yet (the operator lands with its own issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
