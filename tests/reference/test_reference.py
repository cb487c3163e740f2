"""Tests of the numpy KDA reference forward (kda_tp.reference) against the kda_small fixture.

The fixture (tests/data/kda_small, see its README) was produced with flash-linear-attention, not
with this project. Rank slices here are cut with plain numpy from the fixture's own
``manifest.json`` ``tp_slices``, so these tests do not depend on the Rust plan or slicers.
"""

from __future__ import annotations

import json

import ml_dtypes  # registers bfloat16 with numpy so safetensors can return BF16 arrays
import numpy as np
import pytest
from safetensors import safe_open

from kda_tp.errors import ShapeMismatchError
from kda_tp.reference import WEIGHT_NAMES, kda_layer_forward

from paths import DATA

FIXTURE = DATA / "kda_small"
TOL = 1e-4  # README: a float32 forward matches y to ~1e-6; 1e-4 is safe
WRONG = 1e-3  # every wrong plan must move the summed output by more than this


def _disk_key(name: str) -> str:
    """Manifest / checkpoint suffix of a plan name (A_log and dt_bias have no ``.weight``)."""
    return name if name in ("A_log", "dt_bias") else f"{name}.weight"


@pytest.fixture(scope="module")
def fx() -> dict:
    """The fixture: full weights by plan name, x, y, manifest, config and head_dim."""
    manifest = json.loads((FIXTURE / "manifest.json").read_text())
    config = json.loads((FIXTURE / "config.json").read_text())
    prefix = manifest["tensor_prefix"]
    with safe_open(str(FIXTURE / "model.safetensors"), framework="np") as f:
        names = WEIGHT_NAMES + ("g_a_proj", "g_b_proj")
        weights = {n: f.get_tensor(prefix + _disk_key(n)) for n in names}
    assert weights["q_proj"].dtype == np.dtype(ml_dtypes.bfloat16)
    assert weights["A_log"].dtype == np.float32
    return {
        "weights": weights,
        "x": np.load(FIXTURE / "x.npy"),
        "y": np.load(FIXTURE / "y.npy"),
        "manifest": manifest,
        "eps": config["rms_norm_eps"],
        "head_dim": config["linear_attn_config"]["head_dim"],
    }


def _forward(fx: dict, weights: dict) -> np.ndarray:
    return kda_layer_forward(weights, fx["x"], head_dim=fx["head_dim"], rms_norm_eps=fx["eps"])


def _rank_weights(fx: dict, tp: int) -> list[dict]:
    """Each rank's local weights, cut from the full ones with the manifest's [dim, start, stop]."""
    ranks = []
    for rank_slices in fx["manifest"]["tp_slices"][str(tp)]:
        local = {}
        for name, full in fx["weights"].items():
            spec = rank_slices[_disk_key(name)]
            if spec is None:
                local[name] = full
            else:
                dim, start, stop = spec
                index = [slice(None)] * full.ndim
                index[dim] = slice(start, stop)
                local[name] = full[tuple(index)]
        ranks.append(local)
    return ranks


def _max_abs(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)))


def test_full_forward_matches_fla_output(fx):
    y = _forward(fx, fx["weights"])
    assert y.dtype == np.float32 and y.shape == fx["y"].shape
    assert _max_abs(y, fx["y"]) < TOL


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_partials_match_fixture_and_sum_to_output(fx, tp):
    files = fx["manifest"]["partial_files"][str(tp)]
    partials = [_forward(fx, w) for w in _rank_weights(fx, tp)]
    assert len(partials) == len(files) == tp
    for partial, file in zip(partials, files):
        assert _max_abs(partial, np.load(FIXTURE / file)) < TOL, file
    assert _max_abs(sum(partials), fx["y"]) < TOL


def test_norm_eps_comes_from_config(fx):
    assert fx["eps"] == 1e-5
    wrong_eps = kda_layer_forward(
        fx["weights"], fx["x"], head_dim=fx["head_dim"], rms_norm_eps=1e-6
    )
    assert _max_abs(wrong_eps, fx["y"]) > WRONG


def test_accepts_2d_conv_and_1d_a_log(fx):
    weights = dict(fx["weights"])
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        weights[name] = weights[name][:, 0, :]
    weights["A_log"] = weights["A_log"].reshape(-1)
    assert _max_abs(_forward(fx, weights), fx["y"]) < TOL


def test_output_is_causal(fx):
    x = fx["x"].copy()
    x[:, -1] += 1.0
    y = kda_layer_forward(fx["weights"], x, head_dim=fx["head_dim"], rms_norm_eps=fx["eps"])
    assert np.array_equal(y[:, :-1], _forward(fx, fx["weights"])[:, :-1])
    assert _max_abs(y[:, -1], fx["y"][:, -1]) > WRONG


def test_any_geometry_splits_over_heads():
    """3 heads of width 8, hidden 20 (!= 24 channels), kernel 3, gate rank 5, batch 2."""
    rng = np.random.default_rng(7)
    heads, dim, hidden, kernel, rank = 3, 8, 20, 3, 5
    channels = heads * dim

    def rand(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.3

    full = {
        "q_proj": rand(channels, hidden),
        "k_proj": rand(channels, hidden),
        "v_proj": rand(channels, hidden),
        "q_conv1d": rand(channels, 1, kernel),
        "k_conv1d": rand(channels, kernel),
        "v_conv1d": rand(channels, 1, kernel),
        "f_a_proj": rand(rank, hidden),
        "f_b_proj": rand(channels, rank),
        "g_a_proj": rand(rank, hidden),
        "g_b_proj": rand(channels, rank),
        "b_proj": rand(heads, hidden),
        "A_log": np.log(rng.uniform(1, 16, heads)).astype(np.float32),
        "dt_bias": rand(channels),
        "o_norm": 1.0 + rand(dim),
        "o_proj": rand(hidden, channels),
    }
    x = rng.standard_normal((2, 7, hidden)).astype(np.float32)
    y = kda_layer_forward(full, x, head_dim=dim)
    assert y.shape == (2, 7, hidden) and np.all(np.isfinite(y))
    partials = []
    for h in range(heads):
        ch = slice(h * dim, (h + 1) * dim)
        local = {n: a[ch] for n, a in full.items() if n in ("q_proj", "k_proj", "v_proj")}
        local |= {n: full[n][ch] for n in ("q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj")}
        local |= {n: full[n][ch] for n in ("g_b_proj", "dt_bias")}
        local |= {n: full[n] for n in ("f_a_proj", "g_a_proj", "o_norm")}
        local |= {
            "b_proj": full["b_proj"][h : h + 1],
            "A_log": full["A_log"][h : h + 1],
            "o_proj": full["o_proj"][:, ch],
        }
        partials.append(kda_layer_forward(local, x, head_dim=dim))
    assert _max_abs(sum(partials), y) < 1e-5 * max(1.0, float(np.abs(y).max()))


@pytest.mark.parametrize(
    ("name", "bad_shape"),
    [("dt_bias", (255,)), ("o_proj", (256, 128)), ("A_log", (1, 4)), ("q_conv1d", (256, 1, 1, 4))],
)
def test_shape_mismatch_names_tensor(fx, name, bad_shape):
    weights = dict(fx["weights"])
    weights[name] = np.zeros(bad_shape, np.float32)
    with pytest.raises(ShapeMismatchError, match=name) as info:
        _forward(fx, weights)
    assert str(bad_shape) in str(info.value)


def test_rejects_bad_input_and_missing_weight(fx):
    with pytest.raises(ShapeMismatchError, match="x: shape"):
        kda_layer_forward(fx["weights"], fx["x"][0], head_dim=fx["head_dim"])
    with pytest.raises(ShapeMismatchError, match="q_proj"):
        kda_layer_forward(fx["weights"], fx["x"][..., :128], head_dim=fx["head_dim"])
    weights = {n: a for n, a in fx["weights"].items() if n != "o_norm"}
    with pytest.raises(KeyError, match="o_norm"):
        _forward(fx, weights)


# Wrong TP=2 plans, as numpy mutations of the correct rank slices. Each keeps every local shape
# right, so only the numbers can reveal it. Arguments: full weights, correct per-rank weights.


def _o_proj_rows_read_as_columns(full, ranks):
    """o_proj's rank bytes cut as a row block (half of the flat buffer), read in column shape."""
    o_proj = full["o_proj"]
    rows = o_proj.shape[0] // len(ranks)
    return [
        {**w, "o_proj": o_proj[r * rows : (r + 1) * rows].reshape(w["o_proj"].shape)}
        for r, w in enumerate(ranks)
    ]


def _dt_bias_at_head_offset(full, ranks):
    """dt_bias sliced from rank * local_heads (a head offset) instead of the channel offset."""
    out = []
    for r, w in enumerate(ranks):
        width = w["dt_bias"].shape[0]
        start = r * w["A_log"].size
        out.append({**w, "dt_bias": full["dt_bias"][start : start + width]})
    return out


def _a_log_of_rank0_everywhere(full, ranks):
    return [{**w, "A_log": ranks[0]["A_log"]} for w in ranks]


def _q_conv_of_other_rank(full, ranks):
    return [{**w, "q_conv1d": ranks[(r + 1) % len(ranks)]["q_conv1d"]} for r, w in enumerate(ranks)]


def _same_head_range_twice(full, ranks):
    return [ranks[0]] * len(ranks)


@pytest.mark.parametrize(
    "mutate",
    [
        _o_proj_rows_read_as_columns,
        _dt_bias_at_head_offset,
        _a_log_of_rank0_everywhere,
        _q_conv_of_other_rank,
        _same_head_range_twice,
    ],
)
def test_wrong_tp2_plan_changes_sum(fx, mutate):
    ranks = _rank_weights(fx, 2)
    wrong = mutate(fx["weights"], ranks)
    for good, bad in zip(ranks, wrong):
        assert {n: a.shape for n, a in bad.items()} == {n: a.shape for n, a in good.items()}
    assert _max_abs(sum(_forward(fx, w) for w in wrong), fx["y"]) > WRONG
