"""Sections 3-4: ``kda-tp shard`` of a whole checkpoint against the safetensors baseline
and ``cp -r``; its peak RSS against checkpoint size."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.synth import write_checkpoint

from .common import BASELINE, MIB, log, row, verdict, warm
from .procs import Cli, run_child, timed_job


def verify_baseline(ckpt: Path, out: Path, tp: int, rank: int) -> None:
    src = SafetensorsSource(ckpt)
    sharded = KdaShardedSource(src, KdaTpPlan.from_config(src, rank, tp))
    got = SafetensorsSource(out / f"rank{rank}")
    assert sorted(got.names()) == sorted(sharded.names()), "baseline names differ"
    for name in sharded.names():
        a, b = sharded[name], got.get(name)
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

