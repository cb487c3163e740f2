"""vLLM's weight-transfer engines under the guard: each session followed from
``start_weight_update`` to ``finish_weight_update``, and the trainer's expected digests handed
to the workers.

Every engine ``WeightTransferEngineFactory.create_engine`` makes (nccl, ipc, sparse_nccl,
nccl_m2n, sharded_rdt, or a user's) is followed (:func:`follow_transfer`): its
``init_transfer_engine`` runs with no update session (``sharded_rdt`` bakes its replay plan
there by driving the model's ``load_weights`` over placeholder tensors on the meta device: a
dry run, not an update), ``start_weight_update`` opens an update session on the main model
and ``finish_weight_update`` ends it (``kda_tp.guard._transfer.end_session``): a session that
fed KDA tensors through the model's ``load_weights`` is checked against what it fed; one that
fed none (``sharded_rdt``'s replay of recorded scatters, ``nccl_m2n``'s in-place reshard, a
worker's own ``param.copy_``) is checked for what needs no fed values (padding rows zero,
derived copies) and, when the trainer handed them over, against its expected digests.

How a trainer hands its digests to the workers, before ``finish_weight_update``::

    expected = kda_tp.audit.expected_digests(weights, CONFIG, engine=ENGINE, tp_size=TP)
    kda_tp.guard.vllm.expect_digests(llm, expected)      # llm.collective_rpc underneath
    llm.start_weight_update(...); llm.update_weights(...); llm.finish_weight_update()

or, without a ``vllm.LLM`` in the trainer's process (a server, a Ray actor), the worker method
``kda_tp_expect_digests`` (:data:`DIGESTS_METHOD`) through whatever ``collective_rpc`` the
stack has, with the digests as its one argument.

Importing this module imports no vLLM.
"""

from __future__ import annotations

from typing import Any

from .._live import Follower, followed
from .._load import follow_model
from .._record import RECORD
from .._transfer import checked_digests, end_session, expect
from .facts import VllmEngine, tp_rank_size

__all__ = ["DIGESTS_METHOD", "add_digests_method", "expect_digests", "follow_transfer"]

#: The worker method that takes the trainer's expected digests (:func:`expect_digests`).
DIGESTS_METHOD = "kda_tp_expect_digests"

_OWNER = "weight transfer"
_FOLLOWED = "__kda_tp_transfer__"


def follow_transfer(engine: Any, vllm_config: Any) -> None:
    """Follow one weight-transfer engine (``WeightTransferEngine``): its
    ``init_transfer_engine`` runs with no update session, its ``start_weight_update`` opens one
    on the main model (a session aimed at a draft model is not checked), its
    ``finish_weight_update`` ends it (see the module's docstring). Idempotent.

    Raises:
        GuardError: from ``finish_weight_update``, in mode ``fail``, when a KDA parameter,
            padding row or derived copy is wrong after the session, or a parameter differs
            from the trainer's expected digest.
    """
    if getattr(engine, _FOLLOWED, False):
        return
    setattr(engine, _FOLLOWED, True)
    model = engine.model
    if followed(model) is None:
        follow_model(VllmEngine(getattr(engine, "model_config", None), vllm_config), model)
    init, start, finish = (engine.init_transfer_engine, engine.start_weight_update,
                           engine.finish_weight_update)
    opened: list[Follower] = []

    def init_transfer_engine(*args: Any, **kwargs: Any) -> Any:
        how = followed(engine.model)
        if how is None:
            return init(*args, **kwargs)
        with how.quietly():  # a dry run over placeholders (sharded_rdt's bake): no update
            return init(*args, **kwargs)

    def start_weight_update(*args: Any, **kwargs: Any) -> Any:
        model = engine.model
        how = followed(model) if model is getattr(engine, "_default_model", model) else None
        if how is not None and how.open(_OWNER, _OWNER):
            opened.append(how)
        try:
            return start(*args, **kwargs)
        except BaseException:
            while opened:
                opened.pop().abandon(_OWNER)
            raise

    def finish_weight_update(*args: Any, **kwargs: Any) -> Any:
        try:
            out = finish(*args, **kwargs)
        except BaseException:
            while opened:
                opened.pop().abandon(_OWNER)
            raise
        while opened:
            end_session(opened.pop(), _OWNER)
        return out

    engine.init_transfer_engine = init_transfer_engine
    engine.start_weight_update = start_weight_update
    engine.finish_weight_update = finish_weight_update


def add_digests_method(worker_base: Any) -> None:
    """Give vLLM's ``WorkerBase`` the method :data:`DIGESTS_METHOD` (``kda_tp.guard.vllm``'s
    plugin does, with its other worker method)."""
    RECORD.install(f"vllm.v1.worker.worker_base.WorkerBase.{DIGESTS_METHOD}", worker_base,
                   DIGESTS_METHOD, _worker_digests)


def _worker_digests(worker: Any, digests: Any) -> dict[str, Any]:
    """The worker method: keep ``digests`` for the next weight-transfer session of this
    worker's model; answers how many of them are this rank's (a plain dict: collective_rpc
    results cross processes as msgpack)."""
    RECORD.running(_worker_digests)
    expect(worker.model_runner.get_model(), digests)
    rank, size = tp_rank_size()
    mine = sum(1 for key in digests if f":tp{rank}:" in key)
    return {"tp_rank": rank, "tp_size": size, "digests": mine}


def expect_digests(llm: Any, digests: Any) -> list[dict[str, Any]]:
    """Hand the trainer's expected digests to every worker of a live vLLM ``LLM``, before the
    weight-transfer session they are for ends: at its ``finish_weight_update`` each worker
    hashes its KDA parameters as vLLM's ``compute_weight_checksums`` does and compares them
    with its rank's keys (a mismatch names the parameter and the rank: a ``GuardError`` out
    of ``finish_weight_update`` in mode ``fail``, a warning in ``warn``), and the verdict line
    says ``checked by digests``; without digests it says ``invariants only``. The session
    consumes them: hand them over again for the next one.

    Args:
        llm: a ``vllm.LLM`` whose workers run the guard (``llm.collective_rpc``).
        digests: ``kda_tp.audit.expected_digests(...)``'s result for the weights this session
            sends (every rank's keys, ``dp0:pp0:pcp0:tp{r}:<name>``).

    Returns:
        One dict per worker: its ``tp_rank``, ``tp_size`` and how many ``digests`` are its.

    Raises:
        UsageError: ``digests`` is not a mapping of keys to SHA-256 hex strings (checked
            here, before any worker is asked).
    """
    return list(llm.collective_rpc(DIGESTS_METHOD, args=(checked_digests(digests),)))
