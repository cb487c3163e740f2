"""``python -m kda_tp`` and the ``kda-tp`` console script.

A Ctrl-C at any moment exits 130 with one line, no traceback: also while numpy, the Rust core
and the command's modules are still being imported, which is why this entry point imports the
command line inside :func:`main` and ``import kda_tp`` imports nothing (see ``kda_tp.__init__``).
A SIGINT that the process started ignoring (a background job's, ``nohup``) stays ignored, and
one that arrives after the command has finished changes nothing. Python's own start-up (before
this module runs, about 20-30 ms) is out of reach: a Ctrl-C there ends Python its own way.
"""

import os
import signal
import sys


def main() -> int:
    """Run ``kda-tp`` with ``sys.argv``; returns its exit status (see :func:`kda_tp.cli.main`)."""
    interrupted: list[int] = []
    finished: list[int] = []

    def on_sigint(signum: int, frame: object) -> None:
        if finished:  # the command has finished and said so: its exit status stands
            return
        interrupted.append(signum)
        raise KeyboardInterrupt

    # Only where Ctrl-C raises KeyboardInterrupt anyway (not where SIGINT is ignored): the same,
    # and noted, because what it interrupts may turn it into another exception (numpy's
    # initialisation raises ImportError).
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, on_sigint)
    status: int | None = None
    try:
        from .cli import main as run

        status = run()
        finished.append(status)
    except BaseException:
        if not interrupted:
            raise
    if not interrupted:
        assert status is not None
        return status
    if status != 130:  # 128 + SIGINT; the command's own handler says what it stopped
        print("kda-tp: interrupted", file=sys.stderr)
    # Not a return: where C code saw the KeyboardInterrupt unhandled, Python would end by the
    # signal instead of this exit status.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a closed pipe
            pass
    os._exit(130)


if __name__ == "__main__":
    sys.exit(main())
