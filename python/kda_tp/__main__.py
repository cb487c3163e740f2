"""``python -m kda_tp`` and the ``kda-tp`` console script.

A Ctrl-C at any moment exits 130 with one line, no traceback: also while numpy, the Rust core
and the command's modules are still being imported, which is why this entry point imports the
command line inside :func:`main` and ``import kda_tp`` imports little (see ``kda_tp.__init__``).
A SIGINT that the process started ignoring (a background job's, ``nohup``) stays ignored.
"""

import sys


def main() -> int:
    """Run ``kda-tp`` with ``sys.argv``; returns its exit status (see :func:`kda_tp.cli.main`)."""
    try:
        from .cli import main as run  # noqa: PLC0415 - inside the try: interruptible

        return run()
    except KeyboardInterrupt:
        # Interrupted before or after the command's own handler (imports, argument parsing).
        print("kda-tp: interrupted", file=sys.stderr)
        return 130  # 128 + SIGINT, as the command's own handler returns (cli.EXIT_INTERRUPTED)


if __name__ == "__main__":
    sys.exit(main())
