"""The copies an engine derives from its KDA parameters, checked against what those parameters
make of them now (:data:`kda_tp.engines.DERIVED`): at the first load (only where every
parameter a copy derives from is exact) and after every update.

This module imports no engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..audit.report import AuditReport
from ..checkpoint.values import as_record, first_difference, same_values
from ..checkpoint.names import param_location, param_name
from ..engines.derived import DERIVED, MLA_DERIVED, Derived
from ..errors import KdaTpError

__all__ = ["MlaCopiesVerdict", "derived_problem", "first_load_problem", "judge_mla_copies",
           "mla_copies", "mla_first_load_problem"]

#: The names of the MLA layers' derived copies (vLLM's ``W_UK_T`` / ``W_UV`` parameters, built
#: by ``process_weights_after_loading``; SGLang's ``w_kc`` / ``w_vc`` attributes, built at the
#: end of ``load_weights``), the last part of their names.
_MLA_COPIES = frozenset(n.rpartition(".")[2] for copies in MLA_DERIVED.values() for n in copies)


def mla_copies(model: Any) -> dict[str, Any]:
    """The MLA layers' derived copies a ``torch.nn.Module`` holds now, by full name: its
    parameters of those names and the plain attributes once built (not None); none before
    the engine builds them."""
    found = {n: p for n, p in model.named_parameters()
             if n.rpartition(".")[2] in _MLA_COPIES}
    for name, module in model.named_modules():
        for attribute in _MLA_COPIES:
            value = module.__dict__.get(attribute)  # a plain attribute (not a parameter)
            if value is not None:
                found[f"{name}.{attribute}" if name else attribute] = value
    return found


def mla_first_load_problem(name: str, value: Any, params: Mapping[str, Any],
                           report: AuditReport, plan: Any) -> str | None | bool:
    """The verdict on one MLA derived copy (:data:`~kda_tp.engines.derived.MLA_DERIVED`, named
    as itself: ``W_UK_T``, ``w_kc``, ...) against what the rank's local ``kv_b_proj`` (judged
    by the audit, ``report``) derives: None (exact), a problem, or False when ``report``'s
    layout keeps no such copy. Checked only when that ``kv_b_proj`` is exact (else its
    failure says it all); one the audit did not check is the problem.

    Args:
        plan: the rank's ``kda_tp.rank.MlaTpPlan`` (the local heads the copy is cut into).
    """
    location = param_location(name)
    copy = MLA_DERIVED.get(report.engine, {}).get(location[2]) if location else None
    if location is None or copy is None:
        return False
    origin = param_name(location[0], location[1], copy.source)
    verdicts = {p.name: p for p in report.params}
    if origin not in verdicts:
        return f"its parameter {origin} was not checked"
    if not verdicts[origin].passed:
        return None
    derived = Derived((copy.source,), lambda kv_b: copy.derive(kv_b, plan), issue=copy.issue)
    return _problem(name, value, params, derived, [origin])


@dataclass
class MlaCopiesVerdict:
    """What :func:`judge_mla_copies` found on one rank.

    Attributes:
        checked: the copies compared (names), each against its local ``kv_b_proj``.
        bytes: their size, in bytes.
        problems: ``"<copy's name>: <what is wrong>"`` per wrong copy.
        unchecked: ``"<copy's name>: <why not checked>"`` per copy the layout keeps that the
            engine did not build: refused in mode ``fail``, as every check that cannot run.
        repacked: ``"<copy's name>: <why not checkable>"`` per copy whose ``kv_b_proj`` the
            attention backend released once it packed its own copies (vLLM's ``AMX_MLA``):
            not checkable, said, stops nothing (the rule of the KDA parameters an engine
            repacks after loading).
    """

    checked: list[str] = field(default_factory=list)
    bytes: int = 0
    problems: list[str] = field(default_factory=list)
    unchecked: list[str] = field(default_factory=list)
    repacked: list[str] = field(default_factory=list)


def judge_mla_copies(params: Mapping[str, Any], copies: Mapping[str, Any], layout: str,
                     plan: Any) -> MlaCopiesVerdict:
    """Every MLA layer's derived copies (:data:`~kda_tp.engines.derived.MLA_DERIVED` of
    ``layout``) against what the rank's local ``kv_b_proj`` derives now, once the engine built
    them (vLLM: after ``process_weights_after_loading``, at the first load and after every
    refit). A copy is judged only where its ``kv_b_proj`` is readable: one whose
    ``kv_b_proj.weight`` the backend emptied (vLLM's ``AMX_MLA`` packs its own copies and
    releases it) is in ``repacked``, one the engine never built in ``unchecked``; never passed
    as judged. Without the rank's MLA plan (``plan`` None: the first load said why it did not
    judge the MLA layers) nothing is judged.

    Args:
        params: the rank's parameters now, by full name (``kv_b_proj.weight`` among them).
        copies: the copies the model holds, by full name (:func:`mla_copies`).
        layout: the engine layout's name.
        plan: the rank's ``kda_tp.rank.MlaTpPlan`` (its local heads), or None when unknown.
    """
    verdict = MlaCopiesVerdict()
    table = MLA_DERIVED.get(layout, {}) if plan is not None else {}
    layers: dict[tuple[str, int], str] = {}
    for name in params:
        location = param_location(name)
        if location is not None and location[2].endswith("kv_b_proj.weight"):
            layers.setdefault(location[:2], name)
    for (prefix, layer), origin in sorted(layers.items()):
        kv_b = params[origin]
        for suffix, copy in table.items():
            name = param_name(prefix, layer, suffix)
            value = copies.get(name)
            if 0 in tuple(getattr(kv_b, "shape", ())) or getattr(kv_b, "is_meta", False):
                verdict.repacked.append(
                    f"{name}: {origin} is empty after post-processing (the attention backend "
                    "released it once it packed its own copies: vLLM's AMX_MLA)")
                continue
            if value is None:
                verdict.unchecked.append(f"{name}: the engine built no such copy of {origin}")
                continue
            derived = Derived((copy.source,), lambda kv, c=copy: c.derive(kv, plan),
                              issue=copy.issue)
            problem = _problem(name, value, {origin: kv_b}, derived, [origin])
            verdict.checked.append(name)
            verdict.bytes += int(getattr(value, "nbytes", 0) or 0)
            if isinstance(problem, str):
                verdict.problems.append(f"{name}: {problem}")
    return verdict



def _origins(name: str, layout: str) -> tuple[Derived, list[str]] | None:
    """The copy ``name`` is under ``layout`` and the full names of the parameters it derives
    from; None when ``layout`` keeps no such copy."""
    location = param_location(name)
    copy = DERIVED.get(layout, {}).get(location[2]) if location is not None else None
    if location is None or copy is None:
        return None
    prefix, layer, _ = location
    return copy, [param_name(prefix, layer, source) for source in copy.sources]


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
    found = _origins(name, layout)
    return False if found is None else _problem(name, value, params, *found)


def first_load_problem(name: str, value: Any, params: Mapping[str, Any],
                       report: AuditReport) -> str | None | bool:
    """:func:`derived_problem` after the first load's audit (``report``): checked only when
    every parameter the copy derives from is exact (else the parameter's failure says it
    all); a parameter the audit did not check is the problem."""
    found = _origins(name, report.engine)
    if found is None:
        return False
    verdicts = {p.name: p for p in report.params}
    for origin in found[1]:
        if origin not in verdicts:
            return f"its parameter {origin} was not checked"
        if not verdicts[origin].passed:
            return None
    return _problem(name, value, params, *found)


def _problem(name: str, value: Any, params: Mapping[str, Any], copy: Derived,
             origins: list[str]) -> str | None | bool:
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
