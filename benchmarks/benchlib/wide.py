"""Section 8: one rank's view of a checkpoint with Kimi K3's header width, and the guard on
that rank, against safetensors reading the same headers."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open

import kda_tp
from kda_tp import SafetensorsSource
from kda_tp.synth import write_small_checkpoint

from .common import best_interleaved, log, row, verdict, warm

# Kimi K3's header width (layers, experts per layer, files).
WIDE_LAYERS, WIDE_EXPERTS, WIDE_FILES = 60, 384, 8


def write_k3_wide(out: Path) -> tuple[int, int]:
    """A checkpoint with Kimi K3's header width and tiny tensors: 60 layers, 45 of them KDA
    (every 4th MLA, K3's wrapper config and names, full-rank g_proj, padded A_log; 8 heads of
    16, hidden 64), plus 384 experts x 3 projections in every layer as zero-size tensors, in 8
    files with an index. Returns (tensor names, files)."""
    from kda_tp.checkpoint import write_index, write_safetensors

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

    from kda_tp.checkpoint.names import param_name
    from kda_tp.engines import build_param, engine_params, get_layout
    from kda_tp.guard import check

    logging.getLogger("kda_tp.guard").setLevel(logging.WARNING)  # no pass line per call
    layout = get_layout("vllm-0.33-k3")
    with kda_tp.open_rank(ckpt, tp_rank=rank, tp_size=tp, qk_multiple=1) as view:
        prefix = layout.state_dict_prefix(view.prefix)
        # What a BF16 engine's loader left in the rank's parameters.
        params = {param_name(prefix, layer, p.suffix):
                  build_param(view, layout, p.suffix, layer, model_dtype="BF16")
                  for layer, p in engine_params(view, layout)}
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

