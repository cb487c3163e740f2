"""Loads one MLA layer of a hybrid checkpoint through an engine's own MLA class and model
``load_weights`` on CPU at every rank of the given TP sizes, and saves what the layer holds.

Run in its own interpreter (the faked tensor-parallel group is global):
``python mla_engine_child.py ENGINE KIND CKPT LAYER OUT_DIR TP_SIZES`` with ENGINE ``vllm`` or
``sglang`` (or ``sglang-refits``: ``_sglang_refits``, TP_SIZES unused), KIND ``k3``,
``kimi_linear`` or ``glm``, LAYER the checkpoint's 0-based MLA layer, TP_SIZES comma-separated
(``1,2,4``). For each rank it writes ``OUT_DIR/tp{T}_r{R}.safetensors``:
the layer's ``named_parameters()`` after ``load_weights`` (names after ``self_attn.``, in the
model dtype BF16), and the copies the engine derives from ``kv_b_proj`` as ``derived.<name>``:
vLLM's ``W_UK_T`` / ``W_UV`` after the layer's ``process_weights_after_loading`` (on
``mla_attn.mla_attn`` for GLM-5.3; the ``CPU_MLA`` backend, as ``AMX_MLA`` empties
``kv_b_proj``), SGLang's ``w_kc`` / ``w_vc`` after the model's own ``post_load_weights``.
For vLLM, ``OUT_DIR/tp{T}_r{R}.json`` holds vLLM's own ``compute_tensor_digests`` of the layer
after post-processing (its weight checksums, names relative to ``self_attn``).
The model classes' ``load_weights`` run on a stand-in holding only ``layers.{LAYER}.self_attn``
(the engines' full model constructors need CUDA); GLM-5.3 is built without its DSA indexer
(``index_topk`` None), which the tables do not describe.
"""

from __future__ import annotations

import json
import os
import sys
import types
import warnings
from pathlib import Path
from typing import Any

from kda_tp.guard._target import AS_HELD


def _checkpoint(ckpt: Path, layer: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The text config and the MLA layer's tensors, named from ``layers.`` on."""
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    text = dict(config.get("text_config", config))
    text.pop("model_type", None)
    weights: dict[str, Any] = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        weights.update(load_file(str(f)))
    mla = {"layers." + n.split("layers.", 1)[1]: w for n, w in weights.items()
           if f"layers.{layer}.self_attn." in n}
    return text, mla


def vllm_layer(kind: str, text: dict[str, Any], mla: dict[str, Any], layer: int, t: int,
               r: int, wrap: Any = None, weights: Any = None) -> tuple[Any, Any, Any, Any]:
    """The MLA layer built by vLLM's own class for rank ``r`` of ``t`` (the faked group set)
    and loaded by its model class's ``load_weights`` on a stand-in: ``(vllm_config, stand-in,
    layer, the MLAAttention that absorbs kv_b_proj)``; the stand-in's ``load_weights`` is the
    model class's, or ``wrap(it, layer)`` (a loader with a bug, tests/mla_bugs_child.py);
    ``weights``: what the first load feeds (default ``mla``'s items)."""
    import torch
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_layers import fake_group

    ps._TP = fake_group(t, r)
    vc = VllmConfig()
    vc.attention_config.backend = AttentionBackendEnum.CPU_MLA
    prefix = f"layers.{layer}.self_attn"
    with set_current_vllm_config(vc):
        if kind == "glm":
            from transformers import Glm5NextTextConfig
            from vllm.models.glm5next.common.attention import Glm5NextMLAAttention
            from vllm.models.glm5next.common.model import Glm5NextModel as Model

            cfg = Glm5NextTextConfig(**text)
            cfg.__dict__.update(index_topk=None, mla_use_nope=False)  # no DSA indexer
        else:
            from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention
            from vllm.models.kimi_k3.nvidia.model import KimiLinearModel as Model
            from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig

            cfg = KimiLinearConfig(**text)
        vc.model_config = types.SimpleNamespace(dtype=torch.bfloat16, hf_config=cfg,
                                                hf_text_config=cfg, rswa_window=None)
        geometry = (cfg.hidden_size, cfg.num_attention_heads, cfg.qk_nope_head_dim,
                    cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank)
        if kind == "glm":
            attn = Glm5NextMLAAttention(vc, cfg, *geometry, prefix=prefix, skip_rope=True)
            absorbing = attn.mla_attn.mla_attn
        else:
            attn = MultiHeadLatentAttention(
                cfg, *geometry, use_output_gate=bool(getattr(cfg, "mla_use_output_gate", False)),
                prefix=prefix)
            absorbing = attn
        stack = torch.nn.Module()
        stack.config = cfg
        stack.is_fused_shared_expert_enabled = False
        stack.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(layer + 1)])
        stack.layers[layer].self_attn = attn
        stack.load_weights = types.MethodType(Model.load_weights, stack)
        if wrap is not None:
            stack.load_weights = wrap(stack.load_weights, attn)
        stack.load_weights(iter(mla.items()) if weights is None else weights)
    return vc, stack, attn, absorbing


def _vllm(kind: str, text: dict[str, Any], mla: dict[str, Any], layer: int, t: int,
          r: int) -> tuple[Any, dict[str, Any]]:
    import torch
    from vllm.config import set_current_vllm_config

    vc, _, attn, absorbing = vllm_layer(kind, text, mla, layer, t, r)
    with set_current_vllm_config(vc):
        held = {n: p.data.clone() for n, p in attn.named_parameters()}
        absorbing.process_weights_after_loading(torch.bfloat16)
        derived = {n: p.data for n, p in attn.named_parameters()
                   if n.rpartition(".")[2] in ("W_UK_T", "W_UV")}
        from vllm.model_executor.model_loader.weight_checksum import compute_tensor_digests

        held["checksums"] = compute_tensor_digests(attn)
    return held, derived


def _sglang(kind: str, text: dict[str, Any], mla: dict[str, Any], layer: int, t: int,
            r: int, then: Any = None, wrap: Any = None,
            weights: Any = None) -> tuple[Any, dict[str, Any]]:
    """The MLA layer built by SGLang's own class for rank ``r`` of ``t`` and loaded by its
    model class's ``load_weights`` (or ``wrap(it, layer)``) on a stand-in, fed ``weights``
    (default ``mla``'s items); ``then(stand-in)`` runs inside the parallel context:
    ``(the layer's parameters, its w_kc / w_vc)``."""
    import torch
    from sglang.srt.layers.utils import PPMissingLayer
    from sglang.srt.runtime_context import get_parallel

    if kind == "glm":
        import sglang.srt.models.glm5_next as g5
        from sglang.srt.configs.glm5_next import Glm5NextTextConfig as Config
        from sglang.srt.models.deepseek_v2 import DeepseekV2AttentionMLA as Attention
        from sglang.srt.models.glm5_next import Glm5NextForConditionalGeneration as Model

        g5.get_lora = lambda: types.SimpleNamespace(enable_lora=False, lora_paths=None)
    else:
        from sglang.srt.configs.kimi_linear import KimiLinearConfig as Config

        if kind == "k3":
            from sglang.srt.models.kimi_k3 import KimiK3LinearForCausalLM as Model
            from sglang.srt.models.kimi_k3 import KimiK3MLAAttention as Attention
        else:
            from sglang.srt.models.kimi_linear import KimiLinearForCausalLM as Model
            from sglang.srt.models.kimi_linear import KimiMLAAttention as Attention
    cfg = Config(**text)
    if kind == "glm":
        cfg.n_routed_experts = 0
    extra = {"enable_cp_tp_group_sharing": False} if kind == "glm" else {}
    prefix = f"model.layers.{layer}.self_attn"
    with get_parallel().override(tp_size=t, tp_rank=r, attn_tp_size=t, attn_tp_rank=r,
                                 attn_dcp_size=1, moe_tp_size=t, **extra):
        if kind == "k3":
            attn = Attention(config=cfg, layer_idx=layer, quant_config=None, prefix=prefix)
        else:
            attn = Attention(config=cfg, hidden_size=cfg.hidden_size,
                             num_heads=cfg.num_attention_heads,
                             qk_nope_head_dim=cfg.qk_nope_head_dim,
                             qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim,
                             q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank,
                             quant_config=None, layer_id=layer, reduce_results=False,
                             prefix=prefix, skip_rope=True)
        top = torch.nn.Module()
        top.config = cfg
        top.model = torch.nn.Module()
        top.model.layers = torch.nn.ModuleList(
            [PPMissingLayer() for _ in range(layer)] + [torch.nn.Module()])
        top.model.layers[layer].self_attn = attn
        top.model.layers[layer].use_attn_residuals = False  # K3's post_load_weights asks
        top.model.layers[layer].mlp = torch.nn.Module()
        top.model.start_layer, top.model.end_layer = 0, layer + 1
        top._is_non_local_pp_weight = lambda name: False
        top.num_fused_shared_experts = 0
        top.quant_config = None
        top.fuse_qkv_a_proj = cfg.q_lora_rank is not None  # GLM-5.3's model sets it so
        top.encoder_only = False
        top.post_load_weights = types.MethodType(Model.post_load_weights, top)
        top.load_weights = types.MethodType(Model.load_weights, top)
        if wrap is not None:
            top.load_weights = wrap(top.load_weights, attn)
        top.load_weights(iter(("model." + n, w) for n, w in mla.items()) if weights is None
                         else (("model." + n, w) for n, w in weights))
        held = {n: p.data.clone() for n, p in attn.named_parameters()}
        derived = {n: getattr(attn, n) for n in ("w_kc", "w_vc")
                   if getattr(attn, n, None) is not None}
        if then is not None:
            then(top)
    return held, derived


class FromLayers:
    """The engine as it holds its parameters (as loaded: ``kda_tp.guard._target.AS_HELD``),
    whose name mapping gives the stand-in (the model class's inner model) a checkpoint name
    from ``layers.`` on behind ``prefix`` (``"model.layers."`` as the served class's mapper
    gives it, or ``"layers."`` once the mapper stripped the checkpoint's prefix)."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def described(self, name: str, param: Any) -> Any:
        return AS_HELD.described(name, param)

    def read_back(self, module: Any, param: Any) -> tuple[Any, str | None]:
        return AS_HELD.read_back(module, param)

    def masked_copy(self, copy: Any) -> bool:
        return AS_HELD.masked_copy(copy)

    def spelling(self, model: Any) -> Any:
        return lambda name: (self.prefix + name.split("layers.", 1)[1]
                             if "layers." in name else name)


def _sglang_refits(kind: str, ckpt: Path, text: dict[str, Any], mla: dict[str, Any],
                   layer: int, out: Path) -> None:
    """SGLang's ``w_kc`` / ``w_vc`` judged after the ``load_weights`` that rebuilt them, on
    rank 1 of 2: the first load checked (its KDA layer built by the layout) and followed,
    then a ``kv_b_proj`` refit through the model's ``load_weights``, then one whose
    ``post_load_weights`` is not forwarded (SGLang #26744). Writes ``OUT_DIR/refits.json``:
    ``{"honest": [the guard's lines], "stale": the GuardError's message}``."""
    import logging

    import kda_tp
    from kda_tp.engines import LAYOUTS, build_param
    from kda_tp.errors import GuardError
    from kda_tp.guard import check, follow
    from kda_tp.guard._derived import mla_copies

    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logging.getLogger("kda_tp.guard").addHandler(Keep())
    layout = LAYOUTS[{"k3": "sglang-0.5.23-k3", "glm": "sglang-0.5.23-glm-5.3"}[kind]]
    kv_b = f"layers.{layer}.self_attn.kv_b_proj.weight"
    found: dict[str, Any] = {}

    def refits(top: Any) -> None:
        view = kda_tp.open_rank(ckpt, tp_rank=1, tp_size=2, qk_multiple=1, mla=True)
        base = layout.state_dict_prefix(view.prefix)
        params = {f"{base}0.self_attn.{p.suffix}": build_param(view, layout, p.suffix, 0,
                                                               model_dtype="BF16")
                  for p in layout.params_for(view.plan)}
        named = {base + n.removeprefix("model.layers."): p  # the checkpoint's prefix
                 for n, p in [*top.named_parameters(), *mla_copies(top).items()]}
        params.update({n: p for n, p in named.items() if n.endswith(".weight")})
        result = check(params, ckpt, tp_rank=1, tp_size=2, engine=layout.name,
                       derived={n: p for n, p in named.items() if n not in params})
        assert result is not None and result.passed and result.mla_plan is not None, \
            result and result.text()
        follow(top, "sglang", plan=result.plan, tp_rank=1, tp_size=2,
               mla_plan=result.mla_plan, reader=FromLayers("model.layers."))
        lines.clear()
        top.load_weights(iter([("model." + kv_b, mla[kv_b] * 2)]))
        found["honest"] = list(lines)
        lines.clear()
        for name, tensor in mla.items():  # one tensor per call (OpenRLHF, TRL colocate)
            top.load_weights(iter([("model." + name, tensor * 2)]))
        found["per_tensor"] = list(lines)
        top.post_load_weights = lambda *args, **kwargs: None  # a hook not forwarded
        try:
            top.load_weights(iter([("model." + kv_b, mla[kv_b] * 3)]))
        except GuardError as error:
            found["stale"] = str(error)

    _sglang(kind, text, mla, layer, 2, 1, then=refits)
    (out / "refits.json").write_text(json.dumps(found))


def main(argv: list[str]) -> None:
    warnings.simplefilter("ignore")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    import torch
    from safetensors.torch import save_file

    engine, kind, ckpt, layer, out = argv[:5]
    sizes = [int(t) for t in argv[5].split(",")]
    text, mla = _checkpoint(Path(ckpt), int(layer))
    torch.set_default_dtype(torch.bfloat16)  # the engines build a model in its model dtype
    if engine.startswith("sglang"):
        from sglang.srt.runtime_context import _CONTEXT
        from sglang.srt.server_args import ServerArgs

        _CONTEXT.set_server_args(ServerArgs(model_path=ckpt, device="cpu"))
    if engine == "sglang-refits":
        _sglang_refits(kind, Path(ckpt), text, mla, int(layer), Path(out))
        return
    load = _vllm if engine == "vllm" else _sglang
    for t in sizes:
        for r in range(t):
            held, derived = load(kind, text, mla, int(layer), t, r)
            checksums = held.pop("checksums", None)
            if checksums is not None:  # vLLM's own weight checksums, after post-processing
                (Path(out) / f"tp{t}_r{r}.json").write_text(json.dumps(checksums))
            tensors = {**held, **{f"derived.{n}": d.contiguous() for n, d in derived.items()}}
            save_file(tensors, str(Path(out) / f"tp{t}_r{r}.safetensors"),
                      metadata={"tp_size": str(t), "tp_rank": str(r)})


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1:])
