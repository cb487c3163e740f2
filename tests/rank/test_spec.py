"""The spec's own tests (tests/data/spec: tp.rs.txt invariants, tp_bind.rs.txt tests), run against
the Rust core through the Python API, with the spec's byte patterns."""

from __future__ import annotations

import copy
import importlib
import pickle

import kda_tp
import numpy as np
import pytest
from kda_tp import KdaShard, KdaTpPlan, shard_bytes
from kda_tp.checkpoint import checkpoint_suffix


def glm(rank: int) -> KdaTpPlan:
    """GLM-5.3's real KDA geometry at TP=2."""
    return KdaTpPlan(rank, 2, 4096, 128, 64, 4, 128)


def test_every_plan_entry_is_reachable_from_a_checkpoint_name():
    assert checkpoint_suffix("q_proj") == "q_proj.weight"
    assert checkpoint_suffix("q_conv1d") == "q_conv1d.weight"
    assert checkpoint_suffix("A_log") == "A_log"
    assert checkpoint_suffix("dt_bias") == "dt_bias"
    assert [t.name for t in glm(0).tensors] == [
        "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
        "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "A_log", "dt_bias", "o_norm", "o_proj",
    ]


def test_channel_rows_partition_the_tensor():
    # Smallest legal stand-in at TP=2: 4 heads x 64 (2 * 2 * 64 = 256).
    r0, r1 = (KdaTpPlan(r, 2, 4, 64, 4, 2, 4)["q_proj"] for r in (0, 1))
    assert r0.kind == KdaShard.CHANNEL_ROWS
    full = bytes(b for r in range(256) for b in [r] * 8)  # [256, 4] BF16, byte = row index
    a, b = bytes(shard_bytes(r0, full)), bytes(shard_bytes(r1, full))
    assert len(a) + len(b) == len(full)
    assert a + b == full
    assert max(a) < 128 <= min(b)


def test_o_proj_is_column_sliced_not_row_sliced():
    o = KdaTpPlan(1, 2, 4, 64, 4, 2, 4)["o_proj"]
    assert o.kind == KdaShard.CHANNEL_COLS
    assert (o.full_rows, o.full_row_elems, o.local_rows, o.local_row_elems) == (4, 256, 4, 128)
    full = bytes(b for _ in range(4) for c in range(256) for b in (c, 0))
    got = bytes(shard_bytes(o, full))
    assert got == bytes(b for _ in range(4) for c in range(128, 256) for b in (c, 0))
    row_sliced = full[len(full) // 2 :]
    assert len(row_sliced) == len(got) and row_sliced != got


def test_o_norm_and_the_low_rank_down_projections_are_replicated():
    plan = glm(1)
    for name in ["o_norm", "f_a_proj", "g_a_proj"]:
        t = plan[name]
        assert t.kind == KdaShard.REPLICATED, name
        full = b"\xab" * t.full_bytes
        assert bytes(shard_bytes(t, full)) == full, name


def test_a_log_and_dt_bias_shard_at_different_granularity():
    plan = glm(1)
    a, d = plan["A_log"], plan["dt_bias"]
    assert (a.full_rows, a.local_rows) == (64, 32)
    assert (d.full_rows, d.local_rows) == (8192, 4096)
    assert d.src_row_offset == a.src_row_offset * 128
    assert (a.elem_bytes, d.elem_bytes) == (4, 4)


def test_tp1_is_the_identity():
    plan = KdaTpPlan(0, 1, 4096, 128, 64, 4, 128)
    for t in plan.tensors:
        assert t.local_bytes == t.full_bytes, t.name
        full = b"\x5a" * t.full_bytes
        assert bytes(shard_bytes(t, full)) == full, t.name
    assert not plan.needs_output_all_reduce


def test_a_size_mismatch_is_refused():
    q = glm(0)["q_proj"]
    with pytest.raises(kda_tp.ShapeMismatchError, match=r"q_proj: buffer is 67108862 bytes.*implies 67108864 bytes"):
        shard_bytes(q, bytes(q.full_bytes - 2))


def test_local_shape_preserves_the_on_disk_rank():
    plan = glm(1)
    assert plan["q_conv1d"].local_shape([8192, 1, 4]) == (4096, 1, 4)
    assert plan["o_proj"].local_shape([4096, 8192]) == (4096, 4096)
    assert plan["o_norm"].local_shape([128]) == (128,)
    assert plan["A_log"].local_shape([1, 1, 64, 1]) == (1, 1, 32, 1)
    assert plan["A_log"].local_shape([64]) == (32,)
    with pytest.raises(kda_tp.ShapeMismatchError, match="A_log"):
        plan["A_log"].local_shape([2, 32])


def test_plan_totals_and_refusals():
    plan = glm(0)
    assert plan.local_heads == 32
    assert plan.full_bytes == 275_481_088 and plan.local_bytes == 138_789_248
    assert plan.needs_output_all_reduce
    assert plan.get("nope") is None
    with pytest.raises(KeyError):
        plan["nope"]
    assert KdaTpPlan(0, 4, 256, 64, 4, 4, 64, qk_multiple=1).local_heads == 1


@pytest.mark.parametrize("args, message", [
    ((2, 2, 4096, 128, 64, 4, 128), "tp_rank 2 >= tp_size 2"),
    ((0, 3, 4096, 128, 64, 4, 128), r"heads \(64\) divisible by tp_size \(3\)"),
    ((0, 2, 4096, 0, 64, 4, 128), "head_dim is 0"),
    ((0, 4, 256, 64, 4, 4, 64), r"qk_channels \(128\) must be a multiple of 256"),
    ((0, 2, -1, 128, 64, 4, 128), "hidden must be a non-negative integer"),
    ((0, 1, 2**62, 128, 64, 4, 128), "overflows"),
])
def test_bad_plan_arguments_are_refused_by_name(args, message):
    with pytest.raises(kda_tp.PlanError, match=message):
        KdaTpPlan(*args)


def test_dtype_overrides_change_element_sizes():
    plan = KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, dtypes={"q_conv1d": "F32", "A_log": "BF16"})
    assert (plan["q_conv1d"].dtype, plan["q_conv1d"].elem_bytes) == ("F32", 4)
    assert plan["q_conv1d"].local_bytes == 4096 * 4 * 4
    assert plan["A_log"].elem_bytes == 2
    with pytest.raises(kda_tp.PlanError, match="unknown KDA tensor"):
        KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, dtypes={"qproj": "F32"})
    with pytest.raises(kda_tp.PlanError, match="dtype I32 is not allowed for a KDA tensor"):
        KdaTpPlan(0, 2, 4096, 128, 64, 4, 128, dtypes={"q_proj": "I32"})


def test_column_gather_on_the_parallel_path_matches_numpy():
    o = glm(1)["o_proj"]  # [4096, 8192] BF16 -> columns 4096..8192, 32 MiB out
    full = np.random.default_rng(0).integers(0, 2**16, size=(4096, 8192), dtype=np.uint16)
    got = shard_bytes(o, full)
    assert np.array_equal(got.view(np.uint16).reshape(4096, 4096), full[:, 4096:])


def test_error_classes_are_importable_and_picklable():
    for cls in [kda_tp.PlanError, kda_tp.ShapeMismatchError, kda_tp.DtypeMismatchError,
                kda_tp.CheckpointError, kda_tp.OutputError]:
        assert issubclass(cls, kda_tp.KdaTpError)
        assert importlib.import_module(cls.__module__) is kda_tp.errors
        err = pickle.loads(pickle.dumps(cls("x: expected 1, got 2")))
        assert type(err) is cls and str(err) == "x: expected 1, got 2"
    assert issubclass(kda_tp.PlanError, ValueError)
    assert not issubclass(kda_tp.CheckpointError, ValueError)
    try:
        glm(5)
    except kda_tp.PlanError as e:  # raised from Rust, caught as the Python class
        assert type(e) is kda_tp.PlanError


def test_strided_buffers_are_copied_not_refused():
    q = kda_tp.KdaTpPlan(1, 2, 4, 64, 4, 2, 4)["q_proj"]
    full = np.arange(2 * q.full_bytes, dtype=np.uint32).astype(np.uint8)[::2]
    assert not full.flags.c_contiguous
    expected = full.tobytes()[q.full_bytes // 2 :]
    assert bytes(kda_tp.shard_bytes(q, full)) == expected
    assert bytes(kda_tp.shard_bytes(q, memoryview(full.copy())[::1])) == expected


def test_plans_pickle_and_copy():
    plan = kda_tp.KdaTpPlan(1, 2, 4096, 128, 64, 4, 128, qk_multiple=128, dtypes={"q_conv1d": "F32"})
    for other in (pickle.loads(pickle.dumps(plan)), copy.deepcopy(plan), copy.copy(plan)):
        assert type(other) is kda_tp.KdaTpPlan and other == plan
        assert other["q_conv1d"].dtype == "F32" and other.qk_multiple == 128


def test_a_plan_name_typo_lists_the_names():
    with pytest.raises(KeyError, match="expected one of q_proj, k_proj"):
        kda_tp.KdaTpPlan(0, 2, 4096, 128, 64, 4, 128)["o_proj.weight"]


def test_tp_size_zero_is_named():
    with pytest.raises(kda_tp.PlanError, match="tp_size is 0"):
        kda_tp.KdaTpPlan(0, 0, 4096, 128, 64, 4, 128)
