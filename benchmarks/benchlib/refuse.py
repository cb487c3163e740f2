"""Section 10: refusals of the hostile command lines of ``tests/malformed.py``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from .common import HERE, log, row, verdict


# Runs the command given as its arguments and prints its exit status, wall seconds and the peak
# RSS (MB) of that one child (RUSAGE_CHILDREN of a parent that has no other child).
_MEASURED_CHILD = (
    "import resource, subprocess, sys, time\n"
    "t = time.monotonic()\n"
    "done = subprocess.run(sys.argv[1:], capture_output=True, text=True, timeout=120)\n"
    "seconds = time.monotonic() - t\n"
    "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
    "print(done.returncode, f'{seconds:.3f}', f'{peak:.0f}')\n"
)


def _measured(argv: list[str], env: dict[str, str]) -> tuple[int, float, float]:
    """``python -m kda_tp *argv`` in a measured child: (exit status, seconds, peak MB)."""
    run = subprocess.run([sys.executable, "-c", _MEASURED_CHILD, sys.executable, "-m",
                          "kda_tp", *argv], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    status, seconds, peak = run.stdout.split()
    return int(status), float(seconds), float(peak)


def section_refuse(scratch: Path) -> None:
    """Section 10: every hostile command line of tests/malformed.py, refused; the slowest and
    the largest against ``kda-tp --help`` in the same run (bounds: 5 s, 600 MB)."""
    sys.path.insert(0, str(HERE.parent / "tests"))
    import malformed

    log(f"section 10: {len(malformed.CLI_KINDS)} hostile command lines")
    root = scratch / "malformed"
    root.mkdir()
    malformed.base_checkpoint(root)
    _, help_s, help_mb = _measured(["--help"], {})
    runs = {}
    for kind, build in malformed.CLI_KINDS.items():
        case = build(root)
        runs[kind] = _measured(list(case.argv), dict(case.env))
    wrong = sorted(k for k, (status, _, _) in runs.items() if status != 2)
    slowest = max(runs, key=lambda k: runs[k][1])
    largest = max(runs, key=lambda k: runs[k][2])
    sec = "10 refusals"
    row(sec, "python -m kda_tp --help (baseline)", f"{help_s:.2f}", "s", f"{help_mb:.0f} MB")
    row(sec, f"slowest refusal ({slowest}) of {len(runs)}, exit 2: "
        f"{len(runs) - len(wrong)}/{len(runs)}", f"{runs[slowest][1]:.2f}", "s",
        f"/--help {runs[slowest][1] / help_s:.2f}x", "< 5 s, exit 2",
        verdict(runs[slowest][1] < 5.0 and not wrong))
    row(sec, f"largest refusal ({largest})", f"{runs[largest][2]:.0f}", "MB",
        f"/--help {runs[largest][2] / help_mb:.2f}x", "< 600 MB",
        verdict(runs[largest][2] < 600))
    log(f"  slowest {slowest} {runs[slowest][1]:.2f} s, largest {largest} "
        f"{runs[largest][2]:.0f} MB; not exit 2: {wrong or 'none'}")
    shutil.rmtree(root)

