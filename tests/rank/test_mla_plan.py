"""The MLA plan (``kda_tp.rank.MlaTpPlan``, the Rust core) against the oracle's restatement of
the spec (``kda_tp.oracle.mla_plan``, ``tests/data/spec/mla.md``): the three families' released
geometries tensor by tensor, a property over random MLA geometries (byte for byte: every field
of every tensor, the ranks' slices rejoining to the tensor), and the refusals."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_tp
from kda_tp import oracle
from kda_tp.errors import KdaTpError, PlanError
from kda_tp.rank import MlaTpPlan

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TENSOR_FIELDS = ("name", "dtype", "elem_bytes", "full_rows", "full_row_elems", "local_rows",
                 "local_row_elems", "src_row_offset", "src_col_offset", "local_bytes",
                 "full_bytes")
PLAN_FIELDS = ("tp_rank", "tp_size", "hidden", "heads", "local_heads", "q_lora_rank",
               "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
               "output_gate", "indexer", "local_bytes", "full_bytes")

# The released geometries (spec section 1): positional args after (tp_rank, tp_size), options.
KIMI_LINEAR = ((2304, 32, 512, 128, 64, 128), {})
KIMI_K3 = ((7168, 96, 512, 128, 64, 128), {"q_lora_rank": 1536, "output_gate": True})
GLM = ((4096, 64, 512, 256, 0, 256), {"q_lora_rank": 1536, "indexer": (32, 128, 16)})


def assert_same(rust: MlaTpPlan, ref: oracle.OracleMlaPlan) -> None:
    """Every plan and tensor field equal, the kind by name, the on-disk shape and its local
    shape too."""
    for field in PLAN_FIELDS:
        assert getattr(rust, field) == getattr(ref, field), field
    assert [t.name for t in rust.tensors] == [t.name for t in ref.tensors]
    for r, o in zip(rust.tensors, ref.tensors):
        for field in TENSOR_FIELDS:
            assert getattr(r, field) == getattr(o, field), (r.name, field)
        assert r.kind.name == o.kind, r.name
        assert tuple(r.disk_shape) == o.disk_shape, r.name
        assert r.scale is None and r.block is None


@pytest.mark.parametrize("geometry", [KIMI_LINEAR, KIMI_K3, GLM], ids=["kimi-linear", "k3", "glm"])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8, 16, 32])
def test_the_released_geometries_agree_with_the_oracle_on_every_rank(geometry, tp_size):
    args, options = geometry
    for rank in range(tp_size):
        assert_same(MlaTpPlan(rank, tp_size, *args, **options),
                    oracle.mla_plan(rank, tp_size, *args, **options))


def test_kimi_linear_rank_1_of_4_tensor_by_tensor():
    plan = MlaTpPlan(1, 4, *KIMI_LINEAR[0])
    rows = [(t.name, t.kind.name, tuple(t.disk_shape), tuple(t.local_shape(list(t.disk_shape))),
             t.src_row_offset, t.src_col_offset) for t in plan.tensors]
    assert rows == [
        ("q_proj", "CHANNEL_ROWS", (6144, 2304), (1536, 2304), 1536, 0),
        ("kv_a_proj_with_mqa", "REPLICATED", (576, 2304), (576, 2304), 0, 0),
        ("kv_a_layernorm", "REPLICATED", (512,), (512,), 0, 0),
        ("kv_b_proj", "CHANNEL_ROWS", (8192, 512), (2048, 512), 2048, 0),
        ("o_proj", "CHANNEL_COLS", (2304, 4096), (2304, 1024), 0, 1024),
    ]
    assert plan.local_heads == 8


def test_k3_mla_g_proj_and_o_proj_are_the_kda_layer_s_names_shapes_and_slices():
    """The collision the spec keeps: only the config tells the two layers apart."""
    mla = MlaTpPlan(3, 8, *KIMI_K3[0], **KIMI_K3[1])
    kda = kda_tp.KdaTpPlan(3, 8, 7168, 128, 96, 4, 128, full_rank_gate=True)
    for name in ("g_proj", "o_proj"):
        assert mla[name] == kda[name]
    assert mla["q_b_proj"].disk_shape == (18432, 1536)
    assert mla["kv_b_proj"].local_shape([24576, 512]) == (3072, 512)
    assert mla["kv_b_proj"].src_row_offset == 3 * 3072


def test_glm_is_nope_and_its_indexer_is_replicated():
    plan = MlaTpPlan(1, 2, *GLM[0], **GLM[1])
    assert plan["kv_a_proj_with_mqa"].disk_shape == (512, 4096)
    assert plan["q_b_proj"].local_shape([16384, 1536]) == (8192, 1536)
    assert plan["o_proj"].local_shape([4096, 16384]) == (4096, 8192)
    indexer = [t for t in plan.tensors if t.name.startswith("indexer.")]
    assert [t.name for t in indexer] == list(oracle.INDEXER_TENSOR_NAMES)
    assert {t.kind.name for t in indexer} == {"REPLICATED"}
    assert plan["indexer.wq_b"].disk_shape == (4096, 1536)
    assert plan["indexer.index_kpool_compress_ape"].dtype == "F32"
    assert "g_proj" not in plan and "q_proj" not in plan


@st.composite
def mla_geometries(draw):
    tp_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    heads = tp_size * draw(st.integers(1, 6))
    args = (draw(st.integers(1, 48)), heads, draw(st.integers(1, 24)), draw(st.integers(1, 12)),
            draw(st.integers(0, 8)), draw(st.integers(1, 12)))
    options = {
        "q_lora_rank": draw(st.none() | st.integers(1, 24)),
        "output_gate": draw(st.booleans()),
        "indexer": draw(st.none() | st.tuples(st.integers(1, 4), st.integers(1, 8),
                                              st.integers(1, 4))),
        "dtypes": draw(st.none() | st.dictionaries(
            st.sampled_from(["kv_b_proj", "o_proj", "kv_a_layernorm", "kv_a_proj_with_mqa"]),
            st.sampled_from(["BF16", "F16", "F32", "F64"]), max_size=3)),
    }
    return tp_size, args, options


@PROPERTY
@given(mla_geometries(), st.integers(0, 2**32 - 1))
def test_rust_and_oracle_agree_and_the_ranks_rejoin_every_tensor(geometry, seed):
    tp_size, args, options = geometry
    rng = np.random.default_rng(seed)
    plans = [MlaTpPlan(r, tp_size, *args, **options) for r in range(tp_size)]
    for rank, plan in enumerate(plans):
        assert_same(plan, oracle.mla_plan(rank, tp_size, *args, **options))
        assert pickle.loads(pickle.dumps(plan)) == plan
    for i, entry in enumerate(plans[0].tensors):
        full = rng.integers(0, 256, entry.full_bytes, dtype=np.uint8)
        parts = [kda_tp.shard_bytes(p.tensors[i], full) for p in plans]
        for p, part in zip(plans, parts):
            assert part.size == p.tensors[i].local_bytes
        if entry.kind.name == "REPLICATED":
            assert all(np.array_equal(part, full) for part in parts)
            continue
        rows = [part.reshape(p.tensors[i].local_rows, -1) for p, part in zip(plans, parts)]
        axis = 1 if entry.kind.name == "CHANNEL_COLS" else 0
        assert np.array_equal(np.concatenate(rows, axis=axis).reshape(-1), full), entry.name


@given(mla_geometries(), st.integers(2, 9))
@settings(max_examples=100, deadline=None)
def test_a_head_count_the_world_size_does_not_divide_is_refused_by_both(geometry, tp_size):
    _, (hidden, heads, *rest), options = geometry
    if heads % tp_size == 0:
        heads += 1 if (heads + 1) % tp_size else 2
    args = (hidden, heads, *rest)
    with pytest.raises(PlanError) as rust:
        MlaTpPlan(0, tp_size, *args, **options)
    with pytest.raises(PlanError):
        oracle.mla_plan(0, tp_size, *args, **options)
    error = rust.value
    assert (error.heads, error.tp_size) == (heads, tp_size)
    assert error.allowed_tp_sizes == tuple(t for t in range(1, heads + 1) if heads % t == 0)
    assert f"num_attention_heads ({heads}) divisible by tp_size ({tp_size})" in str(error)


@pytest.mark.parametrize("field, change", [
    ("hidden_size", {"hidden": 0}), ("num_attention_heads", {"heads": 0}),
    ("kv_lora_rank", {"kv_lora_rank": 0}), ("qk_nope_head_dim", {"qk_nope_head_dim": 0}),
    ("v_head_dim", {"v_head_dim": 0}), ("q_lora_rank", {"q_lora_rank": 0}),
    ("index_kpool", {"indexer": (32, 128, 0)}),
])
def test_zero_geometry_is_refused_naming_the_config_key(field, change):
    kwargs = dict(zip(("hidden", "heads", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                       "v_head_dim"), GLM[0]), **GLM[1])
    kwargs.update(change)
    with pytest.raises(PlanError) as rust:
        MlaTpPlan(0, 1, **kwargs)
    assert rust.value.field == field
    assert f"{field} is 0" in str(rust.value) and f"fix the config's {field}" in str(rust.value)
    with pytest.raises(PlanError, match=f"{field} is 0"):
        oracle.mla_plan(0, 1, **kwargs)


def test_bad_ranks_dtypes_and_names_are_plan_errors():
    args, options = KIMI_LINEAR
    for rank, size in ((2, 2), (0, 0)):
        with pytest.raises(PlanError):
            MlaTpPlan(rank, size, *args)
        with pytest.raises(PlanError):
            oracle.mla_plan(rank, size, *args)
    with pytest.raises(PlanError, match='unknown MLA tensor "g_proj"') as unknown:
        MlaTpPlan(0, 1, *args, dtypes={"g_proj": "BF16"})
    assert unknown.value.tensor == "g_proj" and isinstance(unknown.value, KdaTpError)
    with pytest.raises(PlanError, match="o_proj: dtype F8_E4M3 is not allowed") as fp8:
        MlaTpPlan(0, 1, *args, dtypes={"o_proj": "F8_E4M3"})
    assert fp8.value.dtype == "F8_E4M3"
    with pytest.raises(PlanError, match="tp_rank must be a non-negative integer"):
        MlaTpPlan(True, 1, *args)
    with pytest.raises(KeyError, match="not an MLA plan name"):
        MlaTpPlan(0, 1, *args)["g_proj"]
