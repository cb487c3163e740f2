"""Values as kda_tp compares them: a parameter's raw bytes and dtype, equality, casts.

An engine's parameter arrives as a numpy array, a torch tensor (any device) or a
:class:`~kda_tp.Tensor` record; :func:`as_record` turns each into the record of its raw bytes.
Values compare by their bits, except that a NaN matches any NaN (:func:`same_values`): an
engine's cast writes a NaN in one of several patterns, by device and code path
(``kda_tp.model.dtypes``). The expected values are cast to the parameter's dtype as the
engines' loaders cast them (``kda_tp.model.dtypes.cast_to``, with the dtype facts, where the
engine layouts fill parameters with it). The one rule of the audit, the dump, the digests, the
guard and the verification of rank checkpoints (:func:`bytes_equal`), beside :class:`Tensor`.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import numpy as np

from ..errors import CheckpointError, ShapeMismatchError
from ..model.dtypes import AUDITED_DTYPES, numpy_dtype, torch_dtype
from .reader import Tensor

__all__ = ["as_record", "bytes_equal", "differing", "first_difference", "same_tensor_values",
           "same_values"]


def as_record(name: str, value: Any) -> Tensor:
    """``value`` (a numpy array, a torch tensor on any device, or a :class:`~kda_tp.Tensor`)
    as a Tensor record of its raw bytes. torch is never imported here: a torch tensor means it
    is loaded already.

    Raises:
        CheckpointError: a value of another type, a dtype with no safetensors name, or a torch
            tensor without data (``meta`` device).
        ShapeMismatchError: a Tensor record whose data is not its shape's size in bytes.
    """
    if isinstance(value, Tensor):
        if value.dtype not in AUDITED_DTYPES:  # reported as a dtype mismatch
            return value
        data = value.data
        need = math.prod(value.shape) * numpy_dtype(value.dtype).itemsize
        if not isinstance(data, np.ndarray) or data.nbytes != need:
            got = f"{data.nbytes} bytes" if isinstance(data, np.ndarray) else type(data).__name__
            raise ShapeMismatchError(
                f"{name}: a kda_tp.Tensor of shape {list(value.shape)} x {value.dtype} needs "
                f"{need} bytes of data, it has {got}"
            )
        flat = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        return Tensor(name, value.dtype, value.shape, flat)
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported already
    if torch is not None and isinstance(value, torch.Tensor):  # engines' Parameter subclasses too
        if torch.nn.parameter.is_lazy(value):
            raise CheckpointError(f"{name}: an uninitialized (lazy) parameter: it holds no "
                                  "values; was the model materialized and loaded?")
        if value.layout != torch.strided:
            raise CheckpointError(f"{name}: a {value.layout} tensor; an engine's parameters are "
                                  "dense (strided): dump the dense weights")
        dtype = next((d for d in AUDITED_DTYPES if value.dtype == torch_dtype(d)), None)
        if dtype is None:
            raise CheckpointError(f"{name}: torch dtype {value.dtype} is not audited "
                                  f"(known: {', '.join(AUDITED_DTYPES)})")
        if value.device.type == "meta":
            raise CheckpointError(f"{name}: a meta tensor (no data); dump the loaded weights")
        # A negated or conjugated view (``_neg_view()``) holds its values only once resolved.
        flat = value.detach().resolve_neg().resolve_conj().to("cpu").contiguous().reshape(-1)
        return Tensor(name, dtype, tuple(value.shape), flat.view(torch_dtype("U8")).numpy())
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        dtype = next((d for d in AUDITED_DTYPES if numpy_dtype(d) == array.dtype), None)
        if dtype is None:
            raise CheckpointError(f"{name}: numpy dtype {array.dtype} is not audited "
                                  f"(known: {', '.join(AUDITED_DTYPES)})")
        return Tensor(name, dtype, array.shape, array.reshape(-1).view(np.uint8))
    raise CheckpointError(
        f"{name}: a {type(value).__name__}; expected a numpy array, a torch tensor or a "
        "kda_tp.Tensor"
    )



# Elements compared per step: a difference is found in the first differing chunk, without a
# temporary the size of the whole array.
_CHUNK = 1 << 20
_STEP = 1 << 12


def same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat arrays of one dtype hold the same values: the same bits, except that a
    NaN matches a NaN of any bit pattern (an engine's cast writes a NaN in one of several:
    ``kda_tp.model.dtypes``); ``-0.0`` and ``0.0`` differ. Compared chunk by chunk: arrays that
    differ early cost little."""
    if a.shape != b.shape:
        return False
    return _first_chunk_difference(a, b) is None


def _first_chunk_difference(a: np.ndarray, b: np.ndarray) -> int | None:
    """The first index where flat arrays ``a`` and ``b`` differ (see :func:`same_values`),
    found chunk by chunk (stops at the first differing chunk); None when they do not."""
    x, y = a.view(np.uint8), b.view(np.uint8)
    step = _CHUNK * a.dtype.itemsize
    for start in range(0, x.size, step):
        if bytes_equal(x[start : start + step], y[start : start + step]):
            continue
        # The differing chunk, in small steps: the first difference costs a few thousand
        # elements' comparison, not a chunk's NaN tests.
        first = start // a.dtype.itemsize
        for at in range(first, min(first + _CHUNK, a.size), _STEP):
            found = np.flatnonzero(differing(a[at : at + _STEP], b[at : at + _STEP]))
            if found.size:
                return at + int(found[0])
    return None


def differing(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per element of flat arrays ``a`` and ``b`` (one dtype, one size): whether they differ
    (other bits, unless both are NaN)."""
    width = a.dtype.itemsize
    bits: np.ndarray = (
        a.view(np.uint8).reshape(-1, width) != b.view(np.uint8).reshape(-1, width)).any(1)
    if a.dtype.kind not in "iub":  # every other audited dtype is a float (ml_dtypes' too)
        bits &= ~(np.isnan(a) & np.isnan(b))
    return bits


def first_difference(a: np.ndarray, b: np.ndarray) -> int:
    """The first element index where flat arrays ``a`` and ``b`` (one dtype, one size) differ
    (see :func:`same_values`); they must differ."""
    found = _first_chunk_difference(a, b)
    assert found is not None, "first_difference of arrays holding the same values"
    return found


def same_tensor_values(a: Any, b: Any) -> bool:
    """:func:`same_values` for two torch tensors of one dtype and size, on their device
    (nothing copied to the host): the same bits, except that a NaN matches a NaN of any bit
    pattern. torch is never imported here: torch tensors mean it is loaded already."""
    torch = sys.modules["torch"]
    kind = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    x, y = a.contiguous().view(kind), b.contiguous().view(kind)
    if bool(torch.equal(x, y)):
        return True
    if not a.is_floating_point():
        return False
    return bool(((x == y) | (torch.isnan(a) & torch.isnan(b))).all())


def bytes_equal(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat uint8 arrays hold the same bytes (arrays of two sizes do not), compared
    as the widest integers that tile them in 1 MiB chunks (as fast as a memcpy of one of them,
    2.4x faster than bytes on 112 MB; no temporary larger than a chunk). Equal bytes are the
    same values; unequal ones may still be (two NaNs): a verdict on values is
    :func:`same_values`', one on bytes (a rank checkpoint against its input) this one's."""
    if a.shape != b.shape:
        return False
    word = next(w for w in (8, 4, 2, 1) if a.size % w == 0 and a.ctypes.data % w == 0
                and b.ctypes.data % w == 0)
    x, y = a.view(f"<u{word}"), b.view(f"<u{word}")
    step = (1 << 20) // word
    return all(np.array_equal(x[i : i + step], y[i : i + step]) for i in range(0, x.size, step))
