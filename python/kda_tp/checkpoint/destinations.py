"""The buffers a tensor's bytes are copied into (``read_into``, an engine parameter's ``fill``):
each checked before a byte is written, by dtype and shape where it is typed (a numpy array, a
torch tensor, a typed buffer) and by byte count where it holds bytes (item size 1), so that no
read ever writes a silently wrong value (a float16 buffer for a BF16 tensor, a transposed shape
of the right size). Every refusal names the tensor, the expected and actual value and the fix.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import BufferLayoutError, DtypeMismatchError, ShapeMismatchError
from ..model.dtypes import DTYPE_SIZES, import_torch, numpy_dtype, torch_dtype

__all__ = ["check_out", "check_torch_destination", "destination", "writable_bytes"]


def writable_bytes(name: str, out: Any) -> np.ndarray:
    """``out`` as a writable 1-D ``uint8`` array sharing its memory (for ``read_into``).

    Raises:
        BufferLayoutError: ``out`` is read-only, not C-contiguous, an object array, or not a
            buffer.
    """
    if isinstance(out, np.ndarray):
        if out.dtype.hasobject:
            raise BufferLayoutError(
                f"{name}: the output buffer is a numpy array of Python objects ({out.dtype})"
            )
        array = out
    else:
        try:
            view = memoryview(out)
        except TypeError:
            raise BufferLayoutError(
                f"{name}: the output ({type(out).__name__}) does not expose the buffer protocol"
            ) from None
        if view.readonly:
            raise BufferLayoutError(f"{name}: the output buffer is read-only")
        if not view.c_contiguous:
            raise BufferLayoutError(f"{name}: the output buffer is not C-contiguous")
        # cast() refuses views with a zero-length dimension; an empty one is written as is.
        array = np.frombuffer(view.cast("B"), np.uint8) if view.nbytes else np.empty(0, np.uint8)
    if not array.flags.writeable:
        raise BufferLayoutError(f"{name}: the output buffer is read-only")
    if not array.flags.c_contiguous:
        raise BufferLayoutError(f"{name}: the output buffer is not C-contiguous")
    return array.reshape(-1).view(np.uint8)


def check_out(name: str, dtype: str, out: Any, target: np.ndarray, expected: int) -> None:
    """Refuse an output buffer of the wrong byte size or item size (for ``read_into``).

    ``target`` is ``out`` as bytes (:func:`writable_bytes`); ``expected`` the byte count of
    ``name`` (dtype ``dtype``); ``out``'s item size must be 1 or the dtype's.

    Raises:
        BufferLayoutError: naming ``name``, the expected and actual sizes.
    """
    itemsize = out.itemsize if isinstance(out, np.ndarray) else memoryview(out).itemsize
    elem = _itemsize(dtype)
    if itemsize not in (1, elem):
        raise ShapeMismatchError(
            f"{name}: the output buffer has {itemsize}-byte items, the tensor's dtype {dtype} "
            f"has {elem}-byte elements"
        )
    if target.nbytes != expected:
        raise ShapeMismatchError(
            f"{name}: the output buffer is {target.nbytes} bytes, this rank's tensor is "
            f"{expected} bytes"
        )


def _is_torch_tensor(out: Any) -> bool:
    """Whether ``out`` is a ``torch.Tensor`` (without importing torch)."""
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(out).__mro__)


def destination(name: str, dtype: str, shape: tuple[int, ...], out: Any) -> np.ndarray:
    """``out``, a ``read_into`` destination, as a writable 1-D ``uint8`` array sharing its
    memory, once it is checked to hold tensor ``name`` (safetensors dtype ``dtype``, this rank's
    local ``shape``) without reinterpreting it:

    * a *typed* destination (a numpy array or CPU ``torch.Tensor`` of any dtype but ``uint8``
      and ``int8``, or a typed buffer such as ``array.array('f')``) must have exactly the
      tensor's dtype (BF16 as ``ml_dtypes.bfloat16`` / ``torch.bfloat16``) and shape;
    * a *byte* destination (``uint8``/``int8`` arrays and tensors, ``bytearray``, a byte
      ``memoryview``, ``mmap``) is checked by byte count alone: any shape of
      ``prod(shape) x itemsize(dtype)`` bytes.

    A torch tensor must be on the CPU here (``KdaShardedSource.read_into`` stages other devices
    through host memory), contiguous, and may require grad (it is written through ``detach()``,
    as ``load_state_dict`` does under ``torch.no_grad``).

    Raises:
        DtypeMismatchError: a typed destination of another dtype (the message names the
            tensor, both dtypes and the fix).
        ShapeMismatchError: a typed destination of another shape, or a byte destination of
            another byte count (both named, and the fix).
        BufferLayoutError: ``out`` is read-only, not C-contiguous, an object array, not a
            buffer, or a torch tensor off the CPU.
    """
    elems = 1
    for extent in shape:
        elems *= extent
    expected_bytes = elems * _itemsize(dtype)
    if _is_torch_tensor(out):
        if out.device.type != "cpu":
            raise BufferLayoutError(
                f"{name}: the destination is on {out.device}; read_into stages it through host "
                "memory (KdaShardedSource.read_into), destination() takes CPU tensors only"
            )
        check_torch_destination(name, dtype, shape, out)
        torch = import_torch()
        tensor = out.detach()
        if not tensor.numel():
            return np.empty(0, np.uint8)
        raw: np.ndarray = tensor.reshape(-1).view(torch.uint8).numpy()
        return raw
    target = writable_bytes(name, out)
    if isinstance(out, np.ndarray):
        given = out.dtype
        given_shape = tuple(out.shape)
    else:
        view = memoryview(out)
        given = None if view.format in ("B", "b", "c") else view.format
        given_shape = tuple(view.shape or ())
        if given is not None:
            try:
                given = np.dtype(view.format)
            except TypeError:
                raise DtypeMismatchError(
                    f"{name}: the destination's buffer format {view.format!r} is no numpy "
                    f"dtype; pass a numpy array of {dtype} and shape {list(shape)}, or a byte "
                    f"buffer of {expected_bytes} bytes"
                ) from None
    if given is None or given in (np.dtype(np.uint8), np.dtype(np.int8)):
        _check_bytes(name, dtype, shape, target.nbytes, expected_bytes)
        return target
    try:
        wanted: Any = numpy_dtype(dtype)
    except DtypeMismatchError:
        wanted = None
    if given != wanted:
        want = "no numpy dtype" if wanted is None else f"numpy {wanted}"
        raise DtypeMismatchError(
            f"{name}: the destination is numpy {given}, this rank's tensor is {dtype} ({want}); "
            f"pass an array of {dtype} and shape {list(shape)} (kda_tp.checkpoint.reader."
            f"numpy_dtype({dtype!r})), or a uint8 buffer of {expected_bytes} bytes for the raw "
            "bytes, and cast afterwards"
        )
    _check_shape(name, dtype, shape, given_shape)
    return target


def check_torch_destination(name: str, dtype: str, shape: tuple[int, ...], out: Any) -> None:
    """The checks :func:`destination` makes of a ``torch.Tensor`` ``out`` on any device: the
    tensor's dtype and shape (typed), or its byte count (``uint8``/``int8``), and contiguity.

    Raises:
        DtypeMismatchError, ShapeMismatchError, BufferLayoutError: as :func:`destination`.
    """
    torch = import_torch()
    elems = 1
    for extent in shape:
        elems *= extent
    expected_bytes = elems * _itemsize(dtype)
    if not out.is_contiguous():
        raise BufferLayoutError(
            f"{name}: the destination tensor is not contiguous (strides {out.stride()}); "
            "pass a contiguous tensor, or read into one and copy_() it"
        )
    if out.dtype in (torch.uint8, torch.int8):
        _check_bytes(name, dtype, shape, out.numel(), expected_bytes)
        return
    try:
        typed: Any = torch_dtype(dtype)
    except DtypeMismatchError:
        typed = f"no torch dtype for {dtype}"
    if out.dtype != typed:
        raise DtypeMismatchError(
            f"{name}: the destination is {out.dtype}, this rank's tensor is {dtype} ({typed}); "
            f"pass a {typed} tensor of shape {list(shape)}, or read into one and cast with "
            f"copy_() (a uint8 tensor of {expected_bytes} bytes takes the raw bytes)"
        )
    _check_shape(name, dtype, shape, tuple(out.shape))


def _check_shape(name: str, dtype: str, shape: tuple[int, ...], given: tuple[int, ...]) -> None:
    if tuple(given) != tuple(shape):
        raise ShapeMismatchError(
            f"{name}: the destination has shape {list(given)}, this rank's tensor is "
            f"{dtype} {list(shape)}; pass a destination of shape {list(shape)} (a transposed or "
            "reshaped buffer of the same size would receive the bytes in the wrong places)"
        )


def _check_bytes(name: str, dtype: str, shape: tuple[int, ...], given: int, expected: int) -> None:
    if given != expected:
        raise ShapeMismatchError(
            f"{name}: the byte destination is {given} bytes, this rank's tensor is {dtype} "
            f"{list(shape)}, {expected} bytes; pass a buffer of exactly {expected} bytes"
        )


def _itemsize(dtype: str) -> int:
    # 1 for the packed sub-byte floats (F4, F6): their tensors are handled as bytes.
    return DTYPE_SIZES.get(dtype, 1)
