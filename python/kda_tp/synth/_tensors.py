"""What a synthetic checkpoint holds, per config dialect: its tensors (names, dtypes, shapes,
value kinds) and its ``config.json``, from a :class:`Geometry` (see :mod:`kda_tp.synth`, which
generates the values and writes the files)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..model.dtypes import DTYPE_SIZES
from ..model.families import FAMILIES, ModelFamily

__all__ = [
    "FP8_BLOCK",
    "GLM_GATE_LOWER_BOUND",
    "K3_GATE_LOWER_BOUND",
    "STYLES",
    "VISION_HIDDEN",
    "Geometry",
    "Spec",
    "config_json",
    "model_tensors",
    "modelopt_config",
    "quantize_attention",
]

#: The config dialects, by style: the family whose synthetic checkpoints use it.
STYLES = {family.style: family for family in FAMILIES.values()}
#: Kimi K3's forget-gate lower bound (``linear_attn_config.gate_lower_bound``).
K3_GATE_LOWER_BOUND = -5.0
#: GLM-5.3-Flash's forget-gate lower bound (``text_config.linear_lower_bound``; transformers'
#: default).
GLM_GATE_LOWER_BOUND = -5.0
#: Hidden size of the synthetic K3 vision tower (small: only its names matter to sharding).
VISION_HIDDEN = 256
#: Edge of an FP8 weight's square scale block (ModelOpt's ``FP8_PB_WO``).
FP8_BLOCK = 128
_RMS_NORM_EPS = 1e-5

#: A layer's ``self_attn`` tensor: name, safetensors dtype, shape, value kind (:class:`Spec`).
Entry = tuple[str, str, tuple[int, ...], str]


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Sizes of one synthetic model (element counts: hidden d, heads H, head_dim D, conv
    kernel K, gate rank R) plus its config dialect (``style``) and layout switches."""

    hidden: int
    heads: int
    head_dim: int
    conv_kernel: int
    gate_rank: int
    style: str
    flat_a_log: bool = False
    flat_conv: bool = False
    a_log_len: int | None = None

    @property
    def channels(self) -> int:
        """C = H * D."""
        return self.heads * self.head_dim

    @property
    def family(self) -> ModelFamily:
        """The family whose checkpoints this dialect imitates: what they store differently."""
        return STYLES[self.style]

    @property
    def stack(self) -> str:
        """The decoder stack's name prefix (K3 and GLM nest it in a wrapper)."""
        return self.family.decoder_prefix.removesuffix("layers.")

    @property
    def lm_head(self) -> str:
        """``lm_head``'s tensor name."""
        return self.family.lm_head

    @property
    def q_lora_rank(self) -> int:
        """K3's and GLM's MLA q-LoRA rank: 12 D (1536 at D = 128)."""
        return 12 * self.head_dim

    @property
    def rope_dim(self) -> int:
        """MLA RoPE dims, Kimi-Linear's ratio: D / 2."""
        return max(1, self.head_dim // 2)

    @property
    def kv_lora_rank(self) -> int:
        """MLA kv-LoRA rank, Kimi-Linear's ratio: 4 D (nope = v = D)."""
        return 4 * self.head_dim


class Spec:
    """One tensor to generate: name, safetensors dtype, shape and value distribution.

    ``kind`` is ``"proj"`` (N(0, 0.02)), ``"conv"`` (U(-0.5, 0.5)), ``"norm"`` (1 + N(0, 0.02)),
    ``"a_log"`` (log U(1, 16)), ``"a_log_pad:H"`` (the first H entries log U(1, 16), the rest
    zero), ``"dt_bias"`` (inverse softplus of a log-uniform step in [1e-3, 1e-1], as
    flash-linear-attention initialises it), ``"fp8"`` (N(0, 1) · 64 in F8_E4M3) or ``"scale"``
    (U(0.5, 1.5) · 0.02 / 64, so that dequantized FP8 weights are about N(0, 0.02)).
    """

    __slots__ = ("dtype", "kind", "name", "nbytes", "shape")

    def __init__(self, name: str, dtype: str, shape: tuple[int, ...], kind: str):
        self.name = name
        self.dtype = dtype
        self.shape = shape
        self.kind = kind
        self.nbytes = math.prod(shape) * DTYPE_SIZES[dtype]


def model_tensors(
    g: Geometry, num_layers: int, kda: set[int], vocab: int, wdt: str
) -> list[Spec]:
    """All tensors of the model in file order: embeddings, layers 0.., final norm, lm_head, and
    for K3 the vision tower and projector."""
    specs = [Spec(g.stack + "embed_tokens.weight", wdt, (vocab, g.hidden), "proj")]
    for i in range(num_layers):
        layer = f"{g.stack}layers.{i}."
        specs.append(Spec(layer + "input_layernorm.weight", wdt, (g.hidden,), "norm"))
        attention = _kda_tensors(g, wdt) if i in kda else _MLA_TENSORS[g.style](g, wdt)
        specs.extend(Spec(layer + "self_attn." + n, dt, s, k) for n, dt, s, k in attention)
        specs.append(Spec(layer + "post_attention_layernorm.weight", wdt, (g.hidden,), "norm"))
    specs.append(Spec(g.stack + "norm.weight", wdt, (g.hidden,), "norm"))
    specs.append(Spec(g.lm_head, wdt, (vocab, g.hidden), "proj"))
    if g.family.vision_tower:
        # A vision tower whose `self_attn.q_proj`/`o_proj` must never be taken for KDA.
        tower, width = "vision_tower.encoder.blocks.0.self_attn.", VISION_HIDDEN
        specs.append(Spec(tower + "q_proj.weight", wdt, (width, width), "proj"))
        specs.append(Spec(tower + "o_proj.weight", wdt, (width, width), "proj"))
        specs.append(Spec("mm_projector.proj.0.weight", wdt, (g.hidden, width), "proj"))
    return specs

def _kda_tensors(g: Geometry, wdt: str) -> list[Entry]:
    """A KDA layer's ``self_attn`` tensors in the plan's spec order, as the geometry's family
    stores them (:class:`~kda_tp.model.families.ModelFamily`): K3 one full-rank output gate,
    ``A_log`` zero-padded, F32 convs and ``o_norm``; GLM-5.3-Flash (transformers
    ``modeling_glm5_next.py``) F32 convs, ``A_log`` ``[H]``."""
    c, d, r, family = g.channels, g.hidden, g.gate_rank, g.family
    conv = (c, g.conv_kernel) if g.flat_conv else (c, 1, g.conv_kernel)
    conv_dtype = family.conv_dtype or wdt
    gate: list[Entry] = [("g_proj.weight", wdt, (c, d), "proj")] if family.full_rank_gate else [
        ("g_a_proj.weight", wdt, (r, d), "proj"), ("g_b_proj.weight", wdt, (c, r), "proj")]
    if family.padded_a_log:
        a_log: Entry = ("A_log", "F32", (g.a_log_len or g.heads,), f"a_log_pad:{g.heads}")
    else:
        flat = g.flat_a_log or family.flat_a_log
        a_log = ("A_log", "F32", (g.heads,) if flat else (1, 1, g.heads, 1), "a_log")
    return [
        *((f"{p}_proj.weight", wdt, (c, d), "proj") for p in "qkv"),
        *((f"{p}_conv1d.weight", conv_dtype, conv, "conv") for p in "qkv"),
        ("f_a_proj.weight", wdt, (r, d), "proj"),
        ("f_b_proj.weight", wdt, (c, r), "proj"),
        *gate,
        ("b_proj.weight", wdt, (g.heads, d), "proj"),
        a_log,
        ("dt_bias", "F32", (c,), "dt_bias"),
        ("o_norm.weight", family.o_norm_dtype or wdt, (g.head_dim,), "norm"),
        ("o_proj.weight", wdt, (d, c), "proj"),
    ]


def _mla_tensors(g: Geometry, wdt: str) -> list[Entry]:
    """A Kimi-Linear MLA layer's ``self_attn`` tensors (q_lora_rank null, nope = v = D)."""
    d, h, hd, lora, rope = g.hidden, g.heads, g.head_dim, g.kv_lora_rank, g.rope_dim
    return [
        ("q_proj.weight", wdt, (h * (hd + rope), d), "proj"),
        ("kv_a_proj_with_mqa.weight", wdt, (lora + rope, d), "proj"),
        ("kv_a_layernorm.weight", wdt, (lora,), "norm"),
        ("kv_b_proj.weight", wdt, (h * 2 * hd, lora), "proj"),
        ("o_proj.weight", wdt, (d, h * hd), "proj"),
    ]


def _k3_mla_tensors(g: Geometry, wdt: str) -> list[Entry]:
    """A Kimi K3 MLA layer's ``self_attn`` tensors (q-LoRA, output gate). Its ``g_proj`` and
    ``o_proj`` have exactly a KDA layer's names and shapes."""
    d, h, hd, lora, rope, q_rank = (
        g.hidden, g.heads, g.head_dim, g.kv_lora_rank, g.rope_dim, g.q_lora_rank
    )
    return [
        ("q_a_proj.weight", wdt, (q_rank, d), "proj"),
        ("q_a_layernorm.weight", wdt, (q_rank,), "norm"),
        ("q_b_proj.weight", wdt, (h * (hd + rope), q_rank), "proj"),
        ("kv_a_proj_with_mqa.weight", wdt, (lora + rope, d), "proj"),
        ("kv_a_layernorm.weight", wdt, (lora,), "norm"),
        ("kv_b_proj.weight", wdt, (h * 2 * hd, lora), "proj"),
        ("g_proj.weight", wdt, (h * hd, d), "proj"),
        ("o_proj.weight", wdt, (d, h * hd), "proj"),
    ]


def _glm_mla_tensors(g: Geometry, wdt: str) -> list[Entry]:
    """A GLM-5.3-Flash MLA (DSA) layer's ``self_attn`` tensors (transformers
    ``Glm5NextTextAttention``: q-LoRA, no RoPE dims, nope = v = D); its ``o_proj`` has the KDA
    name."""
    d, h, hd, lora, q_rank = g.hidden, g.heads, g.head_dim, g.kv_lora_rank, g.q_lora_rank
    return [
        ("q_a_proj.weight", wdt, (q_rank, d), "proj"),
        ("q_a_layernorm.weight", wdt, (q_rank,), "norm"),
        ("q_b_proj.weight", wdt, (h * hd, q_rank), "proj"),
        ("kv_a_proj_with_mqa.weight", wdt, (lora, d), "proj"),
        ("kv_a_layernorm.weight", wdt, (lora,), "norm"),
        ("kv_b_proj.weight", wdt, (h * 2 * hd, lora), "proj"),
        ("o_proj.weight", wdt, (d, h * hd), "proj"),
    ]


#: A full-attention (MLA) layer's ``self_attn`` tensors, by config dialect.
_MLA_TENSORS = {"kimi": _mla_tensors, "k3": _k3_mla_tensors, "glm": _glm_mla_tensors}


def quantize_attention(specs: list[Spec]) -> list[Spec]:
    """Every attention projection as FP8_PB_WO: an F8_E4M3 weight followed by its F32 scale
    grid ``[ceil(out/128), 1, ceil(in/128), 1]``; everything else unchanged."""
    out = []
    for spec in specs:
        is_proj = ".self_attn." in spec.name and spec.name.endswith("_proj.weight")
        is_proj = is_proj or spec.name.endswith("kv_a_proj_with_mqa.weight")
        if not is_proj or spec.name.startswith("vision_tower."):
            out.append(spec)
            continue
        rows, cols = spec.shape
        grid = (-(-rows // FP8_BLOCK), 1, -(-cols // FP8_BLOCK), 1)
        out.append(Spec(spec.name, "F8_E4M3", spec.shape, "fp8"))
        out.append(Spec(spec.name + "_scale", "F32", grid, "scale"))
    return out


def modelopt_config(scale_names: list[str]) -> dict[str, Any]:
    """ModelOpt's ``MIXED_PRECISION`` description of the FP8_PB_WO modules."""
    modules = sorted(n.removesuffix(".weight_scale") for n in scale_names)
    return {
        "quant_algo": "MIXED_PRECISION",
        "kv_cache_quant_algo": None,
        "quantized_layers": {m: {"quant_algo": "FP8_PB_WO"} for m in modules},
        "exclude_modules": ["*_conv1d*", "*o_norm*", "*A_log*", "*dt_bias*",
                            "language_model.lm_head", "vision_tower*"],
    }


def config_json(
    g: Geometry, num_layers: int, kda: set[int], vocab: int, torch_dtype: str
) -> dict[str, Any]:
    """config.json contents in the geometry's dialect."""
    return _CONFIG_JSON[g.style](g, num_layers, kda, vocab, torch_dtype)


def _common(g: Geometry, num_layers: int, vocab: int, torch_dtype: str) -> dict[str, Any]:
    """The keys every dialect's (text) config has alike."""
    return {
        "hidden_size": g.hidden,
        "num_hidden_layers": num_layers,
        "num_attention_heads": g.heads,
        "rms_norm_eps": _RMS_NORM_EPS,
        "vocab_size": vocab,
        "tie_word_embeddings": False,
        "torch_dtype": torch_dtype,
    }


def _kimi_config(
    g: Geometry, num_layers: int, kda: set[int], vocab: int, torch_dtype: str
) -> dict[str, Any]:
    """Kimi-Linear's config.json (1-based ``kda_layers``)."""
    return {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        **_common(g, num_layers, vocab, torch_dtype),
        "num_key_value_heads": g.heads,
        "q_lora_rank": None,
        "kv_lora_rank": g.kv_lora_rank,
        "qk_nope_head_dim": g.head_dim,
        "qk_rope_head_dim": g.rope_dim,
        "v_head_dim": g.head_dim,
        "mla_use_nope": True,
        "linear_attn_config": {
            "head_dim": g.head_dim,
            "num_heads": g.heads,
            "short_conv_kernel_size": g.conv_kernel,
            "kda_layers": [i + 1 for i in range(num_layers) if i in kda],
            "full_attn_layers": [i + 1 for i in range(num_layers) if i not in kda],
        },
    }


def _k3_config(
    g: Geometry, num_layers: int, kda: set[int], vocab: int, torch_dtype: str
) -> dict[str, Any]:
    """Kimi K3's config.json: Kimi-Linear's text config with the full-rank gate, q-LoRA and
    the MLA output gate, nested beside a vision config."""
    text = _kimi_config(g, num_layers, kda, vocab, torch_dtype)
    text["linear_attn_config"].update(
        use_full_rank_gate=True, gate_lower_bound=K3_GATE_LOWER_BOUND
    )
    text.pop("architectures")
    text.update(q_lora_rank=g.q_lora_rank, mla_use_output_gate=True)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "vision_config": {"hidden_size": VISION_HIDDEN, "num_hidden_layers": 1},
    }


def _glm_config(
    g: Geometry, num_layers: int, kda: set[int], vocab: int, torch_dtype: str
) -> dict[str, Any]:
    """GLM-5.3-Flash's config.json (transformers ``glm5_next``: ``layer_types``)."""
    text = {
        "model_type": "glm5_next_text",
        **_common(g, num_layers, vocab, torch_dtype),
        "num_key_value_heads": g.heads,
        "q_lora_rank": g.q_lora_rank,
        "kv_lora_rank": g.kv_lora_rank,
        "qk_nope_head_dim": g.head_dim,
        "qk_rope_head_dim": 0,
        "v_head_dim": g.head_dim,
        "linear_head_dim": g.head_dim,
        "linear_num_heads": g.heads,
        "linear_conv_kernel_dim": g.conv_kernel,
        "linear_lower_bound": GLM_GATE_LOWER_BOUND,
        "layer_types": [
            "linear_attention" if i in kda else "indexed_attention" for i in range(num_layers)
        ],
    }
    return {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text,
        "torch_dtype": torch_dtype,
    }


#: The config.json of each dialect.
_CONFIG_JSON = {"kimi": _kimi_config, "k3": _k3_config, "glm": _glm_config}
