"""The audit's verdicts: per part, per parameter, per run (:func:`kda_tp.audit.audit`).

:class:`AuditReport` holds one :class:`ParamAudit` per KDA parameter of every audited rank; a
parameter that differs carries one :class:`PartDifference` per differing part. Every class has
``format()`` (the lines ``kda-tp audit`` prints) and ``to_dict()`` (``kda-tp audit --json``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = ["AuditReport", "ParamAudit", "PartDifference"]


@dataclass(frozen=True)
class PartDifference:
    """Where one part (plan tensor) of an engine parameter differs from what it should hold.

    Attributes:
        part: the plan tensor (``q_proj``, ``A_log``, ...), or ``"padding"`` for the zero rows
            an engine appends to a fused parameter.
        index: the first differing index, in the parameter's shape (elements).
        part_index: the same position as an index into the part (its local shape).
        expected: the expected value there (after the cast to the parameter's dtype).
        actual: the value the dump holds there.
        equals: what the part's data equals instead, when it equals some other slice (e.g.
            ``"rank 0's slice of q_proj"``); for the padding, which rows must be zero. None
            when it matches nothing tried.
        untried: how many candidate slices the diagnosis did not compare, its budget spent
            (``kda_tp.audit._diagnosis.DIAGNOSIS_BUDGET``); 0 when every one was tried.
    """

    part: str
    index: tuple[int, ...]
    part_index: tuple[int, ...]
    expected: float
    actual: float
    equals: str | None = None
    untried: int = 0

    def format(self) -> str:
        """One clause, e.g. ``part v_proj differs at [768, 0] (its [0, 0]; expected 20384.0,
        got 20768.0): equals rank 2's slice of v_proj``."""
        text = (
            f"part {self.part} differs at {list(self.index)} (its {list(self.part_index)}; "
            f"expected {self.expected!r}, got {self.actual!r})"
        )
        if self.equals is None:
            return text + (f" ({self.untried} candidate slice(s) not tried: the diagnosis "
                           "budget is spent)" if self.untried else "")
        return text + (": " if self.part == "padding" else ": equals ") + self.equals

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return {
            "part": self.part, "index": list(self.index), "part_index": list(self.part_index),
            "expected": _json_float(self.expected), "actual": _json_float(self.actual),
            "equals": self.equals, "untried": self.untried,
        }


@dataclass(frozen=True)
class ParamAudit:
    """The verdict on one KDA parameter of one rank.

    Attributes:
        rank: the tensor-parallel rank.
        layer: the 0-based decoder layer.
        name: the parameter's name in the dump (with the dump's own prefix; for a missing
            parameter, the name the engine would give it).
        status: ``"exact"``, ``"mismatch"`` (present, but shape, dtype or bytes differ) or
            ``"missing"`` (the engine's layout has it, the dump does not).
        problem: what is wrong in a few words (``"values differ in q_proj, k_proj"``, a shape,
            a dtype, ``"missing: ..."``); None when exact.
        differences: per differing part, where and what it equals instead (first differing
            part first).
        equals: what the whole parameter equals instead, when no single part explains it
            (e.g. its parts in another order); None otherwise.
        held_dtype: the dtype the parameter is held in when that is not the engine's default
            model dtype the audit assumed, none being passed (``"F32"`` where ``"BF16"`` was
            expected): the engine likely ran in another ``--dtype``; None otherwise.
        mla: True for a parameter of one of the hybrid's MLA layers (``EngineLayout.mla``).
    """

    rank: int
    layer: int
    name: str
    status: str
    problem: str | None = None
    differences: tuple[PartDifference, ...] = ()
    equals: str | None = None
    held_dtype: str | None = None
    mla: bool = False

    @property
    def passed(self) -> bool:
        """True when the parameter is exactly right."""
        return self.status == "exact"

    def format(self) -> str:
        """One line: ``rank 1 model.layers.0.self_attn.A_log: <problem>[; equals ...][; part
        ...]``."""
        if self.passed:
            return f"rank {self.rank} {self.name}: exact"
        text = f"rank {self.rank} {self.name}: {self.problem}"
        if self.equals:
            text += f"; equals {self.equals}"
        if self.differences:
            text += "; " + "; ".join(d.format() for d in self.differences)
        return text

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return {
            "rank": self.rank, "layer": self.layer, "name": self.name, "status": self.status,
            "problem": self.problem, "equals": self.equals,
            "differences": [d.to_dict() for d in self.differences], "mla": self.mla,
        }


@dataclass
class AuditReport:
    """The outcome of :func:`audit` (one rank) or :func:`~kda_tp.audit.audit_path` (one or every
    rank).

    Attributes:
        engine: the engine layout audited against (a :data:`kda_tp.engines.LAYOUTS` key).
        tp_size: the tensor-parallel world size.
        ranks: the ranks audited, sorted.
        params: one entry per KDA parameter of every KDA layer of every audited rank, then (where
            the hybrid's MLA layers are judged) per MLA parameter of every MLA layer.
        ignored: parameters of the dump that are neither (counted, not checked).
        problems: what is wrong outside any one parameter (e.g. a rank missing from a
            ``sharded_state`` directory).
    """

    engine: str
    tp_size: int
    ranks: tuple[int, ...] = ()
    params: list[ParamAudit] = field(default_factory=list)
    ignored: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when every KDA parameter of every rank is exactly right and no rank is
        missing."""
        return not self.problems and all(p.passed for p in self.params)

    @property
    def failures(self) -> list[ParamAudit]:
        """The parameters that are not exactly right."""
        return [p for p in self.params if not p.passed]

    def summary(self) -> str:
        """One line: the verdict and the counts (``14 of 14 KDA and 12 of 12 MLA parameters
        exact ...`` where MLA parameters were judged)."""
        exact = sum(p.passed for p in self.params)
        mla = [p for p in self.params if p.mla]
        judged = (f"{exact - sum(p.passed for p in mla)} of {len(self.params) - len(mla)} KDA "
                  f"and {sum(p.passed for p in mla)} of {len(mla)} MLA" if mla
                  else f"{exact} of {len(self.params)} KDA")
        counts = (
            f"{judged} parameters exact on rank"
            f"{'s' if len(self.ranks) != 1 else ''} {', '.join(map(str, self.ranks)) or '-'} "
            f"of {self.tp_size} ({self.engine}); {self.ignored} other parameters ignored"
        )
        if self.passed:
            return f"OK: {counts}"
        wrong = len(self.params) - exact
        extra = f", {len(self.problems)} other problem(s)" if self.problems else ""
        held = {p.held_dtype for p in self.failures}
        if not self.problems and len(held) == 1 and None not in held:
            # Every wrong parameter is right but for the engine's model dtype: say so first.
            (dtype,) = held
            extra = (f", each held in {dtype}, not the model dtype the audit expected: the "
                     f"engine likely ran with --dtype {dtype}; audit again with --dtype "
                     f"{dtype} (model_dtype=)")
        what = (f"{sum(not p.passed and not p.mla for p in self.params)} KDA and "
                f"{sum(not p.passed for p in mla)} MLA" if mla else f"{wrong} KDA")
        return f"FAIL: {what} parameter(s) wrong{extra}; {counts}"

    def format(self) -> str:
        """One line per problem and per parameter that is not exact, then the summary."""
        lines = list(self.problems) + [p.format() for p in self.failures]
        return "\n".join([*lines, self.summary()])

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (what ``kda-tp audit --json`` prints): ``ok`` (:attr:`passed`, under
        the key every ``kda-tp --json`` document has), ``engine``, ``tp_size``, ``ranks``, ``ignored``,
        ``problems``, ``exact`` (the count) and ``params`` (every parameter's entry, see
        :meth:`ParamAudit.to_dict`)."""
        return {
            "ok": self.passed, "engine": self.engine, "tp_size": self.tp_size,
            "ranks": list(self.ranks), "ignored": self.ignored, "problems": list(self.problems),
            "exact": sum(p.passed for p in self.params),
            "params": [p.to_dict() for p in self.params],
        }


def _json_float(x: float) -> float | str:
    """``x``, or its repr for NaN and infinities (which JSON cannot hold)."""
    return x if math.isfinite(x) else repr(x)
