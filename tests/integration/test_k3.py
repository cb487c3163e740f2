"""Kimi K3 end to end: wrapper config, full-rank output gate, zero-padded ``A_log``, MLA layers
whose ``g_proj``/``o_proj`` carry the KDA names, transformers' native ``kimi_linear`` configs.

``tests/data/k3_small`` was made with flash-linear-attention (see its README): hidden 128,
4 KDA heads of 64, ``A_log`` F32 ``[16]`` (4 heads + 12 zeros), layer 1 MLA, a vision tower.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import kda_tp
import numpy as np
import pytest
from kda_tp import oracle
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError
from kda_tp.reference import kda_layer_forward, layer_weights
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_checkpoint, write_small_checkpoint

from paths import DATA
from fixture_checks import assert_rank_partials, cli_shard_and_verify

FIXTURE = DATA / "k3_small"
LAYERS = "language_model.model.layers."
KDA = LAYERS + "0.self_attn."
MLA = LAYERS + "1.self_attn."
BOUND = -5.0  # the fixture's gate_lower_bound


def test_the_fixture_config_and_plan():
    plan = kda_tp.KdaTpPlan.from_config(FIXTURE, 1, 2)
    assert (plan.hidden, plan.full_heads, plan.head_dim, plan.gate_rank) == (128, 4, 64, 64)
    assert plan.full_rank_gate and plan.a_log_len == 16
    assert plan.get("g_a_proj") is None and plan.get("g_b_proj") is None
    assert len(plan.tensors) == 14
    assert plan["g_proj"].kind == kda_tp.KdaShard.CHANNEL_ROWS
    assert plan["g_proj"].local_shape([256, 128]) == (128, 128)
    assert plan["A_log"].local_shape([16]) == (2,)
    assert plan["A_log"].byte_range == (8, 16)  # heads 2 and 3, not entries 8..16
    # dtypes come per tensor from the checkpoint: F32 convs, A_log, dt_bias, o_norm.
    assert {t.name for t in plan.tensors if t.dtype == "F32"} == {
        "q_conv1d", "k_conv1d", "v_conv1d", "A_log", "dt_bias", "o_norm"
    }
    # A bare config knows the gate form but not the padding.
    bare = kda_tp.KdaTpPlan.from_config(FIXTURE / "config.json", 0, 2)
    assert bare.full_rank_gate and bare.a_log_len == 4
    assert pickle.loads(pickle.dumps(plan)) == plan


def test_reference_forward_on_each_ranks_slices_matches_the_fixture():
    source = kda_tp.SafetensorsSource(FIXTURE)
    x, y = np.load(FIXTURE / "x.npy"), np.load(FIXTURE / "y.npy")

    def rank_weights(rank: int) -> dict[str, np.ndarray]:
        plan = kda_tp.KdaTpPlan.from_config(source, rank, 2)
        local = layer_weights(kda_tp.KdaShardedSource(source, plan), 0, LAYERS, plan)
        assert local["A_log"].shape == (2,)
        return local

    assert_rank_partials(FIXTURE, rank_weights, gate_lower_bound=BOUND)
    # The full weights, padded A_log included, give y.
    full = layer_weights(source, 0, LAYERS, kda_tp.KdaTpPlan.from_config(source, 0, 2))
    assert full["A_log"].shape == (16,)
    assert np.max(np.abs(kda_layer_forward(full, x, head_dim=64, gate_lower_bound=BOUND) - y)) < 1e-5
    # Without the lower bound (Kimi-Linear's softplus gate) the output is far off.
    unbounded = kda_layer_forward(full, x, head_dim=64)
    assert np.max(np.abs(unbounded - y)) > 0.1


class _EvenSplitOfThePadding:
    """A rank view handing out ``A_log`` split evenly over the 16 stored entries: the known
    wrong answer (rank 1 gets entries 8..16, zero padding, instead of heads 2 and 3)."""

    def __init__(self, source, plan, layers):
        self._inner = kda_tp.KdaShardedSource(source, plan, layers)
        stored = source.get(KDA + "A_log").array
        share = stored.size // plan.tp_size
        self._a_log = stored[plan.tp_rank * share : (plan.tp_rank + 1) * share]

    def get(self, name):
        if name == KDA + "A_log":
            return type("Record", (), {"array": self._a_log})()
        return self._inner[name]


def test_an_even_split_of_the_padded_a_log_fails_the_numeric_check():
    good = kda_tp.reference.check_tp_equivalence(FIXTURE, 2)
    assert good.passed and good.layers[0].max_abs_error < 1e-5
    bad = kda_tp.reference.check_tp_equivalence(FIXTURE, 2,
                                                shard_source_factory=_EvenSplitOfThePadding)
    assert not bad.passed
    assert bad.layers[0].max_abs_error > 0.1  # the fixture manifest measured 0.36


@pytest.mark.parametrize(("tp_size", "extra"), [(2, []), (4, ["--qk-multiple", "1"])])
def test_cli_plan_shard_verify_numeric_on_the_fixture(tmp_path, capsys, tp_size, extra):
    out = tmp_path / "out"
    assert main(["plan", str(FIXTURE), "--tp-size", str(tp_size), *extra]) == 0
    table = capsys.readouterr().out
    assert "g_proj" in table and "g_a_proj" not in table
    assert "A_log stores 16 entries for 4 heads" in table
    cli_shard_and_verify(FIXTURE, out, tp_size, capsys, *extra)
    assert oracle.verify(FIXTURE, out) == []
    full = kda_tp.SafetensorsSource(FIXTURE)
    a_log = full.get(KDA + "A_log").array
    heads = 4 // tp_size
    for r in range(tp_size):
        rank = kda_tp.SafetensorsSource(rank_dir(out, r))
        assert np.array_equal(rank.get(KDA + "A_log").array, a_log[r * heads : (r + 1) * heads])
        assert rank.get(KDA + "g_proj.weight").shape == (256 // tp_size, 128)
        assert rank.get(KDA + "o_proj.weight").shape == (128, 256 // tp_size)
        # MLA layer 1's g_proj/o_proj have the KDA names and shapes, the vision tower has
        # self_attn.q_proj: all byte-identical to the input, as is everything outside layer 0.
        for name in full.names():
            if not name.startswith(KDA):
                assert rank.get(name).shape == full.get(name).shape, name
                assert np.array_equal(rank.get(name).data, full.get(name).data), name
        assert rank.get(MLA + "g_proj.weight").shape == (256, 128)


def _rewrite(tmp_path: Path, change: dict[str, np.ndarray | None], config=None) -> Path:
    """A one-file copy of the fixture with tensors replaced (array), added (array) or removed
    (None), and optionally another config dict."""
    source = kda_tp.SafetensorsSource(FIXTURE)
    arrays = {name: source.get(name).array for name in source.names()}
    for name, array in change.items():
        if array is None:
            del arrays[name]
        else:
            arrays[name] = array
    out = tmp_path / "ckpt"
    out.mkdir(parents=True)
    dtypes = {np.dtype(kda_tp.model.numpy_dtype(d)): d for d in ("BF16", "F32")}
    write_safetensors(
        out / "model.safetensors",
        [(n, dtypes[a.dtype], a.shape, a.nbytes, lambda a=a: np.ascontiguousarray(a))
         for n, a in arrays.items()],
    )
    config = config or json.loads((FIXTURE / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(config))
    return out


def _bf16(shape) -> np.ndarray:
    return np.full(shape, 0.5, dtype=kda_tp.model.numpy_dtype("BF16"))


def _low_rank_config() -> dict:
    config = json.loads((FIXTURE / "config.json").read_text())
    config["text_config"]["linear_attn_config"]["use_full_rank_gate"] = False
    return config


def _padded_a_log(value: float, index: int) -> dict:
    a_log = kda_tp.SafetensorsSource(FIXTURE).get(KDA + "A_log").array.copy()
    a_log[index] = value
    return {KDA + "A_log": a_log}


@pytest.mark.parametrize(
    ("change", "config", "error", "message"),
    [
        (_padded_a_log(0.5, 9), None, CheckpointError,
         r"language_model\.model\.layers\.0\.self_attn\.A_log: padding entry 9 is 0\.5, "
         r"expected 0"),
        ({KDA + "g_a_proj.weight": _bf16((64, 128))}, None, CheckpointError,
         r"g_a_proj\.weight: the config sets linear_attn_config\.use_full_rank_gate"),
        ({KDA + "g_proj.weight": _bf16((256, 64))}, None, ShapeMismatchError,
         r"self_attn\.g_proj\.weight: .*on-disk shape \[256, 64\]"),
        ({KDA + "g_proj.weight": None, KDA + "g_a_proj.weight": _bf16((64, 128)),
          KDA + "g_b_proj.weight": _bf16((256, 64))}, None, CheckpointError,
         r"the config sets linear_attn_config\.use_full_rank_gate .* holds the low-rank"),
        ({}, _low_rank_config(), CheckpointError,
         r"g_proj\.weight: this KDA layer holds a full-rank g_proj, but the config does not set"),
    ],
    ids=["nonzero-padding", "g_proj-and-g_a_proj", "g_proj-wrong-shape", "config-full-disk-low",
         "config-low-disk-full"],
)
def test_refusals_name_the_tensor_and_leave_no_output(
    tmp_path, capsys, change, config, error, message
):
    ckpt = _rewrite(tmp_path, change, config)
    out = tmp_path / "out"
    with pytest.raises(error, match=message):
        shard_checkpoint(ckpt, out, 2)
    assert not out.exists() or list(out.iterdir()) == []
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    assert error.__name__ in capsys.readouterr().err
    assert not out.exists() or list(out.iterdir()) == []


def test_the_oracle_flags_a_nonzero_padding(tmp_path):
    good = _rewrite(tmp_path / "good", {})
    bad = _rewrite(tmp_path / "bad", _padded_a_log(-1.25, 15))
    out = tmp_path / "out"
    shard_checkpoint(good, out, 2)
    assert oracle.verify(good, out) == []
    assert any("padding entry 15 is -1.25, expected 0" in p for p in oracle.verify(bad, out))


def _as_native(config: dict, older_spelling: bool, layer_type: str) -> dict:
    """``config`` (a text config with ``linear_attn_config``) in transformers' native
    ``kimi_linear`` keys, layer 0 of ``layer_type`` and layer 1 full attention; in place."""
    linear = config.pop("linear_attn_config")
    dim, heads = ("linear_head_dim", "linear_num_heads") if older_spelling else (
        "linear_key_head_dim", "linear_num_key_heads")
    config.update({dim: linear["head_dim"], heads: linear["num_heads"],
                   "linear_conv_kernel_dim": linear["short_conv_kernel_size"],
                   "layer_types": [layer_type, "full_attention"]})
    return config


def _native_config(older_spelling: bool, layer_type: str) -> dict:
    """The fixture's config in transformers' native ``kimi_linear`` keys (no wrapper)."""
    text = json.loads((FIXTURE / "config.json").read_text())["text_config"]
    return _as_native(text, older_spelling, layer_type)


@pytest.mark.parametrize(("older", "layer_type"),
                         [(False, "kda_attention"), (True, "linear_attention")])
def test_native_kimi_linear_configs_shard_and_verify(tmp_path, older, layer_type):
    # The native config has no K3 gate keys: use a Kimi-Linear-style (low-rank gate) checkpoint.
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=96, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=16, num_layers=2, kda_layers=[0])
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps(_as_native(config, older, layer_type)))
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    report = verify_shards(ckpt, out, numeric=True)
    assert report.ok and report.numeric.passed, report.problems
    assert oracle.verify(ckpt, out) == []
    # The same keys describe the K3 fixture's geometry, read from text_config or flat.
    parsed = kda_tp.model.parse_config(_native_config(older, layer_type))
    assert (parsed.heads, parsed.head_dim, parsed.kda_layers) == (4, 64, (0,))


@pytest.mark.parametrize(
    ("config", "why"),
    [
        ({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
          "num_attention_heads": 32}, "no linear_attn_config"),
        ({"model_type": "kimi_k3", "text_config": {"model_type": "llama", "hidden_size": 8}},
         "no linear_attn_config"),
        ({"hidden_size": 8, "linear_attn_config": {"head_dim": 64, "num_heads": 4,
          "short_conv_kernel_size": 4, "kda_layers": []}}, "kda_layers' is empty"),
        ({"hidden_size": 8, "linear_key_head_dim": 64, "linear_num_key_heads": 4,
          "linear_conv_kernel_dim": 4, "layer_types": ["full_attention"]}, "'kda_attention'"),
    ],
    ids=["llama", "wrapped-llama", "empty-kda-layers", "no-linear-layer-type"],
)
def test_a_config_with_no_kda_layer_is_refused(tmp_path, capsys, config, why):
    with pytest.raises(CheckpointError, match=f"no KDA layers: .*{why}"):
        kda_tp.KdaTpPlan.from_config(config, 0, 2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path / "config.json"), "--tp-size", "2"]) == 2
    assert "no KDA layers" in capsys.readouterr().err
    # The oracle says the same, in its own words.
    with pytest.raises(CheckpointError, match="no KDA layers"):
        oracle.read_kda_config(config)


@pytest.mark.parametrize("bad", [0, 1, -0.0, "x", True, float("inf")])
def test_config_gate_keys_are_checked(bad):
    config = json.loads((FIXTURE / "config.json").read_text())
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = bad
    with pytest.raises(CheckpointError, match="gate_lower_bound"):
        kda_tp.model.parse_config(config)
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = -5.0
    config["text_config"]["linear_attn_config"]["use_full_rank_gate"] = "yes"
    with pytest.raises(CheckpointError, match="use_full_rank_gate"):
        kda_tp.model.parse_config(config)


def test_k3_tp_sizes_divide_96_and_64_is_refused_with_the_valid_sizes():
    valid = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]
    for tp in valid:
        plan = kda_tp.KdaTpPlan(tp - 1, tp, 7168, 128, 96, 4, 128, full_rank_gate=True,
                                a_log_len=128)
        assert plan["A_log"].local_rows == 96 // tp
    with pytest.raises(PlanError, match="tp_size may be one of 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, "
                                        "48, 96"):
        kda_tp.KdaTpPlan(0, 64, 7168, 128, 96, 4, 128, full_rank_gate=True, a_log_len=128)
    with pytest.raises(PlanError, match="A_log stores 95 entries, fewer than the 96 heads"):
        kda_tp.KdaTpPlan(0, 8, 7168, 128, 96, 4, 128, a_log_len=95)
    # The oracle agrees on the valid sizes and the refusal.
    assert [tp for tp in range(1, 97) if 96 % tp == 0] == valid
    with pytest.raises(PlanError):
        oracle.plan(0, 64, 7168, 128, 96, 4, 128, full_rank_gate=True, a_log_len=128)


def test_a_small_synthetic_k3_checkpoint_round_trips(tmp_path):
    """The synth K3 layout: wrapper config, language_model. prefix, MLA with colliding names,
    vision tower; two KDA layers around an MLA one."""
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=64, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=16, num_layers=3, kda_layers=[0, 2],
                                  style="k3", a_log_len=10)
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    report = verify_shards(ckpt, out, numeric=True)
    assert report.ok and [e.layer for e in report.numeric.layers] == [0, 2], report.problems
    assert oracle.verify(ckpt, out) == []
    full = kda_tp.SafetensorsSource(ckpt)
    assert full.get(LAYERS + "0.self_attn.A_log").shape == (10,)
    assert not full.get(LAYERS + "0.self_attn.A_log").array[4:].any()
    assert full.get(LAYERS + "1.self_attn.g_proj.weight").shape == (256, 64)  # MLA, KDA's shape
    rank1 = kda_tp.SafetensorsSource(rank_dir(out, 1))
    # Both are sliced, each by its own layer's plan (MLA: 4 heads of v_head_dim 64 over 2).
    assert rank1.get(LAYERS + "1.self_attn.g_proj.weight").shape == (128, 64)
    assert rank1.get(LAYERS + "2.self_attn.g_proj.weight").shape == (128, 64)
    assert rank1.get("vision_tower.encoder.blocks.0.self_attn.q_proj.weight").shape == (256, 256)


@pytest.mark.slow
def test_k3_real_geometry_tp2_and_tp8(tmp_path, capsys):
    """Issue acceptance on K3's real KDA geometry (hidden 7168, 96 heads of 128): one KDA layer
    (0.89 GB) and one MLA layer with the colliding g_proj/o_proj names."""
    ckpt = write_checkpoint(tmp_path / "k3", "kimi-k3", 2)
    full = kda_tp.SafetensorsSource(ckpt)
    for tp_size in (2, 8):
        out = tmp_path / f"tp{tp_size}"
        assert main(["plan", str(ckpt), "--tp-size", str(tp_size)]) == 0
        cli_shard_and_verify(ckpt, out, tp_size, capsys)
        rank = kda_tp.SafetensorsSource(rank_dir(out, 3 if tp_size == 8 else 1))
        if tp_size == 8:
            assert rank.get(KDA + "A_log").shape == (12,)
            assert rank.get(KDA + "g_proj.weight").shape == (1536, 7168)
            assert rank.get(KDA + "o_proj.weight").shape == (7168, 1536)
            assert np.array_equal(rank.get(KDA + "A_log").array,
                                  full.get(KDA + "A_log").array[36:48])
        r = 3 if tp_size == 8 else 1
        mla = oracle.mla_plan(r, tp_size, **oracle.read_mla_geometry(
            json.loads((ckpt / "config.json").read_text())))
        for name in full.names():
            if name.startswith(KDA):
                continue
            if name.startswith(LAYERS + "1.self_attn."):  # MLA: the oracle's slice of each
                entry = mla.get(oracle.plan_name(name.split(".self_attn.")[1]))
                assert entry is not None, name
                assert bytes(rank.get(name)) == oracle.shard_bytes(entry, bytes(full.get(name)))
            else:
                assert np.array_equal(rank.get(name).data, full.get(name).data), name
        shutil.rmtree(out)




def test_a_gate_lower_bound_beyond_float32_is_refused():
    """An unknown model_type: any bound below 0 float32 holds (Kimi's own range: test_config)."""
    config = json.loads((DATA / "k3_small" / "config.json").read_text())
    config["model_type"] = config["text_config"]["model_type"] = "my_kda_model"
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = -1e308
    with pytest.raises(CheckpointError, match="gate_lower_bound' = -1e\\+308 is not a number"):
        kda_tp.model.parse_config(config)
