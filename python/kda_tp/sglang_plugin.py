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
resolved to its local cache, never downloaded); ``KDA_TP_GUARD_CHECKPOINT``
(``kda_tp.guard.CHECKPOINT_ENV``) overrides it, which a ``--load-format sharded_state`` start
needs (its directory holds the ranks' dumps, not the checkpoint they came from).

This module imports SGLang only inside the functions SGLang calls; ``import kda_tp`` imports
neither it nor SGLang.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .guard import CHECKPOINT_ENV, holds_kda

__all__ = ["RPC_METHOD", "TARGETS", "audit_engine", "audit_runner", "checkpoint_of",
           "guard_runner", "rank_and_size", "register"]

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
    f"{_SCHEDULER}.handle_rpc_request",
)


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: register the guard's hooks.

    SGLang's ``load_plugins()`` calls it once per process and then applies the hooks
    (``HookRegistry.apply_hooks``); nothing is checked until a model runner loads weights.
    """
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    load, finalize, update, rpc = TARGETS
    HookRegistry.register(load, _after_load_model, HookType.AFTER)
    HookRegistry.register(finalize, _after_finalize, HookType.AFTER)
    HookRegistry.register(update, _around_update_from_disk, HookType.AROUND)
    HookRegistry.register(rpc, _around_rpc, HookType.AROUND)


# ------------------------------------------------------------------------------------------------
# What SGLang calls


def _after_load_model(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.load_model``: check, unless the overlap mode commits the weights
    later (``runner.startup_weight_load`` set: the finalize hook checks)."""
    if getattr(runner, "startup_weight_load", None) is None:
        guard_runner(runner)


def _after_finalize(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """After ``ModelRunner.finalize_startup_weight_load`` (overlap mode): check."""
    guard_runner(runner)


def _around_update_from_disk(original: Callable[..., tuple[bool, str]], updater: Any,
                             model_path: str, load_format: str | None = None, *args: Any,
                             **kwargs: Any) -> tuple[bool, str]:
    """Around ``WeightUpdater.update_weights_from_disk``: after a successful update, check the
    runner's new weights against ``model_path``; a failure in mode ``fail`` turns the result
    into ``(False, diagnosis)``. A filtered (partial) update is not checked."""
    from .errors import GuardError

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


def checkpoint_of(runner: Any) -> str | None:
    """The local checkpoint a model runner loaded: ``KDA_TP_GUARD_CHECKPOINT`` if set, else
    ``runner.model_config.model_path`` (a Hugging Face repository id: its local snapshot, if
    cached). None, after one warning, for a ``sharded_state`` load without
    ``KDA_TP_GUARD_CHECKPOINT`` (its directory holds the dumps, not the checkpoint)."""
    chosen = os.environ.get(CHECKPOINT_ENV, "").strip()
    if chosen:
        return chosen
    load_format = getattr(getattr(runner, "load_config", None), "load_format", "")
    if str(getattr(load_format, "value", load_format)).lower() == "sharded_state":
        warnings.warn(
            f"kda_tp guard: a sharded_state load is checked against the checkpoint it was saved "
            f"from; set {CHECKPOINT_ENV} to that checkpoint's directory (not checked now)",
            RuntimeWarning, stacklevel=2,
        )
        return None
    config = runner.model_config
    path = str(config.model_path)
    if "://" in path or os.path.exists(path):
        return path
    try:  # a repository id: the snapshot SGLang downloaded, never a download here
        from huggingface_hub import snapshot_download

        return str(snapshot_download(path, revision=getattr(config, "revision", None),
                                     local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached or no huggingface_hub: the guard warns
        return path


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
    from .guard import check, mode

    if mode() == "off":
        return None
    path = checkpoint if checkpoint is not None else checkpoint_of(runner)
    if path is None:
        return None
    tp_rank, tp_size = rank_and_size()
    return check(dict(runner.model.named_parameters()), path, tp_rank=tp_rank,
                 tp_size=tp_size, where=_label(), model_dtype=_model_dtype(runner))


# ------------------------------------------------------------------------------------------------
# A running engine


def _model_dtype(runner: Any) -> str | None:
    """The engine's model dtype (``runner.model_config.dtype``, a torch dtype) as
    ``kda_tp.guard.check`` takes it; None when the runner has none."""
    dtype = getattr(getattr(runner, "model_config", None), "dtype", None)
    return None if dtype is None else str(dtype)


def audit_runner(runner: Any, checkpoint: str | None = None) -> dict[str, Any]:
    """One rank's audit of one SGLang ``ModelRunner``, whatever the guard's mode, as a dict
    (what :func:`audit_engine` returns per rank).

    Keys: ``ok`` (True, False, or None when nothing was checked), ``line`` (the one-line
    verdict), ``tp_rank``, ``tp_size`` (SGLang's attention TP group), ``where``,
    ``checkpoint``, ``skipped`` (why nothing was checked, or None), ``engine`` (the layout),
    ``seconds``, ``summary`` and ``text`` (the audit's summary and full diagnosis), ``report``
    (``AuditReport.to_dict()``, as ``kda-tp audit --json``).
    """
    from .engine_audit import audit

    tp_rank, tp_size = rank_and_size()
    out: dict[str, Any] = {"ok": None, "line": "", "tp_rank": tp_rank, "tp_size": tp_size,
                           "where": _label(), "checkpoint": None, "skipped": None,
                           "engine": None, "seconds": 0.0, "summary": "", "text": "",
                           "report": None}
    path = None if getattr(runner, "is_draft_worker", False) else (
        checkpoint or checkpoint_of(runner))
    out["checkpoint"] = path
    params = {} if path is None else dict(runner.model.named_parameters())
    start = time.perf_counter()
    if getattr(runner, "is_draft_worker", False):
        out["skipped"] = "a draft model runner"
    elif path is None or "://" in path or not os.path.exists(path):
        out["skipped"] = f"no local checkpoint ({path!r})"
    elif not holds_kda(params):
        out["skipped"] = "no KDA parameter"
    else:
        report = audit(params, path, tp_rank=tp_rank, tp_size=tp_size,
                       model_dtype=_model_dtype(runner))
        out.update(ok=report.passed, engine=report.engine,
                   seconds=time.perf_counter() - start, summary=report.summary(),
                   text=report.format(), report=report.to_dict())
    out["line"] = (f"kda_tp guard: {out['where']}: tp rank {tp_rank}/{tp_size}: "
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
        One dict per rank (see :func:`audit_runner`), by DP / pipeline / TP rank.

    Raises:
        AssertionError: from SGLang's ``collective_rpc`` when a scheduler's call failed (its
            message is the error).
    """
    def run(directory: str) -> list[dict[str, Any]]:
        engine.collective_rpc(RPC_METHOD, report_dir=directory, checkpoint=checkpoint or "")
        found = sorted(Path(directory).glob("kda_tp-guard*-tp*.json"))
        reports = [json.loads(p.read_text()) for p in found]
        return sorted(reports, key=lambda r: (r["where"], r["tp_rank"]))

    if report_dir is not None:
        os.makedirs(report_dir, exist_ok=True)
        return run(os.fspath(report_dir))
    with tempfile.TemporaryDirectory(prefix="kda_tp-guard-") as directory:
        return run(directory)
