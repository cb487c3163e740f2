"""Property tests: the Rust shard plan (``kda_tp``) against the pure-Python oracle.

The oracle (``kda_tp.oracle``) restates ``tests/data/spec/tp.rs.txt`` and
``tests/data/spec/tp_bind.rs.txt`` independently of the Rust core, so every property is "Rust and
oracle agree", plus the invariants that hold whatever the plan is: the ranks' slices of a tensor
rejoin to the tensor, and TP=1 is the identity. Geometries stay small (heads up to 64, hidden up to
64, channels up to ~8k) so that random byte buffers for every tensor of every rank are cheap.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kda_tp
from kda_tp import oracle
from kda_tp.errors import PlanError, ShapeMismatchError

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

QK_MULTIPLES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

PLAN_FIELDS = (
    "tp_rank",
    "tp_size",
    "hidden",
    "head_dim",
    "full_heads",
    "local_heads",
    "conv_kernel",
    "gate_rank",
    "qk_multiple",
    "full_rank_gate",
    "a_log_len",
    "local_bytes",
    "full_bytes",
    "needs_output_all_reduce",
)
TENSOR_FIELDS = (
    "name",
    "dtype",
    "elem_bytes",
    "full_rows",
    "full_row_elems",
    "local_rows",
    "local_row_elems",
    "src_row_offset",
    "src_col_offset",
    "local_bytes",
    "full_bytes",
)


@dataclass(frozen=True)
class Geometry:
    """One KDA block's geometry and plan options, as passed to both implementations."""

    hidden: int
    head_dim: int
    heads: int
    conv_kernel: int
    gate_rank: int
    qk_multiple: int
    dtypes: dict | None
    full_rank_gate: bool = False
    a_log_len: int | None = None

    def args(self, rank: int, tp_size: int) -> tuple:
        return (
            rank,
            tp_size,
            self.hidden,
            self.head_dim,
            self.heads,
            self.conv_kernel,
            self.gate_rank,
        )

    def kwargs(self) -> dict:
        return {
            "qk_multiple": self.qk_multiple,
            "dtypes": self.dtypes,
            "full_rank_gate": self.full_rank_gate,
            "a_log_len": self.a_log_len,
        }

    def tp_sizes(self) -> list[int]:
        """Every tensor-parallel size that divides the head count."""
        return [t for t in range(1, self.heads + 1) if self.heads % t == 0]


def rust_plan(g: Geometry, rank: int, tp_size: int):
    return kda_tp.KdaTpPlan(*g.args(rank, tp_size), **g.kwargs())


def oracle_plan(g: Geometry, rank: int, tp_size: int) -> oracle.OraclePlan:
    return oracle.plan(*g.args(rank, tp_size), **g.kwargs())


def dtype_overrides(names=oracle.TENSOR_NAMES):
    return st.none() | st.dictionaries(
        st.sampled_from(names), st.sampled_from(tuple(oracle.ELEM_BYTES)), max_size=4
    )


@st.composite
def legal_geometries(draw) -> Geometry:
    """Geometry whose TP=1 plan is legal; larger TP sizes may break the q|k width rule, which
    exercises the refusal on both sides. Half of them are Kimi K3 blocks (full-rank ``g_proj``),
    and ``A_log`` is zero-padded past the heads in about half."""
    qk_multiple = draw(st.sampled_from(QK_MULTIPLES))
    full_rank_gate = draw(st.booleans())
    names = oracle.FULL_RANK_GATE_TENSOR_NAMES if full_rank_gate else oracle.TENSOR_NAMES
    heads = draw(st.integers(1, 64))
    # Smallest head_dim making 2 * heads * head_dim a multiple of qk_multiple.
    unit = qk_multiple // math.gcd(qk_multiple, 2 * heads)
    head_dim = unit * draw(st.integers(1, max(1, 1024 // (heads * unit))))
    return Geometry(
        hidden=draw(st.integers(1, 64)),
        head_dim=head_dim,
        heads=heads,
        conv_kernel=draw(st.integers(1, 8)),
        gate_rank=draw(st.integers(1, 32)),
        qk_multiple=qk_multiple,
        dtypes=draw(dtype_overrides(names)),
        full_rank_gate=full_rank_gate,
        a_log_len=draw(st.none() | st.integers(heads, heads + 40)),
    )


def kind_name(kind) -> str:
    """``"HEAD_ROWS"`` for ``kda_tp.KdaShard.HEAD_ROWS``."""
    return getattr(kind, "name", None) or str(kind).rsplit(".", 1)[-1]


def assert_same_plan(got, want: oracle.OraclePlan) -> None:
    for field in PLAN_FIELDS:
        assert getattr(got, field) == getattr(want, field), field
    assert [t.name for t in got.tensors] == [t.name for t in want.tensors]
    for g, w in zip(got.tensors, want.tensors, strict=True):
        for field in TENSOR_FIELDS:
            assert getattr(g, field) == getattr(w, field), (w.name, field)
        assert kind_name(g.kind) == w.kind, w.name
        assert g.kind == getattr(kda_tp.KdaShard, w.kind), w.name
        assert tuple(g.disk_shape) == w.disk_shape, w.name
        assert got.get(w.name).src_row_offset == w.src_row_offset, w.name


def rust_shard(entry, data: bytes) -> bytes:
    """Rust ``shard_bytes`` as bytes, after checking the array contract (1-D uint8; read-only
    when it is a view of the input, i.e. for every kind but ``CHANNEL_COLS``)."""
    arr = kda_tp.shard_bytes(entry, data)
    assert isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and arr.ndim == 1
    if kind_name(entry.kind) != "CHANNEL_COLS":
        assert not arr.flags.writeable, entry.name
    return arr.tobytes()


def assert_plans_agree(g: Geometry, rank: int, tp_size: int) -> None:
    """The Rust plan and the oracle's both refuse ``g`` at ``rank`` of ``tp_size`` with a
    PlanError, or both build the same plan."""
    try:
        want = oracle_plan(g, rank, tp_size)
    except PlanError:
        with pytest.raises(PlanError):
            rust_plan(g, rank, tp_size)
        return
    assert_same_plan(rust_plan(g, rank, tp_size), want)


@PROPERTY
@given(legal_geometries())
def test_plan_matches_the_oracle_for_every_tp_size_and_rank(g):
    for tp_size in g.tp_sizes():
        for rank in range(tp_size):
            assert_plans_agree(g, rank, tp_size)


@PROPERTY
@given(legal_geometries(), st.integers(0, 2**32))
def test_shard_bytes_match_the_oracle_and_the_ranks_rejoin(g, seed):
    rng = random.Random(seed)
    full = {t.name: rng.randbytes(t.full_bytes) for t in oracle_plan(g, 0, 1).tensors}
    for tp_size in g.tp_sizes():
        try:
            oracle_plan(g, 0, tp_size)
        except PlanError:
            continue
        slices = {name: [] for name in full}
        for rank in range(tp_size):
            rust = rust_plan(g, rank, tp_size)
            for entry, want in zip(
                rust.tensors, oracle_plan(g, rank, tp_size).tensors, strict=True
            ):
                data = full[entry.name]
                got = rust_shard(entry, data)
                assert got == oracle.shard_bytes(want, data), (tp_size, rank, entry.name)
                slices[entry.name].append(got)
        for entry in oracle_plan(g, 0, tp_size).tensors:
            want = full[entry.name]
            if entry.name == "A_log":
                want = want[: g.heads * entry.elem_bytes]  # the zero padding is no rank's
            assert rejoin(entry, slices[entry.name]) == want, (tp_size, entry.name)


def rejoin(entry: oracle.OracleTensor, parts: list[bytes]) -> bytes:
    """The full tensor from every rank's slice, in rank order: replicated tensors must agree on
    every rank; row slices concatenate (a padded ``A_log`` to its heads); column slices
    (``o_proj``) interleave row by row."""
    if entry.kind == "REPLICATED":
        assert all(p == parts[0] for p in parts), entry.name
        return parts[0]
    if entry.kind != "CHANNEL_COLS":
        return b"".join(parts)
    width = entry.local_row_elems * entry.elem_bytes
    return b"".join(
        p[row * width : (row + 1) * width] for row in range(entry.full_rows) for p in parts
    )


@PROPERTY
@given(legal_geometries(), st.integers(0, 2**32))
def test_tp1_is_the_identity(g, seed):
    rng = random.Random(seed)
    rust = rust_plan(g, 0, 1)
    assert rust.needs_output_all_reduce is False
    a_log = rust["A_log"]
    padding = (a_log.full_rows - g.heads) * a_log.elem_bytes
    assert rust.local_bytes == rust.full_bytes - padding
    for entry in rust.tensors:
        data = rng.randbytes(entry.full_bytes)
        assert (entry.src_row_offset, entry.src_col_offset) == (0, 0)
        if entry.name == "A_log" and g.a_log_len not in (None, g.heads):
            # A padded A_log keeps its heads and drops the padding, even at TP=1.
            assert (entry.local_rows, entry.full_rows) == (g.heads, g.a_log_len)
            assert rust_shard(entry, data) == data[: g.heads * entry.elem_bytes]
            continue
        assert (entry.local_rows, entry.local_row_elems) == (entry.full_rows, entry.full_row_elems)
        assert rust_shard(entry, data) == data, entry.name


@PROPERTY
@given(legal_geometries(), st.data())
def test_a_buffer_of_the_wrong_size_is_refused_on_both_sides(g, data):
    tp_size = data.draw(st.sampled_from(g.tp_sizes()))
    try:
        want = oracle_plan(g, tp_size - 1, tp_size)
    except PlanError:
        return
    rust = rust_plan(g, tp_size - 1, tp_size)
    for r, w in zip(rust.tensors, want.tensors, strict=True):
        length = data.draw(
            st.integers(0, w.full_bytes + 16).filter(lambda n, full=w.full_bytes: n != full)
        )
        with pytest.raises(ShapeMismatchError, match=w.name):
            kda_tp.shard_bytes(r, bytes(length))
        with pytest.raises(ShapeMismatchError, match=w.name):
            oracle.shard_bytes(w, bytes(length))


sizes = st.one_of(
    st.integers(-1, 8),
    st.sampled_from((16, 64, 128, 256, 2**20, 2**31, 2**40, 2**62, 2**64)),
)
raw_dtypes = st.none() | st.dictionaries(
    st.sampled_from((*oracle.TENSOR_NAMES, "g_proj", "q", "o_proj.weight", "bias")),
    st.sampled_from((*oracle.ELEM_BYTES, "I32", "bf16", "F8_E4M3")),
    max_size=3,
)


@PROPERTY
@given(
    rank=sizes,
    tp_size=sizes,
    g=st.builds(
        Geometry,
        hidden=sizes,
        head_dim=sizes,
        heads=sizes,
        conv_kernel=sizes,
        gate_rank=sizes,
        qk_multiple=st.sampled_from((0, 1, 2, 128, 256, 2**40)),
        dtypes=raw_dtypes,
        full_rank_gate=st.booleans(),
        a_log_len=st.none() | sizes,
    ),
)
def test_refusals_agree_on_any_geometry(rank, tp_size, g):
    assert_plans_agree(g, rank, tp_size)


@st.composite
def near_the_byte_limit(draw) -> tuple[int, int, Geometry]:
    """(rank, tp_size, geometry) whose largest tensors (``q/k/v_proj``, ``o_proj``:
    ``C * hidden`` elements) lie within a factor of about 200 of the 2**63 - 1 byte limit, so
    both the per-tensor limit and the whole-block limit are crossed on either side."""
    log_elems = draw(st.integers(55, 63))
    log_channels = draw(st.integers(0, log_elems))
    log_heads = draw(st.integers(0, log_channels))
    tp_size = 2 ** draw(st.integers(0, log_heads))
    geometry = Geometry(
        hidden=2 ** (log_elems - log_channels) * draw(st.sampled_from((1, 3))),
        head_dim=2 ** (log_channels - log_heads),
        heads=2**log_heads,
        conv_kernel=draw(sizes),
        gate_rank=draw(sizes),
        qk_multiple=1,
        dtypes=draw(dtype_overrides()),
    )
    return draw(st.integers(0, tp_size - 1)), tp_size, geometry


@PROPERTY
@given(near_the_byte_limit())
def test_byte_size_limits_agree(case):
    rank, tp_size, g = case
    assert_plans_agree(g, rank, tp_size)


def candidate_shapes(entry: oracle.OracleTensor, data: st.DataObject) -> list[tuple[int, ...]]:
    """On-disk shapes to try for one tensor: the canonical one, the flat ``[rows, row_elems]``
    view, the alternatives real checkpoints use (``A_log`` as ``(H,)``, conv as ``(C, K)``),
    unit axes added and axes permuted, and arbitrary small shapes."""
    shapes = [
        entry.disk_shape,
        (entry.full_rows, entry.full_row_elems),
        (entry.full_rows * entry.full_row_elems,),
        (1, *entry.disk_shape),
        (*entry.disk_shape, 1),
        (entry.full_row_elems, entry.full_rows),
        (entry.full_rows + 1, entry.full_row_elems),
    ]
    padded = [*entry.disk_shape, *[1] * data.draw(st.integers(0, 2))]
    shapes.append(tuple(data.draw(st.permutations(padded))))
    shapes.append(tuple(data.draw(st.lists(st.integers(0, 8), max_size=4))))
    return shapes


@PROPERTY
@given(legal_geometries(), st.data())
def test_local_shape_matches_the_oracle(g, data):
    tp_size = data.draw(st.sampled_from(g.tp_sizes()))
    rank = data.draw(st.integers(0, tp_size - 1))
    try:
        want = oracle_plan(g, rank, tp_size)
    except PlanError:
        return
    rust = rust_plan(g, rank, tp_size)
    for r, w in zip(rust.tensors, want.tensors, strict=True):
        for shape in candidate_shapes(w, data):
            try:
                expected = oracle.local_shape(w, shape)
            except ShapeMismatchError:
                with pytest.raises(ShapeMismatchError):
                    r.local_shape(shape)
                continue
            assert tuple(r.local_shape(shape)) == expected, (w.name, shape)


def test_plan_lookup_by_name():
    rust = kda_tp.KdaTpPlan(1, 2, 4096, 128, 64, 4, 128)
    assert rust.get("nope") is None
    with pytest.raises(KeyError):
        rust["nope"]
    assert rust["A_log"].local_rows == rust.get("A_log").local_rows == 32


@st.composite
def block_quantized(draw) -> tuple[Geometry, tuple[int, int], list[str]]:
    """A legal geometry with random FP8 block edges (small, so ranks' ranges land on block
    boundaries, inside one block, or across a boundary, which must be refused) and a random
    subset of the projections quantized."""
    g = draw(legal_geometries())
    names = oracle.FULL_RANK_GATE_TENSOR_NAMES if g.full_rank_gate else oracle.TENSOR_NAMES
    projections = [n for n in names if n.endswith("_proj")]
    quantized = draw(st.lists(st.sampled_from(projections), min_size=1, unique=True))
    block = (draw(st.integers(1, 300)), draw(st.integers(1, 300)))
    # The quantized names' dtype overrides must be FP8 or floats; keep the others'.
    dtypes = {k: v for k, v in (g.dtypes or {}).items() if k not in quantized} or None
    return Geometry(**{**g.__dict__, "dtypes": dtypes}), block, quantized


@PROPERTY
@given(block_quantized(), st.integers(0, 2**32))
def test_block_scale_plans_match_the_oracle_and_cover_each_ranks_weight(case, seed):
    g, block, quantized = case
    quant = {"quant_block": block, "quantized": quantized, "scale_layout": "modelopt"}
    rng = random.Random(seed)
    for tp_size in g.tp_sizes():
        for rank in range(tp_size):
            try:
                want = oracle.plan(*g.args(rank, tp_size), **g.kwargs(), **quant)
            except PlanError:
                with pytest.raises(PlanError):
                    kda_tp.KdaTpPlan(*g.args(rank, tp_size), **g.kwargs(), **quant)
                continue
            got = kda_tp.KdaTpPlan(*g.args(rank, tp_size), **g.kwargs(), **quant)
            assert_same_plan(got, want)
            for r, w in zip(got.tensors, want.tensors, strict=True):
                assert (r.scale is None) == (w.scale is None) == (w.name not in quantized)
                if w.scale is None:
                    continue
                assert r.block == w.block == block and r.dtype == "F8_E4M3"
                for field in TENSOR_FIELDS:
                    assert getattr(r.scale, field) == getattr(w.scale, field), (w.name, field)
                assert tuple(r.scale.disk_shape) == w.scale.disk_shape
                # The kept blocks cover the rank's weight range, and dequantizing with local
                # indices (i // bo, j // bi) reads the same block as the global indices.
                by_cols = w.kind == "CHANNEL_COLS"
                start = w.src_col_offset if by_cols else w.src_row_offset
                size = w.local_row_elems if by_cols else w.local_rows
                edge = block[1] if by_cols else block[0]
                first = w.scale.src_col_offset if by_cols else w.scale.src_row_offset
                for i in (0, size - 1):
                    assert (start + i) // edge == first + i // edge, (w.name, i)
                grid = rng.randbytes(w.scale.full_bytes)
                assert rust_shard(r.scale, grid) == oracle.shard_bytes(w.scale, grid)
