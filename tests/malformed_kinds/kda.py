"""A checkpoint whose KDA tensors are wrong (``action="shard"``): one missing, or one of the
wrong dtype, number of dimensions or size. Each is the base checkpoint rewritten as one
``model.safetensors``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
from kda_tp.errors import CheckpointError, DtypeMismatchError, KdaTpError, ShapeMismatchError

from .core import ATTN, SIZES, Kinds, Tensor, pattern, rewritten

KINDS = Kinds()


def _without(name: str) -> Callable[[Path, str], Path]:
    """A writer: the base checkpoint rewritten without the tensor ``name``."""

    def write(root: Path, kind: str) -> Path:
        return rewritten(root, kind, lambda ts: [t for t in ts if t[0] != name])

    return write


KINDS.add("kda_missing_tensor", _without(ATTN.format(1) + "g_b_proj.weight"), CheckpointError,
          ("KDA layer 1", "self_attn.g_b_proj.weight"), "shard")
KINDS.add("kda_missing_tensor_first_layer", _without(ATTN.format(0) + "A_log"), CheckpointError,
          ("KDA layer 0", "self_attn.A_log"), "shard")


def _changed(
    error: type[KdaTpError], name: str, *contains: str
) -> Callable[[Callable[[Tensor], Tensor]], Callable[[Path], object]]:
    """Decorator: the decorated ``change(tensor) -> tensor`` is applied to the tensor ``name``
    of the base checkpoint, rewritten; the kind is named after it, and the message names the
    file and ``name`` and contains ``contains``."""

    def register(change: Callable[[Tensor], Tensor]) -> Callable[[Path], object]:
        def write(root: Path, kind: str) -> Path:
            return rewritten(root, kind, lambda ts: [change(t) if t[0] == name else t for t in ts])

        write.__name__, write.__doc__ = change.__name__, change.__doc__
        return KINDS.kind(error, name, *contains, action="shard", subject="model.safetensors")(
            write)

    return register


def _retyped(tensor: Tensor, dtype: str) -> Tensor:
    """``tensor`` stored as ``dtype`` (same shape, patterned bytes of the new size)."""
    name, _, shape, _ = tensor
    return name, dtype, shape, pattern(int(np.prod(shape)) * SIZES[dtype])


def _reshaped(tensor: Tensor, shape: list[int]) -> Tensor:
    """``tensor``'s bytes under another shape of as many elements."""
    name, dtype, old, data = tensor
    assert int(np.prod(old)) == int(np.prod(shape)), (old, shape)
    return name, dtype, shape, data


@_changed(DtypeMismatchError, ATTN.format(1) + "A_log", "BF16", "F32")
def kda_wrong_dtype(tensor: Tensor) -> Tensor:
    """Layer 1's A_log is BF16 while layer 0's (which the plan follows) is F32."""
    return _retyped(tensor, "BF16")


@_changed(DtypeMismatchError, ATTN.format(0) + "q_proj.weight", "I16")
def kda_integer_dtype(tensor: Tensor) -> Tensor:
    """The first KDA layer's q_proj is I16: not a floating-point dtype the plan can take."""
    return _retyped(tensor, "I16")


@_changed(ShapeMismatchError, ATTN.format(1) + "q_proj.weight", "[4, 64, 64]")
def kda_wrong_ndim(tensor: Tensor) -> Tensor:
    """Layer 1's q_proj [256, 64] stored 3-D as [heads, head_dim, hidden] = [4, 64, 64].

    (Extra unit axes, e.g. [256, 64, 1] or [1, 256, 64], hold the same bytes in the same order
    and are accepted by design, like the conv weights' [C, 1, K].)"""
    return _reshaped(tensor, [4, 64, 64])


@_changed(ShapeMismatchError, ATTN.format(1) + "o_proj.weight")
def kda_flattened(tensor: Tensor) -> Tensor:
    """Layer 1's o_proj [64, 256] stored flat as [16384]."""
    return _reshaped(tensor, [64 * 256])


@_changed(ShapeMismatchError, ATTN.format(0) + "f_a_proj.weight")
def kda_scalar_gate(tensor: Tensor) -> Tensor:
    """The first KDA layer's f_a_proj (read for the gate rank) is a 0-d tensor."""
    name, dtype, _, data = tensor
    return name, dtype, [], data[:2]


@_changed(ShapeMismatchError, ATTN.format(1) + "v_proj.weight", "[128, 64]")
def kda_wrong_size(tensor: Tensor) -> Tensor:
    """Layer 1's v_proj has 2 dimensions but half the rows."""
    name, dtype, _, data = tensor
    return name, dtype, [128, 64], data[: 128 * 64 * 2]


@_changed(DtypeMismatchError, ATTN.format(1) + "o_norm.weight", "F4")
def kda_sub_byte_dtype(tensor: Tensor) -> Tensor:
    """Layer 1's o_norm is packed F4: a KDA tensor must be BF16/F16/F32/F64 (a tensor outside
    the KDA layers may be F4; it is copied through, see tests/checkpoint/test_file_quirks.py)."""
    name, _, shape, _ = tensor
    return name, "F4", shape, pattern(int(np.prod(shape)) // 2)


@_changed(CheckpointError, ATTN.format(1) + "q_proj.weight",
          "has 65 axes, more than the 32 kda_tp reads")
def kda_too_many_axes(tensor: Tensor) -> Tensor:
    """Layer 1's q_proj [256, 64] with 63 unit axes appended (65 axes): the same bytes in the
    same order, which the plan would take (unit axes are accepted by design), but numpy holds
    at most 32 axes (numpy 1.x; 64 in numpy 2): refused at the header check, naming it."""
    name, dtype, shape, data = tensor
    return name, dtype, [*shape, *[1] * 63], data
