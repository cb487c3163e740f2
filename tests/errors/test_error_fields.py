"""Errors keep their fields: an exception raised by the Rust core carries the Rust error's
fields as attributes (rust/py.rs, documented in kda_tp.errors and docs/errors.md), with the
message unchanged; the bindings raise only classes of the KdaTpError hierarchy."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import _native
from kda_tp.errors import (
    BufferLayoutError,
    CheckpointError,
    KdaTpError,
    PlanError,
    ShapeMismatchError,
    UsageError,
)

PLAN_FIELDS = ("field", "tp_rank", "tp_size", "heads", "head_dim", "qk_multiple",
               "allowed_tp_sizes", "head_divisors", "tensor", "dtype")


def fields(error: BaseException, names: tuple[str, ...]) -> dict[str, object]:
    """The attributes of ``error`` that are not None."""
    return {n: getattr(error, n) for n in names if getattr(error, n) is not None}


def test_heads_not_divisible_carries_the_sizes_that_pass() -> None:
    with pytest.raises(PlanError) as info:
        kda_tp.KdaTpPlan(0, 3, 4096, 128, 64, 4, 128)
    assert str(info.value) == ("KDA TP requires heads (64) divisible by tp_size (3); tp_size may "
                               "be one of 1, 2, 4, 8, 16, 32, 64")
    assert fields(info.value, PLAN_FIELDS) == {
        "tp_size": 3, "heads": 64, "head_dim": 128, "qk_multiple": 256,
        "allowed_tp_sizes": (1, 2, 4, 8, 16, 32, 64), "head_divisors": (1, 2, 4, 8, 16, 32, 64),
    }


def test_the_qk_rule_carries_the_sizes_that_pass_with_and_without_it() -> None:
    # 4 heads of 64: TP=4 leaves a local q|k width of 128, not a multiple of 256.
    with pytest.raises(PlanError, match=r"local qk_channels \(128\) must be a multiple of 256") as info:
        kda_tp.KdaTpPlan(0, 4, 4, 64, 4, 2, 4)
    assert fields(info.value, PLAN_FIELDS) == {
        "tp_size": 4, "heads": 4, "head_dim": 64, "qk_multiple": 256,
        "allowed_tp_sizes": (1, 2), "head_divisors": (1, 2, 4),
    }
    with pytest.raises(PlanError) as info:
        kda_tp.KdaTpPlan(0, 1, 4, 8, 6, 2, 2, qk_multiple=2**64 - 1)
    assert info.value.allowed_tp_sizes == () and info.value.head_divisors == (1, 2, 3, 6)


def test_absurd_head_counts_list_no_sizes() -> None:
    with pytest.raises(PlanError, match="a divisor of the head count") as info:
        kda_tp.KdaTpPlan(0, 3, 1, 1, 2**62, 1, 1, qk_multiple=1)
    assert (info.value.tp_size, info.value.heads) == (3, 2**62)
    assert info.value.allowed_tp_sizes is None and info.value.head_divisors is None


def test_rank_out_of_range_carries_rank_and_size() -> None:
    with pytest.raises(PlanError) as info:
        kda_tp.KdaTpPlan(2, 2, 4096, 128, 64, 4, 128)
    assert str(info.value) == "tp_rank 2 >= tp_size 2"
    assert fields(info.value, PLAN_FIELDS) == {"tp_rank": 2, "tp_size": 2}


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        ((0, 1, 0, 128, 64, 4, 128), {}, "hidden"),
        ((True, 1, 4096, 128, 64, 4, 128), {}, "tp_rank"),
        ((0, 1, 4096, 128, 64, 4, -1), {}, "gate_rank"),
        ((0, 1, 4096, 128, 64, 4, 128), {"a_log_len": 3}, "a_log_len"),
        ((0, 1, 4096, 128, 64, 4, 128), {"quant_block": (0, 128)}, "block"),
        ((0, 1, 4096, 128, 64, 4, 128), {"quant_block": (2**17, 128)}, "block"),
        ((0, 1, 4096, 128, 64, 4, 128), {"quant_block": "x"}, "quant_block"),
        ((0, 1, 4096, 128, 64, 4, 128), {"quantized": ["q_proj"]}, "quantized"),
        ((0, 1, 4096, 128, 64, 4, 128), {"scale_layout": "x"}, "scale_layout"),
    ],
)
def test_a_refused_argument_is_named(args: tuple[int, ...], kwargs: dict[str, object],
                                     field: str) -> None:
    with pytest.raises(PlanError) as info:
        _native.KdaTpPlan(*args, **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field
    assert info.value.tp_size is None and info.value.allowed_tp_sizes is None


def test_a_refused_tensor_or_dtype_is_named() -> None:
    geometry = (0, 1, 4096, 128, 64, 4, 128)
    with pytest.raises(PlanError, match="unknown KDA tensor") as info:
        kda_tp.KdaTpPlan(*geometry, dtypes={"g_proj": "BF16"})
    assert fields(info.value, PLAN_FIELDS) == {"tensor": "g_proj"}
    with pytest.raises(PlanError, match="is not allowed for a KDA tensor") as info:
        kda_tp.KdaTpPlan(*geometry, dtypes={"A_log": "I32"})
    assert fields(info.value, PLAN_FIELDS) == {"tensor": "A_log", "dtype": "I32"}
    with pytest.raises(PlanError, match="unknown dtype") as info:
        kda_tp.KdaTpPlan(*geometry, dtypes={"A_log": "Q7"})
    assert fields(info.value, PLAN_FIELDS) == {"tensor": "A_log", "dtype": "Q7"}
    with pytest.raises(PlanError, match="never block-quantized") as info:
        kda_tp.KdaTpPlan(*geometry, quant_block=(128, 128), quantized=["A_log"])
    assert fields(info.value, PLAN_FIELDS) == {"tensor": "A_log"}


SHAPE_FIELDS = ("tensor", "expected_bytes", "actual_bytes", "expected_shape", "actual_shape")


def test_a_buffer_of_the_wrong_length_carries_both_lengths() -> None:
    q = kda_tp.KdaTpPlan(0, 2, 4, 64, 4, 2, 4)["q_proj"]
    with pytest.raises(ShapeMismatchError) as info:
        _native.shard_bytes(q, np.zeros(q.full_bytes - 2, np.uint8))
    assert str(info.value) == (f"q_proj: buffer is {q.full_bytes - 2} bytes, the plan's full "
                               f"shape [256, 4] x 2 bytes implies {q.full_bytes} bytes")
    assert fields(info.value, SHAPE_FIELDS) == {
        "tensor": "q_proj", "expected_bytes": q.full_bytes, "actual_bytes": q.full_bytes - 2}
    with pytest.raises(ShapeMismatchError) as info:
        _native.copy_into(np.zeros(8, np.uint8), np.zeros(6, np.uint8))
    assert fields(info.value, SHAPE_FIELDS) == {"expected_bytes": 8, "actual_bytes": 6}


def test_a_shape_that_cannot_hold_the_tensor_carries_both_shapes() -> None:
    a_log = kda_tp.KdaTpPlan(3, 8, 2304, 128, 32, 4, 128)["A_log"]
    with pytest.raises(ShapeMismatchError) as info:
        a_log.local_shape([2, 16])
    assert str(info.value) == ("A_log: on-disk shape [2, 16] does not match the plan; expected "
                               "32 elements as [32, 1] (e.g. [1, 1, 32, 1])")
    assert fields(info.value, SHAPE_FIELDS) == {
        "tensor": "A_log", "expected_shape": (1, 1, 32, 1), "actual_shape": (2, 16)}


def test_a_checkpoint_error_carries_the_path_and_tensor(tmp_path: Path) -> None:
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x09\x00\x00\x00\x00\x00\x00\x00{}")  # a 9-byte header in 2 bytes
    ok = tmp_path / "ok.safetensors"
    ok.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(CheckpointError, match="runs past the end") as info:
        _native.Checkpoint(bad)
    assert info.value.path == bad and info.value.tensor is None
    with pytest.raises(CheckpointError, match="no tensor named") as info:
        _native.Checkpoint(ok).read("w")
    assert (info.value.path, info.value.tensor) == (tmp_path, "w")  # the checkpoint's root


def test_the_bindings_raise_only_the_hierarchy(tmp_path: Path) -> None:
    strided = np.zeros(16, np.uint8)[::2]
    with pytest.raises(BufferLayoutError, match="the buffer must be C-contiguous"):
        _native.copy_into(strided, np.zeros(8, np.uint8))
    with pytest.raises(BufferLayoutError, match="the output buffer must be C-contiguous"):
        _native.copy_into(np.zeros(8, np.uint8), strided)
    path = tmp_path / "ok.safetensors"
    path.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(UsageError, match='backend must be "mmap" or "pread", got "x"'):
        _native.Checkpoint(path, "x")
    assert issubclass(BufferLayoutError, KdaTpError) and issubclass(UsageError, ValueError)


def test_fields_survive_pickling_and_default_to_none() -> None:
    with pytest.raises(PlanError) as info:
        kda_tp.KdaTpPlan(0, 3, 4096, 128, 64, 4, 128)
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.args == info.value.args
    assert fields(copy, PLAN_FIELDS) == fields(info.value, PLAN_FIELDS)
    # Raised from Python, the same classes have every attribute, None.
    assert fields(PlanError("no fields"), PLAN_FIELDS) == {}
    assert fields(ShapeMismatchError("no fields"), SHAPE_FIELDS) == {}
    assert CheckpointError("no fields").path is None
