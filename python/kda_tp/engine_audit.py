"""Auditing the KDA weights a serving engine loaded: is every rank's parameter exactly right?

A serving engine (vLLM, SGLang, transformers) loads each rank's KDA parameters with its own
code, fusing the checkpoint tensors in its own layout (:mod:`kda_tp.engines`). :func:`audit`
takes what one rank holds (its ``state_dict()``, or a ``save_sharded_state`` dump of it), builds
each KDA parameter the engine should hold from the checkpoint with the same code a loader uses
(:meth:`KdaShardedSource.build_param <kda_tp.KdaShardedSource>`), and compares them byte for
byte, after casting the expected values to the parameter's dtype as the engine does (e.g. BF16
to F32). A parameter that differs is diagnosed: which part (plan tensor) differs first, at which
index, and what the data equals instead when it equals some other slice (another rank's, another
part's, the even split of a padded ``A_log``, ``dt_bias`` at the head offset, ...).

:func:`audit_path` does the same for files on disk: a ``sharded_state`` directory
(``model-rank-{r}-part-{p}.safetensors``, vLLM's ``model-pp-{pp}-tp-{tp}-part-{p}.safetensors``)
or one rank's safetensors file. ``kda-tp audit`` is its command line.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ._io import open_files_error
from .config import parse_metadata_int
from .checkpoint import SafetensorsSource, Tensor, numpy_dtype, torch_dtype
from .engines import (
    LAYOUTS,
    EngineLayout,
    EngineParam,
    EngineParamPlan,
    get_layout,
    model_family,
    param_location,
    param_name,
    recognise,
)
from .errors import CheckpointError, EngineLayoutError, PlanError, ShapeMismatchError
from .layout import kda_layer_indices, kda_tensor_name, scale_tensor_name
from .plan import KdaTpPlan
from .source import KdaShardedSource, checked_get

__all__ = [
    "AuditReport",
    "ParamAudit",
    "PartDifference",
    "audit",
    "audit_path",
    "cast_overflow",
    "sharded_state_files",
]

# vLLM's and SGLang's save_sharded_state file names (vLLM's default pattern, and its pattern
# with the pipeline stage).
# ASCII digits only: \d also matches other scripts' digits, which int() reads.
_RANK_FILE = re.compile(r"^model-rank-([0-9]+)-part-([0-9]+)\.safetensors$")
_PP_TP_FILE = re.compile(r"^model-pp-([0-9]+)-tp-([0-9]+)-part-([0-9]+)\.safetensors$")
# A rank or size in a file header's metadata.
_ASCII_INT = re.compile(r"[0-9]+")
# The model families' names in messages.
_FAMILY_NAMES = {"kimi-k3": "Kimi K3", "kimi-linear": "Kimi-Linear", "glm-5.3": "GLM-5.3-Flash"}

# The float dtypes an engine casts between (torch's `copy_`, round to nearest even); FP8 and
# integer parameters are compared as stored.
_CASTABLE = ("F64", "F32", "F16", "BF16")
# The dtypes a dumped parameter may have (safetensors names).
_DTYPES = (*_CASTABLE, "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class PartDifference:
    """Where one part (plan tensor) of an engine parameter differs from what it should hold.

    Attributes:
        part: the plan tensor (``q_proj``, ``A_log``, ...), or ``"padding"`` for the zero rows
            an engine appends to a fused parameter.
        index: the first differing index, in the parameter's shape (elements).
        part_index: the same position as an index into the part (its local shape).
        expected: the expected value there (after the cast to the parameter's dtype).
        actual: the value the dump holds there.
        equals: what the part's data equals instead, when it equals some other slice (e.g.
            ``"rank 0's slice of q_proj"``); for the padding, which rows must be zero. None
            when it matches nothing known.
    """

    part: str
    index: tuple[int, ...]
    part_index: tuple[int, ...]
    expected: float
    actual: float
    equals: str | None = None

    def format(self) -> str:
        """One clause, e.g. ``part v_proj differs at [768, 0] (its [0, 0]; expected 20384.0,
        got 20768.0): equals rank 2's slice of v_proj``."""
        text = (
            f"part {self.part} differs at {list(self.index)} (its {list(self.part_index)}; "
            f"expected {self.expected!r}, got {self.actual!r})"
        )
        if self.equals is None:
            return text
        return text + (": " if self.part == "padding" else ": equals ") + self.equals

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return {
            "part": self.part, "index": list(self.index), "part_index": list(self.part_index),
            "expected": _json_float(self.expected), "actual": _json_float(self.actual),
            "equals": self.equals,
        }


@dataclass(frozen=True)
class ParamAudit:
    """The verdict on one KDA parameter of one rank.

    Attributes:
        rank: the tensor-parallel rank.
        layer: the 0-based decoder layer.
        name: the parameter's name in the dump (with the dump's own prefix; for a missing
            parameter, the name the engine would give it).
        status: ``"exact"``, ``"mismatch"`` (present, but shape, dtype or bytes differ) or
            ``"missing"`` (the engine's layout has it, the dump does not).
        problem: what is wrong in a few words (``"values differ in q_proj, k_proj"``, a shape,
            a dtype, ``"missing: ..."``); None when exact.
        differences: per differing part, where and what it equals instead (first differing
            part first).
        equals: what the whole parameter equals instead, when no single part explains it
            (e.g. its parts in another order); None otherwise.
    """

    rank: int
    layer: int
    name: str
    status: str
    problem: str | None = None
    differences: tuple[PartDifference, ...] = ()
    equals: str | None = None

    @property
    def passed(self) -> bool:
        """True when the parameter is exactly right."""
        return self.status == "exact"

    def format(self) -> str:
        """One line: ``rank 1 model.layers.0.self_attn.A_log: <problem>[; equals ...][; part
        ...]``."""
        if self.passed:
            return f"rank {self.rank} {self.name}: exact"
        text = f"rank {self.rank} {self.name}: {self.problem}"
        if self.equals:
            text += f"; equals {self.equals}"
        if self.differences:
            text += "; " + "; ".join(d.format() for d in self.differences)
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return {
            "rank": self.rank, "layer": self.layer, "name": self.name, "status": self.status,
            "problem": self.problem, "equals": self.equals,
            "differences": [d.to_dict() for d in self.differences],
        }


@dataclass
class AuditReport:
    """The outcome of :func:`audit` (one rank) or :func:`audit_path` (one or every rank).

    Attributes:
        engine: the engine layout audited against (a :data:`kda_tp.engines.LAYOUTS` key).
        tp_size: the tensor-parallel world size.
        ranks: the ranks audited, sorted.
        params: one entry per KDA parameter of every KDA layer of every audited rank.
        ignored: parameters of the dump that are not KDA parameters (counted, not checked).
        problems: what is wrong outside any one parameter (e.g. a rank missing from a
            ``sharded_state`` directory).
    """

    engine: str
    tp_size: int
    ranks: tuple[int, ...] = ()
    params: list[ParamAudit] = field(default_factory=list)
    ignored: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every KDA parameter of every rank is exactly right and no rank is
        missing."""
        return not self.problems and all(p.passed for p in self.params)

    @property
    def failures(self) -> list[ParamAudit]:
        """The parameters that are not exactly right."""
        return [p for p in self.params if not p.passed]

    def summary(self) -> str:
        """One line: the verdict and the counts."""
        exact = sum(p.passed for p in self.params)
        counts = (
            f"{exact} of {len(self.params)} KDA parameters exact on rank"
            f"{'s' if len(self.ranks) != 1 else ''} {', '.join(map(str, self.ranks)) or '-'} "
            f"of {self.tp_size} ({self.engine}); {self.ignored} other parameters ignored"
        )
        if self.passed:
            return f"OK: {counts}"
        wrong = len(self.params) - exact
        extra = f", {len(self.problems)} other problem(s)" if self.problems else ""
        return f"FAIL: {wrong} KDA parameter(s) wrong{extra}; {counts}"

    def format(self) -> str:
        """One line per problem and per parameter that is not exact, then the summary."""
        lines = list(self.problems) + [p.format() for p in self.failures]
        return "\n".join([*lines, self.summary()])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``kda-tp audit --json`` prints): ``ok`` (:attr:`passed`, under
        the key every ``kda-tp --json`` document has), ``engine``, ``tp_size``, ``ranks``, ``ignored``,
        ``problems``, ``exact`` (the count) and ``params`` (every parameter's entry, see
        :meth:`ParamAudit.to_dict`)."""
        return {
            "ok": self.passed, "engine": self.engine, "tp_size": self.tp_size,
            "ranks": list(self.ranks), "ignored": self.ignored, "problems": list(self.problems),
            "exact": sum(p.passed for p in self.params),
            "params": [p.to_dict() for p in self.params],
        }


def _json_float(x: float) -> float | str:
    """``x``, or its repr for NaN and infinities (which JSON cannot hold)."""
    return x if math.isfinite(x) else repr(x)


def sharded_state_files(path: str | os.PathLike[str]) -> dict[int, list[Path]]:
    """The ``save_sharded_state`` files of a directory, by tensor-parallel rank.

    vLLM and SGLang write ``model-rank-{r}-part-{p}.safetensors``; vLLM with pipeline stages
    ``model-pp-{pp}-tp-{r}-part-{p}.safetensors``. A rank's files (every part, every pipeline
    stage) together hold its ``state_dict()``. Other files (``config.json``, tokenizer files)
    are ignored.

    Returns:
        ``{rank: [files, sorted]}``, ranks sorted.

    Raises:
        CheckpointError: ``path`` cannot be listed, or holds no such file.
    """
    root = Path(path)
    try:
        entries = sorted(root.iterdir())
    except OSError as e:
        raise CheckpointError(f"{root}: cannot list the sharded_state directory: {e}") from e
    files: dict[int, list[Path]] = {}
    for p in entries:
        rank = _rank_of_name(p.name)
        if rank is not None:
            files.setdefault(rank, []).append(p)
    if not files:
        raise CheckpointError(
            f"{root}: no sharded_state file (model-rank-{{r}}-part-{{p}}.safetensors or "
            "model-pp-{pp}-tp-{r}-part-{p}.safetensors) in it; pass the directory given to "
            "save_sharded_state, or one rank's .safetensors file with --rank"
        )
    return dict(sorted(files.items()))


def _rank_of_name(name: str) -> int | None:
    """The tensor-parallel rank a ``save_sharded_state`` file name carries, or None."""
    if m := _RANK_FILE.match(name):
        return parse_metadata_int(m.group(1), "rank in the file name", name)
    if m := _PP_TP_FILE.match(name):
        return parse_metadata_int(m.group(2), "rank in the file name", name)
    return None


def _record(name: str, value: Any) -> Tensor:
    """``value`` (a numpy array, a torch tensor on any device, or a :class:`~kda_tp.Tensor`)
    as a Tensor record of its raw bytes. torch is never imported here: a torch tensor means it
    is loaded already.

    Raises:
        CheckpointError: a value of another type, a dtype with no safetensors name, or a torch
            tensor without data (``meta`` device).
        ShapeMismatchError: a Tensor record whose data is not its shape's size in bytes.
    """
    if isinstance(value, Tensor):
        if value.dtype not in _DTYPES:  # reported as a dtype mismatch
            return value
        data = value.data
        need = math.prod(value.shape) * numpy_dtype(value.dtype).itemsize
        if not isinstance(data, np.ndarray) or data.nbytes != need:
            got = f"{data.nbytes} bytes" if isinstance(data, np.ndarray) else type(data).__name__
            raise ShapeMismatchError(
                f"{name}: a kda_tp.Tensor of shape {list(value.shape)} x {value.dtype} needs "
                f"{need} bytes of data, it has {got}"
            )
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return Tensor(name, value.dtype, value.shape, flat)
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported already
    if torch is not None and isinstance(value, torch.Tensor):  # engines' Parameter subclasses too
        if torch.nn.parameter.is_lazy(value):
            raise CheckpointError(f"{name}: an uninitialized (lazy) parameter: it holds no "
                                  "values; was the model materialized and loaded?")
        if value.layout != torch.strided:
            raise CheckpointError(f"{name}: a {value.layout} tensor; an engine's parameters are "
                                  "dense (strided): dump the dense weights")
        dtype = next((d for d in _DTYPES if value.dtype == torch_dtype(d)), None)
        if dtype is None:
            raise CheckpointError(f"{name}: torch dtype {value.dtype} is not audited "
                                  f"(known: {', '.join(_DTYPES)})")
        if value.device.type == "meta":
            raise CheckpointError(f"{name}: a meta tensor (no data); dump the loaded weights")
        # A negated or conjugated view (``_neg_view()``) holds its values only once resolved.
        flat = value.detach().resolve_neg().resolve_conj().to("cpu").contiguous().reshape(-1)
        return Tensor(name, dtype, tuple(value.shape), flat.view(torch_dtype("U8")).numpy())
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        dtype = next((d for d in _DTYPES if numpy_dtype(d) == array.dtype), None)
        if dtype is None:
            raise CheckpointError(f"{name}: numpy dtype {array.dtype} is not audited "
                                  f"(known: {', '.join(_DTYPES)})")
        return Tensor(name, dtype, array.shape, array.reshape(-1).view(np.uint8))
    raise CheckpointError(
        f"{name}: a {type(value).__name__}; expected a numpy array, a torch tensor or a "
        "kda_tp.Tensor"
    )


def as_record(name: str, value: Any) -> Tensor:
    """``value`` (a numpy array, a torch tensor on any device, or a ``kda_tp.Tensor``) as the
    Tensor record of its raw bytes and dtype that the audit compares (the guard reads derived
    copies with it).

    Raises:
        CheckpointError: a value of another type, a dtype with no safetensors name, a torch
            tensor without data (meta, uninitialized) or not dense.
        ShapeMismatchError: a Tensor record whose data is not its shape's size in bytes.
    """
    return _record(name, value)


def _dtype_name(value: Any) -> str | None:
    """The safetensors dtype name of a dumped value, without reading its data; None when it
    has none (not an array, a dtype not audited: :func:`_record` then says why)."""
    if isinstance(value, Tensor):
        return value.dtype
    if isinstance(value, np.ndarray):
        return next((d for d in _DTYPES if numpy_dtype(d) == value.dtype), None)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        try:
            return next((d for d in _DTYPES if value.dtype == torch_dtype(d)), None)
        except Exception:  # a lazy parameter: _record refuses it
            return None
    return None


class _Candidates:
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


def _cast(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` in safetensors dtype ``dtype``, cast as the engines' ``copy_`` does (round to
    nearest even) and as ``KdaShardedSource.build_param`` does; unchanged when already of it."""
    target = numpy_dtype(dtype)
    return values if values.dtype == target else values.astype(target)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays of one dtype hold the same values: the same bits, except that a
    NaN matches a NaN of any bit pattern (torch and ml_dtypes cast a NaN to different ones);
    ``-0.0`` and ``0.0`` differ."""
    if a.shape != b.shape:
        return False
    x, y = a.view(np.uint8), b.view(np.uint8)
    # Compared as the widest integers that tile the bytes: fewer, larger elements (2.4x faster
    # than bytes on 112 MB).
    word = next(w for w in (8, 4, 2, 1) if x.size % w == 0)
    if np.array_equal(x.view(f"<u{word}"), y.view(f"<u{word}")):
        return True
    return not _differing(a, b).any()


def _differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element of flat arrays ``a`` and ``b`` (one dtype, one size): whether they differ
    (other bits, unless both are NaN)."""
    width = a.dtype.itemsize
    bits: np.ndarray = (
        a.view(np.uint8).reshape(-1, width) != b.view(np.uint8).reshape(-1, width)).any(1)
    if a.dtype.kind not in "iub":  # every other audited dtype is a float (ml_dtypes' too)
        bits &= ~(np.isnan(a) & np.isnan(b))
    return bits


def _first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The first element index where flat arrays ``a`` and ``b`` (one dtype, one size) differ
    (see :func:`_same`)."""
    return int(np.flatnonzero(_differing(a, b))[0])


def _identify(data: np.ndarray, part: str, dtype: str, candidates: _Candidates,
              single: bool) -> str | None:
    """What ``data`` (a part's elements, in the dump's ``dtype``) equals instead, if anything
    (nothing for no elements: that is a shape problem only). ``single``: see
    :meth:`_Candidates.labelled`."""
    if not data.size:
        return None
    zeros = not data.view(np.uint8).any()
    for label, values in candidates.labelled(part, data.size, single):
        if values is None:
            if zeros:
                return label
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported elsewhere
            same = values.size == data.size and _same(data, _cast(values, dtype))
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
            if _same(data[offset : offset + piece.size], piece):
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
    ..."``), else None: the one rule of the audit and of ``kda_tp.write_engine_dump`` /
    ``kda_tp.engine_digests``.

    Args:
        plan: the parameter's plan (``KdaShardedSource.param_plan``).
        built: the parameter as built (``KdaShardedSource.build_param``), flat.
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


def _overflow(plan: EngineParamPlan, expected: np.ndarray, candidates: _Candidates
              ) -> str | None:
    """:func:`cast_overflow` of the rank's parameter, in the audit's words."""
    found = cast_overflow(plan, expected, lambda part: candidates.slice(candidates.rank, part))
    return None if found is None else f"{found}, and the bytes cannot tell which slice was loaded"


def _compare(rank: int, layer: int, name: str, record: Tensor, plan: EngineParamPlan,
             expected: np.ndarray, candidates: _Candidates) -> ParamAudit:
    """Compare one dumped parameter with the bytes it must hold; diagnose a difference."""
    if record.dtype != plan.dtype:
        # A float parameter is expected in its own dtype (the engine's model dtype) unless the
        # layout fixes it (F32 A_log, dt_bias, convs) or its parts are FP8.
        fixed = f" ({plan.layout} holds it in {plan.dtype})" if record.dtype in _CASTABLE else ""
        return ParamAudit(rank, layer, name, "mismatch",
                          f"dtype {record.dtype}, expected {plan.dtype}{fixed}")
    data = record.array.reshape(-1)
    spans = _spans(plan)
    if tuple(record.shape) != plan.shape:
        problem = f"shape {list(record.shape)}, expected {list(plan.shape)}"
        if _same(data, expected):
            return ParamAudit(rank, layer, name, "mismatch", problem + " (the values are right)")
        named = [s for s in spans if s.part != "padding"]
        if len(named) == 1:
            instead = _identify(data, named[0].part, record.dtype, candidates, True)
        else:
            instead = _part_order(data, spans, expected)
        return ParamAudit(rank, layer, name, "mismatch", problem, equals=instead)
    if _same(data, expected):
        return ParamAudit(rank, layer, name, "exact")
    differences = []
    single = sum(s.part != "padding" for s in spans) == 1
    for span in spans:
        got, want = data[span.start : span.stop], expected[span.start : span.stop]
        if _same(got, want):
            continue
        i = _first_difference(got, want)
        index = tuple(int(x) for x in np.unravel_index(span.start + i, plan.shape))
        part_index = tuple(int(x) for x in np.unravel_index(i, span.shape))
        if span.part == "padding":
            first = span.start // (math.prod(plan.shape[1:]) or 1)
            equals: str | None = (
                f"non-zero padding: rows {first}..{plan.shape[0] - 1} must be zero, row "
                f"{index[0]} is not"
            )
        else:
            equals = _identify(got, span.part, record.dtype, candidates, single)
        differences.append(
            PartDifference(span.part, index, part_index, float(want[i]), float(got[i]), equals)
        )
    order = None
    if sum(d.part != "padding" for d in differences) >= 2:
        order = _part_order(data, spans, expected)
    return ParamAudit(rank, layer, name, "mismatch",
                      f"values differ in {', '.join(d.part for d in differences)}",
                      tuple(differences), order)


def _exact_in_place(record: Tensor, plan: EngineParamPlan, candidates: _Candidates) -> bool:
    """Whether a dumped parameter is exactly right, proven without building it: each part's
    bytes equal the rank's slice as the checkpoint holds it (a view of the mapped file for a
    row slice; ``o_proj``'s columns gathered), the padding is zero. Only where the engine does
    not cast (a cast part, another dtype or shape: False). False proves nothing: the full
    comparison (:func:`_compare`) then runs and diagnoses. This is the guard's fast path: it
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
        if want.nbytes != stop - start or not _bytes_equal(data[start:stop], want):
            return False
    return plan.padding is None or not data[plan.padding[0] : plan.padding[1]].any()


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat uint8 arrays of one size hold the same bytes, compared as the widest
    integers that tile them in 1 MiB chunks (as fast as a memcpy of one of them; no
    temporary larger than a chunk)."""
    word = next(w for w in (8, 4, 2, 1) if a.size % w == 0 and a.ctypes.data % w == 0
                and b.ctypes.data % w == 0)
    x, y = a.view(f"<u{word}"), b.view(f"<u{word}")
    step = (1 << 20) // word
    return all(np.array_equal(x[i : i + step], y[i : i + step]) for i in range(0, x.size, step))


@dataclass(frozen=True)
class _Selected:
    """A dump's KDA parameters: ``layers`` maps each layer to ``{suffix: name}``, all under
    ``prefix``; ``ignored`` counts the other names."""

    prefix: str
    layers: dict[int, dict[str, str]]
    ignored: int


class _Auditor:
    """Audits ranks of one engine's dump against one checkpoint at one world size."""

    def __init__(self, checkpoint: str | os.PathLike[str] | SafetensorsSource, tp_size: int,
                 engine: str | None, layers: Iterable[int] | None = None):
        self.source = (checkpoint if isinstance(checkpoint, SafetensorsSource)
                       else SafetensorsSource(checkpoint))
        self.family = model_family(self.source.config)
        self.tp_size = tp_size
        self.forced = None if engine is None else get_layout(engine)
        self.layers = kda_layer_indices(self.source, None)
        if layers is not None:  # a pipeline stage's KDA layers
            wanted = set(layers)
            if not wanted <= set(self.layers):
                raise CheckpointError(
                    f"layers {sorted(wanted - set(self.layers))} are not KDA layers of "
                    f"{self.source.path} (its KDA layers: {list(self.layers)})"
                )
            self.layers = tuple(sorted(wanted))
        self._shards: dict[int, KdaShardedSource] = {}
        # The names any layout knows, and those only a KDA layer has.
        self.known = frozenset().union(*(lay.suffixes for lay in LAYOUTS.values()))
        self.markers = {s for s in self.known if s.rsplit(".", 1)[-1] in ("A_log", "dt_bias")}

    def shard(self, rank: int) -> KdaShardedSource:
        """Rank ``rank``'s view of the checkpoint (any split the heads allow: no q|k width
        rule, the engine chose the world size)."""
        if rank not in self._shards:
            plan = KdaTpPlan.from_config(self.source, rank, self.tp_size, qk_multiple=1)
            self._shards[rank] = KdaShardedSource(self.source, plan)
        return self._shards[rank]

    def select(self, names: Sequence[str], where: str) -> _Selected | None:
        """The dump's KDA parameters: those under the prefix where ``A_log``/``dt_bias`` lie
        (else any name a layout knows) in the checkpoint's KDA layers; every other name is
        counted as ignored. None when it has no KDA parameter.

        Raises:
            CheckpointError: KDA parameters under several prefixes.
        """
        parsed = [(n, loc) for n in names if (loc := param_location(n))]
        kda = [(n, (prefix, layer, suffix)) for n, (prefix, layer, suffix) in parsed
               if layer in self.layers and suffix in self.known]
        prefixes = {prefix for _, (prefix, _, suffix) in kda if suffix in self.markers}
        prefixes = prefixes or {prefix for _, (prefix, _, _) in kda}
        if not prefixes:
            return None
        if len(prefixes) > 1:
            raise CheckpointError(
                f"{where}: KDA parameters under several prefixes {sorted(prefixes)}; "
                "cannot tell which stack holds the engine's KDA layers"
            )
        (prefix,) = prefixes
        layers: dict[int, dict[str, str]] = {}
        for n, (found, layer, suffix) in kda:
            if found == prefix:
                layers.setdefault(layer, {})[suffix] = n
        return _Selected(prefix, layers, len(names) - sum(map(len, layers.values())))

    def no_kda(self, where: str) -> CheckpointError:
        """The refusal of a dump without any KDA parameter."""
        return CheckpointError(
            f"{where}: no KDA parameter of the checkpoint's KDA layers {list(self.layers)} "
            "(no ...layers.{i}.self_attn.A_log or other name an engine layout knows); is it a "
            f"dump of this model ({_FAMILY_NAMES[self.family]}, {self.source.path})?"
        )

    def layout(self, suffixes: Iterable[str], where: str) -> EngineLayout:
        """The layout the names fit (the forced one, if any), checked against the plan.

        Raises:
            EngineLayoutError: no layout, or several, fit the names; the layout does not fit
                the checkpoint's plan.
        """
        if self.forced is not None:
            layout = self.forced
        else:
            suffixes = set(suffixes)
            found = recognise(suffixes, self.family)
            elsewhere = [] if found else [
                lay.name for lay in recognise(suffixes, None) if lay.family != self.family]
            if elsewhere:
                raise EngineLayoutError(self.wrong_checkpoint(where, elsewhere))
            if not found:
                raise EngineLayoutError(
                    f"{where}: no {self.family} engine layout has the parameter names "
                    f"{sorted(suffixes)}; known layouts: {', '.join(LAYOUTS)}; pass "
                    "--engine (engine=) to audit against one anyway"
                )
            if len(found) > 1:
                raise EngineLayoutError(
                    f"{where}: the parameter names fit several engine layouts: "
                    f"{', '.join(lay.name for lay in found)}; pass --engine (engine=) to pick one"
                )
            (layout,) = found
        layout.params_for(self.shard(0).plan)
        return layout

    def elsewhere(self, suffixes: set[str], layout: EngineLayout, where: str) -> str | None:
        """When ``layout`` (recognised, not forced) lacks some of the names' parameters while a
        layout of another model family has them all, the note that the checkpoint is likely
        not the one the dump was loaded from."""
        if self.forced is not None or not layout.required - suffixes:
            return None
        others = [lay.name for lay in recognise(suffixes, None)
                  if lay.family != self.family and not lay.required - suffixes]
        return self.wrong_checkpoint(where, others) if others else None

    def wrong_checkpoint(self, where: str, layouts: Sequence[str]) -> str:
        """The message for names that are those of ``layouts``, of another model family."""
        return (f"{where}: these names are {' or '.join(layouts)}'s; is {self.source.path} the "
                "checkpoint this dump was loaded from? its config is "
                f"{_FAMILY_NAMES[self.family]}")

    def engine_params(self, rank: int, layout: EngineLayout) -> list[tuple[int, EngineParam]]:
        """The rank's engine parameters in the audited layers (a pipeline stage's only)."""
        return [(layer, param) for layer, param in self.shard(rank).engine_params(layout)
                if layer in self.layers]

    def run(self, records: Mapping[str, Any], rank: int, selected: _Selected,
            layout: EngineLayout, report: AuditReport,
            advance: Callable[[int], None] | None) -> None:
        """Audit every KDA parameter of every KDA layer of one rank into ``report``."""
        report.ignored += selected.ignored
        candidates: _Candidates | None = None
        expected: dict[int, set[str]] = {}
        rank_dtype = self.model_dtype(records, rank, selected, layout)
        for layer, param in self.engine_params(rank, layout):
            if candidates is None or candidates.layer != layer:
                candidates = _Candidates(self.source, self.shard, rank, layer)
            expected.setdefault(layer, set()).add(param.suffix)
            name = selected.layers.get(layer, {}).get(
                param.suffix, param_name(selected.prefix, layer, param.suffix))
            report.params.append(self.param(rank, layer, name, records.get(name), layout,
                                            param.suffix, candidates, rank_dtype))
            if advance:
                advance(1)
        # Names of another quantization form (scale grids of unquantized weights).
        report.ignored += sum(len(set(selected.layers.get(layer, {})) - suffixes)
                              for layer, suffixes in expected.items())

    def follows_model(self, rank: int, layout: EngineLayout, suffix: str) -> bool:
        """Whether the engine casts parameter ``suffix`` to its model dtype (not a dtype the
        layout fixes, such as F32 ``A_log``, nor FP8 parts or a scale grid)."""
        return self.shard(rank).param_plan(layout, suffix, model_dtype="F64").dtype == "F64"

    def model_dtype(self, records: Mapping[str, Any], rank: int, selected: _Selected,
                    layout: EngineLayout) -> str | None:
        """The rank's model dtype: the float dtype most of its parameters that follow the
        model dtype are dumped in (ties: the first such parameter's); None when none is a
        float. An engine casts all those parameters to one dtype, so one in another dtype is
        wrong (:meth:`param` says so, naming both)."""
        seen: Counter[str] = Counter()
        for layer, param in self.engine_params(rank, layout):
            name = selected.layers.get(layer, {}).get(param.suffix)
            dtype = _dtype_name(records.get(name)) if name is not None else None
            if dtype in _CASTABLE and self.follows_model(rank, layout, param.suffix):
                seen[dtype] += 1
        return seen.most_common(1)[0][0] if seen else None

    def param(self, rank: int, layer: int, name: str, value: Any, layout: EngineLayout,
              suffix: str, candidates: _Candidates, rank_dtype: str | None = None
              ) -> ParamAudit:
        """One parameter's verdict. The engine's model dtype is taken to be ``rank_dtype``
        (the rank's, :meth:`model_dtype`), else the dumped parameter's (a float); else
        (missing, or not a float) the first part's. A parameter that follows the model dtype
        in another float dtype than ``rank_dtype`` is a mismatch naming both."""
        shard = self.shard(rank)
        record = None if value is None else _record(name, value)
        parts = layout.param(suffix).parts
        model_dtype = (rank_dtype if rank_dtype is not None
                       else record.dtype if record is not None and record.dtype in _CASTABLE
                       else shard.plan[parts[0]].dtype if parts else None)
        plan = shard.param_plan(layout, suffix, model_dtype=model_dtype)
        if record is None:
            return ParamAudit(rank, layer, name, "missing",
                              f"missing: {layout.name} holds {suffix} {list(plan.shape)} here")
        if (rank_dtype is not None and record.dtype in _CASTABLE and record.dtype != rank_dtype
                and self.follows_model(rank, layout, suffix)):
            return ParamAudit(rank, layer, name, "mismatch",
                              f"dtype {record.dtype}, expected {rank_dtype} (the model dtype of "
                              "this rank's other parameters: an engine casts them all to one "
                              "model dtype)")
        if _exact_in_place(record, plan, candidates):
            return ParamAudit(rank, layer, name, "exact")
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below
            expected = shard.build_param(layout, suffix, layer, model_dtype=model_dtype)
        result = _compare(rank, layer, name, record, plan, expected.reshape(-1), candidates)
        overflow = _overflow(plan, expected.reshape(-1), candidates)
        if overflow is None:
            return result
        # Every rank's slice may cast to the same infinities: the bytes prove nothing.
        problem = overflow if result.passed else f"{overflow}; {result.problem}"
        return ParamAudit(rank, layer, name, "mismatch", problem, result.differences,
                          result.equals)


def audit(
    state_dict: Mapping[str, Any],
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    *,
    tp_rank: int,
    tp_size: int,
    engine: str | None = None,
    layers: Iterable[int] | None = None,
) -> AuditReport:
    """Check every KDA parameter one rank of a serving engine holds against the checkpoint.

    For every KDA layer of the checkpoint (from its config) and every parameter the engine's
    layout has (:mod:`kda_tp.engines`), the expected bytes are built with
    :meth:`KdaShardedSource.build_param <kda_tp.KdaShardedSource.build_param>` (what the
    engine's loader leaves in the parameter: this rank's slices of the plan tensors in the
    layout's order, padding zero, cast to the parameter's dtype: the layout's fixed one, e.g.
    F32 for ``A_log``, else the dumped parameter's own, as the engine casts to its model
    dtype) and compared byte for byte with the dump. A parameter that differs is diagnosed
    (:class:`ParamAudit`, :class:`PartDifference`).

    Args:
        state_dict: the rank's parameters by name (e.g. ``model.state_dict()``, or the tensors
            of its ``save_sharded_state`` files): numpy arrays, torch tensors (any device;
            only the KDA parameters are copied to the CPU) or :class:`~kda_tp.Tensor`
            records. Names may carry any model prefix (``model.``,
            ``language_model.model.``): the KDA parameters are the
            ``...layers.{i}.self_attn.<param>`` of the checkpoint's KDA layers under the
            prefix where ``A_log`` lies. Every other name is counted and ignored.
        checkpoint: the checkpoint the engine loaded (directory, ``.safetensors`` file or
            :class:`~kda_tp.SafetensorsSource`), with its ``config.json``.
        tp_rank: the rank ``state_dict`` belongs to.
        tp_size: the engine's tensor-parallel world size.
        engine: a layout name (:data:`kda_tp.engines.LAYOUTS`, e.g. ``"vllm-0.33-k3"``);
            None recognises it from the parameter names and the checkpoint's model family.
        layers: the 0-based KDA layers this rank holds (a pipeline-parallel stage's), each a
            KDA layer of the checkpoint; None: every KDA layer of the checkpoint.

    Returns:
        The report: ``passed``, and one :class:`ParamAudit` per KDA parameter of every KDA
        layer (a parameter the layout has and ``state_dict`` lacks is ``"missing"``).

    Raises:
        CheckpointError: the checkpoint cannot be read or has no config; ``layers`` names a
            layer that is not a KDA layer; ``state_dict`` holds no KDA parameter, KDA
            parameters under several prefixes, a key that is not a ``str``, or a value that
            is not an array.
        ShapeMismatchError: a :class:`~kda_tp.Tensor` record whose data is not its shape's
            size in bytes.
        EngineLayoutError: no layout, or several, fit the names (the message lists them; names
            of another model family's layout mean the checkpoint is likely the wrong one); an
            unknown ``engine``; a layout that does not fit the checkpoint (e.g. another
            output-gate form).
        PlanError: ``tp_size`` or ``tp_rank`` is not an integer (a bool included), ``tp_size``
            does not divide the heads, or ``tp_rank`` is out of range.
    """
    tp_size, tp_rank = _whole("tp_size", tp_size, 1), _whole("tp_rank", tp_rank, 0)
    names = list(state_dict.keys())
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"state_dict: the key {name!r} ({type(name).__name__}) is not a "
                                  "parameter name (a str)")
    auditor = _Auditor(checkpoint, tp_size, engine, layers)
    selected = auditor.select(names, "state_dict")
    if selected is None:
        raise auditor.no_kda("state_dict")
    layout = auditor.layout(_suffixes(selected), "state_dict")
    report = AuditReport(layout.name, tp_size, (tp_rank,))
    note = auditor.elsewhere(_suffixes(selected), layout, "state_dict")
    report.problems += [note] if note else []
    auditor.run(state_dict, tp_rank, selected, layout, report, None)
    return report


def _suffixes(selected: _Selected) -> set[str]:
    return {s for names in selected.layers.values() for s in names}


def _whole(what: str, value: Any, low: int) -> int:
    """``value`` as an int ``>= low``.

    Raises:
        PlanError: a bool, not an integer, or below ``low``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise PlanError(f"{what} must be an integer >= {low}, got {value!r}")
    return int(value)


def _meta_int(meta: Mapping[str, Any], key: str, path: Path) -> int | None:
    """A file header's metadata ``key`` as a rank or size; None when absent or not ASCII
    digits (``str.isdigit`` is also true for ``"²"``, which ``int`` refuses).

    Raises:
        CheckpointError: ASCII digits, but more than ``kda_tp.config.MAX_INT_DIGITS``.
    """
    value = meta.get(key)
    if isinstance(value, str) and _ASCII_INT.fullmatch(value):
        return parse_metadata_int(value, key, str(path))
    return None


def _same_family(model: str, family: str) -> bool:
    """Whether a dump's ``model`` metadata (``"kimi_linear"``, ``"GLM-5.3-Flash"``, ``"k3"``)
    names ``family`` (one of the words of either holds all the other's)."""
    a, b = (set(re.split(r"[-_ ]+", x.lower())) for x in (model, family))
    return a <= b or b <= a


class _RankFiles(Mapping[str, Tensor]):
    """One rank's tensors across its ``save_sharded_state`` files (parts, pipeline stages)."""

    def __init__(self, files: Sequence[Path]):
        # Every part stays open: past RLIMIT_NOFILE, say so rather than blame one part.
        limit = open_files_error(len(files), files[0].parent if files else ".")
        if limit is not None:
            raise limit
        self.sources = [SafetensorsSource(f) for f in files]
        self.where: dict[str, SafetensorsSource] = {}
        for source in self.sources:
            for name in source.names():
                if name in self.where:
                    raise CheckpointError(
                        f"{name} is in both {self.where[name].path} and {source.path}; "
                        "a rank's sharded_state files hold each parameter once"
                    )
                self.where[name] = source

    def __getitem__(self, name: str) -> Tensor:
        if name not in self.where:
            raise KeyError(name)
        return checked_get(self.where[name], name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.where)

    def __len__(self) -> int:
        return len(self.where)

    def check(self, rank: int, tp_size: int, how: str, family: str) -> str | None:
        """Compare the files' header metadata (``tp_size``, ``tp_rank``, ``model``, where an
        engine or tool wrote them) with the audit's world size, ``rank`` (taken ``how``) and
        the checkpoint's ``family``; returns the note on a ``model`` of another family.

        Raises:
            PlanError: the metadata's ``tp_size`` or ``tp_rank`` disagrees.
        """
        note = None
        for source in self.sources:
            meta = source.files()[0][1] or {}
            size = _meta_int(meta, "tp_size", source.path)
            found = _meta_int(meta, "tp_rank", source.path)
            if size is not None and size != tp_size:
                raise PlanError(f"{source.path}: the dump's metadata says tp_size {size}; pass "
                                f"--tp-size {size} (tp_size=), not {tp_size}")
            if found is not None and found != rank:
                raise PlanError(f"{source.path}: the dump's metadata says tp_rank {found}, "
                                f"{how} says rank {rank}; pass --rank {found} (rank=)")
            model = meta.get("model")
            if note is None and isinstance(model, str) and not _same_family(model, family):
                note = (f"{source.path}: the dump's metadata says model {model!r}; the "
                        f"checkpoint's config is {_FAMILY_NAMES[family]}")
        return note


def audit_path(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    tp_size: int,
    rank: int | None = None,
    engine: str | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> AuditReport:
    """:func:`audit` on files: a ``save_sharded_state`` directory, or one rank's file.

    A directory holds ``model-rank-{r}-part-{p}.safetensors`` (vLLM, SGLang) or
    ``model-pp-{pp}-tp-{r}-part-{p}.safetensors`` (vLLM with pipeline stages) files; a rank's
    files together are its state dict. Every rank ``0..tp_size-1`` is audited and must be
    there: a missing rank is a problem in the report (it does not pass), not a refusal, so the
    ranks that are there are still audited; a rank whose files hold no KDA parameter has them
    all ``"missing"``. With ``rank``, only that rank is audited (and only it must be there). A
    single ``.safetensors`` file is one rank's whole state dict; its rank is ``rank``, else the
    one in its name, else its header's ``tp_rank`` metadata. Where the files' header metadata
    has ``tp_size``/``tp_rank``, they must agree with ``tp_size`` and the rank; a ``model`` of
    another family than the checkpoint's is a problem in the report.

    Args:
        checkpoint: the checkpoint the engine loaded.
        path: the directory given to ``save_sharded_state``, or one rank's ``.safetensors``.
        tp_size: the engine's tensor-parallel world size.
        rank: see above.
        engine: see :func:`audit`; the ranks' names must fit one layout.
        progress: called once with the number of parameters to check; returns
            ``advance(n)``, called after each (as for :func:`~kda_tp.shard.verify_shards`).

    Raises:
        CheckpointError: ``path`` does not exist, is a directory without ``sharded_state``
            files, holds files of ranks ``>= tp_size`` (the message lists the ranks found: the
            world size is another), no rank's files hold a KDA parameter, or a file's rank is
            not known (its metadata's ``tp_rank`` not ASCII digits); and as :func:`audit`.
        EngineLayoutError: as :func:`audit`; also when ranks fit different layouts.
        PlanError: as :func:`audit`; also when the files' ``tp_size``/``tp_rank`` metadata
            disagree with ``tp_size`` or the rank.
    """
    root = Path(path)
    tp_size = _whole("tp_size", tp_size, 1)
    rank = None if rank is None else _whole("rank", rank, 0)
    auditor = _Auditor(checkpoint, tp_size, engine)
    # The plan refuses a tp_size the checkpoint's heads cannot split (so tp_size <= heads)
    # before anything is listed or reported per rank.
    auditor.shard(0)
    if root.is_dir():
        files = sharded_state_files(root)
        beyond = [r for r in files if r >= tp_size]
        if beyond:
            raise CheckpointError(
                f"{root}: holds the files of ranks {sorted(files)}, but tp_size is {tp_size}; "
                "pass the world size the engine ran with"
            )
        wanted = list(range(tp_size)) if rank is None else [rank]
        how = "its name"
    elif root.is_file():
        found = rank if rank is not None else _rank_of_file(root)
        files, wanted = {found: [root]}, [found]
        how = "--rank (rank=)" if rank is not None else "its name"
    else:
        raise CheckpointError(f"{root}: no such file or directory")
    for r in wanted:
        if not 0 <= r < tp_size:
            raise PlanError(f"rank {r} is not a rank of tp_size {tp_size} (0..{tp_size - 1})")
    report = AuditReport("", tp_size)
    noted = False  # the dump's model metadata named another family (said once, first)
    dumps: list[tuple[int, _RankFiles, _Selected | None]] = []
    for r in wanted:
        if r not in files:
            report.problems.append(
                f"{root}: rank {r} of {tp_size} is missing (no model-rank-{r}-part-*"
                f".safetensors or model-pp-*-tp-{r}-part-*.safetensors)"
            )
            continue
        records = _RankFiles(files[r])
        note = records.check(r, tp_size, how, auditor.family)
        if note is not None and not noted:
            report.problems.insert(0, note)
            noted = True
        where = str(files[r][0]) if len(files[r]) == 1 else f"{root} rank {r}"
        dumps.append((r, records, auditor.select(list(records), where)))
    present = [(r, selected) for r, _, selected in dumps if selected is not None]
    if dumps and not present:
        error = auditor.no_kda(str(root))
        raise CheckpointError("; ".join([str(error), *report.problems])) from None
    report.ranks = tuple(r for r, *_ in dumps)
    if not present:  # every wanted rank is missing
        report.engine = engine or "-"
        return report
    layout = _common_layout(auditor, root, present, report.problems)
    report.engine = layout.name
    note = auditor.elsewhere(set().union(*(_suffixes(s) for _, s in present)), layout, str(root))
    report.problems += [note] if note else []
    total = sum(len(auditor.engine_params(r, layout)) for r, *_ in dumps)
    advance = progress(total) if progress else None
    for r, records, selected in dumps:
        if selected is None:  # this rank's KDA parameters are all missing
            selected = _Selected(present[0][1].prefix, {}, len(records))
        auditor.run(records, r, selected, layout, report, advance)
    return report


def _common_layout(auditor: _Auditor, root: Path, present: Sequence[tuple[int, _Selected]],
                   notes: Sequence[str]) -> EngineLayout:
    """The one layout every rank's KDA parameter names fit (together).

    Raises:
        EngineLayoutError: no layout or several fit (``notes``, e.g. the dump's ``model``
            metadata, appended), or the ranks fit different layouts.
    """
    try:
        return auditor.layout(set().union(*(_suffixes(s) for _, s in present)), str(root))
    except EngineLayoutError as error:
        if len(present) > 1:  # which ranks disagree
            layouts = [(r, auditor.layout(_suffixes(s), f"{root} rank {r}")) for r, s in present]
            if len({lay.name for _, lay in layouts}) > 1:
                raise EngineLayoutError(
                    f"{root}: the ranks' parameter names fit different layouts "
                    f"({', '.join(f'rank {r}: {lay.name}' for r, lay in layouts)}); pass "
                    "--engine (engine=) to audit every rank against one"
                ) from None
        raise EngineLayoutError("; ".join([str(error), *notes])) from None


def _rank_of_file(path: Path) -> int:
    """The rank of one dumped file: from its ``save_sharded_state`` name, else its header's
    ``tp_rank`` metadata.

    Raises:
        CheckpointError: neither says, or the metadata's ``tp_rank`` is not a rank.
    """
    found = _rank_of_name(path.name)
    if found is not None:
        return found
    meta = SafetensorsSource(path).files()[0][1] or {}
    found = _meta_int(meta, "tp_rank", path)
    if found is not None:
        return found
    if "tp_rank" in meta:
        raise CheckpointError(
            f"{path}: its metadata's tp_rank {meta['tp_rank']!r} is not a rank (0, 1, ...); "
            "pass --rank (rank=)"
        )
    raise CheckpointError(
        f"{path}: its rank is not in its name (model-rank-{{r}}-part-{{p}}.safetensors) nor in "
        "its metadata (tp_rank); pass --rank (rank=)"
    )
