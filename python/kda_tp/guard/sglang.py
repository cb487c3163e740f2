"""The guard inside SGLang 0.5.23: every TP rank checks its KDA weights right after they load.

``pip install kda_tp`` registers :func:`register` as the entry point ``kda_tp_guard`` of the
group ``sglang.srt.plugins``. SGLang's own ``sglang.srt.plugins.load_plugins()`` runs it in every
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
* around ``WeightUpdater.update_weights_from_tensor``, ``load_weights_from_distributed`` (the
  load step of ``update_weights_from_distributed``) and ``update_weights_from_ipc``: each is
  one update session (:mod:`kda_tp.guard.updates`): what it feeds the model's
  ``load_weights`` is the reference, every KDA parameter it touched is checked when it
  returns, and a wrong one makes it a failed update ``(False, diagnosis)`` in mode ``fail``
  (logged in ``warn``). A ``load_format="direct"`` or custom-loader tensor update writes
  engine-format tensors without ``load_weights``: one warning that it is not checked;
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

The checkpoint is the runner's ``model_config.model_path`` (a Hugging Face repository id is
resolved to its local cache in the engine's ``download_dir``, never downloaded);
``KDA_TP_GUARD_CHECKPOINT`` (``kda_tp.guard.CHECKPOINT_ENV``, stripped; a path that is not
there is a ``GuardError`` in mode ``fail``) overrides it, which a ``--load-format
sharded_state`` start needs (its directory holds the ranks' dumps, not the checkpoint they came
from). The engine's model dtype (``model_config.dtype``) is passed to the check.

Armed, provably: at the first load each rank records which of :data:`TARGETS` SGLang's
``HookRegistry`` applied (``apply_hooks`` only logs a target it could not resolve); a missing
one is a ``GuardError`` raised from the load (mode ``fail``) or a warning (``warn``).
:func:`audit_engine` reports it per rank with the engine and kda_tp versions, the checks run
and the last verdict.

This module imports SGLang only inside the functions SGLang calls; ``import kda_tp`` imports
neither it nor SGLang.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engines.dtype import model_dtype_name
from ..errors import GuardError, KdaTpError
from .first_load import (
    CHECKPOINT_ENV,
    GuardResult,
    check,
    explicit_checkpoint,
    holds_kda,
    rank_report,
    resolve_checkpoint,
)
from .updates import Followed, follow, followed, warn_once

__all__ = ["RPC_METHOD", "TARGETS", "audit_engine", "audit_runner", "checkpoint_of",
           "guard_runner", "rank_and_size", "register", "status"]

logger = logging.getLogger("kda_tp.guard")

#: The scheduler method :func:`audit_engine` calls through ``Engine.collective_rpc``.
RPC_METHOD = "kda_tp_guard_audit"

_RUNNER = "sglang.srt.model_executor.model_runner.ModelRunner"
_UPDATER = "sglang.srt.model_executor.model_runner_components.weight_updater.WeightUpdater"
_SCHEDULER = "sglang.srt.managers.scheduler.Scheduler"

#: The SGLang 0.5.23 functions the plugin hooks (``HookRegistry`` targets).
TARGETS = (
    f"{_RUNNER}.load_model",
    f"{_RUNNER}.finalize_startup_weight_load",
    f"{_UPDATER}.update_weights_from_disk",
    f"{_UPDATER}.update_weights_from_tensor",
    f"{_UPDATER}.load_weights_from_distributed",
    f"{_UPDATER}.update_weights_from_ipc",
    f"{_SCHEDULER}.handle_rpc_request",
)

# This process's record: checks run by kind, and the last verdict line.
_checks: dict[str, int] = {}
_last: list[str] = [""]


def _ran(kind: str, line: str) -> None:
    _checks[kind] = _checks.get(kind, 0) + 1
    _last[0] = line


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the guard's hooks.

    SGLang's ``load_plugins()`` calls it once per process and then applies the hooks
    (``HookRegistry.apply_hooks``); nothing is checked until a model runner loads weights.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    load, finalize, disk, tensor, distributed, ipc, rpc = TARGETS
    HookRegistry.register(load, _after_load_model, HookType.AFTER)
    HookRegistry.register(finalize, _after_finalize, HookType.AFTER)
    HookRegistry.register(disk, _around_update_from_disk, HookType.AROUND)
    HookRegistry.register(tensor, _around_update_from_tensor, HookType.AROUND)
    HookRegistry.register(distributed, _around_load_from_distributed, HookType.AROUND)
    HookRegistry.register(ipc, _around_update_from_ipc, HookType.AROUND)
    HookRegistry.register(rpc, _around_rpc, HookType.AROUND)


def hooks() -> dict[str, str]:
    """Each of :data:`TARGETS`: ``"armed"`` when SGLang's ``HookRegistry`` applied it in this
    process, else why not."""
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry

        applied = set(getattr(HookRegistry, "_patched", ()))
    except ImportError as error:
        return {t: f"missing: {error}" for t in TARGETS}
    return {t: "armed" if t in applied else
            "missing: not applied by SGLang's HookRegistry (renamed in this SGLang version, or "
            "SGLANG_PLUGINS leaves out kda_tp_guard?)" for t in TARGETS}


def status() -> dict[str, Any]:
    """This process's guard: ``versions`` (SGLang's, kda_tp's), ``mode``, ``hooks``
    (:func:`hooks`), ``checks`` (run, by kind: ``first load``, ``update``) and ``last`` (the
    last verdict line)."""
    import sys

    from .._native import __version__
    from .first_load import mode

    try:
        chosen = mode()
    except KdaTpError as error:
        chosen = f"invalid: {error}"
    sglang = sys.modules.get("sglang")
    return {"versions": {"sglang": str(getattr(sglang, "__version__", "not imported")),
                         "kda_tp": __version__},
            "mode": chosen, "hooks": hooks(), "checks": dict(_checks), "last": _last[0]}


def _check_armed() -> None:
    """At the first load: every hook target applied, else a ``GuardError`` (mode ``fail``,
    raised from the load, which SGLang does not swallow) or a warning (``warn``)."""
    from .first_load import cannot_check

    missing = {t: why for t, why in hooks().items() if why != "armed"}
    if missing:
        cannot_check("kda_tp guard: sglang: hooks not armed, so these paths are not checked: "
                     + "; ".join(f"{t}: {why}" for t, why in missing.items()))


# ------------------------------------------------------------------------------------------------
# What SGLang calls


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.load_model``: check, unless the overlap mode commits the weights
    later (``runner.startup_weight_load`` set: the finalize hook checks)."""
    _check_armed()
    if getattr(runner, "startup_weight_load", None) is None:
        guard_runner(runner)
        follow_runner(runner)


def _after_finalize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.finalize_startup_weight_load`` (overlap mode): check."""
    guard_runner(runner)
    follow_runner(runner)


def follow_runner(runner: Any) -> None:
    """Check every later update of a (non-draft) runner's model: its ``load_weights`` feeds
    the update sessions the update hooks open (:func:`kda_tp.guard.follow`)."""
    model = getattr(runner, "model", None)
    if (getattr(runner, "is_draft_worker", False) or model is None
            or followed(model) is not None or not callable(getattr(model, "load_weights", None))
            or not holds_kda(n for n, _ in model.named_parameters())):
        return
    import weakref

    ref: Callable[[], Any] = weakref.ref(model)
    follow(model, Followed("sglang", lambda: checkpoint_of(runner, quiet=True), rank_and_size,
                           lambda: dict(ref().named_parameters()), dict, lambda: None,
                           lambda line: _ran("update", line)))


def _updated(runner: Any, where: str, call: Callable[[], tuple[bool, str]]) -> tuple[bool, str]:
    """Run one update of ``runner``'s model as an update session; a wrong result (mode
    ``fail``) turns a successful update into ``(False, diagnosis)``."""
    follow_runner(runner)
    how = followed(getattr(runner, "model", None))
    if how is None:
        return call()
    try:
        with how.update(where):
            ok, message = call()
            if not ok:  # SGLang reports its own failure; nothing to check
                how.session = None
    except GuardError as error:
        return False, (f"the update is loaded, but the kda_tp guard found this rank's KDA "
                       f"weights wrong; the engine serves them until a correct update: {error}")
    return ok, message


def _around_update_from_tensor(original: Callable[..., tuple[bool, str]], updater: Any,
                               named_tensors: Any, load_format: str | None = None,
                               *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_tensor``: one checked update session."""
    if load_format not in (None, "flattened_bucket"):
        warn_once(f"kda_tp guard: sglang: update_weights_from_tensor(load_format={load_format!r})"
                  " writes tensors without the model's load_weights; its KDA weights are not "
                  "checked")
        return original(updater, named_tensors, load_format, *args, **kwargs)
    return _updated(updater.get_model_runner(), "update_weights_from_tensor",
                    lambda: original(updater, named_tensors, load_format, *args, **kwargs))


def _around_load_from_distributed(original: Callable[..., tuple[bool, str]], updater: Any,
                                  *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.load_weights_from_distributed``: one checked update session."""
    return _updated(updater.get_model_runner(), "update_weights_from_distributed",
                    lambda: original(updater, *args, **kwargs))


def _around_update_from_ipc(original: Callable[..., tuple[bool, str]], updater: Any,
                            *args: Any, **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_ipc``: one checked update session."""
    return _updated(updater.get_model_runner(), "update_weights_from_ipc",
                    lambda: original(updater, *args, **kwargs))




def _around_update_from_disk(original: Callable[..., tuple[bool, str]], updater: Any,
                             model_path: str, load_format: str | None = None, *args: Any,
                             **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_disk``: after a successful update, check the
    runner's new weights against ``model_path``; a failure in mode ``fail`` turns the result
    into ``(False, diagnosis)``. A filtered (partial) update is not checked."""
    how = followed(getattr(updater.get_model_runner(), "model", None))
    with how.quietly() if how is not None else contextlib.nullcontext():
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
    if getattr(recv_req, "method", None) == RPC_METHOD and RPC_METHOD not in vars(scheduler):
        setattr(scheduler, RPC_METHOD, lambda **params: _scheduler_audit(scheduler, **params))
    return original(scheduler, recv_req, *args, **kwargs)


# ------------------------------------------------------------------------------------------------
# The check of one model runner


def _parallel() -> Any:
    """SGLang's parallel context (``get_parallel()``) of this process."""
    from sglang.srt.runtime_context import get_parallel

    return get_parallel()


def rank_and_size() -> tuple[int, int]:
    """``(attn_tp_rank, attn_tp_size)`` of this process, from SGLang's ``get_parallel()``:
    the group SGLang's KDA layers shard their heads over (the TP group without DP attention)."""
    parallel = _parallel()
    return int(parallel.attn_tp_rank), int(parallel.attn_tp_size)


def _label() -> str:
    """``"sglang"``, with the DP-attention and pipeline ranks when there are several."""
    parallel = _parallel()
    label = "sglang"
    for what in ("attn_dp", "pp"):
        try:
            size, rank = getattr(parallel, f"{what}_size"), getattr(parallel, f"{what}_rank")
        except (AttributeError, ValueError):  # a context without that group published
            continue
        if isinstance(size, int) and size > 1:
            label += f" {what} rank {rank}"
    return label


def checkpoint_of(runner: Any, quiet: bool = False) -> str | None:
    """The local checkpoint a model runner loaded: ``KDA_TP_GUARD_CHECKPOINT`` if set
    (stripped), else ``runner.model_config.model_path`` (a Hugging Face repository id: its
    local snapshot, if cached, in the engine's ``download_dir``). None, after one warning
    (unless ``quiet``), for a ``sharded_state`` load without ``KDA_TP_GUARD_CHECKPOINT`` (its
    directory holds the dumps, not the checkpoint); ``""`` for a variable naming a path that
    is not there, in mode ``warn`` (warned).

    Raises:
        GuardError: mode ``fail`` and ``KDA_TP_GUARD_CHECKPOINT`` names a path that is not there.
    """
    chosen = explicit_checkpoint("sglang")
    if chosen is not None:
        return chosen
    load_config = getattr(runner, "load_config", None)
    load_format = getattr(load_config, "load_format", "")
    if str(getattr(load_format, "value", load_format)).lower() == "sharded_state":
        if not quiet:
            warnings.warn(
                f"kda_tp guard: a sharded_state load is checked against the checkpoint it was "
                f"saved from; set {CHECKPOINT_ENV} to that checkpoint's directory (not checked "
                "now)", RuntimeWarning, stacklevel=2,
            )
        return None
    config = runner.model_config
    return resolve_checkpoint(str(config.model_path), revision=getattr(config, "revision", None),
                              download_dir=getattr(load_config, "download_dir", None))


def guard_runner(runner: Any, checkpoint: str | None = None) -> Any:
    """Run ``kda_tp.guard.check`` on one SGLang ``ModelRunner``'s loaded model.

    Args:
        runner: the model runner (``runner.model`` loaded); a draft runner
            (``runner.is_draft_worker``) is skipped.
        checkpoint: the checkpoint to check against; None: :func:`checkpoint_of`.

    Returns:
        The ``kda_tp.guard.GuardResult``, or None when nothing was checked (draft runner,
        mode ``off``, non-KDA model, no local checkpoint).

    Raises:
        GuardError: mode ``fail`` and a KDA parameter is wrong (the audit's diagnosis).
    """
    if getattr(runner, "is_draft_worker", False) or getattr(runner, "model", None) is None:
        return None
    from .first_load import mode

    if mode() == "off":
        return None
    path = checkpoint if checkpoint is not None else checkpoint_of(runner)
    if not path:
        return None
    tp_rank, tp_size = rank_and_size()
    dtype = model_dtype_name(getattr(getattr(runner, "model_config", None), "dtype", None))
    result = check(dict(runner.model.named_parameters()), path, tp_rank=tp_rank,
                   tp_size=tp_size, where=_label(), model_dtype=dtype)
    if result is not None:
        _ran("first load" if checkpoint is None else "update_weights_from_disk", result.line())
    return result


# ------------------------------------------------------------------------------------------------
# A running engine


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
    where = _label()
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
        return check(dict(runner.model.named_parameters()), path, tp_rank=tp_rank,
                     tp_size=tp_size, where=where, guard_mode="fail",
                     model_dtype=model_dtype_name(getattr(getattr(
                         runner, "model_config", None), "dtype", None)))

    out = {**rank_report(run, tp_rank=tp_rank, tp_size=tp_size, where=where), **status()}
    out["checkpoint"] = found["path"]
    out["line"] = (f"kda_tp guard: {where}: tp rank {tp_rank}/{tp_size}: "
                   f"{out['summary'] or 'not checked: ' + str(out['skipped'])}")
    return out


def _scheduler_audit(scheduler: Any, report_dir: str = "", checkpoint: str = "") -> None:
    """The scheduler side of :data:`RPC_METHOD`: audit this scheduler's target runner and
    write the result as JSON to ``report_dir/kda_tp-guard-tp{r}.json`` (with ``-dp{d}`` /
    ``-pp{p}`` when those groups have several ranks)."""
    runner = scheduler.tp_worker.model_runner
    result = audit_runner(runner, checkpoint or None)
    logger.info("%s", result["line"])
    if report_dir:
        name = "kda_tp-guard" + result["where"].removeprefix("sglang").replace(" rank ", "")
        name = name.replace(" ", "-") + f"-tp{result['tp_rank']}.json"
        target = Path(report_dir) / name
        with tempfile.NamedTemporaryFile("w", dir=report_dir, delete=False,
                                         suffix=".tmp") as tmp:
            json.dump(result, tmp)
        os.replace(tmp.name, target)


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
        report_dir: where the ranks write ``kda_tp-guard-...-tp{r}.json``; kept when given.

    Returns:
        One dict per rank (see :func:`audit_runner`), by DP / pipeline / TP rank; a rank of
        the engine's TP group that wrote no report (no guard loaded in it, or it did not
        answer) is one entry with ``guarded`` False and ``ok`` None.

    Raises:
        AssertionError: from SGLang's ``collective_rpc`` when a scheduler's call failed (its
            message is the error).
    """
    def run(directory: str) -> list[dict[str, Any]]:
        engine.collective_rpc(RPC_METHOD, report_dir=directory, checkpoint=checkpoint or "")
        found = sorted(Path(directory).glob("kda_tp-guard*-tp*.json"))
        reports = [json.loads(p.read_text()) for p in found]
        size = max((int(r["tp_size"]) for r in reports), default=0)
        answered = {int(r["tp_rank"]) for r in reports}
        reports += [{"ok": None, "guarded": False, "tp_rank": r, "tp_size": size,
                     "where": "sglang", "line": f"kda_tp guard: sglang: tp rank {r}/{size}: "
                     "unguarded: this rank wrote no report (no guard loaded, or no answer)"}
                    for r in range(size) if r not in answered]
        return sorted(reports, key=lambda r: (r["where"], r["tp_rank"]))

    if report_dir is not None:
        os.makedirs(report_dir, exist_ok=True)
        return run(os.fspath(report_dir))
    with tempfile.TemporaryDirectory(prefix="kda_tp-guard-") as directory:
        return run(directory)
