"""Runs one container process inside a pod's network namespace: bind-mounts the pod's volumes
(the service-account token among them) into a private mount namespace, then execs the
container's command. Invoked by the process node as
`ip netns exec NS python hack/testbed/launcher.py --bind SRC DST ... -- CMD ARGS...`
(`ip netns exec` already gives the child its own mount namespace, with host mounts slaved, so
these binds are seen by this pod only)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="testbed.launcher")
    parser.add_argument("--bind", nargs=2, action="append", default=[], metavar=("SRC", "DST"))
    parser.add_argument("--cwd", default="/")
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        sys.exit("testbed.launcher: no command given")
    for src, dst in args.bind:
        os.makedirs(dst, exist_ok=True)
        subprocess.run(["mount", "--bind", src, dst], check=True)
    os.chdir(args.cwd)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
