#!/usr/bin/env python3
"""Draw the documentation's pictures of the shard plan (docs/img/*.svg) from kda_tp itself.

Usage: python3 tools/pictures.py [OUT_DIR]   (default: docs/img of this checkout)

Every number in the pictures comes from the installed package: ``kda_tp.KdaTpPlan`` for one
rank after another (which rows or columns each rank keeps), ``kda_tp.rank.MlaTpPlan`` for an
MLA layer (its geometry from the family's synthetic config, ``kda_tp.synth.model_config``),
``kda_tp.synth.GEOMETRIES`` for the models' real geometries and ``kda_tp.engines`` for an engine's fused parameter; the picture of the
package's rooms from its files and tools/layers.py's order of them (``LAYERS``). The SVG is
written as plain text (no drawing library, no timestamps, integers and one-decimal floats), so
the same package draws the same bytes; tests/integration/test_pictures.py redraws them and compares.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from xml.sax.saxutils import escape

import kda_tp
from kda_tp import KdaShard, KdaTensorPlan, KdaTpPlan
from kda_tp.engines import get_layout
from kda_tp.model import parse_config, parse_mla_config
from kda_tp.rank import MlaTpPlan
# The synthetic config of a family's real geometry (its MLA keys included): the dialect synth
# writes, so the MLA picture's numbers come from the package as the KDA pictures' do.
from kda_tp.synth import GEOMETRIES, model_config
from layers import LAYERS  # tools/layers.py, beside this file

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "docs" / "img"

FONT = "DejaVu Sans, Verdana, Helvetica, Arial, sans-serif"
INK = "#222222"
MUTED = "#555555"
# Rank colours (Tableau 10), and the text colour readable on each.
RANKS = ("#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#e15759", "#76b7b2", "#edc948",
         "#9c755f")
ON_RANK = ("#ffffff", INK, "#ffffff", "#ffffff", "#ffffff", INK, INK, "#ffffff")
PAD_FILL = "url(#padding)"
EVERY_RANK = "url(#every-rank)"


def num(x: float) -> str:
    """A coordinate: an integer, or one decimal (deterministic, no exponent)."""
    text = f"{x:.1f}"
    return text[:-2] if text.endswith(".0") else text


def count(n: int) -> str:
    """An element or byte count with thousands separators."""
    return f"{n:,}"


def shape(dims: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


class Svg:
    """An SVG document built as text; ``height`` grows with what is drawn."""

    def __init__(self, width: int, title: str, ranks: int) -> None:
        self.width = width
        self.height = 0.0
        self.title = title
        self.ranks = ranks
        self.body: list[str] = []

    def _grow(self, y: float) -> None:
        self.height = max(self.height, y)

    def rect(self, x: float, y: float, w: float, h: float, fill: str, stroke: str | None = None,
             opacity: float | None = None) -> None:
        attrs = f'x="{num(x)}" y="{num(y)}" width="{num(w)}" height="{num(h)}" fill="{fill}"'
        if stroke:
            attrs += f' stroke="{stroke}" stroke-width="1"'
        if opacity is not None:
            attrs += f' fill-opacity="{num(opacity)}"'
        self.body.append(f"<rect {attrs}/>")
        self._grow(y + h)

    def line(self, x1: float, y1: float, x2: float, y2: float, stroke: str = INK,
             width: float = 1, dash: bool = False, arrow: bool = False) -> None:
        attrs = (f'x1="{num(x1)}" y1="{num(y1)}" x2="{num(x2)}" y2="{num(y2)}" '
                 f'stroke="{stroke}" stroke-width="{num(width)}"')
        if dash:
            attrs += ' stroke-dasharray="4 3"'
        if arrow:
            attrs += ' marker-end="url(#arrow)"'
        self.body.append(f"<line {attrs}/>")
        self._grow(max(y1, y2))

    def text(self, x: float, y: float, s: str, size: int = 13, anchor: str = "start",
             bold: bool = False, fill: str = INK, italic: bool = False) -> None:
        attrs = f'x="{num(x)}" y="{num(y)}" font-size="{size}"'
        if anchor != "start":
            attrs += f' text-anchor="{anchor}"'
        if bold:
            attrs += ' font-weight="bold"'
        if italic:
            attrs += ' font-style="italic"'
        if fill != INK:
            attrs += f' fill="{fill}"'
        self.body.append(f"<text {attrs}>{escape(s)}</text>")
        self._grow(y + size * 0.3)

    def legend(self, x: float, y: float, items: list[tuple[str, str]]) -> None:
        """Swatches with labels in one line from ``(x, y)`` (``y`` the swatches' top)."""
        left = x
        for fill, label in items:
            if x + 22 + text_width(label, 13) > self.width - 12:
                x, y = left, y + 24
            self.rect(x, y, 16, 16, fill, stroke=MUTED)
            self.text(x + 22, y + 12.5, label, size=13)
            x += 22 + text_width(label, 13) + 22

    def render(self) -> str:
        height = math.ceil(self.height + 16)
        stripes = "".join(
            f'<rect x="{4 * i}" y="0" width="4" height="{4 * self.ranks}" fill="{RANKS[i]}"/>'
            for i in range(self.ranks)
        )
        head = [
            '<svg xmlns="http://www.w3.org/2000/svg" '
            f'width="{self.width}" height="{height}" viewBox="0 0 {self.width} {height}" '
            f'font-family="{FONT}" role="img">',
            f"<title>{escape(self.title)}</title>",
            "<defs>",
            f'<pattern id="every-rank" width="{4 * self.ranks}" height="{4 * self.ranks}" '
            f'patternUnits="userSpaceOnUse" patternTransform="rotate(45)">{stripes}</pattern>',
            '<pattern id="padding" width="6" height="6" patternUnits="userSpaceOnUse" '
            'patternTransform="rotate(45)"><rect width="6" height="6" fill="#f2f2f2"/>'
            '<line x1="0" y1="0" x2="0" y2="6" stroke="#9a9a9a" stroke-width="1.5"/></pattern>',
            '<marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="7" '
            f'markerHeight="7" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
            f'fill="{MUTED}"/></marker>',
            "</defs>",
            f'<rect width="{self.width}" height="{height}" fill="#ffffff"/>',
        ]
        return "\n".join([*head, *self.body, "</svg>"]) + "\n"


def text_width(s: str, size: int) -> float:
    """A generous estimate of a DejaVu Sans line's width (pixels), for layout only."""
    return len(s) * size * 0.62


def plans(family: str, tp_size: int) -> list[KdaTpPlan]:
    """Every rank's plan of one KDA layer of ``family``'s real geometry (``kda_tp.synth``),
    with the dtypes its checkpoints store (K3: F32 convs, ``A_log`` zero-padded to 128)."""
    g = GEOMETRIES[family]
    options: dict[str, object] = {}
    if g["style"] == "k3":
        f32 = ("q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias", "o_norm")
        options = {"full_rank_gate": True, "a_log_len": max(g["heads"], g["head_dim"]),
                   "dtypes": dict.fromkeys(f32, "F32")}
    return [KdaTpPlan(rank, tp_size, g["hidden"], g["head_dim"], g["heads"], g["conv_kernel"],
                      g["gate_rank"], **options)  # type: ignore[arg-type]
            for rank in range(tp_size)]


def owned(t: KdaTensorPlan) -> tuple[int, int]:
    """``(start, stop)`` of the rank's part on the sharded axis (rows, or columns for
    CHANNEL_COLS), in elements of that axis."""
    if t.kind == KdaShard.CHANNEL_COLS:
        return t.src_col_offset, t.src_col_offset + t.local_row_elems
    return t.src_row_offset, t.src_row_offset + t.local_rows


# ------------------------------------------------------------------------------------------------
# (a) one KDA layer at TP 4: every tensor, every rank's rows or columns

def box_size(t: KdaTensorPlan) -> tuple[float, float]:
    """A tensor's box (width for columns, height for rows) on a log scale: not to scale, but
    the bigger axis looks bigger."""
    return 14 + 8 * math.log2(t.full_row_elems), 14 + 8.5 * math.log2(t.full_rows)


def draw_tensor(svg: Svg, x: float, y: float, per_rank: list[KdaTensorPlan],
                ticks: bool) -> None:
    """One tensor's box at ``(x, y)`` with every rank's part, and its labels below it."""
    t = per_rank[0]
    w, h = box_size(t)
    if t.kind == KdaShard.REPLICATED:
        svg.rect(x, y, w, h, EVERY_RANK)
    else:
        cols = t.kind == KdaShard.CHANNEL_COLS
        full = t.full_row_elems if cols else t.full_rows
        for rank, part in enumerate(per_rank):
            start, stop = owned(part)
            if cols:
                svg.rect(x + w * start / full, y, w * (stop - start) / full, h, RANKS[rank])
            else:
                svg.rect(x, y + h * start / full, w, h * (stop - start) / full, RANKS[rank])
        if t.kind == KdaShard.HEAD_ROWS:
            # one row per head: thin lines between the rows
            for row in range(1, full):
                svg.line(x, y + h * row / full, x + w, y + h * row / full, "#ffffff", 0.5)
        if ticks:
            edges = sorted({e for part in per_rank for e in owned(part)})
            for n, edge in enumerate(edges):
                if cols:  # labels on two levels: they would touch on one
                    lift = 12 * (n % 2)
                    svg.line(x + w * edge / full, y - 4 - lift, x + w * edge / full, y, MUTED)
                    svg.text(x + w * edge / full, y - 7 - lift, str(edge), 11, "middle",
                             fill=MUTED)
                else:
                    svg.line(x - 4, y + h * edge / full, x, y + h * edge / full, MUTED)
                    svg.text(x - 7, y + h * edge / full + 4, str(edge), 11, "end", fill=MUTED)
    svg.rect(x, y, w, h, "none", stroke=INK)
    svg.text(x, y + h + 17, t.name, 13, bold=True)
    svg.text(x, y + h + 33, shape(t.disk_shape), 12, fill=MUTED)


GAP = 22  # between two boxes of one kind
KIND_GAP = 44  # between two kinds on one line
LEFT = 60


def slot_width(t: KdaTensorPlan) -> float:
    return max(box_size(t)[0], text_width(t.name, 13), text_width(shape(t.disk_shape), 12))


def kind_heading(kind: KdaShard, p0: KdaTpPlan) -> tuple[str, str]:
    """A kind's heading and the rule it follows, with this geometry's numbers."""
    lc, lh = p0.local_heads * p0.head_dim, p0.local_heads
    c = p0.full_heads * p0.head_dim
    return {
        KdaShard.CHANNEL_ROWS: ("CHANNEL_ROWS: rows are channels",
                                f"rank r keeps rows [{lc}r, {lc}(r+1)), its {lh} heads' channels"),
        KdaShard.HEAD_ROWS: ("HEAD_ROWS: rows are heads",
                             f"rank r keeps rows [{lh}r, {lh}(r+1))"),
        KdaShard.REPLICATED: ("REPLICATED", "every rank keeps all"),
        KdaShard.CHANNEL_COLS: ("CHANNEL_COLS: columns are channels",
                                f"rank r keeps columns [{lc}r, {lc}(r+1)) of {c}"),
    }[kind]


def picture_plan(family: str = "kimi-linear", tp_size: int = 4) -> str:
    """(a) Every KDA tensor of one layer, each rank's rows or columns in its colour."""
    ranks = plans(family, tp_size)
    p0 = ranks[0]
    c = p0.full_heads * p0.head_dim
    svg = Svg(820, f"What each rank keeps of one Kimi-Linear KDA layer at TP {tp_size}", tp_size)
    svg.text(20, 30, f"One Kimi-Linear KDA layer at TP {tp_size}: what each rank keeps", 18,
             bold=True)
    svg.text(20, 52, f"hidden {p0.hidden}, {p0.full_heads} heads of {p0.head_dim} "
             f"(C = {c} channels), conv {p0.conv_kernel}, gate rank {p0.gate_rank}", 13,
             fill=MUTED)
    svg.text(20, 70, "Each box is a tensor's on-disk [rows, columns] matrix, its sides on a log "
             "scale; the ranks' parts are to scale.", 13, fill=MUTED)
    svg.legend(20, 84, [(RANKS[r], f"rank {r}") for r in range(tp_size)]
               + [(EVERY_RANK, "every rank (replicated)")])

    order = [KdaShard.CHANNEL_ROWS, KdaShard.HEAD_ROWS, KdaShard.REPLICATED,
             KdaShard.CHANNEL_COLS]
    # Lines of (kind, first line of the kind, tensor indices); a kind wraps at the width.
    lines: list[list[tuple[KdaShard, bool, list[int]]]] = [[]]
    x = float(LEFT)
    for kind in order:
        heading = max(text_width(s, 13) for s in kind_heading(kind, p0))
        first = True
        for i, t in enumerate(p0.tensors):
            if t.kind != kind:
                continue
            need = slot_width(t)
            if first:
                need = max(need, heading)
            opening = not lines[-1] or lines[-1][-1][0] != kind
            if x + need + (KIND_GAP if opening and lines[-1] else 0) > svg.width - 12 \
                    and lines[-1]:
                lines.append([])
                x = float(LEFT)
                opening = True
            if opening:
                x += KIND_GAP if lines[-1] else 0
                lines[-1].append((kind, first, []))
                first = False
            lines[-1][-1][2].append(i)
            x += slot_width(t) + GAP
        del heading
    y = 150.0
    for line in lines:
        x = float(LEFT)
        tallest = max(box_size(p0.tensors[i])[1] for _, _, idx in line for i in idx)
        top = y + 58
        for n, (kind, first, idx) in enumerate(line):
            if n:
                x += KIND_GAP - GAP
            title, rule = kind_heading(kind, p0)
            head_x = x - 40 if kind in (KdaShard.CHANNEL_ROWS, KdaShard.HEAD_ROWS) else x
            if first:
                svg.text(head_x, y, title, 13, bold=True)
                svg.text(head_x, y + 17, rule, 12, fill=MUTED)
            else:  # a kind continued from the line above: its name again, or its tensors
                # would stand under the next kind's heading
                title = f"{kind.name} (continued)"
                svg.text(head_x, y, title, 13, bold=True)
            start = x
            for j, i in enumerate(idx):
                t = p0.tensors[i]
                per_rank = [p.tensors[i] for p in ranks]
                box_top = top + tallest - box_size(t)[1]  # boxes stand on one line
                draw_tensor(svg, x, box_top, per_rank, ticks=j == 0)
                x += slot_width(t) + GAP
            if first:
                x = max(x, start + text_width(rule, 12) + GAP)
            else:
                x = max(x, head_x + text_width(title, 13) + GAP)
        y = top + tallest + 33 + 36
    local, full = p0.local_bytes, p0.full_bytes
    svg.text(20, y - 4, f"Each rank keeps {p0.local_heads} of {p0.full_heads} heads: "
             f"{count(local)} of {count(full)} bytes of the layer ({100 * local / full:.1f}%).",
             13)
    svg.text(20, y + 14, "o_proj is row-parallel: each rank's output is a partial sum, "
             "all-reduced (sum) after it.", 13)
    return svg.render()


# ------------------------------------------------------------------------------------------------
# (a') one MLA layer of a hybrid at TP 4, beside the KDA layer


def mla_plans(family: str, tp_size: int) -> list[MlaTpPlan]:
    """Every rank's plan of one MLA layer of ``family``'s real geometry: its synthetic
    config's MLA keys (``kda_tp.synth``), read as kda-tp reads a config."""
    config = model_config(family, 4, 64)
    mla = parse_mla_config(config, parse_config(config))
    assert mla is not None and 3 in mla.layers  # layer 3 is MLA
    return [MlaTpPlan.from_mla_config(mla, rank, tp_size) for rank in range(tp_size)]


def picture_mla(family: str = "kimi-k3", tp_size: int = 4) -> str:
    """(a') Every tensor of one MLA layer, each rank's rows or columns in its colour: the
    heads' blocks of the up-projections and o_proj, the latents and norms on every rank."""
    ranks = mla_plans(family, tp_size)
    p0 = ranks[0]
    display = {"kimi-k3": "Kimi K3"}.get(family, family)
    svg = Svg(820, f"What each rank keeps of one {display} MLA layer at TP {tp_size}", tp_size)
    svg.text(20, 30, f"One {display} MLA layer at TP {tp_size}: what each rank keeps", 18,
             bold=True)
    q = "no q-LoRA" if p0.q_lora_rank is None else f"Q {p0.q_lora_rank}"
    svg.text(20, 52, f"hidden {p0.hidden}, {p0.heads} heads (num_attention_heads), {q}, "
             f"L {p0.kv_lora_rank}, P {p0.qk_nope_head_dim}, Pr {p0.qk_rope_head_dim}, "
             f"V {p0.v_head_dim}" + (", output gate" if p0.output_gate else ""), 13, fill=MUTED)
    svg.text(20, 70, "Each box is a tensor's on-disk [rows, columns] matrix, its sides on a log "
             "scale; the ranks' parts are to scale.", 13, fill=MUTED)
    svg.legend(20, 84, [(RANKS[r], f"rank {r}") for r in range(tp_size)]
               + [(EVERY_RANK, "every rank (replicated)")])
    hl = p0.local_heads
    per_head = {t.name: (t.local_rows if t.kind == KdaShard.CHANNEL_ROWS
                         else t.local_row_elems) // hl
                for t in p0.tensors if t.kind != KdaShard.REPLICATED}
    groups = [
        (KdaShard.CHANNEL_ROWS, "CHANNEL_ROWS: rows are heads' blocks",
         "rank r keeps its " + str(hl) + " heads' rows: "
         + ", ".join(f"{n} {per_head[n]} a head" for n in per_head if n != "o_proj")),
        (KdaShard.REPLICATED, "REPLICATED: the latents and their norms", "every rank keeps all"),
        (KdaShard.CHANNEL_COLS, "CHANNEL_COLS: columns are heads' values",
         f"rank r keeps columns [{hl * per_head['o_proj']}r, {hl * per_head['o_proj']}(r+1))"),
    ]
    y = 150.0
    for kind, title, rule in groups:
        idx = [i for i, t in enumerate(p0.tensors) if t.kind == kind]
        tallest = max(box_size(p0.tensors[i])[1] for i in idx)
        svg.text(LEFT - 40, y, title, 13, bold=True)
        svg.text(LEFT - 40, y + 17, rule, 12, fill=MUTED)
        top, x = y + 58, float(LEFT)
        for j, i in enumerate(idx):
            t = p0.tensors[i]
            draw_tensor(svg, x, top + tallest - box_size(t)[1], [p.tensors[i] for p in ranks],
                        ticks=j == 0)
            x += slot_width(t) + GAP
        y = top + tallest + 33 + 36
    local, full = p0.local_bytes, p0.full_bytes
    svg.text(20, y - 4, f"Each rank keeps {hl} of {p0.heads} MLA heads: {count(local)} of "
             f"{count(full)} bytes of the layer ({100 * local / full:.1f}%).", 13)
    svg.text(20, y + 14, "g_proj and o_proj have the KDA layer's names and shapes: the layer "
             "type comes from the config.", 13)
    return svg.render()


# ------------------------------------------------------------------------------------------------
# (b) o_proj: a strided column gather, against a row slice


def label_box(svg: Svg, x: float, y: float, s: str, size: int = 12) -> None:
    """Text centred on ``(x, y)`` on a white box, readable over any fill."""
    w = text_width(s, size) * 0.92 + 8
    svg.rect(x - w / 2, y - size * 0.85, w, size * 1.35, "#ffffff", opacity=0.9)
    svg.text(x, y + size * 0.35, s, size, "middle")


def picture_o_proj(family: str = "kimi-linear", tp_size: int = 4, rank: int = 1) -> str:
    """(b) One rank's o_proj columns gathered from every row, against q_proj's one range."""
    ranks = plans(family, tp_size)
    o = ranks[rank]["o_proj"]
    q = ranks[rank]["q_proj"]
    eb = o.elem_bytes
    row_bytes = o.full_row_elems * eb
    span = o.local_row_elems * eb
    colour = RANKS[rank]
    svg = Svg(820, f"o_proj at TP {tp_size}: a strided column gather", tp_size)
    svg.text(20, 30, f"o_proj at TP {tp_size}: rank {rank} gathers columns from every row", 18,
             bold=True)
    svg.text(20, 52, f"Kimi-Linear's o_proj {shape(o.disk_shape)} {o.dtype} is row-parallel: "
             f"rank r keeps columns [{o.local_row_elems}r, {o.local_row_elems}(r+1)) of every "
             "row,", 13, fill=MUTED)
    svg.text(20, 70, "and its output is a partial sum, all-reduced. Every other sliced tensor "
             "keeps a range of rows.", 13, fill=MUTED)

    # the matrices: full o_proj with the rank's columns, and the rank's local matrix
    x0, y0, w, h = 90.0, 118.0, 256.0, 150.0
    full = o.full_row_elems
    for r, p in enumerate(ranks):
        start, stop = owned(p["o_proj"])
        svg.rect(x0 + w * start / full, y0, w * (stop - start) / full, h, RANKS[r],
                 opacity=1 if r == rank else 0.25)
    svg.rect(x0, y0, w, h, "none", stroke=INK)
    for edge in sorted({e for p in ranks for e in owned(p["o_proj"])}):
        svg.line(x0 + w * edge / full, y0 - 4, x0 + w * edge / full, y0, MUTED)
        svg.text(x0 + w * edge / full, y0 - 7, str(edge), 11, "middle", fill=MUTED)
    svg.text(x0 + w / 2, y0 - 24, f"o_proj on disk {shape(o.disk_shape)}: columns", 12,
             "middle", fill=MUTED)
    svg.text(x0 - 8, y0 + h / 2 + 4, f"{o.full_rows} rows", 12, "end", fill=MUTED)
    lx = x0 + w + 110
    lw = w * o.local_row_elems / full
    svg.line(x0 + w + 12, y0 + h / 2, lx - 10, y0 + h / 2, MUTED, 1.5, arrow=True)
    svg.rect(lx, y0, lw, h, colour, stroke=INK)
    svg.text(lx + lw + 12, y0 + 40, f"rank {rank}'s o_proj {shape(o.local_shape(o.disk_shape))}",
             13, bold=True)
    svg.text(lx + lw + 12, y0 + 58, f"columns {o.src_col_offset}..{o.src_col_offset + o.local_row_elems} "
             "of every row,", 13)
    svg.text(lx + lw + 12, y0 + 76, "contiguous in its own memory", 13)

    # the bytes: the file row after row, and the rank's buffer
    y = y0 + h + 56
    svg.text(20, y, f"In the file (row-major), each row is {count(row_bytes)} bytes; rank {rank} "
             f"copies {count(span)} bytes from each of the {count(o.full_rows)} rows:", 13,
             bold=True)
    cell = 38.0  # one rank's columns of one row
    shown = [0, 1, 2, o.full_rows - 1]
    sx, sy = 20.0, y + 28
    dy = sy + 92
    dest_x = sx + 140
    xs = sx
    for k, row in enumerate(shown):
        if k == len(shown) - 1:
            svg.text(xs + 12, sy + 17, "...", 14, "middle")
            xs += 26
        for r, p in enumerate(ranks):
            svg.rect(xs + cell * r, sy, cell, 24, RANKS[r], opacity=1 if r == rank else 0.25)
        svg.rect(xs, sy, cell * tp_size, 24, "none", stroke=INK)
        svg.line(xs, sy - 3, xs, sy + 27, INK, 1.5)  # where a row starts
        svg.text(xs + cell * tp_size / 2, sy - 5, f"row {row}", 11, "middle", fill=MUTED)
        # to the rank's buffer
        dx = dest_x + cell * (k if k < len(shown) - 1 else k + 0.7)
        svg.line(xs + cell * (rank + 0.5), sy + 24, dx + cell / 2, dy - 2, colour, 1.2)
        svg.rect(dx, dy, cell, 24, colour, stroke=INK)
        svg.text(dx + cell / 2, dy + 40, f"row {row}", 11, "middle", fill=MUTED)
        xs += cell * tp_size
    svg.text(dest_x + cell * 3 + 13, dy + 17, "...", 14, "middle")
    svg.text(20, dy + 17, f"rank {rank}'s buffer", 13, bold=True)
    svg.text(dest_x + cell * 5 + 20, dy + 11, f"{count(o.full_rows)} spans of {count(span)} "
             f"bytes, one every {count(row_bytes)}:", 12)
    svg.text(dest_x + cell * 5 + 20, dy + 27, f"{count(o.local_bytes)} bytes, "
             f"shape {shape(o.local_shape(o.disk_shape))}", 12)

    # q_proj: one range
    y = dy + 84
    lo, hi = q.byte_range or (0, 0)
    svg.text(20, y, f"q_proj {shape(q.disk_shape)} (CHANNEL_ROWS): rank {rank} keeps one "
             f"range, bytes {count(lo)}..{count(hi)}:", 13, bold=True)
    qy = y + 14
    qw = 600.0
    for r, p in enumerate(ranks):
        a, b = p["q_proj"].byte_range or (0, 0)
        svg.rect(20 + qw * a / q.full_bytes, qy, qw * (b - a) / q.full_bytes, 24, RANKS[r],
                 opacity=1 if r == rank else 0.25)
        svg.text(20 + qw * (a + b) / 2 / q.full_bytes, qy + 17, f"rank {r}", 12, "middle",
                 fill=ON_RANK[r] if r == rank else INK)
    svg.rect(20, qy, qw, 24, "none", stroke=INK)
    bad = o.full_rows // tp_size
    svg.text(20, qy + 56, f"A row slice of o_proj (rows {bad * rank}..{bad * (rank + 1)}) "
             f"has the same size, {count(o.local_bytes)} bytes, and the wrong numbers:", 13)
    svg.text(20, qy + 74, "the byte check (verify) and the numeric check (verify --numeric) "
             "both tell them apart.", 13)
    return svg.render()


# ------------------------------------------------------------------------------------------------
# (c) Kimi K3's zero-padded A_log


def picture_k3_a_log(tp_size: int = 8) -> str:
    """(c) K3's A_log: 96 heads in 128 stored entries; each rank's heads, the padding no
    rank's; against an even split of the 128 entries."""
    ranks = plans("kimi-k3", tp_size)
    a = ranks[0]["A_log"]
    stored, heads = a.full_rows, ranks[0].full_heads
    svg = Svg(820, f"Kimi K3's zero-padded A_log at TP {tp_size}", tp_size)
    svg.text(20, 30, f"Kimi K3's A_log at TP {tp_size}: {heads} heads in {stored} stored "
             "entries", 18, bold=True)
    svg.text(20, 52, f"A_log {shape(a.disk_shape)} {a.dtype}: entries 0..{heads - 1} are the "
             f"heads, {heads}..{stored - 1} zero padding (checked to be zero before use).", 13,
             fill=MUTED)
    svg.legend(20, 66, [(RANKS[r], f"rank {r}") for r in range(tp_size)]
               + [(PAD_FILL, "zero padding")])
    cell = 6.0
    x0 = 20.0

    def strip(y: float, parts: list[tuple[int, int]], title: str, below: bool) -> None:
        svg.text(x0, y - 28 if not below else y - 10, title, 13, bold=True)
        for i in range(stored):
            owner = next((r for r, (lo, hi) in enumerate(parts) if lo <= i < hi), None)
            fill = RANKS[owner] if owner is not None else PAD_FILL
            svg.rect(x0 + cell * i, y, cell, 30, fill)
        for i in range(1, stored):
            svg.line(x0 + cell * i, y, x0 + cell * i, y + 30, "#ffffff", 0.4)
        svg.rect(x0, y, cell * stored, 30, "none", stroke=INK)
        edges = sorted({e for part in parts for e in part} | {stored})
        for e in edges:
            ty = y + 30 if below else y
            svg.line(x0 + cell * e, ty, x0 + cell * e, ty + (5 if below else -5), MUTED)
            svg.text(x0 + cell * e, ty + 17 if below else ty - 8, str(e), 11, "middle",
                     fill=MUTED)

    mine = [owned(p["A_log"]) for p in ranks]
    strip(160, mine, f"kda_tp: rank r keeps entries [{mine[1][0]}r, {mine[1][0]}(r+1)), "
          f"its {ranks[0].local_heads} heads; the padding is no rank's", False)
    label_box(svg, x0 + cell * (heads + stored) / 2, 175, "no rank's")
    even = stored // tp_size
    parts = [(even * r, even * (r + 1)) for r in range(tp_size)]
    strip(250, parts, f"An even split of the {stored} entries (wrong): {even} per rank", True)
    wrong = [r for r, (lo, hi) in enumerate(parts) if hi > heads]
    lh = ranks[0].local_heads
    svg.text(x0, 324, f"Each rank would get {even} entries for its {lh} heads: rank 1 entries "
             f"{parts[1][0]}..{parts[1][1] - 1}, heads of ranks {parts[1][0] // lh} and "
             f"{(parts[1][1] - 1) // lh} (its own are {mine[1][0]}..{mine[1][1] - 1});", 13)
    svg.text(x0, 342, f"ranks {' and '.join(map(str, wrong))} get padding as decay rates: "
             "kda_tp never plans this; verify --numeric catches it.", 13)
    return svg.render()


# ------------------------------------------------------------------------------------------------
# (d) an engine's fused parameter: vLLM 0.33's K3 in_proj_qkvgfab


def picture_fused(layout_name: str = "vllm-0.33-k3", suffix: str = "in_proj_qkvgfab.weight",
                  family: str = "kimi-k3", tp_size: int = 4) -> str:
    """(d) One fused parameter on every rank: its parts, each from the rank's rows of a
    checkpoint tensor (or all of a replicated one), and the zero rows."""
    layout = get_layout(layout_name)
    ranks = plans(family, tp_size)
    fused = [layout.param_plan(suffix, p) for p in ranks]
    f0 = fused[0]
    param = layout.param(suffix)
    rows = f0.shape[0]
    used = f0.regions[-1].rows[1]
    svg = Svg(820, f"{layout.engine} {layout.version}'s {suffix} for Kimi K3 at TP {tp_size}",
              tp_size)
    svg.text(20, 30, f"vLLM {layout.version}, Kimi K3 at TP {tp_size}: {suffix}", 18, bold=True)
    svg.text(20, 52, f"One parameter per rank, {shape(f0.shape)} {f0.dtype}: the parts "
             "concatenated on dim 0, then zero rows up to a", 13, fill=MUTED)
    svg.text(20, 70, f"multiple of {param.pad_to} ({used} -> {rows} rows). Heights are not to "
             "scale; the row numbers are.", 13, fill=MUTED)
    svg.legend(20, 84, [(RANKS[r], f"rank {r}") for r in range(tp_size)]
               + [(EVERY_RANK, "every rank"), (PAD_FILL, "zero rows")])

    def height(n: int) -> float:
        return 20 + 5 * math.log2(n)

    x0, y0, col, gap = 200.0, 150.0, 132.0, 16.0
    segments = [(reg.part, reg.rows) for reg in f0.regions] + [("zero", (used, rows))]
    for k in range(tp_size):
        svg.text(x0 + (col + gap) * k + col / 2, y0 - 10, f"rank {k}", 13, "middle", bold=True)
    y = y0
    for part, (lo, hi) in segments:
        h = height(hi - lo)
        svg.text(x0 - 12, y + h / 2 - 2, part if part != "zero" else "zero rows", 13, "end",
                 bold=True)
        svg.text(x0 - 12, y + h / 2 + 13, f"rows {lo}..{hi}", 11, "end",
                 fill=MUTED)
        for k, p in enumerate(ranks):
            x = x0 + (col + gap) * k
            if part == "zero":
                svg.rect(x, y, col, h, PAD_FILL)
                label = "0"
            else:
                t = p[part]
                if t.kind == KdaShard.REPLICATED:
                    svg.rect(x, y, col, h, EVERY_RANK)
                    label = f"{part}, all {t.full_rows} rows"
                else:
                    a, b = owned(t)
                    svg.rect(x, y, col, h, RANKS[k])
                    label = f"{part}[{a}:{b}]"
            svg.rect(x, y, col, h, "none", stroke=INK)
            if part == "zero" or p.get(part) is not None and p[part].kind == KdaShard.REPLICATED:
                label_box(svg, x + col / 2, y + h / 2, label, 11)
            else:
                svg.text(x + col / 2, y + h / 2 + 4, label, 11, "middle", fill=ON_RANK[k])
        y += h
    svg.text(20, y + 30, f"Each rank's q, k, v and g parts are its {ranks[0].local_heads} heads' "
             f"{ranks[0].local_heads * ranks[0].head_dim} channels; f_a_proj is whole on every "
             "rank (vLLM loads", 13)
    svg.text(20, y + 48, "rank 0's shard of it everywhere); b_proj is the rank's heads. "
             "kda_tp.engines.build_param fills it in one call.", 13)
    return svg.render()


def package_rooms() -> dict[str, list[str]]:
    """The installed package's rooms: each folder with its modules (``__init__`` is its face),
    and each module at the root a room of its own."""
    root = Path(kda_tp.__file__).parent
    rooms: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if "__pycache__" in parts or parts == ("__init__",):
            continue
        if len(parts) == 1:
            rooms[parts[0]] = []
        else:
            rooms.setdefault(parts[0], []).append(".".join(parts[1:]).replace("__init__", "face"))
    return rooms


def wrapped(words: list[str], width: float, size: int) -> list[str]:
    """``words`` joined with commas into lines of at most ``width`` pixels."""
    lines: list[str] = []
    for word in words:
        if lines and text_width(lines[-1] + ", " + word, size) <= width:
            lines[-1] += ", " + word
        else:
            lines.append(word)
    return lines


def picture_house() -> str:
    """(e) The package's rooms on their floors: each imports only rooms on the floors below."""
    rooms = package_rooms()
    svg = Svg(1000, "kda_tp's rooms (folders and root modules) on their floors", 1)
    svg.text(20, 24, "kda_tp: the package face (__init__: open_rank, describe, KdaTpPlan, the "
             "errors, ...) imports every room on first use", 13, bold=True)
    y = 44.0
    for floor, names in enumerate(LAYERS):
        gap = 12
        width = (1000 - 40 - gap * (len(names) - 1)) / len(names)
        lines = {n: wrapped(rooms.get(n, []), width - 16, 11) for n in names}
        height = 30 + 14 * max(len(v) for v in lines.values())
        svg.text(8, y + 18, str(len(LAYERS) - floor), 12, fill=MUTED)
        for i, name in enumerate(names):
            x = 20 + i * (width + gap)
            folder = bool(rooms.get(name))
            svg.rect(x, y, width, height, "#eef3f8" if folder else "#f7f7f7", stroke=MUTED)
            svg.text(x + 8, y + 18, f"{name}/" if folder else f"{name}.py", 13, bold=True)
            for j, line in enumerate(lines[name]):
                svg.text(x + 8, y + 34 + 14 * j, line, 11, fill=MUTED)
        y += height + 10
    svg.text(20, y + 14, f"{len(LAYERS)} floors, top first (tools/layers.py's LAYERS): a room "
             "imports only rooms on the floors below it, never one beside it;", 12, italic=True)
    svg.text(20, y + 32, "tests/integration/test_architecture.py refuses any other import.", 12,
             italic=True)
    return svg.render()


PICTURES: dict[str, Callable[[], str]] = {
    "plan-kimi-linear-tp4.svg": picture_plan,
    "plan-mla-kimi-k3-tp4.svg": picture_mla,
    "o-proj-gather.svg": picture_o_proj,
    "k3-a-log.svg": picture_k3_a_log,
    "vllm-k3-in-proj.svg": picture_fused,
    "house.svg": picture_house,
}


def main(argv: list[str]) -> int:
    if len(argv) > 1 or argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    out = Path(argv[0]) if argv else DEFAULT_OUT
    out.mkdir(parents=True, exist_ok=True)
    for name, draw in PICTURES.items():
        (out / name).write_text(draw(), encoding="utf-8", newline="\n")
        print(f"wrote {out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
