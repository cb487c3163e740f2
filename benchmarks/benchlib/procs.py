"""Child processes of the benchmark: the ``kda-tp`` CLI and its optional flags, wall time
and peak RSS of a command (``/usr/bin/time``, /proc sampling)."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .common import log


GNU_TIME = "/usr/bin/time" if os.access("/usr/bin/time", os.X_OK) else None


def run_child(cmd: list[str], sample: bool = False) -> dict:
    """Run ``cmd``: wall time, peak RSS, and (``sample``) peak RssAnon/RssFile/VmHWM from /proc.

    Peak RSS is ``/usr/bin/time -f %M`` (the "Maximum resident set size" of ``time -v``). Not
    this process's ``wait4`` ru_maxrss: Linux carries the parent's RSS high-water mark across
    (v)fork + exec into the child's ru_maxrss, so it would report the benchmark's own RSS.
    Without /usr/bin/time, the last sampled VmHWM (per process image, reset at exec) is used.
    """
    err_file = tempfile.TemporaryFile()  # a file, not a pipe: a chatty child cannot block
    rss_fd, rss_path = tempfile.mkstemp(prefix="kda_tp_bench_rss.")
    os.close(rss_fd)
    wrapped = [GNU_TIME, "-f", "%M", "-o", rss_path, *cmd] if GNU_TIME else cmd
    sample = sample or GNU_TIME is None
    peak = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    t0 = time.perf_counter()
    proc = subprocess.Popen(wrapped, stdout=subprocess.DEVNULL, stderr=err_file)
    if sample:
        while proc.poll() is None:
            _sample(proc.pid, GNU_TIME is not None, peak)
            time.sleep(0.01)
    proc.wait()
    wall = time.perf_counter() - t0
    err_file.seek(0)
    err = err_file.read().decode(errors="replace")
    err_file.close()
    try:
        maxrss = int(Path(rss_path).read_text().split()[-1]) * 1024 if GNU_TIME else peak["VmHWM"]
    except (ValueError, IndexError):
        maxrss = 0
    os.unlink(rss_path)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed ({proc.returncode}):\n{err[-3000:]}")
    return {"wall": wall, "maxrss": maxrss, **peak}


def _sample(pid: int, via_time: bool, peak: dict) -> None:
    """Fold /proc/<pid>/status of the measured process (time's child if ``via_time``) into peak."""
    try:
        if via_time:
            children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
            if not children:
                return
            pid = int(children[0])
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in peak:
                peak[key] = max(peak[key], int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass


def timed_job(cmd: list[str], out: Path) -> dict:
    """rm + sync before (outside the timing); command; then sync(2) timed separately."""
    if out.exists():
        shutil.rmtree(out)
    os.sync()
    result = run_child(cmd)
    t0 = time.perf_counter()
    os.sync()
    result["durable"] = result["wall"] + time.perf_counter() - t0
    result["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    return result


class Cli:
    """The ``kda-tp`` command, and which optional ``shard`` flags it has."""

    def __init__(self, cmd: list[str], help_text: str):
        self.cmd = cmd
        self.help = help_text

    def has(self, flag: str) -> bool:
        return flag in self.help

    def shard(self, ckpt: Path, tp: int, out: Path | None, *extra: str) -> list[str]:
        """``kda-tp shard CKPT --tp-size N [--quiet] [extra] --out`` (+ OUT when given)."""
        cmd = self.cmd + ["shard", str(ckpt), "--tp-size", str(tp)]
        if self.has("--quiet"):
            cmd.append("--quiet")  # no progress bar: time the work, not the terminal output
        cmd += list(extra) + ["--out"]
        return cmd + ([str(out)] if out is not None else [])


def kda_cli(args) -> Cli | None:
    cmd = shlex.split(args.kda_tp) if args.kda_tp else [str(Path(sys.executable).parent / "kda-tp")]
    try:
        probe = subprocess.run(cmd + ["shard", "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        log(f"kda-tp shard not available: {e}")
        return None
    if probe.returncode != 0:
        log(f"kda-tp shard not available: {probe.stderr.decode(errors='replace').strip()[-300:]}")
        return None
    return Cli(cmd, probe.stdout.decode(errors="replace"))
