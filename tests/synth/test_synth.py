"""Tests of synthetic checkpoints (kda_tp.synth): small Kimi- and GLM-style checkpoints, random
and real geometries (a few hundred MB each, marked slow), dtypes, seeds, files and errors.

Checkpoints are read back with the ``safetensors`` package (which validates the layout) and
checked against the KDA shapes written down here, not taken from the plan.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # registers bfloat16 with numpy so safetensors can return BF16 arrays
import numpy as np
import pytest
from safetensors import safe_open

from kda_tp.model.dtypes import DTYPE_SIZES
from kda_tp.synth import checkpoints as synth
from kda_tp.errors import DtypeMismatchError, OutputError, PlanError

from checkpoint_files import read_file


# ----------------------------------------------------------------------------------------------
# helpers


def read_checkpoint(directory: Path) -> tuple[dict, dict, dict]:
    """(config, index, {name: (file name, dtype, shape)}) of a synthetic checkpoint."""
    config = json.loads((directory / "config.json").read_text())
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    tensors = {}
    for file_name in sorted(set(index["weight_map"].values())):
        with safe_open(str(directory / file_name), framework="np") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                view = f.get_slice(name)
                assert name not in tensors
                tensors[name] = (file_name, view.get_dtype(), tuple(view.get_shape()))
    return config, index, tensors


def load(directory: Path, name: str) -> np.ndarray:
    """One tensor of a checkpoint as a numpy array (BF16 as ml_dtypes.bfloat16)."""
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    with safe_open(str(directory / index["weight_map"][name]), framework="np") as f:
        return f.get_tensor(name)


def expected_kda_shapes(
    hidden, heads, head_dim, conv_kernel, gate_rank, *, flat_a_log=False, flat_conv=False
) -> dict[str, tuple[int, ...]]:
    """On-disk shape of each KDA ``self_attn`` tensor, by name suffix."""
    c = heads * head_dim
    conv = (c, conv_kernel) if flat_conv else (c, 1, conv_kernel)
    return {
        "q_proj.weight": (c, hidden), "k_proj.weight": (c, hidden), "v_proj.weight": (c, hidden),
        "q_conv1d.weight": conv, "k_conv1d.weight": conv, "v_conv1d.weight": conv,
        "f_a_proj.weight": (gate_rank, hidden), "g_a_proj.weight": (gate_rank, hidden),
        "f_b_proj.weight": (c, gate_rank), "g_b_proj.weight": (c, gate_rank),
        "b_proj.weight": (heads, hidden),
        "A_log": (heads,) if flat_a_log else (1, 1, heads, 1),
        "dt_bias": (c,),
        "o_norm.weight": (head_dim,),
        "o_proj.weight": (hidden, c),
    }  # fmt: skip


def check_index(directory: Path, index: dict, tensors: dict) -> None:
    """The index names every tensor once, with its file, and the right total_size."""
    assert index["weight_map"] == {name: t[0] for name, t in tensors.items()}
    assert list(index["weight_map"]) == sorted(index["weight_map"])
    total = sum(
        int(np.prod(shape)) * DTYPE_SIZES[dtype] for _f, dtype, shape in tensors.values()
    )
    assert index["metadata"] == {"total_size": total}
    files = sorted(set(index["weight_map"].values()))
    assert len(files) >= 2
    assert files == [
        f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)
    ]
    on_disk = sorted(p.name for p in directory.iterdir())
    assert on_disk == sorted(files + ["config.json", "model.safetensors.index.json"])


# ----------------------------------------------------------------------------------------------
# synth: small checkpoints


def test_bf16_encoding_rounds_to_nearest_even():
    rng = np.random.default_rng(5)
    values = np.concatenate([
        rng.standard_normal(10000, dtype=np.float32) * 0.02,
        rng.standard_normal(1000, dtype=np.float32) * 1e4,
        # exact ties (low half 0x8000) with an even and an odd kept bit, a carry, and zero
        np.array(
            [0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000, 0x3F80FFFF, 0], np.uint32
        ).view(np.float32),
    ])  # fmt: skip
    ours = synth._encode(values, "BF16")
    assert ours.dtype == np.dtype("<u2")
    assert ours.tolist() == values.astype(ml_dtypes.bfloat16).view(np.uint16).tolist()


def test_small_kimi_style_checkpoint(tmp_path):
    out = synth.write_small_checkpoint(
        tmp_path / "ck", hidden=96, heads=4, head_dim=16, conv_kernel=3, gate_rank=8,
        num_layers=5, kda_layers=[0, 2, 3], seed=7, style="kimi", vocab_size=50,
    )  # fmt: skip
    assert out == tmp_path / "ck"
    config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)

    assert config["architectures"] == ["KimiLinearForCausalLM"]
    assert config["model_type"] == "kimi_linear"
    assert config["hidden_size"] == 96 and config["num_hidden_layers"] == 5
    assert config["vocab_size"] == 50 and config["torch_dtype"] == "bfloat16"
    assert config["rms_norm_eps"] == 1e-5
    assert config["linear_attn_config"] == {
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 3,
        "kda_layers": [1, 3, 4], "full_attn_layers": [2, 5],
    }  # fmt: skip
    assert config["q_lora_rank"] is None
    assert (
        config["kv_lora_rank"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
    ) == (64, 16, 8, 16)

    kda = expected_kda_shapes(96, 4, 16, 3, 8)
    for i in (0, 2, 3):
        for suffix, shape in kda.items():
            dtype = "F32" if suffix in ("A_log", "dt_bias") else "BF16"
            assert tensors[f"model.layers.{i}.self_attn.{suffix}"][1:] == (dtype, shape)
    mla = {
        "q_proj.weight": (4 * 24, 96), "kv_a_proj_with_mqa.weight": (64 + 8, 96),
        "kv_a_layernorm.weight": (64,), "kv_b_proj.weight": (4 * 32, 64), "o_proj.weight": (96, 64),
    }  # fmt: skip
    for i in (1, 4):
        attn = {
            n.split("self_attn.")[1]: t[2]
            for n, t in tensors.items()
            if n.startswith(f"model.layers.{i}.self_attn.")
        }
        assert attn == mla
    for i in range(5):
        for norm in ("input_layernorm.weight", "post_attention_layernorm.weight"):
            assert tensors[f"model.layers.{i}.{norm}"][1:] == ("BF16", (96,))
    assert tensors["model.embed_tokens.weight"][1:] == ("BF16", (50, 96))
    assert tensors["lm_head.weight"][1:] == ("BF16", (50, 96))
    assert tensors["model.norm.weight"][1:] == ("BF16", (96,))
    assert len(tensors) == 3 + 5 * 2 + 3 * 15 + 2 * 5

    for name in tensors:
        assert np.isfinite(load(out, name).astype(np.float32)).all(), name
    a_log = load(out, "model.layers.0.self_attn.A_log")
    assert a_log.dtype == np.float32 and (a_log >= 0).all() and (a_log <= np.log(16)).all()


def test_small_glm_style_checkpoint(tmp_path):
    """GLM-5.3-Flash as transformers writes it: glm5_next wrapper, lower-bounded gate, A_log
    [H] and convs in F32, MLA (DSA) layers under model.language_model."""
    out = synth.write_small_checkpoint(
        tmp_path / "ck", hidden=64, heads=8, head_dim=8, conv_kernel=4, gate_rank=8,
        num_layers=3, kda_layers=[1, 2], seed=3, style="glm",
    )  # fmt: skip
    config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)
    assert config["architectures"] == ["Glm5NextForConditionalGeneration"]
    assert config["model_type"] == "glm5_next"
    text = config["text_config"]
    assert text["model_type"] == "glm5_next_text"
    assert text["layer_types"] == ["indexed_attention", "linear_attention", "linear_attention"]
    assert (
        text["linear_head_dim"], text["linear_num_heads"], text["linear_conv_kernel_dim"]
    ) == (8, 8, 4)
    assert text["linear_lower_bound"] == -5.0
    assert text["hidden_size"] == 64 and text["num_hidden_layers"] == 3
    assert "linear_attn_config" not in text

    layers = "model.language_model.layers."
    for i in (1, 2):
        for suffix, shape in expected_kda_shapes(64, 8, 8, 4, 8, flat_a_log=True).items():
            assert tensors[f"{layers}{i}.self_attn.{suffix}"][2] == shape
        for suffix in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "A_log"):
            assert tensors[f"{layers}{i}.self_attn.{suffix}"][1] == "F32"
    mla = {
        n.split("self_attn.")[1]: t[2]
        for n, t in tensors.items()
        if n.startswith(f"{layers}0.self_attn.")
    }
    assert mla == {
        "q_a_proj.weight": (96, 64), "q_a_layernorm.weight": (96,), "q_b_proj.weight": (64, 96),
        "kv_a_proj_with_mqa.weight": (32, 64), "kv_a_layernorm.weight": (32,),
        "kv_b_proj.weight": (128, 32), "o_proj.weight": (64, 64),
    }  # fmt: skip
    assert {"model.language_model.embed_tokens.weight", "lm_head.weight"} <= set(tensors)


@pytest.mark.parametrize("case", range(6))
def test_random_small_geometries(tmp_path, case):
    rng = np.random.default_rng(100 + case)
    heads = int(rng.choice([1, 2, 3, 4, 6, 8]))
    head_dim = int(rng.choice([1, 4, 8, 16, 32]))
    hidden = int(rng.integers(1, 200))
    conv_kernel = int(rng.integers(1, 6))
    gate_rank = int(rng.integers(1, 40))
    num_layers = int(rng.integers(1, 5))
    kda_layers = sorted(
        int(i)
        for i in rng.choice(num_layers, size=int(rng.integers(0, num_layers + 1)), replace=False)
    )
    style = ("kimi", "glm")[case % 2]
    out = synth.write_small_checkpoint(
        tmp_path, hidden, heads, head_dim, conv_kernel, gate_rank, num_layers, kda_layers,
        seed=case, style=style, flat_a_log=bool(case & 2), flat_conv=bool(case & 4),
    )  # fmt: skip
    config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)
    expected = expected_kda_shapes(
        hidden,
        heads,
        head_dim,
        conv_kernel,
        gate_rank,
        flat_a_log=bool(case & 2) or style == "glm",
        flat_conv=bool(case & 4),
    )
    layers = "model.layers." if style == "kimi" else "model.language_model.layers."
    for i in kda_layers:
        for suffix, shape in expected.items():
            assert tensors[f"{layers}{i}.self_attn.{suffix}"][2] == shape
    for i in set(range(num_layers)) - set(kda_layers):
        assert f"{layers}{i}.self_attn.dt_bias" not in tensors
    if style == "kimi":
        assert config["linear_attn_config"]["kda_layers"] == [i + 1 for i in kda_layers]
    else:
        assert [t == "linear_attention" for t in config["text_config"]["layer_types"]] == [
            i in kda_layers for i in range(num_layers)
        ]


@pytest.mark.parametrize(("weight_dtype", "np_dtype"), [("F16", np.float16), ("F32", np.float32)])
def test_weight_dtype_option(tmp_path, weight_dtype, np_dtype):
    out = synth.write_small_checkpoint(tmp_path, 32, 2, 8, 4, 8, 1, [0], weight_dtype=weight_dtype)
    config, _index, tensors = read_checkpoint(out)
    assert config["torch_dtype"] == {"F16": "float16", "F32": "float32"}[weight_dtype]
    for name, (_f, dtype, _shape) in tensors.items():
        assert dtype == ("F32" if name.endswith(("A_log", "dt_bias")) else weight_dtype)
    assert load(out, "model.layers.0.self_attn.q_proj.weight").dtype == np_dtype


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path):
    args = {
        "hidden": 256, "heads": 4, "head_dim": 64, "conv_kernel": 4, "gate_rank": 16,
        "num_layers": 2, "kda_layers": [0, 1],
    }  # fmt: skip
    a = synth.write_small_checkpoint(tmp_path / "a", seed=11, **args)
    b = synth.write_small_checkpoint(tmp_path / "b", seed=11, **args)
    c = synth.write_small_checkpoint(tmp_path / "c", seed=12, **args)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes()
    for name in json.loads((a / "model.safetensors.index.json").read_text())["weight_map"]:
        assert load(a, name).tobytes() != load(c, name).tobytes(), name


def test_rows_columns_and_tensors_all_differ(tmp_path):
    """A slice of the wrong rows, columns, layer or tensor must have different bytes."""
    out = synth.write_small_checkpoint(tmp_path, 512, 4, 64, 4, 64, 2, [0, 1], seed=2)
    # [256, 512]: large enough to be built from pool windows
    q0 = load(out, "model.layers.0.self_attn.q_proj.weight").view(np.uint16)
    assert q0.shape == (256, 512)
    assert len({row.tobytes() for row in q0}) == 256
    col_blocks = {q0[:, j : j + 64].tobytes() for j in range(0, 512, 64)}
    assert len(col_blocks) == 8
    o0 = load(out, "model.layers.0.self_attn.o_proj.weight").view(np.uint16)  # [512, 256]
    assert len({o0[:, j : j + 64].tobytes() for j in range(0, 256, 64)}) == 4
    projections = [
        load(out, f"model.layers.{i}.self_attn.{p}_proj.weight").tobytes()
        for i in (0, 1)
        for p in "qkv"
    ]
    assert len(set(projections)) == 6
    for small in ("dt_bias", "q_conv1d.weight", "b_proj.weight"):
        first = load(out, f"model.layers.0.self_attn.{small}")
        assert first.tobytes() != load(out, f"model.layers.1.self_attn.{small}").tobytes()
        rows = first.reshape(first.shape[0], -1)
        assert len({r.tobytes() for r in rows}) == rows.shape[0]
    # realistic scale
    q = q0.view(ml_dtypes.bfloat16).astype(np.float32)
    assert 0.015 < q.std() < 0.025 and abs(q.mean()) < 0.002


def test_many_files_and_progress(tmp_path):
    reports = []
    out = synth.write_small_checkpoint(
        tmp_path, 128, 4, 32, 4, 32, 3, [0, 1, 2], max_file_bytes=100_000,
        progress=lambda done, total: reports.append((done, total)),
    )  # fmt: skip
    _config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)
    files = set(index["weight_map"].values())
    assert len(files) > 4
    total = index["metadata"]["total_size"]
    assert len(reports) == len(tensors)
    assert [r[1] for r in reports] == [total] * len(tensors)
    done = [r[0] for r in reports]
    assert done == sorted(done) and done[-1] == total
    # a file exceeds the budget by at most its largest tensor
    for file_name in files:
        header, _s, data = read_file(out / file_name)
        largest = max(
            v["data_offsets"][1] - v["data_offsets"][0]
            for k, v in header.items()
            if k != "__metadata__"
        )
        assert len(data) <= 100_000 + largest


def test_rewriting_a_checkpoint_replaces_its_files(tmp_path):
    synth.write_small_checkpoint(tmp_path / "a", 32, 2, 8, 4, 8, 2, [0, 1], seed=1)
    synth.write_small_checkpoint(tmp_path / "a", 32, 2, 8, 4, 8, 2, [0, 1], seed=2)
    synth.write_small_checkpoint(tmp_path / "b", 32, 2, 8, 4, 8, 2, [0, 1], seed=2)
    _config, index, tensors = read_checkpoint(tmp_path / "a")
    check_index(tmp_path / "a", index, tensors)
    for path in (tmp_path / "b").iterdir():
        assert (tmp_path / "a" / path.name).read_bytes() == path.read_bytes()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"kda_layers": [0, 0]}, PlanError, "kda_layers"),
        ({"kda_layers": [2]}, PlanError, "kda_layers"),
        ({"kda_layers": [-1]}, PlanError, "kda_layers"),
        ({"kda_layers": [0.0]}, PlanError, "kda_layers"),
        ({"heads": 0}, PlanError, "heads"),
        ({"hidden": 2.0}, PlanError, "hidden"),
        ({"seed": -1}, PlanError, "seed"),
        ({"style": "mamba"}, PlanError, "style"),
        ({"weight_dtype": "F64"}, DtypeMismatchError, "weight_dtype"),
    ],
)
def test_small_checkpoint_argument_errors(tmp_path, kwargs, error, match):
    args = {
        "hidden": 32, "heads": 2, "head_dim": 8, "conv_kernel": 4, "gate_rank": 8,
        "num_layers": 2, "kda_layers": [0],
    }  # fmt: skip
    args.update(kwargs)
    with pytest.raises(error, match=match):
        synth.write_small_checkpoint(tmp_path / "x", **args)
    assert not (tmp_path / "x").exists()


def test_output_directory_that_is_a_file(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(OutputError, match="file"):
        synth.write_small_checkpoint(tmp_path / "file", 32, 2, 8, 4, 8, 1, [0])


def test_write_checkpoint_argument_errors(tmp_path):
    with pytest.raises(PlanError, match="model"):
        synth.write_checkpoint(tmp_path, "kimi-k9")
    with pytest.raises(PlanError, match="num_layers"):
        synth.write_checkpoint(tmp_path, "kimi-linear", num_layers=0)
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# synth: real geometries (a few hundred MB each)


@pytest.mark.slow
def test_kimi_linear_geometry_four_layers(tmp_path):
    out = synth.write_checkpoint(tmp_path / "kimi", "kimi-linear", num_layers=4, seed=0)
    config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)
    assert config["linear_attn_config"] == {
        "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
        "kda_layers": [1, 2, 3], "full_attn_layers": [4],
    }  # fmt: skip
    assert (
        config["architectures"] == ["KimiLinearForCausalLM"]
        and config["model_type"] == "kimi_linear"
    )
    sizes = (config["hidden_size"], config["num_hidden_layers"], config["rms_norm_eps"])
    assert sizes == (2304, 4, 1e-5)
    assert (
        config["num_attention_heads"],
        config["kv_lora_rank"],
        config["qk_nope_head_dim"],
        config["qk_rope_head_dim"],
        config["v_head_dim"],
        config["q_lora_rank"],
    ) == (32, 512, 128, 64, 128, None)
    kda = {
        "q_proj.weight": ("BF16", (4096, 2304)), "k_proj.weight": ("BF16", (4096, 2304)),
        "v_proj.weight": ("BF16", (4096, 2304)),
        "q_conv1d.weight": ("BF16", (4096, 1, 4)), "k_conv1d.weight": ("BF16", (4096, 1, 4)),
        "v_conv1d.weight": ("BF16", (4096, 1, 4)),
        "f_a_proj.weight": ("BF16", (128, 2304)), "g_a_proj.weight": ("BF16", (128, 2304)),
        "f_b_proj.weight": ("BF16", (4096, 128)), "g_b_proj.weight": ("BF16", (4096, 128)),
        "b_proj.weight": ("BF16", (32, 2304)),
        "A_log": ("F32", (1, 1, 32, 1)), "dt_bias": ("F32", (4096,)),
        "o_norm.weight": ("BF16", (128,)), "o_proj.weight": ("BF16", (2304, 4096)),
    }  # fmt: skip
    mla = {
        "q_proj.weight": ("BF16", (6144, 2304)), "kv_a_proj_with_mqa.weight": ("BF16", (576, 2304)),
        "kv_a_layernorm.weight": ("BF16", (512,)), "kv_b_proj.weight": ("BF16", (8192, 512)),
        "o_proj.weight": ("BF16", (2304, 4096)),
    }  # fmt: skip
    for i in range(4):
        attn = {
            n.split("self_attn.")[1]: t[1:]
            for n, t in tensors.items()
            if n.startswith(f"model.layers.{i}.self_attn.")
        }
        assert attn == (mla if i == 3 else kda), i
        assert tensors[f"model.layers.{i}.input_layernorm.weight"][1:] == ("BF16", (2304,))
        assert tensors[f"model.layers.{i}.post_attention_layernorm.weight"][1:] == ("BF16", (2304,))
    assert tensors["model.embed_tokens.weight"][1:] == ("BF16", (1024, 2304))
    assert tensors["lm_head.weight"][1:] == ("BF16", (1024, 2304))
    assert tensors["model.norm.weight"][1:] == ("BF16", (2304,))
    # per-layer parameter counts from the real model's inventory (kda_in_the_field.md §1.3)
    kda_params = sum(
        int(np.prod(shape))
        for n, (_f, _d, shape) in tensors.items()
        if n.startswith("model.layers.0.self_attn.")
    )
    mla_params = sum(
        int(np.prod(shape))
        for n, (_f, _d, shape) in tensors.items()
        if n.startswith("model.layers.3.self_attn.")
    )
    assert (kda_params, mla_params) == (39_514_272, 29_114_880)
    assert index["metadata"]["total_size"] == 304_818_816


@pytest.mark.slow
def test_glm_geometry_one_layer(tmp_path):
    out = synth.write_checkpoint(tmp_path / "glm", "glm-5.3-flash", num_layers=1, seed=0)
    config, index, tensors = read_checkpoint(out)
    check_index(out, index, tensors)
    text = config["text_config"]
    assert text["layer_types"] == ["linear_attention"]
    assert (
        text["hidden_size"],
        text["linear_head_dim"],
        text["linear_num_heads"],
        text["linear_conv_kernel_dim"],
        text["linear_lower_bound"],
        text["rms_norm_eps"],
    ) == (4096, 128, 64, 4, -5.0, 1e-5)
    layer = "model.language_model.layers.0.self_attn."
    for suffix, shape in expected_kda_shapes(4096, 64, 128, 4, 128, flat_a_log=True).items():
        assert tensors[layer + suffix][2] == shape
    assert tensors[layer + "o_proj.weight"][2] == (4096, 8192)


def test_model_config_is_the_config_write_checkpoint_writes_and_carries_the_mla_keys(tmp_path):
    from kda_tp.model import parse_config, parse_mla_config
    from kda_tp.synth import model_config, write_checkpoint

    # The smallest real geometry written: one Kimi-Linear KDA layer (and its config).
    written = write_checkpoint(tmp_path / "kimi", "kimi-linear", 1, vocab_size=8)
    assert model_config("kimi-linear", 1, 8) == json.loads((written / "config.json").read_text())
    config = model_config("kimi-k3")
    mla = parse_mla_config(config, parse_config(config))
    assert mla is not None and mla.layers == (3,)
    assert (mla.hidden, mla.heads, mla.q_lora_rank, mla.v_head_dim, mla.output_gate) == (
        7168, 96, 1536, 128, True)
    with pytest.raises(PlanError, match="unknown model .nope."):
        model_config("nope")
