"""Which layers of a hybrid are MLA, and their geometry, from the config alone
(``kda_tp.model.parse_mla_config``; spec ``tests/data/spec/mla.md`` section 0): Kimi-Linear and
K3 by ``linear_attn_config.kda_layers``, GLM-5.3-Flash by ``layer_types`` (each fourth by
default) with the DSA indexer; refusals name the key, the value and the fix."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from kda_tp.errors import CheckpointError
from kda_tp.model import MlaConfig, parse_config, parse_mla_config
from kda_tp.synth import write_small_checkpoint

from paths import DATA


def kimi_linear(**changes: Any) -> dict[str, Any]:
    """Kimi-Linear's released config, cut to what matters here (27 layers, every 4th and the
    last MLA)."""
    config = {
        "model_type": "kimi_linear", "hidden_size": 2304, "num_hidden_layers": 27,
        "num_attention_heads": 32, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "mla_use_nope": True,
        "linear_attn_config": {
            "head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
            "kda_layers": [n for n in range(1, 28) if n % 4 != 0 and n != 27],
        },
    }
    config.update(changes)
    return config


def test_kimi_linear_mla_layers_are_those_not_in_kda_layers():
    mla = parse_mla_config(kimi_linear())
    assert mla == MlaConfig(
        layers=(3, 7, 11, 15, 19, 23, 26), hidden=2304, heads=32, q_lora_rank=None,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        output_gate=False, indexer=None, source="<dict>",
    )


def test_k3_reads_its_text_config_with_q_lora_and_the_output_gate():
    config = json.loads((DATA / "k3_small" / "config.json").read_text())
    mla = parse_mla_config(config)
    assert mla is not None
    assert (mla.layers, mla.heads, mla.q_lora_rank, mla.kv_lora_rank, mla.output_gate) == (
        (1,), 4, 64, 64, True)
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (64, 32, 128)
    assert mla.source == "<dict>:text_config"


def glm(**text: Any) -> dict[str, Any]:
    return {"model_type": "glm5_next",
            "text_config": {"model_type": "glm5_next_text", "num_hidden_layers": 8, **text}}


def test_glm_every_fourth_layer_is_mla_with_transformers_defaults_and_the_indexer():
    mla = parse_mla_config(glm())
    assert mla is not None and mla.layers == (3, 7)
    assert (mla.hidden, mla.heads, mla.q_lora_rank, mla.kv_lora_rank) == (4096, 64, 1536, 512)
    assert (mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim) == (256, 0, 256)
    assert mla.indexer == (32, 128, 16) and not mla.output_gate


def test_glm_layer_types_decide_and_a_null_index_topk_drops_the_indexer():
    types = ["linear_attention", "full_attention", "indexed_attention", "linear_attention"]
    mla = parse_mla_config(glm(num_hidden_layers=4, layer_types=types, index_topk=None))
    assert mla is not None and mla.layers == (1, 2) and mla.indexer is None


def test_a_kda_only_config_has_no_mla_layers():
    assert parse_mla_config(kimi_linear(num_hidden_layers=1, linear_attn_config={
        "head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1]})) is None
    # No layer list at all: the MLA layers are unknown, not guessed from names.
    config = kimi_linear()
    del config["linear_attn_config"]["kda_layers"]
    assert parse_mla_config(config) is None


@pytest.mark.parametrize("style, output_gate, q_lora", [
    ("kimi", False, False), ("k3", True, True), ("glm", False, True)])
def test_synthetic_configs_of_every_family_describe_their_mla_layers(tmp_path, style, output_gate,
                                                                    q_lora):
    ckpt = write_small_checkpoint(tmp_path, hidden=96, heads=4, head_dim=64, conv_kernel=4,
                                  gate_rank=64, num_layers=4, kda_layers=[0, 2], style=style)
    config = json.loads((ckpt / "config.json").read_text())
    mla = parse_mla_config(config, parse_config(config))
    assert mla is not None and mla.layers == (1, 3)
    assert mla.output_gate is output_gate and (mla.q_lora_rank is not None) is q_lora


@pytest.mark.parametrize("key, value, message", [
    ("kv_lora_rank", None, "'kv_lora_rank' = None is not an integer in [1, 2**31)"),
    ("num_attention_heads", 0, "'num_attention_heads' = 0 is not an integer in [1, 2**31)"),
    ("qk_rope_head_dim", -1, "'qk_rope_head_dim' = -1 is not an integer in [0, 2**31)"),
    ("v_head_dim", "128", "'v_head_dim' = '128' is not an integer"),
    ("mla_use_output_gate", "yes", "'mla_use_output_gate' = 'yes' is not a bool"),
])
def test_a_bad_mla_key_is_refused_naming_it(key, value, message):
    with pytest.raises(CheckpointError) as refused:
        parse_mla_config(kimi_linear(**{key: value}))
    assert message in str(refused.value)
    assert str(refused.value).startswith("<dict>: ")


def test_a_missing_mla_key_names_the_layers_that_need_it():
    config = kimi_linear()
    del config["qk_nope_head_dim"]
    with pytest.raises(CheckpointError, match=r"no 'qk_nope_head_dim', which the MLA layers "
                                              r"3, 7, 11, 15, 19, 23, 26 need"):
        parse_mla_config(config)


@pytest.mark.parametrize("text, message", [
    ({"q_lora_rank": None}, "'text_config.q_lora_rank' is null"),
    ({"qk_rope_head_dim": 64}, "'text_config.qk_rope_head_dim' = 64: GLM-5.3-Flash's DSA layers "
                               "are NoPE"),
])
def test_glm_is_held_to_transformers_validate_architecture(text, message):
    with pytest.raises(CheckpointError, match=message):
        parse_mla_config(glm(**text))


def test_parsing_leaves_the_config_untouched():
    config = kimi_linear()
    before = copy.deepcopy(config)
    parse_mla_config(config)
    assert config == before
