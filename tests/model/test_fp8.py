"""Block-quantized (FP8) KDA checkpoints: scale grids sliced to match their weights, the three
layouts (ModelOpt, DeepSeek, compressed-tensors), refusals, and the numeric proof.

``tests/data/k3_fp8_small`` is the k3_small geometry with every KDA and MLA projection in NVIDIA
ModelOpt's FP8_PB_WO layout, its outputs computed by flash-linear-attention ops on the
dequantized weights (see its README).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import kda_tp
import ml_dtypes
import numpy as np
import pytest
from kda_tp import oracle
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, DtypeMismatchError, PlanError, ShapeMismatchError
from kda_tp.reference import kda_layer_forward, layer_weights
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_checkpoint, write_small_checkpoint
from tp_fixtures import write_one_file
from paths import DATA

FIXTURE = DATA / "k3_fp8_small"
LAYERS = "language_model.model.layers."
KDA = LAYERS + "0.self_attn."
MLA = LAYERS + "1.self_attn."
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "f_b_proj", "b_proj", "o_proj")


def test_the_fixture_plan_has_a_scale_per_projection():
    plan = kda_tp.KdaTpPlan.from_config(FIXTURE, 1, 2)
    assert sorted(t.name for t in plan.tensors if t.scale is not None) == sorted(PROJECTIONS)
    for name in ("q_conv1d", "A_log", "dt_bias", "o_norm"):
        assert plan[name].scale is None and plan[name].dtype == "F32"
    q = plan["q_proj"]
    assert (q.dtype, q.block, q.scale.dtype) == ("F8_E4M3", (128, 128), "F32")
    assert q.scale.local_shape([2, 1, 1, 1]) == (1, 1, 1, 1)
    assert q.scale.src_row_offset == 1  # rank 1's 128 rows are block row 1
    assert plan["b_proj"].scale.src_row_offset == 0  # rows 2..4 lie in block row 0
    assert plan["o_proj"].scale.local_shape([1, 1, 2, 1]) == (1, 1, 1, 1)
    assert plan["o_proj"].scale.src_col_offset == 1


def test_reference_on_each_ranks_dequantized_slices_matches_the_fixture():
    source = kda_tp.SafetensorsSource(FIXTURE)
    x, y = np.load(FIXTURE / "x.npy"), np.load(FIXTURE / "y.npy")
    partials = []
    for rank in range(2):
        plan = kda_tp.KdaTpPlan.from_config(source, rank, 2)
        view = kda_tp.KdaShardedSource(source, plan)
        local = layer_weights(view, 0, LAYERS, plan)
        partial = kda_layer_forward(local, x, head_dim=64, gate_lower_bound=-5.0)
        want = np.load(FIXTURE / f"y_partial_tp2_rank{rank}.npy")
        assert np.max(np.abs(partial - want)) < 1e-5
        partials.append(partial)
    assert np.max(np.abs(sum(partials) - y)) < 1e-5


def test_cli_shard_and_verify_the_fixture(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["plan", str(FIXTURE), "--tp-size", "2"]) == 0
    assert "q_proj.scale" in capsys.readouterr().out
    assert main(["shard", str(FIXTURE), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    assert main(["verify", str(FIXTURE), str(out), "--numeric"]) == 0
    assert "numerical TP equivalence passes" in capsys.readouterr().out
    assert oracle.verify(FIXTURE, out) == []
    full = kda_tp.SafetensorsSource(FIXTURE)
    for r in range(2):
        rank = kda_tp.SafetensorsSource(rank_dir(out, r))
        q, qs = rank.get(KDA + "q_proj.weight"), rank.get(KDA + "q_proj.weight_scale")
        assert (q.dtype, q.shape, qs.dtype, qs.shape) == ("F8_E4M3", (128, 128), "F32", (1, 1, 1, 1))
        grid = full.get(KDA + "q_proj.weight_scale").array
        assert np.array_equal(qs.array, grid[r : r + 1])
        # b_proj's 2 rows per rank both lie in block row 0: every rank keeps it.
        assert np.array_equal(rank.get(KDA + "b_proj.weight_scale").array,
                              full.get(KDA + "b_proj.weight_scale").array)
        for name in full.names():
            if not name.startswith(KDA):  # MLA (FP8 too), vision, embeddings: untouched
                assert np.array_equal(rank.get(name).data, full.get(name).data), name


def _arrays(directory: Path) -> dict[str, np.ndarray]:
    source = kda_tp.SafetensorsSource(directory)
    return {name: source.get(name).array for name in source.names()}


def _fixture_config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def _relayout(tmp_path: Path, style: str) -> Path:
    """The fixture with its scales as DeepSeek (``weight_scale_inv``, 2-D, ``quant_method:
    fp8``) or compressed-tensors (``weight_scale``, 2-D) store them."""
    arrays = {}
    for name, a in _arrays(FIXTURE).items():
        if name.endswith(".weight_scale"):
            grid = a[:, 0, :, 0]
            arrays[name + "_inv" if style == "deepseek" else name] = grid
        else:
            arrays[name] = a
    config = _fixture_config()
    if style == "deepseek":
        config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                         "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128]}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "strategy": "block",
                "block_structure": [128, 128]}}}}
    return write_one_file(tmp_path / style, arrays, config)


@pytest.mark.parametrize("style", ["deepseek", "compressed-tensors"])
def test_other_layouts_give_the_same_weights_per_rank(tmp_path, style):
    other = _relayout(tmp_path, style)
    out = tmp_path / "out"
    shard_checkpoint(other, out, 2)
    report = verify_shards(other, out, numeric=True)
    assert report.ok and report.numeric.passed, report.problems
    assert oracle.verify(other, out) == []
    suffix = "weight_scale_inv" if style == "deepseek" else "weight_scale"
    fixture = kda_tp.SafetensorsSource(FIXTURE)
    for rank in range(2):
        plan = kda_tp.KdaTpPlan.from_config(fixture, rank, 2)
        want = layer_weights(kda_tp.KdaShardedSource(fixture, plan), 0, LAYERS, plan)
        got_source = kda_tp.SafetensorsSource(rank_dir(out, rank))
        got = layer_weights(got_source, 0, LAYERS, plan)
        for name in PROJECTIONS:
            assert np.array_equal(got[name], want[name]), name
            assert got_source.get(f"{KDA}{name}.{suffix}").array.ndim == 2


class _Swapped:
    """A rank view whose ``name`` tensors are replaced by arrays."""

    def __init__(self, inner, replacements):
        self._inner, self._replacements = inner, replacements

    def get(self, name):
        if name in self._replacements:
            return type("Record", (), {"array": self._replacements[name]})()
        return self._inner[name]


def _even_scale_split(source, plan, layers):
    """o_proj's scale grid cut as ``tp_size`` equal row slices of the flat grid (the wrong rule)
    instead of the blocks covering the rank's columns, kept at the local shape."""
    inner = kda_tp.KdaShardedSource(source, plan, layers)
    name = KDA + "q_proj.weight_scale"
    grid = source.get(name).array
    share = grid.shape[0] // plan.tp_size
    wrong = grid[::-1][plan.tp_rank * share : (plan.tp_rank + 1) * share]  # not the covering block
    assert wrong.shape == inner[name].array.shape
    return _Swapped(inner, {name: wrong})


def _scale_left_out(source, plan, layers):
    """o_proj served without its scale: the FP8 values taken at face value (scale 1)."""
    inner = kda_tp.KdaShardedSource(source, plan, layers)
    name = KDA + "o_proj.weight_scale"
    return _Swapped(inner, {name: np.ones_like(inner[name].array)})


@pytest.mark.parametrize("factory", [_even_scale_split, _scale_left_out])
def test_a_mis_sliced_or_missing_scale_fails_the_numeric_check(factory):
    assert kda_tp.reference.check_tp_equivalence(FIXTURE, 2).passed
    report = kda_tp.reference.check_tp_equivalence(FIXTURE, 2, shard_source_factory=factory)
    assert not report.passed
    assert report.layers[0].max_abs_error > 1e-2


def _without(*names: str) -> dict:
    arrays = _arrays(FIXTURE)
    for name in names:
        del arrays[name]
    return arrays


def _with(**changes) -> dict:
    arrays = _arrays(FIXTURE)
    arrays.update({KDA + k.replace("__", "."): v for k, v in changes.items()})
    return arrays


def _f8(shape) -> np.ndarray:
    return np.ones(shape, dtype=ml_dtypes.float8_e4m3fn)


def _nvfp4_arrays() -> dict:
    arrays = _without(KDA + "q_proj.weight", KDA + "q_proj.weight_scale")
    arrays[KDA + "q_proj.weight"] = np.zeros((256, 64), np.uint8)  # two FP4 values per byte
    arrays[KDA + "q_proj.weight_scale"] = _f8((256, 8))
    return arrays


def _nvfp4_config() -> dict:
    config = _fixture_config()
    config["quantization_config"] = {"quant_method": "modelopt", "quant_algo": "NVFP4"}
    return config


def _packed_arrays() -> dict:
    arrays = _without(KDA + "q_proj.weight", KDA + "q_proj.weight_scale")
    arrays[KDA + "q_proj.weight_packed"] = np.zeros((256, 64), np.uint8)
    arrays[KDA + "q_proj.weight_scale"] = np.ones((256, 4), np.float32)
    return arrays


def _packed_config() -> dict:
    config = _fixture_config()
    config["quantization_config"] = {"quant_method": "compressed-tensors",
                                     "format": "pack-quantized", "config_groups": {}}
    return config


def _plain_config() -> dict:
    config = _fixture_config()
    del config["quantization_config"]
    return config


@pytest.mark.parametrize(
    ("arrays", "config", "error", "message"),
    [
        (_without(KDA + "q_proj.weight_scale"), None, CheckpointError,
         r"KDA layer 0 lacks self_attn\.q_proj\.weight_scale \(its block scale\)"),
        (_without(KDA + "q_proj.weight"), None, CheckpointError,
         r"KDA layer 0 lacks .*self_attn\.q_proj\.weight"),
        (_with(q_proj__weight_scale=np.ones((3, 1, 1, 1), np.float32)), None,
         ShapeMismatchError, r"q_proj\.weight_scale: q_proj\.scale: on-disk shape \[3, 1, 1, 1\] .*"
         r"expected 2 elements"),
        (_with(q_conv1d__weight=_f8((256, 1, 4))), None, CheckpointError,
         r"q_conv1d is stored as FP8, but conv weights, A_log, dt_bias and o_norm are never "
         r"quantized"),
        (_with(q_conv1d__weight_scale=np.ones((2, 1, 1, 1), np.float32)), None, CheckpointError,
         r"q_conv1d\.weight_scale: a block scale, but q_conv1d is not block-quantized"),
        (_arrays(FIXTURE), _plain_config(), CheckpointError,
         r"an FP8 weight, but the config declares no quantization_config"),
        (_nvfp4_arrays(), _nvfp4_config(), DtypeMismatchError,
         r"q_proj\.weight: dtype U8 .*the config declares ModelOpt NVFP4"),
        (_packed_arrays(), _packed_config(), CheckpointError,
         r"q_proj\.weight_packed: packed 4-bit KDA weights \(4-bit group-quantized "
         r"\(weight_packed \+ group scales\) \(compressed-tensors pack-quantized\)\)"),
    ],
    ids=["weight-without-scale", "scale-without-weight", "wrong-grid", "conv-quantized",
         "conv-scale", "no-quant-config", "nvfp4", "packed-4bit"],
)
def test_refusals_name_the_problem_and_leave_no_output(
    tmp_path, capsys, arrays, config, error, message
):
    ckpt = write_one_file(tmp_path / "ckpt", arrays, config or _fixture_config())
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        shard_checkpoint(ckpt, out, 2)
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    assert error.__name__ in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []


def test_a_split_inside_a_block_is_refused(tmp_path, capsys):
    """6 heads of 64 at TP=2: rank 1's rows 192..384 start inside block 1 of 128 rows."""
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=128, heads=6, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=1, kda_layers=[0],
                                  style="k3", fp8=True)
    out = tmp_path / "out"
    message = r"q_proj: rank 1's rows 192\.\.384 start inside block 1 of 128 rows"
    with pytest.raises(PlanError, match=message):
        shard_checkpoint(ckpt, out, 2, qk_multiple=1)
    assert main(["shard", str(ckpt), "--tp-size", "2", "--qk-multiple", "1", "--out", str(out),
                 "--quiet"]) == 2
    assert "rank 1's rows 192..384" in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []
    # TP=3 gives each rank 128 rows: block-aligned, and it round-trips.
    shard_checkpoint(ckpt, out, 3, qk_multiple=1)
    assert verify_shards(ckpt, out, numeric=True).ok
    assert oracle.verify(ckpt, out) == []


def test_dequantize_both_grid_layouts():
    weight = np.arange(6 * 5, dtype=np.float32).reshape(6, 5).astype(ml_dtypes.float8_e4m3fn)
    grid = np.array([[1.0, 10.0], [100.0, 1000.0]], np.float32)  # blocks of 4 x 3
    want = weight.astype(np.float32) * np.array(
        [[1, 1, 1, 10, 10]] * 4 + [[100, 100, 100, 1000, 1000]] * 2, np.float32
    )
    assert np.array_equal(kda_tp.model.dequantize(weight, grid, (4, 3)), want)
    assert np.array_equal(kda_tp.model.dequantize(weight, grid[:, None, :, None], (4, 3)), want)
    assert kda_tp.model.dequantize(weight, grid, (4, 3)).dtype == np.float32
    with pytest.raises(ShapeMismatchError, match=r"expected \[2, 2\] \(or \[2, 1, 2, 1\]\)"):
        kda_tp.model.dequantize(weight, grid[:1], (4, 3))


@pytest.mark.slow
def test_k3_real_geometry_fp8_tp2_and_tp8(tmp_path, capsys):
    """Issue acceptance: K3's real KDA shapes in ModelOpt FP8 (one KDA, one MLA layer); the
    MLA layer's FP8 weights and scale grids sliced too (12 heads a rank at TP 8: whole
    128-blocks), as the rank's view slices them."""
    ckpt = write_checkpoint(tmp_path / "k3fp8", "kimi-k3-fp8", 2)
    full = kda_tp.SafetensorsSource(ckpt)
    for tp_size in (2, 8):
        out = tmp_path / f"tp{tp_size}"
        assert main(["shard", str(ckpt), "--tp-size", str(tp_size), "--out", str(out),
                     "--quiet"]) == 0
        assert main(["verify", str(ckpt), str(out), "--numeric"]) == 0
        assert "numerical TP equivalence passes" in capsys.readouterr().out
        rank = kda_tp.SafetensorsSource(rank_dir(out, 3 if tp_size == 8 else 1))
        if tp_size == 8:
            q = rank.get(KDA + "q_proj.weight")
            assert (q.dtype, q.shape) == ("F8_E4M3", (1536, 7168))
            assert rank.get(KDA + "q_proj.weight_scale").shape == (12, 1, 56, 1)
            assert rank.get(KDA + "b_proj.weight_scale").shape == (1, 1, 56, 1)
            assert rank.get(KDA + "o_proj.weight_scale").shape == (56, 1, 12, 1)
            assert np.array_equal(rank.get(KDA + "o_proj.weight_scale").array,
                                  full.get(KDA + "o_proj.weight_scale").array[:, :, 36:48])
            q_b = LAYERS + "1.self_attn.q_b_proj.weight_scale"
            assert np.array_equal(rank.get(q_b).array, full.get(q_b).array[54:72])
        with kda_tp.open_rank(ckpt, tp_rank=3 if tp_size == 8 else 1, tp_size=tp_size,
                              mla=True) as view:
            for name in full.names():
                if name.startswith(LAYERS + "1.self_attn."):
                    assert bytes(rank.get(name).data) == bytes(view[name].data), name
                elif not name.startswith(KDA):
                    assert np.array_equal(rank.get(name).data, full.get(name).data), name
        capsys.readouterr()




@pytest.mark.parametrize("text", ["[1, 2]", '{"quantization": "FP8_PB_WO"}', '"x"', "{}"])
def test_a_malformed_hf_quant_config_is_a_named_error(tmp_path, capsys, text):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "k3_fp8_small", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "hf_quant_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: expected a JSON object"):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(tmp_path / "o")]) == 2
    assert "CheckpointError" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


@pytest.mark.parametrize("block", [(-1, 128), (128, 2**70), ("a", 128), (128,), 5])
def test_a_bad_quant_block_is_a_plan_error(block):
    with pytest.raises(PlanError, match="quant_block"):
        kda_tp.KdaTpPlan(0, 1, 128, 64, 4, 4, 64, quant_block=block)


def test_packed_4bit_weights_under_an_fp8_config_name_the_declared_format(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "k3_fp8_small", ckpt)
    source = kda_tp.SafetensorsSource(ckpt)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    specs = []
    for n in source.names():
        t = source.get(n)
        assert t is not None
        data = bytes(np.asarray(t.data))
        if n == name:
            specs.append((n + "_packed", "U8", list(t.shape), len(data), lambda d=data: d))
        else:
            specs.append((n, t.dtype, list(t.shape), len(data), lambda d=data: d))
    for p in ckpt.glob("model*"):
        p.unlink()
    write_safetensors(ckpt / "model.safetensors", specs)
    with pytest.raises(CheckpointError, match=r"packed 4-bit KDA weights \(ModelOpt FP8_PB_WO "
                                              r"\(128x128 blocks\), whose weights are F8"):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)
