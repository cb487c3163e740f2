"""Sections 5-6: one Kimi K3 KDA layer, a rank's whole layer into preallocated parameters,
and vLLM's fused ``in_proj_qkvgfab`` built by ``build_param``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
from safetensors import safe_open

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.engines import build_param, param_plan
from kda_tp.synth import write_checkpoint

from .common import best_interleaved, log, row, torch, verdict, warm


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
    from kda_tp.checkpoint import write_safetensors

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
                np.copyto(params[name], shard[name].data)

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
        row(sec, "view[name] then copy into the parameter", f"{gbs['get_copy']:.2f}", "GB/s",
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


def section_vllm_fused(src: SafetensorsSource, reps: int) -> None:
    """Section 6: vLLM's fused K3 ``in_proj_qkvgfab`` (q, k, v, g, f_a, b, zero rows to a
    multiple of 16) for rank 3 of 8, built by ``kda_tp.engines.build_param`` into a
    preallocated, prefaulted parameter, vs ``np.copyto`` of the same number of contiguous bytes
    of the same mapped file into the same buffer."""
    log("section 6: vLLM K3 in_proj_qkvgfab")
    layout, suffix = "vllm-0.33-k3", "in_proj_qkvgfab.weight"
    shard = KdaShardedSource(src, k3_plan(3, 8), layers=[0])
    plan = param_plan(shard, layout, suffix)
    param = np.ones(plan.nbytes, np.uint8)  # the loader's parameter, faulted in once
    source = src.get(K3_PREFIX + "q_proj.weight").data  # 176 MiB, mapped and pre-touched
    assert source.nbytes >= plan.nbytes

    def via_build():
        build_param(shard, layout, suffix, 0, param)

    def via_memcpy():
        np.copyto(param, source[: plan.nbytes])

    via_build()  # correctness: each part equals the rank's slice, the padding is zero
    for region in plan.regions:
        want = shard[K3_PREFIX + f"{region.part}.weight"].data
        assert np.array_equal(param[region.byte_range[0] : region.byte_range[1]], want)
    assert plan.padding is not None and not param[plan.padding[0] :].any()
    t = best_interleaved({"build": via_build, "memcpy": via_memcpy}, reps)
    gbs = {k: plan.nbytes / v / 1e9 for k, v in t.items()}
    ratio = gbs["build"] / gbs["memcpy"]
    sec = "6 vLLM K3 TP=8 r3"
    row(sec, f"in_proj_qkvgfab {list(plan.shape)} BF16 ({plan.nbytes / 1e6:.0f} MB): "
        "6 parts + 4 zero rows", "", "", "into a preallocated, prefaulted parameter")
    row(sec, "plain memcpy of the same bytes", f"{gbs['memcpy']:.2f}", "GB/s")
    row(sec, "kda_tp.engines.build_param", f"{gbs['build']:.2f}", "GB/s",
        f"build/memcpy {ratio:.2f}x", ">= 0.85x", verdict(ratio >= 0.85))
    log(f"  build {gbs['build']:.2f}, memcpy {gbs['memcpy']:.2f} GB/s, {ratio:.2f}x")



# ------------------------------------------------------------------------------------------------
# one K3 rank as an engine's loader left it (sections 7 and 9)


def k3_engine_rank(ckpt: Path, rank: int, tp: int,
                   touch: bool = False) -> tuple[SafetensorsSource, dict[str, np.ndarray]]:
    """Write one Kimi K3 KDA layer to ``ckpt`` (``synth.write_checkpoint(ckpt, "kimi-k3", 1)``),
    warm it, and build rank ``rank`` of ``tp``'s ``vllm-0.33-k3`` parameters as a BF16 engine's
    loader left them (the F32 o_norm cast to BF16 with the rest; a rank of mixed model dtypes is
    wrong). ``touch``: map every page of the checkpoint into this process first. Returns the
    checkpoint's source and {parameter name: numpy array}."""
    from kda_tp.engines import get_layout

    write_checkpoint(ckpt, "kimi-k3", 1)
    warm(ckpt)
    src = SafetensorsSource(ckpt)
    if touch:
        for name in src.names():
            int(src.get(name).data[::4096].sum())  # map every page into this process
    shard = KdaShardedSource(src, KdaTpPlan.from_config(src, rank, tp, qk_multiple=1))
    layout = get_layout("vllm-0.33-k3")
    prefix = next(n for n in src.names() if n.endswith("self_attn.A_log"))[: -len("A_log")]
    params = {prefix + p.suffix: build_param(shard, layout, p.suffix, 0, model_dtype="BF16")
              for p in layout.params_for(shard.plan)}
    return src, params


def k3_rank_row(sec: str, rank: int, tp: int, params: dict[str, np.ndarray]) -> None:
    """The table row that describes a rank of :func:`k3_engine_rank`."""
    nbytes = sum(a.nbytes for a in params.values())
    row(sec, f"one K3 KDA layer, rank {rank} of {tp}: {len(params)} vllm-0.33-k3 parameters, "
        f"{nbytes / 1e6:.0f} MB", "", "", "numpy parameters, checkpoint mapped and warm")
