"""``open_rank(..., mla=True)`` on a Kimi K3-style hybrid whose MLA projections are block FP8
(``kda_tp.synth``'s ``fp8=True``: ModelOpt ``FP8_PB_WO``; and the same tensors relaid as DeepSeek's
``weight_scale_inv`` 2-D grids): every rank's MLA weight and scale grid is the slice the oracle
(``kda_tp.oracle.mla_plan``, restated from ``tests/data/spec/mla.md`` section 5) cuts, and
dequantizes to the rows (columns) of the full dequantized weight; a split whose share per rank is
not whole blocks is refused; a missing or doubled scale is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, PlanError
from kda_tp.model import dequantize
from kda_tp.synth import write_small_checkpoint

from tp_fixtures import write_one_file

#: One KDA layer (0) and one MLA layer (1), 8 heads of 128: MLA q_b_proj 192 rows a head,
#: kv_b_proj 256, g_proj and o_proj 128; whole 128-blocks per rank at TP 1, 2 and 4, not at 8.
GEOMETRY = dict(hidden=256, heads=8, head_dim=128, conv_kernel=4, gate_rank=128, num_layers=2,
                kda_layers=[0], seed=7, style="k3")
MLA = ".layers.1.self_attn."
PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "g_proj", "o_proj")


def deepseek(ckpt: Path, out: Path) -> Path:
    """``ckpt`` with every block scale as DeepSeek stores it: ``<p>.weight_scale_inv``
    ``[ob, ib]`` under ``quant_method: fp8``, ``weight_block_size: [128, 128]``."""
    source = kda_tp.SafetensorsSource(ckpt)
    arrays = {}
    for name in source.names():
        a = source.get(name).array
        if name.endswith(".weight_scale"):
            arrays[name + "_inv"] = np.ascontiguousarray(a[:, 0, :, 0])
        else:
            arrays[name] = a
    config = json.loads((ckpt / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                     "activation_scheme": "dynamic",
                                     "weight_block_size": [128, 128]}
    return write_one_file(out, arrays, config)


@pytest.fixture(scope="module", params=["modelopt", "deepseek"])
def fp8_hybrid(request, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fp8_hybrid")
    ckpt = write_small_checkpoint(root / "modelopt", **GEOMETRY, fp8=True)
    return ckpt if request.param == "modelopt" else deepseek(ckpt, root / "deepseek")


def oracle_plan(ckpt: Path, rank: int, tp_size: int) -> oracle.OracleMlaPlan:
    """The oracle's plan of the MLA layer, every projection quantized in 128 x 128 blocks."""
    geometry = oracle.read_mla_geometry(json.loads((ckpt / "config.json").read_text()))
    return oracle.mla_plan(rank, tp_size, **geometry, quant_block=(128, 128),
                           quantized=PROJECTIONS)


def weight_name(names: list[str], weight: str) -> str:
    """The checkpoint name of MLA ``weight``."""
    return next(n for n in names if n.endswith(MLA + weight + ".weight"))


def scale_name(names: list[str], weight: str) -> str:
    """The one block scale of MLA ``weight`` in ``names``, whichever spelling."""
    found = [n for n in names if MLA + weight + ".weight_scale" in n]
    assert len(found) == 1, found
    return found[0]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_every_mla_weight_and_scale_is_the_oracle_s_slice(fp8_hybrid, tp_size):
    full = kda_tp.SafetensorsSource(fp8_hybrid)
    mla_names = [n for n in full.names() if MLA in n]
    assert len(mla_names) == 8 + 6  # six FP8 weights with their scales, two BF16 norms
    for rank in range(tp_size):
        expected = oracle_plan(fp8_hybrid, rank, tp_size)
        with kda_tp.open_rank(fp8_hybrid, tp_rank=rank, tp_size=tp_size, mla=True) as view:
            assert view.mla_layers == (1,)
            for name in mla_names:
                suffix = name.split(".self_attn.", 1)[1]
                plan_name = oracle.plan_name(suffix)
                for spelling in (".weight_scale_inv", ".weight_scale"):
                    plan_name = plan_name.replace(spelling, ".scale")
                entry = expected.get(plan_name)
                assert entry is not None, name
                got = view[name]
                assert got.dtype == full.get(name).dtype, name
                assert bytes(got.data) == oracle.shard_bytes(entry, bytes(full.get(name).data))
                assert tuple(got.shape) == oracle.local_shape(entry, full.get(name).shape)
                assert view.is_sharded(name) and view.plan_entry(name).name == plan_name


@pytest.mark.parametrize("tp_size", [2, 4])
def test_each_rank_s_grid_dequantizes_its_own_rows_and_columns(fp8_hybrid, tp_size):
    """The meaning of the slices, in numpy from the spec's rule: the local weight with the
    local grid is the rank's rows (``o_proj``: columns) of the full dequantized weight; the
    replicated ones whole."""
    full = kda_tp.SafetensorsSource(fp8_hybrid)
    names = full.names()
    heads, per_head = 8 // tp_size, {"q_b_proj": 192, "kv_b_proj": 256, "g_proj": 128,
                                     "o_proj": 128}
    whole = {p: dequantize(full.get(weight_name(names, p)).array,
                           full.get(scale_name(names, p)).array) for p in PROJECTIONS}
    for rank in range(tp_size):
        with kda_tp.open_rank(fp8_hybrid, tp_rank=rank, tp_size=tp_size, mla=True) as view:
            for p in PROJECTIONS:
                local = dequantize(view[weight_name(names, p)].array,
                                   view[scale_name(names, p)].array)
                if p not in per_head:
                    want = whole[p]
                elif p == "o_proj":
                    width = heads * per_head[p]
                    want = whole[p][:, rank * width:(rank + 1) * width]
                else:
                    height = heads * per_head[p]
                    want = whole[p][rank * height:(rank + 1) * height]
                assert np.array_equal(local, want), (p, rank)


def test_a_split_that_cuts_a_block_is_refused_naming_tensor_range_and_fix(fp8_hybrid, capsys):
    """TP 8: one head a rank, q_b_proj's 192 rows are 1.5 blocks; vLLM refuses the split too
    (``kda-tp plan`` says the sizes that pass). Without mla the KDA view stands (the MLA layer
    passes through whole)."""
    with pytest.raises(PlanError, match=r"q_b_proj: rank 3's rows 576\.\.768 do not start and "
                                        r"end on block boundaries \(blocks of 128 rows; 192 "
                                        r"rows per rank at tp_size 8\).*tp_size may be one of "
                                        r"1, 2, 4$") as refused:
        kda_tp.open_rank(fp8_hybrid, tp_rank=3, tp_size=8, mla=True)
    assert refused.value.allowed_tp_sizes == (1, 2, 4) and refused.value.tensor == "q_b_proj"
    assert isinstance(refused.value, kda_tp.KdaTpError)
    with pytest.raises(PlanError):
        oracle_plan(fp8_hybrid, 3, 8)
    assert main(["plan", str(fp8_hybrid), "--tp-size", "8"]) == 2
    assert capsys.readouterr().err.endswith("tp_size may be one of 1, 2, 4\n")
    with kda_tp.open_rank(fp8_hybrid, tp_rank=3, tp_size=8) as view:
        assert view.mla is None and not view.is_sharded(
            next(n for n in view.names() if n.endswith(MLA + "q_b_proj.weight")))


def _tensors_and_config(ckpt: Path) -> tuple[dict[str, np.ndarray], dict]:
    source = kda_tp.SafetensorsSource(ckpt)
    tensors = {n: source.get(n).array for n in source.names()}
    return tensors, json.loads((ckpt / "config.json").read_text())


def test_a_missing_or_doubled_mla_scale_is_refused(fp8_hybrid):
    tensors, config = _tensors_and_config(fp8_hybrid)
    scale = scale_name(list(tensors), "kv_b_proj")
    lacking = {n: t for n, t in tensors.items() if n != scale}
    with pytest.raises(CheckpointError, match=r"MLA layer 1 lacks .*kv_b_proj\.weight_scale "
                                              r"\(the block scale of its FP8 kv_b_proj"):
        kda_tp.open_rank(lacking, config=config, tp_rank=0, tp_size=2, mla=True)
    doubled = dict(tensors)
    other = scale + "_inv" if scale.endswith("weight_scale") else scale.removesuffix("_inv")
    doubled[other] = tensors[scale]
    with pytest.raises(CheckpointError, match="MLA layer 1 holds both weight_scale and "
                                              "weight_scale_inv for kv_b_proj"):
        kda_tp.open_rank(doubled, config=config, tp_rank=0, tp_size=2, mla=True)
    # The trainer's tensors in memory give the checkpoint's bytes.
    with kda_tp.open_rank(tensors, config=config, tp_rank=1, tp_size=2, mla=True) as memory, \
            kda_tp.open_rank(fp8_hybrid, tp_rank=1, tp_size=2, mla=True) as disk:
        for name in (n for n in tensors if MLA in n):
            assert bytes(memory[name].data) == bytes(disk[name].data), name


def test_fp8_mla_weights_under_a_config_without_a_block_format_pass_through_with_a_line(
        fp8_hybrid, tmp_path):
    """The format comes from the config: without one, rank_mla_plan (what shard, verify and
    the torch loader slice by) says why the MLA layers pass through whole."""
    from kda_tp.rank.mla import rank_mla_plan

    tensors, config = _tensors_and_config(fp8_hybrid)
    config.pop("quantization_config")
    bare = write_one_file(tmp_path / "bare", tensors, config)
    source = kda_tp.SafetensorsSource(bare)
    plan, line = rank_mla_plan(kda_tp.describe(source), 0, 2)
    assert plan is None and line is not None
    assert line.startswith("MLA layers [1] passed through whole (not sliced per rank): "
                           "CheckpointError: ")
    assert "an FP8 MLA weight, but the config declares no quantization_config" in line


def test_a_modelopt_declaration_an_mla_projection_contradicts_is_refused(tmp_path):
    """As for the KDA projections (docs/quantized.md): an MLA module the config declares NVFP4,
    or excludes while its weight is FP8, is named; shard's plan then passes the MLA layer
    through whole, saying why."""
    from kda_tp.rank.mla import rank_mla_plan

    ckpt = write_small_checkpoint(tmp_path / "ckpt", **GEOMETRY, fp8=True)
    config = json.loads((ckpt / "config.json").read_text())
    layers = config["quantization_config"]["quantized_layers"]
    module = next(m for m in layers if m.endswith("layers.1.self_attn.kv_b_proj"))
    layers[module] = {"quant_algo": "NVFP4"}
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "hf_quant_config.json").unlink()
    message = (rf"{module}\.weight: the config's quantized_layers declares {module} as ModelOpt "
               r"NVFP4 \(on disk: F8_E4M3\)")
    with pytest.raises(CheckpointError, match=message):
        kda_tp.open_rank(ckpt, tp_rank=0, tp_size=2, mla=True)
    source = kda_tp.SafetensorsSource(ckpt)
    plan, line = rank_mla_plan(kda_tp.describe(source), 0, 2)
    assert plan is None and line is not None and "as ModelOpt NVFP4" in line
    del layers[module]
    config["quantization_config"]["exclude_modules"].append("*layers.1.self_attn.kv_b_proj")
    (ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="stored as F8_E4M3, but the config says otherwise: "
                                              "its exclude_modules pattern"):
        kda_tp.open_rank(ckpt, tp_rank=0, tp_size=2, mla=True)
