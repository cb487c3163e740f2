"""Block-FP8 MLA projections in the MLA plan (``MlaTpPlan(..., quant_block=...)``, the Rust core)
against the oracle's restatement of the spec (``kda_tp.oracle.mla_plan``,
``tests/data/spec/mla.md`` section 5): each quantized projection's scale grid per rank (the whole
grid when replicated, its blocks' rows or columns when sliced), the refusal of a split whose share
per rank is not a whole number of blocks (vLLM's ``validate_fp8_block_shape``), at K3's released
geometry and over random geometries."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kda_tp import oracle
from kda_tp.errors import PlanError
from kda_tp.rank import MlaTpPlan

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

FIELDS = ("name", "dtype", "elem_bytes", "full_rows", "full_row_elems", "local_rows",
          "local_row_elems", "src_row_offset", "src_col_offset", "local_bytes", "full_bytes")
# Kimi K3's released MLA geometry (spec section 1) and NVIDIA's ModelOpt FP8 release of it.
K3 = (7168, 96, 512, 128, 64, 128)
K3_OPTIONS = {"q_lora_rank": 1536, "output_gate": True}
MODELOPT = {"quant_block": (128, 128), "scale_layout": "modelopt"}
PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")


def assert_same(rust: MlaTpPlan, ref: oracle.OracleMlaPlan) -> None:
    """Every tensor field equal, the block and the scale grid's entry too."""
    assert [t.name for t in rust.tensors] == [t.name for t in ref.tensors]
    for r, o in zip(rust.tensors, ref.tensors):
        for field in FIELDS:
            assert getattr(r, field) == getattr(o, field), (r.name, field)
        assert r.block == o.block, r.name
        assert (r.scale is None) == (o.scale is None), r.name
        if r.scale is not None:
            for field in FIELDS:
                assert getattr(r.scale, field) == getattr(o.scale, field), (r.scale.name, field)
            assert r.scale.kind.name == o.scale.kind and r.scale.kind == r.kind
            assert tuple(r.scale.disk_shape) == o.scale.disk_shape, r.scale.name


def test_k3_rank_3_of_8_scale_grids():
    """The numbers a loader writer checks by hand: 12 heads per rank, 128-row blocks."""
    plan = MlaTpPlan(3, 8, *K3, **K3_OPTIONS, **MODELOPT)
    assert [t.name for t in plan.tensors if t.scale is not None] == list(PROJECTIONS)
    rows = {t.name: (t.dtype, t.block, tuple(t.scale.local_shape(list(t.scale.disk_shape))),
                     t.scale.src_row_offset, t.scale.src_col_offset)
            for t in plan.tensors if t.scale is not None}
    assert rows == {
        "q_a_proj": ("F8_E4M3", (128, 128), (12, 1, 56, 1), 0, 0),
        # q_b_proj rows 6912..9216 of 18432: grid rows 54..72 of 144.
        "q_b_proj": ("F8_E4M3", (128, 128), (18, 1, 12, 1), 54, 0),
        # L + Pr = 576 rows, replicated: 5 grid rows, the last one partial, kept whole.
        "kv_a_proj_with_mqa": ("F8_E4M3", (128, 128), (5, 1, 56, 1), 0, 0),
        "kv_b_proj": ("F8_E4M3", (128, 128), (24, 1, 4, 1), 72, 0),
        "g_proj": ("F8_E4M3", (128, 128), (12, 1, 56, 1), 36, 0),
        # o_proj input columns 4608..6144: grid columns 36..48.
        "o_proj": ("F8_E4M3", (128, 128), (56, 1, 12, 1), 0, 36),
    }
    assert plan["q_a_layernorm"].scale is None and plan["q_a_layernorm"].dtype == "BF16"
    assert plan["kv_a_layernorm"].scale is None


@pytest.mark.parametrize("layout", ["modelopt", "grid"])
@pytest.mark.parametrize("tp_size", [1, 2, 4, 8, 16, 48])
def test_k3_agrees_with_the_oracle_on_every_rank(tp_size, layout):
    quant = {"quant_block": (128, 128), "scale_layout": layout}
    for rank in range(tp_size):
        plan = MlaTpPlan(rank, tp_size, *K3, **K3_OPTIONS, **quant)
        assert_same(plan, oracle.mla_plan(rank, tp_size, *K3, **K3_OPTIONS, **quant))
        assert pickle.loads(pickle.dumps(plan)) == plan


@pytest.mark.parametrize("tp_size", [32, 96])
def test_k3_at_a_tp_size_that_splits_a_block_is_refused_naming_tensor_range_and_fix(tp_size):
    """3 heads per rank at TP 32: q_b_proj's 576 rows per rank are 4.5 blocks, so rank 1's rows
    576..1152 start inside block 4; vLLM 0.33 refuses this split too."""
    local = 96 // tp_size * 192
    with pytest.raises(PlanError) as refused:
        MlaTpPlan(1, tp_size, *K3, **K3_OPTIONS, **MODELOPT)
    assert str(refused.value) == (
        f"q_b_proj: rank 1's rows {local}..{2 * local} do not start and end on block "
        f"boundaries (blocks of 128 rows; {local} rows per rank at tp_size {tp_size}), so its "
        "block scales cannot be sliced to match (vLLM's block-FP8 loader refuses this split "
        "too: each rank's share must be a multiple of the block); tp_size may be one of 1, 2, "
        "3, 4, 6, 8, 12, 16, 24, 48")
    e = refused.value
    assert (e.tensor, e.tp_rank, e.tp_size) == ("q_b_proj", None, tp_size)  # rank 1 is valid
    assert e.allowed_tp_sizes == (1, 2, 3, 4, 6, 8, 12, 16, 24, 48)
    with pytest.raises(PlanError, match="q_b_proj: rank's rows"):
        oracle.mla_plan(1, tp_size, *K3, **K3_OPTIONS, **MODELOPT)
    # Unquantized, the same split is planned.
    MlaTpPlan(1, tp_size, *K3, **K3_OPTIONS)


def test_o_proj_columns_split_inside_a_block_are_refused():
    # 4 heads of V = 96: o_proj's 192 input columns per rank at TP 2 are 1.5 blocks of 128.
    with pytest.raises(PlanError, match="o_proj: rank 0's columns 0..192 do not start") as e:
        MlaTpPlan(0, 2, 256, 4, 64, 32, 0, 96, quant_block=(128, 128), quantized=["o_proj"])
    assert e.value.allowed_tp_sizes == (1,)
    plan = MlaTpPlan(0, 2, 256, 4, 64, 32, 0, 96, quant_block=(128, 128),
                     quantized=["kv_b_proj"])  # (32 + 96) * 2 = 256 rows per rank: whole blocks
    assert plan["kv_b_proj"].scale.local_rows == 2 and plan["o_proj"].scale is None


def test_the_norms_and_the_indexer_cannot_be_quantized_nor_fp8_unquantized():
    with pytest.raises(PlanError, match="kv_a_layernorm is never block-quantized") as e:
        MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quant_block=(128, 128), quantized=["kv_a_layernorm"])
    assert e.value.tensor == "kv_a_layernorm"
    with pytest.raises(PlanError, match="indexer.wk is never block-quantized"):
        MlaTpPlan(0, 1, 4096, 64, 512, 256, 0, 256, q_lora_rank=1536, indexer=(32, 128, 16),
                  quant_block=(128, 128), quantized=["indexer.wk"])
    with pytest.raises(PlanError, match='unknown MLA tensor "q_proj"'):
        MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quant_block=(128, 128), quantized=["q_proj"])
    with pytest.raises(PlanError, match="g_proj: dtype F8_E4M3 is not allowed"):
        MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quant_block=(128, 128), quantized=["o_proj"],
                  dtypes={"g_proj": "F8_E4M3"})
    with pytest.raises(PlanError, match="quantized= needs quant_block") as needs:
        MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quantized=["o_proj"])
    assert needs.value.field == "quantized"
    with pytest.raises(PlanError, match="block size 0|block is 0") as zero:
        MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quant_block=(0, 128))
    assert zero.value.field == "block"
    # E5M2 is an FP8 a quantized projection may have.
    plan = MlaTpPlan(0, 1, *K3, **K3_OPTIONS, quant_block=(128, 128),
                     dtypes={"o_proj": "F8_E5M2"})
    assert plan["o_proj"].dtype == "F8_E5M2" and plan["o_proj"].elem_bytes == 1


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def fp8_geometries(draw):
    heads = draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16]))
    tp_size = draw(st.sampled_from(_divisors(heads)))
    nope, v = draw(st.sampled_from([16, 32, 64, 96, 128])), draw(st.sampled_from([32, 64, 128]))
    rope = draw(st.sampled_from([0, 16, 32, 64]))
    block = (draw(st.sampled_from([32, 64, 128])), draw(st.sampled_from([32, 64, 128])))
    q_lora = draw(st.sampled_from([None, 96, 256]))
    args = (draw(st.sampled_from([64, 96, 256])), heads, draw(st.sampled_from([64, 128, 160])),
            nope, rope, v)
    options = {"q_lora_rank": q_lora, "output_gate": q_lora is not None and draw(st.booleans())}
    projections = [t.name for t in MlaTpPlan(0, 1, *args, **options).tensors
                   if t.name.endswith("_proj") or t.name == "kv_a_proj_with_mqa"]
    quantized = draw(st.lists(st.sampled_from(projections), min_size=1, unique=True))
    layout = draw(st.sampled_from(["grid", "modelopt"]))
    quant = {"quant_block": block, "quantized": quantized, "scale_layout": layout}
    return tp_size, args, options, quant


@PROPERTY
@given(fp8_geometries())
def test_random_geometries_agree_with_the_oracle_or_both_refuse(geometry):
    """Every rank: the same entries and scale grids as the oracle, or both refuse; a planned
    sliced weight's scale rows (columns) of all ranks tile its grid exactly, and every rank's
    range starts and ends on a block boundary."""
    tp_size, args, options, quant = geometry
    try:
        plans = [MlaTpPlan(r, tp_size, *args, **options, **quant) for r in range(tp_size)]
    except PlanError as refused:
        assert tp_size > 1 and refused.tensor in quant["quantized"]
        assert tp_size not in refused.allowed_tp_sizes and 1 in refused.allowed_tp_sizes
        with pytest.raises(PlanError):
            oracle.mla_plan(0, tp_size, *args, **options, **quant)
        return
    for rank, plan in enumerate(plans):
        assert_same(plan, oracle.mla_plan(rank, tp_size, *args, **options, **quant))
    b0, b1 = quant["quant_block"]
    for name in quant["quantized"]:
        entries = [p[name] for p in plans]
        by_cols = entries[0].kind.name == "CHANNEL_COLS"
        if entries[0].kind.name == "REPLICATED" or tp_size == 1:
            assert all(e.scale.local_rows == e.scale.full_rows
                       and e.scale.local_row_elems == e.scale.full_row_elems for e in entries)
            continue
        edge = b1 if by_cols else b0
        offsets = [(e.src_col_offset, e.local_row_elems) if by_cols
                   else (e.src_row_offset, e.local_rows) for e in entries]
        assert all(start % edge == 0 and size % edge == 0 for start, size in offsets)
        grid = [(e.scale.src_col_offset, e.scale.local_row_elems) if by_cols
                else (e.scale.src_row_offset, e.scale.local_rows) for e in entries]
        assert grid == [(start // edge, size // edge) for start, size in offsets]
        full = entries[0].scale.full_row_elems if by_cols else entries[0].scale.full_rows
        assert sum(size for _, size in grid) == full
