"""What an engine's post-load repack leaves checkable, engine-neutral (issue 34, item 2; issue 38,
F2).

An engine adapter (:class:`kda_tp.guard.Engine`) reads back what its engine holds after a
repack (vLLM's CPU GEMM dispatch: :mod:`kda_tp.guard.vllm.repacked`) and says how: as it is,
through the engine's GEMM (:data:`GEMM`), or why it cannot be read back (not checked).

A GEMM read-back is judged element by element on what it carries
(:func:`read_back_difference`), the one statement of the rules: ``-0.0`` and ``+0.0`` alike, a
subnormal as zero (a GEMM flushes it), and a row of the weight holding a NaN or an infinity set
aside (``0 * NaN`` makes the whole read-back row NaN): those elements, and only those, are
"not checkable", counted and reported; every other element of the parameter is judged, so a
wrong load is wrong whatever its expected values hold.

This module imports no engine and no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..audit.auditor import RankAudit
from ..audit.expected_params import build_checked
from ..audit.report import AuditReport
from ..checkpoint.names import param_location
from ..checkpoint.values import as_record
from ..model.dtypes import numpy_dtype

__all__ = ["GEMM", "judge", "read_back_difference", "set_aside_line"]

#: The ``repacked`` value of a parameter read back through the engine's GEMM.
GEMM = ""


@functools.cache
def _smallest_normal(dtype: str) -> float:
    """The smallest normal magnitude of a float dtype (below it, not zero: a subnormal)."""
    found = numpy_dtype(dtype)
    try:
        return float(np.finfo(found).smallest_normal)
    except ValueError:  # an ml_dtypes type (BF16, FP8): its own finfo
        import ml_dtypes

        return float(ml_dtypes.finfo(found).smallest_normal)  # type: ignore[no-untyped-call]


def read_back_difference(got: np.ndarray, want: np.ndarray, dtype: str, row: int,
                         start: int = 0) -> tuple[int | None, int]:
    """Compare a GEMM read-back with what it must hold, as the read-back carries values.

    ``-0.0`` and ``+0.0`` compare alike, a subnormal compares as zero (both sides), a NaN
    matches a NaN (the audit's rule); the elements of every weight row in which ``want``
    holds a NaN or an infinity are set aside (the GEMM reads that whole row NaN).

    Args:
        got: the read-back, flat, in ``dtype`` (numpy; an ml_dtypes type for BF16/FP8).
        want: the expected values, flat, the same size and dtype.
        dtype: their safetensors dtype (``"BF16"``, ``"F32"``...).
        row: elements per row of the weight (its last dimension, the GEMM's ``K``).
        start: the flat index of ``got[0]`` in the weight (a region of it), for the rows.

    Returns:
        ``(first, aside)``: the first index (into ``got``) that differs on an element the
        read-back carries, or None; and how many elements were set aside.

    Raises:
        ValueError: ``got`` and ``want`` differ in size.
    """
    if got.size != want.size:
        raise ValueError(f"the read-back holds {got.size} elements, {want.size} expected")
    w = np.asarray(want).astype(np.float64).reshape(-1)
    g = np.asarray(got).astype(np.float64).reshape(-1)
    tiny = _smallest_normal(dtype)
    for values in (w, g):
        values[np.abs(values) < tiny] = 0.0  # -0.0 and subnormals read as +0.0
    bad = ~np.isfinite(w)
    aside = np.zeros(w.size, dtype=bool)
    if bad.any():
        rows = (np.arange(w.size) + start) // max(row, 1)
        aside = np.isin(rows, np.unique(rows[bad]))
    differ = (w != g) & ~(np.isnan(w) & np.isnan(g)) & ~aside
    first = int(np.argmax(differ)) if differ.any() else None
    return first, int(aside.sum())


def set_aside_line(name: str, aside: int, total: int) -> str:
    """The "not checkable" line of ``aside`` elements of ``total`` set aside in ``name``."""
    return (f"{name}: repacked by the engine; {aside} of {total} elements not checkable: their "
            "rows hold a NaN or an infinity, which the engine's GEMM reads back as a row of NaN "
            "(every other element checked)")


def judge(audited: RankAudit, repacked: Mapping[str, str], values: Mapping[str, Any]
          ) -> tuple[AuditReport, list[str]]:
    """The rank's audit with each failing repacked parameter judged on what the engine holds:
    one read back through the GEMM judged element by element (:func:`read_back_difference`:
    exact when it differs only where the read-back cannot carry a value; else wrong, the
    audit's verdict standing), one that cannot be read back taken out (not checked).

    Args:
        audited: the rank's audit (its report, and the plan and view it built: the expected
            values are built from them, nothing planned again).
        repacked: each repacked parameter's name -> :data:`GEMM` or why it cannot be read
            back (the engine adapter's ``held``).
        values: the parameters the audit read, by name (a repacked one's read-back).

    Returns:
        ``(report, lines)``: a new report (the audit's is left as it is), and one line per
        parameter taken out or element set aside (``<name>: ... not checkable ...``).
    """
    report, plan = audited.report, audited.plan
    out, gone, judged = [], set(), {}
    for p in report.failures:
        why = repacked.get(p.name)
        if why is None:
            continue
        if why != GEMM:
            out.append(f"{p.name}: {why}")
            gone.add(p.name)
            continue
        location = param_location(p.name)
        if location is None or p.status != "mismatch":
            continue
        want = plan.param_plan(location[2])
        built = build_checked(audited.view, plan.layout, location[1], want, p.name,
                              plan.model_dtype, "pass another --dtype (model_dtype=), "
                              "the one the engine runs in")
        got = as_record(p.name, values[p.name]).array
        if got.shape != built.shape or got.dtype != built.dtype:
            continue  # a shape or a dtype: the audit's verdict stands
        first, aside = read_back_difference(got.reshape(-1), built.reshape(-1), want.dtype,
                                            built.shape[-1] if built.ndim else 1)
        if first is not None:
            index = [int(i) for i in np.unravel_index(first, built.shape)]
            judged[p.name] = dataclasses.replace(
                p, problem=f"{p.problem} (read back through the engine's GEMM, -0.0 as +0.0 "
                f"and subnormals as 0: first differs at {index})")
            continue
        judged[p.name] = dataclasses.replace(p, status="exact", problem=None, differences=(),
                                             equals=None)
        if aside:
            out.append(set_aside_line(p.name, aside, built.size))
    if not gone and not judged:
        return report, out
    params = [judged.get(p.name, p) for p in report.params if p.name not in gone]
    return dataclasses.replace(report, params=params), out
