"""What the vLLM guard tests (test_vllm*.py beside this) share: a stand-in model of one
KDA layer built with vLLM 0.33.0's own classes for a faked tensor-parallel rank, loaded by
vLLM's own loaders, and the bugs a loader makes (a rank's loaders told another rank).

As in the fixtures' recipe (tests/data/engine_ranks/make/vllm_rank.py): the tensor-parallel
group is faked (``parallel_state._TP`` holding ``world_size`` and ``rank_in_group``), and a
stand-in module holding only ``layers.0.self_attn`` goes through the model class's
``load_weights`` (vLLM's full model constructors need CUDA). Imported by the tests after
``pytest.importorskip("vllm")``; the fixtures ``vc`` and ``guard_env_unset`` are in
conftest.py beside it."""

from __future__ import annotations

import os
import types
import warnings
from pathlib import Path

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    vllm = pytest.importorskip("vllm")  # skips the importing test module without vLLM
    import torch
    import vllm.distributed.parallel_state as ps
    from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.linear import ColumnParallelLinear
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    from vllm.v1.worker.worker_base import WorkerBase

from tp_fixtures import CKPT
from tp_fixtures import PRE as ATTN
from vllm_layers import fake_group, kda_classes, stand_in

H, D, K, HIDDEN = 12, 128, 4, 64  # the fixtures' geometry (make/make_ckpt.py)


def set_rank(tp_size: int, rank: int) -> None:
    ps._TP = fake_group(tp_size, rank)
    ps._PP = fake_group(1, 0)


def model_config(path: Path) -> types.SimpleNamespace:
    """The ModelConfig fields vLLM's loaders read."""
    return types.SimpleNamespace(
        model=str(path), model_weights="", revision=None, quantization=None,
        dtype=torch.float32, multimodal_config=None, is_moe=False, get_num_experts=lambda: 0,
        word_embeddings_untied_by_checkpoint=False)



def reload_config(kind: str) -> VllmConfig:
    """The VllmConfig a worker passes to ``reload_weights`` (and a weight-transfer engine is
    made with): the fixture checkpoint of ``kind`` and vLLM's default load config."""
    config = VllmConfig()
    config.model_config = model_config(CKPT[kind])
    config.load_config = LoadConfig()
    return config


def build(vc, kind: str, tp_size: int, rank: int, *, o_proj_rows: bool = False,
          decode_copies: bool = False) -> torch.nn.Module:
    """A stand-in model (``model.layers.0.self_attn``: vLLM's KDA layer of ``kind`` for
    ``rank`` of ``tp_size``), whose ``load_weights`` is the model class's. ``decode_copies``:
    K3's layer as the native decode backend builds it, with ``decode_conv1d_weight`` and
    ``decode_norm_weight`` (on CPU the Triton backend has none)."""
    set_rank(tp_size, rank)
    vc.compilation_config.static_forward_context.clear()
    with set_current_vllm_config(vc):
        cfg, Layer, Model = kda_classes(kind, heads=H, head_dim=D, kernel=K, hidden=HIDDEN)
        if decode_copies:  # the native fused decode backend (CUDA) keeps K3's decode copies
            import vllm.models.kimi_k3.nvidia.kda as k3_kda
            from unittest import mock
            with mock.patch.object(k3_kda, "is_fused_kda_decode_supported", lambda *a: True):
                layer = Layer(cfg, vc, prefix="model.layers.0.self_attn")
        else:
            layer = Layer(cfg, vc, prefix="model.layers.0.self_attn")
        if o_proj_rows:  # the bug: o_proj built column-parallel, its rows split across ranks
            layer.o_proj = ColumnParallelLinear(H * D, HIDDEN, bias=False,
                                                prefix="model.layers.0.self_attn.o_proj")
    inner = stand_in(cfg, layer)
    outer = torch.nn.Module()
    outer.model = inner

    def load_weights(weights):
        with set_current_vllm_config(vc):
            loaded = Model.load_weights(inner, ((n.removeprefix("model."), w) for n, w in weights))
        return {"model." + n for n in loaded}  # names of the stand-in's parameters

    outer.load_weights = load_weights
    return outer


def default_load(vc, model, path: Path) -> None:
    with set_current_vllm_config(vc):
        DefaultModelLoader(LoadConfig()).load_weights(model, model_config(path))


def loading_as(model, tp_size: int, rank: int) -> None:
    """The bug of vllm-gguf-plugin #103 and kin: the weight loaders see rank ``rank`` while the
    worker is another rank of the group."""
    real = model.load_weights

    def load_weights(weights):
        group = ps._TP
        ps._TP = fake_group(tp_size, rank)
        try:
            return real(weights)
        finally:
            ps._TP = group

    model.load_weights = load_weights


def fed(kind: str, scale: float = 2.0) -> list[tuple[str, torch.Tensor]]:
    """A trainer's refit of the fixture: every tensor of the checkpoint, values x ``scale``
    (new weights), in checkpoint names and layout."""
    from safetensors.torch import load_file
    return [(n, t * scale) for n, t in sorted(load_file(str(CKPT[kind] / "model.safetensors"))
                                              .items())]


def loaded(vc, kind: str, tp_size: int, rank: int) -> torch.nn.Module:
    """A model loaded by vLLM's own loader, as a worker holds it before the first refit."""
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, kind, tp_size, rank)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT[kind])
    return model


def expected_after(vc, kind: str, tp_size: int, rank: int, scale: float
                   ) -> dict[str, torch.Tensor]:
    """What the rank must hold after a refit with values x ``scale``: an independent model
    loaded with the same values by the model class's own load_weights (not followed)."""
    model = build(vc, kind, tp_size, rank)
    with set_current_vllm_config(vc):
        model.load_weights(fed(kind, scale))
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def swap_q_into_k(model) -> None:
    """The bug of a refit's loader that writes q_proj's rows where k_proj's go in K3's fused
    ``in_proj_qkvgfab`` (k_proj's shard gets the q_proj fed last, in this call or an earlier
    one)."""
    param = model.model.layers[0].self_attn.in_proj_qkvgfab.weight
    original = param.weight_loader
    last_q = {}

    def swapped(p, w, shard_id=None):
        if shard_id == 0:
            last_q["q"] = w
        return original(p, last_q["q"] if shard_id == 1 else w, shard_id)

    param.weight_loader = swapped


def worker(model, checkpoint: Path, **config) -> types.SimpleNamespace:
    """A vLLM worker as ``WorkerBase``'s methods read it: ``model`` in its model runner, its
    ``vllm_config`` the model config of ``checkpoint`` with no draft model (and ``config``'s
    other fields)."""
    vllm_config = types.SimpleNamespace(model_config=model_config(checkpoint),
                                        speculative_config=None, **config)
    return types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model),
                                 vllm_config=vllm_config)


def fake_llm(workers, tp_size: int = 2) -> types.SimpleNamespace:
    """An ``LLM`` whose ``collective_rpc(method)`` runs ``WorkerBase.method`` on each
    ``(rank, worker)`` of ``workers`` in turn, the tensor-parallel group faked to that rank
    of ``tp_size``: what vLLM's workers answer ``audit_llm``."""
    def collective_rpc(method, kwargs=None):
        out = []
        for rank, one in workers:
            set_rank(tp_size, rank)
            out.append(getattr(WorkerBase, method)(one, **(kwargs or {})))
        return out

    return types.SimpleNamespace(collective_rpc=collective_rpc)

