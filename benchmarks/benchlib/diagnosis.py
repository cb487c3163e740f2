"""Section 9: the audit's diagnosis of a garbage K3 rank within its budget."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

import kda_tp

from .common import best_interleaved, log, row, verdict
from .k3 import k3_engine_rank, k3_rank_row


def section_diagnosis(scratch: Path, reps: int) -> None:
    """Section 9: the audit of a garbage K3 rank (TP 8, one layer) vs the audit of the exact
    rank: the diagnosis stays within its budget."""
    log("section 9: the audit's diagnosis of a garbage rank")
    ckpt = scratch / "k3-diagnosis"
    rank, tp = 3, 8
    src, exact = k3_engine_rank(ckpt, rank, tp)
    rng = np.random.default_rng(0)
    garbage = {n: rng.integers(0, 256, a.nbytes, np.uint8).view(a.dtype).reshape(a.shape)
               for n, a in exact.items()}
    good = kda_tp.audit.audit(exact, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")
    bad = kda_tp.audit.audit(garbage, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")
    assert good.passed and len(bad.failures) == len(exact), bad.summary()

    def via_exact():
        kda_tp.audit.audit(exact, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")

    def via_garbage():
        kda_tp.audit.audit(garbage, src, tp_rank=rank, tp_size=tp, model_dtype="BF16")

    t = best_interleaved({"exact": via_exact, "garbage": via_garbage}, reps)
    ratio = t["garbage"] / t["exact"]
    sec = f"9 audit diagnosis K3 TP={tp} r{rank}"
    k3_rank_row(sec, rank, tp, exact)
    row(sec, "kda_tp.audit of the exact rank", f"{t['exact'] * 1e3:.1f}", "ms")
    row(sec, "kda_tp.audit of the rank filled with garbage (verdict + bounded diagnosis)",
        f"{t['garbage'] * 1e3:.1f}", "ms", f"garbage/exact {ratio:.2f}x", "<= 10.00x",
        verdict(ratio <= 10.0))
    log(f"  garbage {t['garbage'] * 1e3:.1f} ms, exact {t['exact'] * 1e3:.1f} ms, {ratio:.2f}x")
    del exact, garbage, src
    shutil.rmtree(ckpt)


