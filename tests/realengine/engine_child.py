"""One real vLLM engine, in its own process: ``python engine_child.py SPEC OUT``.

``SPEC`` is a JSON object: ``model`` (a checkpoint directory), ``tp`` (tensor-parallel size),
``dtype`` (vLLM's ``dtype``, default ``"auto"``), ``llm`` (more ``vllm.LLM`` keywords) and
``actions``, run in order once the engine has started:

* ``{"do": "audit"}``: ``kda_tp.guard.vllm.audit_llm(llm)``, every worker's report;
* ``{"do": "rpc", "method": NAME, "args": [...], "kwargs": {...}}``: ``llm.collective_rpc``
  of a worker method: vLLM's own (``reload_weights``) or :class:`Refit`'s.

``OUT`` receives a JSON object, rewritten after the start and after every action (so a parent
that had to end a hung engine still reads what happened): ``started``, ``start_seconds``,
``error`` (what ``LLM(...)`` raised: ``{"type", "message", "cause"}``) and ``actions`` (per
action ``value``, or ``error`` for what the call raised, and ``seconds``).

:class:`Refit` is the worker extension (``worker_extension_cls="engine_child.Refit"``; the
parent puts this directory on ``PYTHONPATH`` for vLLM's workers) through which a test refits as
RL stacks do (OpenRLHF's ``WorkerWrap``, TRL's colocated sync): the model's own
``load_weights``, or vLLM's layerwise ``reload_weights`` with an iterator.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _error(error: BaseException) -> dict[str, Any]:
    return {"type": f"{type(error).__module__}.{type(error).__name__}",
            "message": str(error),
            "cause": repr(error.__cause__) if error.__cause__ is not None else None}


@contextlib.contextmanager
def _loaders_told_rank_0(on: bool) -> Iterator[None]:
    """vllm-gguf-plugin #103's bug, when ``on``: vLLM's sharded weight loaders
    (``weight_utils.sharded_weight_loader``: Kimi-Linear's ``dt_bias``) are told rank 0."""
    from vllm.model_executor.model_loader import weight_utils

    saved = weight_utils.get_tensor_model_parallel_rank
    if on:
        weight_utils.get_tensor_model_parallel_rank = lambda: 0
    try:
        yield
    finally:
        weight_utils.get_tensor_model_parallel_rank = saved


@contextlib.contextmanager
def _kv_b_proj_narrowed_at_rank_0(model: Any, on: bool) -> Iterator[None]:
    """A wrong refit of the MLA layers' column-parallel ``kv_b_proj``, when ``on``: its loader
    narrows the checkpoint at rank 0 on every rank (the layer's and its weight's ``tp_rank``
    set to 0, as vLLM's own loader of replicated latent shards does, ``linear.py:1593``, for
    shards that are replicated; ``kv_b_proj``'s are not)."""
    layers = [m for n, m in model.named_modules() if n.endswith("self_attn.kv_b_proj")]
    saved = [(m.tp_rank, m.weight.tp_rank) for m in layers]
    if on:
        for layer in layers:
            layer.tp_rank = layer.weight.tp_rank = 0
    try:
        yield
    finally:
        for layer, (rank, weight_rank) in zip(layers, saved):
            layer.tp_rank, layer.weight.tp_rank = rank, weight_rank


def _tensors(path: str, only: list[str] | None) -> dict[str, Any]:
    """The checkpoint's tensors (every ``*.safetensors`` file), those whose name holds one of
    ``only`` when given."""
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        tensors.update(load_file(file))
    return {k: v for k, v in tensors.items() if only is None or any(o in k for o in only)}


class Refit:
    """Worker methods (mixed into vLLM's worker class) that refit this rank's model. Each
    returns ``{"ok": True}`` or ``{"ok": False, "error": {...}}`` with what the call raised
    (a ``GuardError`` of the guard included), so every rank answers."""

    def kda_refit(self, path: str, only: list[str] | None = None,
                  rank_0_bug: bool = False, spelling: list[str] | None = None
                  ) -> dict[str, Any]:
        """The checkpoint's tensors (``only``: those whose name holds one of these) into the
        model's own ``load_weights``, in one call; ``spelling``: ``[prefix, other]``, each
        name's ``prefix`` fed as ``other`` (another spelling the engine accepts)."""
        old, new = spelling or ("", "")
        try:
            with _loaders_told_rank_0(rank_0_bug):
                self.model_runner.model.load_weights(
                    (new + n.removeprefix(old) if old and n.startswith(old) else n, t)
                    for n, t in _tensors(path, only).items())
        except Exception as error:  # noqa: BLE001 - reported to the test
            return {"ok": False, "error": _error(error)}
        return {"ok": True}

    def mla_refit(self, path: str, only: list[str],
                  kv_b_proj_at_rank_0: bool = False) -> dict[str, Any]:
        """The checkpoint's ``only`` tensors (MLA ones: ``kv_a_layernorm``, ``kv_b_proj``)
        into the model's own ``load_weights``, in one call; ``kv_b_proj_at_rank_0``: with
        ``kv_b_proj``'s loader narrowing at rank 0 on every rank."""
        model = self.model_runner.model
        try:
            with _kv_b_proj_narrowed_at_rank_0(model, kv_b_proj_at_rank_0):
                model.load_weights(iter(_tensors(path, only).items()))
        except Exception as error:  # noqa: BLE001 - reported to the test
            return {"ok": False, "error": _error(error)}
        return {"ok": True}

    def kda_reload(self, path: str, from_disk: bool = False,
                   rank_0_bug: bool = False) -> dict[str, Any]:
        """vLLM's ``reload_weights`` of the worker: from an iterator over the checkpoint's
        tensors (a layerwise reload session, as RL weight syncs use it) or from disk."""
        try:
            with _loaders_told_rank_0(rank_0_bug):
                if from_disk:
                    self.reload_weights(weights_path=path)
                else:
                    self.reload_weights(weights_iterator=iter(_tensors(path, None).items()))
        except Exception as error:  # noqa: BLE001 - reported to the test
            return {"ok": False, "error": _error(error)}
        return {"ok": True}


def _act(llm: Any, action: dict[str, Any]) -> Any:
    if action["do"] == "audit":
        from kda_tp.guard.vllm import audit_llm

        return audit_llm(llm)
    return llm.collective_rpc(action["method"], args=tuple(action.get("args", ())),
                              kwargs=action.get("kwargs"))


def main() -> None:
    spec, out = json.loads(sys.argv[1]), Path(sys.argv[2])
    result: dict[str, Any] = {"started": False, "actions": []}

    def save() -> None:
        out.write_text(json.dumps(result, default=str))

    start = time.perf_counter()
    try:
        from vllm import LLM

        llm = LLM(spec["model"], tensor_parallel_size=spec.get("tp", 1),
                  dtype=spec.get("dtype", "auto"), skip_tokenizer_init=True,
                  enforce_eager=True, enable_prefix_caching=False, max_model_len=256,
                  max_num_seqs=4, max_num_batched_tokens=256, **spec.get("llm", {}))
    except Exception as error:  # noqa: BLE001 - what the caller of LLM() gets
        result.update(start_seconds=time.perf_counter() - start, error=_error(error))
        save()
        return
    result.update(started=True, start_seconds=time.perf_counter() - start)
    save()
    for action in spec.get("actions", []):
        began = time.perf_counter()
        try:
            entry: dict[str, Any] = {"value": _act(llm, action)}
        except Exception as error:  # noqa: BLE001 - reported to the test
            entry = {"error": _error(error)}
        result["actions"].append({**entry, "seconds": time.perf_counter() - began})
        save()


if __name__ == "__main__":  # vLLM starts its engine core with multiprocessing's spawn
    main()
