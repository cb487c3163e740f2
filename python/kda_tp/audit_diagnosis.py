"""Diagnosing a wrong engine parameter: which part differs, where, and what it holds instead.

:func:`exact_in_place` proves a parameter right without building it (the fast path);
:func:`compare` compares it with the bytes it must hold and, part by part, names what a wrong
part equals instead (another rank's slice, another part, zeros, ...) from the
:class:`Candidates` of its layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .audit_report import ParamAudit, PartDifference
from .audit_values import (
    CASTABLE,
    bytes_equal,
    cast_overflow,
    cast_to,
    first_difference,
    same_values,
)
from .checkpoint import SafetensorsSource, Tensor, numpy_dtype
from .engines import EngineParamPlan
from .layout import kda_tensor_name, scale_tensor_name
from .source import KdaShardedSource, checked_get

__all__ = ["Candidates", "audit_overflow", "compare", "exact_in_place", "identify"]


class Candidates:
    """The slices a wrong part of rank ``rank``'s parameter in KDA layer ``layer`` may hold
    instead: every rank's slice of every plan tensor (and block-scale grid), and the full
    tensors, read from the checkpoint when first asked for."""

    def __init__(self, source: SafetensorsSource, shards: Callable[[int], KdaShardedSource],
                 rank: int, layer: int):
        self.source, self.shards, self.rank, self.layer = source, shards, rank, layer
        shard = shards(rank)
        self.plan, self.prefix = shard.plan, shard.prefix
        self.parts = [t.name for t in self.plan.tensors]
        self.parts += [f"{t.name}.scale" for t in self.plan.tensors if t.scale is not None]

    def _name(self, part: str) -> str:
        if part.endswith(".scale"):
            found = scale_tensor_name(self.source, self.prefix, self.layer,
                                      part.removesuffix(".scale"))
            assert found is not None  # the adapter checked every quantized weight's scale
            return found
        return kda_tensor_name(self.prefix, self.layer, part)

    def slice(self, rank: int, part: str) -> np.ndarray:
        """Rank ``rank``'s slice of ``part``, flat, in the checkpoint's dtype."""
        return checked_get(self.shards(rank), self._name(part)).array.reshape(-1)

    def full(self, part: str) -> np.ndarray:
        """The whole checkpoint tensor ``part``, flat."""
        return checked_get(self.source, self._name(part)).array.reshape(-1)

    def size(self, part: str) -> int:
        """Elements of one rank's slice of ``part`` (every rank's is the same size)."""
        entry = self.plan[part.removesuffix(".scale")]
        if part.endswith(".scale"):
            assert entry.scale is not None  # listed in `parts` only when it has one
            entry = entry.scale
        return int(entry.local_rows * entry.local_row_elems)

    def labelled(self, part: str, size: int, single: bool
                 ) -> Iterable[tuple[str, np.ndarray | None]]:
        """``(what it is, values)`` for every known slice of ``size`` elements a part ``part``
        might hold by mistake, most likely first (None: zeros). Slices are read only when their
        size is ``size``. ``single``: the part is the whole parameter (no other part to swap
        with: another tensor's slice means the wrong tensor was loaded)."""
        plan, tp_size = self.plan, self.plan.tp_size
        others = [r for r in range(tp_size) if r != self.rank]
        if part in self.parts and self.size(part) == size:
            for r in others:
                yield f"rank {r}'s slice of {part}", self.slice(r, part)
        if part == "A_log" and plan.a_log_len > plan.full_heads and plan.a_log_len % tp_size == 0:
            stored, heads = plan.a_log_len, plan.local_heads
            start = self.rank * (stored // tp_size)
            yield (
                f"the even split of the padded A_log: entries {start}..{start + size - 1} of "
                f"the {stored} stored (padding included, {stored // tp_size} per rank), instead "
                f"of heads {self.rank * heads}..{(self.rank + 1) * heads - 1} of "
                f"{plan.full_heads}",
                self.full(part)[start : start + size],
            )
        start, channels = self.rank * plan.local_heads, self.rank * plan.local_heads * plan.head_dim
        if part == "dt_bias" and start != channels and size == self.size(part):
            yield (
                f"dt_bias[{start}:{start + size}]: sliced at the head offset rank x H/T = {start} "
                f"instead of the channel offset rank x C/T = {channels}",
                self.full(part)[start : start + size],
            )
        for other in self.parts:
            if other == part or self.size(other) != size:
                continue
            if {part, other} == {"f_b_proj", "g_b_proj"}:
                why = "f_b and g_b swapped"
            else:
                why = "the wrong tensor was loaded" if single else "parts in another order"
            yield f"this rank's slice of {other}: {why}", self.slice(self.rank, other)
            for r in others:
                yield f"rank {r}'s slice of {other}", self.slice(r, other)
        yield "zeros (never loaded?)", None


def identify(data: np.ndarray, part: str, dtype: str, candidates: Candidates,
              single: bool) -> str | None:
    """What ``data`` (a part's elements, in the dump's ``dtype``) equals instead, if anything
    (nothing for no elements: that is a shape problem only). ``single``: see
    :meth:`Candidates.labelled`."""
    if not data.size:
        return None
    zeros = not data.view(np.uint8).any()
    for label, values in candidates.labelled(part, data.size, single):
        if values is None:
            if zeros:
                return label
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported elsewhere
            same = values.size == data.size and same_values(data, cast_to(values, dtype))
        if same:
            # An all-zero slice (e.g. padding) cannot be told from a parameter never loaded.
            return f"zeros (never loaded?), or {label}: both are all zero" if zeros else label
    return None


@dataclass(frozen=True)
class _Span:
    """A part's elements ``[start, stop)`` in the flat parameter, and its shape there."""

    part: str
    start: int
    stop: int
    shape: tuple[int, ...]


def _spans(plan: EngineParamPlan) -> list[_Span]:
    """The parameter's parts (and the padding, as ``"padding"``) in elements, buffer order."""
    size = numpy_dtype(plan.dtype).itemsize
    spans = [_Span(r.part, r.byte_range[0] // size, r.byte_range[1] // size, r.shape)
             for r in plan.regions]
    if plan.padding is not None:
        start, stop = (b // size for b in plan.padding)
        row = math.prod(plan.shape[1:]) or 1
        spans.append(_Span("padding", start, stop, ((stop - start) // row, *plan.shape[1:])))
    return spans


def _part_order(data: np.ndarray, spans: Sequence[_Span], expected: np.ndarray) -> str | None:
    """When ``data`` is this rank's parts in another order (then zeros), that order."""
    pieces = {s.part: expected[s.start : s.stop] for s in spans if s.part != "padding"}
    names = list(pieces)
    if not 2 <= len(names) <= 8:
        return None

    def search(offset: int, left: tuple[str, ...]) -> list[str] | None:
        if not left:
            return [] if not data[offset:].view(np.uint8).any() else None
        for name in left:
            piece = pieces[name]
            if same_values(data[offset : offset + piece.size], piece):
                rest = search(offset + piece.size, tuple(n for n in left if n != name))
                if rest is not None:
                    return [name, *rest]
        return None

    order = search(0, tuple(names))
    if order is None or order == names:
        return None
    return f"its parts in another order: {', '.join(order)} (expected {', '.join(names)})"


def audit_overflow(plan: EngineParamPlan, expected: np.ndarray, candidates: Candidates
              ) -> str | None:
    """:func:`cast_overflow` of the rank's parameter, in the audit's words."""
    found = cast_overflow(plan, expected, lambda part: candidates.slice(candidates.rank, part))
    return None if found is None else f"{found}, and the bytes cannot tell which slice was loaded"


def compare(rank: int, layer: int, name: str, record: Tensor, plan: EngineParamPlan,
             expected: np.ndarray, candidates: Candidates) -> ParamAudit:
    """Compare one dumped parameter with the bytes it must hold; diagnose a difference."""
    if record.dtype != plan.dtype:
        # A float parameter is expected in its own dtype (the engine's model dtype) unless the
        # layout fixes it (F32 A_log, dt_bias, convs) or its parts are FP8.
        fixed = f" ({plan.layout} holds it in {plan.dtype})" if record.dtype in CASTABLE else ""
        return ParamAudit(rank, layer, name, "mismatch",
                          f"dtype {record.dtype}, expected {plan.dtype}{fixed}")
    data = record.array.reshape(-1)
    spans = _spans(plan)
    if tuple(record.shape) != plan.shape:
        problem = f"shape {list(record.shape)}, expected {list(plan.shape)}"
        if same_values(data, expected):
            return ParamAudit(rank, layer, name, "mismatch", problem + " (the values are right)")
        named = [s for s in spans if s.part != "padding"]
        if len(named) == 1:
            instead = identify(data, named[0].part, record.dtype, candidates, True)
        else:
            instead = _part_order(data, spans, expected)
        return ParamAudit(rank, layer, name, "mismatch", problem, equals=instead)
    if same_values(data, expected):
        return ParamAudit(rank, layer, name, "exact")
    differences = []
    single = sum(s.part != "padding" for s in spans) == 1
    for span in spans:
        got, want = data[span.start : span.stop], expected[span.start : span.stop]
        if same_values(got, want):
            continue
        i = first_difference(got, want)
        index = tuple(int(x) for x in np.unravel_index(span.start + i, plan.shape))
        part_index = tuple(int(x) for x in np.unravel_index(i, span.shape))
        if span.part == "padding":
            first = span.start // (math.prod(plan.shape[1:]) or 1)
            equals: str | None = (
                f"non-zero padding: rows {first}..{plan.shape[0] - 1} must be zero, row "
                f"{index[0]} is not"
            )
        else:
            equals = identify(got, span.part, record.dtype, candidates, single)
        differences.append(
            PartDifference(span.part, index, part_index, float(want[i]), float(got[i]), equals)
        )
    order = None
    if sum(d.part != "padding" for d in differences) >= 2:
        order = _part_order(data, spans, expected)
    return ParamAudit(rank, layer, name, "mismatch",
                      f"values differ in {', '.join(d.part for d in differences)}",
                      tuple(differences), order)


def exact_in_place(record: Tensor, plan: EngineParamPlan, candidates: Candidates) -> bool:
    """Whether a dumped parameter is exactly right, proven without building it: each part's
    bytes equal the rank's slice as the checkpoint holds it (a view of the mapped file for a
    row slice; ``o_proj``'s columns gathered), the padding is zero. Only where the engine does
    not cast (a cast part, another dtype or shape: False). False proves nothing: the full
    comparison (:func:`compare`) then runs and diagnoses. This is the guard's fast path: it
    reads the parameter and the rank's bytes once each and writes nothing."""
    if record.dtype != plan.dtype or tuple(record.shape) != plan.shape:
        return False
    if any(r.source_dtype != plan.dtype for r in plan.regions):
        return False
    data = record.data.reshape(-1).view(np.uint8)
    if data.nbytes != plan.nbytes:
        return False
    for region in plan.regions:
        start, stop = region.byte_range
        want = candidates.slice(candidates.rank, region.part).view(np.uint8)
        if want.nbytes != stop - start or not bytes_equal(data[start:stop], want):
            return False
    return plan.padding is None or not data[plan.padding[0] : plan.padding[1]].any()
