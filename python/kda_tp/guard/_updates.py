"""The guard after a weight update: what the update fed is the reference.

An RL refit has no checkpoint on disk: the bytes a rank must hold after it are this rank's
slices, by the plan and the engine's layout, of the checkpoint-format tensors the update
handed to the model's ``load_weights``. An :class:`UpdateSession` takes them as they pass
(:meth:`UpdateSession.wrap`, around the iterator the engine consumes) for the rank's
:class:`~kda_tp.guard.RankTarget`, and :meth:`UpdateSession.close` returns an
:class:`UpdateReport`; the engine plugin logs, raises or records it. One session is one update:
one ``load_weights`` call, or every call between the two ends of an engine's session (vLLM's
layerwise reload, a weight-transfer session, SGLang's ``begin_weight_update`` /
``end_weight_update``).

What is checked, for every parameter the update touched (some part of it was fed), every
element of it, nothing sampled:

* each region that was fed holds what was fed, cast to the parameter's dtype by the engine's
  own cast (torch's ``Tensor.to`` for torch tensors; ``kda_tp.model.dtypes.cast_to``
  otherwise) and compared as the audit compares (``same_values``: a NaN matches any NaN);
  where the engine applies a NaN as "keep the old value" (its own NaN-sentinel copy, which
  the engine adapter recognises: vLLM's ``load_checkpoint_weight_patches``; ``Reader
  .masked_copy``), the reference is that copy applied to the region's values before the
  update, on this rank; any other replacement of ``torch.Tensor.copy_`` is not trusted;
* a fed region seen applied is verified then, in full, and its digest kept (:func:`_digest`:
  the Rust core's exact XXH3-128 of the region's bytes, read on every core, no copy; a host
  region is compared and hashed in one pass, :func:`_verified_digest`); at the end it must
  still have that digest (a later loader that overwrote it is named);
* each region that was not fed still holds what it held before the update: its digest is
  taken when the parameter is first touched, before the engine applies anything, and compared
  at the end; padding rows are zero;
* a parameter the engine repacked after the update (vLLM's CPU GEMM dispatch) is read where
  the engine reads it, through its GEMM (before the update too: a repacked or meta parameter
  is read back through the target, :meth:`RankTarget.held`), and a fed region judged element
  by element as the read-back carries values (``kda_tp.guard._repacked.read_back_difference``:
  the elements it cannot carry counted, "not checkable"); a region that cannot be read at all,
  before or after, is "not checked", which fails the update in mode ``fail``.

A wrong region is named with what it holds instead, when kda_tp can tell without any other
rank's data: what was fed for another part of the layer, in this session or in an earlier
call (an ``UpdateSession``'s ``memory``, kept by the plugin across calls: digests); the values
from before the update; else the first differing element, named as the first load names it: its
index in the parameter and in the part (``at [0, 5] (its [0, 5]; expected ...``). Memory stays about one layer's parts
of this rank: a part is verified on the tensors' own device right after the engine consumes it
(only its digest kept), and a host copy of this rank's slice is kept only while the engine has
not applied it (vLLM's layerwise reload applies a layer when all of it is in).

Nothing but report lines leaves a session: an error of the check itself is an ``unchecked``
line, never an exception into the engine's loader. This module imports no engine and no
torch; torch tensors come from the engine, so torch is imported already.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._native import digest as native_digest
from .._native import digest_if_equal
from ..checkpoint.reader import shard_bytes
from ..checkpoint.values import as_record, first_difference, same_tensor_values, same_values
from ..errors import KdaTpError
from ..model.dtypes import cast_to, numpy_dtype, torch_dtype
from ..rank.plan import KdaTensorPlan
from ._repacked import GEMM, read_back_difference, set_aside_line
from ._target import PADDING, Place, RankTarget

__all__ = ["Memory", "UpdateReport", "UpdateSession"]

#: What was last fed for each part, across the calls of a refit: ``(layer, part)`` -> ``(fed
#: name, {dtype: digest of what was fed, cast})``, kept by the plugin per model.
Memory = dict[tuple[int, str], tuple[str, dict[str, bytes]]]

#: Elements of a region compared first when asking whether the engine applied a part yet (an
#: early "not yet"; a "yes" is always the whole region compared).
_EARLY = 256


@dataclass
class UpdateReport:
    """What one update session found.

    Attributes:
        params: KDA parameters the update touched (some part of them was fed).
        regions: regions of them checked (fed parts, the others, padding), every element.
        bytes: bytes of those regions, in the parameters' dtypes.
        seconds: wall time of the final check, in seconds (feeding not included).
        fed: KDA tensors of this rank's layers fed.
        problems: one line per wrong region (``"<param name>: <part>: ..."``) or fed tensor
            that could not be placed; empty when every region holds what it must.
        unchecked: one line per check that could not run (a region the engine left
            unreadable, before or after the update; an error of the guard's own): the update
            is not checked (mode ``fail`` refuses it).
        repacked: one line per parameter the engine repacked after the update (vLLM's CPU
            GEMM dispatch) with elements its GEMM read-back cannot carry (a row holding a NaN
            or an infinity), counted: "not checkable", every other element of it judged.
        mla: MLA parameters (of a hybrid's MLA layers) among ``params``.
    """

    params: int = 0
    regions: int = 0
    bytes: int = 0
    seconds: float = 0.0
    fed: int = 0
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    repacked: list[str] = field(default_factory=list)
    mla: int = 0

    @property
    def passed(self) -> bool:
        """True when every region checked holds what it must and every check ran."""
        return not self.problems and not self.unchecked


@dataclass
class _Fed:
    """One part fed in this session: the name it came under and its reference per region,
    in one of three states: ``refs`` (this rank's slice of the fed tensor, or the engine's
    copy of it: views valid until the engine asks for the next tensor), ``copies`` (host
    copies in the regions' dtypes, once the engine asked for the next tensor, or its call
    ended, before it applied the part), or ``verified`` (the part was seen applied, in full:
    only each region's digest is kept)."""

    name: str
    refs: dict[Place, Any] = field(default_factory=dict)
    copies: dict[Place, np.ndarray] = field(default_factory=dict)
    verified: dict[Place, bytes] = field(default_factory=dict)


class UpdateSession:
    """One rank's check of one update, built from what the update feeds.

    Args:
        target: the rank's :class:`~kda_tp.guard.RankTarget` (its parameter objects
            are read before the engine applies each part and after the update).
        memory: what earlier calls of the refit fed (``Memory``), updated at
            :meth:`close`; None: a memory of this session only.
        model: the ``torch.nn.Module`` holding the parameters, for a session opened before
            anything is known of the update (one ``load_weights`` call): when the first KDA
            tensor comes, a target whose parameter objects the model no longer holds is
            rebuilt for the ones it holds (:meth:`RankTarget.rebuilt`). None: the target is
            current (checked when the session opened).
    """

    def __init__(self, target: RankTarget, memory: Memory | None = None, model: Any = None):
        self.target = target
        self._model = model
        self.memory: Memory = {} if memory is None else memory
        # Each touched parameter's regions' digests before the update (None: unreadable), and
        # how the parameter was read then (None as held, GEMM through the engine's GEMM).
        self._before: dict[str, dict[Place, bytes | None]] = {}
        self._before_how: dict[str, str | None] = {}
        self._fed: dict[tuple[int, str], _Fed] = {}
        self._pending: tuple[int, str] | None = None
        self._problems: list[str] = []
        self._unchecked: list[str] = []
        # How each parameter was read at the close (None as held, GEMM through the GEMM).
        self._how: dict[str, str | None] = {}
        self._now: Mapping[str, Any] | None = None
        #: The parameters :meth:`close` read, by name (None: the engine no longer holds it, or
        #: it cannot be read back), for the caller's checks after it (the derived copies).
        self.values: dict[str, Any] = {}
        self.count = 0
        #: The engine held the parameters on the meta device when the first KDA tensor came:
        #: a layerwise reload the guard did not see begin; the session goes on to its end.
        self.deferred = False

    # -- feeding -------------------------------------------------------------------------------

    def wrap(self, weights: Iterable[Any]) -> Iterator[Any]:
        """``weights`` (pairs, or triples with the loader's keyword arguments), each passed
        on unchanged, what the engine's ``load_weights`` consumes. A pair whose name is not a
        KDA tensor of this rank costs one dictionary lookup. A KDA one is noted before the
        engine gets it (the digests of its parameters, the reference) and verified when
        the engine asks for the next pair; a part not applied by then is copied to the host
        before the source is asked for that pair (a streamer may reuse its buffer)."""
        place = self.target.place
        for item in weights:
            try:
                name = item[0]
                hit = place(name) if isinstance(name, str) else None
            except (TypeError, IndexError, KeyError):  # not a pair: the engine's to refuse
                hit = None
            if hit is None:
                yield item
                continue
            self._contained(self._note, name, item[1], hit)
            yield item
            self._contained(self._settle_pending)
            # A streamer may reuse its buffer for the next pair (a loader's view of it, SGLang
            # GLM-5.3's cached_a_proj, then changes: SGLang #37369): this part, if not applied,
            # is copied before the source is asked again (earlier ones were, at their turn).
            fed = self._fed.get(hit[:2])
            if fed is not None:
                self._contained(self._copy, fed)

    def feed(self, name: str, tensor: Any) -> None:
        """Take note of one tensor the update hands to the model, which the engine applies
        later: this rank's slice kept as a host copy (nothing for a name that is not a KDA
        tensor of this rank). A tensor fed twice counts with its last value."""
        hit = self.target.place(name)
        if hit is not None:
            self._contained(self._note, name, tensor, hit)
            self._pending = None
            fed = self._fed.get(hit[:2])
            if fed is not None:
                self._contained(self._copy, fed)

    def end_call(self) -> None:
        """The engine's ``load_weights`` call returned: the part it consumed last is verified,
        and every part it has not applied is copied to the host now, while the caller's
        buffers still hold them."""
        self._contained(self._settle_pending)
        for fed in self._fed.values():
            self._contained(self._copy, fed)

    @property
    def touched(self) -> bool:
        """Whether any KDA tensor of this rank's layers was fed."""
        return bool(self.count)

    @property
    def fed_parts(self) -> frozenset[tuple[int, str]]:
        """``(layer, part)`` of every part fed in this session."""
        return frozenset(self._fed)

    @property
    def kept_bytes(self) -> int:
        """Host bytes the session holds now: copies of parts not yet seen applied."""
        return sum(c.nbytes for f in self._fed.values() for c in f.copies.values())

    def _contained(self, step: Any, *args: Any) -> None:
        """Run one step of the check; an error of it is an ``unchecked`` line, never an
        exception into the engine's loader."""
        try:
            step(*args)
        except Exception as error:  # noqa: BLE001 - the guard must not break the engine's load
            what = f"{args[0]}: " if args and isinstance(args[0], str) else ""
            self._unchecked.append(f"{what}the check failed: {type(error).__name__}: {error}")

    def _note(self, name: str, tensor: Any, hit: tuple[int, str, KdaTensorPlan]) -> None:
        layer, part, entry = hit
        self._settle_pending()
        if self._model is not None:  # the first KDA tensor of a call: the objects now
            model, self._model = self._model, None
            if self.target.meta(model):  # inside a layerwise reload: the target's objects
                self.deferred = True     # hold the values until it finalizes
            elif not self.target.holds(model):
                self.target = self.target.rebuilt(model)
        self.count += 1
        places = self.target.places[(layer, part)]
        for place in places:
            if place.name not in self._before:  # first touch: every region's digest
                self._first_touch(place.name)
        local = _local(entry, tensor)
        if local is None:
            shape = list(getattr(tensor, "shape", ()))
            self._problems.append(
                f"{name}: fed with shape {shape}, which does not hold the "
                f"{entry.full_rows * entry.full_row_elems} elements of {part} the plan places; "
                "the update cannot be right")
            self._fed.pop((layer, part), None)
            return
        self._fed[(layer, part)] = _Fed(name, {p: self._reference(p, local) for p in places})
        self._pending = (layer, part)

    def _first_touch(self, name: str) -> None:
        """The digest of every region of parameter ``name`` before the engine applies
        anything: as the target holds it, or, emptied by a repack or on the meta device,
        read back where the engine reads it (:meth:`RankTarget.held`)."""
        value, how = self.target.params[name], None
        regions = self.target.regions[name]
        digests = {p: _digest(value, p) for p in regions}
        if any(d is None for d in digests.values()):
            value, how = self.target.held(name)
            digests = {p: _digest(value, p) for p in regions} if how in (None, GEMM) else \
                dict.fromkeys(regions)
        self._before[name], self._before_how[name] = digests, how

    def _reference(self, place: Place, local: Any) -> Any:
        """What ``place`` must hold once the engine applied ``local``: ``local`` itself (cast
        when compared), or, while ``torch.Tensor.copy_`` is the engine's own NaN-sentinel copy
        (``Reader.masked_copy``: vLLM's ``load_checkpoint_weight_patches``), that copy
        applied to a clone of the region's values now. Any other replacement of ``copy_`` is
        not trusted: the fed values stay the reference."""
        copy = getattr(type(local), "copy_", None)
        if not hasattr(local, "detach") or not self.target.reader.masked_copy(copy):
            return local
        region = _region(self.target.params[place.name], place)
        if not hasattr(region, "detach"):
            return local
        region = region.clone()
        region.copy_(local.reshape(-1).to(region.device))  # the engine's copy, its own rule
        return region

    def _settle_pending(self) -> None:
        """Verify the part the engine consumed last, then retry the parts of its layer not
        yet seen applied (an engine applying a layer when all of it is in)."""
        if self._pending is None:
            return
        key, self._pending = self._pending, None
        self._verify(self._fed[key])
        for other in [k for k in self._fed if k[0] == key[0] and k != key]:
            self._verify(self._fed[other])

    def _verify(self, fed: _Fed) -> None:
        """If every region of ``fed`` holds its reference now, in full, keep only digests."""
        held = fed.refs or fed.copies
        if not held:
            return
        digests = {}
        for place, ref in held.items():
            found = _verified_digest(self.target.params[place.name], place, ref)
            if found is None:
                return
            digests[place] = found
        fed.verified = digests
        fed.refs, fed.copies = {}, {}

    @staticmethod
    def _copy(fed: _Fed) -> None:
        """A part not yet seen applied: its references as host copies."""
        if fed.refs:
            fed.copies = {p: _host(p, r) for p, r in fed.refs.items()}
            fed.refs = {}

    # -- the end -------------------------------------------------------------------------------

    def close(self, params: Mapping[str, Any] | None = None,
              unloaded: frozenset[tuple[int, str]] = frozenset()) -> UpdateReport:
        """Check every region of every parameter the update touched, as the parameters are
        now, every element.

        Args:
            params: the rank's parameters now, by full name; None: as the target reads them
                (:meth:`RankTarget.current`: an object the engine re-registered is read anew).
            unloaded: parts never loaded since a dummy load (their regions are named so).

        Returns:
            The :class:`UpdateReport`.
        """
        self.end_call()
        start = time.perf_counter()
        report = UpdateReport(fed=self.count, problems=list(self._problems),
                              unchecked=list(self._unchecked))
        values = self.values = {}
        self._now = params
        try:
            self._close(report, values)
            for layer, part in sorted(unloaded - self.fed_parts):
                for place in self.target.places.get((layer, part), ()):
                    report.problems.append(f"{place.name}: {part}: never loaded since the dummy "
                                           "load (random values): the update did not feed it")
        except Exception as error:  # noqa: BLE001 - never an exception into the engine
            report.unchecked.append(f"the check failed: {type(error).__name__}: {error}")
        report.params = len(self._before)
        report.mla = len(self.target.mla_params.intersection(self._before))
        report.seconds = time.perf_counter() - start
        self._remember()
        return report

    def _value(self, values: dict[str, Any], name: str, report: UpdateReport) -> Any:
        """Parameter ``name`` now (looked up once per close); None, with a line, when the
        engine no longer holds it (a problem) or it cannot be read back (not checked)."""
        if name not in values:
            how = None
            if self._now is None:
                values[name], how = self.target.read(name)
            else:
                values[name] = self._now.get(name)
            self._how[name] = how
            if how is not None and how != GEMM:
                report.unchecked.append(f"{name}: {how}")
                values[name] = None
            elif values[name] is None:
                report.problems.append(f"{name}: missing after the update")
        return values[name]

    @staticmethod
    def _read(place: Place, value: Any, report: UpdateReport) -> np.ndarray | None:
        """``place``'s region of a parameter on the host (only that region is copied); None,
        with an ``unchecked`` line, when it cannot be read (meta, lazy, another kind)."""
        try:
            region = _region(value, place)
            if hasattr(region, "detach"):
                return np.asarray(as_record(place.name, region).array).reshape(-1)
            return np.asarray(region).reshape(-1)
        except Exception as error:  # noqa: BLE001 - unreadable: a check that cannot run
            report.unchecked.append(f"{place.name}: cannot be read after the update: {error}")
            return None

    @staticmethod
    def _digest_now(place: Place, value: Any, report: UpdateReport) -> bytes | None:
        """``place``'s digest now; None, with an ``unchecked`` line, when unreadable."""
        found = _digest(value, place)
        if found is None:
            report.unchecked.append(f"{place.name}: {place.part}: cannot be read after the "
                                    "update: not checked")
        return found

    def _close(self, report: UpdateReport, values: dict[str, Any]) -> None:
        fed_places = {p for f in self._fed.values() for p in (*f.copies, *f.verified)}
        for (_, part), fed in self._fed.items():
            for place, digest in fed.verified.items():
                value = self._value(values, place.name, report)
                now = None if value is None else self._digest_now(place, value, report)
                if now is None:
                    continue
                report.regions += 1
                report.bytes += place.nbytes
                if now != digest:
                    report.problems.append(
                        f"{place.name}: {part}: {fed.name} was applied, then changed before "
                        "the update ended (a later write over the verified region)")
            for place, want in fed.copies.items():
                value = self._value(values, place.name, report)
                region = None if value is None else self._read(place, value, report)
                if region is None:
                    continue
                report.regions += 1
                report.bytes += place.nbytes
                self._fed_region(report, place, part, fed.name, value, region, want, values)
        for name, before in self._before.items():
            value = self._value(values, name, report)
            if value is None:
                continue
            for place, earlier in before.items():
                if place not in fed_places:
                    self._unfed_region(report, place, value, earlier)

    def _fed_region(self, report: UpdateReport, place: Place, part: str, fed_name: str,
                    value: Any, region: np.ndarray, want: np.ndarray,
                    values: dict[str, Any]) -> None:
        """Judge one fed region not seen applied while fed, in full: as held, or as the
        engine's GEMM reads it back (elements it cannot carry counted, not checkable)."""
        if want.size != region.size:
            report.problems.append(
                f"{place.name}: {part}: {fed_name} was fed with {want.size} elements for this "
                f"rank, the engine's region holds {region.size}")
            return
        if self._how.get(place.name) == GEMM:
            row = int(value.shape[-1]) if getattr(value, "ndim", 0) else 1
            first, aside = read_back_difference(region, want, place.dtype, row, place.start)
            if aside:
                report.repacked.append(set_aside_line(f"{place.name}: {part}", aside,
                                                      region.size))
            if first is not None:
                index, its = _index(place, value, first)
                report.problems.append(
                    f"{place.name}: {part}: differs from what was fed as {fed_name} at {index} "
                    f"(its {its}) as the engine's GEMM reads it back (-0.0 as +0.0, subnormals "
                    f"as 0; expected {float(want[first])!r}, got {float(region[first])!r})")
            return
        if not same_values(region, want):
            report.problems.append(f"{place.name}: {part}: " + self._diagnose(
                place, value, region, want, fed_name, values, report))

    def _unfed_region(self, report: UpdateReport, place: Place, value: Any,
                      earlier: bytes | None) -> None:
        """Judge one region the update did not feed, in full: padding zero, anything else
        its digest from before the update."""
        name = place.name
        if place.part == PADDING:
            rows = self._read(place, value, report)
            if rows is None:
                return
            report.regions += 1
            report.bytes += place.nbytes
            if rows.view(np.uint8).any():
                report.problems.append(
                    f"{name}: padding: not zero after the update (the engine zeroes its "
                    "padding rows at every load)")
            return
        if earlier is None:
            report.unchecked.append(
                f"{name}: {place.part}: not fed by this update, and the engine held it where "
                "kda_tp could not read it before the update: not checked")
            return
        now = self._digest_now(place, value, report)
        if now is None:
            return
        report.regions += 1
        report.bytes += place.nbytes
        if now == earlier:
            return
        if self._before_how.get(name) != self._how.get(name):
            report.unchecked.append(
                f"{name}: {place.part}: not fed by this update, read before it as held and "
                "after it through the engine's GEMM (which reads -0.0 as +0.0): not checked")
            return
        what = self._earlier(place, now)
        report.problems.append(
            f"{name}: {place.part}: not fed by this update and no longer holds its values from "
            "before it (rebuilt uninitialised?)"
            + (f"; it holds what was fed as {what}" if what else ""))

    def _diagnose(self, place: Place, value: Any, got: np.ndarray, want: np.ndarray,
                  fed_name: str, values: dict[str, Any], report: UpdateReport) -> str:
        """What a wrong fed region of parameter ``value`` holds instead."""
        swapped = (f"(this rank's slice), not {fed_name}: parts swapped by the update's "
                   "loader")
        for (layer, part), other in self._fed.items():
            if layer != place.layer or part == place.part:
                continue
            for spot, held in other.copies.items():
                if spot.dtype == place.dtype and held.size == got.size and same_values(got, held):
                    return f"holds what was fed as {other.name} {swapped}"
            for spot in other.verified:
                if spot.dtype != place.dtype or spot.stop - spot.start != got.size:
                    continue
                value = self._value(values, spot.name, report)
                now = None if value is None else self._read(spot, value, report)
                if now is not None and same_values(got, now):
                    return f"holds what was fed as {other.name} {swapped}"
        digest = _host_digest(got)
        what = self._earlier(place, digest)
        if what:
            return f"holds what was fed as {what} in an earlier call of this refit {swapped}"
        before = self._before.get(place.name, {}).get(place)
        if before is not None and digest == before and _host_digest(want) != before:
            return (f"holds the values from before the update: {fed_name} was fed but the "
                    "engine never applied it")
        first = first_difference(got, want)
        index, its = _index(place, value, first)
        return (f"differs from what was fed as {fed_name} at {index} (its {its}; expected "
                f"{float(want[first])!r}, got {float(got[first])!r})")

    def _earlier(self, place: Place, digest: bytes) -> str | None:
        """The name another part of ``place``'s layer was last fed under, when ``digest`` (a
        region's digest now) is the digest of what was fed for it."""
        for (layer, part), (name, digests) in self.memory.items():
            if layer == place.layer and part != place.part and \
                    digests.get(place.dtype) == digest:
                return name
        return None

    def _remember(self) -> None:
        """Keep the digest of what each fed part was fed, for the refit's later calls."""
        for key, fed in self._fed.items():
            digests = {p.dtype: v for p, v in fed.verified.items()}
            for place, held in fed.copies.items():
                digests.setdefault(place.dtype, _host_digest(held))
            self.memory[key] = (fed.name, digests)


# -- values ------------------------------------------------------------------------------------


def _local(t: KdaTensorPlan, tensor: Any) -> Any:
    """This rank's slice of a fed tensor (its checkpoint-format full tensor), flat, as a view
    where the layout allows (numpy or torch on its device); None when the tensor does not hold
    the plan's elements."""
    if isinstance(tensor, np.ndarray) and tensor.dtype == numpy_dtype(t.dtype) \
            and tensor.nbytes == t.full_bytes:
        # The checkpoint's own dtype: the rank's bytes by the plan (a view of a row range,
        # o_proj's columns gathered by the core's threads).
        return shard_bytes(t, tensor).view(tensor.dtype)
    try:
        view = tensor.reshape(t.full_rows, t.full_row_elems)
    except (RuntimeError, ValueError, AttributeError, TypeError):
        return None
    return view[t.src_row_offset:t.src_row_offset + t.local_rows,
                t.src_col_offset:t.src_col_offset + t.local_row_elems].reshape(-1)


def _index(place: Place, value: Any, first: int) -> tuple[list[int], list[int]]:
    """Where element ``first`` of ``place``'s region lies, as the first load's diagnosis names
    it (``kda_tp.audit.report.PartDifference``): its index in the parameter ``value`` (by the
    parameter's shape) and in the part (the region's rows, each a row of the parameter); a
    parameter whose shape does not hold the region, or a region that does not start on a row,
    is indexed flat."""
    shape = tuple(int(n) for n in getattr(value, "shape", ()))
    size, at = place.stop - place.start, place.start + first
    if not shape or math.prod(shape) < place.stop:
        return [at], [first]
    row = math.prod(shape[1:])
    part = (size // row, *shape[1:]) if row and size % row == 0 and place.start % row == 0 \
        else (size,)
    return ([int(i) for i in np.unravel_index(at, shape)],
            [int(i) for i in np.unravel_index(first, part)])


def _region(value: Any, place: Place) -> Any:
    """``place``'s elements of a parameter, flat (a view: numpy, or torch on its device)."""
    if hasattr(value, "detach"):
        return value.detach().reshape(-1)[place.start:place.stop]
    return np.asarray(value).reshape(-1)[place.start:place.stop]


def _holds(value: Any, place: Place, ref: Any) -> bool:
    """Whether ``place``'s region of a parameter holds ``ref`` (the fed slice or the engine's
    copy of it, cast to the parameter's dtype; or a host copy in that dtype), every element,
    compared as the audit compares: a torch reference on the parameter's device (nothing
    copied to the host; host memory compared by numpy, as fast as a memcpy); a host copy
    against the region read to the host; numpy as numpy. The first :data:`_EARLY` elements
    first (an early "not applied yet"). False when it cannot tell (meta, another kind of
    array)."""
    try:
        region = _region(value, place)
        if hasattr(region, "detach"):
            if region.is_meta:
                return False
            if hasattr(ref, "detach"):
                want = ref.to(device=region.device, dtype=region.dtype)
                if region.numel() != want.numel() or not same_tensor_values(
                        region[:_EARLY], want[:_EARLY]):
                    return False
                if region.device.type == "cpu":  # host memory: numpy's compare, no copy
                    return bool(same_values(as_record(place.name, region).array,
                                            as_record(place.name, want).array))
                return bool(same_tensor_values(region, want))
            if not same_values(as_record(place.name, region[:_EARLY]).array.reshape(-1),
                               ref[:_EARLY]):
                return False
            return bool(same_values(as_record(place.name, region).array.reshape(-1), ref))
        want = cast_to(np.asarray(ref).reshape(-1), place.dtype)
        return bool(region.size == want.size and same_values(region, want))
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, NotImplementedError):
        return False


def _verified_digest(value: Any, place: Place, ref: Any) -> bytes | None:
    """``place``'s digest when its region of a parameter holds ``ref``, every element (see
    :func:`_holds`); None when it does not, or cannot be read. A host region holding exactly
    the bytes of its reference (cast) is compared and hashed in one pass over both
    (``kda_tp._native.digest_if_equal``); any other (a device tensor, a NaN of another bit
    pattern, not applied yet) is compared by :func:`_holds`, then hashed."""
    pair = _host_bytes(value, place, ref)
    if pair is not None:
        found = digest_if_equal(*pair)
        if found is not None:
            return found
    if not _holds(value, place, ref):
        return None
    return _digest(value, place)


def _host_bytes(value: Any, place: Place, ref: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """``place``'s region of a parameter and its reference (cast to the region's dtype) as
    flat uint8 views, when both lie in host memory as torch tensors or numpy arrays and the
    region's first :data:`_EARLY` elements hold the reference's bytes (an early "not applied
    yet"); None otherwise."""
    try:
        region = _region(value, place)
        if hasattr(region, "detach"):
            if region.device.type != "cpu" or not hasattr(ref, "detach"):
                return None
            ref = ref.detach().to(device=region.device, dtype=region.dtype)
        elif not isinstance(ref, np.ndarray) or ref.dtype != region.dtype:
            return None
        got = as_record(place.name, region).data
        want = as_record(place.name, ref.reshape(-1)).data
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError, NotImplementedError,
            KdaTpError):
        return None
    early = _EARLY * numpy_dtype(place.dtype).itemsize
    if got.size != want.size or not np.array_equal(got[:early], want[:early]):
        return None
    return got, want


def _host(place: Place, ref: Any) -> np.ndarray:
    """A reference as a host copy in the region's dtype: torch values cast by torch (the
    engine's cast), numpy by ``cast_to``."""
    if hasattr(ref, "detach"):
        cast = ref.detach().to(dtype=torch_dtype(place.dtype)).contiguous()
        return np.array(as_record(place.name, cast.reshape(-1)).array, copy=True).reshape(-1)
    return np.array(cast_to(np.asarray(ref).reshape(-1), place.dtype), copy=True)


def _host_digest(flat: np.ndarray) -> bytes:
    """The digest of a flat host array's bytes, every byte read: the core's exact XXH3-128
    over 1 MiB chunks hashed on every core, the GIL released (``kda_tp._native.digest``). A
    contiguous array is hashed where it lies; a non-contiguous one (an engine holds its
    parameters contiguous) is first copied into a contiguous array, its elements in order."""
    return native_digest(np.ascontiguousarray(flat).reshape(-1).view(np.uint8))


def _digest(value: Any, place: Place) -> bytes | None:
    """The digest of one region of a parameter, every byte of it (a torch tensor on the host
    hashed where it lies, no copy; on a device, its region brought to the host); None when
    the parameter cannot be read there (meta, lazy, emptied by a repack)."""
    try:
        if place.stop > _numel(value):
            return None
        if hasattr(value, "detach"):
            region = value.detach().reshape(-1)[place.start:place.stop]
            return _host_digest(as_record(place.name, region).data)
        return _host_digest(np.asarray(value).reshape(-1)[place.start:place.stop])
    except Exception:  # noqa: BLE001 - meta, lazy, not an array: unreadable
        return None


def _numel(value: Any) -> int:
    """Elements of a torch tensor or a numpy array."""
    return int(value.numel()) if hasattr(value, "numel") else int(np.asarray(value).size)
