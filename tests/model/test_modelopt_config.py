"""What a ModelOpt config declares per module is checked against every KDA tensor.

NVIDIA's ModelOpt ``MIXED_PRECISION`` configs (``quant_method: modelopt_mixed``, or an
``hf_quant_config.json``) give each quantized module its own ``quant_algo`` in
``quantized_layers`` (NVIDIA's Kimi K3 release: ``FP8_PB_WO`` attention, ``NVFP4`` experts) and
list unquantized ones in ``exclude_modules``; ModelOpt's FP8 is E4M3 by definition. A KDA tensor
that contradicts its declaration is refused with a message that names the module and the
algorithm, on every KDA layer, not only the first one.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import kda_tp
import ml_dtypes
import numpy as np
import pytest
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, DtypeMismatchError
from kda_tp.shard import shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint
from tp_fixtures import write_one_file
from paths import DATA

FIXTURE = DATA / "k3_fp8_small"
KDA = "language_model.model.layers.0.self_attn."


def _arrays() -> dict[str, np.ndarray]:
    source = kda_tp.SafetensorsSource(FIXTURE)
    return {name: np.array(source.get(name).array) for name in source.names()}


def _config() -> dict:
    return json.loads((FIXTURE / "config.json").read_text())


def _declare(config: dict, module: str, algo: str | None) -> dict:
    """``config`` with ``module`` declared as ``algo`` in quantized_layers (None: unlisted)."""
    layers = config["quantization_config"]["quantized_layers"]
    layers.pop(module, None)
    if algo is not None:
        layers[module] = {"quant_algo": algo}
    return config


def _nvfp4_q_proj() -> dict[str, np.ndarray]:
    """q_proj as ModelOpt stores NVFP4: packed E2M1 pairs (U8) and E4M3 scales per 16."""
    arrays = _arrays()
    arrays[KDA + "q_proj.weight"] = np.zeros((256, 64), np.uint8)
    arrays[KDA + "q_proj.weight_scale"] = np.ones((256, 8), ml_dtypes.float8_e4m3fn)
    return arrays


def _e5m2_q_proj() -> dict[str, np.ndarray]:
    arrays = _arrays()
    q = arrays[KDA + "q_proj.weight"]
    arrays[KDA + "q_proj.weight"] = q.astype(np.float32).astype(ml_dtypes.float8_e5m2)
    return arrays


def _bf16_q_proj() -> dict[str, np.ndarray]:
    arrays = _arrays()
    q = arrays[KDA + "q_proj.weight"]
    arrays[KDA + "q_proj.weight"] = q.astype(np.float32).astype(ml_dtypes.bfloat16)
    del arrays[KDA + "q_proj.weight_scale"]
    return arrays


def _excluding(pattern: str) -> dict:
    config = _declare(_config(), KDA + "o_proj", None)
    config["quantization_config"]["exclude_modules"].append(pattern)
    return config


@pytest.mark.parametrize(
    ("arrays", "config", "error", "message"),
    [
        (_nvfp4_q_proj(), _declare(_config(), KDA + "q_proj", "NVFP4"), CheckpointError,
         r"q_proj\.weight: the config's quantized_layers declares "
         r"language_model\.model\.layers\.0\.self_attn\.q_proj as ModelOpt NVFP4 \(on disk: U8\); "
         r"kda_tp slices .* not NVFP4 ones"),
        (_e5m2_q_proj(), _config(), DtypeMismatchError,
         r"q_proj\.weight: dtype F8_E5M2, but ModelOpt FP8_PB_WO \(128x128 blocks\) weights are "
         r"F8_E4M3 \(ModelOpt's FP8 is E4M3 by definition\)"),
        (_bf16_q_proj(), _config(), CheckpointError,
         r"q_proj\.weight: dtype BF16, but the config's quantized_layers declares "
         r"language_model\.model\.layers\.0\.self_attn\.q_proj as ModelOpt FP8_PB_WO"),
        (_arrays(), _declare(_config(), KDA + "o_proj", None), CheckpointError,
         r"o_proj\.weight: stored as F8_E4M3, but the config says otherwise: its "
         r"quantized_layers does not list language_model\.model\.layers\.0\.self_attn\.o_proj"),
        (_arrays(), _excluding("*self_attn.o_proj*"), CheckpointError,
         r"o_proj\.weight: stored as F8_E4M3, .*exclude_modules pattern '\*self_attn\.o_proj\*' "
         r"leaves language_model\.model\.layers\.0\.self_attn\.o_proj unquantized"),
    ],
    ids=["nvfp4-kda-layer", "e5m2-under-modelopt", "declared-fp8-stored-bf16", "fp8-unlisted",
         "fp8-excluded"],
)
def test_a_kda_tensor_that_contradicts_its_modelopt_declaration_is_refused(
    tmp_path, capsys, arrays, config, error, message
):
    ckpt = write_one_file(tmp_path / "ckpt", arrays, config)
    with pytest.raises(error, match=message):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert error.__name__ in err and "Traceback" not in err
    assert not out.exists() or list(out.iterdir()) == []


def test_the_mixed_nvfp4_message_also_comes_from_hf_quant_config_json(tmp_path):
    """The declaration may live in ``hf_quant_config.json`` alone (ModelOpt's own file)."""
    config = _declare(_config(), KDA + "q_proj", "NVFP4")
    body = config.pop("quantization_config")
    del body["quant_method"]
    ckpt = write_one_file(tmp_path / "ckpt", _nvfp4_q_proj(), config)
    (ckpt / "hf_quant_config.json").write_text(json.dumps({"quantization": body}))
    with pytest.raises(CheckpointError, match=r"as ModelOpt NVFP4 \(on disk: U8\)"):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)


def _two_kda_layers(tmp_path: Path) -> Path:
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=256, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=2, kda_layers=[0, 1],
                                  style="k3", fp8=True)
    return ckpt


def test_every_kda_layer_is_checked_not_only_the_first(tmp_path):
    ckpt = _two_kda_layers(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    layers = config["quantization_config"]["quantized_layers"]
    module = next(m for m in layers if m.endswith("layers.1.self_attn.k_proj"))
    layers[module] = {"quant_algo": "NVFP4"}
    (ckpt / "config.json").write_text(json.dumps(config))
    name = re.escape(module)
    with pytest.raises(CheckpointError, match=rf"{name}\.weight: .*declares {name} as ModelOpt "
                                              r"NVFP4 \(on disk: F8_E4M3\)"):
        shard_checkpoint(ckpt, tmp_path / "out", 2, qk_multiple=1)
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []


def test_every_spelling_nvidia_lists_a_module_under_counts(tmp_path):
    """NVIDIA's K3 export lists ``language_model.model.layers.N...`` also as
    ``model.layers.N...`` and ``layers.N...``; a config keyed by one of the short spellings
    alone declares the same modules."""
    ckpt = _two_kda_layers(tmp_path)
    config = json.loads((ckpt / "config.json").read_text())
    quant = config["quantization_config"]
    prefix = "language_model.model."
    assert all(m.startswith(prefix) for m in quant["quantized_layers"])
    quant["quantized_layers"] = {
        m.removeprefix(prefix if i % 2 else "language_model."): v
        for i, (m, v) in enumerate(quant["quantized_layers"].items())
    }
    (ckpt / "config.json").write_text(json.dumps(config))
    shard_checkpoint(ckpt, tmp_path / "out", 2, qk_multiple=1)
    assert verify_shards(ckpt, tmp_path / "out").ok
