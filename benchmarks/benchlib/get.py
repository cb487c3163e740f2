"""Section 2: zero-copy reads (``view[name]``, ``SafetensorsSource.get``) of row-sliced and
replicated tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors import safe_open

from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource

from .common import GLM_PREFIX, MIB, log, per_call_us, row, verdict


def _copied(tensor, mappings, again) -> int:
    """0 if ``tensor.data`` lies inside a file mapping and shares memory with a second get."""
    data = tensor.data
    ptr = data.ctypes.data
    inside = any(lo <= ptr and ptr + data.nbytes <= hi for lo, hi in mappings)
    shared = np.shares_memory(data, again.data) if data.nbytes else True
    return 0 if (inside and shared) else data.nbytes


def section2(glm: Path, wide: Path, calls: int, loops: int) -> None:
    log("section 2: zero-copy reads")
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
        ("rows", "view[name] q_proj rows TP4", g_sh, g_src, L + "q_proj.weight"),
        ("rows", "view[name] b_proj heads TP4", g_sh, g_src, L + "b_proj.weight"),
        ("repl", "view[name] f_a_proj repl TP2", w_sh, w_src, L + "f_a_proj.weight"),
        ("repl", "view[name] f_a_proj repl TP4", g_sh, g_src, L + "f_a_proj.weight"),
    ]
    times: dict[str, list[tuple[int, float]]] = {}
    for group, label, src, owner, name in cases:
        read = src.__getitem__ if isinstance(src, KdaShardedSource) else src.get
        full = owner.get(name).nbytes
        t = read(name)
        copied = _copied(t, owner.mappings(), read(name))
        us = per_call_us(lambda: read(name), calls, loops)
        times.setdefault(group, []).append((full, us))
        row("2 reads", f"{label} (full {_size(full)}, out {_size(t.nbytes)})", f"{us:.1f}",
            "us/call", f"copied {copied} B", "0 B", verdict(copied == 0))
    for group, what in (("plain", "whole tensor"), ("rows", "row slice"), ("repl", "replicated")):
        (big, t_big), (small, t_small) = sorted(times[group], reverse=True)
        ratio = t_big / t_small
        row("2 reads", f"{what}: time/call {_size(big)} vs {_size(small)}", "", "",
            f"{ratio:.2f}x for {big / small:.0f}x bytes", "<= 2.00x", verdict(ratio <= 2.0))
    # contrast: safetensors np row slice of the same q_proj (copies)
    name = L + "q_proj.weight"
    plan = KdaTpPlan.from_config(g_src, 1, 4)["q_proj"]
    lo, k = plan.src_row_offset, plan.local_rows
    with safe_open(g_src.file_of(name), framework="np") as f:
        f.get_tensor(name)
        st_us = per_call_us(lambda: f.get_slice(name)[lo : lo + k], max(3, calls // 500), loops)
    kda_us = min(us for _, us in times["rows"])
    row("2 reads", f"safetensors np get_slice q_proj rows TP4 (out {_size(plan.local_bytes)})",
        f"{st_us:.1f}", "us/call", f"copied {plan.local_bytes} B; {st_us / kda_us:.0f}x kda read")


def _size(n: int) -> str:
    return f"{n / MIB:.0f} MiB" if n >= MIB else f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"

