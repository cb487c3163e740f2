"""Shared by every section of ``benchmarks/bench.py``: the result table's rows, the machine
description, and the timing helpers (interleaved rounds with caches evicted, per-call times)."""

from __future__ import annotations

import os
import platform
import resource
import sys
import time
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" for safetensors' np framework)
import numpy as np

import kda_tp
import safetensors

try:
    import torch
except ImportError:  # optional
    torch = None

HERE = Path(__file__).resolve().parent.parent  # benchmarks/
BASELINE = HERE / "safetensors_baseline.py"
MIB = 2**20
ROWS: list[tuple] = []  # (section, case, value, unit, ratio text, target, verdict)
# Layer 0's KDA tensors in the synthetic GLM-5.3-Flash checkpoints (transformers' names).
GLM_PREFIX = "model.language_model.layers.0.self_attn."


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def row(section, case, value="", unit="", ratio="", target="", verdict=""):
    ROWS.append((section, case, value, unit, ratio, target, verdict))


def verdict(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


# ------------------------------------------------------------------------------------------------
# machine


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "?"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    thp = "?"
    try:
        thp = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text().strip()
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = (
        f"python {platform.python_version()}, numpy {np.__version__}, "
        f"safetensors {safetensors.__version__}, kda_tp {kda_tp.__version__}, "
        f"torch {torch.__version__ if torch else 'not installed'}"
    )
    text = (
        f"machine: {cpu}; {os.cpu_count()} logical cores ({usable} usable); RAM {ram}; "
        f"kernel {platform.release()}; THP {thp}\n{versions}\n{load_line()}"
    )
    return text


def load_line() -> str:
    """The 1-minute load average at the start (it lags: an earlier run still shows in it; the
    line after the table measures the CPU other processes took during this run)."""
    return f"load average at start (1 min, lagging): {os.getloadavg()[0]:.2f}"


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU-seconds of the whole machine, CPU-seconds of this process and its children)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    # user nice system idle iowait irq softirq steal ...
    busy = (sum(fields[:3]) + sum(fields[5:8])) / os.sysconf("SC_CLK_TCK")
    own = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        r = resource.getrusage(who)
        own += r.ru_utime + r.ru_stime
    return busy, own


def foreign_cpu_line(start: tuple[float, float], wall: float) -> str:
    """How much CPU other processes used during the run (they compete with the measurements)."""
    busy, own = cpu_seconds()
    other = max(0.0, (busy - start[0]) - (own - start[1]))
    line = (f"other processes used {other:.1f} CPU-s during the {wall:.0f} s run "
            f"({100 * other / wall:.0f}% of one core)")
    if other / wall > 0.1:
        line += "  WARNING: figures were measured on a busy machine"
    return line


# ------------------------------------------------------------------------------------------------
# timing helpers


_EVICT = None


def evict_caches() -> None:
    """Read twice the last-level cache (at least 128 MiB) so the next call reads its source
    from DRAM, not cache."""
    global _EVICT
    if _EVICT is None:
        _EVICT = np.ones(max(128 * MIB, 2 * llc_bytes()) // 8, np.uint64)
    _EVICT.max()


def llc_bytes() -> int:
    """The largest CPU cache in bytes (sysfs), 32 MiB when unknown."""
    sizes = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = f.read_text().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 * MIB)


def interleaved(funcs: dict, reps: int) -> dict[str, list[float]]:
    """Every wall time per function, one call of each per round, ``reps`` rounds, caches
    evicted before every call (see best_interleaved)."""
    times: dict[str, list[float]] = {k: [] for k in funcs}
    for _ in range(reps):
        for name, fn in funcs.items():
            evict_caches()
            t0 = time.perf_counter()
            out = fn()
            t1 = time.perf_counter()
            del out
            times[name].append(t1 - t0)
    return times


def best_interleaved(funcs: dict, reps: int) -> dict[str, float]:
    """Best wall time per function; one call of each per round, rounds repeated ``reps`` times.

    Caches are evicted before every call: a checkpoint's bytes are read once, from DRAM, and a
    small source left in L3 by the previous repetition would favour plain copies (a column
    slice's 16 KiB-strided rows map to few cache sets and do not stay resident).
    """
    return {k: min(v) for k, v in interleaved(funcs, reps).items()}


def per_call_us(fn, calls: int, loops: int) -> float:
    """Best (over ``loops``) mean time per call in microseconds."""
    best = float("inf")
    for _ in range(loops):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def warm(path: Path) -> None:
    """Read every file under ``path`` once so it sits in the page cache."""
    for f in sorted(path.rglob("*")):
        if f.is_file():
            with open(f, "rb", buffering=0) as fh:
                while fh.read(64 * MIB):
                    pass



def print_table() -> None:
    head = ("section", "case", "value", "unit", "ratio / detail", "target", "result")
    widths = [max(len(str(r[i])) for r in ROWS + [head]) for i in range(len(head))]
    line = "  ".join("-" * w for w in widths)

    def fmt(r):
        cells = []
        for i, (cell, w) in enumerate(zip(r, widths)):
            cells.append(str(cell).rjust(w) if i == 2 else str(cell).ljust(w))
        return "  ".join(cells).rstrip()

    print(fmt(head))
    print(line)
    prev = None
    for r in ROWS:
        sec = r[0].split()[0]
        if prev is not None and sec != prev:
            print(line)
        prev = sec
        print(fmt(r))
    print(line)
    misses = sum(r[6] == "MISS" for r in ROWS)
    passes = sum(r[6] == "PASS" for r in ROWS)
    print(f"targets: {passes} PASS, {misses} MISS, {sum(r[6] == 'n/a' for r in ROWS)} n/a")

