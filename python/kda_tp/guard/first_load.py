"""The guard: check a serving engine's KDA weights on every tensor-parallel rank as they load.

An engine plugin (``kda_tp.guard.vllm``, ``kda_tp.guard.sglang``) calls :func:`check` on each
rank right after the weights load, with the rank's parameters, the checkpoint it loaded, and
the rank and world size of the engine's own tensor-parallel group. :func:`check` is
:func:`kda_tp.audit.audit` (the same comparison, byte for byte, and the same diagnosis) behind a
mode switch, the environment variable ``KDA_TP_GUARD`` (:data:`MODE_ENV`):

* ``fail`` (the default): a wrong KDA parameter raises :class:`~kda_tp.errors.GuardError` carrying the
  audit's diagnosis (layer, parameter, part, what it holds instead), which stops the engine's
  start-up;
* ``warn``: the diagnosis is logged at WARNING on the logger ``kda_tp.guard`` and the engine
  goes on;
* ``off``: nothing is checked.

On a pass, one INFO line per rank goes to the logger ``kda_tp.guard``:
``kda_tp guard: <where>: tp rank 1/4: 9 KDA parameters, 1179648 bytes, 0.004 s: OK``.

Nothing is checked, at no measurable cost, for a model without KDA parameters (no
``...self_attn.A_log`` or ``...self_attn.dt_bias`` name nor another name only a KDA layer has:
any non-KDA model, a draft or MTP model). A checkpoint that is not a local path (a remote
streamer, ``s3://...``) is one ``RuntimeWarning``: that load path cannot be checked. A check
that could not run is never silent (:func:`cannot_check`): KDA layer names without ``A_log``
and ``dt_bias``, a checkpoint whose config describes no KDA layer, an explicitly set
``KDA_TP_GUARD_CHECKPOINT`` that is not there, a tensor the guard cannot read: each a
``GuardError`` in mode ``fail``, a warning in mode ``warn``, never a crash.

The checkpoint is described once per rank (``kda_tp.describe``: its config and names read
once); the description goes down to the audit and comes back in the :class:`GuardResult`, for
the engine plugin to build the rank's update target from it without reading anything again.

This module imports no engine and no torch; torch tensors are read only when torch is imported
already (they come from an engine).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audit.auditor import audit
from ..audit.report import AuditReport
from ..checkpoint.description import describe
from ..checkpoint.reader import SafetensorsSource
from ..checkpoint.values import as_record, first_difference, same_values
from ..engines.derived import DERIVED
from ..engines.registry import kda_only_suffixes, param_location, param_name
from ..errors import CheckpointError, GuardError, GuardModeError, KdaTpError
from ..model.config import describes_kda
from .modes import CHECKPOINT_ENV, MODE_ENV, MODES, cannot_check, mode
from .repacked import judge

__all__ = ["GuardResult", "check", "derived_problem", "holds_kda", "looks_kda", "rank_report",
           "stage_layers", "verdict_line"]

logger = logging.getLogger("kda_tp.guard")

# Parameter names only a KDA layer has (every engine layout holds A_log and dt_bias; other
# linear-attention layers such as Qwen3-Next's hold theirs under `linear_attn.`).
_MARKERS = (".A_log", ".dt_bias")


# Names only a KDA layer has (any engine layout, and the derived copies): a model holding
# some under `.self_attn.` without the markers is a KDA model whose markers are missing.
_KDA_LOOKING = tuple(f".{end}" for end in sorted(kda_only_suffixes()) if f".{end}" not in _MARKERS
                     ) + tuple(f".{copy}" for copies in DERIVED.values() for copy in copies)


def derived_problem(name: str, value: Any, params: Mapping[str, Any], layout: str
                    ) -> str | None | bool:
    """The verdict on one derived copy against the parameters it derives from, as they are
    in ``params`` now: None (exact, compared as the audit compares: ``same_values``), a
    problem (its shape, dtype, or the first element that differs), or False when ``layout``
    keeps no such copy (:data:`~kda_tp.engines.derived.DERIVED`) or one of its parameters is
    not in ``params`` (not checked).

    Args:
        name: the copy's full name (``model.layers.0.self_attn._merged_conv_weight``).
        value: its tensor (torch on any device, numpy).
        params: the rank's parameters by full name.
        layout: the engine layout's name.
    """
    location = param_location(name)
    known = DERIVED.get(layout, {})
    if location is None or location[2] not in known:
        return False
    prefix, layer, suffix = location
    copy = known[suffix]
    origins = [param_name(prefix, layer, source) for source in copy.sources]
    if any(origin not in params for origin in origins):
        return False
    try:
        got = as_record(name, value)
        bases = [as_record(origin, params[origin]) for origin in origins]
    except KdaTpError as error:
        return f"cannot be read: {error}"
    want = np.ascontiguousarray(copy.derive(*(b.array for b in bases)))
    want_dtype = as_record(name, want).dtype
    what = " and ".join(copy.sources)
    if got.array.shape != want.shape or got.dtype != want_dtype:
        return (f"shape {list(got.array.shape)} x {got.dtype}, expected {list(want.shape)} x "
                f"{want_dtype} (derived from {what})")
    flat_got, flat_want = np.ascontiguousarray(got.array).reshape(-1), want.reshape(-1)
    if same_values(flat_got, flat_want):
        return None
    first = first_difference(flat_got, flat_want)
    index = [int(i) for i in np.unravel_index(first, want.shape)]
    stale = (f"the engine's copy is stale (built before the last update and never rebuilt: "
             f"{copy.issue})" if copy.issue else
             "the engine's decode copy is stale or was filled from another slice")
    return (f"differs from what {what} makes of it at {index} (expected "
            f"{float(flat_want[first])!r}, got {float(flat_got[first])!r}): {stale}")


def holds_kda(names: Iterable[str]) -> bool:
    """Whether parameter names include a KDA layer's (``...self_attn.A_log`` or
    ``...self_attn.dt_bias``, any prefix): the cheap test :func:`check` skips on, for plugins
    that must decide before they know the checkpoint. One pass over the names, no I/O; a
    name that is not a ``str`` is no KDA name."""
    return _any_ending(names, _MARKERS)


def looks_kda(names: Iterable[Any]) -> bool:
    """Whether names include a KDA layer's: :func:`holds_kda`'s markers or other names only a
    KDA layer has (its gate projections, ``o_norm``, its fused projections or convs, under
    ``.self_attn.``). True with :func:`holds_kda` false is a KDA model whose ``A_log`` and
    ``dt_bias`` are missing, which :func:`check` skips with a warning. One pass over the
    names, no I/O."""
    return _any_ending(names, _MARKERS + _KDA_LOOKING)


def _any_ending(names: Iterable[Any], ends: tuple[str, ...]) -> bool:
    names = list(names) if not isinstance(names, Mapping | list | tuple) else names
    try:  # the fast path: every name a str
        return any(n.endswith(ends) and ".self_attn." in n for n in names)
    except (AttributeError, TypeError):
        return any(isinstance(n, str) and n.endswith(ends) and ".self_attn." in n
                   for n in names)


def rank_report(run: Callable[[], GuardResult | None], *, tp_rank: int, tp_size: int,
                where: str) -> dict[str, Any]:
    """One rank's live audit as the plain dict both engine plugins return per rank
    (``vllm_plugin.audit_llm``, ``sglang_plugin.audit_engine``); never raises for a wrong
    rank or a check that could not run.

    Args:
        run: the rank's check: a call of :func:`check` in mode ``fail`` (a failure raises
            :class:`GuardError` with its report; a check that cannot run raises it without).
        tp_rank: the rank checked.
        tp_size: the tensor-parallel world size.
        where: the caller's label (``"sglang"``, ``"vllm audit"``).

    Returns:
        Keys ``ok`` (True, False, or None when nothing was checked), ``guarded`` (True),
        ``line`` (the guard's one-line verdict, or ``not checked: <why>``), ``tp_rank``,
        ``tp_size``, ``where``, ``skipped`` (why nothing was checked, or
        None), ``engine`` (the layout), ``params``, ``bytes``, ``seconds``, ``summary`` and
        ``text`` (the audit's summary and full diagnosis) and ``report``
        (``AuditReport.to_dict()``, as ``kda-tp audit --json``).
    """
    out: dict[str, Any] = {"ok": None, "guarded": True, "line": "", "tp_rank": tp_rank,
                           "tp_size": tp_size, "where": where, "skipped": None, "engine": None,
                           "params": 0, "bytes": 0, "seconds": 0.0, "summary": "", "text": "",
                           "report": None, "unchecked": []}
    report: AuditReport | None = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            result = run()
        except GuardError as error:
            if error.report is None:
                out.update(skipped=str(error), line=f"not checked: {error}")
                return out
            result, report = error.result, error.report
            out["line"] = str(error).splitlines()[0]
    if result is not None:
        out.update(result.to_dict())
        return out
    if report is None:
        why = "; ".join(str(w.message) for w in seen) or "no KDA parameter in this model"
        out.update(skipped=why, line=f"not checked: {why}")
        return out
    out.update(ok=report.passed, engine=report.engine, summary=report.summary(),
               text=report.format(), report=report.to_dict())
    return out


def stage_layers(names: Iterable[Any]) -> list[int]:
    """The decoder layers whose KDA parameters ``names`` hold: every layer with a KDA name
    (:func:`looks_kda`'s, not only ``A_log`` / ``dt_bias``), so that a layer whose markers are
    missing is checked, and reported missing, instead of dropped."""
    return sorted({loc[1] for n in names
                   if isinstance(n, str) and looks_kda([n]) and (loc := param_location(n))})


@dataclass(frozen=True)
class GuardResult:
    """What :func:`check` found on one rank.

    Attributes:
        report: the audit's report (``kda_tp.audit.AuditReport``), the derived copies'
            verdicts in its ``problems``.
        tp_rank: the rank checked.
        tp_size: the tensor-parallel world size.
        engine: the engine layout checked against (a ``kda_tp.engines.LAYOUTS`` name).
        params: KDA parameters (and derived copies) checked.
        bytes: their size on the rank, in bytes.
        seconds: wall time of the check, in seconds.
        where: the caller's label (``"vllm worker 3"``), or ``""``.
        source: the checkpoint as this check opened it (its description, ``kda_tp.describe``
            of it, read once): what the engine plugin builds the rank's update target from.
        unchecked: one line per parameter the engine repacked after loading that cannot be
            checked (``<name>: ... not checkable ...``), out of ``report``'s verdicts.
    """

    report: AuditReport
    tp_rank: int
    tp_size: int
    engine: str
    params: int
    bytes: int
    seconds: float
    where: str = ""
    source: SafetensorsSource | None = field(default=None, repr=False, compare=False)
    unchecked: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        """True when every KDA parameter and derived copy is exactly right."""
        return self.report.passed

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (each checked rank's part of the plugins' live
        audit, :func:`rank_report`): ``ok`` (:attr:`passed`), ``line`` (:meth:`line`),
        ``tp_rank``, ``tp_size``, ``where``, ``engine``, ``params``, ``bytes``, ``seconds``,
        ``summary`` and ``text`` (the audit's summary line and full diagnosis), ``report``
        (``AuditReport.to_dict()``, as ``kda-tp audit --json`` prints it) and ``unchecked``."""
        return {"ok": self.passed, "line": self.line(), "tp_rank": self.tp_rank,
                "tp_size": self.tp_size, "where": self.where, "engine": self.engine,
                "params": self.params, "bytes": self.bytes, "seconds": self.seconds,
                "summary": self.report.summary(), "text": self.text(),
                "report": self.report.to_dict(), "unchecked": list(self.unchecked)}

    def text(self) -> str:
        """The audit's diagnosis, then one line per parameter not checkable."""
        return "\n".join([self.report.format(), *(f"rank {self.tp_rank} {u}"
                                                  for u in self.unchecked)])

    def line(self) -> str:
        """The one-line verdict: ``kda_tp guard: <where>: tp rank r/T: N KDA parameters, B
        bytes, S s: OK`` (``FAIL`` when some parameter is wrong; ``, U not checkable
        (repacked)`` before the verdict when some are, ``unchecked``)."""
        where = f"{self.where}: " if self.where else ""
        verdict = "OK" if self.passed else f"FAIL ({len(self.report.failures)} wrong)"
        held = f", {len(self.unchecked)} not checkable (repacked)" if self.unchecked else ""
        return (f"kda_tp guard: {where}tp rank {self.tp_rank}/{self.tp_size}: {self.params} KDA "
                f"parameters ({self.engine}), {self.bytes} bytes, {self.seconds:.3f} s{held}: "
                f"{verdict}")


def _nbytes(value: Any) -> int:
    """Bytes of an array, a torch tensor or a ``kda_tp.Tensor`` (all have ``nbytes``)."""
    found = getattr(value, "nbytes", 0)
    return int(found) if isinstance(found, (int, np.integer)) else 0


def _is_local(checkpoint: Any) -> bool:
    """Whether ``checkpoint`` is a path on this machine (a directory or a file)."""
    if not isinstance(checkpoint, (str, os.PathLike)):
        return False
    text = os.fspath(checkpoint)
    return "://" not in str(text) and os.path.exists(text)


def check(
    params: Mapping[str, Any] | Iterable[tuple[str, Any]],
    checkpoint: str | os.PathLike[str],
    *,
    tp_rank: int,
    tp_size: int,
    engine: str | None = None,
    derived: Mapping[str, Any] | None = None,
    where: str = "",
    layers: Iterable[int] | None = None,
    guard_mode: str | None = None,
    model_dtype: str | None = None,
    repacked: Mapping[str, str] | None = None,
) -> GuardResult | None:
    """Check one rank's loaded KDA parameters against the checkpoint, as the mode says.

    Every KDA parameter of every KDA layer of the checkpoint (its config says which layers) is
    compared byte for byte with this rank's slices, fused as the engine's layout says
    (:func:`kda_tp.audit.audit`, reading only this rank's bytes of the checkpoint); each derived
    copy in ``derived`` (:data:`DERIVED`) with what its parameter makes of it.

    Args:
        params: the rank's parameters, as ``model.named_parameters()`` gives them (a mapping
            or ``(name, tensor)`` pairs): torch tensors on any device, numpy arrays or
            ``kda_tp.Tensor`` records; names with any model prefix.
        checkpoint: the local checkpoint directory (or ``.safetensors`` file) the engine
            loaded, with its ``config.json``.
        tp_rank: the rank, from the engine's own tensor-parallel group.
        tp_size: the engine's tensor-parallel world size.
        engine: a layout name (``kda_tp.engines.LAYOUTS``), or None to recognise it from the
            names.
        derived: the engine's copies of KDA parameters outside ``params``
            (``...self_attn.decode_conv1d_weight``), by full name; names :data:`DERIVED` does
            not know for the layout are ignored.
        where: a label for the messages (``"vllm worker 3"``).
        layers: the 0-based KDA layers this rank holds, under pipeline parallelism (its
            stage's); None: every KDA layer of the checkpoint.
        guard_mode: one of :data:`MODES` instead of ``KDA_TP_GUARD``'s (e.g. ``"warn"`` to
            report on a running engine without raising); None: the variable's.
        model_dtype: the engine's model dtype as a safetensors name (``"BF16"``; see
            :func:`~kda_tp.engines.model_dtype_name`), passed to the audit so that a parameter held in
            another float dtype (a lossy cast) is wrong; None: the engine's default for the
            checkpoint's config (``kda_tp.engines.engine_model_dtype``).
        repacked: the parameters the engine repacked after loading, as
            :func:`kda_tp.guard.repacked.held` found them (``params`` holding their
            read-back): a failing one it could not read, or whose expected values its GEMM
            cannot carry, is not checkable (``GuardResult.unchecked``), never wrong.

    Returns:
        None without checking anything when the mode is ``off`` or ``params`` has no KDA
        parameter name; also, with one ``RuntimeWarning`` saying why, when ``checkpoint`` is
        not a local path; and in mode ``warn`` when the check could not run (KDA layer names
        but no ``A_log`` or ``dt_bias``, a config that describes no KDA layer, a tensor the
        audit cannot read: a warning, see :func:`cannot_check`); else the
        :class:`GuardResult` (in mode ``warn`` also when it failed). The result's
        :meth:`~GuardResult.line` is logged at INFO on a pass, the diagnosis at WARNING on a
        failure in mode ``warn``.

    Raises:
        GuardError: mode ``fail``, and some KDA parameter (or derived copy) is wrong or missing,
            or the check could not run (KDA layer names without ``A_log`` and ``dt_bias``, a
            config describing no KDA layer, no engine layout fits the names, a config the
            audit refuses, a tensor it cannot read: sparse, uninitialized, meta); the message
            is the audit's diagnosis, ``.report`` the report and ``.result`` the
            :class:`GuardResult` (both None when the audit could not run). A failing verdict
            is first logged at ERROR as one line naming the rank and the wrong parameters
            (:func:`verdict_line`).
        GuardModeError: ``KDA_TP_GUARD`` (or ``guard_mode``) holds another value than
            ``fail``, ``warn``, ``off``.
        CheckpointError: a KDA model's ``params`` has a key that is not a ``str``.
        TypeError: ``derived`` has a key that is not a ``str``; ``params`` is neither a
            mapping nor ``(name, tensor)`` pairs.
    """
    chosen = mode() if guard_mode is None else guard_mode
    if chosen not in MODES:
        raise GuardModeError(f"guard_mode={guard_mode!r} is not a guard mode; use one of "
                             f"{', '.join(MODES)}")
    if chosen == "off":
        return None
    named = params if isinstance(params, Mapping) else _pairs(params)
    for key in derived or {}:
        if not isinstance(key, str):
            raise TypeError(f"derived: the key {key!r} ({type(key).__name__}) is not a "
                            "parameter name (a str)")
    label = f"{where}: " if where else ""
    if not looks_kda(named):  # one pass over a non-KDA model's names
        return None
    if not holds_kda(named):
        cannot_check(f"kda_tp guard: {label}tp rank {tp_rank}/{tp_size}: the parameters hold "
                     "KDA layer names (gate projections, o_norm, fused projections, convs) but "
                     "no ...self_attn.A_log or ...self_attn.dt_bias; the KDA weights are not "
                     "checked (a loader that dropped them?)", chosen)
        return None
    for key in named:
        if not isinstance(key, str):
            raise CheckpointError(f"params: the key {key!r} ({type(key).__name__}) is not a "
                                  "parameter name (a str)")
    if not _is_local(checkpoint):
        warnings.warn(
            f"kda_tp guard: {label}the checkpoint {checkpoint!r} is not a local path (a remote "
            f"or streamed load?); the KDA weights of tp rank {tp_rank}/{tp_size} are not "
            f"checked (set {MODE_ENV}=off to silence this)",
            RuntimeWarning, stacklevel=2,
        )
        return None
    start = time.perf_counter()
    try:
        try:
            source: SafetensorsSource | None = SafetensorsSource(checkpoint)
        except KdaTpError:
            source = None  # no tensors to audit: the audit below says so, after the config
        description = describe(source or checkpoint)  # config and names read once per rank
        try:
            describes = describes_kda(description.config)
        except KdaTpError:
            describes = True  # a broken config.json: the audit below says so
        if not describes:
            cannot_check(f"kda_tp guard: {label}tp rank {tp_rank}/{tp_size}: the parameters are "
                         "KDA layers' (...self_attn.A_log / dt_bias) but the config of "
                         f"{os.fspath(checkpoint)} describes no KDA layer; the KDA weights are "
                         f"not checked (is it the checkpoint the engine loaded? set "
                         f"{CHECKPOINT_ENV} to it)", chosen)
            return None
        report = audit(named, source or checkpoint, tp_rank=tp_rank, tp_size=tp_size, engine=engine,
                       layers=layers, model_dtype=model_dtype)
        count = len(report.params)
        unchecked = judge(report, repacked, source or checkpoint, tp_rank=tp_rank,
                          model_dtype=model_dtype) if repacked else []
        checked = [p for p in report.params if p.status != "missing"]
        nbytes = sum(_nbytes(named[p.name]) for p in checked)
        for name, value in (derived or {}).items():
            problem = _check_derived(name, value, named, report)
            if problem is not False:
                count += 1
                nbytes += _nbytes(value)
                if problem:
                    report.problems.append(f"rank {tp_rank} {name}: {problem}")
    except GuardError:
        raise
    except Exception as error:  # the guard's own failure must never crash a warn-mode engine
        why = str(error) if isinstance(error, KdaTpError) else f"{type(error).__name__}: {error}"
        text = (f"kda_tp guard: {label}tp rank {tp_rank}/{tp_size}: cannot check the KDA "
                f"weights against {os.fspath(checkpoint)}: {why}")
        if chosen == "fail":
            raise GuardError(text + f" (set {MODE_ENV}=warn to start anyway)") from error
        logger.warning("%s", text)
        return None
    result = GuardResult(report, tp_rank, tp_size, report.engine, count, nbytes,
                         time.perf_counter() - start, where, source, tuple(unchecked))
    if result.passed:
        logger.info("%s", result.line())
        return result
    text = (f"{result.line()}\nthe KDA weights this rank loaded differ from "
            f"{os.fspath(checkpoint)}:\n{result.text()}")
    if chosen == "fail":
        wrong = [p.name for p in report.params if not p.passed]
        wrong += [p.split(": ", 1)[0].removeprefix(f"rank {tp_rank} ") for p in report.problems]
        logger.error("%s", verdict_line(result.line(), wrong))
        raise GuardError(text + f"\n(set {MODE_ENV}=warn to start anyway)", report, result)
    logger.warning("%s", text)
    return result


def verdict_line(line: str, wrong: Iterable[str]) -> str:
    """A failing verdict ``line`` with the wrong parameters' names (the first 3, then ``+N
    more``): the one line an engine's log carries where the engine cannot carry the
    diagnosis to its caller (vLLM's ``LLM()`` raises only "Engine core initialization
    failed" and logs the ``GuardError``'s lines one by one)."""
    names = list(dict.fromkeys(wrong))
    more = f" +{len(names) - 3} more" if len(names) > 3 else ""
    return f"{line}: {', '.join(names[:3])}{more}" if names else line


def _pairs(params: Iterable[Any]) -> dict[str, Any]:
    """``(name, tensor)`` pairs as a dict.

    Raises:
        TypeError: ``params`` is not iterable, or an item is not a pair.
    """
    out: dict[str, Any] = {}
    try:
        items = iter(params)
    except TypeError:
        raise TypeError(f"params: a {type(params).__name__}; expected a mapping or (name, "
                        "tensor) pairs") from None
    for i, item in enumerate(items):
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise TypeError(f"params: item {i} is a {type(item).__name__}, not a (name, "
                            "tensor) pair; pass a mapping or model.named_parameters()")
        out[item[0]] = item[1]
    return out


def _check_derived(name: str, value: Any, named: Mapping[str, Any],
                   report: AuditReport) -> str | None | bool:
    """:func:`derived_problem` after the first load: checked only when every parameter it
    derives from is exact (else the parameter's failure says it all)."""
    location = param_location(name)
    known = DERIVED.get(report.engine, {})
    if location is None or location[2] not in known:
        return False
    prefix, layer, suffix = location
    verdicts = {p.name: p for p in report.params}
    for source in known[suffix].sources:
        origin = f"{prefix}{layer}.self_attn.{source}"
        if origin not in verdicts:
            return f"its parameter {origin} was not checked"
        if not verdicts[origin].passed:
            return None
    return derived_problem(name, value, named, report.engine)
