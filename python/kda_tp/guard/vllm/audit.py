"""A live audit of a running vLLM ``LLM`` (:func:`audit_llm`), on every worker through
``collective_rpc`` and the worker method ``kda_tp_audit`` (:data:`WORKER_METHOD`,
:func:`worker_audit`, which the plugin adds to vLLM's ``WorkerBase``).

Each report says what it compares against (``reference``): the checkpoint given, or the
checkpoint the engine started from; after updates the guard judged on that worker, a start-up
checkpoint is no reference for the weights now, which the report says, with the last update's
own verdict, instead of calling a correct engine wrong. Under vLLM's ``external_launcher``
(TRL's colocated engines: each trainer process owns one worker) the audit covers the ranks
this process owns, and says so.

vLLM's multiprocess executor reads its workers' answers in order and raises at the first failed
one, leaving the later workers' answers of that call unread in their queues (vLLM 0.33's
``MultiprocExecutor.collective_rpc``); the next call then reads those: each audit carries an
id that its answers echo, so an answer carrying another audit's id (left from an earlier
call) is named, never taken for this audit's.

This module imports vLLM only inside the worker method (it runs in a vLLM worker).
"""

from __future__ import annotations

import os
import uuid
from typing import Any

from .._live import followed
from .._load import on_load
from .._modes import audited, checkpoint_env, held_verdicts, warn_once
from .._record import account, count, engine_ranks, rank_report, sized, status
from .facts import VllmEngine, dp_rank, pp_rank_size, tp_rank_size

__all__ = ["WORKER_METHOD", "audit_llm", "worker_audit"]

#: The worker method the plugin adds to vLLM's ``WorkerBase``, which :func:`audit_llm` calls.
WORKER_METHOD = "kda_tp_audit"

_STALE = ("vLLM's multiprocess executor stops reading its workers' answers at the first failed "
          "one (MultiprocExecutor.collective_rpc, vLLM 0.33): an earlier call that failed on "
          "some worker (a GuardError of a refit) left this worker's answer of it in its queue, "
          "and every later collective_rpc reads this worker one call late; restart the engine")


def worker_audit(worker: Any, checkpoint: str | None = None, audit: str = ""
                 ) -> dict[str, Any]:
    """The worker method ``kda_tp_audit``: this worker's guard report as a plain dict
    (collective_rpc results cross processes as msgpack), against ``checkpoint`` when given
    (an RL refit's source), else the checkpoint the engine started from. Never raises for a
    wrong rank or a check that cannot run.

    Args:
        worker: vLLM's worker (``WorkerBase``).
        checkpoint: the checkpoint to audit against; None: the start-up one.
        audit: the audit's id, echoed (:func:`audit_llm` tells a stale answer by it).

    Returns:
        ``kda_tp.guard.rank_report``'s keys, the process's guard ``status`` as the loads and
        updates left it, ``dp_rank``, ``pp_rank``, ``audit``, ``reference`` (what the
        parameters were compared with) and ``updates`` (the updates the guard judged on this
        model since its load). Audited against the start-up checkpoint after such updates, a
        difference is expected: the line says so and gives the last update's own verdict (``OK``,
        ``FAIL (N wrong)``: its line is the process's ``last``), and
        ``ok`` is False when that verdict failed, else None (not judged).
    """
    model = worker.model_runner.get_model()
    vllm_config = worker.vllm_config
    model_config = vllm_config.model_config
    rank, size = tp_rank_size()
    before = status("vllm")  # the record as the loads and updates left it, not this audit
    how = followed(model)
    updates, last, last_failed = (how.updates, how.last, how.last_failed) if how is not None \
        else (0, "", False)
    given = os.fspath(checkpoint) if checkpoint else None
    start_up = checkpoint_env() or getattr(model_config, "model", None)
    reference = f"checkpoint {given} (given)" if given else f"start-up checkpoint {start_up}"

    def run() -> Any:  # "fail" to get the reason; a running engine is never stopped from here
        return on_load(VllmEngine(model_config, vllm_config, "audit"), model,
                       where="vllm audit", given=given, guard_mode="fail", record=False,
                       follows=False)[0]

    with held_verdicts():  # this audit's one line, with its reference, is logged below
        out = {**rank_report(run, tp_rank=rank, tp_size=size, where="vllm audit"), **before,
               "dp_rank": dp_rank(vllm_config), "pp_rank": pp_rank_size()[0], "audit": audit,
               "reference": reference, "updates": updates}
    if given is None and updates and out["ok"] is not None:
        said = "the same values" if out["ok"] else "differences after a refit are expected"
        out["line"] += (f" (reference: {reference}; {updates} update(s) since: {said}; "
                        f"the last update's own verdict: {last.rsplit(': ', 1)[-1]})")
        if not out["ok"]:  # no reference for the weights now: the last update's verdict
            out["ok"] = False if last_failed else None
    audited(out["line"], out["ok"])
    return out


def audit_llm(llm: Any, *, checkpoint: str | os.PathLike[str] | None = None
              ) -> list[dict[str, Any]]:
    """Audit the KDA weights a live vLLM ``LLM`` holds, on every worker it owns, now.

    Calls the worker method ``kda_tp_audit`` through ``llm.collective_rpc`` (the plugin
    must be installed in the workers: it is, when kda_tp is installed in vLLM's environment
    and ``VLLM_PLUGINS``, if set, names ``kda_tp_guard``). Each worker checks its parameters
    as they are now against ``checkpoint``, or else the checkpoint the engine started from
    (``KDA_TP_GUARD_CHECKPOINT`` when set, else vLLM's model path), and says which
    (``reference``); nothing is raised for a wrong rank.

    After weight updates (an RL refit) the start-up checkpoint is no reference for the
    weights now: a rank the guard saw updated, audited without ``checkpoint``, that differs
    from it has its line say ``reference: start-up checkpoint <path>; N update(s) since:
    differences after a refit are expected`` and the last update's own verdict (each update
    was judged against what it fed when it ran); its ``ok`` is that verdict's when it failed
    (False: the engine holds what the update did not feed), else None (not judged). Pass the
    refit's source as ``checkpoint`` to judge the weights now.

    Under ``distributed_executor_backend="external_launcher"`` (TRL's colocated engines,
    torchrun: each process owns one worker, ``collective_rpc`` reaches only it) the ranks this
    process owns are audited and their lines say so; the other ranks are their own processes'
    to audit, never reported as silent.

    Args:
        llm: a ``vllm.LLM``.
        checkpoint: the checkpoint to audit against (an RL refit's source, as SGLang's
            ``audit_engine`` takes); None: the one each worker started from. The workers must
            see it (one machine or a shared file system).

    Returns:
        One dict per worker, in vLLM's worker order, with the keys of
        ``kda_tp.guard.rank_report`` (the SGLang plugin's audit returns the same): ``ok``
        (True, False, or None when nothing was checked or judged), ``guarded`` (False for a
        worker without the guard, one that did not answer, or an answer left from an earlier
        call), ``tp_rank``, ``tp_size``, ``where`` (``"vllm audit"``), ``line`` (the guard's
        one-line verdict, or ``not checked: <why>``), ``skipped``, ``engine``, ``params``,
        ``bytes``, ``seconds``, ``summary``, ``text``, ``report``
        (``AuditReport.to_dict()``: every parameter's verdict and diagnosis), ``reference``,
        ``updates``, and the worker's ``versions``, ``mode``, ``hooks`` (armed or missing),
        ``checks`` (run, by kind) and ``last`` (the last verdict before this audit), with
        ``dp_rank`` and ``pp_rank``. Every rank the engine has in this process (its
        data-parallel rank, pipeline x tensor-parallel sizes: the LLM's parallel config, else
        the answers'; under ``external_launcher`` the ranks that answered) is reported once:
        one that did not answer, or answered twice, is an entry with ``guarded`` False
        (``kda_tp.guard._record.account``); nobody answering is never ``[]``.
    """
    plugins = os.environ.get("VLLM_PLUGINS")
    hint = ""
    if plugins is not None and "kda_tp_guard" not in [p.strip() for p in plugins.split(",")]:
        hint = f" (VLLM_PLUGINS={plugins!r} leaves out kda_tp_guard: the workers are unguarded)"
        warn_once(f"kda_tp guard: VLLM_PLUGINS={plugins!r} leaves out kda_tp_guard: vLLM does "
                  "not load the guard, no load or update is checked")
    audit = uuid.uuid4().hex
    kwargs: dict[str, Any] = {"audit": audit}
    if checkpoint is not None:
        kwargs["checkpoint"] = os.fspath(checkpoint)
    try:
        answers = list(llm.collective_rpc(WORKER_METHOD, kwargs=kwargs))
    except Exception as error:  # noqa: BLE001 - a worker without the method: unguarded
        stale = f"; {WORKER_METHOD} never fails in a worker: {_STALE}" \
            if "Worker failed with error" in str(error) else ""
        return [_unguarded(f"the workers do not answer {WORKER_METHOD} "
                           f"({type(error).__name__}: {error}){stale}{hint}")]
    fresh = [a for a in answers if isinstance(a, dict) and a.get("audit", audit) == audit]
    reports, odd = sized(fresh, "vllm audit")
    odd += [_unguarded(f"worker {i} answered {answer!r:.80}{hint}" if not isinstance(answer, dict)
                       else f"worker {i} answered an earlier call's {WORKER_METHOD} "
                            f"({str(answer.get('line', ''))[:160]}): {_STALE}")
            for i, answer in enumerate(answers)
            if not isinstance(answer, dict) or answer.get("audit", audit) != audit]
    config = getattr(getattr(llm, "llm_engine", None), "vllm_config", None)
    parallel = getattr(config, "parallel_config", None)
    if _external_launcher(parallel) and reports:
        return [_owned(r, parallel) for r in account(reports, [
            (r.get("dp_rank") or 0, r.get("pp_rank") or 0, r["tp_rank"]) for r in reports
            if isinstance(r.get("tp_rank"), int)], "vllm audit")] + odd
    tp = count(getattr(parallel, "tensor_parallel_size", None)) or \
        max([r.get("tp_size") or 0 for r in reports] + [0])
    pp = count(getattr(parallel, "pipeline_parallel_size", None)) or \
        max([(r.get("pp_rank") or 0) + 1 for r in reports] + [1])
    dp = {dp_rank(config)} if parallel is not None else \
        {r.get("dp_rank") or 0 for r in reports} or {0}
    if not tp and not odd:
        return [_unguarded(f"no worker answered {WORKER_METHOD}{hint}")]
    expected, too_many = engine_ranks(sorted(dp), pp, tp, "vllm audit")
    if too_many:
        return too_many + odd
    return account(reports, expected, "vllm audit") + odd


def _external_launcher(parallel: Any) -> bool:
    """Whether the engine runs under vLLM's ``external_launcher`` executor (by name, or the
    class ``ExecutorWithExternalLauncher`` or a subclass given as the backend)."""
    backend = getattr(parallel, "distributed_executor_backend", None)
    if isinstance(backend, type):
        return any(c.__name__ == "ExecutorWithExternalLauncher" for c in backend.__mro__)
    return backend == "external_launcher"


def _owned(report: dict[str, Any], parallel: Any) -> dict[str, Any]:
    """One answer of an ``external_launcher`` audit, its line saying whose ranks it covers."""
    tp = count(getattr(parallel, "tensor_parallel_size", None)) or report.get("tp_size") or 1
    pp = count(getattr(parallel, "pipeline_parallel_size", None)) or 1
    if tp * pp == 1:
        return report
    return {**report, "line": f"{report['line']} (external_launcher: this process owns this "
                              f"rank of {tp * pp}; the others are audited from their own "
                              "processes)"}


def _unguarded(why: str) -> dict[str, Any]:
    """A worker's report when it has no guard to answer (:func:`audit_llm`)."""
    return {"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
            "line": f"unguarded: {why}", "report": None}
