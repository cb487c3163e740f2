"""TRL 1.16.0's own weight sync against real in-process vLLM engines:
``python trl_child.py SPEC OUT``.

``SPEC`` (JSON): ``model`` (a checkpoint directory), ``tp``, ``refits`` (in order:
``"honest"``; ``"bug"``, honest after :func:`stack_workers.loader_bug` on the last rank). This
process is the launcher: it runs itself under ``torch.distributed.run`` with ``tp`` processes,
as a TRL trainer runs (``accelerate launch`` / ``torchrun``). Each of them is one trainer rank:
an ``accelerate.Accelerator`` (gloo on CPU), and TRL's
``VLLMGeneration(mode="colocate", tensor_parallel_size=tp)``, whose ``vllm.LLM`` with
``distributed_executor_backend="external_launcher"`` holds this rank's engine worker in the
process. Each refit is TRL's own ``sync_weights()``: one ``load_weights([(name, param)])``
per parameter into the rank's worker, each parameter in its own dtype.

The policy TRL reads is the checkpoint's tensors under their checkpoint names (a module tree
built from them, ``name_or_path`` the checkpoint): transformers 5's ``KimiLinearForCausalLM``
renames and fuses parameters when it loads (``conv1d``, ``A_log``, the experts), which
vLLM 0.32's Kimi-Linear ``load_weights`` does not take, guard or no guard.

Before each refit each rank prints the line :data:`MARK` (its lines after it are that
refit's). The launch is ended after :data:`LAUNCH_TIMEOUT_S`. ``OUT`` receives ``started``,
the launch's ``returncode`` and ``ranks``: per rank its own ``started``, ``bug_rank`` and per
refit ``error`` (what ``sync_weights`` raised: ``type``, ``message``; None when it returned),
each rank's object rewritten as it goes (``OUT.rank<N>``) and gathered by the launcher.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

#: The line each rank prints before refit N: its lines after it are that refit's.
MARK = "=== kda_tp test: refit {} ==="
#: A launch that has not ended by then is a hang (less than engine_run.ENGINE_TIMEOUT_S, after
#: which the test kills this process's group).
LAUNCH_TIMEOUT_S = 360


def _policy(model: Path) -> Any:
    """A module tree holding the checkpoint's tensors as parameters under their names."""
    import torch
    from safetensors.torch import load_file

    policy = torch.nn.Module()
    for name, value in load_file(model / "model.safetensors").items():
        *path, leaf = name.split(".")
        module = policy
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(value, requires_grad=False))
    policy.name_or_path = str(model)
    return policy


def rank_main(spec: dict[str, Any], out: Path) -> None:
    """One trainer rank (under ``torch.distributed.run``)."""
    result: dict[str, Any] = {"started": False, "refits": []}

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    save()
    from accelerate import Accelerator

    from stack_workers import loader_bug
    from stand_ins import rebind_kernels_past_unreadable_modules, trl_llm_arguments

    rebind_kernels_past_unreadable_modules()
    trl_llm_arguments()
    from trl.generation.vllm_generation import VLLMGeneration

    accelerator = Accelerator(cpu=True)
    generation = VLLMGeneration(
        _policy(Path(spec["model"])), accelerator, None, mode="colocate",
        tensor_parallel_size=spec["tp"], max_model_length=256, max_num_seqs=4)
    result["started"] = True
    save()
    for index, kind in enumerate(spec["refits"]):
        if kind == "bug":
            result["bug_rank"] = generation.llm.collective_rpc(loader_bug)[0]
        print(MARK.format(index), file=sys.stderr, flush=True)
        error = None
        try:
            generation.sync_weights()
        except Exception as raised:  # noqa: BLE001 - what reaches TRL's trainer
            error = {"type": type(raised).__name__, "message": str(raised)}
        result["refits"].append({"kind": kind, "error": error})
        save()
    accelerator.wait_for_everyone()


def main() -> None:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    if "LOCAL_RANK" in os.environ:
        rank_main(spec, out.with_name(f"{out.name}.rank{os.environ['RANK']}"))
        return
    tp = spec["tp"]
    # torch.distributed.run starts each rank in a session of its own, out of reach of the
    # test's kill of this process group: the launcher is ended here, by the signal it
    # forwards to its ranks, then killed
    launched = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(tp),
         "--standalone", __file__, *sys.argv[1:]], stdin=subprocess.DEVNULL)
    try:
        launched.wait(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        launched.terminate()
        try:
            launched.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launched.kill()
            launched.wait()
    ranks = []
    for rank in range(tp):
        path = out.with_name(f"{out.name}.rank{rank}")
        ranks.append(json.loads(path.read_text()) if path.exists() else None)
    out.write_text(json.dumps({"started": all(r and r["started"] for r in ranks),
                               "returncode": launched.returncode, "ranks": ranks}))


if __name__ == "__main__":
    main()
