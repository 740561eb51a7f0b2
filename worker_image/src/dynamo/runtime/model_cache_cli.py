"""`dynamo-model-cache`: what the operator's model cache Job runs in the worker image.

    dynamo-model-cache fill --source s3://bucket/prefix --cache DIR
    dynamo-model-cache prune --cache DIR --keep KEY [--keep KEY ...]

`fill` makes the source's directory under DIR complete (see `dynamo.runtime.model_cache`),
printing one JSON line of progress about every second, `{"bytesDone": N, "bytesTotal": M}`,
and a last one with `"complete": true` and `"directory"`. A failure is written, as
`{"reason": ..., "message": ...}`, to the termination-message file (`DYN_TERMINATION_LOG`, else
`/dev/termination-log`) so the operator can show it, and on stderr for people.

Exit status: 0 done; 1 a failure a retry may cure (the Job retries); 2 a failure no retry will
cure until someone fixes the source, the credentials or the command line (refused credentials,
nothing at the source, a bad or unsupported URI, an unsafe listing).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Final, NoReturn

from dynamo.common.lora.errors import (
    REASON_AUTH,
    REASON_BAD_URI,
    REASON_FAILED,
    REASON_NOT_FOUND,
    REASON_UNSAFE,
    LoRADownloadError,
)
from dynamo.runtime import model_cache

PROG: Final = "dynamo-model-cache"
EXIT_OK: Final = 0
EXIT_TRANSIENT: Final = 1
EXIT_PERMANENT: Final = 2
TERMINATION_LOG_ENV: Final = "DYN_TERMINATION_LOG"
DEFAULT_TERMINATION_LOG: Final = "/dev/termination-log"
#: Reasons no retry can cure until a person fixes something.
PERMANENT_REASONS: Final = frozenset({REASON_AUTH, REASON_NOT_FOUND, REASON_BAD_URI, REASON_UNSAFE})
#: Kubernetes keeps at most 4096 bytes of a termination message; a longer one would be cut
#: mid-JSON, so the message is shortened instead.
_MESSAGE_LIMIT: Final = 3500


class _Parser(argparse.ArgumentParser):
    """Argument errors as one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_PERMANENT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG,
        description="Fill and prune the model cache volume that worker pods load from.",
        allow_abbrev=False,
    )
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    fill = commands.add_parser(
        "fill",
        help="download a source into its cache directory unless it is complete",
        description="Download every object under an s3:// source into <cache>/<key>, verify "
        "it against the listing, and mark it complete. Exit 0 when done (or already "
        "complete), 1 on a failure a retry may cure, 2 on one it cannot.",
    )
    fill.add_argument("--source", required=True, metavar="URI", help="s3://bucket/prefix")
    fill.add_argument("--cache", required=True, type=Path, metavar="DIR", help="the cache root")
    prune = commands.add_parser(
        "prune",
        help="remove the cache directories of every key not kept",
        description="Remove every key directory and partial directory under the cache whose "
        "key is not kept; other names are left alone.",
    )
    prune.add_argument("--cache", required=True, type=Path, metavar="DIR", help="the cache root")
    prune.add_argument(
        "--keep",
        required=True,
        action="append",
        metavar="KEY",
        help="a key to keep (16 lowercase hex digits); repeat for more",
    )
    return parser


def _progress(done: int, total: int) -> None:
    print(json.dumps({"bytesDone": done, "bytesTotal": total}), flush=True)


async def _fill(source: str, cache: Path) -> model_cache.FillResult:
    # SIGTERM (the Job's pod deleted) cancels the fill, whose cleanup removes the partial
    # directory instead of leaving it to the next fill.
    task = asyncio.current_task()
    if task is not None:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    return await model_cache.fill(source, cache, progress=_progress)


def run_fill(source: str, cache: Path) -> int:
    """`fill`: the exit status; the failure, if any, reported as the module says."""
    try:
        result = asyncio.run(_fill(source, cache))
    except LoRADownloadError as exc:
        return _fail(exc.reason, str(exc))
    except asyncio.CancelledError:
        return _fail(REASON_FAILED, f"the fill of {source} was stopped (SIGTERM)")
    except Exception as exc:
        logging.getLogger(__name__).debug("fill failed", exc_info=True)
        return _fail(REASON_FAILED, f"filling the model cache from {source} failed: {exc}")
    if not result.fetched:
        print(f"{PROG}: {result.directory} is already complete for {source}", file=sys.stderr)
    final = {
        "bytesDone": result.bytes_total,
        "bytesTotal": result.bytes_total,
        "complete": True,
        "directory": str(result.directory),
    }
    print(json.dumps(final), flush=True)
    return EXIT_OK


def _fail(reason: str, message: str) -> int:
    text = " ".join(message.split())
    if len(text) > _MESSAGE_LIMIT:
        text = text[: _MESSAGE_LIMIT - 3] + "..."
    path = os.environ.get(TERMINATION_LOG_ENV) or DEFAULT_TERMINATION_LOG
    try:
        with open(path, "w") as out:
            json.dump({"reason": reason, "message": text}, out)
    except OSError:
        pass  # not in a pod (or no such file): stderr below still tells the story
    print(f"{PROG}: error ({reason}): {text}", file=sys.stderr)
    return EXIT_PERMANENT if reason in PERMANENT_REASONS else EXIT_TRANSIENT


def run_prune(cache: Path, keep: list[str]) -> int:
    """`prune`: one line per removed directory on stdout."""
    try:
        removed = model_cache.prune(cache, keep)
    except ValueError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_PERMANENT
    except OSError as exc:
        print(f"{PROG}: error: pruning {cache} failed: {exc}", file=sys.stderr)
        return EXIT_TRANSIENT
    for path in removed:
        print(f"removed {path}", flush=True)
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dynamo-model-cache`."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("dynamo").setLevel(logging.INFO)
    if args.command == "fill":
        return run_fill(args.source, args.cache)
    return run_prune(args.cache, args.keep)


if __name__ == "__main__":
    sys.exit(main())
