"""Dtype facts, written once: every safetensors dtype name kda_tp knows, its size, its numpy
(or ``ml_dtypes``) type and its torch name, the spellings engines and configs use for them,
and how a serving engine casts between the float dtypes (:func:`cast_to`).

The cast is the engines' own. vLLM's and SGLang's weight loaders copy a checkpoint tensor into
a parameter of another dtype with torch's ``param.data.copy_(loaded_weight)``
(``default_weight_loader``, ``sharded_weight_loader``, the linear layers' ``weight_loader``,
the KDA conv and ``A_log`` loaders), and torch rounds to nearest even through F32:
``c10::BFloat16`` and ``c10::Half`` have only a ``float`` constructor
(``torch/headeronly/util/BFloat16.h``, ``Half.h``, on the CPU and on CUDA alike), so an F64
value is first rounded to F32, then to BF16 or F16 (two roundings; numpy and ``ml_dtypes``
round once, and disagree with torch on about 1 in 270 F64 values near a tie). :func:`cast_to`
computes torch's bytes with numpy alone, proven equal to torch's ``copy_`` and ``.to()`` on
the CPU for every pair of float dtypes the engines cast between
(``tests/integration/test_casts.py``, exhaustively for the 8- and 16-bit sources).

A NaN has no one pattern after the engine's cast: torch on the CPU writes ``0xFFFF`` for any
F32 NaN cast to BF16 in its vectorised kernel (AVX2, AVX-512) and ``0x7FC0`` in its scalar
one (a non-contiguous source such as a row-parallel weight narrowed on its columns, an F16 or
FP8 source, a small F64 tensor, a CPU without AVX2), keeps the payload in F16 (F16C), and CUDA
writes ``0x7FFF``; a blocking ``copy_`` from a CPU tensor into a CUDA parameter converts on the
CPU (``aten/src/ATen/native/cuda/Copy.cu``, ``copy_kernel_cuda``), which is how both engines
load a checkpoint. So kda_tp writes numpy's NaN, compares a NaN as matching any NaN
(:func:`kda_tp.checkpoint.values.same_values`), and refuses to promise a digest of a cast NaN
(``kda_tp.audit._diagnosis.cast_nan``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from ..errors import DtypeMismatchError, MissingDependencyError, ShapeMismatchError

__all__ = [
    "AUDITED_DTYPES",
    "DTYPE_BITS",
    "DTYPE_SIZES",
    "FLOAT_DTYPES",
    "FP8_DTYPES",
    "MODEL_DTYPES",
    "SPELLINGS",
    "TORCH_MISSING",
    "TORCH_NAMES",
    "cast_into",
    "cast_to",
    "import_torch",
    "numpy_dtype",
    "tensor_nbytes",
    "torch_dtype",
]

#: Bits per element of every safetensors dtype: the whole-byte dtypes and the packed sub-byte
#: floats of the MX formats (F4: 4 bits, F6_E2M3 and F6_E3M2: 6 bits), whose tensors are stored
#: as packed bits without padding.
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8, "U16": 16, "I16": 16, "F16": 16, "BF16": 16, "U32": 32, "I32": 32,
    "F32": 32, "U64": 64, "I64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
}
#: Bytes per element of every whole-byte safetensors dtype.
DTYPE_SIZES: dict[str, int] = {d: bits // 8 for d, bits in DTYPE_BITS.items() if bits % 8 == 0}
#: The float dtypes a KDA tensor may have unquantized (the Rust plan's rule), and that an
#: engine casts between.
FLOAT_DTYPES = ("BF16", "F16", "F32", "F64")
#: The FP8 dtypes of block-quantized projections (and the scale-less FP8 an engine holds).
FP8_DTYPES = ("F8_E4M3", "F8_E5M2")
#: The model dtypes an engine runs in.
MODEL_DTYPES = ("BF16", "F16", "F32")
#: The dtypes an engine's parameter may have in an audit, a dump or a digest.
AUDITED_DTYPES = (*FLOAT_DTYPES, *FP8_DTYPES, "I64", "I32", "I16", "I8", "U8", "BOOL")
#: The float dtypes as torch, numpy, the configs (``dtype``, ``torch_dtype``) and the engines'
#: ``--dtype`` spell them (lower case, without ``torch.``: vLLM's
#: ``_STR_DTYPE_TO_TORCH_DTYPE``), by safetensors name.
SPELLINGS: dict[str, str] = {
    "bfloat16": "BF16", "float16": "F16", "half": "F16", "float32": "F32", "float": "F32",
    "float64": "F64", "double": "F64",
}

# The numpy type of each dtype numpy has itself, and the ml_dtypes attribute of the others:
# ml_dtypes takes longer to import than numpy, so it is imported for the first such array.
_NUMPY = {"BOOL": "bool_", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
          "F16": "float16", "I32": "int32", "U32": "uint32", "F32": "float32",
          "F64": "float64", "I64": "int64", "U64": "uint64", "C64": "complex64"}
_ML_DTYPES = {"BF16": "bfloat16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
#: torch's name (its attribute, and a config's ``torch_dtype``) of each dtype torch has
#: (torch >= 2.5).
TORCH_NAMES = {**_NUMPY, "BOOL": "bool", **_ML_DTYPES}
_TYPES: dict[str, np.dtype] = {}

if TYPE_CHECKING:
    import numpy as np

#: What a call needing torch says when it is not installed.
TORCH_MISSING = ("kda_tp.torch needs PyTorch (torch >= 2.5), which is not installed: "
                 "pip install 'kda_tp[torch]' (from a source checkout: pip install '.[torch]')")


def numpy_dtype(dtype: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (BF16 and FP8 through ``ml_dtypes``).

    Raises:
        DtypeMismatchError: a dtype with no numpy equivalent (packed 4- and 6-bit floats).
    """
    known = _TYPES.get(dtype)
    if known is not None:
        return known
    import numpy as np  # noqa: PLC0415 - start-up time: the command line imports these facts

    if dtype in _ML_DTYPES:
        import ml_dtypes  # noqa: PLC0415 - start-up time (see _ML_DTYPES)

        found: np.dtype = np.dtype(getattr(ml_dtypes, _ML_DTYPES[dtype]))
    elif dtype in _NUMPY:
        found = np.dtype(getattr(np, _NUMPY[dtype]))
    else:
        raise DtypeMismatchError(f"dtype {dtype} has no numpy equivalent")
    _TYPES[dtype] = found
    return found


def import_torch() -> Any:
    """``torch``, imported on first use (the optional ``torch`` extra).

    Raises:
        MissingDependencyError: torch is not installed (:data:`TORCH_MISSING`).
    """
    try:
        import torch  # noqa: PLC0415 - optional dependency, imported on first use
    except ImportError as e:
        raise MissingDependencyError(TORCH_MISSING) from e
    return torch


def torch_dtype(dtype: str) -> Any:
    """The ``torch.dtype`` of a safetensors dtype name (``"BF16"`` -> ``torch.bfloat16``,
    ``"F8_E4M3"`` -> ``torch.float8_e4m3fn``, ``"F8_E5M2"`` -> ``torch.float8_e5m2``).

    Raises:
        MissingDependencyError: torch is not installed (``pip install 'kda_tp[torch]'``).
        DtypeMismatchError: a dtype torch has no equivalent for (packed 4- and 6-bit floats,
            ``F8_E8M0``).
    """
    found = getattr(import_torch(), TORCH_NAMES.get(dtype, ""), None)
    if found is None:
        raise DtypeMismatchError(f"dtype {dtype} has no torch equivalent")
    return found


def tensor_nbytes(dtype: str, shape: Iterable[int]) -> int:
    """The data size in bytes of a tensor of ``dtype`` and ``shape`` (elements).

    Raises:
        DtypeMismatchError: ``dtype`` is not a safetensors dtype (:data:`DTYPE_BITS`).
        ShapeMismatchError: a negative or non-integer dimension, or a sub-byte tensor whose
            bits do not fill a whole number of bytes (e.g. 3 F4 elements).
    """
    import numpy as np  # noqa: PLC0415 - start-up time

    bits = DTYPE_BITS.get(dtype)
    if bits is None:
        raise DtypeMismatchError(
            f"dtype {dtype!r} is not a safetensors dtype (expected one of {', '.join(DTYPE_BITS)})"
        )
    dims = tuple(shape)
    if not all(
        isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims
    ):
        raise ShapeMismatchError(f"shape {list(dims)} has a negative or non-int size")
    total_bits = int(np.prod(dims, dtype=object)) * bits
    if total_bits % 8:
        raise ShapeMismatchError(
            f"shape {list(dims)} of {dtype} is {total_bits} bits, not a whole number of bytes"
        )
    return total_bits // 8


def cast_to(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` (a numpy array of a float or FP8 dtype) in safetensors dtype ``dtype``, with
    the bytes a serving engine's loader leaves (torch's ``copy_``: round to nearest even, an F64
    value through F32; see the module's text); ``values`` itself when already of it. A value
    too large becomes an infinity (no warning: ``kda_tp.audit._diagnosis.cast_overflow``
    names it); a NaN stays a NaN (numpy's pattern: see the module's text).

    Raises:
        DtypeMismatchError: ``dtype`` has no numpy equivalent.
    """
    import numpy as np  # noqa: PLC0415 - start-up time

    target = numpy_dtype(dtype)
    if values.dtype == target:
        return values
    with np.errstate(over="ignore", invalid="ignore"):
        out: np.ndarray = _through_f32(values, target).astype(target)
    return out


def cast_into(out: np.ndarray, values: np.ndarray) -> None:
    """Write ``values`` cast as :func:`cast_to` casts (torch's rounding) into ``out`` (a
    writable array of the target dtype and ``values``' size)."""
    import numpy as np  # noqa: PLC0415 - start-up time

    with np.errstate(over="ignore", invalid="ignore"):
        np.copyto(out, _through_f32(values, out.dtype).reshape(out.shape), casting="unsafe")


def _through_f32(values: np.ndarray, target: np.dtype) -> np.ndarray:
    """``values`` rounded to F32 first where torch's cast to ``target`` goes through it (an F64
    float to a 16- or 8-bit float: ``c10::BFloat16``/``c10::Half`` take a ``float``)."""
    if values.dtype.itemsize == 8 and values.dtype.kind == "f" and target.itemsize < 4:
        import numpy as np  # noqa: PLC0415 - start-up time

        return values.astype(np.float32)  # within the caller's errstate
    return values
