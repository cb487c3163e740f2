"""What an engine's post-load repack leaves checkable, engine-neutral (issue 34, item 2).

An engine adapter (:class:`kda_tp.guard.Engine`) reads back what its engine holds after a
repack (vLLM's CPU GEMM dispatch: :mod:`kda_tp.guard.vllm.repacked`) and says how: as it is,
through the engine's GEMM (:data:`GEMM`), or why it cannot be read back (not checkable).

A GEMM does not carry every value (:func:`not_carried`): ``-0.0`` reads ``+0.0``, a subnormal
reads 0 (flushed), a NaN or an infinity makes its whole row NaN (``0 * NaN``). A parameter read
through the GEMM whose expected values hold one of them is "repacked by the engine; not
checkable" (:func:`judge`), never wrong, and never OK on a value the read-back cannot carry.

This module imports no engine and no torch.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import numpy as np

from ..audit.auditor import RankAudit
from ..audit.expected_params import build_checked
from ..audit.report import AuditReport
from ..checkpoint.names import param_location
from ..model.dtypes import numpy_dtype

__all__ = ["GEMM", "judge", "not_carried"]

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


def not_carried(expected: np.ndarray, dtype: str) -> str | None:
    """Which value of ``expected`` (a numpy array in the safetensors dtype ``dtype``) a GEMM
    read-back cannot carry: ``"a NaN or an infinity (its row reads NaN)"``, ``"-0.0 (reads
    +0.0)"``, ``"a subnormal (reads 0)"``; None when it carries them all."""
    values = np.asarray(expected).astype(np.float64).reshape(-1)
    if not np.isfinite(values).all():
        return "a NaN or an infinity (its row reads NaN)"
    zero = values == 0
    if np.signbit(values[zero]).any():
        return "-0.0 (reads +0.0)"
    if (~zero & (np.abs(values) < _smallest_normal(dtype))).any():
        return "a subnormal (reads 0)"
    return None


def judge(audited: RankAudit, repacked: Mapping[str, str]) -> tuple[AuditReport, list[str]]:
    """The rank's audit without the repacked parameters it cannot judge: each failing one
    that could not be read back, and each failing one read through the GEMM whose expected
    values hold a value the GEMM cannot carry (:func:`not_carried`). A failing GEMM read-back
    of values it carries stays wrong.

    Args:
        audited: the rank's audit (its report, and the plan and view it built: the expected
            values are built from them, nothing planned again).
        repacked: each repacked parameter's name -> :data:`GEMM` or why it cannot be read
            back (the engine adapter's ``held``).

    Returns:
        ``(report, lines)``: a new report without those parameters (the audit's is left as
        it is), and one line per parameter taken out: ``<name>: repacked by the engine; not
        checkable: ...``.
    """
    report, plan = audited.report, audited.plan
    out, gone = [], set()
    for p in report.failures:
        why = repacked.get(p.name)
        if why is None:
            continue
        if why == GEMM:
            location = param_location(p.name)
            value = None
            if location is not None:
                want = plan.param_plan(location[2])
                built = build_checked(audited.view, plan.layout, location[1], want, p.name,
                                      plan.model_dtype, "pass another --dtype (model_dtype=), "
                                      "the one the engine runs in")
                value = not_carried(built, want.dtype)
            if value is None:
                continue  # a value the GEMM carries differs: the audit's verdict stands
            why = (f"repacked by the engine; not checkable: its expected values hold {value}, "
                   "which the engine's GEMM read-back cannot carry")
        out.append(f"{p.name}: {why}")
        gone.add(p.name)
    if not gone:
        return report, []
    return dataclasses.replace(report, params=[p for p in report.params
                                               if p.name not in gone]), out
