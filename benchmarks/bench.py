"""kda_tp benchmark: slicing throughput, zero-copy reads, and whole-checkpoint sharding.

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
   inherited): exit status 130, kda-tp's own ``kda-tp:`` line last (``demo``'s progress
   lines may come before it), no traceback (n/a when the command ended before the signal).
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
     ``view[name]`` (a ``KdaShardedSource``), numpy ``a[:, lo:hi].copy()`` (``a`` = the buffer viewed as
     uint16 [4096, 8192]), safetensors ``safe_open(file, framework="np").get_slice(name)[:,
     lo:hi]`` (BF16 via ml_dtypes; its own mapping of the same file, handle opened once), torch
     ``narrow(1, lo, w).contiguous()`` when torch is installed.
   Caches are evicted before every call (a read of twice the last-level cache). Figures are GB/s
   of output (1 GB = 1e9 bytes). Outputs are checked byte-equal before timing.
2. ``view[name]`` (and ``SafetensorsSource.get``) of row-sliced and replicated tensors, 64 MiB and 1 MiB class: time per call (us,
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
   ``full_rank_gate=True, a_log_len=128``); (b) ``view[name]`` then ``np.copyto``; (c) safetensors ``safe_open(..., "pt").get_slice(...)`` then
   ``param.copy_()`` (only when torch is installed); (d) ``np.copyto`` of the same number of
   contiguous bytes of each tensor. GB/s of local bytes.
6. vLLM's fused K3 parameter: ``in_proj_qkvgfab`` of rank 3 of 8 (q, k, v, g rows of the rank,
   f_a whole, b the rank's 12 heads, zero rows to a multiple of 16: [6288, 7168] BF16, 90 MB;
   layout ``vllm-0.33-k3``) built from the section-5 file by ``kda_tp.engines.build_param``
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
   same rank (``kda_tp.guard.UpdateSession`` on the rank's ``RankTarget``, built once per
   model: the layer's full checkpoint-format tensors fed through ``UpdateSession.wrap`` as an
   engine consumes them, each part verified against the parameter as it is applied, every
   region of the touched parameters checked at the end) against a single-thread memcpy of the
   rank's KDA bytes it touched (target: within 2x), with the extra host memory held (target: at
   most the rank's largest parameter); and a per-tensor refit (OpenRLHF's and TRL's one
   ``load_weights`` call per tensor): the layer's tensors among 6000 others (two experts' gate
   and up projections into each of 1500 parameters) into a torch stand-in of the engine's
   model whose ``load_weights`` does per call what vLLM's model class does
   (``dict(named_parameters())``, then each tensor's loader), through the guard's own hook
   (``kda_tp.guard.follow``, mode ``fail``) against without it, as a ratio (target: within
   1.2x; skipped without torch; no vLLM needed); and the K3 layer's refit alone into the same
   stand-in, in one ``load_weights`` call and one tensor per call, guarded against no plugin
   in the same run (goal: within 1.2x; every element of every touched parameter judged, by
   digests before and after).
   ``--only guard`` runs this section alone.
8. A Kimi-K3-wide header: 60 layers of which 45 KDA (K3's wrapper config and names, full-rank
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
9. The audit's diagnosis within its budget: the same K3 rank (TP 8, one layer, 7
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
   ``python -m kda_tp --help`` measured alongside (ratio for information); the targets are
   acceptance bounds, under 5 s and 600 MB each (``tests/checkpoint/test_malformed.py`` checks the one
   ``kda-tp: error:`` line and exit 2, not these bounds).

If the ``kda-tp shard`` CLI is not available, sections 3-4 print n/a for it (the baselines still
run). torch is optional. OPENBLAS/OMP settings are irrelevant (no BLAS is used).
Scratch data goes under ``--tmp`` and is removed at the end. The sections live in
``benchmarks/benchlib/`` (a module a section or two); this script parses the options and runs them.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchlib.common import cpu_seconds, foreign_cpu_line, log, machine, print_table, warm
from benchlib.diagnosis import section_diagnosis
from benchlib.gather import section1
from benchlib.get import section2
from benchlib.guard import section_guard
from benchlib.k3 import section_k3
from benchlib.procs import kda_cli
from benchlib.refuse import section_refuse
from benchlib.shard import section3, section4
from benchlib.start import section_start
from benchlib.wide import section_wide
from kda_tp.synth import write_checkpoint, write_small_checkpoint

# --only: the sections by name (numbers as in the module docstring)
SECTIONS = {"start": "0", "gather": "1", "get": "2", "shard": "3", "k3": "5, 6", "guard": "7",
            "wide": "8", "diagnosis": "9", "refuse": "10",
            "rss": "4"}
FRESH_ENV, FRESH_VALUE = "MALLOC_MMAP_THRESHOLD_", "1048576"


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
