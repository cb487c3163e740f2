"""kda_tp benchmark: slicing throughput, zero-copy gets, and whole-checkpoint sharding.

Run by hand (not part of the test suite), from the repository root::

    python benchmarks/bench.py            # full run (about 3-5 minutes on a 2-vCPU VM)
    python benchmarks/bench.py --quick    # 3 repetitions, skips section 4 (about 40 s)
    python benchmarks/bench.py --only gather   # section 1 alone (about 40 s)
    python benchmarks/bench.py --only guard    # section 7 alone (about 10 s)
    python benchmarks/bench.py --only wide     # section 8 alone (about 20 s)
    python benchmarks/bench.py --only diagnosis   # section 9 alone (about 30 s)

Options: ``--tmp DIR`` (scratch root, default /tmp; about 4.5 GB needed for the full run),
``--kda-tp CMD`` (command that runs the CLI, default the ``kda-tp`` console script beside the
interpreter), ``--keep`` (leave the scratch directory behind), ``--fresh-pages`` (re-run under
``MALLOC_MMAP_THRESHOLD_=1048576`` so that every output of 1 MiB or more - kda_tp's, numpy's and
the memcpy baseline's alike - is a fresh mapping whose pages the copy must fault in; by default
glibc lets ``np.empty`` reuse heap memory an earlier repetition already faulted in, which
favours the numpy and memcpy baselines over an output allocated with calloc/``np.zeros``).

Progress goes to stderr; stdout gets the machine description and ONE table. Every figure in the
table is measured in the same run, on the same buffers, and compared as a ratio against a
baseline measured alongside it; the last columns give the target and PASS/MISS.

0. Start-up: ``kda-tp --help`` and ``kda-tp plan CONFIG --tp-size 4`` (the GLM-5.3 config of
   section 3) against ``python -c "import numpy"``, best of N interleaved wall times of the
   whole process (target: at most 1.5x numpy's), and ``python -c "import kda_tp"`` for
   information. Then Ctrl-C: SIGINT half the ``plan`` time (inside the imports) and 0.3 s
   after starting ``kda-tp shard`` on that checkpoint, and 0.3 s and 0.7 s after starting
   ``kda-tp demo`` (SIGINT at its default disposition in the child, whatever the benchmark
   inherited): exit status 130 and only ``kda-tp:`` lines, no traceback (n/a when the command
   ended before the signal).
1. ``o_proj`` column slice (CHANNEL_COLS), GLM-5.3 geometry [4096, 8192] BF16 (64 MiB), at
   TP = 2, 4, 8 (rank tp//2). The input is the tensor's bytes in the read-only mapping of a
   generated checkpoint file (warm page cache, pages pre-touched). Timed, best of N, interleaved
   round-robin. Where the output lands is measured separately, because on a VM faulting in fresh
   pages costs more than the copy:
   * fresh memory: ``KdaShardedSource.read_into`` (the gather) and ``np.copyto`` of the same
     number of contiguous bytes (the memory-bandwidth limit), each into a new private anonymous
     mapping (4 KiB pages the copy must fault in; created and unmapped every call), the
     median of 15 interleaved calls (5 with ``--quick``), with the gather's thread count
     (rayon's pool) against memcpy's one thread. For information, the memcpy into a new
     ``MAP_POPULATE`` mapping (faulted in by mmap, as the gather prefaults its output) and
     into a new mapping advised ``MADV_HUGEPAGE``, and
     ``kda_tp.shard_bytes(plan["o_proj"], buf)``, whose output is a new numpy array (glibc may
     hand back heap memory an earlier call already faulted in; kda_tp advises huge pages on it);
   * prefaulted memory: ``read_into`` and ``np.copyto`` into the same reused buffer;
   * other implementations, each allocating its output: ``shard_bytes``,
     ``KdaShardedSource.get(name)``, numpy ``a[:, lo:hi].copy()`` (``a`` = the buffer viewed as
     uint16 [4096, 8192]), safetensors ``safe_open(file, framework="np").get_slice(name)[:,
     lo:hi]`` (BF16 via ml_dtypes; its own mapping of the same file, handle opened once), torch
     ``narrow(1, lo, w).contiguous()`` when torch is installed.
   Caches are evicted before every call (a read of twice the last-level cache). Figures are GB/s
   of output (1 GB = 1e9 bytes). Outputs are checked byte-equal before timing.
2. ``get()`` of row-sliced and replicated tensors, 64 MiB and 1 MiB class: time per call (us,
   best of several loops of many calls) and bytes copied (0 when the returned array's data lies
   inside one of ``source.mappings()`` and two calls share memory; else the tensor's size).
   A safetensors np row slice of the same tensor is shown for contrast (it copies).
3. ``kda-tp shard CKPT --tp-size 4 --out DIR`` on a generated 4-layer GLM-5.3 checkpoint
   (about 1.1 GB, 3 files), warm page cache, vs ``benchmarks/safetensors_baseline.py`` (the same
   job with safe_open/get_slice + safetensors.numpy.save_file) and ``cp -r`` of the directory
   (the I/O limit). Wall time of the command alone (the target uses this), and "+sync": the
   command followed by sync(2), i.e. until the written data is on disk (a tool that fsyncs pays
   for the disk inside its wall time; cp and safetensors' save_file do not fsync; the +sync
   figures compare all three on the same footing).
   Peak RSS is ``/usr/bin/time``'s "Maximum resident set size" (``%M``; not the benchmark's own
   wait4 ru_maxrss, which on Linux inherits the parent's high-water mark across fork + exec).
   The baseline's output is checked against KdaShardedSource.
   When the CLI has ``--quiet`` it is passed (no progress bar); when it has ``--backend``, one
   ``--backend pread`` run is shown for information.
5. Kimi K3: one KDA layer of K3's geometry (hidden 7168, 96 heads x 128, conv 4, f gate rank
   128, a full-rank ``g_proj [12288, 7168]`` instead of g_a/g_b; 0.89 GB), written as a
   safetensors file. A rank's whole layer at TP=2 and TP=8 into preallocated, prefaulted
   parameter buffers, best of N interleaved: (a) ``KdaShardedSource.read_into`` (the plan with
   ``full_rank_gate=True, a_log_len=128``); (b) ``get()`` then ``np.copyto``; (c) safetensors ``safe_open(..., "pt").get_slice(...)`` then
   ``param.copy_()`` (only when torch is installed); (d) ``np.copyto`` of the same number of
   contiguous bytes of each tensor. GB/s of local bytes.
6. vLLM's fused K3 parameter: ``in_proj_qkvgfab`` of rank 3 of 8 (q, k, v, g rows of the rank,
   f_a whole, b the rank's 12 heads, zero rows to a multiple of 16: [6288, 7168] BF16, 90 MB;
   layout ``vllm-0.33-k3``) built from the section-5 file by ``KdaShardedSource.build_param``
   into a preallocated, prefaulted buffer, vs ``np.copyto`` of the same number of contiguous
   bytes of the same mapped file into the same buffer. Best of N, interleaved. Checked first:
   each part equals the rank's slice, the padding is zero.
7. The guard (``kda_tp.guard.check``, what the vLLM and SGLang plugins run on every rank after
   the weights load): rank 3 of 8 of one Kimi K3 KDA layer (``synth.write_checkpoint(...,
   "kimi-k3", 1)``: K3's geometry, the layer's 7 ``vllm-0.33-k3`` parameters, 113 MB, as numpy
   arrays a loader filled) against ``np.copyto`` of the same number of contiguous bytes of the
   mapped checkpoint into a prefaulted buffer (single thread), best of N interleaved (target:
   the guard within 2x the memcpy); and its cost on a non-KDA model's parameters (an 80-layer
   Llama's 723 names), time per call (target: under 1 ms); and the check of one refit of the
   same rank (``kda_tp.update_check``: the layer's full checkpoint-format tensors fed through
   ``UpdateCheck.wrap`` as an engine consumes them, each part verified against the parameter
   as it is applied, fingerprints re-checked at the end) against a single-thread memcpy of the
   rank's KDA bytes it touched (target: within 2x), with the extra host memory held (target: at
   most the rank's largest parameter).
   ``--only guard`` runs this section alone.
   ``g_proj``, padded ``A_log``; tiny geometry, 8 heads of 16), 384 experts x 3 projections per
   layer as zero-size tensors, about 70k names in 8 files with an index, generated in the run.
   One rank's view, ``kda_tp.open_rank(ckpt, tp_rank=3, tp_size=8)`` (headers, config,
   description, plan, view; then ``keys()`` and ``close()``), against safetensors'
   ``safe_open(file, "np")`` + ``keys()`` of each file, best of N interleaved (target: within
   2x). The cost is per name, not per byte. For information, kda_tp's reader alone
   (``SafetensorsSource`` open + ``names()`` + ``close()``: the Rust header validation), the
   floor under the view. Then the guard on that rank (``kda_tp.guard.check`` on its
   ``vllm-0.33-k3`` parameters as numpy arrays, built by ``build_param``) against the same
   header read plus a memcpy of the parameters' bytes (target: within 3x).
9. The audit's diagnosis within its budget (issue 27.5): the same K3 rank (TP 8, one layer, 7
   ``vllm-0.33-k3`` parameters) filled with garbage (random bytes in each parameter's dtype
   and shape: every part of every parameter wrong, nothing to recognise), audited with
   ``kda_tp.audit`` (verdict and bounded diagnosis), against the audit of the exact rank, best
   of N interleaved (target: the garbage rank within 10x the exact one).
4. (full run only) Peak RSS of ``kda-tp shard`` at TP=4 on a 2-layer and an 8-layer GLM-5.3
   checkpoint; the bound is the largest single tensor + 256 MiB. RssAnon/RssFile peaks are
   sampled from /proc every 10 ms (RSS counts touched pages of file mappings, so a
   mmap-based reader's RSS includes mapped checkpoint pages; RssAnon is the private memory).
   When the CLI has ``--backend``, the same with ``--backend pread`` is shown for information.
10. Refusals (``--only refuse``): every hostile command line of ``tests/malformed.py``
   (``CLI_KINDS``), each ``python -m kda_tp`` in a process of its own measured by a parent of
   its own (wall time, peak RSS of that child alone): the slowest and the largest, against
   ``python -m kda_tp --help`` measured alongside (ratio for information); targets issue 21's
   acceptance bounds, under 5 s and 600 MB each (``tests/unit/test_malformed.py`` checks the one
   ``kda-tp: error:`` line and exit 2, not these bounds).

If the ``kda-tp shard`` CLI is not available, sections 3-4 print n/a for it (the baselines still
run). torch is optional. OPENBLAS/OMP settings are irrelevant (no BLAS is used).
Scratch data goes under ``--tmp`` and is removed at the end.
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers numpy's "bfloat16" for safetensors' np framework)
import numpy as np

import kda_tp
import safetensors
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, shard_bytes
from kda_tp.synth import write_checkpoint, write_small_checkpoint
from safetensors import safe_open

try:
    import torch
except ImportError:  # optional
    torch = None

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "safetensors_baseline.py"
MIB = 2**20
# --only: the sections by name (numbers as in the module docstring)
SECTIONS = {"start": "0", "gather": "1", "get": "2", "shard": "3", "k3": "5, 6", "guard": "7",
            "wide": "8", "diagnosis": "9", "refuse": "10",
            "rss": "4"}
# Section 8: Kimi K3's header width (layers, experts per layer, files).
WIDE_LAYERS, WIDE_EXPERTS, WIDE_FILES = 60, 384, 8
ROWS: list[tuple] = []  # (section, case, value, unit, ratio text, target, verdict)


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


# Layer 0's KDA tensors in the synthetic GLM-5.3-Flash checkpoints (transformers' names).
GLM_PREFIX = "model.language_model.layers.0.self_attn."

# ------------------------------------------------------------------------------------------------
# section 0: start-up and Ctrl-C


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
    # "kda-tp: ..." lines, no traceback.
    # `demo` (generate, shard, verify: seconds) is still running at 0.7 s where `shard` of this
    # checkpoint may already have finished on a fast machine.
    shard = cli.shard(ckpt, 4, scratch / "o_sigint")
    demo = cli.cmd + ["demo", "--tp-size", "4", "--model", "kimi-linear"]
    for name, cmd, delay in (("shard", shard, best["plan"] / 2), ("shard", shard, 0.3),
                             ("demo", demo, 0.3), ("demo", demo, 0.7)):
        running, status, err = _interrupted_after(cmd, delay)
        shutil.rmtree(scratch / "o_sigint", ignore_errors=True)
        lines = err.splitlines()
        clean = status == 130 and bool(lines) and all(line.startswith("kda-tp:") for line in lines)
        detail = (f"exit {status}, {len(lines)} line(s)" + (", traceback" if "Traceback" in err
                                                                else ", no traceback"))
        if not running:
            detail, clean = f"exited ({status}) before the signal", None
        row(sec, f"SIGINT {delay:.2f} s after starting kda-tp {name}", "", "", detail,
            "130, no traceback", verdict(clean))
        log(f"  SIGINT after {delay:.2f} s: {detail}; stderr: {err.strip()[-300:]!r}")


# ------------------------------------------------------------------------------------------------
# section 1: o_proj column slice


def section1(ckpt: Path, reps: int, fresh_reps: int) -> None:
    log(f"section 1: o_proj column slice, best of {reps}; into fresh memory median of {fresh_reps}")
    source = SafetensorsSource(ckpt)
    name = GLM_PREFIX + "o_proj.weight"
    record = source.get(name)
    rows_, cols = record.shape
    buf = record.data  # read-only uint8 view of the file mapping
    assert buf.nbytes == rows_ * cols * 2
    int(buf[:: 4096].sum())  # touch every page of the mapping in this process
    a = buf.view(np.uint16).reshape(rows_, cols)
    st_file = safe_open(source.file_of(name), framework="np")
    st_file.get_slice(name)[:, :1]  # warm its own mapping (touches a page column only)
    st_file.get_tensor(name)  # touch all of it
    tbuf = None
    if torch is not None:
        # torch's own mapping of the file (private, so writable: torch.frombuffer on the
        # read-only mapping above would warn that it cannot mark the tensor read-only).
        _, begin, end = source.file_range(name)
        path = source.file_of(name)
        tfile = torch.from_file(str(path), shared=False, size=path.stat().st_size,
                                dtype=torch.uint8)
        tbuf = tfile[begin:end].view(torch.bfloat16).reshape(rows_, cols)
        int(tbuf.view(torch.int16)[:, :: 2048].sum())  # touch its pages in this process

    for tp in (2, 4, 8):
        rank = tp // 2
        plan = KdaTpPlan.from_config(source, rank, tp)
        entry = plan["o_proj"]
        sharded = KdaShardedSource(source, plan)
        lo, w = entry.src_col_offset, entry.local_row_elems
        hi = lo + w
        n = entry.local_bytes
        prefaulted = np.ones(n, np.uint8)  # faulted in once, reused: no page faults
        funcs = {
            "kda": lambda: shard_bytes(entry, buf),
            "kda_get": lambda: sharded.get(name).data,
            "read_into": lambda: sharded.read_into(name, prefaulted),
            "numpy": lambda: a[:, lo:hi].copy(),
            "safetensors": lambda: st_file.get_slice(name)[:, lo:hi],
            "memcpy_prefaulted": lambda: np.copyto(prefaulted, buf[:n]),
        }
        # into fresh memory: every call writes a new private anonymous mapping (4 KiB pages)
        fresh = {
            "read_into_fresh": lambda: fresh_pages(n, lambda out: sharded.read_into(name, out)),
            "memcpy": lambda: fresh_pages(n, lambda out: np.copyto(out, buf[:n])),
            "memcpy_populate": lambda: fresh_pages(n, lambda out: np.copyto(out, buf[:n]),
                                                   populate=True),
            "memcpy_huge": lambda: fresh_pages(n, lambda out: np.copyto(out, buf[:n]), True),
        }
        if tbuf is not None:
            funcs["torch"] = lambda: tbuf.narrow(1, lo, w).contiguous()
        # correctness before timing
        ref = funcs["numpy"]().reshape(-1).view(np.uint8)
        assert np.array_equal(funcs["kda"](), ref), "kda_tp != numpy"
        assert np.array_equal(funcs["kda_get"](), ref), "get != numpy"
        funcs["read_into"]()
        assert np.array_equal(prefaulted, ref), "read_into != numpy"
        assert np.array_equal(fresh["read_into_fresh"](), ref), "read_into (fresh) != numpy"
        st = funcs["safetensors"]()
        assert np.array_equal(st.view(np.uint16).reshape(-1).view(np.uint8), ref), "safetensors"
        if tbuf is not None:
            tt = funcs["torch"]()
            assert np.array_equal(tt.view(torch.int16).numpy().reshape(-1).view(np.uint8), ref)
        del ref, st
        times = interleaved(fresh, fresh_reps)
        t = {k: min(v) for k, v in interleaved(funcs, reps).items()}
        t["memcpy"] = min(times["memcpy"])
        del prefaulted
        gbs = {k: n / v / 1e9 for k, v in t.items()}
        med = {k: n / float(np.median(v)) / 1e9 for k, v in times.items()}
        sec = f"1 TP={tp} r{rank}"
        shape = f"[{rows_},{w}] {n / MIB:.0f} MiB"
        fresh_gather_rows(sec, f"GLM-5.3 o_proj {shape}", med, len(times["memcpy"]))
        row(sec, "kda_tp.shard_bytes (new numpy array, huge pages advised)", f"{gbs['kda']:.2f}",
            "GB/s", f"shard_bytes/memcpy fresh (best) {gbs['kda'] / gbs['memcpy']:.2f}x")
        # prefaulted memory
        row(sec, "memcpy into prefaulted memory", f"{gbs['memcpy_prefaulted']:.2f}", "GB/s")
        r_pre = gbs["read_into"] / gbs["memcpy_prefaulted"]
        row(sec, "KdaShardedSource.read_into, same prefaulted memory", f"{gbs['read_into']:.2f}",
            "GB/s", f"read_into/memcpy {r_pre:.2f}x", ">= 0.90x", verdict(r_pre >= 0.90))
        # other implementations (fresh output each)
        row(sec, f"numpy a[:,lo:hi].copy() {shape}", f"{gbs['numpy']:.2f}", "GB/s")
        row(sec, "safetensors np get_slice[:,lo:hi]", f"{gbs['safetensors']:.2f}", "GB/s")
        if tbuf is not None:
            row(sec, "torch narrow(1,lo,w).contiguous()", f"{gbs['torch']:.2f}", "GB/s",
                f"kda/torch {gbs['kda'] / gbs['torch']:.2f}x")
        else:
            row(sec, "torch narrow().contiguous()", "skip", "", "torch not installed")
        r_np = gbs["kda"] / gbs["numpy"]
        r_st = gbs["kda"] / gbs["safetensors"]
        row(sec, "kda_tp.shard_bytes vs numpy, safetensors", "", "", f"kda/numpy {r_np:.2f}x",
            "> 1.00x", verdict(r_np > 1.0))
        if tp == 2:
            row(sec, "", "", "", f"kda/safetensors {r_st:.2f}x", ">= 3.00x", verdict(r_st >= 3.0))
        else:
            row(sec, "", "", "", f"kda/safetensors {r_st:.2f}x")
        row(sec, "KdaShardedSource.get (same file)", f"{gbs['kda_get']:.2f}", "GB/s",
            f"get/memcpy fresh (best) {gbs['kda_get'] / gbs['memcpy']:.2f}x")
        log(f"  TP={tp}: best " + ", ".join(f"{k} {v:.2f}" for k, v in gbs.items()) + " GB/s; "
            "fresh, median " + ", ".join(f"{k} {v:.2f}" for k, v in med.items()) + " GB/s")
    del st_file


def fresh_gather_rows(sec: str, what: str, med: dict[str, float], runs: int) -> None:
    """The rows of one gather into fresh memory: the target (the gather against a plain
    single-threaded memcpy of the same bytes into the same kind of new mapping, medians of
    ``runs`` interleaved calls) and, for information, the memcpy with its mapping populated
    up front and into huge pages."""
    threads = gather_threads()
    row(sec, f"memcpy (np.copyto, 1 thread) into fresh memory (new 4 KiB-page mapping), {what}",
        f"{med['memcpy']:.2f}", "GB/s", f"median of {runs}")
    r_fresh = med["read_into_fresh"] / med["memcpy"]
    row(sec, f"o_proj gather (read_into, {threads} threads) into the same kind of mapping",
        f"{med['read_into_fresh']:.2f}", "GB/s", f"gather/memcpy fresh {r_fresh:.2f}x",
        ">= 0.90x", verdict(r_fresh >= 0.90))
    row(sec, "  (info) memcpy, 1 thread, into a fresh MAP_POPULATE mapping (prefaulted in mmap)",
        f"{med['memcpy_populate']:.2f}", "GB/s",
        f"gather/this {med['read_into_fresh'] / med['memcpy_populate']:.2f}x")
    row(sec, "  (info) memcpy, 1 thread, into fresh huge-page memory (MADV_HUGEPAGE)",
        f"{med['memcpy_huge']:.2f}", "GB/s")


def gather_threads() -> int:
    """The threads of kda_tp's rayon pool: RAYON_NUM_THREADS, else the cores this process may
    use (rayon's default, short of a cgroup CPU quota)."""
    env = os.environ.get("RAYON_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def fresh_pages(n: int, fill, huge: bool = False, populate: bool = False) -> np.ndarray:
    """``fill`` a new private anonymous mapping of ``n`` bytes (pages the copy must fault in;
    with ``huge``, advised to use transparent huge pages; with ``populate``, faulted in by
    mmap itself, ``MAP_POPULATE``) and return it as a uint8 array (the mapping is unmapped
    when the array is freed, after the timing)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if populate:
        flags |= getattr(mmap, "MAP_POPULATE", 0)
    m = mmap.mmap(-1, n, flags=flags)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    out = np.frombuffer(m, np.uint8)
    fill(out)
    return out


# ------------------------------------------------------------------------------------------------
# section 5: one Kimi K3 layer, a rank's whole layer into preallocated parameters

K3_PREFIX = "model.layers.0.self_attn."


def k3_plan(tp_rank: int, tp_size: int) -> KdaTpPlan:
    """Kimi K3's KDA geometry: hidden 7168, 96 heads of 128, conv 4, f gate rank 128, the
    full-rank g_proj, A_log stored [128] for 96 heads, F32 convs, A_log, dt_bias and o_norm."""
    f32 = {name: "F32" for name in ("q_conv1d", "k_conv1d", "v_conv1d", "o_norm")}
    return KdaTpPlan(tp_rank, tp_size, 7168, 128, 96, 4, 128, full_rank_gate=True, a_log_len=128,
                     dtypes=f32)


def k3_entries(plan: KdaTpPlan) -> list[tuple[str, object]]:
    """(checkpoint name, plan entry) of one K3 KDA layer's 14 tensors."""
    return [(K3_PREFIX + (t.name if t.name in ("A_log", "dt_bias") else f"{t.name}.weight"), t)
            for t in plan.tensors]


def write_k3_layer(path: Path) -> int:
    """Write one K3 KDA layer (about 0.89 GB) as a safetensors file; returns its data bytes."""
    from kda_tp._io import write_safetensors

    specs = []
    for i, (name, t) in enumerate(k3_entries(k3_plan(0, 1))):
        def data(t=t, i=i):
            words = np.arange(t.full_bytes // 8 + 1, dtype=np.uint64) * 0x9E3779B97F4A7C15 + i
            out = words.view(np.uint8)[: t.full_bytes].copy()
            if t.name == "A_log":
                out[96 * 4 :] = 0  # the zero padding past the 96 heads, checked by the adapter
            return out
        specs.append((name, t.dtype, tuple(t.disk_shape), t.full_bytes, data))
    return write_safetensors(path, specs, sync=False)


def section_k3(scratch: Path, reps: int) -> None:
    log("section 5: Kimi K3 layer")
    path = scratch / "k3" / "model.safetensors"
    path.parent.mkdir()
    size = write_k3_layer(path)
    warm(path.parent)
    src = SafetensorsSource(path)
    for name in src.names():
        int(src.get(name).data[::4096].sum())  # map every page into this process
    for tp in (2, 8):
        rank = tp // 2
        plan = k3_plan(rank, tp)
        shard = KdaShardedSource(src, plan, layers=[0])
        entries = k3_entries(plan)
        local = sum(t.local_bytes for _, t in entries)
        # the parameters a loader preallocated, faulted in once
        params = {name: np.ones(t.local_bytes, np.uint8) for name, t in entries}

        def via_read_into():
            for name, _ in entries:
                shard.read_into(name, params[name])

        def via_get_copy():
            for name, _ in entries:
                np.copyto(params[name], shard.get(name).data)

        def via_memcpy():
            for name, t in entries:
                np.copyto(params[name], src.get(name).data[: t.local_bytes])

        funcs = {"read_into": via_read_into, "get_copy": via_get_copy, "memcpy": via_memcpy}
        if torch is not None:
            tparams = {name: torch.from_numpy(params[name]) for name, _ in entries}
            st = safe_open(path, framework="pt")

            def via_safetensors():
                for name, t in entries:
                    sl = st.get_slice(name)
                    if t.byte_range is None:
                        lo, w = t.src_col_offset, t.local_row_elems
                        part = sl[:, lo : lo + w]
                    elif t.kind.name == "REPLICATED":
                        part = sl[:]
                    else:
                        axis = t.sharded_axis(list(t.disk_shape))
                        index = [slice(None)] * len(t.disk_shape)
                        index[axis] = slice(t.src_row_offset, t.src_row_offset + t.local_rows)
                        part = sl[tuple(index)]
                    tparams[name].copy_(part.contiguous().view(-1).view(torch.uint8))

            funcs["safetensors"] = via_safetensors
        # correctness: every method leaves the same bytes
        via_read_into()
        want = {name: params[name].copy() for name, _ in entries}
        for key in ("get_copy", "safetensors"):
            if key in funcs:
                for p in params.values():
                    p.fill(0)
                funcs[key]()
                assert all(np.array_equal(params[n], want[n]) for n in want), key
        del want
        t = best_interleaved(funcs, reps)
        gbs = {k: local / v / 1e9 for k, v in t.items()}
        sec = f"5 K3 TP={tp} r{rank}"
        row(sec, f"one K3 KDA layer ({size / 1e9:.2f} GB), this rank's {local / 1e6:.0f} MB",
            "", "", "into preallocated, prefaulted parameters")
        row(sec, "plain memcpy of the same bytes", f"{gbs['memcpy']:.2f}", "GB/s")
        row(sec, "get() then copy into the parameter", f"{gbs['get_copy']:.2f}", "GB/s",
            f"get+copy/memcpy {gbs['get_copy'] / gbs['memcpy']:.2f}x")
        r_mem = gbs["read_into"] / gbs["memcpy"]
        row(sec, "read_into the parameters", f"{gbs['read_into']:.2f}", "GB/s",
            f"read_into/memcpy {r_mem:.2f}x", ">= 0.85x", verdict(r_mem >= 0.85))
        row(sec, "", "", "", f"read_into/get+copy {gbs['read_into'] / gbs['get_copy']:.2f}x")
        if "safetensors" in gbs:
            r_st = gbs["read_into"] / gbs["safetensors"]
            row(sec, "safetensors pt get_slice + param.copy_()", f"{gbs['safetensors']:.2f}",
                "GB/s")
            row(sec, "", "", "", f"read_into/safetensors {r_st:.2f}x", ">= 1.20x",
                verdict(r_st >= 1.2))
        else:
            row(sec, "safetensors pt get_slice + param.copy_()", "skip", "",
                "skipped: torch not installed", ">= 1.20x", "n/a")
        log(f"  TP={tp}: " + ", ".join(f"{k} {v:.2f}" for k, v in gbs.items()) + " GB/s")
        del params
    section_vllm_fused(src, reps)
    del src
    shutil.rmtree(path.parent)


def section_guard(scratch: Path, reps: int, calls: int, loops: int) -> None:
    """Section 7: the guard on one K3 rank (TP 8, one layer) vs a single-thread memcpy of the
    same bytes; the guard on a non-KDA model's parameters."""
    import logging

    from kda_tp.engines import get_layout
    from kda_tp.guard import check

    log("section 7: the guard")
    logging.getLogger("kda_tp.guard").setLevel(logging.WARNING)  # no pass line per call
    ckpt = scratch / "k3-guard"
    write_checkpoint(ckpt, "kimi-k3", 1)
    warm(ckpt)
    src = SafetensorsSource(ckpt)
    for name in src.names():
        int(src.get(name).data[::4096].sum())  # map every page into this process
    rank, tp = 3, 8
    shard = KdaShardedSource(src, KdaTpPlan.from_config(src, rank, tp, qk_multiple=1))
    layout = get_layout("vllm-0.33-k3")
    prefix = next(n for n in src.names() if n.endswith("self_attn.A_log"))[: -len("A_log")]
    # What a loader left in the rank's parameters (a BF16 engine: the F32 o_norm cast to BF16
    # with the rest; a rank of mixed model dtypes is wrong).
    params = {prefix + p.suffix: shard.build_param(layout, p.suffix, 0, model_dtype="BF16")
              for p in layout.params_for(shard.plan)}
    nbytes = sum(a.nbytes for a in params.values())
    source = np.concatenate([src.get(n).data.reshape(-1).view(np.uint8)
                             for n in src.names() if ".self_attn." in n])[:nbytes]
    dst = np.ones(nbytes, np.uint8)  # prefaulted
    result = check(params, ckpt, tp_rank=rank, tp_size=tp)
    assert result is not None and result.passed, result

    def via_guard():
        check(params, ckpt, tp_rank=rank, tp_size=tp)

    def via_memcpy():
        np.copyto(dst, source)

    t = best_interleaved({"guard": via_guard, "memcpy": via_memcpy}, reps)
    ratio = t["guard"] / t["memcpy"]
    sec = f"7 guard K3 TP={tp} r{rank}"
    row(sec, f"one K3 KDA layer, rank {rank} of {tp}: {len(params)} vllm-0.33-k3 parameters, "
        f"{nbytes / 1e6:.0f} MB", "", "", "numpy parameters, checkpoint mapped and warm")
    row(sec, "single-thread memcpy of the same bytes", f"{t['memcpy'] * 1e3:.1f}", "ms")
    row(sec, "kda_tp.guard.check (mode fail, passes)", f"{t['guard'] * 1e3:.1f}", "ms",
        f"guard/memcpy {ratio:.2f}x", "<= 2.00x", verdict(ratio <= 2.0))
    log(f"  guard {t['guard'] * 1e3:.1f} ms, memcpy {t['memcpy'] * 1e3:.1f} ms, {ratio:.2f}x")
    section_guard_update(ckpt, src, params, rank, tp, reps)
    del params, source, dst, src
    shutil.rmtree(ckpt)
    # A non-KDA model: an 80-layer Llama's parameter names (the values are never read).
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(80):
        names += [f"model.layers.{i}.{n}.weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")]
    llama = {n: np.zeros(1, np.float32) for n in names}
    us = per_call_us(lambda: check(llama, "/nonexistent/llama", tp_rank=0, tp_size=8), calls,
                     loops)
    row("7 guard non-KDA", f"kda_tp.guard.check on a non-KDA model ({len(llama)} parameters)",
        f"{us:.1f}", "us", "skipped: no KDA parameter name", "< 1000 us", verdict(us < 1000))
    log(f"  non-KDA: {us:.1f} us per call")


def section_guard_update(ckpt: Path, src: SafetensorsSource, params: dict, rank: int, tp: int,
                         reps: int) -> None:
    """Section 7, updates: one refit of the K3 layer checked against what it fed
    (``kda_tp.update_check.UpdateCheck``: fingerprints as each part is fed, this rank's
    slices kept as the trainer's full checkpoint-format tensors pass, every touched region
    compared at the end) vs a single-thread memcpy of the rank's KDA bytes the update touched."""
    from kda_tp.update_check import UpdateCheck

    fed = [(n, src.get(n).array) for n in src.names() if ".self_attn." in n]
    # The engine applied each tensor as it was fed (the parameters hold the rank's slices):
    # wrap() verifies each part when the engine asks for the next one.
    session = UpdateCheck(ckpt, params, tp_rank=rank, tp_size=tp)
    for _ in session.wrap(fed):
        pass
    report = session.check(params)
    assert report.passed, report.problems
    touched, kept = report.bytes, session.kept_bytes
    feed = UpdateCheck(ckpt, params, tp_rank=rank, tp_size=tp)  # an engine that defers: copies
    for name, value in fed:
        feed.feed(name, value)
    deferred = feed.kept_bytes
    largest = max(a.nbytes for a in params.values())
    source = np.concatenate([a.reshape(-1).view(np.uint8) for _, a in fed])[:touched]
    dst = np.ones(touched, np.uint8)  # prefaulted

    def via_update():
        update = UpdateCheck(ckpt, params, tp_rank=rank, tp_size=tp)
        for _ in update.wrap(fed):
            pass
        update.check(params)

    def via_memcpy():
        np.copyto(dst, source)

    t = best_interleaved({"update": via_update, "memcpy": via_memcpy}, reps)
    ratio = t["update"] / t["memcpy"]
    sec = f"7 guard update K3 TP={tp} r{rank}"
    row(sec, f"one refit of the K3 layer (the trainer's full tensors fed), rank {rank} of {tp}: "
        f"{report.regions} regions of {report.params} parameters, {touched / 1e6:.0f} MB touched",
        "", "", "numpy parameters; fed tensors mapped and warm")
    row(sec, "single-thread memcpy of the rank's KDA bytes touched", f"{t['memcpy'] * 1e3:.1f}",
        "ms")
    row(sec, "update check: start + each part fingerprinted and verified as fed + end check",
        f"{t['update'] * 1e3:.1f}", "ms", f"update/memcpy {ratio:.2f}x", "<= 2.00x",
        verdict(ratio <= 2.0))
    row(sec, "extra host memory held (parts applied as fed: fingerprints only)",
        f"{kept / 1e6:.0f}", "MB", f"largest parameter {largest / 1e6:.0f} MB",
        "<= largest", verdict(kept <= largest))
    row(sec, "  (info) host memory if every part were deferred (this rank's slices, copied)",
        f"{deferred / 1e6:.0f}", "MB", f"{deferred / largest:.2f}x the largest parameter")
    log(f"  update {t['update'] * 1e3:.1f} ms, memcpy {t['memcpy'] * 1e3:.1f} ms, {ratio:.2f}x")


def write_k3_wide(out: Path) -> tuple[int, int]:
    """A checkpoint with Kimi K3's header width and tiny tensors: 60 layers, 45 of them KDA
    (every 4th MLA, K3's wrapper config and names, full-rank g_proj, padded A_log; 8 heads of
    16, hidden 64), plus 384 experts x 3 projections in every layer as zero-size tensors, in 8
    files with an index. Returns (tensor names, files)."""
    from kda_tp._io import write_index, write_safetensors

    base = out.parent / (out.name + "-base")
    kda_layers = [i for i in range(WIDE_LAYERS) if (i + 1) % 4]
    write_small_checkpoint(base, hidden=64, heads=8, head_dim=16, conv_kernel=4, gate_rank=16,
                           num_layers=WIDE_LAYERS, kda_layers=kda_layers, style="k3",
                           a_log_len=16)
    src = SafetensorsSource(base)
    specs = []
    for name in src.names():
        t = src.get(name)
        data = np.array(t.data)
        specs.append((name, t.dtype, t.shape, data.nbytes, lambda data=data: data))
    empty = np.empty(0, np.uint8)
    for layer in range(WIDE_LAYERS):
        for e in range(WIDE_EXPERTS):
            for w in ("w1", "w2", "w3"):
                specs.append((f"language_model.model.layers.{layer}.mlp.experts.{e}.{w}.weight",
                              "BF16", (0, 64), 0, lambda: empty))
    out.mkdir(parents=True)
    weight_map, total = {}, 0
    per_file = -(-len(specs) // WIDE_FILES)
    for f in range(WIDE_FILES):
        file = f"model-{f + 1:05d}-of-{WIDE_FILES:05d}.safetensors"
        chunk = specs[f * per_file:(f + 1) * per_file]
        total += write_safetensors(out / file, chunk, sync=False)
        weight_map.update(dict.fromkeys((spec[0] for spec in chunk), file))
    write_index(out / "model.safetensors.index.json", weight_map, total, sync=False)
    shutil.copy(base / "config.json", out / "config.json")
    shutil.rmtree(base)
    return len(specs), WIDE_FILES


def section_wide(scratch: Path, reps: int) -> None:
    """Section 8: one rank's view of a checkpoint with K3's header width vs safetensors
    reading the same headers."""
    log("section 8: a Kimi-K3-wide header")
    ckpt = scratch / "k3-wide"
    names, files = write_k3_wide(ckpt)
    warm(ckpt)
    paths = sorted(ckpt.glob("*.safetensors"))
    rank, tp = 3, 8

    def via_safetensors():
        for path in paths:
            with safe_open(path, framework="np") as f:
                f.keys()

    def via_view():
        with kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=tp, qk_multiple=1) as view:
            view.keys()

    def via_reader():
        with SafetensorsSource(ckpt) as source:
            source.names()

    with kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=tp, qk_multiple=1) as view:
        kda_names = sum(view.is_sharded(n) for n in view.keys())
        layers = len(view.layers)
    t = best_interleaved({"safetensors": via_safetensors, "view": via_view,
                          "reader": via_reader}, reps)
    ratio = t["view"] / t["safetensors"]
    sec = f"8 K3-wide header TP={tp} r{rank}"
    row(sec, f"{names} names in {files} files, {layers} KDA layers ({kda_names} KDA tensors)",
        "", "", "tiny tensors: the cost is per name")
    row(sec, "safetensors safe_open + keys() of every file", f"{t['safetensors'] * 1e3:.1f}",
        "ms")
    row(sec, "kda_tp.SafetensorsSource open + names() + close (the Rust header reader)",
        f"{t['reader'] * 1e3:.1f}", "ms", f"reader/safetensors {t['reader'] / t['safetensors']:.2f}x")
    row(sec, "kda_tp.open_rank (header, config, plan, view) + keys()",
        f"{t['view'] * 1e3:.1f}", "ms", f"view/safetensors {ratio:.2f}x", "<= 2.00x",
        verdict(ratio <= 2.0))
    log(f"  view {t['view'] * 1e3:.1f} ms, reader {t['reader'] * 1e3:.1f} ms, safetensors "
        f"{t['safetensors'] * 1e3:.1f} ms, {ratio:.2f}x")
    wide_guard(ckpt, rank, tp, reps, via_safetensors)
    shutil.rmtree(ckpt)


def wide_guard(ckpt: Path, rank: int, tp: int, reps: int, read_headers) -> None:
    """Section 8, the guard: ``kda_tp.guard.check`` on one rank's vllm-0.33-k3 parameters of
    the K3-wide checkpoint vs reading its headers (safetensors) + copying the rank's bytes."""
    import logging

    from kda_tp.engines import get_layout, param_name
    from kda_tp.guard import check

    logging.getLogger("kda_tp.guard").setLevel(logging.WARNING)  # no pass line per call
    layout = get_layout("vllm-0.33-k3")
    with kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=tp, qk_multiple=1) as view:
        prefix = layout.state_dict_prefix(view.prefix)
        # What a BF16 engine's loader left in the rank's parameters.
        params = {param_name(prefix, layer, p.suffix):
                  view.build_param(layout, p.suffix, layer, model_dtype="BF16")
                  for layer, p in view.engine_params(layout)}
    nbytes = sum(a.nbytes for a in params.values())
    source = np.concatenate([a.reshape(-1).view(np.uint8) for a in params.values()])
    dst = np.ones(nbytes, np.uint8)  # prefaulted
    result = check(params, ckpt, tp_rank=rank, tp_size=tp, engine=layout.name)
    assert result is not None and result.passed, result

    def via_guard():
        check(params, ckpt, tp_rank=rank, tp_size=tp, engine=layout.name)

    def via_baseline():
        read_headers()
        np.copyto(dst, source)

    t = best_interleaved({"guard": via_guard, "baseline": via_baseline}, reps)
    ratio = t["guard"] / t["baseline"]
    sec = f"8 K3-wide header TP={tp} r{rank}"
    row(sec, f"guard: {len(params)} vllm-0.33-k3 parameters of rank {rank}, "
        f"{nbytes / 1e6:.1f} MB", "", "", "numpy parameters")
    row(sec, "safetensors header read + memcpy of the rank's parameter bytes",
        f"{t['baseline'] * 1e3:.1f}", "ms")
    row(sec, "kda_tp.guard.check (mode fail, passes)", f"{t['guard'] * 1e3:.1f}", "ms",
        f"guard/baseline {ratio:.2f}x", "<= 3.00x", verdict(ratio <= 3.0))
    log(f"  guard {t['guard'] * 1e3:.1f} ms, baseline {t['baseline'] * 1e3:.1f} ms, "
        f"{ratio:.2f}x")


def section_diagnosis(scratch: Path, reps: int) -> None:
    """Section 9: the audit of a garbage K3 rank (TP 8, one layer) vs the audit of the exact
    rank: the diagnosis stays within its budget."""
    import kda_tp
    from kda_tp.engines import get_layout

    log("section 9: the audit's diagnosis of a garbage rank")
    ckpt = scratch / "k3-diagnosis"
    write_checkpoint(ckpt, "kimi-k3", 1)
    warm(ckpt)
    src = SafetensorsSource(ckpt)
    rank, tp = 3, 8
    shard = KdaShardedSource(src, KdaTpPlan.from_config(src, rank, tp, qk_multiple=1))
    layout = get_layout("vllm-0.33-k3")
    prefix = next(n for n in src.names() if n.endswith("self_attn.A_log"))[: -len("A_log")]
    exact = {prefix + p.suffix: shard.build_param(layout, p.suffix, 0, model_dtype="BF16")
             for p in layout.params_for(shard.plan)}
    rng = np.random.default_rng(0)
    garbage = {n: rng.integers(0, 256, a.nbytes, np.uint8).view(a.dtype).reshape(a.shape)
               for n, a in exact.items()}
    nbytes = sum(a.nbytes for a in exact.values())
    good = kda_tp.audit(exact, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")
    bad = kda_tp.audit(garbage, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")
    assert good.passed and len(bad.failures) == len(exact), bad.summary()

    def via_exact():
        kda_tp.audit(exact, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")

    def via_garbage():
        kda_tp.audit(garbage, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")

    t = best_interleaved({"exact": via_exact, "garbage": via_garbage}, reps)
    ratio = t["garbage"] / t["exact"]
    sec = f"9 audit diagnosis K3 TP={tp} r{rank}"
    row(sec, f"one K3 KDA layer, rank {rank} of {tp}: {len(exact)} vllm-0.33-k3 parameters, "
        f"{nbytes / 1e6:.0f} MB", "", "", "numpy parameters, checkpoint mapped and warm")
    row(sec, "kda_tp.audit of the exact rank", f"{t['exact'] * 1e3:.1f}", "ms")
    row(sec, "kda_tp.audit of the rank filled with garbage (verdict + bounded diagnosis)",
        f"{t['garbage'] * 1e3:.1f}", "ms", f"garbage/exact {ratio:.2f}x", "<= 10.00x",
        verdict(ratio <= 10.0))
    log(f"  garbage {t['garbage'] * 1e3:.1f} ms, exact {t['exact'] * 1e3:.1f} ms, {ratio:.2f}x")
    del exact, garbage, src, shard
    shutil.rmtree(ckpt)


# ------------------------------------------------------------------------------------------------
# section 10: refusals of hostile command lines

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
    the largest against ``kda-tp --help`` in the same run (bounds: issue 21's 5 s, 600 MB)."""
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


def section_vllm_fused(src: SafetensorsSource, reps: int) -> None:
    """Section 6: vLLM's fused K3 ``in_proj_qkvgfab`` (q, k, v, g, f_a, b, zero rows to a
    multiple of 16) for rank 3 of 8, built by ``KdaShardedSource.build_param`` into a
    preallocated, prefaulted parameter, vs ``np.copyto`` of the same number of contiguous bytes
    of the same mapped file into the same buffer."""
    log("section 6: vLLM K3 in_proj_qkvgfab")
    layout, suffix = "vllm-0.33-k3", "in_proj_qkvgfab.weight"
    shard = KdaShardedSource(src, k3_plan(3, 8), layers=[0])
    plan = shard.param_plan(layout, suffix)
    param = np.ones(plan.nbytes, np.uint8)  # the loader's parameter, faulted in once
    source = src.get(K3_PREFIX + "q_proj.weight").data  # 176 MiB, mapped and pre-touched
    assert source.nbytes >= plan.nbytes

    def via_build():
        shard.build_param(layout, suffix, 0, param)

    def via_memcpy():
        np.copyto(param, source[: plan.nbytes])

    via_build()  # correctness: each part equals the rank's slice, the padding is zero
    for region in plan.regions:
        want = shard.get(K3_PREFIX + f"{region.part}.weight").data
        assert np.array_equal(param[region.byte_range[0] : region.byte_range[1]], want)
    assert plan.padding is not None and not param[plan.padding[0] :].any()
    t = best_interleaved({"build": via_build, "memcpy": via_memcpy}, reps)
    gbs = {k: plan.nbytes / v / 1e9 for k, v in t.items()}
    ratio = gbs["build"] / gbs["memcpy"]
    sec = "6 vLLM K3 TP=8 r3"
    row(sec, f"in_proj_qkvgfab {list(plan.shape)} BF16 ({plan.nbytes / 1e6:.0f} MB): "
        "6 parts + 4 zero rows", "", "", "into a preallocated, prefaulted parameter")
    row(sec, "plain memcpy of the same bytes", f"{gbs['memcpy']:.2f}", "GB/s")
    row(sec, "KdaShardedSource.build_param", f"{gbs['build']:.2f}", "GB/s",
        f"build/memcpy {ratio:.2f}x", ">= 0.85x", verdict(ratio >= 0.85))
    log(f"  build {gbs['build']:.2f}, memcpy {gbs['memcpy']:.2f} GB/s, {ratio:.2f}x")


# ------------------------------------------------------------------------------------------------
# section 2: zero-copy get()


def _copied(tensor, mappings, again) -> int:
    """0 if ``tensor.data`` lies inside a file mapping and shares memory with a second get."""
    data = tensor.data
    ptr = data.ctypes.data
    inside = any(lo <= ptr and ptr + data.nbytes <= hi for lo, hi in mappings)
    shared = np.shares_memory(data, again.data) if data.nbytes else True
    return 0 if (inside and shared) else data.nbytes


def section2(glm: Path, wide: Path, calls: int, loops: int) -> None:
    log("section 2: zero-copy get()")
    cases = []
    g_src = SafetensorsSource(glm)
    g_sh = KdaShardedSource(g_src, KdaTpPlan.from_config(g_src, 1, 4))
    w_src = SafetensorsSource(wide)
    w_sh = KdaShardedSource(w_src, KdaTpPlan.from_config(w_src, 1, 2))
    L = GLM_PREFIX
    # (group, label, source, mapping owner, name)
    cases = [
        ("plain", "SafetensorsSource.get q_proj", g_src, g_src, L + "q_proj.weight"),
        ("plain", "SafetensorsSource.get f_a_proj", g_src, g_src, L + "f_a_proj.weight"),
        ("rows", "KdaSharded.get q_proj rows TP4", g_sh, g_src, L + "q_proj.weight"),
        ("rows", "KdaSharded.get b_proj heads TP4", g_sh, g_src, L + "b_proj.weight"),
        ("repl", "KdaSharded.get f_a_proj repl TP2", w_sh, w_src, L + "f_a_proj.weight"),
        ("repl", "KdaSharded.get f_a_proj repl TP4", g_sh, g_src, L + "f_a_proj.weight"),
    ]
    times: dict[str, list[tuple[int, float]]] = {}
    for group, label, src, owner, name in cases:
        full = owner.get(name).nbytes
        t = src.get(name)
        copied = _copied(t, owner.mappings(), src.get(name))
        us = per_call_us(lambda: src.get(name), calls, loops)
        times.setdefault(group, []).append((full, us))
        row("2 get()", f"{label} (full {_size(full)}, out {_size(t.nbytes)})", f"{us:.1f}",
            "us/call", f"copied {copied} B", "0 B", verdict(copied == 0))
    for group, what in (("plain", "whole tensor"), ("rows", "row slice"), ("repl", "replicated")):
        (big, t_big), (small, t_small) = sorted(times[group], reverse=True)
        ratio = t_big / t_small
        row("2 get()", f"{what}: time/call {_size(big)} vs {_size(small)}", "", "",
            f"{ratio:.2f}x for {big / small:.0f}x bytes", "<= 2.00x", verdict(ratio <= 2.0))
    # contrast: safetensors np row slice of the same q_proj (copies)
    name = L + "q_proj.weight"
    plan = KdaTpPlan.from_config(g_src, 1, 4)["q_proj"]
    lo, k = plan.src_row_offset, plan.local_rows
    with safe_open(g_src.file_of(name), framework="np") as f:
        f.get_tensor(name)
        st_us = per_call_us(lambda: f.get_slice(name)[lo : lo + k], max(3, calls // 500), loops)
    kda_us = min(us for _, us in times["rows"])
    row("2 get()", f"safetensors np get_slice q_proj rows TP4 (out {_size(plan.local_bytes)})",
        f"{st_us:.1f}", "us/call", f"copied {plan.local_bytes} B; {st_us / kda_us:.0f}x kda get")


def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


# ------------------------------------------------------------------------------------------------
# sections 3-4: whole checkpoint


FRESH_ENV, FRESH_VALUE = "MALLOC_MMAP_THRESHOLD_", "1048576"
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


def verify_baseline(ckpt: Path, out: Path, tp: int, rank: int) -> None:
    src = SafetensorsSource(ckpt)
    sharded = KdaShardedSource(src, KdaTpPlan.from_config(src, rank, tp))
    got = SafetensorsSource(out / f"rank{rank}")
    assert sorted(got.names()) == sorted(sharded.names()), "baseline names differ"
    for name in sharded.names():
        a, b = sharded.get(name), got.get(name)
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a.data, b.data), name


def section3(ckpt: Path, scratch: Path, cli: Cli | None, rounds: int, quick: bool) -> None:
    tp = 4
    log(f"section 3: shard 4-layer GLM at TP={tp}, {rounds} round(s)")
    warm(ckpt)
    jobs = {}
    if cli is not None:
        jobs["kda"] = (cli.shard(ckpt, tp, None), scratch / "o_kda")
    jobs["st"] = ([sys.executable, str(BASELINE), str(ckpt), "--tp-size", str(tp), "--out"],
                  scratch / "o_st")
    jobs["cp"] = (["cp", "-r", str(ckpt)], scratch / "o_cp")
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for key, (cmd, out) in jobs.items():
            r = timed_job(cmd + [str(out)], out)
            log(f"  {key}: {r['wall']:.2f} s (+sync {r['durable']:.2f} s), "
                f"maxrss {r['maxrss'] / MIB:.0f} MiB, {r['bytes'] / 1e9:.2f} GB written")
            b = best.setdefault(key, dict(r))
            for field in ("wall", "durable"):
                b[field] = min(b[field], r[field])
            b["maxrss"] = max(b["maxrss"], r["maxrss"])
    pread = None
    if cli is not None and cli.has("--backend") and not quick:
        out = scratch / "o_pread"
        pread = timed_job(cli.shard(ckpt, tp, out, "--backend", "pread"), out)
        log(f"  kda --backend pread: {pread['wall']:.2f} s, maxrss {pread['maxrss'] / MIB:.0f} MiB")
        shutil.rmtree(out, ignore_errors=True)
    verify_baseline(ckpt, jobs["st"][1], tp, 1)
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    sec = f"3 shard TP={tp}"
    st, cp = best["st"], best["cp"]
    row(sec, f"input: 4-layer GLM-5.3, {size / 1e9:.2f} GB, warm cache", "", "",
        f"best of {rounds}")
    row(sec, "cp -r (I/O limit)", f"{cp['wall']:.2f}", "s",
        f"{size / cp['wall'] / 1e9:.2f} GB/s; +sync {cp['durable']:.2f} s")
    row(sec, "safetensors baseline (get_slice+save_file)", f"{st['wall']:.2f}", "s",
        f"+sync {st['durable']:.2f} s; RSS {st['maxrss'] / MIB:.0f} MiB; "
        f"wrote {st['bytes'] / 1e9:.2f} GB")
    if "kda" in best:
        k = best["kda"]
        row(sec, "kda-tp shard", f"{k['wall']:.2f}", "s",
            f"+sync {k['durable']:.2f} s; RSS {k['maxrss'] / MIB:.0f} MiB; "
            f"wrote {k['bytes'] / 1e9:.2f} GB")
        r_st, r_cp = st["wall"] / k["wall"], cp["wall"] / k["wall"]
        row(sec, "kda-tp speed vs safetensors baseline", "", "", f"{r_st:.2f}x", ">= 2.00x",
            verdict(r_st >= 2.0))
        row(sec, "kda-tp speed vs cp -r", "", "", f"{r_cp:.2f}x", ">= 0.80x", verdict(r_cp >= 0.8))
        bound = largest_tensor(ckpt) + 256 * MIB
        row(sec, "kda-tp shard peak RSS", f"{k['maxrss'] / MIB:.0f}", "MiB",
            "largest tensor + 256 MiB", f"< {bound / MIB:.0f} MiB", verdict(k["maxrss"] < bound))
        row(sec, "  same, both +sync (data on disk)", "", "",
            f"vs st {st['durable'] / k['durable']:.2f}x, vs cp {cp['durable'] / k['durable']:.2f}x")
        if pread is not None:
            row(sec, "  (info) kda-tp shard --backend pread, 1 run", f"{pread['wall']:.2f}", "s",
                f"+sync {pread['durable']:.2f} s; RSS {pread['maxrss'] / MIB:.0f} MiB; "
                f"vs st {st['wall'] / pread['wall']:.2f}x, vs cp {cp['wall'] / pread['wall']:.2f}x")
    else:
        row(sec, "kda-tp shard", "n/a", "", "CLI not available", ">= 2.00x / >= 0.80x", "n/a")
    for _, out in jobs.values():
        shutil.rmtree(out, ignore_errors=True)


def largest_tensor(ckpt: Path) -> int:
    """Bytes of the largest tensor of a checkpoint (from the headers)."""
    src = SafetensorsSource(ckpt)
    return max(int(np.prod(src.info(n)[1])) * (4 if src.info(n)[0] == "F32" else 2)
               for n in src.names())


def section4(scratch: Path, cli: Cli | None) -> None:
    tp = 4
    log("section 4: peak RSS vs checkpoint size")
    results = {}
    largest = 0
    for layers in (2, 8):
        ckpt = scratch / f"glm{layers}"
        log(f"  writing {layers}-layer checkpoint")
        write_checkpoint(ckpt, "glm-5.3-flash", layers)
        src = SafetensorsSource(ckpt)
        largest = max(largest, max(src.get(n).nbytes for n in src.names()))
        size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
        del src
        warm(ckpt)
        out = scratch / "o_rss"
        results[layers] = (size, None, None)
        if cli is not None:
            runs = []
            for extra in ([], ["--backend", "pread"]) if cli.has("--backend") else ([],):
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                runs.append(run_child(cli.shard(ckpt, tp, out, *extra), sample=True))
                log(f"  {layers} layers {' '.join(extra)}: "
                    f"maxrss {runs[-1]['maxrss'] / MIB:.0f} MiB")
                shutil.rmtree(out, ignore_errors=True)
            results[layers] = (size, runs[0], runs[1] if len(runs) > 1 else None)
        shutil.rmtree(ckpt, ignore_errors=True)
    bound = largest + 256 * MIB
    sec = f"4 RSS TP={tp}"
    for layers, (size, r, _) in results.items():
        if r is None:
            row(sec, f"kda-tp shard {layers} layers ({size / 1e9:.2f} GB)", "n/a", "",
                "CLI not available", f"< {bound / MIB:.0f} MiB", "n/a")
            continue
        row(sec, f"kda-tp shard {layers} layers ({size / 1e9:.2f} GB)", f"{r['maxrss'] / MIB:.0f}",
            "MiB", f"anon {r['RssAnon'] / MIB:.0f} + file {r['RssFile'] / MIB:.0f} MiB (sampled)",
            f"< {bound / MIB:.0f} MiB", verdict(r["maxrss"] < bound))
    if all(r is not None for _, r, _ in results.values()):
        growth = results[8][1]["maxrss"] / results[2][1]["maxrss"]
        row(sec, "peak RSS 8 layers / 2 layers", "", "", f"{growth:.2f}x for 4x the bytes")
    for layers, (size, _, p) in results.items():
        if p is not None:
            row(sec, f"  (info) same, --backend pread, {layers} layers", f"{p['maxrss'] / MIB:.0f}",
                "MiB", f"anon {p['RssAnon'] / MIB:.0f} + file {p['RssFile'] / MIB:.0f} MiB; "
                f"would {verdict(p['maxrss'] < bound)}")
    row(sec, f"bound = largest tensor {largest / MIB:.0f} MiB + 256 MiB", f"{bound / MIB:.0f}",
        "MiB")


# ------------------------------------------------------------------------------------------------


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kda_tp benchmark (see module docstring)")
    parser.add_argument("--quick", action="store_true",
                        help="fewer repetitions, no --backend pread run, skip section 4")
    parser.add_argument("--tmp", default="/tmp", help="scratch root (default /tmp)")
    parser.add_argument("--kda-tp", default=None, help="command that runs the kda-tp CLI")
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    parser.add_argument(
        "--fresh-pages", action="store_true",
        help=f"re-run under {FRESH_ENV}={FRESH_VALUE}: every allocation >= 1 MiB (kda_tp's, "
        "numpy's and memcpy's outputs alike) is a fresh mmap whose pages the copy faults in",
    )
    parser.add_argument(
        "--only", default=",".join(SECTIONS), metavar="NAMES",
        help="comma-separated sections to run: " + ", ".join(
            f"{k} ({v})" for k, v in SECTIONS.items()) + " (default: all)",
    )
    args = parser.parse_args(argv)
    only = set(args.only.split(","))
    if not only <= set(SECTIONS):
        parser.error(f"--only: unknown section(s) {', '.join(sorted(only - set(SECTIONS)))}; "
                     f"choose from {', '.join(SECTIONS)}")
    if args.fresh_pages and os.environ.get(FRESH_ENV) != FRESH_VALUE:
        argv = sys.argv[1:] if argv is None else argv
        env = dict(os.environ, **{FRESH_ENV: FRESH_VALUE})
        os.execve(sys.executable, [sys.executable, str(Path(__file__).resolve()), *argv], env)

    reps = 3 if args.quick else 10
    fresh_reps = 5 if args.quick else 15
    calls, loops = (2000, 3) if args.quick else (5000, 5)
    rounds = 1 if args.quick else 2
    t_start = time.perf_counter()
    cpu0 = cpu_seconds()
    print(machine())
    malloc = os.environ.get(FRESH_ENV)
    if malloc:
        print(f"malloc: {FRESH_ENV}={malloc} (outputs of that size or more on fresh pages)")
    else:
        print("malloc: glibc default (np.empty may reuse already-faulted heap memory)")
    print(f"mode: {'quick' if args.quick else 'full'} (section 1 best of {reps}, into fresh "
          f"memory median of {fresh_reps}; section 3 best of {rounds}; section 4 "
          f"{'skipped' if args.quick else 'run'}); sections {','.join(s for s in SECTIONS if s in only)}",
          flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="kda_tp_bench.", dir=args.tmp))
    try:
        glm = scratch / "glm4"
        cli = kda_cli(args)
        if only & {"start", "gather", "get", "shard"}:
            log("writing 4-layer GLM-5.3 checkpoint")
            write_checkpoint(glm, "glm-5.3-flash", 4)
            warm(glm)
        if "start" in only:
            section_start(glm, scratch, cli, 2 * reps)
        if "gather" in only:
            section1(glm, reps, fresh_reps)
        if "get" in only:
            wide = scratch / "wide"
            # one KDA layer whose replicated f_a_proj/g_a_proj are [4096, 8192] BF16 = 64 MiB
            write_small_checkpoint(wide, hidden=8192, heads=2, head_dim=128, conv_kernel=4,
                                   gate_rank=4096, num_layers=1, kda_layers=[0], style="glm")
            warm(wide)
            section2(glm, wide, calls, loops)
            shutil.rmtree(wide)
        if "shard" in only:
            section3(glm, scratch, cli, rounds, args.quick)
        shutil.rmtree(glm, ignore_errors=True)
        if "k3" in only:
            section_k3(scratch, reps)
        if "guard" in only:
            section_guard(scratch, reps, calls, loops)
        if "wide" in only:
            section_wide(scratch, reps)
        if "diagnosis" in only:
            section_diagnosis(scratch, reps)
        if "rss" in only and not args.quick:
            section4(scratch, cli)
        if "refuse" in only:
            section_refuse(scratch)
    finally:
        if args.keep:
            log(f"kept {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    return finish(t_start, cpu0)


def finish(t_start: float, cpu0: tuple[float, float]) -> int:
    """Print the table and the run's CPU and wall time."""
    print_table()
    print(foreign_cpu_line(cpu0, time.perf_counter() - t_start))
    print(f"total bench time {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
