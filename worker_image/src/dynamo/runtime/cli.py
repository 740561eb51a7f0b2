"""The `dynamo-worker` command line."""

import sys


def main(argv: list[str] | None = None) -> int:
    """Entry point; the worker lifecycle lands with the worker-runtime issue."""
    del argv
    print("dynamo-worker: not implemented yet (the worker runtime lands with its own issue)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
