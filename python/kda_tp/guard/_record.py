"""This process's guard record, one for both engine plugins: the hooks armed (or why not), the
checks run by kind and the last verdict line, as :func:`status` reports them, and one rank's
live audit as a plain dict (:func:`rank_report`: the live audits
``kda_tp.guard.vllm.audit_llm`` and ``kda_tp.guard.sglang.audit_engine`` return it per rank).

This module imports no engine.
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from .._native import __version__
from ..audit.report import AuditReport
from ..errors import GuardError, KdaTpError
from ._first_load import GuardResult
from ._modes import mode

__all__ = ["RECORD", "Record", "account", "rank_report", "status"]


@dataclass
class _Installed:
    """One wrapper put in place for kda_tp: its owner (a class or module kept, an instance
    only weakly), the attribute, the wrapper as set (kda_tp's ``setattr``'s value, or what an
    engine's hook registry set), the function of kda_tp's that runs in it (and calls
    :meth:`Record.running`), how many times it ran and what held the attribute when it last
    ran (the wrapper itself, or a replacement that called it)."""

    owner: Callable[[], Any]
    attr: str
    wrapper: Any
    function: Any
    runs: int = 0
    holder: Any = None


@dataclass
class Record:
    """The hooks installed in this process and those that could not be (target -> ``"armed"``
    or why not), the checks run by kind (``first load``, ``update``, ...), the last verdict
    line, and every wrapper installed (target -> one entry per owner: a model's own
    ``load_weights`` is one target for every followed model), which :meth:`verify` checks is
    still in place, or proven running through what replaced it."""

    hooks: dict[str, str] = field(default_factory=dict)
    checks: dict[str, int] = field(default_factory=dict)
    last: str = ""
    installed: dict[str, list[_Installed]] = field(default_factory=dict)
    _by_function: dict[int, _Installed] = field(default_factory=dict)

    def install(self, target: str, owner: Any, attr: str, wrapper: Any) -> None:
        """``owner.attr = wrapper``, remembered under ``target`` (a class or module owner
        kept, an instance only weakly: the record never keeps a model alive, and a model's
        entry goes when the model does), and ``target`` armed. The wrapper's function calls
        :meth:`running` each time it runs."""
        setattr(owner, attr, wrapper)
        self.adopt(target, owner, attr, getattr(wrapper, "__func__", wrapper))

    def adopt(self, target: str, owner: Any, attr: str, function: Any) -> None:
        """What holds ``owner.attr`` now is kda_tp's wrapper for ``target`` (an engine's hook
        registry applied it: SGLang's ``HookRegistry``), in which kda_tp's ``function`` runs
        (it calls :meth:`running`); ``target`` armed."""
        ref: Callable[[], Any] = ((lambda: owner) if isinstance(owner, (type, ModuleType))
                                  else weakref.ref(owner))
        entry = _Installed(ref, attr, inspect.getattr_static(owner, attr, None), function)
        entries = [e for e in self.installed.get(target, []) if e.owner() is not None
                   and e.owner() is not owner]
        self.installed[target] = entries + [entry]
        self._by_function = {k: v for k, v in self._by_function.items()
                             if v.owner() is not None}
        self._by_function[id(function)] = entry
        self.hooks[target] = "armed"

    def running(self, function: Any) -> None:
        """Called by an installed wrapper's ``function`` each time it runs: one more run, and
        what holds its attribute now (a replacement that called it proves it still runs)."""
        entry = self._by_function.get(id(function))
        if entry is None or entry.function is not function:
            return
        owner = entry.owner()
        entry.runs += 1
        if owner is not None:
            entry.holder = inspect.getattr_static(owner, entry.attr, None)

    def verify(self) -> None:
        """Each target armed only while every wrapper of it is proven to run: in place itself,
        or replaced by something that called it since (the replacement held the attribute
        when the wrapper last ran: :meth:`running`); else ``"replaced by <qualname>"``. A
        replacement that only claims to wrap it (``functools.wraps``' ``__wrapped__``) and
        calls the original directly is not armed. A target whose every owner is gone (a
        followed model garbage-collected) leaves the record: its state goes with it."""
        for target, entries in list(self.installed.items()):
            alive = [(e, owner) for e in entries if (owner := e.owner()) is not None]
            if not alive:
                del self.installed[target]
                self.hooks.pop(target, None)
                continue
            self.installed[target] = [e for e, _ in alive]
            unproven = [now for entry, owner in alive
                        if (now := inspect.getattr_static(owner, entry.attr, None))
                        is not entry.wrapper and (now is None or entry.holder is not now)]
            self.hooks[target] = (f"replaced by {_qualname(unproven[0])}" if unproven
                                  else "armed")

    def ran(self, kind: str, line: str) -> None:
        """Count one verdict of ``kind`` (a pass, a failure, raised or not) and keep its line."""
        self.checks[kind] = self.checks.get(kind, 0) + 1
        self.last = line


#: This process's record.
RECORD = Record()


def _qualname(value: Any) -> str:
    """``module.qualname`` of a function, method or other object (its type's for others)."""
    named = getattr(value, "__func__", value)
    if not hasattr(named, "__qualname__"):
        named = type(named)
    return f"{getattr(named, '__module__', '?')}.{named.__qualname__}"


def status(engine: str) -> dict[str, Any]:
    """This process's guard as a plain dict: ``versions`` (the engine's, ``engine`` being its
    module name ``"vllm"`` or ``"sglang"``, and kda_tp's), ``mode`` (or ``"invalid: ..."``),
    ``hooks`` (each target: ``"armed"``, ``"replaced by <qualname>"`` when a wrapper kda_tp
    installed is no longer in place, or why it is not), ``runs`` (how many times each
    installed wrapper ran), ``checks`` (how many verdicts, by kind), ``last`` (the last verdict line) and ``guarded``: False in mode ``off`` (or an
    invalid mode), where no load or update is judged, whatever hooks are armed."""
    module = sys.modules.get(engine)
    RECORD.verify()
    try:
        chosen = mode()
    except KdaTpError as error:
        chosen = f"invalid: {error}"
    return {"versions": {engine: str(getattr(module, "__version__", "not imported")),
                         "kda_tp": __version__},
            "mode": chosen, "hooks": dict(RECORD.hooks), "checks": dict(RECORD.checks),
            "runs": {target: sum(e.runs for e in entries)
                     for target, entries in RECORD.installed.items()},
            "last": RECORD.last, "guarded": chosen in ("fail", "warn")}


def account(reports: list[dict[str, Any]], expected: list[tuple[int, int, int]],
            where: str) -> list[dict[str, Any]]:
    """A live audit's answers, one per expected rank: every ``(dp, pp, tp)`` rank of
    ``expected`` that did not answer, and a second answer of one rank, is an entry of its own
    with ``guarded`` False and ``ok`` None (unguarded: never ``[]`` or all-OK when a rank is
    silent); a rank that answered more than once is one such entry in place of its answers;
    answers from ranks not expected are kept. Each answer's rank is read from its
    ``dp_rank``, ``pp_rank`` (0 when absent) and ``tp_rank``.

    Args:
        reports: the ranks' answers (the plugins' per-rank dicts).
        expected: every ``(dp_rank, pp_rank, tp_rank)`` the engine has.
        where: the label of the entries made here (``"vllm audit"``, ``"sglang"``).

    Returns:
        The answers and the unguarded entries, by ``(dp, pp, tp)`` rank.
    """
    tp_size = max([t + 1 for _, _, t in expected] + [0])
    by_rank: dict[tuple[int, int, int], list[dict[str, Any]]] = {}
    for report in reports:
        by_rank.setdefault(_rank_of(report), []).append(report)
    out = [answers[0] if len(answers) == 1 else
           _silent(rank, tp_size, where, f"answered {len(answers)} times in one audit (another "
                   "process claims this rank: no answer of it can be trusted)")
           for rank, answers in by_rank.items()]
    out += [_silent(rank, tp_size, where, "did not answer (no guard loaded, or no answer)")
            for rank in expected if rank not in by_rank]
    return sorted(out, key=_rank_of)


MAX_RANKS = 1 << 16
"""More ranks than any engine runs: a live audit's answer (or engine config) claiming a size or
rank beyond it is refused by name, never sized into a list (:func:`sized`)."""

_SIZES = ("tp_size",)
_RANKS = ("tp_rank", "pp_rank", "dp_rank")


def count(value: Any) -> int | None:
    """``value`` as a rank count: an int (not a bool) in ``1..MAX_RANKS``; None otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_RANKS:
        return None
    return value


def sized(reports: list[dict[str, Any]], where: str
          ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A live audit's answers split into those whose sizes and ranks can be trusted to size
    the audit, and an unguarded entry (``guarded`` False, ``ok`` None) for each other one,
    naming the refused field: a ``tp_size`` that is not an int in ``1..MAX_RANKS``, a
    ``tp_rank``/``pp_rank``/``dp_rank`` that is not an int in ``0..MAX_RANKS-1`` (absent or
    None is allowed: read as 0). Cheap whatever the answers claim (F17: ``tp_size`` 10**7
    or ``"two"``).

    Args:
        reports: the ranks' answers.
        where: the label of the entries made here.

    Returns:
        ``(trusted, refused)``.
    """
    trusted: list[dict[str, Any]] = []
    refused: list[dict[str, Any]] = []
    for report in reports:
        bad = [(key, report[key]) for key in _SIZES + _RANKS
               if report.get(key) is not None and not _valid(key, report[key])]
        if not bad:
            trusted.append(report)
            continue
        key, value = bad[0]
        shown = f"<an integer of {value.bit_length()} bits>" if isinstance(value, int) \
            and value.bit_length() > 64 else repr(value)[:40]
        what = f"size (an integer 1..{MAX_RANKS})" if key in _SIZES else \
            f"rank (an integer 0..{MAX_RANKS - 1})"
        refused.append({"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
                        "where": where, "report": None,
                        "line": f"kda_tp guard: {where}: unguarded: an answer's {key} {shown} "
                                f"is not a {what}: refused, its answer not trusted"})
    return trusted, refused


def engine_ranks(dps: list[int], pp: int, tp: int, where: str
                 ) -> tuple[list[tuple[int, int, int]], list[dict[str, Any]]]:
    """Every ``(dp, pp, tp)`` rank of an engine of these sizes, or none and one unguarded
    entry naming the sizes when they hold more than ``MAX_RANKS`` ranks (never a huge list)."""
    if len(dps) * pp * tp > MAX_RANKS:
        return [], [{"ok": None, "guarded": False, "tp_rank": None, "tp_size": None,
                     "where": where, "report": None,
                     "line": f"kda_tp guard: {where}: unguarded: {len(dps)} dp x {pp} pp x "
                             f"{tp} tp ranks are more than {MAX_RANKS}: refused"}]
    return [(d, p, t) for d in dps for p in range(pp) for t in range(tp)], []


def _valid(key: str, value: Any) -> bool:
    if key in _SIZES:
        return count(value) is not None
    return not isinstance(value, bool) and isinstance(value, int) and 0 <= value < MAX_RANKS


def _rank_of(report: dict[str, Any]) -> tuple[int, int, int]:
    def number(key: str) -> int:
        value = report.get(key)
        return value if isinstance(value, int) and not isinstance(value, bool) else -1
    return (max(number("dp_rank"), 0), max(number("pp_rank"), 0), number("tp_rank"))


def _silent(rank: tuple[int, int, int], tp_size: int, where: str, why: str) -> dict[str, Any]:
    dp, pp, tp = rank
    label = "".join(f" {name} rank {value}" for name, value in (("dp", dp), ("pp", pp)) if value)
    return {"ok": None, "guarded": False, "dp_rank": dp, "pp_rank": pp, "tp_rank": tp,
            "tp_size": tp_size, "where": where, "report": None,
            "line": f"kda_tp guard: {where}{label}: tp rank {tp}/{tp_size}: unguarded: {why}"}


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
