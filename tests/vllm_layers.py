"""vLLM 0.33.0's KDA layer and model classes of each family, the config they are built from,
the faked tensor-parallel group and the stand-in model that holds one layer, for the engine
tests (audit/test_digests_vllm.py's and audit/test_audit_engines.py's child processes,
guard/test_vllm*.py) and the fixtures' recipe (tests/data/engine_ranks/make/vllm_rank.py).

Nothing here imports vLLM or torch until a function is called (:func:`kda_classes` inside the
caller's ``set_current_vllm_config``), so collecting the tests without vLLM never imports it."""

from __future__ import annotations

import types
from typing import Any

from kda_configs import kimi_config


def fake_group(world_size: int, rank: int) -> types.SimpleNamespace:
    """What vLLM's layers and loaders ask the tensor-parallel group (``parallel_state._TP``): a
    real one needs torch.distributed."""
    return types.SimpleNamespace(world_size=world_size, rank_in_group=rank, rank=rank,
                                 local_rank=0, device_group=None, cpu_group=None,
                                 ranks=list(range(world_size)))


def stand_in(cfg: Any, layer: Any) -> Any:
    """The decoder model holding only layer 0's attention (``layers.0.self_attn``: ``layer``),
    whose model class's ``load_weights`` runs on it (vLLM's full model constructors need CUDA)."""
    import torch

    stack = torch.nn.Module()
    stack.config = cfg
    stack.is_fused_shared_expert_enabled = False
    stack.layers = torch.nn.ModuleList([torch.nn.Module()])
    stack.layers[0].self_attn = layer
    return stack


def kda_classes(kind: str, *, heads: int, head_dim: int, kernel: int,
                hidden: int) -> tuple[Any, type, type]:
    """``(cfg, Layer, Model)`` for ``kind`` (``k3``, ``kimi_linear`` or ``glm``): the HF config
    of a one-layer model of that geometry, vLLM's KDA layer class (built as
    ``Layer(cfg, vllm_config, prefix=...)``) and the model class whose ``load_weights`` loads it."""
    if kind in ("k3", "kimi_linear"):
        from vllm.models.kimi_k3.nvidia.model import KimiLinearModel as Model
        from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

        if kind == "k3":
            from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention as Layer
        else:
            from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
                KimiGatedDeltaNetAttention as Layer)
        cfg = kimi_config(KimiLinearConfig, kind, heads=heads, head_dim=head_dim, kernel=kernel,
                          hidden=hidden)
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
