"""kda_tp's cast (``kda_tp.model.dtypes.cast_to``, numpy alone) computes torch's bytes: what an
engine's loader leaves when it copies a checkpoint tensor into a parameter of another dtype
(``param.data.copy_(loaded_weight)`` in every vLLM and SGLang weight loader), for every pair of
dtypes the engines cast between, on the CPU.

Sources: every bit pattern of BF16, F16, F8_E4M3 and F8_E5M2; for F32 every pattern of its upper
16 bits at and around the BF16 tie, every F16 rounding boundary (normal, subnormal and overflow
ranges), NaN payloads of both signs and random patterns; for F64 the ties and their
double-rounding neighbours of random F32 values, values past F32's range and below its
subnormals, NaN payloads and random patterns. Targets: the model dtypes (BF16, F16, F32).
Compared with torch's contiguous ``copy_``, ``.to()`` and a ``copy_`` from a non-contiguous
source (a row-parallel weight narrowed on its columns): every non-NaN value byte for byte; a
NaN stays a NaN (its pattern is torch's code path's: ``kda_tp.model.dtypes``).
"""

from __future__ import annotations

import numpy as np
import pytest

from kda_tp.model.dtypes import cast_into, cast_to, numpy_dtype

torch = pytest.importorskip("torch")

SOURCES = ("F64", "F32", "BF16", "F16", "F8_E4M3", "F8_E5M2")
TARGETS = ("F32", "BF16", "F16")
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_TORCH = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
          "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _bits(values: np.ndarray | list[int], dtype: str) -> np.ndarray:
    return np.asarray(values, np.uint64).astype(_UINT[numpy_dtype(dtype).itemsize]).view(
        numpy_dtype(dtype))


def values(dtype: str) -> np.ndarray:
    """The test values of source ``dtype`` (flat)."""
    size = numpy_dtype(dtype).itemsize
    if size <= 2:
        return _bits(np.arange(1 << (8 * size)), dtype)
    rng = np.random.default_rng(0)
    if dtype == "F32":
        nans = [0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FA00000, 0x7F810000, 0x7FBFFFFF,
                *(0x7F800000 | (1 << b) for b in range(23))]
        parts = [nans, [n | 0x80000000 for n in nans],
                 [0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x80000001, 0x007FFFFF, 0x00800000,
                  0x7F7FFFFF, 0xFF7FFFFF]]
        high = np.arange(1 << 16, dtype=np.uint64) << np.uint64(16)
        parts += [high | np.uint64(low) for low in (0x7FFF, 0x8000, 0x8001)]
        grid = ((np.arange(100, 144, dtype=np.uint64) << np.uint64(23))[:, None]
                | (np.arange(1 << 10, dtype=np.uint64) << np.uint64(13))[None, :]).reshape(-1)
        parts += [grid | np.uint64(low) | np.uint64(sign) for low in (0x0FFF, 0x1000, 0x1001)
                  for sign in (0, 0x80000000)]
        parts.append(rng.integers(0, 1 << 32, 1 << 16, dtype=np.uint64))
        return _bits(np.concatenate([np.asarray(p, np.uint64) for p in parts]), dtype)
    # Random F32 values (and ones in F16's range), in F64; then BF16, F16 and F32 ties of them
    # (a half step below the kept bits, in F64's 52-bit mantissa: 2**44, 2**41, 2**28) and
    # their neighbours, where rounding once and rounding through F32 part.
    floats = rng.integers(0, 1 << 32, 1 << 15, dtype=np.uint64).astype(np.uint32).view(
        np.float32)
    halves = (rng.integers(100, 144, 1 << 15, dtype=np.uint64) << np.uint64(23)
              | rng.integers(0, 1 << 23, 1 << 15, dtype=np.uint64)).astype(np.uint32)
    wide = np.concatenate([floats[np.isfinite(floats)], halves.view(np.float32)]).astype(
        np.float64).view(np.uint64)
    parts = [[0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF,
              0x7FF4000000000000, 0x7FF0000020000000, 0x7FF0000000000000, 0xFFF0000000000000,
              0, 1 << 63, 1, 0x7FEFFFFFFFFFFFFF]]
    for step in (1 << 44, 1 << 41, 1 << 28):
        tie = (wide & ~np.uint64(2 * step - 1)) | np.uint64(step)
        offsets = (0, 1, 2, 1 << 28, (1 << 28) + 1, (1 << 28) - 1) if step > 1 << 28 else (0, 1, 2)
        parts += [tie + np.uint64(d) for d in offsets]
        parts += [tie - np.uint64(d) for d in offsets if d]
    parts.append(np.array([3.5e38, 3.4028235677973366e38, 1e-46, 7e-46, 65519.99, 65520.0,
                           1e300, -1e300]).view(np.uint64))
    parts.append(rng.integers(0, 1 << 63, 1 << 16, dtype=np.uint64))
    return _bits(np.concatenate([np.asarray(p, np.uint64) for p in parts]), dtype)


def torch_casts(source: np.ndarray, src: str, dst: str) -> dict[str, np.ndarray]:
    """torch's casts of ``source`` to ``dst`` on the CPU, as raw bits: ``copy_`` (contiguous),
    ``.to()``, and ``copy_`` from a non-contiguous view."""
    t = torch.from_numpy(source.view(np.uint8).copy()).view(getattr(torch, _TORCH[src]))
    target = getattr(torch, _TORCH[dst])
    wide = torch.stack([t, t], 1)  # column 0 is a strided view
    out = {"copy_": torch.empty(t.numel(), dtype=target).copy_(t), ".to()": t.to(target),
           "copy_ strided": torch.empty(t.numel(), dtype=target).copy_(wide[:, 0])}
    size = numpy_dtype(dst).itemsize
    return {k: v.contiguous().view(torch.uint8).numpy().view(_UINT[size]) for k, v in out.items()}


@pytest.mark.parametrize("src", SOURCES)
def test_kda_tps_cast_is_torchs_on_every_value(src):
    source = values(src)
    with np.errstate(invalid="ignore"):  # a NaN cast to F64 says so
        nan_in = np.isnan(source.astype(np.float64))
    for dst in TARGETS:
        if dst == src:
            continue
        ours = cast_to(source, dst)
        into = np.empty(source.size, numpy_dtype(dst))
        cast_into(into, source)
        ours_bits = ours.view(_UINT[ours.dtype.itemsize])
        assert np.array_equal(into.view(ours_bits.dtype), ours_bits, equal_nan=False)
        with np.errstate(invalid="ignore"):
            nan_out = np.isnan(ours.astype(np.float32))
        assert np.array_equal(nan_out, nan_in), (src, dst)
        for path, theirs in torch_casts(source, src, dst).items():
            differ = (ours_bits != theirs) & ~nan_in
            assert not differ.any(), (
                f"{src} -> {dst} ({path}): {int(differ.sum())} values differ, e.g. "
                f"{source[differ][:3]!r}: kda_tp {ours_bits[differ][:3]}, torch "
                f"{theirs[differ][:3]}")
            with np.errstate(invalid="ignore"):
                theirs_nan = np.isnan(theirs.view(numpy_dtype(dst)).astype(np.float32))
            assert np.array_equal(theirs_nan, nan_in), (src, dst, path)


def test_f64_rounds_through_f32_as_torch_does_where_rounding_once_differs():
    # 0xc131efffffffffff is just below a BF16 tie; F32 rounds it onto the tie, which rounds to
    # even (up in magnitude): torch's 0xc990, where rounding once gives 0xc98f.
    value = _bits([0xC131EFFFFFFFFFFF], "F64")
    assert int(cast_to(value, "BF16").view(np.uint16)[0]) == 0xC990
    assert int(torch.from_numpy(value.copy()).to(torch.bfloat16).view(torch.int16)[0]
               ) & 0xFFFF == 0xC990
    assert int(value.astype(numpy_dtype("BF16")).view(np.uint16)[0]) == 0xC98F
