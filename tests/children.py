"""Child Python processes for the Ctrl-C and kill tests, whatever the test run inherited.

A shell starts a background job (``cmd &`` in a script, ``nohup``) with SIGINT ignored, and
children inherit that, so a child that a test interrupts installs Python's own Ctrl-C handler
first. The tests hold such a child at a state (a hook in its code) instead of waiting a time.
"""

from __future__ import annotations

import sys

#: The first lines of every child a test interrupts: Ctrl-C raises KeyboardInterrupt, as in a
#: terminal, even when this test run was started with SIGINT ignored.
SIGINT_DEFAULT = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"


def kda_tp_child(setup: str, *args: object) -> list[str]:
    """The command line of ``python -m kda_tp ARGS`` run after ``setup`` (Python code: hooks,
    patches), with SIGINT as :data:`SIGINT_DEFAULT` sets it unless ``setup`` changes it."""
    code = (SIGINT_DEFAULT + setup
            + "\nimport runpy\nrunpy.run_module('kda_tp', run_name='__main__', alter_sys=True)\n")
    return [sys.executable, "-c", code, *map(str, args)]
