"""What vLLM's workers import (``worker_extension_cls="stack_workers.<Stack>"``): the CPU
stand-ins (stand_ins.py) applied first, then the stack's own, unmodified worker extension
(``OpenRLHF``: its ``WorkerWrap``; ``Verl``: its ``vLLMColocateWorkerExtension``), imported
when vLLM asks for it; and :func:`loader_bug`, the engine-side loader bug a test injects
through ``collective_rpc``.

The host kind: the non-repacking one (``stand_ins.keep_linear_weights``) unless
:data:`HOST_ENV` is ``repacking`` (vLLM's own GEMM dispatch left alone: it repacks on a CPU with
AVX-512-BF16 or AMX).
"""

from __future__ import annotations

import os
from typing import Any

from stand_ins import cuda_on_cpu, keep_linear_weights, verl_cpu_platform, vllm_distribution

#: The variable that leaves vLLM's CPU GEMM dispatch alone when ``repacking``.
HOST_ENV = "KDA_TP_TEST_HOST"

if os.environ.get(HOST_ENV) != "repacking":
    keep_linear_weights()
cuda_on_cpu()

#: The KDA projection a loader bug changes, and where: one element of q's rows.
BUG_MODULE = "model.layers.0.self_attn.in_proj_qkvgfab"
BUG_ELEMENT = (0, 5)

__all__ = ["OpenRLHF", "Verl", "loader_bug"]


def __getattr__(name: str) -> Any:
    """The stack's worker extension ``name`` (``OpenRLHF``, ``Verl``), with its stand-ins."""
    if name == "OpenRLHF":
        from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

        return WorkerWrap
    if name == "Verl":
        vllm_distribution()
        verl_cpu_platform()
        from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

        return vLLMColocateWorkerExtension
    raise AttributeError(f"module 'stack_workers' has no attribute {name!r}")


def loader_bug(worker: Any) -> int:
    """On the last tensor-parallel rank, wrap the ``weight_loader`` of layer 0's
    ``in_proj_qkvgfab`` so that after loading q (shard 0) it adds 1.0 to this rank's q row 0,
    column 5: an engine-side loader bug. Returns the rank it was put on, or -1."""
    from vllm.distributed import parallel_state

    rank = parallel_state.get_tensor_model_parallel_rank()
    if rank != parallel_state.get_tensor_model_parallel_world_size() - 1:
        return -1
    module = worker.model_runner.model.get_submodule(BUG_MODULE)
    param = module.weight
    load = param.weight_loader

    def buggy(param_: Any, loaded: Any, shard_id: Any = None, *args: Any, **kwargs: Any) -> Any:
        out = load(param_, loaded, shard_id, *args, **kwargs)
        if shard_id == 0:
            param_.data[BUG_ELEMENT] += 1.0
        return out

    param.weight_loader = buggy
    return rank
