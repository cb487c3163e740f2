"""SGLang 0.5.23's KDA layer and model classes of each family, the config they are built from
and the stand-in model that holds one layer, for the engine tests' child processes
(guard/sglang_guard_child.py, audit/test_audit_engines.py's); as in the fixtures' recipe
(tests/data/engine_ranks/make/sglang_rank.py).

Nothing here imports SGLang or torch until a function is called (inside the caller's
``get_parallel().override(...)`` where the layer is built)."""

from __future__ import annotations

import types
from typing import Any

from kda_configs import kimi_config


def kda_classes(kind: str, *, heads: int, head_dim: int, kernel: int,
                hidden: int) -> tuple[Any, type, type]:
    """``(cfg, Layer, Model)`` for ``kind`` (``k3``, ``kimi_linear`` or ``glm``): SGLang's config
    of a one-layer model of that geometry, its KDA layer class (built as ``Layer(layer_idx=0,
    hidden_size=..., config=cfg, quant_config=None, prefix=...)``) and the model class whose
    ``load_weights`` loads it. For ``glm``: no routed experts, and ``glm5_next.get_lora``
    answering "no LoRA" (SGLang's asks the server's arguments)."""
    if kind in ("k3", "kimi_linear"):
        from sglang.srt.configs.kimi_linear import KimiLinearConfig

        cfg = kimi_config(KimiLinearConfig, kind, heads=heads, head_dim=head_dim, kernel=kernel,
                          hidden=hidden)
        if kind == "k3":
            from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention as Layer
            from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM as Model
        else:
            from sglang.srt.models.kimi_linear import KimiDeltaAttention as Layer
            from sglang.srt.models.kimi_linear import KimiLinearForCausalLM as Model
    elif kind == "glm":
        import sglang.srt.models.glm5_next as g5
        from sglang.srt.configs.glm5_next import Glm5NextTextConfig
        from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration as Model
        from sglang.srt.models.glm5_next import Glm5NextLinearAttention as Layer

        cfg = Glm5NextTextConfig(hidden_size=hidden, num_hidden_layers=1, vocab_size=16,
                                 linear_attn_config=dict(head_dim=head_dim, num_heads=heads,
                                                         short_conv_kernel_size=kernel,
                                                         kda_layers=[0], full_attn_layers=[]))
        cfg.n_routed_experts = 0
        g5.get_lora = lambda: types.SimpleNamespace(enable_lora=False, lora_paths=None)
    else:
        raise ValueError(f"unknown KDA family {kind!r}")
    return cfg, Layer, Model


def stand_in(cfg: Any, layer: Any) -> Any:
    """The ``...ForCausalLM`` whose ``model.layers.0.self_attn`` is ``layer`` and nothing else
    (SGLang's full models need CUDA), with the attributes its ``load_weights`` reads."""
    import torch

    top = torch.nn.Module()
    top.config = cfg
    top.model = torch.nn.Module()
    top.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    top.model.layers[0].self_attn = layer
    top.model.start_layer, top.model.end_layer = 0, 1
    top._is_non_local_pp_weight = lambda name: False
    top.post_load_weights = lambda *a, **k: None
    top.num_fused_shared_experts = 0
    top.quant_config = None
    return top
