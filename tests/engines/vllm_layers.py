"""vLLM 0.33.0's KDA layer and model classes of each family, and the config they are built from,
for the engine tests beside it (test_digests_vllm.py's child process, test_guard_vllm.py).

Nothing here imports vLLM until :func:`kda_classes` is called (inside the caller's
``set_current_vllm_config``), so collecting the tests without vLLM never imports it. The
configs are those of the fixtures' recipe (tests/data/engine_ranks/make/vllm_rank.py)."""

from __future__ import annotations

from typing import Any


def kda_classes(kind: str, *, heads: int, head_dim: int, kernel: int,
                hidden: int) -> tuple[Any, type, type]:
    """``(cfg, Layer, Model)`` for ``kind`` (``k3``, ``kimi_linear`` or ``glm``): the HF config
    of a one-layer model of that geometry, vLLM's KDA layer class (built as
    ``Layer(cfg, vllm_config, prefix=...)``) and the model class whose ``load_weights`` loads it."""
    if kind in ("k3", "kimi_linear"):
        from vllm.models.kimi_k3.nvidia.model import KimiLinearModel as Model
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

        lac = dict(head_dim=head_dim, num_heads=heads, short_conv_kernel_size=kernel,
                   kda_layers=[1], full_attn_layers=[])
        if kind == "k3":
            lac.update(use_full_rank_gate=True, gate_lower_bound=-5.0)
            from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention as Layer
        else:
            from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
                KimiGatedDeltaNetAttention as Layer)
        cfg = KimiLinearConfig(hidden_size=hidden, num_hidden_layers=1, vocab_size=16,
                               linear_attn_config=lac, hidden_act="silu", rms_norm_eps=1e-5)
    elif kind == "glm":
        from transformers import Glm5NextTextConfig
        from vllm.models.glm5next.common.kda import Glm5NextLinearAttention as Layer
        from vllm.models.glm5next.common.model import Glm5NextModel as Model

        cfg = Glm5NextTextConfig(
            hidden_size=hidden, num_hidden_layers=1, vocab_size=16,
            linear_attn_config=dict(head_dim=head_dim, num_heads=heads,
                                    short_conv_kernel_size=kernel),
            layer_types=["linear_attention"], q_lora_rank=64, qk_rope_head_dim=0,
            num_attention_heads=4, num_key_value_heads=4, mla_use_nope=False)
    else:
        raise ValueError(f"unknown KDA family {kind!r}")
    return cfg, Layer, Model
