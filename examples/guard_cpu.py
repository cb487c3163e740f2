"""The guard's OK and FAIL lines through vLLM 0.33's own loader, on CPU, in one minute.

Run it in the environment vLLM is installed in, with kda_tp installed there too (docs/guard-cpu.md):

    VLLM_TARGET_DEVICE=cpu python examples/guard_cpu.py

What it does, with vLLM's own classes throughout:

1. vLLM's ``load_general_plugins()`` loads kda_tp's plugin (the ``vllm.general_plugins`` entry
   point), which installs the guard around vLLM's loaders.
2. A small Kimi-Linear checkpoint is generated (one KDA layer: 12 heads of 128, hidden 64).
3. Rank 1 of a tensor-parallel group of 2 builds vLLM's own Kimi-Linear KDA layer
   (``KimiGatedDeltaNetAttention``) and loads the checkpoint with vLLM's ``DefaultModelLoader``
   and the model class's ``load_weights``: the guard checks the rank's KDA parameters and logs
   one line ending in ``OK``.
4. The same rank again, with a classic loader bug: the weight loaders think they are rank 0
   (a wrong TP rank inside the loaders), so rank 1 holds rank 0's slices of the parameters
   whose loaders ask the group. The guard stops the load with a ``GuardError`` that names each
   wrong parameter and what it holds instead.
5. The same load with ``KDA_TP_GUARD=warn``: the diagnosis is logged at ERROR and issued as a
   ``GuardWarning``, the load goes on.

vLLM's full model constructors and its distributed start-up need a GPU; as kda_tp's engine
tests do, the tensor-parallel group is faked (vLLM's ``parallel_state._TP`` holds the world size
and rank its layers ask for) and the model is a stand-in module holding only the KDA layer,
loaded through the real model class's ``load_weights``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
import types
import warnings
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
HEADS, HEAD_DIM, KERNEL, HIDDEN = 12, 128, 4, 64


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kda_tp").setLevel(logging.INFO)  # the guard's lines
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
            import torch
            import vllm.distributed.parallel_state as ps
            from vllm.config import LoadConfig, VllmConfig, set_current_vllm_config
            from vllm.model_executor.layers.mamba.gdn.kimi_gdn_linear_attn import (
                KimiGatedDeltaNetAttention,
            )
            from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
            from vllm.models.kimi_k3.nvidia.model import KimiLinearModel
            from vllm.plugins import load_general_plugins
            from vllm.transformers_utils.configs.kimi_linear import KimiLinearConfig
    except ImportError as e:
        print(f"guard_cpu.py: needs vLLM 0.33 (and its torch) in this Python ({e}); run it with "
              "the python of vLLM's environment, with kda_tp installed there from this "
              "checkout (docs/guard-cpu.md)", file=sys.stderr)
        return 2

    from kda_tp import GuardError
    from kda_tp.guard import MODE_ENV
    from kda_tp.synth import write_small_checkpoint

    load_general_plugins()  # what every vLLM worker does first: installs kda_tp's guard
    if not getattr(DefaultModelLoader.load_weights, "__kda_tp_guard__", False):
        print("guard_cpu.py: kda_tp's vLLM plugin is not installed in this environment: "
              "install kda_tp from this checkout into vLLM's environment "
              "(/path/to/engine-env/bin/python -m pip install /path/to/kda_tp; "
              "docs/guard-cpu.md)", file=sys.stderr)
        return 2

    vllm_config = VllmConfig()
    vllm_config.model_config = types.SimpleNamespace(dtype=torch.float32, hf_config=None)
    hf_config = KimiLinearConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, vocab_size=16, hidden_act="silu",
        rms_norm_eps=1e-5, linear_attn_config=dict(
            head_dim=HEAD_DIM, num_heads=HEADS, short_conv_kernel_size=KERNEL, kda_layers=[1],
            full_attn_layers=[]))

    def group(world_size: int, rank: int) -> types.SimpleNamespace:
        """What vLLM's layers ask the tensor-parallel group (a real one needs torch.distributed)."""
        return types.SimpleNamespace(world_size=world_size, rank_in_group=rank, rank=rank,
                                     local_rank=0, device_group=None, cpu_group=None,
                                     ranks=list(range(world_size)))

    def rank_model(tp_size: int, rank: int, loaders_rank: int) -> torch.nn.Module:
        """Rank ``rank``'s model: vLLM's KDA layer as ``model.layers.0.self_attn``, loaded by
        KimiLinearModel.load_weights while vLLM's group says ``loaders_rank``."""
        ps._TP, ps._PP = group(tp_size, rank), group(1, 0)
        vllm_config.compilation_config.static_forward_context.clear()
        with set_current_vllm_config(vllm_config):
            layer = KimiGatedDeltaNetAttention(hf_config, vllm_config,
                                               prefix="model.layers.0.self_attn")
        inner = torch.nn.Module()
        inner.config = hf_config
        inner.is_fused_shared_expert_enabled = False
        inner.layers = torch.nn.ModuleList([torch.nn.Module()])
        inner.layers[0].self_attn = layer
        model = torch.nn.Module()
        model.model = inner

        def load_weights(weights):  # the model class's own, its loaders told `loaders_rank`
            # The stand-in holds only the KDA layer: the checkpoint's other tensors (embedding,
            # MLP, head) have no parameter here and are skipped.
            attention = ((n.removeprefix("model."), w) for n, w in weights
                         if n.startswith("model.layers.0.self_attn."))
            worker_group, ps._TP = ps._TP, group(tp_size, loaders_rank)
            try:
                with set_current_vllm_config(vllm_config):
                    loaded = KimiLinearModel.load_weights(inner, attention)
            finally:
                ps._TP = worker_group
            return {"model." + n for n in loaded}

        model.load_weights = load_weights
        return model

    def load(model: torch.nn.Module, checkpoint: Path) -> None:
        """vLLM's DefaultModelLoader.load_weights, as a worker calls it (the guard runs after)."""
        model_config = types.SimpleNamespace(
            model=str(checkpoint), model_weights="", revision=None, quantization=None,
            dtype=torch.float32, multimodal_config=None, is_moe=False,
            get_num_experts=lambda: 0)
        with set_current_vllm_config(vllm_config):
            DefaultModelLoader(LoadConfig(use_tqdm_on_load=False)).load_weights(model, model_config)

    os.environ.pop(MODE_ENV, None)  # the default mode, fail
    with tempfile.TemporaryDirectory(prefix="kda-tp-guard-cpu-") as tmp:
        checkpoint = write_small_checkpoint(
            Path(tmp) / "kimi-linear", hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM,
            conv_kernel=KERNEL, gate_rank=HEAD_DIM, num_layers=1, kda_layers=[0],
            weight_dtype="F32")
        print("1. rank 1 of 2 loads its slices:")
        load(rank_model(2, 1, loaders_rank=1), checkpoint)
        print("2. rank 1 of 2, its weight loaders told rank 0:")
        try:
            load(rank_model(2, 1, loaders_rank=0), checkpoint)
        except GuardError as e:
            print(f"GuardError: {e}")
        else:
            print("the guard did not stop the wrong load", file=sys.stderr)
            return 1
        print(f"3. the same with {MODE_ENV}=warn:")
        os.environ[MODE_ENV] = "warn"
        load(rank_model(2, 1, loaders_rank=0), checkpoint)
        print("loaded anyway (mode warn)")
        return 0


if __name__ == "__main__":
    sys.exit(main())
