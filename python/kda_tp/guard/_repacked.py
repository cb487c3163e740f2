"""What an engine holds after its post-load repack, read back, and the values such a read-back
cannot carry (issue 34, item 2).

After loading, vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, run by ``UnquantizedLinearMethod
.process_weights_after_loading``) moves every unquantized Linear weight into a kernel's own
packed copy (oneDNN, the SGL/AMX kernel, zentorch), reachable only through the closure of
``layer.cpu_linear``, and replaces ``layer.weight`` with an empty tensor; a BF16 causal-conv
weight ``[dim, 1, width]`` on an AVX512-BF16 (or ARM BF16) host is packed in place, its loaded
values kept by vLLM as ``layer._cpu_unpacked_conv_weight`` ``[dim, width]``. The guard's checks
after the first load (the live audit, a reload from disk, an update session's end) read what
the engine holds (:func:`held`):

* an emptied weight whose module has a callable ``cpu_linear``: the engine's own GEMM of the
  identity, ``cpu_linear(eye(K), weight, None).T`` (``K`` = the module's
  ``input_size_per_partition``, a ``ReplicatedLinear``'s ``input_size``, in blocks of
  :data:`EYE_ROWS` rows), which is ``W`` ``[N, K]``
  bit for bit for every value a GEMM carries;
* a repacked conv: ``_cpu_unpacked_conv_weight`` viewed ``[dim, 1, width]``;
* an emptied weight kda_tp cannot read back (no ``cpu_linear``, or it failed): not checkable
  (repacked), never wrong.

A GEMM does not carry every value (:func:`not_carried`): ``-0.0`` reads ``+0.0``, a subnormal
reads 0 (flushed), a NaN or an infinity makes its whole row NaN (``0 * NaN``). A parameter read
through the GEMM whose expected values hold one of them is "repacked by the engine; not
checkable" (:func:`judge`), never wrong, and never OK on a value the read-back cannot carry.

This module imports no engine; torch is used only when an engine imported it (its tensors).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..audit.expected_params import expected_params
from ..audit.report import AuditReport
from ..engines.registry import param_location

__all__ = ["EYE_ROWS", "GEMM", "held", "judge", "not_carried", "read_back"]

#: Rows of the identity fed to the engine's GEMM at a time (bounds the read-back's memory).
EYE_ROWS = 4096
#: The ``repacked`` value of a parameter read back through the engine's GEMM (:func:`held`).
GEMM = ""
# The smallest normal magnitude of each float dtype (below it, not zero: a subnormal).
_TINY = {"F16": 2.0 ** -14, "F64": 2.0 ** -1022}


def held(model: Any, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``params`` (full name -> parameter, as ``model.named_parameters()``) with every
    repacked one replaced by what the engine holds, read back (:func:`read_back`).

    Returns:
        ``(values, repacked)``: ``values`` by name (the read-back where there is one, else the
        parameter as it is); ``repacked`` maps each repacked parameter's name to
        :data:`GEMM` (read through the engine's GEMM: :func:`judge` decides what it can
        carry) or to why it cannot be read back (not checkable).
    """
    values, repacked = dict(params), {}
    for name, param in params.items():
        if not isinstance(name, str) or not name.endswith(".weight") or \
                param_location(name) is None:
            continue
        try:
            module = model.get_submodule(name[: -len(".weight")])
        except AttributeError:
            continue
        value, how = read_back(module, param)
        values[name] = value
        if how is not None:
            repacked[name] = how
    return values, repacked


def read_back(module: Any, param: Any) -> tuple[Any, str | None]:
    """What ``module`` (the module holding ``param`` as its ``weight``) holds after the
    engine's post-load repack: ``(value, how)``, ``how`` being None (not repacked, or a conv
    whose loaded values the engine kept: ``value`` is them), :data:`GEMM` (``value`` read
    through the engine's GEMM) or why it cannot be read back (``value`` is ``param``)."""
    unpacked = getattr(module, "_cpu_unpacked_conv_weight", None)
    if unpacked is not None and getattr(unpacked, "ndim", 0) == 2:
        return unpacked.view(unpacked.shape[0], 1, unpacked.shape[1]), None
    if getattr(param, "ndim", 1) != 1 or getattr(param, "numel", lambda: 1)() != 0:
        return param, None
    linear = getattr(module, "cpu_linear", None)
    width = getattr(module, "input_size_per_partition", getattr(module, "input_size", None))
    if not callable(linear) or not isinstance(width, int):
        return param, ("not checkable (repacked): the engine replaced it with an empty tensor "
                       "after loading and kda_tp cannot read its kernel's copy")
    try:
        return _through_gemm(linear, param, width), GEMM
    except Exception as error:  # noqa: BLE001 - the engine's kernel: not checkable
        return param, ("not checkable (repacked): reading it back through the engine's "
                       f"cpu_linear failed: {type(error).__name__}: {error}")


def _through_gemm(linear: Any, param: Any, width: int) -> Any:
    """``W`` ``[N, K]`` from the engine's GEMM ``x @ W.T``: the identity's rows, in blocks."""
    torch = sys.modules["torch"]
    blocks = []
    with torch.no_grad():
        for start in range(0, width, EYE_ROWS):
            rows = min(EYE_ROWS, width - start)
            eye = torch.zeros(rows, width, dtype=param.dtype, device=param.device)
            eye[:, start:start + rows] = torch.eye(rows, dtype=param.dtype, device=param.device)
            blocks.append(linear(eye, param, None).to(param.dtype))
    return torch.cat(blocks).t().contiguous()


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
    if (~zero & (np.abs(values) < _TINY.get(dtype, 2.0 ** -126))).any():
        return "a subnormal (reads 0)"
    return None


def judge(report: AuditReport, repacked: Mapping[str, str], checkpoint: Any, *, tp_rank: int,
          model_dtype: str | None) -> list[str]:
    """Take the repacked parameters the audit cannot judge out of ``report``: each failing one
    that could not be read back, and each failing one read through the GEMM whose expected
    values hold a value the GEMM cannot carry (:func:`not_carried`). A failing GEMM read-back
    of values it carries stays wrong.

    Args:
        report: the rank's audit (its ``params`` edited in place).
        repacked: :func:`held`'s second result.
        checkpoint: the checkpoint (path or open source) the audit read.
        tp_rank: the rank.
        model_dtype: the engine's model dtype, as the audit had it.

    Returns:
        One line per parameter taken out: ``<name>: repacked by the engine; not checkable:
        ...``.
    """
    failing = [p for p in report.failures if p.name in repacked]
    if not failing:
        return []
    expected: dict[tuple[int, str], Any] = {}
    if any(repacked[p.name] == GEMM for p in failing):
        _, ranks = expected_params(checkpoint, report.engine, report.tp_size, [tp_rank],
                                   model_dtype)
        for param in ranks[0][1]:
            location = param_location(param.name)
            if location is not None:
                expected[location[1:]] = param
    out, gone = [], set()
    for p in failing:
        why = repacked[p.name]
        if why == GEMM:
            location = param_location(p.name)
            want = expected.get(location[1:]) if location is not None else None
            value = not_carried(want.build(), want.plan.dtype) if want is not None else None
            if value is None:
                continue  # a value the GEMM carries differs: the audit's verdict stands
            why = (f"repacked by the engine; not checkable: its expected values hold {value}, "
                   "which the engine's GEMM read-back cannot carry")
        out.append(f"{p.name}: {why}")
        gone.add(p.name)
    report.params = [p for p in report.params if p.name not in gone]
    return out
