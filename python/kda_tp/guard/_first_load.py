"""The guard: check a serving engine's KDA weights on every tensor-parallel rank as they load.

An engine plugin (``kda_tp.guard.vllm``, ``kda_tp.guard.sglang``) calls :func:`check` on each
rank right after the weights load, with the rank's parameters, the checkpoint it loaded, and
the rank and world size of the engine's own tensor-parallel group. :func:`check` is
:func:`kda_tp.audit.audit` (the same comparison, byte for byte, and the same diagnosis) behind a
mode switch, the environment variable ``KDA_TP_GUARD`` (:data:`MODE_ENV`):

* ``fail`` (the default): a wrong KDA parameter raises :class:`~kda_tp.errors.GuardError` carrying the
  audit's diagnosis (layer, parameter, part, what it holds instead), which stops the engine's
  start-up;
* ``warn``: the diagnosis is logged at ERROR on the logger ``kda_tp.guard`` and issued as a
  :class:`~kda_tp.errors.GuardWarning`, and the engine goes on;
* ``off``: nothing is checked.

On a pass, one INFO line per rank goes to the logger ``kda_tp.guard``:
``kda_tp guard: <where>: tp rank 1/4: 9 KDA parameters, 1179648 bytes, 0.004 s: OK``.

A hybrid's MLA layers are judged too where their plan can be made
(``kda_tp.rank.mla.rank_mla_plan``), every MLA parameter of the rank as the audit judges it
(``audit_rank(..., mla=True)``): the line then counts both (``7 KDA and 6 MLA parameters``) and a
wrong MLA parameter fails as a KDA one does. MLA layers the plan refuses (or a pipeline stage's)
are not checked, and the line says so (``, MLA not checked: <why>``) without failing.

Nothing is checked, at no measurable cost, for a model without KDA parameters (no
``...self_attn.A_log`` or ``...self_attn.dt_bias`` name nor another name only a KDA layer has:
any non-KDA model, a draft or MTP model). A checkpoint that is not a local path (a remote
streamer, ``s3://...``) is one ``RuntimeWarning``: that load path cannot be checked. A check
that could not run is never silent (``cannot_check``): KDA layer names without ``A_log``
and ``dt_bias``, a checkpoint whose config describes no KDA layer, an explicitly set
``KDA_TP_GUARD_CHECKPOINT`` that is not there, a tensor the guard cannot read: each a
``GuardError`` in mode ``fail``, a warning in mode ``warn``, never a crash.

The checkpoint is described once per rank (``kda_tp.describe``: its config and names read
once); the audit builds the rank's plan and engine parameter plans once
(:class:`~kda_tp.engines.RankPlan`), which the :class:`GuardResult` carries for the rank's
update target to be built from without planning anything again.

This module imports no engine and no torch; torch tensors are read only when torch is imported
already (they come from an engine).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audit.auditor import audit_rank
from ..audit.report import AuditReport
from ..checkpoint.description import CheckpointDescription, describe
from ..checkpoint.reader import SafetensorsSource
from ..engines.build import RankPlan
from ..engines.layout import mla_unjudged
from ..errors import CheckpointError, GuardError, GuardModeError, KdaTpError
from ..model.config import describes_kda
from ..rank.mla import MlaTpPlan, rank_mla_plan
from ._derived import first_load_problem, mla_first_load_problem
from ._modes import CHECKPOINT_ENV, MODE_ENV, MODES, cannot_check, failed, mode, passed
from ._names import holds_kda, looks_kda
from ._repacked import judge

__all__ = ["GuardResult", "check"]

logger = logging.getLogger("kda_tp.guard")

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
        plan: the rank's plan and engine parameter plans the audit built
            (:class:`~kda_tp.engines.RankPlan`): what the rank's update target is built from.
        unchecked: one line per parameter the engine repacked after loading that cannot be
            checked (``<name>: ... not checkable ...``), out of ``report``'s verdicts.
        mla: MLA parameters (of the hybrid's MLA layers) checked, out of ``params``.
        mla_unchecked: why the rank's MLA layers were not checked (their plan refused: see
            ``kda_tp.rank.mla.rank_mla_plan``), or ``""``.
        mla_plan: the rank's MLA plan (``kda_tp.rank.MlaTpPlan``) where its MLA layers were
            checked, else None: what the derived copies the engine builds after loading are
            judged with (``kda_tp.guard._derived.judge_mla_copies``).
    """

    report: AuditReport
    tp_rank: int
    tp_size: int
    engine: str
    params: int
    bytes: int
    seconds: float
    where: str = ""
    plan: RankPlan | None = field(default=None, repr=False, compare=False)
    unchecked: tuple[str, ...] = ()
    mla: int = 0
    mla_unchecked: str = ""
    mla_plan: MlaTpPlan | None = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        """True when every KDA parameter and derived copy is exactly right."""
        return self.report.passed

    def to_dict(self) -> dict[str, Any]:
        """The result as a JSON-ready dict (each checked rank's part of the plugins' live
        audit, :func:`kda_tp.guard.rank_report`): ``ok`` (:attr:`passed`), ``line`` (:meth:`line`),
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
        held += f", MLA not checked: {self.mla_unchecked}" if self.mla_unchecked else ""
        counted = (f"{self.params - self.mla} KDA and {self.mla} MLA" if self.mla
                   else f"{self.params} KDA")
        return (f"kda_tp guard: {where}tp rank {self.tp_rank}/{self.tp_size}: {counted} "
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
    """Check one rank's loaded KDA (and MLA) parameters against the checkpoint, as the mode
    says.

    Every KDA parameter of every KDA layer of the checkpoint (its config says which layers) is
    compared byte for byte with this rank's slices, fused as the engine's layout says
    (:func:`kda_tp.audit.audit`, reading only this rank's bytes of the checkpoint); each derived
    copy in ``derived`` (``DERIVED``) with what its parameter makes of it. A hybrid's MLA
    parameters too, where its MLA layers can be planned (``GuardResult.mla`` counts them; else
    ``GuardResult.mla_unchecked`` says why not, which fails nothing).

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
            (``...self_attn.decode_conv1d_weight``), by full name, and of the MLA layers'
            ``kv_b_proj`` once the engine built them (``MLA_DERIVED``: ``W_UK_T``, ``w_kc``,
            ..., judged where the MLA parameters are); names neither table knows for the
            layout are ignored.
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
            ``kda_tp.guard.vllm.repacked.held`` found them (``params`` holding their
            read-back): a failing one read back through the engine's GEMM is judged element
            by element on what the read-back carries (``read_back_difference``: the elements
            it cannot carry set aside and counted in ``GuardResult.unchecked``); one it could
            not read is taken out, not checked (``GuardResult.unchecked``).

    Returns:
        None without checking anything when the mode is ``off`` or ``params`` has no KDA
        parameter name; also, with one ``RuntimeWarning`` saying why, when ``checkpoint`` is
        not a local path; and in mode ``warn`` when the check could not run (KDA layer names
        but no ``A_log`` or ``dt_bias``, a config that describes no KDA layer, a tensor the
        audit cannot read: a warning, see ``cannot_check``); else the
        :class:`GuardResult` (in mode ``warn`` also when it failed). The result's
        :meth:`~GuardResult.line` is logged at INFO on a pass, the diagnosis at ERROR on a
        failure in mode ``warn``, also issued as a :class:`~kda_tp.errors.GuardWarning`
        (``kda_tp.guard._modes.failed``).

    Raises:
        GuardError: mode ``fail``, and some KDA parameter (or derived copy) is wrong or missing,
            or the check could not run (KDA layer names without ``A_log`` and ``dt_bias``, a
            config describing no KDA layer, no engine layout fits the names, a config the
            audit refuses, a tensor it cannot read: sparse, uninitialized, meta); the message
            is the audit's diagnosis, ``.report`` the report and ``.result`` the
            :class:`GuardResult` (both None when the audit could not run). A failing verdict
            is first logged at ERROR as one line naming the rank and the wrong parameters
            (``kda_tp.guard._modes.verdict_line``).
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
        mla_plan, why = _mla(description, tp_rank, tp_size, layers)
        audited = audit_rank(named, source or checkpoint, tp_rank=tp_rank, tp_size=tp_size,
                             engine=engine, layers=layers, model_dtype=model_dtype,
                             mla=mla_plan is not None)
        count = len(audited.report.params)
        mla_count = sum(p.mla for p in audited.report.params)
        if mla_plan is not None and not mla_count:
            why = "the parameters hold none of the MLA layers' names"
        report, unchecked = (judge(audited, repacked, named) if repacked
                              else (audited.report, []))
        checked = [p for p in report.params if p.status != "missing"]
        nbytes = sum(_nbytes(named[p.name]) for p in checked)
        problems = []
        for name, value in (derived or {}).items():
            problem = first_load_problem(name, value, named, report)
            if problem is False and mla_count:
                problem = mla_first_load_problem(name, value, named, report, mla_plan)
                mla_count += problem is not False
            if problem is not False:
                count += 1
                nbytes += _nbytes(value)
                if problem:
                    problems.append(f"rank {tp_rank} {name}: {problem}")
        if problems:
            report = dataclasses.replace(report, problems=[*report.problems, *problems])
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
                         time.perf_counter() - start, where, audited.plan, tuple(unchecked),
                         mla_count, why, mla_plan if mla_count else None)
    if result.passed:
        passed(result.line())
        return result
    wrong = [p.name for p in report.params if not p.passed]
    wrong += [p.split(": ", 1)[0].removeprefix(f"rank {tp_rank} ") for p in report.problems]
    failed(f"{result.line()}\nthe {'KDA and MLA' if mla_count else 'KDA'} weights this rank "
           f"loaded differ from "
           f"{os.fspath(checkpoint)}:\n{result.text()}", wrong, chosen, go_on="start anyway",
           report=report, result=result)
    return result


def _mla(description: CheckpointDescription, tp_rank: int, tp_size: int,
         layers: Iterable[int] | None) -> tuple[MlaTpPlan | None, str]:
    """The rank's MLA plan when its MLA layers are judged (``kda_tp.rank.mla.rank_mla_plan``),
    else None and why not (``""`` for a model without MLA layers, which has nothing to say)."""
    try:
        plan, line = rank_mla_plan(description, tp_rank, tp_size)
    except KdaTpError as error:  # a head split the plan refuses: reported, not a refusal
        return None, str(error)
    if plan is None:
        return None, (line or "").replace(" passed through whole (not sliced per rank)", "")
    if layers is not None:
        return None, "a pipeline stage's MLA layers are not checked yet"
    why = mla_unjudged(plan)
    return (None, why) if why else (plan, "")


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
