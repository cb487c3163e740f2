"""The engine layouts as Markdown tables: the tables of ``docs/engine-layouts.md``, kept current
by tests/engines/test_layouts.py (documentation tooling, not part of the package)."""

from __future__ import annotations

from typing import Any

from kda_tp.engines import LAYOUTS, EngineParam
from kda_tp.engines.derived import MLA_DERIVED
from kda_tp.engines.layout import CONFIG_DTYPE

# Each plan tensor's local shape in symbols, for the documentation tables only.
SYMBOLS = {
    "q_proj": ("Cl", "d"), "k_proj": ("Cl", "d"), "v_proj": ("Cl", "d"), "g_proj": ("Cl", "d"),
    "q_conv1d": ("Cl", "1", "K"), "k_conv1d": ("Cl", "1", "K"), "v_conv1d": ("Cl", "1", "K"),
    "f_a_proj": ("r", "d"), "g_a_proj": ("r", "d"), "f_b_proj": ("Cl", "r"),
    "g_b_proj": ("Cl", "r"), "b_proj": ("Hl", "d"), "A_log": ("Hl",), "dt_bias": ("Cl",),
    "o_norm": ("D",), "o_proj": ("d", "Cl"),
}

# An MLA layer's plan tensors (kda_tp.rank.MlaTpPlan), in the spec's symbols.
MLA_SYMBOLS = {
    "q_proj": ("Hl·(P+Pr)", "d"), "q_a_proj": ("Q", "d"), "q_a_layernorm": ("Q",),
    "q_b_proj": ("Hl·(P+Pr)", "Q"), "kv_a_proj_with_mqa": ("L+Pr", "d"),
    "kv_a_layernorm": ("L",), "kv_b_proj": ("Hl·(P+V)", "L"), "g_proj": ("Hl·V", "d"),
    "o_proj": ("d", "Hl·V"),
}


def symbolic_shape(param: EngineParam, symbols: dict[str, tuple[str, ...]] = SYMBOLS) -> str:
    if param.scale_of is not None:
        return "[Σ parts' block rows, column blocks]"
    if param.view is not None:
        return "[" + ", ".join("Hl" if d == -1 else str(d) for d in param.view) + "]"
    shapes = [symbols[p] for p in param.parts]
    if param.stacked:
        return f"[{len(shapes)}, {', '.join(shapes[0])}]"
    terms: list[list[Any]] = []
    for shape in shapes:  # equal neighbours merged: q, k, v -> 3·Cl
        if terms and terms[-1][1] == shape[0]:
            terms[-1][0] += 1
        else:
            terms.append([1, shape[0]])
    rows = " + ".join(f"{n}·{sym}" if n > 1 else sym for n, sym in terms)
    if param.pad_to > 1:
        rows = f"pad{param.pad_to}({rows})"
        if param.pad_to_fp8:
            rows += f" (FP8: pad{param.pad_to_fp8})"
    return f"[{', '.join((rows, *shapes[0][1:]))}]"


def made_of(param: EngineParam) -> str:
    if param.scale_of is not None:
        return f"the scale grids of `{param.scale_of}`'s parts, concatenated"
    parts = ", ".join(param.parts)
    if param.stacked:
        return f"stack({parts})"
    return f"concat({parts})" if len(param.parts) > 1 else parts


def layouts_markdown() -> str:
    """Every layout as Markdown tables (the tables of ``docs/engine-layouts.md``).

    Shapes use ``Cl`` (this rank's channels, ``Hl * D``), ``Hl`` (its heads), ``D`` (head_dim),
    ``d`` (hidden), ``r`` (gate rank, ``f_a_proj`` rows), ``K`` (conv kernel); ``padN(x)`` is
    ``x`` rounded up to a multiple of ``N`` with zero rows. MLA tables: ``Hl`` this rank's MLA
    heads, ``Q`` q_lora_rank, ``L`` kv_lora_rank, ``P``/``Pr`` the nope/rope head dims, ``V``
    v_head_dim.
    """
    out = []
    for layout in LAYOUTS.values():
        tp = "" if layout.tensor_parallel else " KDA is replicated: tp_size 1 only."
        out.append(f"### `{layout.name}`\n\n{layout.source}.{tp}\n")
        out.append("| parameter | made of | local shape | dtype |")
        out.append("| --- | --- | --- | --- |")
        for p in layout.params:
            dtype = ("config (model when none)" if p.dtype == CONFIG_DTYPE else p.dtype
                     or ("F32 (scales)" if p.scale_of else "model"))
            out.append(f"| `{p.suffix}` | {made_of(p)} | {symbolic_shape(p)} | {dtype} |")
        out.append("")
        if layout.mla:
            out.extend(_mla_table(layout))
    return "\n".join(out)


def _mla_table(layout: Any) -> list[str]:
    """A layout's MLA table: its parameters and the copies derived from ``kv_b_proj``."""
    out = [f"MLA layers: {layout.mla_source}.\n", "| MLA parameter | made of | local shape | dtype |",
           "| --- | --- | --- | --- |"]
    for p in layout.mla:
        name = f"`{p.suffix}`" + (f" (dump: `{p.dump_suffix}`)" if p.dump_suffix else "")
        out.append(f"| {name} | {made_of(p)} | {symbolic_shape(p, MLA_SYMBOLS)} | model |")
    copies = MLA_DERIVED.get(layout.name, {})
    if copies:
        first = next(iter(copies.values()))
        kind = "plain attributes" if first.attribute else "parameters"
        listed = ", ".join(f"`{n}` {d.shape}" for n, d in copies.items())
        out.append(f"\nDerived from the local `kv_b_proj`: {listed} ({kind}, built {first.built}).")
    out.append("")
    return out
