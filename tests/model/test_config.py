"""Config semantics per model family (kda_tp.model.config): each family's config is read the way the
model's own reference code reads it, and ``kda-tp plan`` says what it read.

GLM-5.3-Flash follows transformers' ``configuration_glm5_next.py``; where transformers is
installed, the bounds are compared with what ``Glm5NextConfig`` itself makes of the same dicts.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kda_tp.cli import main
from kda_tp.model import load_config, parse_config
from kda_tp.model.families import RULES_GENERIC, RULES_GLM, RULES_KIMI
from kda_tp.errors import CheckpointError

from paths import ENGINE_RANKS


TEXT = {"hidden_size": 64, "linear_head_dim": 32, "linear_num_heads": 4,
        "linear_conv_kernel_dim": 4, "num_hidden_layers": 4}  # fmt: skip


def glm(text: dict[str, Any], flat: bool = False) -> dict[str, Any]:
    """A GLM-5.3-Flash config: transformers' wrapper, or the flat text-only form."""
    if flat:
        return {"model_type": "glm5_next", **TEXT, **text}
    text = {"model_type": "glm5_next_text", **TEXT, **text}
    return {"model_type": "glm5_next", "text_config": text}


# (text fields, expected bound, expected key); each case is checked wrapped and flat.
GLM_BOUNDS = [
    ({"linear_lower_bound": -5.0}, -5.0, "linear_lower_bound"),
    ({"linear_lower_bound": -2.5}, -2.5, "linear_lower_bound"),
    ({}, -5.0, "default (linear_lower_bound)"),
    # A linear_attn_config stating no bound: still -5 (linear_lower_bound's default).
    ({"linear_attn_config": {"head_dim": 32}}, -5.0, "default (linear_lower_bound)"),
    ({"linear_attn_config": {}}, -5.0, "default (linear_lower_bound)"),
    ({"linear_lower_bound": -5.0, "linear_attn_config": {"gate_lower_bound": -3.0}}, -3.0,
     "linear_attn_config.gate_lower_bound"),
    # None from both keys, safe_gate (default true) restores -5.
    ({"linear_lower_bound": None, "linear_attn_config": {}}, -5.0, "default (safe_gate)"),
    ({"linear_attn_config": {"gate_lower_bound": None}}, -5.0, "default (safe_gate)"),
    ({"linear_attn_config": {"gate_lower_bound": None, "safe_gate": True}}, -5.0,
     "linear_attn_config.safe_gate"),
    # Explicitly none and no safe gate: the softplus gate.
    ({"linear_lower_bound": None}, None, "linear_lower_bound = null"),
    ({"linear_lower_bound": None, "linear_attn_config": {"safe_gate": False}}, None,
     "linear_lower_bound = null"),
    ({"linear_attn_config": {"gate_lower_bound": None, "safe_gate": False}}, None,
     "linear_attn_config.gate_lower_bound = null"),
]  # fmt: skip


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(("text", "bound", "key"), GLM_BOUNDS)
def test_glm_bound_and_its_key(text, bound, key, flat):
    config = parse_config(glm(text, flat))
    assert config.rules == RULES_GLM
    assert config.gate_lower_bound == bound
    assert config.forget_gate == ("softplus" if bound is None else "lower_bound")
    prefix = "" if flat or key.startswith("default") else "text_config."
    assert config.gate_bound_key == prefix + key


@pytest.mark.parametrize("flat", [False, True])
@pytest.mark.parametrize(("text", "bound", "key"), GLM_BOUNDS)
def test_glm_bound_equals_transformers(text, bound, key, flat):
    transformers = pytest.importorskip("transformers")
    config = glm(text, flat)
    model = transformers.Glm5NextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    assert model.text_config.linear_lower_bound == bound == parse_config(config).gate_lower_bound


def test_glm_layers_come_from_layer_types_not_kda_layers():
    types = ["linear_attention", "indexed_attention", "linear_attention", "full_attention"]
    config = parse_config(glm({"layer_types": types,
                               "linear_attn_config": {"kda_layers": [1, 2, 3, 4]}}))
    assert config.kda_layers == (0, 2)
    # Without layer_types: index % 4 == 3 is full attention (transformers' default).
    assert parse_config(glm({"num_hidden_layers": 9})).kda_layers == (0, 1, 2, 4, 5, 6, 8)
    no_kda = "no KDA layers: 'text_config.layer_types' has no 'linear_attention' entry"
    with pytest.raises(CheckpointError, match=re.escape(no_kda)):
        parse_config(glm({"layer_types": ["full_attention"] * 4}))
    # transformers' legacy names are remapped first: "mamba" is "linear_attention".
    legacy = glm({"layer_types": ["mamba", "attention", "linear_attention", "full_attention"]})
    assert parse_config(legacy).kda_layers == (0, 2)


GLM_BAD_LAYER_TYPES = [
    # One entry per layer (transformers' validate_layer_type).
    (["linear_attention"] * 6,
     "'text_config.layer_types' has 6 entries but text_config.num_hidden_layers is 4: "
     "transformers requires one entry per layer"),
    (["linear_attention"] * 2,
     "'text_config.layer_types' has 2 entries but text_config.num_hidden_layers is 4"),
    # "kda_attention" is no GLM layer type (the Kimi/generic rules accept it); nor is an MLP type.
    (["linear_attention", "kda_attention", "linear_attention", "full_attention"],
     "'text_config.layer_types' has 'kda_attention': transformers refuses GLM-5.3-Flash layer "
     "types outside full_attention, sliding_attention, "),
    (["linear_attention", "dense", "linear_attention", "full_attention"],
     "'text_config.layer_types' has 'dense': transformers refuses"),
]


@pytest.mark.parametrize(("types", "message"), GLM_BAD_LAYER_TYPES)
def test_glm_layer_types_are_refused_as_transformers_refuses_them(types, message):
    with pytest.raises(CheckpointError, match=re.escape(message)):
        parse_config(glm({"layer_types": types}))
    flat = message.replace("text_config.", "")
    with pytest.raises(CheckpointError, match=re.escape(flat)):
        parse_config(glm({"layer_types": types}, flat=True))
    transformers = pytest.importorskip("transformers")
    from huggingface_hub.errors import StrictDataclassClassValidationError

    with pytest.raises(StrictDataclassClassValidationError, match="layer_types"):
        transformers.Glm5NextConfig(**{**TEXT, "layer_types": types})


def kimi_layers(lac: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"model_type": "kimi_linear", "hidden_size": 64, **top, "linear_attn_config": {
        "head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, **lac}}


def test_kimi_kda_layers_are_listed_once_and_within_the_model():
    config = kimi_layers({"kda_layers": [1, 2, 3]}, num_hidden_layers=4)
    assert parse_config(config).kda_layers == (0, 1, 2)
    with pytest.raises(CheckpointError, match=re.escape(
        "<dict>: 'linear_attn_config.kda_layers' = [1, 1] lists layer 1 more than once; "
        "list each KDA layer once (1-based)"
    )):
        parse_config(kimi_layers({"kda_layers": [1, 1]}))
    with pytest.raises(CheckpointError, match=re.escape(
        "<dict>: 'linear_attn_config.kda_layers' = [1, 9]: 9 beyond num_hidden_layers = 4 "
        "(kda_layers are 1-based: 1..4)"
    )):
        parse_config(kimi_layers({"kda_layers": [1, 9]}, num_hidden_layers=4))
    # Without num_hidden_layers the config does not say how many layers there are.
    assert parse_config(kimi_layers({"kda_layers": [1, 9]})).kda_layers == (0, 8)
    k3 = {"model_type": "kimi_k3", "text_config": kimi_layers({"kda_layers": [2, 3, 2]})}
    with pytest.raises(CheckpointError, match=re.escape(
        "<dict>:text_config: 'text_config.linear_attn_config.kda_layers' = [2, 3, 2] lists "
        "layer 2 more than once"
    )):
        parse_config(k3)


def test_glm_geometry_prefers_linear_attn_config():
    config = parse_config(glm({"linear_attn_config": {"head_dim": 16, "num_heads": 8,
                                                      "short_conv_kernel_size": 3}}))
    assert (config.head_dim, config.heads, config.conv_kernel) == (16, 8, 3)
    assert (config.hidden, config.full_rank_gate) == (64, False)
    with pytest.raises(CheckpointError, match=r"'text_config.linear_attn_config.num_heads' = 0"):
        parse_config(glm({"linear_attn_config": {"num_heads": 0}}))
    with pytest.raises(CheckpointError, match="safe_gate' = 'yes' is not a bool"):
        parse_config(glm({"linear_attn_config": {"safe_gate": "yes"}}))
    with pytest.raises(CheckpointError, match="linear_lower_bound' = 1.0 is not a number below 0"):
        parse_config(glm({"linear_lower_bound": 1.0}))


def kimi(lac: dict[str, Any], model_type: str = "kimi_linear") -> dict[str, Any]:
    return {"model_type": model_type, "hidden_size": 64, "linear_attn_config": {
        "head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1], **lac}}


@pytest.mark.parametrize("bound", [-5.0, -5, -1.0, -1e-3])
def test_kimi_bound_inside_the_engines_range(bound):
    config = parse_config(kimi({"gate_lower_bound": bound}, "kimi_k3"))
    assert (config.rules, config.gate_lower_bound) == (RULES_KIMI, float(bound))
    assert config.gate_bound_key == "linear_attn_config.gate_lower_bound"


@pytest.mark.parametrize("bound", [-5.5, -1e308, 0, 0.0, 2.0, "-5", True])
def test_kimi_bound_outside_the_engines_range_is_refused(bound):
    with pytest.raises(CheckpointError, match=r"is not in \[-5, 0\): vLLM and SGLang assert"):
        parse_config(kimi({"gate_lower_bound": bound}))


def test_unknown_model_type_keeps_the_kimi_keys_and_says_so():
    config = parse_config(kimi({"gate_lower_bound": -7.0}, "my_kda_model"))
    assert (config.rules, config.gate_lower_bound, config.kda_layers) == (RULES_GENERIC, -7.0, (0,))
    assert "unknown model_type" in config.describe_gate()


def test_engine_fixture_configs():
    """The checkpoints vLLM and SGLang loaded (tests/data/engine_ranks, see its README)."""
    read = {d: parse_config(load_config(ENGINE_RANKS / f"ckpt_{d}")) for d in ("glm", "k3", "kl")}
    assert [(c.rules, c.gate_lower_bound, c.gate_bound_key) for c in read.values()] == [
        (RULES_GLM, -5.0, "text_config.linear_lower_bound"),
        (RULES_KIMI, -5.0, "text_config.linear_attn_config.gate_lower_bound"),
        (RULES_KIMI, None, "no linear_attn_config.gate_lower_bound"),
    ]
    assert all((c.heads, c.head_dim, c.kda_layers) == (12, 128, (0,)) for c in read.values())
    assert [c.full_rank_gate for c in read.values()] == [False, True, False]


def test_plan_prints_the_gate_and_its_key(capsys):
    assert main(["plan", str(ENGINE_RANKS / "ckpt_glm"), "--tp-size", "4"]) == 0
    text = capsys.readouterr().out
    assert (
        "forget gate: lower bound -5.0 (from text_config.linear_lower_bound); config rules: "
        "GLM-5.3-Flash, as transformers' configuration_glm5_next.py reads it"
    ) in text
    assert main(["plan", str(ENGINE_RANKS / "ckpt_kl"), "--tp-size", "4", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {k: doc[k] for k in ("forget_gate", "gate_lower_bound", "gate_bound_key",
                                "config_rules")} == {
        "forget_gate": "softplus", "gate_lower_bound": None,
        "gate_bound_key": "no linear_attn_config.gate_lower_bound", "config_rules": "kimi",
    }  # fmt: skip
    assert main(["plan", str(ENGINE_RANKS / "ckpt_glm" / "config.json"), "--tp-size", "4",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["forget_gate"], doc["gate_lower_bound"], doc["gate_bound_key"]) == (
        "lower_bound", -5.0, "text_config.linear_lower_bound"
    )


def _engine_bound(path: Path) -> float | None:
    """The forget-gate bound an engine's layer ended up with: the rank file's ``engine_gate``
    metadata, e.g. ``lower_bound: None``, ``lower_bound attrs: {'kda_lower_bound': -5.0}``."""
    import kda_tp

    gate = kda_tp.SafetensorsSource(path).files()[0][1]["engine_gate"]
    value = re.search(r"(-?\d+\.\d+|None)", gate)
    assert value is not None, gate
    return None if value.group(1) == "None" else float(value.group(1))


@pytest.mark.parametrize(("model", "ckpt"), [("glm", "glm"), ("k3", "k3"), ("kimi_linear", "kl")])
def test_bound_equals_vllm_and_differs_from_sglang_only_for_glm(model, ckpt):
    """vLLM 0.33 reads every family's bound as kda_tp does; SGLang 0.5.23 runs GLM-5.3-Flash
    unbounded (it reads only linear_attn_config.gate_lower_bound)."""
    ours = parse_config(load_config(ENGINE_RANKS / f"ckpt_{ckpt}")).gate_lower_bound
    vllm = _engine_bound(next(ENGINE_RANKS.glob(f"vllm_{model}_tp4_r*.safetensors")))
    sglang = _engine_bound(next(ENGINE_RANKS.glob(f"sglang_{model}_tp4_r*.safetensors")))
    assert vllm == ours
    assert (sglang == ours) is (model != "glm")
