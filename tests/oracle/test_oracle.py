"""Tests of the pure-Python oracle (``kda_tp.oracle``) on its own; no Rust build needed.

The first group ports the tests of ``tests/data/spec/tp_bind.rs.txt``; the second checks each
invariant and refusal stated in ``tests/data/spec/tp.rs.txt``; then real geometries (GLM-5.3-Flash,
Kimi-Linear-48B), the ``kda_small`` fixture's independent slice manifest, and the checkpoint
verifier.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from kda_tp import oracle
from kda_tp.errors import PlanError, ShapeMismatchError

from checkpoint_files import (
    kimi_config,
    narrow,
    read_checkpoint_tensors,
    read_safetensors,
    write_checkpoint,
)
from paths import DATA


FIXTURE = DATA / "kda_small"


def glm(rank: int) -> oracle.OraclePlan:
    """GLM-5.3-Flash's KDA geometry at TP=2 (the spec's ``plan(rank)``)."""
    return oracle.plan(rank, 2, 4096, 128, 64, 4, 128)


def rows(t: oracle.OracleTensor) -> tuple[int, int, int, int]:
    """A tensor's (full rows, elements a full row, local rows, elements a local row)."""
    return t.full_rows, t.full_row_elems, t.local_rows, t.local_row_elems


def smallest(rank: int) -> oracle.OraclePlan:
    """The smallest geometry the 256-channel rule allows at TP=2: 4 heads of 64, hidden 4."""
    return oracle.plan(rank, 2, 4, 64, 4, 2, 4)


# --- tests/data/spec/tp_bind.rs.txt tests ----------------------------------------------------


def test_plan_names_strip_the_prefix_but_not_a_missing_suffix():
    assert oracle.plan_name("self_attn.q_proj.weight") == "q_proj"
    assert oracle.plan_name("self_attn.q_conv1d.weight") == "q_conv1d"
    assert oracle.plan_name("self_attn.A_log") == "A_log"
    assert oracle.plan_name("self_attn.dt_bias") == "dt_bias"
    for t in glm(0).tensors:
        candidates = [f"self_attn.{t.name}.weight", f"self_attn.{t.name}"]
        assert any(oracle.plan_name(c) == t.name for c in candidates), t.name


def test_channel_rows_partition_the_tensor():
    q = smallest(0).get("q_proj")
    assert q.kind == "CHANNEL_ROWS"
    # [256 channels, hidden 4] BF16: every byte of row r is r.
    full = b"".join(bytes([r]) * 8 for r in range(256))
    q1 = replace(q, src_row_offset=q.local_rows)
    assert q1 == smallest(1).get("q_proj"), "rank 1's entry is rank 0's shifted by local_rows"

    r0, r1 = oracle.shard_bytes(q, full), oracle.shard_bytes(q1, full)
    assert len(r0) + len(r1) == len(full)
    assert r0 + r1 == full, "the two ranks rejoin to the original, in order"
    assert all(b < 128 for b in r0), "rank 0 keeps the low rows"
    assert all(b >= 128 for b in r1), "rank 1 keeps the high rows"


def test_o_proj_is_column_sliced_not_row_sliced():
    o = smallest(1).get("o_proj")
    assert o.kind == "CHANNEL_COLS"
    assert rows(o) == (4, 256, 4, 128)

    # [4, 256] BF16 whose element (row, c) has low byte c.
    full = b"".join(bytes([c, 0]) for _ in range(4) for c in range(256))
    got = oracle.shard_bytes(o, full)
    want = b"".join(bytes([c, 0]) for _ in range(4) for c in range(128, 256))
    assert got == want, "rank 1 keeps columns 128..256 of every row"

    row_sliced = full[len(full) // 2 :]
    assert len(row_sliced) == len(got), "a row slice has the same size ..."
    assert row_sliced != got, "... and different bytes"


def test_o_norm_and_the_low_rank_down_projections_are_replicated():
    p = glm(1)
    for name in ("o_norm", "f_a_proj", "g_a_proj"):
        t = p.get(name)
        assert t.kind == "REPLICATED", name
        full = b"\xab" * t.full_bytes
        assert oracle.shard_bytes(t, full) == full, name
    assert p.get("o_norm").full_bytes == 256


def test_a_log_and_dt_bias_shard_at_different_granularity():
    p = glm(1)
    a, d = p.get("A_log"), p.get("dt_bias")
    assert (a.kind, a.full_rows, a.local_rows) == ("HEAD_ROWS", 64, 32)
    assert (d.kind, d.full_rows, d.local_rows) == ("CHANNEL_ROWS", 8192, 4096)
    assert (a.src_row_offset, d.src_row_offset) == (32, 4096)
    assert d.src_row_offset == a.src_row_offset * 128


def test_tp1_is_the_identity():
    p = oracle.plan(0, 1, 4096, 128, 64, 4, 128)
    for t in p.tensors:
        assert t.local_bytes == t.full_bytes, t.name
        assert (t.src_row_offset, t.src_col_offset) == (0, 0), t.name
        full = b"\x5a" * t.full_bytes
        assert oracle.shard_bytes(t, full) == full, t.name
    assert p.needs_output_all_reduce is False


def test_a_size_mismatch_is_refused():
    q = glm(0).get("q_proj")
    with pytest.raises(ShapeMismatchError) as err:
        oracle.shard_bytes(q, bytes(q.full_bytes - 2))
    message = str(err.value)
    assert "q_proj" in message
    assert "67108862" in message and "67108864" in message
    with pytest.raises(ShapeMismatchError):
        oracle.shard_bytes(q, bytes(q.full_bytes + 2))


def test_local_shape_preserves_the_on_disk_rank():
    p = glm(1)
    assert oracle.local_shape(p.get("q_conv1d"), (8192, 1, 4)) == (4096, 1, 4)
    assert oracle.local_shape(p.get("o_proj"), (4096, 8192)) == (4096, 4096)
    assert oracle.local_shape(p.get("o_norm"), (128,)) == (128,)


def test_the_verifier_sees_local_slices_and_passed_through_tensors(tmp_path):
    """Port of the adapter test: a KDA tensor becomes this rank's slice with a local shape; a
    non-KDA tensor (``input_layernorm``) passes through untouched; the census is unchanged."""
    p = smallest(1)
    q_full = b"".join(bytes([r]) * 8 for r in range(256))
    norm = b"\xee" * 8
    src = tmp_path / "src"
    write_checkpoint(
        src,
        kimi_config(hidden=4, head_dim=64, heads=4, conv=2, kda_layers=[1]),
        {
            "model.layers.0.self_attn.q_proj.weight": ("BF16", (256, 4), q_full),
            "model.layers.0.self_attn.f_a_proj.weight": ("BF16", (4, 4), bytes(32)),
            "model.layers.0.input_layernorm.weight": ("BF16", (4,), norm),
        },
    )
    out = tmp_path / "out"
    for rank in range(2):
        write_checkpoint(
            out / f"rank{rank}",
            kimi_config(hidden=4, head_dim=64, heads=4, conv=2, kda_layers=[1]),
            {
                "model.layers.0.self_attn.q_proj.weight": (
                    "BF16",
                    (128, 4),
                    q_full[rank * 1024 : (rank + 1) * 1024],
                ),
                "model.layers.0.self_attn.f_a_proj.weight": ("BF16", (4, 4), bytes(32)),
                "model.layers.0.input_layernorm.weight": ("BF16", (4,), norm),
            },
            metadata={"tp_rank": str(rank), "tp_size": "2"},
        )
    assert oracle.verify(src, out) == []
    rank1 = dict(read_checkpoint_tensors(out / "rank1"))
    _, shape, data = rank1["model.layers.0.self_attn.q_proj.weight"]
    assert shape == oracle.local_shape(p.get("q_proj"), (256, 4)) == (128, 4)
    assert len(data) == p.get("q_proj").local_bytes
    assert all(b >= 128 for b in data), "rank 1 keeps the high rows"
    assert rank1["model.layers.0.input_layernorm.weight"][2] == norm
    assert len(rank1) == 3, "the census still sees everything"


# --- tests/data/spec/tp.rs.txt invariants and refusals ----------------------------------------


@pytest.mark.parametrize(
    ("args", "kwargs", "needle"),
    [
        ((2, 2, 4096, 128, 64, 4, 128), {}, "tp_rank 2"),
        ((5, 4, 4096, 128, 64, 4, 128), {}, "tp_rank 5"),
        ((0, 0, 4096, 128, 64, 4, 128), {}, "tp_size 0"),
        ((0, 2, 0, 128, 64, 4, 128), {}, "hidden"),
        ((0, 2, 4096, 0, 64, 4, 128), {}, "head_dim"),
        ((0, 2, 4096, 128, 0, 4, 128), {}, "full_heads"),
        ((0, 2, 4096, 128, 64, 0, 128), {}, "conv_kernel"),
        ((0, 2, 4096, 128, 64, 4, 0), {}, "gate_rank"),
        ((0, 2, 4096, 128, 64, 4, 128), {"qk_multiple": 0}, "qk_multiple"),
        ((0, 4, 4096, 128, 6, 4, 128), {}, "heads (6) divisible by tp_size (4)"),
        ((0, 4, 256, 64, 4, 4, 64), {}, "128"),
        ((0, 2, 4096, 128, 64, 4, 128), {"dtypes": {"q": "BF16"}}, "'q'"),
        ((0, 2, 4096, 128, 64, 4, 128), {"dtypes": {"q_proj": "I32"}}, "'I32'"),
        ((0, 2, 4096, 128, 64, 4, 128), {"dtypes": {"q_proj": "bf16"}}, "'bf16'"),
        ((0, 1, 2**62, 128, 64, 4, 128), {}, "too large"),
        ((0, 1, 4, 2**40, 2**40, 1, 1), {"qk_multiple": 1}, "too large"),
    ],
)
def test_refused_geometry(args, kwargs, needle):
    with pytest.raises(PlanError) as err:
        oracle.plan(*args, **kwargs)
    assert needle in str(err.value)


def test_byte_size_limit_is_per_tensor_and_per_block():
    # q_proj = 2^21 channels x 2^41 hidden x 2 bytes = 2^63 bytes: one tensor too many.
    with pytest.raises(PlanError, match="q_proj"):
        oracle.plan(0, 1, 2**41, 128, 2**14, 1, 1)
    # Halve hidden: q/k/v_proj and o_proj are 2^62 bytes each, legal one by one, but the block
    # (over 4 x 2^62 bytes) is not.
    with pytest.raises(PlanError, match="block"):
        oracle.plan(0, 1, 2**40, 128, 2**14, 1, 1)
    # A large but representable block is planned with exact integer sizes.
    p = oracle.plan(1, 2, 2**30, 128, 2**10, 1, 1)
    assert p.get("q_proj").full_bytes == 2**17 * 2**30 * 2
    assert p.get("o_proj").local_bytes == 2**30 * 2**16 * 2
    assert p.get("o_proj").src_col_offset == 2**16


def test_qk_multiple_sets_the_local_width_rule():
    # heads 4, head_dim 64, TP 4: local q|k width 2 * 1 * 64 = 128.
    with pytest.raises(PlanError):
        oracle.plan(0, 4, 256, 64, 4, 4, 64)
    assert oracle.plan(0, 4, 256, 64, 4, 4, 64, qk_multiple=128).qk_multiple == 128
    loose = oracle.plan(3, 4, 256, 64, 4, 4, 64, qk_multiple=1)
    assert (loose.local_heads, loose.qk_multiple) == (1, 1)
    # The rule is on the LOCAL width: TP 2 of the same block gives 256 and passes by default.
    assert oracle.plan(1, 2, 256, 64, 4, 4, 64).qk_multiple == 256


def test_tensors_come_in_spec_order_with_their_kinds_and_default_dtypes():
    p = glm(0)
    assert [t.name for t in p.tensors] == list(oracle.TENSOR_NAMES) == [
        "q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_a_proj",
        "f_b_proj", "g_a_proj", "g_b_proj", "b_proj", "A_log", "dt_bias", "o_norm", "o_proj",
    ]  # fmt: skip
    kinds = {t.name: t.kind for t in p.tensors}
    assert kinds == {
        "q_proj": "CHANNEL_ROWS", "k_proj": "CHANNEL_ROWS", "v_proj": "CHANNEL_ROWS",
        "q_conv1d": "CHANNEL_ROWS", "k_conv1d": "CHANNEL_ROWS", "v_conv1d": "CHANNEL_ROWS",
        "f_a_proj": "REPLICATED", "f_b_proj": "CHANNEL_ROWS", "g_a_proj": "REPLICATED",
        "g_b_proj": "CHANNEL_ROWS", "b_proj": "HEAD_ROWS", "A_log": "HEAD_ROWS",
        "dt_bias": "CHANNEL_ROWS", "o_norm": "REPLICATED", "o_proj": "CHANNEL_COLS",
    }  # fmt: skip
    dtypes = {t.name: (t.dtype, t.elem_bytes) for t in p.tensors}
    for name, got in dtypes.items():
        assert got == (("F32", 4) if name in ("A_log", "dt_bias") else ("BF16", 2)), name
    assert p.get("nope") is None


def test_dtype_overrides_change_element_and_byte_sizes():
    p = oracle.plan(
        1, 2, 8, 64, 4, 3, 2, dtypes={"q_conv1d": "F32", "o_norm": "F64", "A_log": "F16"}
    )
    conv, norm, a_log = p.get("q_conv1d"), p.get("o_norm"), p.get("A_log")
    assert (conv.dtype, conv.elem_bytes, conv.full_bytes, conv.local_bytes) == (
        "F32",
        4,
        3072,
        1536,
    )
    assert (norm.dtype, norm.elem_bytes, norm.full_bytes) == ("F64", 8, 512)
    assert (a_log.dtype, a_log.elem_bytes, a_log.local_bytes) == ("F16", 2, 4)
    assert p.get("k_conv1d").dtype == "BF16", "only the named tensors change"


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_sharded_tensors_split_into_equal_contiguous_ranges_ordered_by_rank(tp_size):
    plans = [oracle.plan(r, tp_size, 16, 32, 8, 3, 5, qk_multiple=1) for r in range(tp_size)]
    for i, name in enumerate(oracle.TENSOR_NAMES):
        entries = [p.tensors[i] for p in plans]
        assert all(e.name == name for e in entries)
        kind = entries[0].kind
        if kind == "REPLICATED":
            assert all(e == entries[0] for e in entries), name
            continue
        for rank, e in enumerate(entries):
            if kind == "CHANNEL_COLS":
                assert (e.local_rows, e.src_row_offset) == (e.full_rows, 0), name
                assert e.local_row_elems * tp_size == e.full_row_elems, name
                assert e.src_col_offset == rank * e.local_row_elems, name
            else:
                assert (e.local_row_elems, e.src_col_offset) == (e.full_row_elems, 0), name
                assert e.local_rows * tp_size == e.full_rows, name
                assert e.src_row_offset == rank * e.local_rows, name


def test_each_rank_owns_a_contiguous_head_range_in_every_tensor():
    head_dim = 32
    for rank in range(4):
        p = oracle.plan(rank, 4, 16, head_dim, 8, 3, 5, qk_multiple=1)
        first_head = p.get("b_proj").src_row_offset
        assert (first_head, p.local_heads) == (rank * 2, 2)
        assert p.get("A_log").src_row_offset == first_head
        for name in ("q_proj", "k_proj", "v_proj", "q_conv1d", "f_b_proj", "g_b_proj", "dt_bias"):
            assert p.get(name).src_row_offset == first_head * head_dim, name
            assert p.get(name).local_rows == p.local_heads * head_dim, name
        assert p.get("o_proj").src_col_offset == first_head * head_dim


def test_all_reduce_follows_o_proj_only_when_split():
    assert oracle.plan(0, 1, 4, 64, 4, 2, 4).needs_output_all_reduce is False
    assert smallest(0).needs_output_all_reduce is True
    assert smallest(1).needs_output_all_reduce is True


# --- real geometries --------------------------------------------------------------------------


@pytest.mark.parametrize("rank", [0, 1])
def test_glm_5_3_flash_at_tp2(rank):
    p = glm(rank)
    assert (p.tp_rank, p.tp_size, p.hidden, p.head_dim) == (rank, 2, 4096, 128)
    assert (p.full_heads, p.local_heads, p.conv_kernel, p.gate_rank) == (64, 32, 4, 128)
    assert p.qk_multiple == 256
    q = p.get("q_proj")
    assert rows(q) == (8192, 4096, 4096, 4096)
    assert q.src_row_offset == 4096 * rank
    assert (q.full_bytes, q.local_bytes) == (67108864, 33554432)
    b = p.get("b_proj")
    assert (b.full_rows, b.local_rows, b.src_row_offset) == (64, 32, 32 * rank)
    o = p.get("o_proj")
    assert rows(o) == (4096, 8192, 4096, 4096)
    assert (o.src_row_offset, o.src_col_offset) == (0, 4096 * rank)
    assert p.get("f_a_proj").full_bytes == p.get("f_a_proj").local_bytes == 1048576
    assert p.get("q_conv1d").local_bytes == 32768
    assert p.full_bytes == 275481088
    assert p.local_bytes == 138789248
    assert p.needs_output_all_reduce is True


def test_kimi_linear_48b_at_tp8_rank3():
    p = oracle.plan(3, 8, 2304, 128, 32, 4, 128)
    assert p.local_heads == 4
    shapes = {t.name: (t.disk_shape, oracle.local_shape(t, t.disk_shape)) for t in p.tensors}
    assert shapes == {
        "q_proj": ((4096, 2304), (512, 2304)),
        "k_proj": ((4096, 2304), (512, 2304)),
        "v_proj": ((4096, 2304), (512, 2304)),
        "q_conv1d": ((4096, 1, 4), (512, 1, 4)),
        "k_conv1d": ((4096, 1, 4), (512, 1, 4)),
        "v_conv1d": ((4096, 1, 4), (512, 1, 4)),
        "f_a_proj": ((128, 2304), (128, 2304)),
        "f_b_proj": ((4096, 128), (512, 128)),
        "g_a_proj": ((128, 2304), (128, 2304)),
        "g_b_proj": ((4096, 128), (512, 128)),
        "b_proj": ((32, 2304), (4, 2304)),
        "A_log": ((1, 1, 32, 1), (1, 1, 4, 1)),
        "dt_bias": ((4096,), (512,)),
        "o_norm": ((128,), (128,)),
        "o_proj": ((2304, 4096), (2304, 512)),
    }
    assert p.get("A_log").src_row_offset == 12
    assert p.get("dt_bias").src_row_offset == 1536
    assert p.get("o_proj").src_col_offset == 1536
    # 39,514,272 parameters per KDA layer: the published count (kda_in_the_field.md §1.3).
    assert sum(t.full_rows * t.full_row_elems for t in p.tensors) == 39514272
    assert p.full_bytes == 79036800
    assert p.local_bytes == 10912016


def test_kimi_linear_accepts_every_head_divisor_and_no_other_tp_size():
    legal = [t for t in range(1, 65) if _plans(2304, 128, 32, 4, 128, t)]
    assert legal == [1, 2, 4, 8, 16, 32]


def _plans(hidden, head_dim, heads, conv, gate, tp_size):
    try:
        oracle.plan(0, tp_size, hidden, head_dim, heads, conv, gate)
    except PlanError:
        return False
    return True


# --- local_shape ------------------------------------------------------------------------------


def test_local_shape_accepts_the_alternative_layouts():
    p = oracle.plan(3, 8, 2304, 128, 32, 4, 128)
    assert oracle.local_shape(p.get("A_log"), (32,)) == (4,)
    assert oracle.local_shape(p.get("A_log"), [32, 1]) == (4, 1)
    assert oracle.local_shape(p.get("q_conv1d"), (4096, 4)) == (512, 4)
    assert oracle.local_shape(p.get("dt_bias"), (1, 4096)) == (1, 512)
    assert oracle.local_shape(p.get("q_proj"), (1, 4096, 2304)) == (1, 512, 2304)
    assert oracle.local_shape(p.get("o_proj"), (1, 2304, 4096)) == (1, 2304, 512)
    assert oracle.local_shape(p.get("f_a_proj"), (128, 1, 2304)) == (128, 1, 2304)


@pytest.mark.parametrize(
    ("name", "shape"),
    [
        ("q_proj", (2304, 4096)),  # transposed: right element count, wrong sharded axis
        ("q_proj", (4096, 2305)),
        ("o_proj", (4096, 2304)),  # transposed row-parallel weight
        ("A_log", (1, 32, 1, 2)),
        ("A_log", (2, 16)),
        ("q_conv1d", (4, 4096)),
        ("o_norm", (64,)),
        ("dt_bias", ()),
    ],
)
def test_local_shape_refuses_a_shape_that_does_not_hold_the_tensor(name, shape):
    t = oracle.plan(3, 8, 2304, 128, 32, 4, 128).get(name)
    with pytest.raises(ShapeMismatchError, match=name):
        oracle.local_shape(t, shape)


def test_local_shape_of_a_single_row_tensor():
    # One head of width 1: every channel-row tensor has one row, so axis 0 is the row axis even
    # when it is a unit axis and a later axis is not.
    p = oracle.plan(0, 1, 3, 1, 1, 5, 2, qk_multiple=1)
    assert oracle.local_shape(p.get("q_conv1d"), (1, 1, 5)) == (1, 1, 5)
    assert oracle.local_shape(p.get("A_log"), (1, 1, 1, 1)) == (1, 1, 1, 1)
    with pytest.raises(ShapeMismatchError):
        oracle.local_shape(p.get("q_conv1d"), (5, 1))


def test_shard_bytes_takes_any_bytes_like_buffer():
    o = smallest(0).get("o_proj")
    data = bytes(range(256)) * 8
    want = oracle.shard_bytes(o, data)
    assert oracle.shard_bytes(o, bytearray(data)) == want
    assert oracle.shard_bytes(o, memoryview(data)) == want
    assert len(want) == o.local_bytes == 1024


# --- the kda_small fixture: slices written down independently (manifest.json) ----------------


@pytest.mark.parametrize(("tp_size", "rank"), [(2, 0), (2, 1), (4, 0), (4, 1), (4, 2), (4, 3)])
def test_fixture_manifest_slices_match_the_plan(tp_size, rank):
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    tensors = read_safetensors(FIXTURE / "model.safetensors")
    prefix = manifest["tensor_prefix"]
    geometry = manifest["geometry"]
    # At TP=4 the local q|k width is 128, which the 256 rule refuses; the fixture relaxes it.
    p = oracle.plan(
        rank, tp_size, geometry["hidden_size"], geometry["head_dim"], geometry["num_heads"],
        geometry["conv_size"], 64, qk_multiple=1,
    )  # fmt: skip
    slices = manifest["tp_slices"][str(tp_size)][rank]
    assert len(slices) == 15
    for name, where in slices.items():
        entry = p.get(oracle.plan_name("self_attn." + name))
        dtype, shape, data = tensors[prefix + name]
        assert (dtype, shape) == (entry.dtype, entry.disk_shape), name
        local = oracle.local_shape(entry, shape)
        got = oracle.shard_bytes(entry, data)
        if where is None:
            assert entry.kind == "REPLICATED", name
            assert (local, got) == (shape, data), name
            continue
        dim, start, stop = where
        want_shape = shape[:dim] + (stop - start,) + shape[dim + 1 :]
        assert local == want_shape, name
        assert got == narrow(data, shape, entry.elem_bytes, dim, start, stop), name
