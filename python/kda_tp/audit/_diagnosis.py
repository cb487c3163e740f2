"""Diagnosing a wrong engine parameter: which part differs, where, and what it holds instead.

:func:`exact_in_place` proves a parameter right without building it (the fast path);
:func:`compare` compares it with the bytes it must hold and, part by part, names what a wrong
part equals instead (another rank's slice, another part, zeros, ...) from the
:class:`Candidates` of its layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.names import kda_tensor_name, scale_tensor_name
from ..checkpoint.reader import SafetensorsSource, Tensor, checked_get
from ..checkpoint.values import bytes_equal, first_difference, same_values
from ..engines.layout import EngineParamPlan
from ..model.dtypes import FLOAT_DTYPES, cast_to, numpy_dtype
from ..rank.mla import mla_tensor_name
from ..rank.plan import KdaShard, KdaTensorPlan
from ..rank.view import KdaShardedSource
from .report import ParamAudit, PartDifference

__all__ = ["DIAGNOSIS_BUDGET", "Candidates", "audit_overflow", "cast_nan", "cast_overflow",
           "compare", "exact_in_place", "identify"]

#: What the diagnosis of one rank's KDA layer may compare in full and gather (another rank's
#: column slice of ``o_proj``), in multiples of the rank's bytes of that layer. Past it, the
#: remaining candidate slices are not tried, and the report says how many were not.
DIAGNOSIS_BUDGET = 4
# Elements of a candidate compared first: it is compared in full only when they match (a
# garbage part costs one short comparison per candidate, not one full one).
_HEAD = 64


class Candidates:
    """The slices a wrong part of rank ``rank``'s parameter in KDA layer ``layer`` may hold
    instead: every rank's slice of every plan tensor (and block-scale grid), and the full
    tensors, read from the checkpoint when first asked for and kept for the layer's other
    parameters. The diagnosis spends at most :data:`DIAGNOSIS_BUDGET` times the rank's bytes
    of the layer (:meth:`afford`). ``mla``: the layer is one of the hybrid's MLA layers, whose
    plan tensors are the rank views' ``mla`` plan's."""

    def __init__(self, source: SafetensorsSource, shards: Callable[[int], KdaShardedSource],
                 rank: int, layer: int, *, mla: bool = False):
        self.source, self.shards, self.rank, self.layer = source, shards, rank, layer
        self.mla = mla
        shard = shards(rank)
        self.plan, self.prefix = self._plan_of(shard), shard.prefix
        self.parts = [t.name for t in self.plan.tensors]
        self.parts += [f"{t.name}.scale" for t in self.plan.tensors if t.scale is not None]
        self._slices: dict[tuple[int, str], np.ndarray] = {}
        self.budget = DIAGNOSIS_BUDGET * sum(self._nbytes(part) for part in self.parts)
        self.spent = 0

    def _plan_of(self, shard: KdaShardedSource) -> Any:
        """The plan of the layer's tensors on ``shard``'s rank (its MLA plan for an MLA
        layer)."""
        return shard.mla if self.mla else shard.plan

    def _entry(self, part: str) -> KdaTensorPlan:
        entry: KdaTensorPlan = self.plan[part.removesuffix(".scale")]
        if part.endswith(".scale"):
            assert entry.scale is not None  # listed in `parts` only when it has one
            entry = entry.scale
        return entry

    def _nbytes(self, part: str) -> int:
        return self.size(part) * numpy_dtype(self._entry(part).dtype).itemsize

    def afford(self, nbytes: int) -> bool:
        """Spend ``nbytes`` of the budget; False (nothing spent) when it would overrun it."""
        if self.spent + nbytes > self.budget:
            return False
        self.spent += nbytes
        return True

    def _name(self, part: str) -> str:
        if part.endswith(".scale"):
            found = scale_tensor_name(self.source, self.prefix, self.layer,
                                      part.removesuffix(".scale"))
            assert found is not None  # the adapter checked every quantized weight's scale
            return found
        if self.mla:
            return mla_tensor_name(self.prefix, self.layer, part)
        return kda_tensor_name(self.prefix, self.layer, part)

    def slice(self, rank: int, part: str) -> np.ndarray:
        """Rank ``rank``'s slice of ``part``, flat, in the checkpoint's dtype."""
        key = (rank, part)
        if key not in self._slices:
            self._slices[key] = self.shards(rank)[self._name(part)].array.reshape(-1)
        return self._slices[key]

    def candidate(self, rank: int, part: str) -> np.ndarray | None:
        """:meth:`slice` for the diagnosis: None when it is a column gather (a copy, unlike a
        row slice's view of the mapped file) the budget cannot pay for."""
        gathered = self._entry(part).kind == KdaShard.CHANNEL_COLS
        if (rank, part) not in self._slices and gathered and not self.afford(self._nbytes(part)):
            return None
        return self.slice(rank, part)

    def head(self, rank: int, part: str, count: int) -> np.ndarray:
        """The first ``count`` (or fewer) elements of rank ``rank``'s slice of ``part``, read
        without gathering the slice: for a column slice, the first row's columns of the rank
        in the mapped tensor."""
        if self._entry(part).kind != KdaShard.CHANNEL_COLS or (rank, part) in self._slices:
            return self.slice(rank, part)[:count]
        entry = self._plan_of(self.shards(rank))[part.removesuffix(".scale")]
        if part.endswith(".scale"):
            assert entry.scale is not None  # listed in `parts` only when it has one
            entry = entry.scale
        start = entry.src_col_offset
        return self.full(part)[start : start + min(count, entry.local_row_elems)]

    def full(self, part: str) -> np.ndarray:
        """The whole checkpoint tensor ``part``, flat."""
        return checked_get(self.source, self._name(part)).array.reshape(-1)

    def size(self, part: str) -> int:
        """Elements of one rank's slice of ``part`` (every rank's is the same size)."""
        entry = self._entry(part)
        return int(entry.local_rows * entry.local_row_elems)

    def labelled(self, part: str, size: int, single: bool
                 ) -> Iterable[tuple[str, _Slice | _Range | None]]:
        """``(what it is, where)`` for every known slice of ``size`` elements a part ``part``
        might hold by mistake, most likely first (``where`` None: zeros). Nothing is read
        here. ``single``: the part is the whole parameter (no other part to swap with: another
        tensor's slice means the wrong tensor was loaded)."""
        plan, tp_size = self.plan, self.plan.tp_size
        others = [r for r in range(tp_size) if r != self.rank]
        if part in self.parts and self.size(part) == size:
            for r in others:
                yield f"rank {r}'s slice of {part}", _Slice(self, r, part)
        if part == "A_log" and plan.a_log_len > plan.full_heads and plan.a_log_len % tp_size == 0:
            stored, heads = plan.a_log_len, plan.local_heads
            start = self.rank * (stored // tp_size)
            yield (
                f"the even split of the padded A_log: entries {start}..{start + size - 1} of "
                f"the {stored} stored (padding included, {stored // tp_size} per rank), instead "
                f"of heads {self.rank * heads}..{(self.rank + 1) * heads - 1} of "
                f"{plan.full_heads}",
                _Range(self.full(part)[start : start + size]),
            )
        if part == "dt_bias":  # a KDA plan's
            start = self.rank * plan.local_heads
            channels = start * plan.head_dim
            if start != channels and size == self.size(part):
                yield (
                    f"dt_bias[{start}:{start + size}]: sliced at the head offset rank x H/T = "
                    f"{start} instead of the channel offset rank x C/T = {channels}",
                    _Range(self.full(part)[start : start + size]),
                )
        for other in self.parts:
            if other == part or self.size(other) != size:
                continue
            if {part, other} == {"f_b_proj", "g_b_proj"}:
                why = "f_b and g_b swapped"
            else:
                why = "the wrong tensor was loaded" if single else "parts in another order"
            yield f"this rank's slice of {other}: {why}", _Slice(self, self.rank, other)
            for r in others:
                yield f"rank {r}'s slice of {other}", _Slice(self, r, other)
        yield "zeros (never loaded?)", None



@dataclass(frozen=True)
class _Slice:
    """A rank's slice of a part, as a candidate: its head read first, the whole when asked."""

    candidates: Candidates
    rank: int
    part: str

    def head(self, count: int) -> np.ndarray:
        return self.candidates.head(self.rank, self.part, count)

    def values(self) -> np.ndarray | None:
        return self.candidates.candidate(self.rank, self.part)


@dataclass(frozen=True)
class _Range:
    """A range of a mapped checkpoint tensor, as a candidate."""

    array: np.ndarray

    def head(self, count: int) -> np.ndarray:
        return self.array[:count]

    def values(self) -> np.ndarray | None:
        return self.array


def identify(data: np.ndarray, part: str, dtype: str, candidates: Candidates,
             single: bool) -> tuple[str | None, int]:
    """What ``data`` (a part's elements, in the dump's ``dtype``) equals instead, if anything
    (nothing for no elements: that is a shape problem only), and how many candidate slices
    the budget left untried. A candidate is compared in full only when its first elements
    match. ``single``: see :meth:`Candidates.labelled`."""
    if not data.size:
        return None, 0
    zeros = not data.view(np.uint8).any()
    head = min(_HEAD, data.size)
    untried = 0
    for label, where in candidates.labelled(part, data.size, single):
        if where is None:
            if zeros:
                return label, untried
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported elsewhere
            first = where.head(head)
            if not same_values(data[: first.size], cast_to(first, dtype)):
                continue
            values = where.values()
            if values is None or not candidates.afford(data.nbytes):
                untried += 1
                continue
            same = values.size == data.size and same_values(data, cast_to(values, dtype))
        if same:
            # An all-zero slice (e.g. padding) cannot be told from a parameter never loaded.
            found = f"zeros (never loaded?), or {label}: both are all zero" if zeros else label
            return found, untried
    return None, untried


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


def _part_order(data: np.ndarray, spans: Sequence[_Span], parts: Mapping[str, np.ndarray]
                ) -> str | None:
    """When ``data`` is this rank's parts (``parts``: what each must hold) in another order
    (then zeros), that order."""
    pieces = {s.part: parts[s.part] for s in spans if s.part != "padding"}
    names = list(pieces)
    if not 2 <= len(names) <= 8:
        return None

    def search(offset: int, left: tuple[str, ...]) -> list[str] | None:
        if not left:
            return [] if not data[offset:].view(np.uint8).any() else None
        for name in left:
            piece = pieces[name]
            head = min(_HEAD, piece.size)
            if (same_values(data[offset : offset + head], piece[:head])
                    and same_values(data[offset : offset + piece.size], piece)):
                rest = search(offset + piece.size, tuple(n for n in left if n != name))
                if rest is not None:
                    return [name, *rest]
        return None

    order = search(0, tuple(names))
    if order is None or order == names:
        return None
    return f"its parts in another order: {', '.join(order)} (expected {', '.join(names)})"


def cast_overflow(plan: EngineParamPlan, built: np.ndarray,
                  part_values: Callable[[str], np.ndarray]) -> str | None:
    """When casting a part to the parameter's dtype turns a finite checkpoint value into an
    infinity (e.g. 70000.0 to F16), what overflows (``"the cast from BF16 to F16 overflows:
    ..."``), else None: the one rule of the audit and of ``kda_tp.audit.write_engine_dump`` /
    ``kda_tp.audit.engine_digests``.

    Args:
        plan: the parameter's plan (``kda_tp.engines.param_plan``).
        built: the parameter as built (``kda_tp.engines.build_param``), flat.
        part_values: a part's slice as the checkpoint stores it, flat (read only for a part
            that is cast and holds an infinity).
    """
    size = numpy_dtype(plan.dtype).itemsize
    for region in plan.regions:
        if region.source_dtype == plan.dtype:
            continue
        cast = built[region.byte_range[0] // size : region.byte_range[1] // size]
        infinite = np.isinf(cast)
        if not infinite.any():
            continue
        values = part_values(region.part)
        overflowed = np.flatnonzero(infinite & np.isfinite(values))
        if overflowed.size:
            i = int(overflowed[0])
            at = [int(x) for x in np.unravel_index(i, region.shape)]
            return (
                f"the cast from {region.source_dtype} to {plan.dtype} overflows: "
                f"{region.part}'s {float(values[i])!r} (its {at}) becomes inf, as do "
                f"{overflowed.size} of its {values.size} values; {plan.dtype} cannot hold this "
                "checkpoint's weights"
            )
    return None


def cast_nan(plan: EngineParamPlan, built: np.ndarray) -> str | None:
    """When a part the engine casts to the parameter's dtype holds a NaN, where (``"q_proj
    holds NaN at [3, 5] (1 of its 6144 values) ..."``), else None: the bits of a NaN after an
    engine's cast depend on where it converts (``kda_tp.model.dtypes``), so a hash of the
    parameter (``kda_tp.audit.engine_digests``, ``expected_digests``) cannot promise the
    engine's. An uncast NaN is copied bit for bit and hashes as it is stored.

    Args:
        plan: the parameter's plan (``kda_tp.engines.param_plan``).
        built: the parameter as built (``kda_tp.engines.build_param``), flat.
    """
    size = numpy_dtype(plan.dtype).itemsize
    for region in plan.regions:
        if region.source_dtype == plan.dtype:
            continue
        nan = np.isnan(built[region.byte_range[0] // size : region.byte_range[1] // size])
        if nan.any():
            i = int(np.flatnonzero(nan)[0])
            at = [int(x) for x in np.unravel_index(i, region.shape)]
            return (
                f"{region.part} holds NaN at {at} ({int(nan.sum())} of its {nan.size} values), "
                f"which the engine casts from {region.source_dtype} to {plan.dtype}: a NaN's "
                "bits after that cast depend on where the engine converts (torch on the CPU "
                "writes 0xFFFF or 0x7FC0 for BF16, CUDA 0x7FFF), so no digest can promise the "
                "engine's; audit the loaded weights instead (kda-tp audit, the guard: a NaN "
                "matches any NaN)"
            )
    return None


def audit_overflow(plan: EngineParamPlan, expected: np.ndarray, candidates: Candidates
              ) -> str | None:
    """:func:`cast_overflow` of the rank's parameter, in the audit's words."""
    found = cast_overflow(plan, expected, lambda part: candidates.slice(candidates.rank, part))
    return None if found is None else f"{found}, and the bytes cannot tell which slice was loaded"


def compare(rank: int, layer: int, name: str, record: Tensor, plan: EngineParamPlan,
            build: Callable[[], np.ndarray], candidates: Candidates) -> ParamAudit:
    """Compare one dumped parameter with the bytes it must hold (``build()``: the whole
    parameter, flat, built only where a part is cast or the shape is wrong; an uncast part is
    compared with the rank's slice as the checkpoint holds it); diagnose a difference."""
    if record.dtype != plan.dtype:
        # A float parameter is expected in its own dtype (the engine's model dtype) unless the
        # layout fixes it (F32 A_log, dt_bias, convs) or its parts are FP8.
        fixed = f" ({plan.layout} holds it in {plan.dtype})" if record.dtype in FLOAT_DTYPES else ""
        return ParamAudit(rank, layer, name, "mismatch",
                          f"dtype {record.dtype}, expected {plan.dtype}{fixed}")
    data = record.array.reshape(-1)
    spans = _spans(plan)
    if tuple(record.shape) != plan.shape:
        problem = f"shape {list(record.shape)}, expected {list(plan.shape)}"
        expected = build()
        if same_values(data, expected):
            return ParamAudit(rank, layer, name, "mismatch", problem + " (the values are right)")
        named = [s for s in spans if s.part != "padding"]
        if len(named) == 1:
            instead, _ = identify(data, named[0].part, record.dtype, candidates, True)
        else:
            instead = _part_order(data, spans, {s.part: expected[s.start : s.stop]
                                                for s in spans})
        return ParamAudit(rank, layer, name, "mismatch", problem, equals=instead)
    # The verdict (which parts differ, where) first; then what each holds instead, within the
    # budget of the layer's Candidates.
    cast = any(r.source_dtype != plan.dtype for r in plan.regions)

    def wanted(span: _Span) -> np.ndarray:
        if cast:
            return build()[span.start : span.stop]
        if span.part == "padding":
            return np.zeros(span.stop - span.start, data.dtype)
        return candidates.slice(candidates.rank, span.part)

    differences = []
    single = sum(s.part != "padding" for s in spans) == 1
    for span in spans:
        got, want = data[span.start : span.stop], wanted(span)
        if same_values(got, want):
            continue
        i = first_difference(got, want)
        index = tuple(int(x) for x in np.unravel_index(span.start + i, plan.shape))
        part_index = tuple(int(x) for x in np.unravel_index(i, span.shape))
        untried = 0
        if span.part == "padding":
            first = span.start // (math.prod(plan.shape[1:]) or 1)
            equals: str | None = (
                f"non-zero padding: rows {first}..{plan.shape[0] - 1} must be zero, row "
                f"{index[0]} is not"
            )
        else:
            equals, untried = identify(got, span.part, record.dtype, candidates, single)
        differences.append(PartDifference(span.part, index, part_index, float(want[i]),
                                          float(got[i]), equals, untried))
    if not differences:
        return ParamAudit(rank, layer, name, "exact")
    order = None
    if sum(d.part != "padding" for d in differences) >= 2:
        order = _part_order(data, spans, {s.part: wanted(s) for s in spans})
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
