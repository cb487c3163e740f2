"""The oracle's command line: ``python -m kda_tp.oracle verify CHECKPOINT OUT``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ._verifier import verify

def main(argv: Sequence[str] | None = None) -> int:
    """Command line: ``python -m kda_tp.oracle verify CHECKPOINT OUT``.

    Prints each problem to stderr and a one-line summary to stdout. Returns the exit status:
    0 when the output is a correct sharding of the checkpoint, 1 otherwise (2 for bad usage,
    from argparse).
    """
    parser = argparse.ArgumentParser(
        prog="python -m kda_tp.oracle",
        description="Check a KDA tensor-parallel sharded checkpoint against its source.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser("verify", help="compare OUT/rank*/ with CHECKPOINT byte for byte")
    check.add_argument("checkpoint", type=Path, help="the full (unsharded) checkpoint directory")
    check.add_argument("out", type=Path, help="the directory holding rank0 .. rank{T-1}")
    args = parser.parse_args(argv)

    problems = verify(args.checkpoint, args.out)
    for line in problems:
        print(line, file=sys.stderr)
    if problems:
        print(f"FAIL: {len(problems)} problem(s) in {args.out} against {args.checkpoint}")
        return 1
    print(f"OK: {args.out} is a correct tensor-parallel sharding of {args.checkpoint}")
    return 0

