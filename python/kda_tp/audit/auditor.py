"""Auditing the KDA weights a serving engine loaded: is every rank's parameter exactly right?

A serving engine (vLLM, SGLang, transformers) loads each rank's KDA parameters with its own
code, fusing the checkpoint tensors in its own layout (:mod:`kda_tp.engines`). :func:`audit`
takes what one rank holds (its ``state_dict()``, or a ``save_sharded_state`` dump of it), builds
each KDA parameter the engine should hold from the checkpoint with the same code a loader uses
(:func:`kda_tp.engines.build_param`), and compares them byte for
byte, after casting the expected values to the parameter's dtype as the engine does (e.g. BF16
to F32). A parameter that differs is diagnosed: which part (plan tensor) differs first, at which
index, and what the data equals instead when it equals some other slice (another rank's, another
part's, the even split of a padded ``A_log``, ``dt_bias`` at the head offset, ...).

:func:`audit_path` does the same for files on disk: a ``sharded_state`` directory
(``model-rank-{r}-part-{p}.safetensors``, vLLM's ``model-pp-{pp}-tp-{tp}-part-{p}.safetensors``)
or one rank's safetensors file. ``kda-tp audit`` is its command line.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..checkpoint.names import param_location, param_name
from ..checkpoint.description import describe
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.values import as_record
from ..engines.build import RankPlan, build_mla_param, build_param, engine_params
from ..engines.dtype import config_dtype, config_model_dtype, engine_model_dtype
from ..engines.layout import EngineLayout, EngineParam, EngineParamPlan, mla_unjudged
from ..engines.registry import LAYOUTS, get_layout, recognise
from ..errors import CheckpointError, EngineLayoutError, PlanError
from ..model.dtypes import FLOAT_DTYPES
from ..model.families import FAMILIES
from ..rank.mla import rank_mla_plan
from ..rank.plan import KdaTpPlan
from ..rank.view import KdaShardedSource
from ._diagnosis import Candidates, audit_overflow, compare, exact_in_place
from ._dump_files import (RankFiles, dump_world_size, meta_int, open_files, rank_of_file,
                         sharded_state_files)
from .report import AuditReport, ParamAudit

__all__ = ["RankAudit", "audit", "audit_path", "audit_rank"]

# The model families' names in messages.
_FAMILY_NAMES = {name: family.display for name, family in FAMILIES.items()}


@dataclass(frozen=True)
class _Selected:
    """A dump's KDA parameters: ``layers`` maps each layer to ``{suffix: name}``, all under
    ``prefix``; ``ignored`` counts the other names; ``problems``: KDA layers of the dump that
    the checkpoint does not describe."""

    prefix: str
    layers: dict[int, dict[str, str]]
    ignored: int
    problems: tuple[str, ...] = ()


@dataclass(frozen=True)
class RankAudit:
    """One rank's audit (:func:`audit_rank`) with what it built for the rank, handed on.

    Attributes:
        report: the rank's :class:`AuditReport`.
        plan: the rank's plan and engine parameter plans in the report's layout, for the
            engine's model dtype (built once for the audit).
        view: the rank's view of the checkpoint the audit read (to build an expected
            parameter with ``plan``'s parameter plans).
    """

    report: AuditReport
    plan: RankPlan
    view: KdaShardedSource


class _Auditor:
    """Audits ranks of one engine's dump against one checkpoint at one world size. Each rank's
    view and :class:`RankPlan`, and the engine's model dtype, are built once and kept here.

    ``first``: the rank whose view is built now (the plan refuses a world size the heads cannot
    split, or a rank out of range, before anything else is read). ``mla``: judge the hybrid's
    MLA layers too, where their plan can be made (``kda_tp.rank.mla.rank_mla_plan``: not for
    a pipeline stage's ``layers``, nor where the MLA layers pass through whole)."""

    def __init__(self, checkpoint: str | os.PathLike[str] | SafetensorsSource, tp_size: int,
                 engine: str | None, layers: Iterable[int] | None = None,
                 model_dtype: str | None = None, *, first: int = 0, mla: bool = False):
        self.source = (checkpoint if isinstance(checkpoint, SafetensorsSource)
                       else SafetensorsSource(checkpoint))
        # The checkpoint's description (read once, shared with every rank's plan and view).
        self.description = description = describe(self.source)
        # Checked now (a bad name is refused before anything is read); resolved per layout.
        self.requested_dtype = (None if model_dtype is None
                                else config_model_dtype(None, "", model_dtype))
        self.family = description.family.name
        self.tp_size = tp_size
        self.forced = None if engine is None else get_layout(engine)
        self.layers = self.described = description.kda_layers()
        if layers is not None:  # a pipeline stage's KDA layers
            wanted = set(layers)
            if not wanted <= set(self.layers):
                raise CheckpointError(
                    f"layers {sorted(wanted - set(self.layers))} are not KDA layers of "
                    f"{self.source.path} (its KDA layers: {list(self.layers)})"
                )
            self.layers = tuple(sorted(wanted))
        self.mla = mla and layers is None
        self._shards: dict[int, KdaShardedSource] = {}
        self._mla_plans: dict[tuple[int, str], dict[str, EngineParamPlan]] = {}
        self._plans: dict[tuple[int, str], RankPlan] = {}
        self._dtypes: dict[str, str] = {}
        # The names any layout knows, and those only a KDA layer has.
        self.known = frozenset().union(*(lay.suffixes for lay in LAYOUTS.values()))
        self.markers = {s for s in self.known if s.rsplit(".", 1)[-1] in ("A_log", "dt_bias")}
        self.shard(first)

    def shard(self, rank: int) -> KdaShardedSource:
        """Rank ``rank``'s view of the checkpoint (any split the heads allow: no q|k width
        rule, the engine chose the world size)."""
        if rank not in self._shards:
            plan = KdaTpPlan.from_description(self.description, rank, self.tp_size,
                                              qk_multiple=1)
            mla = rank_mla_plan(self.description, rank, self.tp_size)[0] if self.mla else None
            mla = None if mla is None or mla_unjudged(mla) else mla
            self._shards[rank] = KdaShardedSource(self.source, plan, mla=mla)
        return self._shards[rank]

    def mla_plans(self, rank: int, layout: EngineLayout) -> dict[str, EngineParamPlan]:
        """Rank ``rank``'s MLA parameter plans in ``layout`` (by name after ``self_attn.``),
        for the engine's model dtype: built once per rank and layout; empty where the MLA
        layers are not judged (no MLA plan, or a layout without an MLA table)."""
        key = (rank, layout.name)
        if key not in self._mla_plans:
            mla = self.shard(rank).mla
            self._mla_plans[key] = {} if mla is None or not layout.mla else {
                p.suffix: layout.mla_param_plan(p.suffix, mla, self.model_dtype(layout))
                for p in layout.mla_params_for(mla)}
        return self._mla_plans[key]

    def rank_plan(self, rank: int, layout: EngineLayout) -> RankPlan:
        """Rank ``rank``'s plan and engine parameter plans in ``layout``, for the engine's model
        dtype (:meth:`model_dtype`): built once per rank and layout."""
        key = (rank, layout.name)
        if key not in self._plans:
            self._plans[key] = RankPlan.of(self.shard(rank).plan, layout,
                                           self.model_dtype(layout), self.description.prefix,
                                           self.layers,
                                           config_dtype(self.description.config, layout.engine))
        return self._plans[key]

    def select(self, names: Sequence[str], where: str) -> _Selected | None:
        """The dump's KDA parameters: those under the prefix where ``A_log``/``dt_bias`` lie
        (else any name a layout knows) in the checkpoint's KDA layers; every other name is
        counted as ignored. A layer under that prefix holding ``A_log``/``dt_bias`` that the
        checkpoint's config does not list as a KDA layer is a problem (the engine holds a KDA
        layer the checkpoint does not describe: never loaded from it), not an ignored name.
        None when it has no KDA parameter.

        Raises:
            CheckpointError: KDA parameters under several prefixes; two names for one
                (layer, parameter), such as ``layers.0.`` and ``layers.00.``.
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
            if found != prefix:
                continue
            other = layers.setdefault(layer, {}).setdefault(suffix, n)
            if other != n:
                raise CheckpointError(
                    f"{where}: {other} and {n} name one parameter (layer {layer}, {suffix}); "
                    "an engine holds each parameter once: which one did it load? pass a state "
                    "dict with one name per parameter"
                )
        # Layers the config does not list as KDA layers, under the KDA prefix, holding a
        # parameter only a KDA layer has.
        strays: dict[int, dict[str, str]] = {}
        for n, (found, layer, suffix) in parsed:
            if found == prefix and layer not in self.described and suffix in self.known:
                strays.setdefault(layer, {})[n] = suffix
        marked = {layer: held for layer, held in sorted(strays.items())
                  if not self.markers.isdisjoint(held.values())}
        problems = tuple(
            f"{where}: layer {layer} holds KDA parameters ({', '.join(sorted(found))}) but the "
            f"config of {self.source.path} describes no KDA layer {layer} (its KDA layers: "
            f"{list(self.described)}); is this the checkpoint the engine loaded?"
            for layer, found in marked.items())
        kept = sum(map(len, layers.values())) + sum(map(len, marked.values()))
        return _Selected(prefix, layers, len(names) - kept, problems)

    def no_kda(self, where: str) -> CheckpointError:
        """The refusal of a dump without any KDA parameter."""
        return CheckpointError(
            f"{where}: no KDA parameter of the checkpoint's KDA layers {list(self.layers)} "
            "(no ...layers.{i}.self_attn.A_log or other name an engine layout knows); is it a "
            f"dump of this model ({_FAMILY_NAMES[self.family]}, {self.source.path})?"
        )

    def layout(self, suffixes: Iterable[str], where: str, rank: int) -> EngineLayout:
        """The layout the names fit (the forced one, if any), checked against rank ``rank``'s
        plan (the rank audited: no other rank's view is built for it).

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
        layout.params_for(self.shard(rank).plan)
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
        return [(layer, param) for layer, param in engine_params(self.shard(rank), layout)
                if layer in self.layers]

    def run(self, records: Mapping[str, Any], rank: int, selected: _Selected,
            layout: EngineLayout, report: AuditReport, params: list[tuple[int, EngineParam]],
            advance: Callable[[int], None] | None) -> None:
        """Audit every KDA parameter of one rank (``params``: :meth:`engine_params`) into
        ``report``, then, where the MLA layers are judged (:meth:`mla_plans`) and the records
        hold any MLA parameter of the layout, every MLA parameter of every MLA layer (one
        missing is ``"missing"``)."""
        report.ignored += selected.ignored
        report.problems += selected.problems
        candidates: Candidates | None = None
        expected: dict[int, set[str]] = {}
        rank_plan = self.rank_plan(rank, layout)
        for layer, param in params:
            if candidates is None or candidates.layer != layer:
                candidates = Candidates(self.source, self.shard, rank, layer)
            expected.setdefault(layer, set()).add(param.suffix)
            name = selected.layers.get(layer, {}).get(
                param.suffix, param_name(selected.prefix, layer, param.suffix))
            report.params.append(self.param(rank, layer, name, records.get(name), rank_plan,
                                            param.suffix, candidates))
            if advance:
                advance(1)
        # Names of another quantization form (scale grids of unquantized weights).
        report.ignored += sum(len(set(selected.layers.get(layer, {})) - suffixes)
                              for layer, suffixes in expected.items())
        plans = self.mla_plans(rank, layout)
        # Each MLA parameter's names: a dump may name it as vLLM's filter keeps it (GLM-5.3:
        # mla_attn.<name>). A state dict holding none of them is audited for KDA only.
        named = {(layer, param): [param_name(selected.prefix, layer, s)
                                  for s in (param.suffix, param.dump_suffix) if s]
                 for layer in (self.shard(rank).mla_layers if plans else ())
                 for param in layout.mla}
        if not any(n in records for names in named.values() for n in names):
            return
        candidates = None
        for (layer, param), names in named.items():
            if candidates is None or candidates.layer != layer:
                candidates = Candidates(self.source, self.shard, rank, layer, mla=True)
            name = next((n for n in names if n in records), names[0])
            report.ignored -= name in records  # counted with the other names by select
            report.params.append(self.param(rank, layer, name, records.get(name), rank_plan,
                                            param.suffix, candidates, mla=plans[param.suffix]))

    def model_dtype(self, layout: EngineLayout) -> str:
        """The engine's model dtype (``kda_tp.engines.engine_model_dtype``): the one
        asked for, else ``layout``'s engine's default for this checkpoint (decided once)."""
        if layout.engine not in self._dtypes:
            self._dtypes[layout.engine] = engine_model_dtype(self.description, layout.engine,
                                                             self.requested_dtype)
        return self._dtypes[layout.engine]

    def param(self, rank: int, layer: int, name: str, value: Any, rank_plan: RankPlan,
              suffix: str, candidates: Candidates,
              mla: EngineParamPlan | None = None) -> ParamAudit:
        """One parameter's verdict, the engine running in ``rank_plan``'s model dtype
        (:meth:`model_dtype`): a parameter that follows the model dtype held in another float
        dtype is a mismatch naming both (e.g. F16 in a BF16 engine: a lossy cast). ``mla``:
        the plan of an MLA parameter (``suffix`` one of ``layout.mla``; every one follows the
        model dtype), None for a KDA one."""
        verdict = self._param(rank, layer, name, value, rank_plan, suffix, candidates, mla)
        return verdict if mla is None else dataclasses.replace(verdict, mla=True)

    def _param(self, rank: int, layer: int, name: str, value: Any, rank_plan: RankPlan,
               suffix: str, candidates: Candidates, mla: EngineParamPlan | None) -> ParamAudit:
        shard = self.shard(rank)
        layout, model_dtype = rank_plan.layout, rank_plan.model_dtype
        assert model_dtype is not None  # the auditor decides it
        record = None if value is None else as_record(name, value)
        plan = rank_plan.param_plan(suffix) if mla is None else mla
        what = suffix if mla is None else f"MLA {suffix}"
        if record is None:
            return ParamAudit(rank, layer, name, "missing",
                              f"missing: {layout.name} holds {what} {list(plan.shape)} here")
        follows = mla is not None or layout.follows_model(suffix, shard.plan)
        if record.dtype in FLOAT_DTYPES and record.dtype != model_dtype and follows:
            how = ("the engine's model dtype, as passed" if self.requested_dtype is not None
                   else f"{layout.name}'s default model dtype for this checkpoint's config")
            return ParamAudit(rank, layer, name, "mismatch",
                              f"dtype {record.dtype}, expected {model_dtype} ({how}: an engine "
                              "casts these parameters to its model dtype; pass the dtype it "
                              "ran in as --dtype (model_dtype=) if it is another)",
                              held_dtype=record.dtype if self.requested_dtype is None else None)
        if exact_in_place(record, plan, candidates):
            return ParamAudit(rank, layer, name, "exact")
        builder = build_param if mla is None else build_mla_param

        @functools.cache
        def build() -> np.ndarray:
            with np.errstate(over="ignore", invalid="ignore"):  # an overflow is reported below
                built: np.ndarray = builder(shard, layout, suffix, layer,
                                            model_dtype=model_dtype, plan=plan)
            return built.reshape(-1)

        result = compare(rank, layer, name, record, plan, build, candidates)
        if all(r.source_dtype == plan.dtype for r in plan.regions):
            return result  # nothing cast, nothing overflows
        overflow = audit_overflow(plan, build(), candidates)
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
    model_dtype: str | None = None,
) -> AuditReport:
    """Check every KDA parameter one rank of a serving engine holds against the checkpoint.

    For every KDA layer of the checkpoint (from its config) and every parameter the engine's
    layout has (:mod:`kda_tp.engines`), the expected bytes are built with
    :func:`kda_tp.engines.build_param` (what the
    engine's loader leaves in the parameter: this rank's slices of the plan tensors in the
    layout's order, padding zero, cast to the parameter's dtype: the layout's fixed one, e.g.
    F32 for ``A_log``, else the engine's model dtype, as the engine casts to it) and compared
    byte for byte with the dump. A parameter that differs is diagnosed
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
        model_dtype: the engine's model dtype (its ``--dtype``) as safetensors names it:
            ``"BF16"``, ``"F16"`` or ``"F32"``; None: the engine's default for this
            checkpoint (``kda_tp.engines.engine_model_dtype``: the config's
            ``dtype``/``torch_dtype`` as vLLM or SGLang reads it; an F32 or dtype-less config
            runs in BF16 under vLLM, F16 under SGLang). A parameter the engine casts to its
            model dtype held in another dtype is wrong (F16 held by a BF16 engine is a lossy
            cast).

    Returns:
        The report: ``passed``, and one :class:`ParamAudit` per KDA parameter of every KDA
        layer (a parameter the layout has and ``state_dict`` lacks is ``"missing"``). A layer
        of ``state_dict`` holding KDA parameters (``A_log``, ``dt_bias``) that the config does
        not list as a KDA layer is a problem in the report.

    Raises:
        CheckpointError: the checkpoint cannot be read or has no config; ``layers`` names a
            layer that is not a KDA layer; ``state_dict`` holds no KDA parameter, KDA
            parameters under several prefixes, two names for one (layer, parameter)
            (``layers.0.`` and ``layers.00.``), a key that is not a ``str``, or a value that
            is not an array.
        DtypeMismatchError: ``model_dtype`` is not one of ``BF16``, ``F16``, ``F32``.
        ShapeMismatchError: a :class:`~kda_tp.Tensor` record whose data is not its shape's
            size in bytes.
        EngineLayoutError: no layout, or several, fit the names (the message lists them; names
            of another model family's layout mean the checkpoint is likely the wrong one); an
            unknown ``engine``; a layout that does not fit the checkpoint (e.g. another
            output-gate form).
        PlanError: ``tp_size`` or ``tp_rank`` is not an integer (a bool included), ``tp_size``
            does not divide the heads, or ``tp_rank`` is out of range.
    """
    return audit_rank(state_dict, checkpoint, tp_rank=tp_rank, tp_size=tp_size, engine=engine,
                      layers=layers, model_dtype=model_dtype, mla=True).report


def audit_rank(
    state_dict: Mapping[str, Any],
    checkpoint: str | os.PathLike[str] | SafetensorsSource,
    *,
    tp_rank: int,
    tp_size: int,
    engine: str | None = None,
    layers: Iterable[int] | None = None,
    model_dtype: str | None = None,
    mla: bool = False,
) -> RankAudit:
    """:func:`audit`, with the rank's :class:`~kda_tp.engines.RankPlan` and view it built
    (what the guard hands on to the rank's update target, instead of building them again);
    the hybrid's MLA layers judged too only with ``mla`` (:func:`audit` judges them).

    Raises:
        As :func:`audit`.
    """
    tp_size, tp_rank = _whole("tp_size", tp_size, 1), _whole("tp_rank", tp_rank, 0)
    names = list(state_dict.keys())
    for name in names:
        if not isinstance(name, str):
            raise CheckpointError(f"state_dict: the key {name!r} ({type(name).__name__}) is not a "
                                  "parameter name (a str)")
    auditor = _Auditor(checkpoint, tp_size, engine, layers, model_dtype, first=tp_rank, mla=mla)
    selected = auditor.select(names, "state_dict")
    if selected is None:
        raise auditor.no_kda("state_dict")
    layout = auditor.layout(_suffixes(selected), "state_dict", tp_rank)
    report = AuditReport(layout.name, tp_size, (tp_rank,))
    note = auditor.elsewhere(_suffixes(selected), layout, "state_dict")
    report.problems += [note] if note else []
    auditor.run(state_dict, tp_rank, selected, layout, report,
                auditor.engine_params(tp_rank, layout), None)
    return RankAudit(report, auditor.rank_plan(tp_rank, layout), auditor.shard(tp_rank))


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


def _same_family(model: str, family: str) -> bool:
    """Whether a dump's ``model`` metadata (``"kimi_linear"``, ``"GLM-5.3-Flash"``, ``"k3"``)
    names ``family`` (one of the words of either holds all the other's)."""
    a, b = (set(re.split(r"[-_ ]+", x.lower())) for x in (model, family))
    return a <= b or b <= a


def _check_metadata(records: RankFiles, rank: int, tp_size: int, how: str, family: str
                    ) -> str | None:
    """Compare one rank's files' header metadata (``tp_size``, ``tp_rank``, ``model``, where an
    engine or tool wrote them) with the audit's world size, ``rank`` (taken ``how``) and
    the checkpoint's ``family``; returns the note on a ``model`` of another family.

    Raises:
        PlanError: the metadata's ``tp_size`` or ``tp_rank`` disagrees.
    """
    note = None
    for source in records.sources:
        meta = source.files()[0][1] or {}
        size = meta_int(meta, "tp_size", source.path)
        found = meta_int(meta, "tp_rank", source.path)
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


def _world_size(root: Path, files: Mapping[int, Sequence[SafetensorsSource]],
                given: int | None) -> int:
    """The world size to audit a dump at: ``given`` (``--tp-size``), which must agree with what
    the dump tells, else the dump's.

    Raises:
        PlanError: ``given`` disagrees with the dump (its metadata, or a rank ``>= given`` in
            its file names), or neither says.
        CheckpointError: the dump's files disagree (``kda_tp.audit.dump_world_size``).
    """
    directory = root.is_dir()
    told = dump_world_size(files, by_names=directory)
    if given is None:
        if told is None:
            raise PlanError(f"{root}: the dump does not say its world size (no tp_size metadata, "
                            "one rank's file); pass --tp-size (tp_size=)")
        return told[0]
    if directory and max(files) >= given:
        raise PlanError(
            f"{root}: holds the files of ranks {sorted(files)}, but tp_size is {given}; pass the "
            "world size the engine ran with, or no --tp-size (tp_size=None): the dump tells it"
        )
    if told is not None and told[1] is not None and told[0] != given:
        raise PlanError(f"{told[1]}: the dump's metadata says tp_size {told[0]}; pass "
                        f"--tp-size {told[0]} (tp_size=), not {given}")
    return given


def audit_path(
    checkpoint: str | os.PathLike[str],
    path: str | os.PathLike[str],
    *,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    engine: str | None = None,
    model_dtype: str | None = None,
    progress: Callable[[int], Callable[[int], None]] | None = None,
) -> AuditReport:
    """:func:`audit` on files: a ``save_sharded_state`` directory, or one rank's file.

    A directory holds ``model-rank-{r}-part-{p}.safetensors`` (vLLM, SGLang) or
    ``model-pp-{pp}-tp-{r}-part-{p}.safetensors`` (vLLM with pipeline stages) files; a rank's
    files together are its state dict. Every rank ``0..tp_size-1`` is audited and must be
    there: a missing rank is a problem in the report (it does not pass), not a refusal, so the
    ranks that are there are still audited; a rank whose files hold no KDA parameter has them
    all ``"missing"``. With ``tp_rank``, only that rank is audited (and only it must be there).
    A single ``.safetensors`` file is one rank's whole state dict; its rank is ``tp_rank``, else the
    one in its name, else its header's ``tp_rank`` metadata. Where the files' header metadata
    has ``tp_size``/``tp_rank``, they must agree with ``tp_size`` and the rank; a ``model`` of
    another family than the checkpoint's is a problem in the report.

    Args:
        checkpoint: the checkpoint the engine loaded.
        path: the directory given to ``save_sharded_state``, or one rank's ``.safetensors``.
        tp_size: the engine's tensor-parallel world size; None: the one the dump tells
            (``kda_tp.audit.dump_world_size``: its files' ``tp_size`` metadata, else
            the highest rank in a directory's file names plus one).
        tp_rank: see above (the keyword name every kda_tp function uses for a TP rank).
        engine: see :func:`audit`; the ranks' names must fit one layout.
        model_dtype: the engine's model dtype, as for :func:`audit`.
        progress: called once with the number of parameters to check; returns
            ``advance(n)``, called after each (as for :func:`~kda_tp.shard.verify_shards`).

    Raises:
        CheckpointError: ``path`` does not exist, is a directory without ``sharded_state``
            files, no rank's files hold a KDA parameter, a file's rank is not known (its
            metadata's ``tp_rank`` not ASCII digits), or two files' metadata name different
            world sizes; and as :func:`audit`.
        EngineLayoutError: as :func:`audit`; also when ranks fit different layouts.
        PlanError: as :func:`audit`; also, whatever the mistake, a ``tp_size`` the dump
            contradicts (files of ranks ``>= tp_size``: the message lists the ranks found;
            ``tp_size`` metadata of another size), ``tp_rank`` metadata that disagrees with the
            rank, and no ``tp_size`` for a dump that does not tell it.
    """
    root = Path(path)
    given = None if tp_size is None else _whole("tp_size", tp_size, 1)
    rank = None if tp_rank is None else _whole("tp_rank", tp_rank, 0)
    # A given tp_size: the plan refuses a split the checkpoint's heads cannot make (so
    # tp_size <= heads) before anything is listed; else the dump tells it, below.
    early = None if given is None else _Auditor(
        checkpoint, given, engine, model_dtype=model_dtype,
        first=rank if rank is not None and rank < given else 0, mla=True)
    if root.is_dir():
        files = {r: open_files(paths) for r, paths in sharded_state_files(root).items()}
        how = "its name"
    elif root.is_file():
        (source,) = open_files([root])
        files = {rank if rank is not None else rank_of_file(source): [source]}
        how = "--rank (rank=)" if rank is not None else "its name"
    elif os.path.lexists(root):
        raise CheckpointError(f"{root}: not a regular file or a directory (a device, FIFO or "
                              "socket cannot be read as a dump); pass a save_sharded_state "
                              "directory or one rank's .safetensors file")
    else:
        raise CheckpointError(f"{root}: no such file or directory")
    tp_size = _world_size(root, files, given)
    wanted = (list(range(tp_size)) if rank is None else [rank]) if root.is_dir() else list(files)
    for r in wanted:
        if not 0 <= r < tp_size:
            raise PlanError(f"rank {r} is not a rank of tp_size {tp_size} (0..{tp_size - 1})")
    auditor = early or _Auditor(checkpoint, tp_size, engine, model_dtype=model_dtype,
                                first=wanted[0], mla=True)
    report = AuditReport("", tp_size)
    noted = False  # the dump's model metadata named another family (said once, first)
    dumps: list[tuple[int, RankFiles, _Selected | None]] = []
    for r in wanted:
        if r not in files:
            report.problems.append(
                f"{root}: rank {r} of {tp_size} is missing (no model-rank-{r}-part-*"
                f".safetensors or model-pp-*-tp-{r}-part-*.safetensors)"
            )
            continue
        records = RankFiles(files[r])
        note = _check_metadata(records, r, tp_size, how, auditor.family)
        if note is not None and not noted:
            report.problems.insert(0, note)
            noted = True
        where = str(files[r][0].path) if len(files[r]) == 1 else f"{root} rank {r}"
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
    params = {r: auditor.engine_params(r, layout) for r, *_ in dumps}
    advance = progress(sum(map(len, params.values()))) if progress else None
    for r, records, selected in dumps:
        if selected is None:  # this rank's KDA parameters are all missing
            selected = _Selected(present[0][1].prefix, {}, len(records))
        auditor.run(records, r, selected, layout, report, params[r], advance)
    return report


def _common_layout(auditor: _Auditor, root: Path, present: Sequence[tuple[int, _Selected]],
                   notes: Sequence[str]) -> EngineLayout:
    """The one layout every rank's KDA parameter names fit (together).

    Raises:
        EngineLayoutError: no layout or several fit (``notes``, e.g. the dump's ``model``
            metadata, appended), or the ranks fit different layouts.
    """
    try:
        return auditor.layout(set().union(*(_suffixes(s) for _, s in present)), str(root),
                              present[0][0])
    except EngineLayoutError as error:
        if len(present) > 1:  # which ranks disagree
            layouts = [(r, auditor.layout(_suffixes(s), f"{root} rank {r}", r))
                       for r, s in present]
            if len({lay.name for _, lay in layouts}) > 1:
                raise EngineLayoutError(
                    f"{root}: the ranks' parameter names fit different layouts "
                    f"({', '.join(f'rank {r}: {lay.name}' for r, lay in layouts)}); pass "
                    "--engine (engine=) to audit every rank against one"
                ) from None
        raise EngineLayoutError("; ".join([str(error), *notes])) from None
