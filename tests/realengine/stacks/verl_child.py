"""verl 0.9.1's own weight sync against a real vLLM engine, in this process:
``python verl_child.py SPEC OUT``.

``SPEC`` (JSON): ``model`` (a checkpoint directory), ``tp``, ``refits`` (the refits to make, in
order: ``"drop"``, the model without layer 0's ``b_proj``; ``"honest"``; ``"bug"``, honest
after :func:`stack_workers.loader_bug` on the last rank). The engine is started as verl's
``vLLMHttpServer`` starts it (``load_format="dummy"``, ``worker_extension_cls`` its
``vLLMColocateWorkerExtension``, stack_workers.py); each refit as its
``vLLMRollout.update_weights`` makes it: ``collective_rpc("update_weights_from_ipc",
kwargs={"use_shm": True})`` (verl's rule ``use_shm = not is_support_ipc()`` on the CPU
platform, stand_ins.py) while every trainer rank's ``BucketedWeightSender`` sends the model's
tensors in FP32 (FSDP's master weights) to its engine rank's ZMQ socket.

A failing receiver never acks, and verl's sender would wait for it forever: the sender's
sockets time out after :data:`ACK_TIMEOUT_S` (ZMQ's ``RCVTIMEO`` on the process's context,
which verl's sockets are made from), and the engine call after :data:`CALL_TIMEOUT_S`.

Before each refit the line :data:`MARK` is printed (the workers' log lines after it are that
refit's). ``OUT`` receives ``started``, ``bug_ranks``, and per refit ``error`` (what
``collective_rpc`` raised: ``type``, ``message``; None when it returned) and ``senders`` (per
trainer rank, what its ``async_send_weights`` raised, ``"sent"`` when it returned), rewritten
as it goes.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: An engine call that has not returned by then is a hang.
CALL_TIMEOUT_S = 120
#: How long verl's sender waits for each ack of its receiver (verl: forever).
ACK_TIMEOUT_S = 30
#: The line this process prints before refit N: the workers' lines after it are that refit's.
MARK = "=== kda_tp test: refit {} ==="
#: The bucket size of verl's sender (``update_weights_bucket_megabytes``): the tiny model's
#: FP32 tensors fit in one bucket, as a small model's do at verl's default.
BUCKET_MB = 16
#: The tensors a ``"drop"`` refit leaves out.
DROPPED = ".layers.0.self_attn.b_proj."


def _send(rank: int, job: str, tensors: dict[str, Any]) -> str:
    """Trainer rank ``rank``'s ``BucketedWeightSender`` sends ``tensors``; what it raised."""
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightSender

    sender = BucketedWeightSender(
        zmq_handle=f"ipc:///tmp/rl-colocate-zmq-{job}-replica-0-rank-{rank}.sock",
        bucket_size_mb=BUCKET_MB, use_shm=True)
    try:
        asyncio.run(sender.async_send_weights(iter(tensors.items())))
    except Exception as error:  # noqa: BLE001 - what reaches verl's trainer
        return f"{type(error).__name__}: {error}"
    return "sent"


def _refit(llm: Any, pool: ThreadPoolExecutor, tp: int, job: str,
           tensors: dict[str, Any]) -> dict[str, Any]:
    """One refit as verl's ``vLLMRollout.update_weights`` makes it."""
    call = pool.submit(llm.collective_rpc, "update_weights_from_ipc", CALL_TIMEOUT_S,
                       kwargs={"use_shm": True})
    senders = [pool.submit(_send, rank, job, tensors) for rank in range(tp)]
    error = None
    try:
        call.result(timeout=CALL_TIMEOUT_S + 10)
    except Exception as raised:  # noqa: BLE001 - what verl's ``await future`` raises
        error = {"type": type(raised).__name__, "message": str(raised)}
    return {"error": error,
            "senders": [sender.result(timeout=ACK_TIMEOUT_S + 30) for sender in senders]}


def main() -> None:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, Any] = {"started": False, "refits": []}

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    job = f"kda-tp-test-{os.getpid()}"
    os.environ["VERL_RAY_JOB_ID"] = job  # what verl's server gives its workers (a Ray job id)
    import torch
    import zmq
    from safetensors.torch import load_file
    from vllm import LLM

    from stack_workers import Verl, loader_bug  # noqa: F401 - verl's stand-ins, here too

    zmq.Context.instance().setsockopt(zmq.RCVTIMEO, ACK_TIMEOUT_S * 1000)
    zmq.Context.instance().setsockopt(zmq.LINGER, 0)
    tp = spec["tp"]
    llm = LLM(spec["model"], tensor_parallel_size=tp, skip_tokenizer_init=True,
              enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
              max_num_seqs=4, max_num_batched_tokens=256, load_format="dummy",
              worker_extension_cls="stack_workers.Verl")
    result["started"] = True
    save()
    honest = {name: value.to(torch.float32) for name, value in
              load_file(Path(spec["model"]) / "model.safetensors").items()}
    with ThreadPoolExecutor(tp + 1) as pool:
        for index, kind in enumerate(spec["refits"]):
            if kind == "bug":
                result["bug_ranks"] = llm.collective_rpc(loader_bug)
            tensors = {name: value for name, value in honest.items()
                       if kind != "drop" or DROPPED not in name}
            print(MARK.format(index), flush=True)
            result["refits"].append({"kind": kind, **_refit(llm, pool, tp, job, tensors)})
            save()


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn
    main()
