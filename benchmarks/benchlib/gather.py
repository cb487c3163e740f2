"""Section 1: the ``o_proj`` column slice (the gather) into fresh and prefaulted memory,
against memcpy and other implementations."""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, shard_bytes

from .common import GLM_PREFIX, MIB, interleaved, log, row, torch, verdict


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
            "kda_get": lambda: sharded[name].data,
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

