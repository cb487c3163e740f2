"""OpenRLHF 0.11.2's own weight sync against a real vLLM engine, in this process:
``python openrlhf_child.py SPEC OUT``.

``SPEC`` (JSON): ``model`` (a checkpoint directory), ``tp``. The engine is started as OpenRLHF's
``create_vllm_engines`` starts it, with ``worker_extension_cls`` its ``WorkerWrap``
(stack_workers.py); the trainer side is re-enacted as ``PolicyModelActor.broadcast_to_vllm``
runs it (on a DeepSpeed Ray actor there, threads here): ``collective_rpc("init_process_group")``
while rank 0 of the group joins, then per tensor (BF16, as DeepSpeed sends them)
``collective_rpc("update_weight", (name, dtype, shape))`` while rank 0 broadcasts it. Two
refits: honest, then with :func:`stack_workers.loader_bug` on the last rank. OpenRLHF stops a
refit at its first failing tensor (``ray.get`` raises), and so does this.

Before each refit the line :data:`MARK` is printed (the workers' log lines after it are that
refit's). ``OUT`` receives ``started``, ``bug_ranks`` (``loader_bug``'s answers), and per
refit ``sent`` (tensors whose call returned) and ``error`` (what the failing call raised:
``type``, ``message``, the tensor's ``name``), rewritten as it goes.
"""

from __future__ import annotations

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: A call (RPC and broadcast) that has not returned by then is a hang.
CALL_TIMEOUT_S = 120
#: The line this process prints before refit N: the workers' lines after it are that refit's.
MARK = "=== kda_tp test: refit {} ==="


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refit(llm: Any, pool: ThreadPoolExecutor, group: Any,
           tensors: dict[str, Any]) -> dict[str, Any]:
    """One refit as OpenRLHF's ``broadcast_to_vllm`` makes it; stops at the first failing
    tensor."""
    import torch

    sent = 0
    for name, tensor in tensors.items():
        call = pool.submit(llm.collective_rpc, "update_weight", CALL_TIMEOUT_S,
                           (name, torch.bfloat16, tuple(tensor.shape)))
        work = group.start(tensor, 0)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while not (work.is_completed() or call.done()) and time.monotonic() < deadline:
            time.sleep(0.001)
        try:
            call.result(timeout=max(deadline - time.monotonic(), 0))
        except Exception as error:  # noqa: BLE001 - what OpenRLHF's ray.get raises
            return {"sent": sent, "error": {"type": type(error).__name__, "message": str(error),
                                            "name": name}}
        sent += 1
    return {"sent": sent, "error": None}


def main() -> None:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, Any] = {"started": False, "refits": []}

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    import torch
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.distributed.utils import StatelessProcessGroup

    from stand_ins import GlooBroadcaster
    from stack_workers import loader_bug

    tp = spec["tp"]
    llm = LLM(spec["model"], tensor_parallel_size=tp, skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=256,
              worker_extension_cls="stack_workers.OpenRLHF")
    result["started"] = True
    save()
    tensors = {name: value.to(torch.bfloat16) for name, value in
               load_file(Path(spec["model"]) / "model.safetensors").items()}
    port = _free_port()
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(llm.collective_rpc, "init_process_group", CALL_TIMEOUT_S,
                             ("127.0.0.1", port, 1, tp + 1, "openrlhf", "gloo"))
        group = GlooBroadcaster(StatelessProcessGroup.create("127.0.0.1", port, 0, tp + 1))
        joined.result(timeout=CALL_TIMEOUT_S)
        print(MARK.format(0), flush=True)
        result["refits"].append(_refit(llm, pool, group, tensors))
        save()
        result["bug_ranks"] = llm.collective_rpc(loader_bug)
        print(MARK.format(1), flush=True)
        result["refits"].append(_refit(llm, pool, group, tensors))
        save()


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn
    main()
