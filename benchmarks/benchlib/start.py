"""Section 0: start-up time of the CLI against ``python -c "import numpy"``, and Ctrl-C."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import log, row, verdict
from .procs import Cli


def _sigint_default() -> None:
    """In the child before exec: Ctrl-C as in a terminal, also when this benchmark runs as a
    background job (the shell starts those with SIGINT ignored, and children inherit that)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupted_after(cmd: list[str], delay: float) -> tuple[bool, int, str]:
    """Start ``cmd``, send SIGINT ``delay`` s later: (still running when sent, exit status,
    stderr)."""
    err_file = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err_file,
                            preexec_fn=_sigint_default)  # noqa: PLW1509 - no threads yet
    time.sleep(delay)
    running = proc.poll() is None
    if running:
        proc.send_signal(signal.SIGINT)
    proc.wait()
    err_file.seek(0)
    return running, proc.returncode, err_file.read().decode(errors="replace")


def section_start(ckpt: Path, scratch: Path, cli: Cli | None, reps: int) -> None:
    """``kda-tp --help`` and ``kda-tp plan CONFIG`` against ``python -c "import numpy"`` (the
    target: at most 1.5x), and SIGINT at fixed delays after starting ``kda-tp shard``."""
    sec = "0 start"
    if cli is None:
        row(sec, "kda-tp --help, plan, Ctrl-C", "n/a", "", "CLI not available", "<= 1.50x", "n/a")
        return
    log(f"section 0: start-up, best of {reps}; SIGINT after a delay")
    config = ckpt / "config.json"
    jobs = {
        "numpy": [sys.executable, "-c", "import numpy"],
        "import": [sys.executable, "-c", "import kda_tp"],
        "help": cli.cmd + ["--help"],
        "plan": cli.cmd + ["plan", str(config), "--tp-size", "4"],
    }
    best = {key: float("inf") for key in jobs}
    for _ in range(reps):
        for key, cmd in jobs.items():
            t0 = time.perf_counter()
            subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
            best[key] = min(best[key], time.perf_counter() - t0)
    ms = {key: f"{1000 * t:.0f}" for key, t in best.items()}
    row(sec, 'python -c "import numpy" (baseline)', ms["numpy"], "ms", f"best of {reps}")
    row(sec, 'python -c "import kda_tp"', ms["import"], "ms",
        f"{best['import'] / best['numpy']:.2f}x numpy")
    for key, case in (("help", "kda-tp --help"), ("plan", "kda-tp plan CONFIG --tp-size 4")):
        ratio = best[key] / best["numpy"]
        row(sec, case, ms[key], "ms", f"{ratio:.2f}x numpy", "<= 1.50x", verdict(ratio <= 1.5))
    # Ctrl-C during the imports (half the time of `plan`, which imports numpy and the Rust core
    # as shard does) and at the delays, while `kda-tp shard` writes: exit status 130,
    # no traceback, and the last stderr line kda-tp's own ("kda-tp: ..."); the lines before it
    # may be the command's progress (demo prints "shard: 519 of 519 MB ..." without --quiet).
    # `demo` (generate, shard, verify: seconds) is still running at 0.7 s where `shard` of this
    # checkpoint may already have finished on a fast machine.
    shard = cli.shard(ckpt, 4, scratch / "o_sigint")
    demo = cli.cmd + ["demo", "--tp-size", "4", "--model", "kimi-linear"]
    for name, cmd, delay in (("shard", shard, best["plan"] / 2), ("shard", shard, 0.3),
                             ("demo", demo, 0.3), ("demo", demo, 0.7)):
        running, status, err = _interrupted_after(cmd, delay)
        shutil.rmtree(scratch / "o_sigint", ignore_errors=True)
        lines = err.splitlines()
        clean = (status == 130 and bool(lines) and lines[-1].startswith("kda-tp:")
                 and "Traceback" not in err)
        detail = (f"exit {status}, {len(lines)} line(s)" + (", traceback" if "Traceback" in err
                                                                else ", no traceback"))
        if not running:
            detail, clean = f"exited ({status}) before the signal", None
        row(sec, f"SIGINT {delay:.2f} s after starting kda-tp {name}", "", "", detail,
            "130, no traceback", verdict(clean))
        log(f"  SIGINT after {delay:.2f} s: {detail}; stderr: {err.strip()[-300:]!r}")

