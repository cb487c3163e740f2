"""``python -m kda_tp`` and the ``kda-tp`` console script.

A Ctrl-C at any moment exits 130 with one line, no traceback: also while numpy, the Rust core
and the command's modules are still being imported, which is why this entry point imports the
command line inside :func:`main` and ``import kda_tp`` imports nothing (see ``kda_tp.__init__``).
A SIGINT that the process started ignoring (a background job's, ``nohup``) stays ignored.
"""

import signal
import sys


class _Interrupted(BaseException):
    """Ctrl-C during the imports. Not a KeyboardInterrupt: an extension module's initialisation
    may turn an exception into an ImportError (numpy's does), and a KeyboardInterrupt that C
    code saw unhandled can make Python end by the signal instead of the exit status."""


def main() -> int:
    """Run ``kda-tp`` with ``sys.argv``; returns its exit status (see :func:`kda_tp.cli.main`)."""
    interrupted = []

    def on_sigint(signum: int, frame: object) -> None:
        interrupted.append(signum)
        raise _Interrupted

    # Only where Ctrl-C would raise KeyboardInterrupt anyway (not when SIGINT is ignored).
    catch = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    try:
        try:
            if catch:
                signal.signal(signal.SIGINT, on_sigint)
            from .cli import main as run
        finally:
            if catch:
                signal.signal(signal.SIGINT, signal.default_int_handler)
        return run()
    except BaseException:
        if not interrupted and not isinstance(sys.exc_info()[1], KeyboardInterrupt):
            raise
        # Interrupted outside the command's own handler: imports, argument parsing.
        print("kda-tp: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as the command's own handler returns (cli.EXIT_INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
