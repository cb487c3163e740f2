"""kda_tp.reference.checkpoint_layer_forward: a checkpoint's KDA layer output, and a rank's part.

The fla fixtures in tests/data (kda_small: Kimi-Linear, k3_small: Kimi K3 with the lower-bounded
gate and padded A_log, k3_fp8_small: the same in ModelOpt FP8 blocks) carry the output ``y`` and
the TP partial outputs computed with flash-linear-attention's ops, not with this project. The
GLM-5.3-Flash checks use a synthetic ``style="glm"`` checkpoint: the config's bound must reach
the output.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp.reference import checkpoint_layer_forward
from kda_tp.synth import write_small_checkpoint

from paths import DATA

TOL = 1e-5  # the fixtures' READMEs: a float32 forward matches y to ~1e-6

# fixture -> {tp_size: partial file name pattern}
PARTIALS = {
    "kda_small": {2: "y_partial_rank{r}.npy", 4: "y_partial_tp4_rank{r}.npy"},
    "k3_small": {2: "y_partial_tp2_rank{r}.npy"},
    "k3_fp8_small": {2: "y_partial_tp2_rank{r}.npy"},
}


@pytest.mark.parametrize("fixture", sorted(PARTIALS))
def test_output_matches_the_fla_fixture(fixture):
    x, y = np.load(DATA / fixture / "x.npy"), np.load(DATA / fixture / "y.npy")
    out = checkpoint_layer_forward(DATA / fixture, 0, x)
    assert out.dtype == np.float32 and out.shape == y.shape
    assert np.max(np.abs(out - y)) < TOL * max(1.0, float(np.max(np.abs(y))))


@pytest.mark.parametrize(
    ("fixture", "tp_size"), [(f, t) for f, sizes in sorted(PARTIALS.items()) for t in sizes]
)
def test_rank_partials_match_the_fla_fixture(fixture, tp_size):
    x = np.load(DATA / fixture / "x.npy")
    source = kda_tp.SafetensorsSource(DATA / fixture)  # a source works as well as a path
    for r in range(tp_size):
        want = np.load(DATA / fixture / PARTIALS[fixture][tp_size].format(r=r))
        got = checkpoint_layer_forward(source, 0, x, tp_rank=r, tp_size=tp_size)
        assert np.max(np.abs(got - want)) < TOL, (fixture, tp_size, r)


@pytest.fixture(scope="module")
def glm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small GLM-5.3-Flash checkpoint (bound -5 from text_config.linear_lower_bound)."""
    return write_small_checkpoint(
        tmp_path_factory.mktemp("glm") / "ckpt", hidden=96, heads=4, head_dim=32,
        conv_kernel=4, gate_rank=32, num_layers=2, kda_layers=[1], seed=3, style="glm",
    )  # fmt: skip


def _with_text_config(src: Path, dst: Path, **changes: object) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["text_config"].update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_glm_output_uses_its_lower_bound(glm, tmp_path):
    x = np.random.default_rng(0).standard_normal((2, 12, 96)).astype(np.float32)
    bounded = checkpoint_layer_forward(glm, 1, x)
    # The same weights read with the bound gone (an explicit null: transformers' softplus gate).
    softplus = checkpoint_layer_forward(
        _with_text_config(glm, tmp_path / "unbounded", linear_lower_bound=None), 1, x
    )
    scale = float(np.max(np.abs(bounded)))
    assert scale > 0 and np.max(np.abs(bounded - softplus)) > 0.05 * scale
    # Independently: the array-level forward with the bound given by hand.
    source = kda_tp.SafetensorsSource(glm)
    prefix = "model.language_model.layers.1.self_attn."
    names = kda_tp.reference.WEIGHT_NAMES + ("g_a_proj", "g_b_proj")
    suffix = {name: name if name in ("A_log", "dt_bias") else f"{name}.weight" for name in names}
    weights = {name: source.get(prefix + suffix[name]).array for name in names}
    assert weights["A_log"].shape == (4,) and weights["A_log"].dtype == np.float32
    by_hand = kda_tp.reference.kda_layer_forward(
        weights, x, head_dim=32, rms_norm_eps=1e-5, gate_lower_bound=-5.0
    )
    assert np.max(np.abs(bounded - by_hand)) < 1e-6 * max(1.0, scale)


def test_glm_rank_partials_sum_to_the_output(glm):
    x = np.random.default_rng(1).standard_normal((1, 9, 96)).astype(np.float32)
    full = checkpoint_layer_forward(glm, 1, x)
    for tp_size in (2, 4):  # 4: one head of 32 per rank, below the sharder's q|k rule
        total = sum(
            checkpoint_layer_forward(glm, 1, x, tp_rank=r, tp_size=tp_size) for r in range(tp_size)
        )
        assert np.max(np.abs(total - full)) < 1e-5 * max(1.0, float(np.max(np.abs(full))))


def test_refusals_name_the_problem(glm):
    x = np.zeros((1, 4, 96), np.float32)
    not_kda = r"layer 0 is not a KDA layer; the KDA layers are \[1\]"
    with pytest.raises(kda_tp.CheckpointError, match=not_kda):
        checkpoint_layer_forward(glm, 0, x)
    with pytest.raises(kda_tp.PlanError, match="tp_size=2 without tp_rank"):
        checkpoint_layer_forward(glm, 1, x, tp_size=2)
    bad_x = r"x: shape \(1, 4, 95\), expected \(batch, seq_len, 96\)"
    with pytest.raises(kda_tp.ShapeMismatchError, match=bad_x):
        checkpoint_layer_forward(glm, 1, np.zeros((1, 4, 95), np.float32))
    with pytest.raises(kda_tp.PlanError, match="divisible"):
        checkpoint_layer_forward(glm, 1, x, tp_rank=0, tp_size=3)
    with pytest.raises(TypeError, match="expected a path or a SafetensorsSource"):
        checkpoint_layer_forward({"hidden_size": 96}, 1, x)


def test_the_numeric_check_passes_on_glm(glm):
    report = kda_tp.reference.check_tp_equivalence(glm, 2, seq_len=8, qk_multiple=1)
    assert report.passed and [entry.layer for entry in report.layers] == [1]


def test_a_config_without_a_layer_list_uses_the_layers_holding_a_log(tmp_path):
    ckpt = shutil.copytree(DATA / "kda_small", tmp_path / "ckpt")
    config = json.loads((ckpt / "config.json").read_text())
    del config["linear_attn_config"]["kda_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    x = np.load(ckpt / "x.npy")
    got = checkpoint_layer_forward(ckpt, 0, x, tp_rank=1, tp_size=2)
    assert np.max(np.abs(got - np.load(ckpt / "y_partial_rank1.npy"))) < TOL
    with pytest.raises(kda_tp.CheckpointError, match=r"the KDA layers are \[0\]"):
        checkpoint_layer_forward(ckpt, 1, x)
