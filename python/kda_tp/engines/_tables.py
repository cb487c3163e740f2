"""The engine layouts as data: one :class:`~kda_tp.engines.EngineLayout` per engine
version and model family (:data:`TABLES`; :data:`kda_tp.engines.LAYOUTS` holds them by name).
Adding an engine version is adding a table here; nothing else branches on the engine. The rules
every table follows are :mod:`kda_tp.engines`' docstring.
"""

from __future__ import annotations

from .layout import CONFIG_DTYPE, EngineLayout, EngineParam

__all__ = ["TABLES"]

# The tables. Sources are the engines' released wheels (vllm 0.33.0, sglang 0.5.23) and
# transformers 5.24. The six main vLLM and SGLang tables, unquantized, are checked against
# parameters the engines' own code loaded (tests/data/engine_ranks), transformers' against what
# transformers loads; the FP8 scale grids and SGLang's unfused Kimi-Linear path are read from
# the sources.

_CONV_QKV = ("q_conv1d", "k_conv1d", "v_conv1d")
_F32 = "F32"


def _common(a_log_view: tuple[int, ...], *, scales: str | None = None) -> tuple[EngineParam, ...]:
    """``A_log``, ``dt_bias``, ``o_norm``, ``o_proj`` (+ its scale grid), held alike everywhere."""
    params = [
        EngineParam("A_log", ("A_log",), view=a_log_view, dtype=_F32),
        EngineParam("dt_bias", ("dt_bias",), dtype=_F32),
        EngineParam("o_norm.weight", ("o_norm",)),
        EngineParam("o_proj.weight", ("o_proj",)),
    ]
    if scales:
        params.append(EngineParam(f"o_proj.{scales}", scale_of="o_proj.weight"))
    return tuple(params)


def _single(name: str, scales: str | None = None) -> tuple[EngineParam, ...]:
    """An unfused projection ``<name>.weight`` (+ its scale grid ``<name>.<scales>``)."""
    weight = EngineParam(f"{name}.weight", (name,))
    if scales is None:
        return (weight,)
    return weight, EngineParam(f"{name}.{scales}", scale_of=weight.suffix)


# SGLang 0.5.23 fuses Kimi-Linear's and GLM-5.3-Flash's low-rank-gate KDA layers alike.
def _sglang_fused_low_rank_gate(fg_b_dtype: str | None) -> tuple[EngineParam, ...]:
    """SGLang's fused low-rank-gate layer; ``fused_fg_b_proj`` built in ``fg_b_dtype``
    (Kimi-Linear: ``dtype=config.dtype``, sglang/srt/models/kimi_linear.py, whatever --dtype;
    GLM-5.3: the fused projection's ``params_dtype``, the model dtype: None)."""
    return (
        EngineParam("fused_qkvbfg_a_proj.weight",
                    ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")),
        EngineParam("fused_fg_b_proj.weight", ("f_b_proj", "g_b_proj"), stacked=True,
                    dtype=fg_b_dtype),
        EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
        *_common((1, 1, -1, 1)),
    )


_VLLM = "vllm/models/kimi_k3/nvidia/kda.py"

# The MLA layers' parameters (the plan tensors of kda_tp.rank.MlaTpPlan; the spec with the
# engines' file:line sources: tests/data/spec/mla.md). Replicated latents (q_a_proj,
# kv_a_proj_with_mqa) and norms are whole on every rank, q_proj/q_b_proj/kv_b_proj/g_proj this
# rank's head rows, o_proj its head columns, every one in the model dtype.
_MLA_TAIL = (*_single("kv_a_layernorm"), *_single("kv_b_proj"))
_MLA_KIMI_LINEAR = (*_single("q_proj"), *_single("kv_a_proj_with_mqa"), *_MLA_TAIL,
                    *_single("o_proj"))
_MLA_Q_LORA = (*_single("q_a_layernorm"), *_single("q_b_proj"))
_SGLANG_A_PROJ = EngineParam("fused_qkv_a_proj_with_mqa.weight",
                             ("q_a_proj", "kv_a_proj_with_mqa"))
_SGLANG_KIMI_LINEAR_MLA = ("sglang 0.5.23 python/sglang/srt/models/kimi_linear.py: KimiMLAAttention "
                           "(DeepseekV2AttentionMLA without q-LoRA: q_proj column-parallel, "
                           "kv_a_proj_with_mqa replicated)")
_VLLM_MLA = "vllm 0.33.0 vllm/models/kimi_k3/nvidia/mla.py: MultiHeadLatentAttention"
_SGLANG_MLA = "sglang 0.5.23 python/sglang/srt/models/deepseek_v2.py: DeepseekV2AttentionMLA"

#: Every engine layout, in the order of ``docs/engine-layouts.md``.
TABLES: tuple[EngineLayout, ...] = (
    EngineLayout(
        "vllm-0.33-k3", "vllm", "0.33", "kimi-k3",
        (
            EngineParam("in_proj_qkvgfab.weight",
                        ("q_proj", "k_proj", "v_proj", "g_proj", "f_a_proj", "b_proj"),
                        pad_to=16, pad_to_fp8=128),
            EngineParam("in_proj_qkvgfab.weight_scale", scale_of="in_proj_qkvgfab.weight"),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            *_single("f_b_proj", "weight_scale"),
            *_common((-1,), scales="weight_scale"),
        ),
        f"vllm 0.33.0 {_VLLM}: KimiK3DeltaAttention (in_proj_qkvgfab: f_a forced to tp_rank 0, "
        "zero rows to a multiple of 16, of 128 under ModelOpt FP8_PB_WO; ModelOpt scales "
        "[ob,1,ib,1] squeezed to [ob,ib] after loading, b_proj's single scale row on every rank)",
        mla=(
            EngineParam("fused_qkv_a_g_proj.weight",
                        ("q_a_proj", "kv_a_proj_with_mqa", "g_proj")),
            *_MLA_Q_LORA, *_MLA_TAIL, *_single("o_proj"),
        ),
        mla_source=f"{_VLLM_MLA} (fused_qkv_a_g_proj: KimiK3MergedQKVGateLinear, q_a and kv_a "
        "replicated, then this rank's g_proj rows; vllm/model_executor/layers/linear.py)",
    ),
    EngineLayout(
        "vllm-0.33-kimi-linear", "vllm", "0.33", "kimi-linear",
        (
            EngineParam("in_proj_qkvgfab.weight",
                        ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj")),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            *_single("f_b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_common((-1,)),
        ),
        "vllm 0.33.0 vllm/model_executor/layers/mamba/gdn/kimi_gdn_linear_attn.py: "
        "KimiGatedDeltaNetAttention (low-rank gate: no padding)",
        mla=_MLA_KIMI_LINEAR,
        mla_source=f"{_VLLM_MLA} (no q-LoRA: q_proj column-parallel, kv_a_proj_with_mqa "
        "a ReplicatedLinear)",
    ),
    EngineLayout(
        "vllm-0.33-glm-5.3", "vllm", "0.33", "glm-5.3",
        (
            EngineParam("in_proj_qkvbfg_a.weight",
                        ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")),
            *(EngineParam(f"{c}.weight", (c,), dtype=_F32) for c in _CONV_QKV),
            *_single("f_b_proj"), *_single("g_b_proj"),
            *_common((1, 1, -1, 1)),
        ),
        "vllm 0.33.0 vllm/models/glm5next/common/kda.py: Glm5NextLinearAttention "
        "(f_a and g_a replicated shards 4 and 5; separate F32 convs)",
        mla=(
            EngineParam("fused_qkv_a_proj.weight", ("q_a_proj", "kv_a_proj_with_mqa")),
            EngineParam("q_a_layernorm.weight", ("q_a_layernorm",),
                        dump_suffix="mla_attn.q_a_layernorm.weight"),
            EngineParam("q_b_proj.weight", ("q_b_proj",), dump_suffix="mla_attn.q_b_proj.weight"),
            *_MLA_TAIL,
            EngineParam("o_proj.weight", ("o_proj",), dump_suffix="mla_attn.o_proj.weight"),
        ),
        mla_source="vllm 0.33.0 vllm/models/glm5next/common/attention.py: Glm5NextMLAAttention "
        "(fused_qkv_a_proj: DeepSeekV2FusedQkvAProjLinear, replicated; the DSA indexer not "
        "tabled; a dump names q_a_layernorm, q_b_proj and o_proj under mla_attn.)",
    ),
    EngineLayout(
        "sglang-0.5.23-k3", "sglang", "0.5.23", "kimi-k3",
        (
            EngineParam("fused_qkvg_proj.weight", ("q_proj", "k_proj", "v_proj", "g_proj")),
            EngineParam("fused_qkvg_proj.weight_scale_inv", scale_of="fused_qkvg_proj.weight"),
            *_single("b_proj", "weight_scale_inv"),
            *_single("f_a_proj", "weight_scale_inv"),
            *_single("f_b_proj", "weight_scale_inv"),
            EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
            *_common((1, 1, -1, 1), scales="weight_scale_inv"),
        ),
        "sglang 0.5.23 python/sglang/srt/models/kimi_k3.py: KimiK3DeltaAttention (full-rank "
        "gate: only [q,k,v,g] fused; ModelOpt weight_scale loaded [:,0,:,0] into "
        "weight_scale_inv; b_proj's scale grid copied whole to every rank)",
        mla=(_SGLANG_A_PROJ, *_MLA_Q_LORA, *_MLA_TAIL, *_single("g_proj"), *_single("o_proj")),
        mla_source=f"{_SGLANG_MLA} as python/sglang/srt/models/kimi_k3.py's KimiK3MLAAttention "
        "(fused_qkv_a_proj_with_mqa replicated; the gate g_proj its own column-parallel linear)",
    ),
    EngineLayout(
        "sglang-0.5.23-kimi-linear", "sglang", "0.5.23", "kimi-linear",
        _sglang_fused_low_rank_gate(CONFIG_DTYPE),
        "sglang 0.5.23 python/sglang/srt/models/kimi_linear.py: KimiDeltaAttention, fused path "
        "(no quantization_config)",
        mla=_MLA_KIMI_LINEAR, mla_source=_SGLANG_KIMI_LINEAR_MLA,
    ),
    EngineLayout(
        "sglang-0.5.23-kimi-linear-unfused", "sglang", "0.5.23", "kimi-linear",
        (
            EngineParam("qkv_proj.weight", ("q_proj", "k_proj", "v_proj")),
            *_single("f_a_proj"), *_single("f_b_proj"), *_single("b_proj"),
            *_single("g_a_proj"), *_single("g_b_proj"),
            EngineParam("qkv_conv1d.weight", _CONV_QKV, dtype=_F32),
            *_common((1, 1, -1, 1)),
        ),
        "sglang 0.5.23 python/sglang/srt/models/kimi_linear.py: KimiDeltaAttention, unfused path "
        "(taken whenever the config has a quantization_config)",
        mla=_MLA_KIMI_LINEAR, mla_source=_SGLANG_KIMI_LINEAR_MLA,
    ),
    EngineLayout(
        "sglang-0.5.23-glm-5.3", "sglang", "0.5.23", "glm-5.3",
        _sglang_fused_low_rank_gate(None),
        "sglang 0.5.23 python/sglang/srt/models/glm5_next.py: Glm5NextLinearAttention, fused "
        "path (KDA projections unquantized, as in GLM-5.3-Flash's FP8 release)",
        wrapped_prefix="model.layers.",  # its mapper: model.language_model. -> model.
        mla=(_SGLANG_A_PROJ, *_MLA_Q_LORA, *_MLA_TAIL, *_single("o_proj")),
        mla_source=f"{_SGLANG_MLA} (fused_qkv_a_proj_with_mqa replicated; the DSA indexer not "
        "tabled)",
    ),
    EngineLayout(
        "transformers-5-kimi-linear", "transformers", "5", "kimi-linear",
        (
            *_single("q_proj"), *_single("k_proj"), *_single("v_proj"),
            EngineParam("conv1d.weight", _CONV_QKV),
            EngineParam("forget_gate.f_a_proj.weight", ("f_a_proj",)),
            EngineParam("forget_gate.f_b_proj.weight", ("f_b_proj",)),
            EngineParam("forget_gate.A_log", ("A_log",), view=(1, 1, -1, 1)),
            EngineParam("forget_gate.dt_bias", ("dt_bias",), dtype=_F32),
            *_single("b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_single("o_norm"), *_single("o_proj"),
        ),
        "transformers 5.24 models/kimi_linear/modeling_kimi_linear.py: KimiLinearDeltaAttention "
        "(conversion_mapping: q/k/v_conv1d concatenated into conv1d, f_a/f_b/dt_bias/A_log under "
        "forget_gate.; dt_bias kept F32)",
        tensor_parallel=False,
    ),
    EngineLayout(
        "transformers-5-glm-5.3", "transformers", "5", "glm-5.3",
        (
            *_single("q_proj"), *_single("k_proj"), *_single("v_proj"),
            EngineParam("conv1d.weight", _CONV_QKV, dtype=_F32),
            EngineParam("forget_gate.f_a_proj.weight", ("f_a_proj",)),
            EngineParam("forget_gate.f_b_proj.weight", ("f_b_proj",)),
            EngineParam("forget_gate.A_log", ("A_log",), view=(-1,), dtype=_F32),
            EngineParam("forget_gate.dt_bias", ("dt_bias",), dtype=_F32),
            *_single("b_proj"), *_single("g_a_proj"), *_single("g_b_proj"),
            *_single("o_norm"), *_single("o_proj"),
        ),
        "transformers 5.24 models/glm5_next/modeling_glm5_next.py: Glm5NextTextLinearAttention "
        "(F32 conv1d and forget-gate A_log/dt_bias)",
        tensor_parallel=False,
        wrapped_prefix="model.language_model.layers.",
    ),
)
