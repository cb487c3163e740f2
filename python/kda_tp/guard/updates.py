"""The guard after a weight update: what the update fed is the reference.

An RL refit has no checkpoint on disk: the bytes a rank must hold after it are this rank's
slices, by the plan and the engine's layout, of the checkpoint-format tensors the update handed
to the model's ``load_weights``. :class:`UpdateCheck` builds that reference as the tensors pass
(:meth:`UpdateCheck.wrap` around the iterator the engine consumes): of each KDA tensor it keeps
only this rank's slice (a copy, on the host), never the full tensor, and nothing of any other
tensor. When the update ends (one ``load_weights`` call, or a whole session: a reload, a
weight-transfer session whose parts arrive in several calls), :meth:`UpdateCheck.check`
compares every region of every KDA parameter the update touched with what was fed for it, byte
for byte, in the parameter's dtype (the engine's cast of the fed values).

A region that differs is named with what it holds instead, when kda_tp can tell without any
other rank's data:

* what was fed for another part of the same layer (``q_proj``'s slice in ``k_proj``'s place);
* the values from before the update (the engine never applied what was fed): each region's
  sampled fingerprint is taken when its part is first fed, before the engine applies it;
* else the first differing element, expected and found.

This module imports no engine and no torch; torch tensors (any device) are sliced in torch and
only the slice is copied to the host.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _native
from ..audit.values import as_record
from ..checkpoint.names import checkpoint_suffix, decoder_prefix, kda_layer_indices
from ..checkpoint.reader import SafetensorsSource, numpy_dtype, shard_bytes
from ..engines.dtype import model_dtype_name
from ..engines.layout import EngineLayout
from ..engines.registry import get_layout, model_family, param_location, recognise
from ..errors import CheckpointError, EngineLayoutError, GuardError, KdaTpError
from ..model.quant import SCALE_SUFFIXES
from ..rank.plan import KdaTensorPlan, KdaTpPlan
from .first_load import CHECKPOINT_ENV, MODE_ENV, cannot_check, derived_problem, mode

__all__ = ["FINGERPRINT_ELEMENTS", "Followed", "UpdateCheck", "UpdateReport", "follow",
           "followed", "warn_once"]

logger = logging.getLogger("kda_tp.guard")

#: Elements sampled (evenly spaced) per region for the fingerprint of its values before an
#: update, which tells "never applied" apart from other wrong values.
FINGERPRINT_ELEMENTS = 64


@dataclass
class UpdateReport:
    """What :meth:`UpdateCheck.check` found.

    Attributes:
        params: KDA parameters the update touched (some part of them was fed).
        regions: regions (a part of one parameter) checked.
        bytes: bytes of the regions checked, in the parameters' dtypes.
        seconds: wall time of the check, in seconds (feeding not included).
        problems: one line per wrong region (``"<param name>: <part>: ..."``), or per fed
            tensor that could not be placed; empty when every touched region holds what was
            fed.
    """

    params: int = 0
    regions: int = 0
    bytes: int = 0
    seconds: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every region the update touched holds exactly what was fed for it."""
        return not self.problems


@dataclass(frozen=True)
class _Place:
    """One region of one engine parameter: the parameter's name and its elements."""

    name: str
    suffix: str
    dtype: str
    start: int
    stop: int


class UpdateCheck:
    """One rank's reference for one weight update, built from what the update feeds.

    Args:
        checkpoint: a local checkpoint directory (or ``.safetensors`` file) of the model, for
            its config and tensor headers: the geometry and the plan (an RL refit changes
            values, not shapes). Its values are never read.
        params: the rank's parameters as the engine holds them now, before the update
            (``model.named_parameters()``): the KDA ones are found by name and the layout is
            recognised from them. They are read again when a part is first fed (its
            regions' fingerprints, before the engine applies it) and after the update.
        tp_rank: this rank in the engine's tensor-parallel group.
        tp_size: that group's size.
        engine: a layout name (``kda_tp.engines.LAYOUTS``); None: recognised from the names.

    Raises:
        CheckpointError: the checkpoint cannot be read, has no config, or its config has no
            KDA layer.
        EngineLayoutError: no layout, or several, fit the parameter names, or the layout does
            not fit the plan.
        PlanError: the world size does not divide the heads.
    """

    def __init__(self, checkpoint: str | os.PathLike[str], params: Mapping[str, Any], *,
                 tp_rank: int, tp_size: int, engine: str | None = None):
        self.plan, self.prefix, layers, family = _geometry(os.fspath(checkpoint), tp_rank,
                                                           tp_size)
        # Checkpoint suffix (after `self_attn.`) -> (part name in the layouts, its plan).
        self._parts: dict[str, tuple[str, KdaTensorPlan]] = {}
        for t in self.plan.tensors:
            self._parts[checkpoint_suffix(t.name)] = (t.name, t)
            if t.scale is not None:
                for spelling in SCALE_SUFFIXES:
                    self._parts[f"{t.name}.{spelling}"] = (f"{t.name}.scale", t.scale)
        found: dict[tuple[int, str], str] = {}
        for name in params:
            location = param_location(name) if isinstance(name, str) else None
            if location is not None and location[1] in layers:
                found[(location[1], location[2])] = name
        self.layout = self._layout({s for _, s in found}, family, engine)
        known = self.layout.suffixes
        self._names = {key: name for key, name in found.items() if key[1] in known}
        # (layer, part) -> the regions it fills.
        self._places: dict[tuple[int, str], list[_Place]] = {}
        for param in self.layout.params_for(self.plan):
            for layer in sorted(layers):
                held = self._names.get((layer, param.suffix))
                if held is None:
                    continue  # another pipeline stage's layer, or a parameter the engine lacks
                plan = self.layout.param_plan(param.suffix, self.plan, _dtype(params[held]))
                size = numpy_dtype(plan.dtype).itemsize
                for region in plan.regions:
                    self._places.setdefault((layer, region.part), []).append(_Place(
                        held, param.suffix, plan.dtype, region.byte_range[0] // size,
                        region.byte_range[1] // size))
        # Each region's fingerprint before the update, taken when its part is first fed
        # (before the engine applies it): (layer, part) -> {parameter name: fingerprint}.
        self._before: dict[tuple[int, str], dict[str, bytes | None]] = {}
        self._fed: dict[tuple[int, str], tuple[str, np.ndarray]] = {}
        # Parts found applied right after they were fed (:meth:`wrap`): (layer, part) -> the
        # fed name and each region's sampled fingerprint then; no copy kept.
        self._verified: dict[tuple[int, str], tuple[str, dict[str, bytes | None]]] = {}
        self._objects = {name: params[name] for name in self._names.values()}
        self._unplaced: list[str] = []

    @staticmethod
    def _layout(suffixes: set[str], family: str, engine: str | None) -> EngineLayout:
        if engine is not None:
            return get_layout(engine)
        fitting = recognise(suffixes, family)
        if len(fitting) != 1:
            raise EngineLayoutError(
                f"the engine's KDA parameter names {sorted(suffixes)} fit "
                f"{'no' if not fitting else 'several'} {family} engine layouts"
                f"{': ' + ', '.join(lay.name for lay in fitting) if fitting else ''}")
        return fitting[0]

    def _part(self, name: Any) -> tuple[int, str, KdaTensorPlan] | None:
        """``(layer, part, plan entry)`` of a fed name, None for a name of no KDA region of
        this rank."""
        location = param_location(name) if isinstance(name, str) else None
        if location is None or location[0] != self.prefix:
            return None
        _, layer, suffix = location
        part = self._parts.get(suffix)
        if part is None or (layer, part[0]) not in self._places:
            return None
        return layer, part[0], part[1]

    def feed(self, name: Any, tensor: Any) -> None:
        """Take note of one tensor the update hands to the model: for a KDA tensor of one of
        the engine's KDA layers (its checkpoint name, under the checkpoint's decoder prefix),
        a host copy of this rank's slice; nothing for any other name. A tensor fed twice
        counts with its last value (as the engine applies it last)."""
        found = self._part(name)
        if found is None:
            return
        layer, label, t = found
        self._remember(layer, label)
        self._verified.pop((layer, label), None)
        if isinstance(tensor, np.ndarray) and tensor.dtype == numpy_dtype(t.dtype) \
                and tensor.nbytes == t.full_bytes:
            # The checkpoint's own dtype: the rank's bytes by the plan (a view of a row range,
            # o_proj's columns gathered), copied by the core's threads.
            local = shard_bytes(t, tensor)
            if t.byte_range is not None:
                kept = np.empty(local.nbytes, np.uint8)
                _native.copy_into(local, kept)
                local = kept
            self._fed[(layer, label)] = (name, local.view(tensor.dtype))
            return
        try:
            view = tensor.reshape(t.full_rows, t.full_row_elems)
        except (RuntimeError, ValueError, AttributeError):
            shape = list(getattr(tensor, "shape", ()))
            self._unplaced.append(
                f"{name}: fed with shape {shape}, which does not hold the "
                f"{t.full_rows * t.full_row_elems} elements of {label} the plan places; the "
                "update cannot be right")
            return
        rows = slice(t.src_row_offset, t.src_row_offset + t.local_rows)
        cols = slice(t.src_col_offset, t.src_col_offset + t.local_row_elems)
        local = view[rows, cols]
        if hasattr(local, "contiguous"):
            local = local.contiguous()
        record = as_record(name, local)
        self._fed[(layer, label)] = (name, np.array(record.array, copy=True).reshape(-1))

    def wrap(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """``weights``, each pair passed on unchanged, what the engine's ``load_weights``
        consumes. When the engine asks for the next pair, the last KDA one has usually been
        applied: its regions are compared then, on the tensors' own device, with this rank's
        slice of what was fed (a view, no copy); found right, only a sampled fingerprint of
        each region is kept (re-checked at the end), else a host copy of the slice is kept
        (:meth:`feed`) for the end of the update: a layer an engine applies only when all its
        parts are in (vLLM's layerwise reload), or a wrong one. Kept copies of the same layer
        are retried each time, so memory stays about one layer's parts of this rank."""
        for name, tensor in weights:
            found = self._part(name)
            if found is None:
                yield name, tensor
                continue
            layer, label, t = found
            self._remember(layer, label)
            yield name, tensor
            if not self._settle(layer, label, name, self._local(t, tensor)):
                self.feed(name, tensor)
            for key in [k for k in self._fed if k[0] == layer and k != (layer, label)]:
                kept_name, kept = self._fed[key]
                if self._settle(key[0], key[1], kept_name, kept):
                    del self._fed[key]

    def _remember(self, layer: int, label: str) -> None:
        """Take the fingerprints of part ``label``'s regions as they are before the update
        (once per update: the first time the part is fed)."""
        if (layer, label) not in self._before:
            self._before[(layer, label)] = {
                p.name: _fingerprint(self._objects[p.name], p)
                for p in self._places[(layer, label)]}

    @staticmethod
    def _local(t: KdaTensorPlan, tensor: Any) -> Any:
        """This rank's slice of a fed tensor, flat, as a view where the layout allows (numpy
        or torch on its device); None when the tensor does not hold the plan's elements."""
        try:
            view = tensor.reshape(t.full_rows, t.full_row_elems)
        except (RuntimeError, ValueError, AttributeError):
            return None
        return view[t.src_row_offset:t.src_row_offset + t.local_rows,
                    t.src_col_offset:t.src_col_offset + t.local_row_elems].reshape(-1)

    def _settle(self, layer: int, label: str, name: str, local: Any) -> bool:
        """Whether every region of part ``label`` holds ``local`` (what was fed for it) now;
        if so it is recorded as verified, with each region's fingerprint."""
        if local is None:
            return False
        places = self._places[(layer, label)]
        if not all(_equal_now(self._objects[p.name], p, local) for p in places):
            return False
        self._verified[(layer, label)] = (name, {
            p.name: _fingerprint(self._objects[p.name], p) for p in places})
        return True

    @property
    def kept_bytes(self) -> int:
        """Host bytes the reference holds now: this rank's slices of the KDA tensors fed."""
        return sum(array.nbytes for _, array in self._fed.values())

    @property
    def touched(self) -> bool:
        """Whether any KDA tensor of this rank's layers was fed (or could not be placed)."""
        return bool(self._fed or self._verified or self._unplaced)

    def check(self, params: Mapping[str, Any]) -> UpdateReport:
        """Compare every region the update touched with what was fed for it.

        Args:
            params: the rank's parameters now, after the update (``named_parameters()``:
                parameters an engine re-registered are looked up again by name).

        Returns:
            The :class:`UpdateReport` (``problems`` empty when all is right).
        """
        start = time.perf_counter()
        report = UpdateReport(problems=list(self._unplaced))
        arrays: dict[str, np.ndarray] = {}
        touched: set[str] = set()
        for (layer, part), (fed_name, prints) in self._verified.items():
            for place in self._places[(layer, part)]:
                value = params.get(place.name)
                touched.add(place.name)
                report.regions += 1
                report.bytes += (place.stop - place.start) * numpy_dtype(place.dtype).itemsize
                if value is None:
                    report.problems.append(f"{place.name}: missing after the update")
                elif _fingerprint(value, place) != prints[place.name]:
                    report.problems.append(
                        f"{place.name}: {part}: {fed_name} was applied, then changed before "
                        "the update ended (its sampled elements differ from what was fed)")
        for (layer, part), (fed_name, fed) in self._fed.items():
            for place in self._places[(layer, part)]:
                value = params.get(place.name)
                if value is None:
                    report.problems.append(f"{place.name}: missing after the update")
                    continue
                if place.name not in arrays:
                    arrays[place.name] = as_record(place.name, value).array.reshape(-1)
                touched.add(place.name)
                got = arrays[place.name][place.start:place.stop]
                report.regions += 1
                report.bytes += got.nbytes
                problem = self._compare(layer, part, place, got, fed_name, fed, value, arrays)
                if problem:
                    report.problems.append(f"{place.name}: {part}: {problem}")
        report.params = len(touched)
        report.seconds = time.perf_counter() - start
        return report

    def _compare(self, layer: int, part: str, place: _Place, got: np.ndarray, fed_name: str,
                 fed: np.ndarray, value: Any, arrays: dict[str, np.ndarray]) -> str | None:
        """None when ``got`` holds ``fed`` cast to the parameter's dtype, else what it holds
        (another part fed: a kept copy, or a verified part's region as the engine holds it)."""
        if fed.size != got.size:
            return (f"{fed_name} was fed with {fed.size} elements for this rank, the engine's "
                    f"region holds {got.size}")
        want = _cast(fed, got.dtype)
        if _bytes_equal(got, want):
            return None
        others = [(key, fed_name_, _cast(array, got.dtype))
                  for key, (fed_name_, array) in self._fed.items()]
        for key, (fed_name_, _) in self._verified.items():
            for spot in self._places[key]:
                if spot.name not in arrays:
                    arrays[spot.name] = as_record(spot.name, self._objects[spot.name]
                                                  ).array.reshape(-1)
                others.append((key, fed_name_, arrays[spot.name][spot.start:spot.stop]))
        for (other_layer, other_part), other_name, other in others:
            if (other_layer == layer and other_part != part and other.size == got.size
                    and _bytes_equal(got, other)):
                return (f"holds what was fed as {other_name} (this rank's slice), not "
                        f"{fed_name}: parts swapped by the update's loader")
        before = self._before.get((layer, part), {}).get(place.name)
        if before is not None and before == _fingerprint(value, place) \
                and before != _sample_bytes(want, place.stop - place.start):
            return (f"holds the values from before the update: {fed_name} was fed but the "
                    "engine never applied it")
        first = int(np.flatnonzero(_bits(got) != _bits(want))[0])
        return (f"differs from what was fed as {fed_name} at element {first} (expected "
                f"{float(want[first])!r}, got {float(got[first])!r})")


@functools.lru_cache(maxsize=8)
def _geometry(checkpoint: str, tp_rank: int, tp_size: int
              ) -> tuple[KdaTpPlan, str, frozenset[int], str]:
    """The plan, decoder prefix, KDA layers and model family of a checkpoint for one rank,
    read once per process (its config and headers; an RL run refits values, not shapes)."""
    source = SafetensorsSource(checkpoint)
    return (KdaTpPlan.from_config(source, tp_rank, tp_size, qk_multiple=1),
            decoder_prefix(source), frozenset(kda_layer_indices(source, None)),
            model_family(source.config))


def _equal_now(value: Any, place: _Place, local: Any) -> bool:
    """Whether ``place``'s region of a parameter holds ``local`` (a fed slice, flat) cast to
    the parameter's dtype, bit for bit: torch on the parameter's device (nothing copied to
    the host), numpy as numpy. False when it cannot tell (meta, another kind of array)."""
    try:
        if hasattr(value, "detach") and hasattr(local, "detach"):
            import torch

            region = value.detach().reshape(-1)[place.start:place.stop]
            want = local.to(device=region.device, dtype=region.dtype)
            if region.numel() != want.numel() or region.is_meta:
                return False
            ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            kind = ints[region.element_size()]
            return bool(torch.equal(region.view(kind), want.contiguous().view(kind)))
        if isinstance(value, np.ndarray) and isinstance(local, np.ndarray):
            region = value.reshape(-1)[place.start:place.stop]
            return region.size == local.size and _bytes_equal(region, _cast(local, region.dtype))
    except (RuntimeError, ValueError, TypeError, KeyError, NotImplementedError):
        return False
    return False


def _dtype(value: Any) -> str | None:
    """The safetensors dtype name of a parameter's dtype (torch or numpy), None if unknown."""
    return model_dtype_name(getattr(value, "dtype", None))


def _cast(values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``values`` in ``dtype`` as an engine's ``copy_`` casts them (round to nearest even)."""
    if values.dtype == dtype:
        return values
    with np.errstate(over="ignore", invalid="ignore"):
        return values.astype(dtype)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(f"<u{a.dtype.itemsize}")


def _bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Byte equality (-0.0 and 0.0 differ, a NaN equals the same NaN), compared as the widest
    integers that tile both in 1 MiB chunks (about a memcpy's time; no temporary larger than
    a chunk)."""
    if a.nbytes != b.nbytes or a.dtype.itemsize != b.dtype.itemsize:
        return False
    x = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    y = np.ascontiguousarray(b).reshape(-1).view(np.uint8)
    word = next(w for w in (8, 4, 2, 1) if x.size % w == 0 and x.ctypes.data % w == 0
                and y.ctypes.data % w == 0)
    x, y = x.view(f"<u{word}"), y.view(f"<u{word}")
    step = (1 << 20) // word
    return all(np.array_equal(x[i:i + step], y[i:i + step]) for i in range(0, x.size, step))


def _indices(count: int) -> np.ndarray:
    """The evenly spaced element indices a fingerprint samples from ``count`` elements."""
    return np.unique(np.linspace(0, max(count - 1, 0), min(count, FINGERPRINT_ELEMENTS),
                                 dtype=np.int64))


def _sample_bytes(flat: np.ndarray, count: int) -> bytes:
    return np.ascontiguousarray(flat.reshape(-1)[_indices(count)]).tobytes()


def _fingerprint(value: Any, place: _Place) -> bytes | None:
    """The sampled elements of one region of a parameter (torch: gathered on its device, only
    the samples copied to the host); None when the parameter cannot be read (meta, lazy)."""
    index = _indices(place.stop - place.start) + place.start
    try:
        if hasattr(value, "detach"):
            import torch

            flat = value.detach().reshape(-1)
            picked = flat[torch.as_tensor(index, device=flat.device)]
            return bytes(as_record(place.name, picked.contiguous()).array.tobytes())
        return np.ascontiguousarray(np.asarray(value).reshape(-1)[index]).tobytes()
    except (CheckpointError, RuntimeError, ValueError, IndexError, NotImplementedError):
        return None


# ------------------------------------------------------------------------------------------
# Following a live model: every call of its load_weights after the first load is an update


@dataclass
class Followed:
    """How an engine plugin checks one model's updates (what :func:`follow` needs of it).

    Attributes:
        engine: the engine's name for the lines (``"vllm"``, ``"sglang"``).
        checkpoint: the local checkpoint whose config and headers give the plan (None: none;
            the updates are then not checked, with one warning).
        rank: ``(tp_rank, tp_size)`` of the engine's tensor-parallel group, now.
        params: the model's parameters as the layouts describe them, now.
        derived: the model's derived copies kda_tp knows (:data:`kda_tp.engines.DERIVED`), now.
        repair: run after every update before the derived copies are checked (the opt-in
            repair of stale caches; a no-op when off).
        ran: told each verdict line (the plugin's armed record).
        session: the open update session, if any.
        quiet: > 0 while a loader fills the model (its own full check covers that load).
    """

    engine: str
    checkpoint: Callable[[], str | None]
    rank: Callable[[], tuple[int, int]]
    params: Callable[[], Mapping[str, Any]]
    derived: Callable[[], Mapping[str, Any]]
    repair: Callable[[], None]
    ran: Callable[[str], None]
    session: UpdateCheck | None = None
    quiet: int = 0

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        """No update session while a loader fills the model (its own check covers it)."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    @contextlib.contextmanager
    def update(self, where: str) -> Iterator[UpdateCheck | None]:
        """One update session: opened now (unless one is open: then it joins that one),
        checked when the block ends without an error (:meth:`close`); yields the session
        (None when nothing is checked)."""
        if self.session is not None:
            yield self.session
            return
        session = self.open(where)
        try:
            yield session
        except BaseException:
            self.session = None
            raise
        self.close(where)

    def open(self, where: str) -> UpdateCheck | None:
        """Open an update session on the parameters as they are now; None, and no session,
        in mode ``off`` or without a local checkpoint config (one warning).

        Raises:
            GuardError: mode ``fail`` and the checkpoint's config cannot give the plan for the
                engine's parameters.
        """
        if mode() == "off":
            return None
        rank, size = self.rank()
        label = f"{self.engine} {where}: tp rank {rank}/{size}"
        path = self.checkpoint()
        if not path or "://" in path or not os.path.exists(path):
            warn_once(f"kda_tp guard: {label}: no local checkpoint config for the model ({path!r}); "
                  f"its weight updates are not checked (set {CHECKPOINT_ENV} to a local copy "
                  "of its config.json and safetensors files)")
            return None
        try:
            self.session = UpdateCheck(path, self.params(), tp_rank=rank, tp_size=size)
        except KdaTpError as error:
            cannot_check(f"kda_tp guard: {label}: cannot check the update against {path}: "
                         f"{error}")
        return self.session

    def close(self, where: str) -> None:
        """Check the open session (every region it touched) and the derived copies; the
        verdict as the mode says: INFO line, WARNING with the diagnosis, or raised.

        Raises:
            GuardError: mode ``fail`` and a KDA parameter or derived copy is wrong.
        """
        session, self.session = self.session, None
        if session is None:
            return
        rank, size = self.rank()
        params = self.params()
        report = session.check(params)
        self.repair()
        for name, value in self.derived().items():
            problem = derived_problem(name, value, params, session.layout.name)
            if isinstance(problem, str):
                report.problems.append(f"{name}: {problem}")
        if not session.touched and report.passed:
            return
        verdict = "OK" if report.passed else f"FAIL ({len(report.problems)} wrong)"
        line = (f"kda_tp guard: {self.engine} {where}: tp rank {rank}/{size}: {report.params} "
                f"KDA parameters updated ({session.layout.name}), {report.bytes} bytes, "
                f"{report.seconds:.3f} s: {verdict}")
        self.ran(line)
        if report.passed:
            logger.info("%s", line)
            return
        text = (f"{line}\nthe KDA weights this rank holds after the update differ from what "
                "the update fed:\n" + "\n".join(f"  rank {rank} {p}" for p in report.problems))
        if mode() == "fail":
            raise GuardError(text + f"\n(set {MODE_ENV}=warn to go on anyway)")
        logger.warning("%s", text)


_followed: weakref.WeakKeyDictionary[Any, Followed] = weakref.WeakKeyDictionary()
_warned: set[str] = set()


def warn_once(text: str) -> None:
    """One ``RuntimeWarning`` per process for a load or update path the guard cannot check
    (the same text again is not repeated)."""
    if text not in _warned:
        _warned.add(text)
        warnings.warn(text, RuntimeWarning, stacklevel=3)


def followed(model: Any) -> Followed | None:
    """The :class:`Followed` record of ``model``, or None when its updates are not followed."""
    return _followed.get(model)


def follow(model: Any, how: Followed) -> None:
    """Check every later update of ``model``: its own ``load_weights`` is wrapped (an instance
    attribute) so that each call feeds the open session of ``how``, or is one update by
    itself, checked when it returns. Idempotent (the first record stays).

    Raises:
        GuardError: from the wrapped ``load_weights``, in mode ``fail``, when the update left
            a KDA parameter wrong.
    """
    if model in _followed:
        return
    _followed[model] = how
    original = model.load_weights

    @functools.wraps(original)
    def load_weights(weights: Iterable[tuple[str, Any]], *args: Any, **kwargs: Any) -> Any:
        if how.quiet:
            return original(weights, *args, **kwargs)
        with how.update("load_weights") as session:
            fed = session.wrap(weights) if session is not None else weights
            return original(fed, *args, **kwargs)

    model.load_weights = load_weights
