"""``kda-tp ARGS`` run in this process, as the command-line tests drive it (a child process:
``children.py``)."""

from __future__ import annotations

import pytest
from kda_tp.cli import main


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``kda-tp ARGS`` in this process: exit status, stdout, stderr."""
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def demo(capsys: pytest.CaptureFixture[str], keep: object, *args: object) -> tuple[int, str, str]:
    """A small, fast ``kda-tp demo --keep KEEP`` (TP 2, one layer, no numeric check)."""
    return run(capsys, "demo", "--tp-size", 2, "--num-layers", 1, "--no-numeric",
               "--keep", keep, *args)
