"""What vLLM holds after its post-load repack, read back (issue 34, item 2), and its parameters
as the layouts describe them.

After loading, vLLM's CPU GEMM dispatch (``dispatch_cpu_unquantized_gemm`` in
``vllm/model_executor/layers/utils.py``, run by ``UnquantizedLinearMethod
.process_weights_after_loading``) moves every unquantized Linear weight into a kernel's own
packed copy (oneDNN, the SGL/AMX kernel, zentorch), reachable only through the closure of
``layer.cpu_linear``, and replaces ``layer.weight`` with an empty tensor; a BF16 causal-conv
weight ``[dim, 1, width]`` on an AVX512-BF16 (or ARM BF16) host is packed in place, its loaded
values kept by vLLM as ``layer._cpu_unpacked_conv_weight`` ``[dim, width]``. The guard's checks
after the first load (the live audit, a reload from disk, an update session's end) read what
vLLM holds (:func:`held`):

* an emptied weight whose module has a callable ``cpu_linear``: vLLM's own GEMM of the
  identity, ``cpu_linear(eye(K), weight, None).T`` (``K`` = the module's
  ``input_size_per_partition``, a ``ReplicatedLinear``'s ``input_size``, in blocks of
  :data:`EYE_ROWS` rows), which is ``W`` ``[N, K]`` bit for bit for every value a GEMM carries
  (judged on what it carries: :func:`kda_tp.guard.read_back_difference`);
* a repacked conv: ``_cpu_unpacked_conv_weight`` viewed ``[dim, 1, width]``;
* an emptied weight kda_tp cannot read back (no ``cpu_linear``, or it failed): never wrong,
  never OK: listed in the live audit's ``unchecked``, "not checked" in an update (which mode
  ``fail`` refuses).

And how vLLM writes a sparse patch: its ``load_checkpoint_weight_patches`` replaces
``torch.Tensor.copy_`` while it loads with ``copy_non_nan_`` (a NaN fed keeps the old value),
recognised as that function of vLLM's own (:func:`masked_copy`), by its code object.

This module imports no vLLM; torch is used only when vLLM imported it (its tensors).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from ...checkpoint.names import param_location
from .._repacked import GEMM

__all__ = ["EYE_ROWS", "as_described", "held", "masked_copy", "read_back"]

#: The module of vLLM's sparse patches (``_load_nan_masked_weights``, its ``copy_non_nan_``).
_PATCHES = "vllm.model_executor.model_loader.checkpoint_weight_patch"

#: Rows of the identity fed to vLLM's GEMM at a time (bounds the read-back's memory).
EYE_ROWS = 4096


def as_described(name: str, param: Any) -> Any:
    """``param`` as the layouts describe it: a ModelOpt ``FP8_PB_WO`` block scale is loaded
    ``[ob, 1, ib, 1]`` and squeezed to ``[ob, ib]`` only by vLLM's
    ``process_weights_after_loading`` (``KFp8Block128.process``), after the guard's first
    check; the squeezed view holds the same bytes. Every other parameter as it is."""
    shape = tuple(getattr(param, "shape", ()))
    if name.endswith(".weight_scale") and len(shape) == 4 and shape[1] == shape[3] == 1:
        return param.squeeze(3).squeeze(1)
    return param


def held(model: Any, params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """``params`` (full name -> parameter, as ``model.named_parameters()``) with every
    repacked one replaced by what vLLM holds, read back (:func:`read_back`).

    Returns:
        ``(values, repacked)``: ``values`` by name (the read-back where there is one, else the
        parameter as it is); ``repacked`` maps each repacked parameter's name to
        ``kda_tp.guard._repacked.GEMM`` (read through vLLM's GEMM: ``kda_tp.guard._repacked.judge``
        decides what it can carry) or to why it cannot be read back (not checkable).
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
    """What ``module`` (the module holding ``param`` as its ``weight``) holds after vLLM's
    post-load repack: ``(value, how)``, ``how`` being None (not repacked, or a conv whose
    loaded values vLLM kept: ``value`` is them), ``kda_tp.guard._repacked.GEMM`` (``value`` read
    through vLLM's GEMM) or why it cannot be read back (``value`` is ``param``)."""
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
    """``W`` ``[N, K]`` from vLLM's GEMM ``x @ W.T``: the identity's rows, in blocks."""
    torch = sys.modules["torch"]
    blocks = []
    with torch.no_grad():
        for start in range(0, width, EYE_ROWS):
            rows = min(EYE_ROWS, width - start)
            eye = torch.zeros(rows, width, dtype=param.dtype, device=param.device)
            eye[:, start:start + rows] = torch.eye(rows, dtype=param.dtype, device=param.device)
            blocks.append(linear(eye, param, None).to(param.dtype))
    return torch.cat(blocks).t().contiguous()


def masked_copy(copy: Any) -> bool:
    """Whether ``copy`` (what ``torch.Tensor.copy_`` is now) is vLLM's own NaN-sentinel copy:
    the ``copy_non_nan_`` that ``_load_nan_masked_weights``
    (``vllm/model_executor/model_loader/checkpoint_weight_patch.py``, run by
    ``load_checkpoint_weight_patches``) defines and installs while a sparse patch loads,
    known by its code object. Any other function, one that merely wraps it included, is not."""
    patches = sys.modules.get(_PATCHES)
    loader = getattr(patches, "_load_nan_masked_weights", None)
    code = getattr(copy, "__code__", None)
    consts = getattr(getattr(loader, "__code__", None), "co_consts", ())
    return code is not None and any(code is c for c in consts)
