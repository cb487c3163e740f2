"""Following a live model's weight updates, the same for both engine plugins.

After the first load an engine plugin calls :func:`follow` once per model with what it knows
(the checkpoint's description or path, the engine's tensor-parallel rank and world size, the
layout, the pipeline stage's layers, whether the load was a dummy one). The model's own
``load_weights`` is then wrapped (an instance attribute): every call feeds the update session
open on the model, or is one update by itself. The plugin opens and closes the sessions the
engine defines (:meth:`Follower.open`, :meth:`Follower.close`: vLLM's layerwise reload and
weight-transfer sessions, SGLang's ``begin_weight_update`` / ``end_weight_update``) and the
follower turns each session's :class:`~kda_tp.guard.UpdateReport` into the verdict:
an INFO line, or a failing one as ``kda_tp.guard._modes.failed`` shows it in every mode (an
ERROR line, then a :class:`~kda_tp.errors.GuardError` in mode ``fail``, the diagnosis and a
:class:`~kda_tp.errors.GuardWarning` in mode ``warn``), counted in the process's record.

A call that feeds no KDA tensor of the rank costs a dictionary lookup per tensor; the rank's
:class:`~kda_tp.guard.RankTarget` is built once and rebuilt only when the engine holds
other parameter objects. After a dummy load the first update that feeds the KDA layers must
fill every region: at the end of an engine session, or at vLLM's
``process_weights_after_loading`` that ends a refit made of plain ``load_weights`` calls, a
part never loaded since is named.

This module imports no engine and no torch.
"""

from __future__ import annotations

import contextlib
import functools
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checkpoint.description import describe
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.values import same_tensor_values, same_values
from ..engines.build import RankPlan
from ..engines.derived import DERIVED, DERIVED_ATTRIBUTES, MLA_DERIVED, derived_copies
from ..errors import GuardModeError
from ._derived import derived_problem, judge_mla_copies, mla_copies
from ._modes import (cannot_check, failed, mode, passed, repair_on, verdict_word,
                     warn_once)
from ._names import names_mla
from ._record import RECORD
from ._target import AS_HELD, RankTarget, Reader
from ._updates import Memory, UpdateReport, UpdateSession

__all__ = ["UPDATES_HOOK", "Follower", "follow", "followed"]

#: The record's name of the wrapper :func:`follow` puts on a model's ``load_weights``.
UPDATES_HOOK = "model.load_weights (updates)"


def repair(model: Any) -> None:
    """With ``KDA_TP_GUARD_REPAIR=1`` (``kda_tp.guard._modes.repair_on``): drop every
    stale-prone derived copy kda_tp knows (:data:`~kda_tp.engines.derived.DERIVED_ATTRIBUTES`)
    so that the engine rebuilds it. The variable is read only where it acts: a model holding
    no such copy never reads it; an invalid value stops nothing in modes ``off`` and ``warn``
    (one warning, no repair), only in mode ``fail``.

    Raises:
        GuardModeError: mode ``fail`` and ``KDA_TP_GUARD_REPAIR`` holds a value that is
            neither on nor off.
    """
    held = [(module, attribute) for module in model.modules() for attribute in DERIVED_ATTRIBUTES
            if module.__dict__.get(attribute) is not None]
    if not held:
        return
    try:
        on = repair_on()
    except GuardModeError as error:
        if mode() == "fail":
            raise
        warn_once(f"kda_tp guard: {error}; no repair (mode {mode()})")
        return
    if on:
        for module, attribute in held:
            setattr(module, attribute, None)


@dataclass
class Follower:
    """How one model's updates are checked.

    Attributes:
        engine: the engine's name in the lines (``"vllm"``, ``"sglang"``).
        target: the rank's target (rebuilt when the engine holds other parameter objects).
        model: a weak reference to the model (the record never keeps it alive).
        memory: what the refit's calls fed, by part (the diagnosis across calls).
        unloaded: after a dummy load, the parts not loaded since; None when not pending.
        updated: a KDA tensor was fed since the dummy load.
        session: the open update session, if any; ``owner`` opened it, ``where`` names it.
        spoiled: why the open session is not whole (the engine reported one of its calls
            failed): its end is a failed update, every region fed in it checked and named.
        quiet: > 0 while a loader fills the model (its own full check covers that load).
        unplaced: for each layer of the rank a name the guard cannot place was fed for in
            the open session or call (``RankTarget.unplaced``): that name and the layer's
            parameters as they were before the engine got it, compared when it ends.
        updates: the updates judged so far (each verdict, passed or not): a live audit
            against the start-up checkpoint says how many updates came since.
        last: the last update's verdict line; ``last_failed``: whether it failed.
        mla_fed: a name of a hybrid's MLA layer (``kda_tp.guard._names.names_mla``) that the
            target cannot place was fed since the last verdict (no MLA plan: a dummy load;
            a tensor the MLA table does not describe): that verdict says MLA parameters are
            not checked on updates. The MLA parameters the target holds (``mla_plan``) are
            judged as the KDA ones.
        mla_plan: the rank's MLA plan (``kda_tp.rank.MlaTpPlan``) the first load's check
            judged the MLA layers with, or None: the MLA layers' derived copies are judged
            with it once the engine built them (:meth:`derived_built`).
    """

    engine: str
    target: RankTarget
    model: Any
    memory: Memory = field(default_factory=dict)
    unloaded: frozenset[tuple[int, str]] | None = None
    updated: bool = False
    session: UpdateSession | None = None
    owner: str = ""
    where: str = ""
    spoiled: str = ""
    quiet: int = 0
    unplaced: dict[int, tuple[str, dict[str, Any]]] = field(default_factory=dict)
    updates: int = 0
    last: str = ""
    last_failed: bool = False
    mla_fed: bool = False
    mla_plan: Any = None

    @contextlib.contextmanager
    def quietly(self) -> Iterator[None]:
        """No update session while a loader fills the model (its own check covers it)."""
        self.quiet += 1
        try:
            yield
        finally:
            self.quiet -= 1

    def open(self, owner: str, where: str) -> bool:
        """Open an update session for ``owner`` (``"layerwise"``, ``"weight transfer"``...),
        named ``where`` in the lines, on the parameters as they are now, before anything is
        applied; False (nothing opened) when one is open already (the caller's calls join it),
        in mode ``off``, or while a loader fills the model.

        Raises:
            GuardError: mode ``fail`` and the engine's parameters no longer fit the target (a
                check that cannot run).
        """
        if self.session is not None or self.quiet or mode() == "off":
            return False
        model = self.model()
        try:
            if model is not None and not self.target.holds(model) \
                    and not self.target.meta(model):
                self.target = self.target.rebuilt(model)
        except Exception as error:  # noqa: BLE001 - only GuardError leaves the engine's call
            cannot_check(f"kda_tp guard: {self.engine} {where}: tp rank {self.target.tp_rank}/"
                         f"{self.target.tp_size}: cannot check this update: "
                         f"{type(error).__name__}: {error}")
            return False
        self.session = UpdateSession(self.target, self.memory)
        self.owner, self.where, self.spoiled, self.mla_fed = owner, where, "", False
        return True

    def spoil(self, why: str) -> None:
        """The engine reported one call of the open session failed (SGLang: "partially
        updated"): the session goes on, and its end is a failed update (issue 38 F5)."""
        if self.session is not None:
            self.spoiled = why

    def abandon(self, owner: str) -> None:
        """Forget ``owner``'s session without a verdict (the engine's call raised)."""
        if self.session is not None and self.owner == owner:
            self.session = None

    def close(self, owner: str) -> UpdateReport | None:
        """Check ``owner``'s session: every region it touched, the derived copies, and after a
        dummy load every part never loaded since (an engine session is one whole update).
        Nothing when another owner's session is open (it closes its own).

        Returns:
            The report, or None when nothing was checked.

        Raises:
            GuardError: mode ``fail``, and a KDA parameter or derived copy is wrong, or the
                check could not run.
        """
        session = self.session
        if session is None or self.owner != owner:
            return None
        self.session = None
        unloaded = self.unloaded if self.unloaded is not None and session.touched else None
        report = self._verdict(session, self.where, unloaded, self.spoiled)
        if self._load_builds_copies():
            self.derived_built(self.where)
        return report

    def call(self, original: Any, weights: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
        """One call of the model's ``load_weights``: fed to the open session, else one update
        by itself (checked when the call returns, if it fed a KDA tensor of the rank)."""
        if self.quiet or mode() == "off":
            return original(weights, *args, **kwargs)
        session = self.session
        if session is not None:
            try:
                return original(session.wrap(self._watched(weights)), *args, **kwargs)
            finally:
                session.end_call()
        model = self.model()
        session = UpdateSession(self.target, self.memory, model)
        self.mla_fed = False
        try:
            out = original(session.wrap(self._watched(weights)), *args, **kwargs)
        finally:
            session.end_call()
        if session.deferred:  # a layerwise reload begun where the guard could not see it
            self.session, self.owner, self.where = session, "layerwise", "layerwise reload"
        elif session.touched:
            self.target = session.target
            self._verdict(session, "load_weights", None)
        else:
            unseen = self._changed_unseen()
            if unseen:
                self._report(UpdateReport(params=len(unseen), unchecked=unseen),
                             "load_weights")
        if not session.deferred and self._load_builds_copies():
            self.derived_built("load_weights")
        return out

    def _load_builds_copies(self) -> bool:
        """Whether the engine rebuilds its MLA derived copies at the end of every
        ``load_weights`` (SGLang's ``w_kc`` / ``w_vc``, plain attributes built by
        ``post_load_weights``): then they are judged after every update
        (:meth:`derived_built`); vLLM's are judged at ``process_weights_after_loading``."""
        return any(copy.attribute
                   for copy in MLA_DERIVED.get(self.target.layout.name, {}).values())

    def _watched(self, weights: Any) -> Iterator[Any]:
        """``weights`` passed on unchanged; before the engine gets a name the guard cannot
        place that names a KDA tensor of one of the rank's layers (``RankTarget.unplaced``),
        that layer's parameters are copied (once per session), to tell after the call whether
        it changed them unseen (F1: a refit under a spelling the engine accepts and the guard
        does not know is never silent)."""
        target = self.target
        for item in weights:
            try:
                name = item[0]
            except (TypeError, IndexError, KeyError):  # not a pair: the engine's to refuse
                name = None
            if isinstance(name, str) and target.place(name) is None:
                self.mla_fed = self.mla_fed or names_mla(name)
                layer = target.unplaced(name)
                if layer is not None and layer not in self.unplaced:
                    self.unplaced[layer] = (name, {
                        param: _copy(target.current(param))
                        for param in target.layer_params(layer)})
            yield item

    def _changed_unseen(self) -> list[str]:
        """One line per parameter that a name the guard could not place changed (compared
        with its copy from before), emptying the record: each is not checked."""
        lines = []
        for layer, (name, before) in sorted(self.unplaced.items()):
            for param, old in before.items():
                try:
                    same = _same(old, self.target.current(param))
                except Exception as error:  # noqa: BLE001 - a comparison that cannot run
                    same, why = False, f" ({type(error).__name__}: {error})"
                else:
                    why = ""
                if not same:
                    lines.append(
                        f"{param}: changed by an update that fed {name!r}, a name the guard "
                        f"cannot place (neither the checkpoint's {self.target.prefix!r} nor a "
                        f"spelling the engine's name mapping gives for it){why}: not checked")
        self.unplaced.clear()
        return lines

    def end_of_refit(self, where: str) -> UpdateReport | None:
        """A refit made of plain ``load_weights`` calls ended (vLLM's
        ``process_weights_after_loading``): after a dummy load, the parts the refit never
        loaded are named.

        Raises:
            GuardError: mode ``fail`` and some part was never loaded.
        """
        if self.unloaded is None or not self.updated or self.session is not None \
                or self.quiet or mode() == "off":
            return None
        report = UpdateReport()
        names = set()
        for layer, part in sorted(self.unloaded):
            for place in self.target.places.get((layer, part), ()):
                names.add(place.name)
                report.regions += 1
                report.bytes += place.nbytes
                report.problems.append(f"{place.name}: {part}: never loaded since the dummy "
                                       "load (random values): the refit did not feed it")
        report.params = len(names)
        self.unloaded = None
        return self._report(report, where)

    def derived_built(self, where: str) -> None:
        """The engine built its MLA layers' derived copies (vLLM:
        ``process_weights_after_loading`` returned, at the first load and after every
        refit): each copy
        (``kda_tp.engines.derived.MLA_DERIVED``) against what the local ``kv_b_proj``
        derives now (``kda_tp.guard._derived.judge_mla_copies``), named as itself when wrong.
        SGLang's (rebuilt at the end of every ``load_weights``) after every update that
        called it, one call or a session. One line, ``kda_tp guard: <engine> <where>: tp rank
        r/T: N MLA derived copies (<layout>), B bytes, S s: OK``; a copy that cannot be
        judged because the backend released its ``kv_b_proj`` (``AMX_MLA``) is counted ``not
        checkable (repacked)`` and stops nothing, as a KDA parameter an engine repacked; a
        copy the layout keeps that the engine did not build is ``NOT CHECKED``, refused in
        mode ``fail``. Nothing for a model without
        MLA layers, in mode ``off``, while a loader fills the model or a session is open
        (judged when it ends).

        Raises:
            GuardError: mode ``fail`` and a copy differs from its ``kv_b_proj`` or was not built.
        """
        layout = self.target.layout.name
        model = self.model()
        if model is None or layout not in MLA_DERIVED or self.session is not None \
                or self.quiet or mode() == "off":
            return
        start = time.perf_counter()
        try:
            verdict = judge_mla_copies(dict(model.named_parameters()), mla_copies(model),
                                       layout, self.mla_plan)
        except Exception as error:  # noqa: BLE001 - never an exception into the engine
            cannot_check(f"kda_tp guard: {self.engine} {where}: tp rank {self.target.tp_rank}/"
                         f"{self.target.tp_size}: cannot check the MLA derived copies: "
                         f"{type(error).__name__}: {error}")
            return
        if not (verdict.checked or verdict.unchecked or verdict.repacked):
            return
        word = verdict_word(len(verdict.problems), len(verdict.unchecked))
        rank = self.target.tp_rank
        repacked = (f", {len(verdict.repacked)} not checkable (repacked)" if verdict.repacked
                    else "")
        line = (f"kda_tp guard: {self.engine} {where}: tp rank {rank}/{self.target.tp_size}: "
                f"{len(verdict.checked)} MLA derived copies ({layout}), {verdict.bytes} bytes, "
                f"{time.perf_counter() - start:.3f} s{repacked}: {word}")
        RECORD.ran("derived copies", line)
        notes = ("".join(f"\n  rank {rank} not checked: {u}" for u in verdict.unchecked)
                 + "".join(f"\n  rank {rank} not checkable: {u}" for u in verdict.repacked))
        if verdict.problems or verdict.unchecked:
            failed(f"{line}\nthe MLA layers' derived copies are not what the local kv_b_proj "
                   "makes of them:\n" + "\n".join(f"  rank {rank} {p}"
                                                   for p in verdict.problems) + notes,
                   [p.split(": ", 1)[0] for p in verdict.problems + verdict.unchecked], mode())
        else:
            passed(line + notes)

    def _verdict(self, session: UpdateSession, where: str,
                 unloaded: frozenset[tuple[int, str]] | None,
                 spoiled: str = "") -> UpdateReport | None:
        report = session.close(unloaded=unloaded or frozenset())
        report.unchecked += self._changed_unseen()
        if spoiled:  # judged whole: a failed update, every region fed in it checked and named
            fed = [f"{place.name}: {part}" for layer, part in sorted(session.fed_parts)
                   for place in self.target.places.get((layer, part), ())]
            report.problems.append(
                f"the session is not whole: {spoiled}; the engine may hold part of that "
                f"call; the regions fed in the session, before and after it, each checked "
                f"above: {'; '.join(fed) or 'none'}")
        if self.unloaded is not None and session.touched:
            self.updated = True
            left = self.unloaded - session.fed_parts
            self.unloaded = None if unloaded is not None or not left else left
        model = self.model()
        if model is not None:
            repair(model)
            try:
                self._derived(model, report, session.values)
            except Exception as error:  # noqa: BLE001 - never an exception into the engine
                report.unchecked.append(f"the derived copies: {type(error).__name__}: {error}")
        session.values.clear()
        if not session.touched and report.passed:
            return None
        return self._report(report, where)

    def _derived(self, model: Any, report: UpdateReport, read: dict[str, Any]) -> None:
        """The derived copies the layout keeps, against their parameters now (those the
        session's close read already, ``read``, not read again)."""
        layout = self.target.layout.name
        if layout not in DERIVED:
            return
        params = {name: value if (value := read.get(name)) is not None
                  else self.target.current(name) for name in self.target.params}
        for name, value in derived_copies(model).items():
            problem = derived_problem(name, value, params, layout)
            if isinstance(problem, str):
                report.problems.append(f"{name}: {problem}")

    def _report(self, report: UpdateReport, where: str) -> UpdateReport:
        """Log, raise or record one verdict."""
        rank, size = self.target.tp_rank, self.target.tp_size
        verdict = verdict_word(len(report.problems), len(report.unchecked))
        repacked = f", {len(report.repacked)} not checkable (repacked)" if report.repacked else ""
        repacked += ", MLA parameters not checked on updates" if self.mla_fed else ""
        self.mla_fed = False
        counted = (f"{report.params - report.mla} KDA and {report.mla} MLA" if report.mla
                   else f"{report.params} KDA")
        line = (f"kda_tp guard: {self.engine} {where}: tp rank {rank}/{size}: {counted} "
                f"parameters updated ({self.target.layout.name}), {report.bytes} bytes, "
                f"{report.seconds:.3f} s{repacked}: {verdict}")
        RECORD.ran("update", line)
        self.updates, self.last, self.last_failed = self.updates + 1, line, not report.passed
        if report.passed:
            passed(line + "".join(f"\n  rank {rank} not checkable: {u}"
                                  for u in report.repacked))
            return report
        weights = "KDA and MLA weights" if report.mla else "KDA weights"
        text = (f"{line}\nthe {weights} this rank holds after the update are not what the "
                "update fed:\n" + "\n".join(f"  rank {rank} {p}" for p in report.problems)
                + "".join(f"\n  rank {rank} not checked: {u}" for u in report.unchecked)
                + "".join(f"\n  rank {rank} not checkable: {u}" for u in report.repacked))
        wrong = [p.split(": ", 1)[0] for p in report.problems + report.unchecked]
        failed(text, wrong, mode())
        return report


def _copy(value: Any) -> Any:
    """A copy of a parameter's values now (torch's ``clone``, else numpy's)."""
    clone = getattr(value, "clone", None)
    if callable(clone):
        return value.detach().clone()
    return np.array(value, copy=True)


def _same(old: Any, now: Any) -> bool:
    """Whether a parameter holds the values of its copy ``old`` (a NaN matches a NaN)."""
    if getattr(now, "is_meta", False) or tuple(getattr(old, "shape", ())) != \
            tuple(getattr(now, "shape", ())):
        return False
    if callable(getattr(old, "clone", None)):
        return old.dtype == now.dtype and same_tensor_values(old, now.detach())
    return same_values(np.asarray(old), np.asarray(now))


_followed: weakref.WeakKeyDictionary[Any, Follower] = weakref.WeakKeyDictionary()


def followed(model: Any) -> Follower | None:
    """The :class:`Follower` of ``model``, or None when its updates are not followed."""
    try:
        return _followed.get(model)
    except TypeError:  # not weakly referenceable: never followed
        return None


def follow(model: Any, engine: str, checkpoint: SafetensorsSource | str | None = None, *,
           tp_rank: int, tp_size: int, layout: str | None = None, layers: Any = None,
           dummy: bool = False, plan: RankPlan | None = None,
           reader: Reader = AS_HELD, mla_plan: Any = None) -> Follower:
    """Check every later update of ``model``: its ``load_weights`` is wrapped (an instance
    attribute) so that each call feeds the open session, or is one update by itself.
    Idempotent (the first follower stays).

    Args:
        model: the loaded ``torch.nn.Module`` (its ``named_parameters()`` and
            ``load_weights``).
        engine: the engine's name for the lines.
        checkpoint: the checkpoint's local path or open source (described once, here); not
            read when ``plan`` is given.
        tp_rank: the engine's tensor-parallel rank (0-based).
        tp_size: the engine's tensor-parallel world size.
        layout: the engine layout's name (the first load's check found it); None: recognised.
        layers: the KDA layers this rank holds (a pipeline stage's); None: every one.
        dummy: the load filled random values: the first update must fill every region.
        plan: the rank's plan the first load's check built (``GuardResult.plan``): the
            target is built from it (its layout and layers), nothing read or planned again.
        reader: how the engine holds its parameters (the engine adapter's).
        mla_plan: the rank's MLA plan the first load's check judged the MLA layers with
            (``GuardResult.mla_plan``), for their derived copies (:meth:`Follower.derived_built`).

    Raises:
        KdaTpError: the checkpoint's config gives no plan for these parameters (no KDA layer,
            no layout fits, a world size that does not divide the heads).
    """
    found = followed(model)
    if found is not None:
        return found
    params = dict(model.named_parameters())
    if plan is not None:
        target = RankTarget.of(plan, params, model=model, reader=reader, mla=mla_plan)
    elif checkpoint is None:
        raise TypeError("follow: neither a checkpoint nor a plan to check the updates against")
    else:
        target = RankTarget.build(describe(checkpoint), params, tp_rank=tp_rank,
                                  tp_size=tp_size, engine=layout, layers=layers, model=model,
                                  reader=reader)
    how = Follower(engine, target, weakref.ref(model), mla_plan=mla_plan)
    if dummy:
        how.unloaded = frozenset(target.places)
    _followed[model] = how
    original = model.load_weights

    @functools.wraps(original)
    def load_weights(weights: Any, *args: Any, **kwargs: Any) -> Any:
        RECORD.running(load_weights)
        return how.call(original, weights, args, kwargs)

    RECORD.install(UPDATES_HOOK, model, "load_weights", load_weights)
    return how
