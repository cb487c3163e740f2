"""The guard inside SGLang 0.5.23: every TP rank checks its KDA weights right after they load.

Installing kda_tp (``pip install .`` from this checkout, or its wheel: it is not on PyPI)
registers :func:`register` as the entry point ``kda_tp_guard`` of the group
``sglang.srt.plugins``. SGLang's own ``sglang.srt.plugins.load_plugins()`` runs it in every
process it starts (each scheduler, one per TP rank, included) and then applies the hooks it
registered with ``sglang.srt.plugins.hook_registry.HookRegistry``:

* after ``ModelRunner.load_model`` (the default ``--startup-weight-load-mode``): the guard runs
  on the loaded model;
* after ``ModelRunner.finalize_startup_weight_load`` (``--startup-weight-load-mode overlap``,
  where ``load_model`` returns with placeholder values and the real weights are committed
  here): the guard runs then instead;
* around ``WeightUpdater.update_weights_from_disk``: after a successful update the guard runs
  again, on the new checkpoint; a wrong update is reported as a failed update (the message is
  the diagnosis);
* around the scheduler's ``SchedulerWeightUpdaterManager.begin_weight_update`` and
  ``end_weight_update`` (SGLang 0.5.23's weight-update session; ``update_weights_from_tensor``
  and ``update_weights_from_distributed`` are refused outside one): the session is one update
  (``kda_tp.guard._updates``), opened once SGLang opened it and checked when SGLang ends
  it; a wrong one turns the end's answer into ``success=False`` with the diagnosis in mode
  ``fail`` (logged in ``warn``). An update SGLang refuses never reaches the model and is not
  reported;
* around ``WeightUpdater.update_weights_from_tensor``, ``load_weights_from_distributed`` (the
  load step of ``update_weights_from_distributed``) and ``update_weights_from_ipc``: inside a
  session each feeds it; outside one (``update_weights_from_ipc``, which SGLang does not
  confine to a session) each is one update, a wrong one a failed update ``(False,
  diagnosis)`` in mode ``fail``. A ``load_format="direct"`` or custom-loader tensor update
  writes engine-format tensors without ``load_weights``: one warning that it is not checked;
* around ``Scheduler.handle_rpc_request``: the scheduler answers SGLang's own
  ``Engine.collective_rpc`` for the method ``kda_tp_guard_audit`` (:data:`RPC_METHOD`), which
  :func:`audit_engine` uses to audit a running engine on all its ranks.

The check is ``kda_tp.guard.check``: every KDA parameter of every KDA layer against this rank's
slices of the checkpoint, in the SGLang 0.5.23 layout the parameter names fit
(``sglang-0.5.23-k3``, ``-kimi-linear``, ``-kimi-linear-unfused``, ``-glm-5.3`` of
``kda_tp.engines``), with the rank and world size of SGLang's attention tensor-parallel group
(``get_parallel().attn_tp_rank`` / ``attn_tp_size``; without DP attention these are ``tp_rank``
/ ``tp_size``): the group SGLang shards its KDA heads over. Its mode is the environment variable
``KDA_TP_GUARD`` (``fail``, the default, stops the scheduler and so the start-up; ``warn``;
``off``). Draft (speculative / MTP) model runners are skipped before any work, non-KDA models
by the guard's own name test.

The checkpoint is :func:`kda_tp.guard.load_checkpoint`'s, as for vLLM: the runner's
``model_config.model_path`` (a Hugging Face repository id resolved to its local cache in the
engine's ``download_dir``, never downloaded), or ``KDA_TP_GUARD_CHECKPOINT`` (a
``--load-format sharded_state`` start needs it); a ``--load-format dummy`` start (random
weights) is not checked at load, and its first update must fill every KDA region. The
engine's model dtype (``model_config.dtype``) is passed to the check.

Armed, provably: at the first load each rank records which of :data:`TARGETS` SGLang's
``HookRegistry`` applied (``apply_hooks`` only logs a target it could not resolve) and what
holds each then; a target is armed while that wrapper still holds it (or what replaced it was
seen running kda_tp's function). A missing one never stops the engine: one WARNING says what
is not armed, and a KDA model is refused at its first load in mode ``fail`` (naming SGLang's
version, what is missing and ``KDA_TP_GUARD=warn``), or warned of in ``warn``.
:func:`audit_engine` reports it per rank with the engine and kda_tp versions, the checks run
and the last verdict.

This module imports SGLang only inside the functions SGLang calls; ``import kda_tp`` imports
neither it nor SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import pkgutil
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...errors import GuardError
from ...output.marks import read_regular
from .._first_load import GuardResult, check
from .._live import Follower, followed
from .._load import follow_model, on_load
from .._modes import MODE_ENV, cannot_check, mode, warn_once
from .._names import looks_kda
from .._record import RECORD, account, count, engine_ranks, rank_report, sized
from .._record import status as _status
from .facts import SglangEngine, parallel_int, label, parallel, checkpoint_of, rank_and_size

__all__ = ["RPC_METHOD", "TARGETS", "audit_engine", "audit_runner", "checkpoint_of",
           "guard_runner", "rank_and_size", "register", "status"]

logger = logging.getLogger("kda_tp.guard")

#: The scheduler method :func:`audit_engine` calls through ``Engine.collective_rpc``.
RPC_METHOD = "kda_tp_guard_audit"

_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_MANAGER = ("sglang.srt.managers.scheduler_components.weight_updater."
            "SchedulerWeightUpdaterManager")
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"
_SESSION = "weight update session"

#: The SGLang 0.5.23 functions the plugin hooks (``HookRegistry`` targets).
TARGETS = (
    f"{_RUNNER}.load_model",
    f"{_RUNNER}.finalize_startup_weight_load",
    f"{_UPDATER}.update_weights_from_disk",
    f"{_UPDATER}.update_weights_from_tensor",
    f"{_UPDATER}.load_weights_from_distributed",
    f"{_UPDATER}.update_weights_from_ipc",
    f"{_MANAGER}.begin_weight_update",
    f"{_MANAGER}.end_weight_update",
    f"{_SCHEDULER}.handle_rpc_request",
)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the guard's hooks.

    SGLang's ``load_plugins()`` calls it once per process and then applies the hooks
    (``HookRegistry.apply_hooks``); nothing is checked until a model runner loads weights.
    It says so in one INFO line (``kda_tp guard: registered in SGLang (mode ...): ...``).

    Raises:
        GuardModeError: ``KDA_TP_GUARD`` holds another value than the modes (the hooks are
            registered first: every load they see refuses too).
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, function in zip(TARGETS, _functions()):
        HookRegistry.register(target, function, HookType.AFTER if function in
                              (_after_load_model, _after_finalize) else HookType.AROUND)
    chosen = mode()  # an invalid mode raises here, the hooks registered (every load refuses)
    what = (f"checks nothing ({MODE_ENV}=off); audit_engine still audits on request"
            if chosen == "off" else
            "checks the KDA weights of every model load and weight update on every rank")
    logger.info("kda_tp guard: registered in SGLang (mode %s): %s", chosen, what)


def _functions() -> tuple[Callable[..., Any], ...]:
    """kda_tp's function for each of :data:`TARGETS`, in order (the first two run after
    SGLang's, the others around it)."""
    return (_after_load_model, _after_finalize, _around_update_from_disk,
            _around_update_from_tensor, _around_load_from_distributed, _around_update_from_ipc,
            _around_begin, _around_end, _around_rpc)


def hooks() -> dict[str, str]:
    """Each of :data:`TARGETS`: ``"armed"`` while the wrapper SGLang's ``HookRegistry`` put
    there holds the target still (or what replaced it was seen running kda_tp's function:
    ``kda_tp.guard._record.Record.verify``), ``"replaced by <qualname>"`` once something else
    holds it, else why it is missing (also kept in the process's record). The registry's
    word that it applied a target is taken once, for what holds the target then; after that
    only what holds it counts."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        applied = set(getattr(HookRegistry, "_patched", ()))
    except ImportError as error:
        RECORD.hooks.update({t: f"missing: {error}" for t in TARGETS})
        return {t: RECORD.hooks[t] for t in TARGETS}
    for target, function in zip(TARGETS, _functions()):
        if target in RECORD.installed:
            continue
        if target not in applied:
            RECORD.hooks[target] = ("missing: not applied by SGLang's HookRegistry (renamed "
                                    "in this SGLang version, or SGLANG_PLUGINS leaves out "
                                    "kda_tp_guard?)")
            continue
        path, attr = target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(path)
        except (ImportError, AttributeError, ValueError) as error:
            RECORD.hooks[target] = f"missing: {type(error).__name__}: {error}"
            continue
        RECORD.adopt(target, owner, attr, function)
    RECORD.verify()
    return {t: RECORD.hooks[t] for t in TARGETS}


def status() -> dict[str, Any]:
    """This process's guard (``kda_tp.guard._record.status`` for SGLang): ``versions``,
    ``mode``, ``hooks`` (``hooks``), ``checks`` (by kind: ``first load``, ``update``...)
    and ``last`` (the last verdict line)."""
    hooks()
    return _status("sglang")


def _check_armed(runner: Any) -> None:
    """At a model runner's first load: every hook target armed, else what is not is said
    once per process in one WARNING and the engine starts; a KDA model (not a draft) that
    cannot be checked on every path is a check that cannot run (``cannot_check``: a
    ``GuardError`` raised from the load in mode ``fail``, naming SGLang's version, what is
    missing and ``KDA_TP_GUARD=warn``; a warning in ``warn``)."""
    missing = {t: why for t, why in hooks().items() if why != "armed"}
    if not missing:
        return
    model = getattr(runner, "model", None)
    text = (f"kda_tp guard: sglang {_version()}: hooks not armed, so these paths are not "
            "checked: " + "; ".join(f"{t}: {why}" for t, why in missing.items()))
    if model is not None and not getattr(runner, "is_draft_worker", False) and \
            looks_kda(n for n, _ in model.named_parameters()):
        cannot_check(f"{text}; this KDA model's weights cannot be checked on every path")
    elif text not in _said:
        _said.add(text)
        logger.warning("%s; the engine starts (a model with no KDA layer needs no check)", text)


_said: set[str] = set()


def _version() -> str:
    """The running SGLang's version (``"?"`` when it says none)."""
    return str(getattr(sys.modules.get("sglang"), "__version__", "?"))


# ------------------------------------------------------------------------------------------------
# What SGLang calls


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.load_model``: check, unless the overlap mode commits the weights
    later (``runner.startup_weight_load`` set: the finalize hook checks)."""
    RECORD.running(_after_load_model)
    _check_armed(runner)
    if getattr(runner, "startup_weight_load", None) is None:
        guard_runner(runner, follows=True)


def _after_finalize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.finalize_startup_weight_load`` (overlap mode): check."""
    RECORD.running(_after_finalize)
    guard_runner(runner, follows=True)


def follow_runner(runner: Any) -> Follower | None:
    """Check every later update of a (non-draft) runner's model, KDA names (as vLLM's plugin,
    :func:`kda_tp.guard.looks_kda`: a model that lost ``A_log`` too): its ``load_weights``
    feeds the update sessions (:func:`kda_tp.guard.follow`). A model whose first load was
    checked is followed from that check already. Returns the follower, or None.

    Raises:
        GuardError: mode ``fail`` and the checkpoint's config gives no plan for the model's
            KDA parameters.
    """
    model = getattr(runner, "model", None)
    if model is None:
        return None
    return follow_model(SglangEngine(runner), model)


def _verdict(how: Follower, owner: str) -> str | None:
    """Close ``owner``'s session: None when right (or not checked), else the diagnosis (mode
    ``fail``; mode ``warn`` logs it and returns None)."""
    try:
        how.close(owner)
    except GuardError as error:
        return str(error)
    return None


def _updated(runner: Any, where: str, call: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """One update call of ``runner``'s model: inside an open session it feeds it (a failure
    SGLang reports makes the session not whole: its end is a failed update); else it is one update by itself, whose wrong
    result (mode ``fail``) turns a successful update into ``(False, diagnosis)``."""
    how = follow_runner(runner)
    if how is None:
        return call()
    owned = how.open(where, where)
    try:
        ok, message = call()
    except BaseException:
        how.abandon(where)
        raise
    if not ok:  # SGLang reports its own failure; nothing to check
        if owned:
            how.abandon(where)
        else:
            how.spoil(f"{where} failed in it: {message}")
        return ok, message
    wrong = _verdict(how, where) if owned else None
    if wrong is not None:
        return False, (f"the update is loaded, but the kda_tp guard found this rank's KDA "
                       f"weights wrong; the engine serves them until a correct update: {wrong}")
    return ok, message


def _around_update_from_tensor(original: Callable[..., tuple[bool, str]], updater: Any,
                               named_tensors: Any, load_format: str | None = None,
                               *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_tensor``: feeds the session, or one update."""
    RECORD.running(_around_update_from_tensor)
    if load_format not in (None, "flattened_bucket"):
        warn_once(f"kda_tp guard: sglang: update_weights_from_tensor(load_format={load_format!r})"
                  " writes tensors without the model's load_weights; its KDA weights are not "
                  "checked")
        return original(updater, named_tensors, load_format, *args, **kwargs)
    return _updated(updater.get_model_runner(), "update_weights_from_tensor",
                    lambda: original(updater, named_tensors, load_format, *args, **kwargs))


def _around_load_from_distributed(original: Callable[..., tuple[bool, str]], updater: Any,
                                  *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.load_weights_from_distributed``: feeds the session, or one
    update."""
    RECORD.running(_around_load_from_distributed)
    return _updated(updater.get_model_runner(), "update_weights_from_distributed",
                    lambda: original(updater, *args, **kwargs))


def _around_update_from_ipc(original: Callable[..., tuple[bool, str]], updater: Any,
                            *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_ipc``: feeds the session, or one update."""
    RECORD.running(_around_update_from_ipc)
    return _updated(updater.get_model_runner(), "update_weights_from_ipc",
                    lambda: original(updater, *args, **kwargs))


def _target_runners(manager: Any, selector: str) -> list[Any]:
    """The target (not draft) model runners a scheduler's weight-update request selects."""
    try:
        return [runner for role, runner in manager._select_runners(selector)
                if role == "target"]
    except ValueError:  # a selector SGLang refuses: its own answer says so
        return []


def _around_begin(original: Callable[..., Any], manager: Any, recv_req: Any, *args: Any,
                  **kwargs: Any) -> Any:
    """Around ``SchedulerWeightUpdaterManager.begin_weight_update``: once SGLang opened its
    session (the runners' packed weights restored), an update session on each target
    runner's model."""
    RECORD.running(_around_begin)
    out = original(manager, recv_req, *args, **kwargs)
    if getattr(out, "success", False):
        for runner in _target_runners(manager, getattr(recv_req, "selector", "all")):
            how = follow_runner(runner)
            if how is not None:
                how.open(_SESSION, _SESSION)
    return out


def _around_end(original: Callable[..., Any], manager: Any, recv_req: Any, *args: Any,
                **kwargs: Any) -> Any:
    """Around ``SchedulerWeightUpdaterManager.end_weight_update``: once SGLang ended its
    session (post-processing done, every rank past its barrier), check it; a wrong update
    (mode ``fail``) turns the answer into ``success=False`` with the diagnosis."""
    RECORD.running(_around_end)
    session = getattr(manager, "_session", None)
    selector = getattr(session, "selector", "all")
    out = original(manager, recv_req, *args, **kwargs)
    if session is None or not getattr(out, "success", False):
        return out
    wrong = []
    for runner in _target_runners(manager, selector):
        how = followed(getattr(runner, "model", None))
        problem = _verdict(how, _SESSION) if how is not None else None
        if problem is not None:
            wrong.append(problem)
    if not wrong:
        return out
    return type(out)(success=False, message=(
        "the weight update is loaded, but the kda_tp guard found this rank's KDA weights "
        "wrong; the engine serves them until a correct update: " + "\n".join(wrong)))


def _around_update_from_disk(original: Callable[..., tuple[bool, str]], updater: Any,
                             model_path: str, load_format: str | None = None, *args: Any,
                             **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_disk``: after a successful update, check the
    runner's new weights against ``model_path``; a failure in mode ``fail`` turns the result
    into ``(False, diagnosis)``. A filtered (partial) update is not checked."""
    RECORD.running(_around_update_from_disk)
    how = followed(getattr(updater.get_model_runner(), "model", None))
    if how is not None:
        with how.quietly():
            ok, message = original(updater, model_path, load_format, *args, **kwargs)
    else:
        ok, message = original(updater, model_path, load_format, *args, **kwargs)
    if not ok:
        return ok, message
    if kwargs.get("weight_name_filter") is not None or (args and args[0] is not None):
        logger.info("kda_tp guard: a filtered update_weights_from_disk is not checked")
        return ok, message
    try:
        guard_runner(updater.get_model_runner(), checkpoint=model_path)
    except GuardError as error:
        return False, (f"the weights of {model_path} are loaded, but the kda_tp guard found "
                       f"this rank's KDA weights wrong; the engine serves them until a correct "
                       f"checkpoint is loaded: {error}")
    return ok, message


def _around_rpc(original: Callable[..., Any], scheduler: Any, recv_req: Any,
                *args: Any, **kwargs: Any) -> Any:
    """Around ``Scheduler.handle_rpc_request``: make :data:`RPC_METHOD` a method of this
    scheduler, then let SGLang's own handler call it (its logging, error report and barrier)."""
    RECORD.running(_around_rpc)
    if getattr(recv_req, "method", None) == RPC_METHOD and RPC_METHOD not in vars(scheduler):
        setattr(scheduler, RPC_METHOD, lambda **params: _scheduler_audit(scheduler, **params))
    return original(scheduler, recv_req, *args, **kwargs)


# ------------------------------------------------------------------------------------------------
# The check of one model runner


def guard_runner(runner: Any, checkpoint: str | None = None, *,
                 follows: bool = False) -> GuardResult | None:
    """Run the guard's one flow (:func:`kda_tp.guard.on_load`) on one SGLang ``ModelRunner``'s
    loaded model: its check (``kda_tp.guard.check``), then, with ``follows``, its updates
    followed from that check's plan.

    Args:
        runner: the model runner (``runner.model`` loaded); a draft runner
            (``runner.is_draft_worker``) is skipped.
        checkpoint: the checkpoint to check against (a reload from disk); None:
            :func:`checkpoint_of`.
        follows: follow the model's later updates (the first load).

    Returns:
        The ``kda_tp.guard.GuardResult``, or None when nothing was checked (draft runner,
        mode ``off``, non-KDA model, a dummy load, no local checkpoint).

    Raises:
        GuardError: mode ``fail`` and a KDA parameter is wrong (the audit's diagnosis).
    """
    if getattr(runner, "is_draft_worker", False) or getattr(runner, "model", None) is None:
        return None
    kind = "first load" if checkpoint is None else "update_weights_from_disk"
    return on_load(SglangEngine(runner), runner.model, where=label(), kind=kind,
                   given=checkpoint, follows=follows)[0]


# ------------------------------------------------------------------------------------------------
# A running engine


def _expected_ranks(engine: Any, reports: list[dict[str, Any]]
                    ) -> tuple[list[tuple[int, int, int]], list[dict[str, Any]]]:
    """Every ``(attention-DP, pipeline, attention-TP)`` rank of the engine: from its
    ``server_args`` when it has them, else from the ranks' reports (their sizes, checked by
    ``kda_tp.guard._record.sized``); with the unguarded entry of too many ranks."""
    args = getattr(engine, "server_args", None)
    if args is not None:
        tp, pp = count(getattr(args, "tp_size", 1)) or 1, count(getattr(args, "pp_size", 1)) or 1
        dp = (count(getattr(args, "dp_size", 1)) or 1) \
            if getattr(args, "enable_dp_attention", False) else 1
        return engine_ranks(list(range(dp)), pp, max(tp // dp, 1), "sglang")
    tp = max([r.get("tp_size") or 0 for r in reports] + [0])
    pp = max([(r.get("pp_rank") or 0) + 1 for r in reports] + [1])
    dps = sorted({r.get("dp_rank") or 0 for r in reports}) or [0]
    return engine_ranks(dps, pp, tp, "sglang")


def audit_runner(runner: Any, checkpoint: str | None = None) -> dict[str, Any]:
    """One rank's audit of one SGLang ``ModelRunner``, whatever the guard's mode, as a dict
    (what :func:`audit_engine` returns per rank); never raises for a wrong rank or a check
    that could not run (its reason is in ``skipped``).

    The check is ``kda_tp.guard.check`` (derived copies included) in mode ``fail``, its
    outcome the dict of ``kda_tp.guard.rank_report`` (the vLLM plugin's ``audit_llm`` returns
    the same keys): ``ok`` (True, False, or None when nothing was checked), ``guarded``,
    ``tp_rank``, ``tp_size`` (SGLang's attention TP group), ``where``, ``skipped`` (why
    nothing was checked, or None), ``engine``, ``params``, ``bytes``, ``seconds``,
    ``summary``, ``text`` and ``report`` (``AuditReport.to_dict()``); plus ``checkpoint``,
    :func:`status`'s ``versions``, ``mode``, ``hooks``, ``checks`` and ``last``, and
    ``line``: ``kda_tp guard: <where>: tp rank r/T: <summary>`` (or ``not checked: <why>``).
    """
    tp_rank, tp_size = rank_and_size()
    where = label()
    found: dict[str, str | None] = {"path": None}

    def run() -> GuardResult | None:
        if getattr(runner, "is_draft_worker", False):
            raise GuardError("a draft model runner")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            path = found["path"] = checkpoint or checkpoint_of(runner)
        if not path:
            why = "; ".join(str(w.message) for w in seen)
            raise GuardError(f"no local checkpoint ({path!r})" + (f": {why}" if why else ""))
        engine = SglangEngine(runner)
        params = dict(runner.model.named_parameters())
        return check(params, path, tp_rank=tp_rank, tp_size=tp_size, where=where,
                     guard_mode="fail", derived=engine.derived(runner.model),
                     layers=engine.stage_layers(params), model_dtype=engine.model_dtype())

    out = {**rank_report(run, tp_rank=tp_rank, tp_size=tp_size, where=where), **status()}
    context = parallel()
    out.update(checkpoint=found["path"], dp_rank=parallel_int(context, "attn_dp_rank"),
               pp_rank=parallel_int(context, "pp_rank"))
    out["line"] = (f"kda_tp guard: {where}: tp rank {tp_rank}/{tp_size}: "
                   f"{out['summary'] or 'not checked: ' + str(out['skipped'])}")
    return out


def _scheduler_audit(scheduler: Any, report_dir: str = "", checkpoint: str = "",
                     audit: str = "") -> None:
    """The scheduler side of :data:`RPC_METHOD`: audit this scheduler's target runner and
    write the result, marked with this ``audit``'s id, as JSON to
    ``report_dir/kda_tp-guard-tp{r}.json`` (with ``-dp{d}`` / ``-pp{p}`` when those groups
    have several ranks)."""
    runner = scheduler.tp_worker.model_runner
    result = {**audit_runner(runner, checkpoint or None), "audit": audit}
    logger.info("%s", result["line"])
    if report_dir:
        name = "kda_tp-guard" + result["where"].removeprefix("sglang").replace(" rank ", "")
        name = name.replace(" ", "-") + f"-tp{result['tp_rank']}.json"
        target = Path(report_dir) / name
        with tempfile.NamedTemporaryFile("w", dir=report_dir, delete=False,
                                         suffix=".tmp") as tmp:
            json.dump(result, tmp)
        os.replace(tmp.name, target)


#: The most bytes one rank's report file may hold (a K3 rank's report is well under it).
REPORT_LIMIT = 64 << 20


def _read_reports(directory: Path, audit: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """This audit's rank reports in ``directory``, each read without following a link and
    without blocking (``kda_tp.output.marks.read_regular``: a FIFO or a link to ``/dev/zero``
    is never waited on or read), at most :data:`REPORT_LIMIT` bytes; a file that is not a
    regular file, too large, not JSON, or not this audit's report is an unguarded entry
    naming it, never a raw error."""
    reports: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []

    def refuse(name: str, why: str) -> None:
        refused.append({"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
                        "where": "sglang", "report": None,
                        "line": f"kda_tp guard: sglang: unguarded: report file {name!r} {why}"})

    for path in sorted(directory.glob("kda_tp-guard*-tp*.json")):
        raw = read_regular(path, REPORT_LIMIT + 1)
        if raw is None:
            refuse(path.name, "is not a regular file kda_tp can read (a link, a FIFO, a device)")
            continue
        if len(raw) > REPORT_LIMIT:
            refuse(path.name, f"holds more than {REPORT_LIMIT} bytes: not read")
            continue
        try:
            report = json.loads(raw)
        except (ValueError, RecursionError) as error:
            refuse(path.name, f"is not JSON ({type(error).__name__}: {str(error)[:80]})")
            continue
        if not isinstance(report, dict) or report.get("audit") != audit:
            refuse(path.name, "is not this audit's report")
            continue
        reports.append(report)
    return reports, refused


def audit_engine(engine: Any, *, checkpoint: str | None = None,
                 report_dir: str | os.PathLike[str] | None = None) -> list[dict[str, Any]]:
    """Audit a running SGLang ``Engine`` on all its TP ranks; each rank's report.

    Calls SGLang's own ``engine.collective_rpc("kda_tp_guard_audit", ...)``, which runs
    :func:`audit_runner` in every scheduler process (the plugin must be installed: it is, with
    kda_tp, unless ``SGLANG_PLUGINS`` leaves out ``kda_tp_guard``). SGLang returns no value
    from an RPC, so each rank writes its report as JSON into ``report_dir`` (a temporary
    directory by default: the engine's ranks must see it, i.e. one machine or a shared file
    system) and this function reads them back. Each rank also logs its one-line verdict.

    Args:
        engine: a ``sglang.Engine``.
        checkpoint: the checkpoint to audit against; None: the one each rank loaded
            (:func:`checkpoint_of`).
        report_dir: where the ranks write ``kda_tp-guard-...-tp{r}.json``, in this audit's own
            subdirectory ``kda_tp-audit-<id>`` (two audits at once never read each other's
            files); kept when given. Each file is read without following a link or blocking,
            at most ``REPORT_LIMIT`` bytes; one that is not this audit's readable JSON report
            is an unguarded entry naming it.

    Returns:
        One dict per rank (see :func:`audit_runner`, with ``dp_rank`` and ``pp_rank``), by DP
        / pipeline / TP rank: every rank the engine has (its ``server_args``: ``tp_size``,
        ``pp_size``, ``dp_size`` with DP attention; else the ranks' own reports), from this
        audit's reports only (each marked with the audit's id: a file an earlier audit left
        is never read as an answer). A rank that wrote no report (no guard loaded in it, or
        it did not answer) or answered twice is one entry with ``guarded`` False and ``ok``
        None (``kda_tp.guard._record.account``); nobody answering is never ``[]``.

    Raises:
        AssertionError: from SGLang's ``collective_rpc`` when a scheduler's call failed (its
            message is the error).
    """
    audit = os.urandom(16).hex()  # this audit's reports only, never an earlier one's

    def run(directory: str) -> list[dict[str, Any]]:
        # one directory per audit: two audits at once into one report_dir never read each
        # other's files (nor remove them)
        mine = Path(directory) / f"kda_tp-audit-{audit}"
        os.mkdir(mine)
        engine.collective_rpc(RPC_METHOD, report_dir=str(mine), checkpoint=checkpoint or "",
                              audit=audit)
        reports, bad = _read_reports(mine, audit)
        reports, odd = sized(reports, "sglang")
        expected, too_many = _expected_ranks(engine, reports)
        if too_many:
            return too_many + odd + bad
        if not expected and not reports and not odd and not bad:
            return [{"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
                     "where": "sglang", "report": None, "line": "kda_tp guard: sglang: "
                     "unguarded: no rank wrote a report (no guard loaded, or no answer)"}]
        return account(reports, expected, "sglang") + odd + bad

    if report_dir is not None:
        os.makedirs(report_dir, exist_ok=True)
        return run(os.fspath(report_dir))
    with tempfile.TemporaryDirectory(prefix="kda_tp-guard-") as directory:
        return run(directory)
