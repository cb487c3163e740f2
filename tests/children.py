"""Child Python processes for the Ctrl-C and kill tests, whatever the test run inherited.

A shell starts a background job (``cmd &`` in a script, ``nohup``) with SIGINT ignored, and
children inherit that, so a child that a test interrupts installs Python's own Ctrl-C handler
first. The tests hold such a child at a state (a hook in its code) instead of waiting a time.
"""

from __future__ import annotations

import subprocess
import sys
import time

#: The first lines of every child a test interrupts: Ctrl-C raises KeyboardInterrupt, as in a
#: terminal, even when this test run was started with SIGINT ignored.
SIGINT_DEFAULT = "import signal\nsignal.signal(signal.SIGINT, signal.default_int_handler)\n"


def kda_tp_child(setup: str, *args: object) -> list[str]:
    """The command line of ``python -m kda_tp ARGS`` run after ``setup`` (Python code: hooks,
    patches), with SIGINT as :data:`SIGINT_DEFAULT` sets it unless ``setup`` changes it."""
    code = (SIGINT_DEFAULT + setup
            + "\nimport runpy\nrunpy.run_module('kda_tp', run_name='__main__', alter_sys=True)\n")
    return [sys.executable, "-c", code, *map(str, args)]


def shard_cmd(checkpoint: object, out: object, *extra: object, tp_size: int = 2) -> list[str]:
    """The command line of ``python -m kda_tp shard CHECKPOINT --tp-size TP_SIZE --out OUT
    --quiet EXTRA`` (in this interpreter)."""
    return [sys.executable, "-m", "kda_tp", "shard", str(checkpoint), "--tp-size", str(tp_size),
            "--out", str(out), "--quiet", *map(str, extra)]


# Runs kda-tp with one writer thread (the ranks one after the other, always in the same order)
# and counts its output events: each write and copy_file_range into a file, each rename
# (os.replace, and kda_tp.output.moves' rename that never replaces) and each directory removal
# (shutil.rmtree, os.rmdir), as "kind file-name" in ``events``.
_COUNTED = """
events = []
def counted(kind, function, arg):
    def call(*args, **kwargs):
        events.append(f"{kind} {Path(args[arg]).name}")
        if len(events) == event_at:
            AT_EVENT
        return function(*args, **kwargs)
    return call
_files.checked_write = counted("write", _files.checked_write, 1)
_io._copy_file_range = counted("copy", _io._copy_file_range, 1)
os.replace = counted("rename", os.replace, 0)
moves._rename = counted("rename", moves._rename, 0)
shutil.rmtree = counted("remove", shutil.rmtree, 0)
os.rmdir = counted("remove", os.rmdir, 0)
os.cpu_count = lambda: 1
if not event_at:
    import atexit
    atexit.register(lambda: AT_EXIT)
"""


def counting_setup(arguments: str, at_event: str, at_exit: str) -> str:
    """``setup`` code for :func:`kda_tp_child` that counts kda-tp's output events, run with one
    writer thread (see ``_COUNTED``). ``arguments`` (lines of code) takes the child's own
    arguments off ``sys.argv`` and sets ``event_at``; just before event ``event_at`` (1-based)
    the child runs ``at_event`` (one line); with ``event_at`` 0 it runs to the end and evaluates
    ``at_exit`` (an expression of ``events``) at exit."""
    return ("import os, shutil, signal, sys\nfrom pathlib import Path\n"
            "from kda_tp.checkpoint import files as _files, writer as _io\n"
            "from kda_tp.output import moves\n"
            + arguments + _COUNTED.replace("AT_EVENT", at_event).replace("AT_EXIT", at_exit))


def wait_blocked(child: subprocess.Popen[str], bound: float) -> None:
    """Wait until ``child`` is blocked on a file lock (a ``->`` line of its pid in
    ``/proc/locks``): the state ``--wait`` is in while another writer holds the lock. Polls that
    state; ``bound`` (seconds) only turns a regression into a failure instead of a hang."""
    deadline = time.monotonic() + bound
    while True:
        with open("/proc/locks") as f:
            if any(line.split()[1] == "->" and line.split()[5] == str(child.pid)
                   for line in f if len(line.split()) > 5):
                return
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, f"pid {child.pid} never blocked on a lock"
        time.sleep(0.01)
