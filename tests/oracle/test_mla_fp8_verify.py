"""``kda-tp shard`` and ``verify`` of a Kimi K3-style hybrid whose MLA projections are block FP8
(ModelOpt ``FP8_PB_WO``, as ``kda_tp.synth`` writes it): every rank holds its slice of each MLA
weight with the matching blocks of its scale grid, byte for byte as the pure-Python oracle
(``kda_tp.oracle.verify``, restated from ``tests/data/spec/mla.md`` section 5) and kda_tp's own
``verify_shards`` say; a rank holding another rank's scale rows is named by both; a split that
cuts a block is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp.checkpoint import write_safetensors
from kda_tp.errors import PlanError
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from tp_fixtures import DTYPE_NAMES

GEOMETRY = dict(hidden=256, heads=8, head_dim=128, conv_kernel=4, gate_rank=128, num_layers=2,
                kda_layers=[0], seed=11, style="k3", fp8=True)
MLA = ".layers.1.self_attn."


@pytest.fixture(scope="module")
def fp8_hybrid(tmp_path_factory) -> Path:
    return write_small_checkpoint(tmp_path_factory.mktemp("fp8_hybrid") / "ckpt", **GEOMETRY)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_shard_then_verify_is_byte_exact_with_the_mla_scales_sliced(fp8_hybrid, tmp_path,
                                                                    tp_size):
    out = tmp_path / "out"
    shard_checkpoint(fp8_hybrid, out, tp_size)
    report = verify_shards(fp8_hybrid, out)
    assert report.ok, report.problems
    assert report.mla_note is None
    assert oracle.verify(fp8_hybrid, out) == []
    full = kda_tp.SafetensorsSource(fp8_hybrid)
    for rank in range(tp_size):
        written = kda_tp.SafetensorsSource(rank_dir(out, rank))
        meta = dict(written.files()[0][1] or {})
        assert meta["kda_tp_mla_layers"] == "[1]"
        scales = {n.split(".self_attn.")[1]: written.get(n).shape
                  for n in written.names() if MLA in n and n.endswith("weight_scale")}
        ob = 12 // tp_size  # q_b_proj: 1536 rows, 12 grid rows
        assert scales == {
            "q_a_proj.weight_scale": (12, 1, 2, 1),
            "q_b_proj.weight_scale": (ob, 1, 12, 1),
            "kv_a_proj_with_mqa.weight_scale": (5, 1, 2, 1),
            "kv_b_proj.weight_scale": (16 // tp_size, 1, 4, 1),
            "g_proj.weight_scale": (8 // tp_size, 1, 2, 1),
            "o_proj.weight_scale": (2, 1, 8 // tp_size, 1),
        }
        q_b = next(n for n in full.names() if n.endswith(MLA + "q_b_proj.weight_scale"))
        assert np.array_equal(written.get(q_b).array,
                              full.get(q_b).array[rank * ob:(rank + 1) * ob])


def test_a_rank_holding_rank_0_s_scale_rows_is_named(fp8_hybrid, tmp_path):
    out = tmp_path / "out"
    shard_checkpoint(fp8_hybrid, out, 2)
    rank1 = rank_dir(out, 1)
    name = next(n for n in kda_tp.SafetensorsSource(fp8_hybrid).names()
                if n.endswith(MLA + "kv_b_proj.weight_scale"))
    _replace(rank1, name, kda_tp.SafetensorsSource(rank_dir(out, 0)).get(name).array.copy())
    report = verify_shards(fp8_hybrid, out)
    assert not report.ok
    assert any(name in p for p in report.problems), report.problems
    assert f"rank1: {name}: bytes differ from this rank's slice of the input" in oracle.verify(
        fp8_hybrid, out)


def _replace(directory: Path, name: str, array: np.ndarray) -> None:
    """Rewrite the one file of ``directory`` that holds ``name`` with ``array`` in its place,
    the header's metadata kept (the file is replaced atomically)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    path = directory / index["weight_map"][name]
    source = kda_tp.SafetensorsSource(path)
    arrays = {n: (array if n == name else source.get(n).array) for n in source.names()}
    metadata = dict(source.files()[0][1] or {})
    write_safetensors(path, [(n, DTYPE_NAMES[a.dtype], a.shape, a.nbytes,
                              lambda a=a: np.ascontiguousarray(a)) for n, a in arrays.items()],
                      metadata=metadata)


def test_a_split_that_cuts_a_block_is_refused_before_anything_is_written(fp8_hybrid, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(PlanError, match=r"q_b_proj: rank \d's rows .* do not start and end on "
                                        r"block boundaries.*tp_size may be one of 1, 2, 4$"):
        shard_checkpoint(fp8_hybrid, out, 8)
    assert not out.exists() or not any(out.iterdir())
