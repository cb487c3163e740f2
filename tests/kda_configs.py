"""The Kimi Linear / K3 HF config of the engine tests' one-layer models, the same for vLLM
0.33.0 and SGLang 0.5.23 (each engine ships its own ``KimiLinearConfig`` class): the
fixtures' recipe's (tests/data/engine_ranks/make)."""

from __future__ import annotations

from typing import Any


def kimi_config(config_cls: type, kind: str, *, heads: int, head_dim: int, kernel: int,
                hidden: int) -> Any:
    """``config_cls`` (an engine's ``KimiLinearConfig``) of a one-layer model of ``kind``
    (``k3``: the full-rank gate and K3's gate lower bound, -5.0; ``kimi_linear``) of that
    geometry: ``heads`` x ``head_dim``, conv ``kernel``, ``hidden`` size, vocabulary 16."""
    lac: dict[str, Any] = dict(head_dim=head_dim, num_heads=heads, short_conv_kernel_size=kernel,
                               kda_layers=[1], full_attn_layers=[])
    if kind == "k3":
        lac.update(use_full_rank_gate=True, gate_lower_bound=-5.0)
    return config_cls(hidden_size=hidden, num_hidden_layers=1, vocab_size=16,
                      linear_attn_config=lac, hidden_act="silu", rms_norm_eps=1e-5)
