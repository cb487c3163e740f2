"""Section 7: the guard (``kda_tp.guard.check``) and the refit check
(``kda_tp.guard.updates``) on one Kimi K3 rank; the guard on a non-KDA model."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from kda_tp import SafetensorsSource

from .common import best_interleaved, log, per_call_us, row, verdict
from .k3 import k3_engine_rank, k3_rank_row


def section_guard(scratch: Path, reps: int, calls: int, loops: int) -> None:
    """Section 7: the guard on one K3 rank (TP 8, one layer) vs a single-thread memcpy of the
    same bytes; the guard on a non-KDA model's parameters."""
    import logging

    from kda_tp.guard import check

    log("section 7: the guard")
    logging.getLogger("kda_tp.guard").setLevel(logging.WARNING)  # no pass line per call
    ckpt = scratch / "k3-guard"
    rank, tp = 3, 8
    src, params = k3_engine_rank(ckpt, rank, tp, touch=True)
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
    k3_rank_row(sec, rank, tp, params)
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
    (``kda_tp.guard.UpdateCheck``: fingerprints as each part is fed, this rank's
    slices kept as the trainer's full checkpoint-format tensors pass, every touched region
    compared at the end) vs a single-thread memcpy of the rank's KDA bytes the update touched."""
    from kda_tp.guard import UpdateCheck

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


