"""kda_tp.guard.vllm.audit (issue 40, item 3): a live audit says what it compares against.
Through vLLM 0.33.0's own classes on CPU: the KDA layer loaded by its DefaultModelLoader and
refit through the model class's own load_weights, ``WorkerBase``'s ``kda_tp_audit``, vLLM's
``ParallelConfig``, and vLLM's own ``MultiprocExecutor.collective_rpc`` and
``WorkerProc._execute_worker_rpc`` with their shared-memory queues replaced by plain ones (the
rest of the executor needs worker processes). Helpers in vllm_guard.py."""

from __future__ import annotations

import collections
import functools
import types
import warnings

import pytest

from vllm_guard import CKPT, fake_llm, fed, loaded, set_rank, swap_q_into_k, worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.config import ParallelConfig, set_current_vllm_config
    from vllm.v1.executor.multiproc_executor import MultiprocExecutor, WorkerProc
    from vllm.v1.worker.worker_base import WorkerBase

from kda_tp import GuardError
from kda_tp.guard import followed
from kda_tp.guard.vllm import WORKER_METHOD, audit_llm

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]


def _refit_workers(vc, kind: str, scale: float) -> list[tuple[int, types.SimpleNamespace]]:
    """Two ranks loaded from the fixture checkpoint, then refit honestly with every value x
    ``scale`` (each refit's own verdict: OK)."""
    workers = []
    for rank in range(2):
        model = loaded(vc, kind, 2, rank)
        with set_current_vllm_config(vc):
            model.load_weights(fed(kind, scale))
        assert followed(model).updates == 1
        workers.append((rank, worker(model, CKPT[kind])))
    return workers


def _scaled_checkpoint(kind: str, scale: float, out):
    """The fixture checkpoint with every value x ``scale``: what the refit fed, on disk."""
    out.mkdir()
    (out / "config.json").write_text((CKPT[kind] / "config.json").read_text())
    save_file({k: v * scale for k, v in load_file(str(CKPT[kind] / "model.safetensors")).items()},
              str(out / "model.safetensors"))
    return out


def test_after_an_honest_refit_the_start_up_checkpoint_is_named_not_judged(vc):
    reports = audit_llm(fake_llm(_refit_workers(vc, "k3", 2.0)))
    assert [r["tp_rank"] for r in reports] == [0, 1]
    for report in reports:
        # the weights now differ from the start-up checkpoint, as a refit makes them: the
        # report says so, and leaves the verdict to the refit's own (OK)
        assert report["ok"] is None and report["guarded"] is True
        assert report["reference"] == f"start-up checkpoint {CKPT['k3']}"
        assert report["updates"] == 1
        line = report["line"]
        assert " wrong) (reference: start-up checkpoint " in line, line
        assert line.split(": FAIL (", 1)[1].split(") (", 1)[1] == (
            f"reference: start-up checkpoint {CKPT['k3']}; 1 update(s) since: differences "
            "after a refit are expected; the last update's own verdict: OK)")
        assert report["report"]["params"]  # the comparison's detail is kept


def test_against_the_refits_source_a_correct_engine_passes_and_a_wrong_rank_fails(vc, tmp_path):
    source = _scaled_checkpoint("k3", 2.0, tmp_path / "x2")
    workers = _refit_workers(vc, "k3", 2.0)
    rank_0, rank_1 = audit_llm(fake_llm(workers), checkpoint=source)
    assert rank_0["ok"] is True and rank_1["ok"] is True, (rank_0["line"], rank_1["line"])
    assert rank_0["reference"] == f"checkpoint {source} (given)"
    assert rank_1["line"].endswith(": OK")
    with torch.no_grad():  # rank 1's o_proj overwritten after the refit
        model = workers[1][1].model_runner.get_model()
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    rank_0, rank_1 = audit_llm(fake_llm(workers), checkpoint=source)
    assert rank_0["ok"] is True and rank_1["ok"] is False
    assert rank_1["line"].endswith("FAIL (1 wrong)")


def test_without_updates_a_difference_is_judged(vc):
    model = loaded(vc, "kimi_linear", 2, 1)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight.zero_()
    (report,) = [r for r in audit_llm(fake_llm([(1, worker(model, CKPT["kimi_linear"]))]))
                 if r["tp_rank"] == 1]
    assert report["ok"] is False and report["updates"] == 0
    assert report["line"].endswith("FAIL (1 wrong)")


def _launched(workers, backend: str | None) -> types.SimpleNamespace:
    """A ``LLM`` of 2 tensor-parallel ranks whose ``collective_rpc`` reaches ``workers``,
    with vLLM's own ``ParallelConfig`` for ``backend``."""
    llm = fake_llm(workers)
    parallel = ParallelConfig(tensor_parallel_size=2, distributed_executor_backend=backend)
    llm.llm_engine = types.SimpleNamespace(
        vllm_config=types.SimpleNamespace(parallel_config=parallel))
    return llm


def test_under_external_launcher_this_processs_rank_is_audited_and_said_so(vc):
    """TRL's colocated engines (torchrun): each process owns one worker, its collective_rpc
    reaches only it; the other rank is its own process's to audit."""
    model = loaded(vc, "kimi_linear", 2, 1)
    workers = [(1, worker(model, CKPT["kimi_linear"]))]
    (report,) = audit_llm(_launched(workers, "external_launcher"))
    assert report["ok"] is True and report["tp_rank"] == 1 and report["guarded"] is True
    assert report["line"].endswith(": OK (external_launcher: this process owns this rank of 2; "
                                   "the others are audited from their own processes)")
    # the same answers from an engine that owns every worker: rank 0 was silent
    rank_0, rank_1 = audit_llm(_launched(workers, "mp"))
    assert rank_0["guarded"] is False and "did not answer" in rank_0["line"]
    assert rank_1["ok"] is True


class _Queue:
    """A worker's response queue (vLLM's ``MessageQueue`` in shared memory), as a deque."""

    def __init__(self):
        self.items = collections.deque()

    def enqueue(self, item):
        self.items.append(item)

    def dequeue(self, timeout=None):
        return self.items.popleft()


class _Broadcast:
    """The executor's broadcast queue: each worker process runs the request at once, through
    vLLM's own ``WorkerProc._execute_worker_rpc`` (the worker's exception becomes a FAILURE
    answer, as in a worker process)."""

    def __init__(self, procs):
        self.procs = procs

    def enqueue(self, request):
        for rank, proc in self.procs:
            set_rank(2, rank)
            WorkerProc._execute_worker_rpc(proc, request)


def _executor(workers) -> MultiprocExecutor:
    """vLLM's ``MultiprocExecutor`` over ``workers``, its queues replaced by plain ones."""
    procs = []
    for rank, one in workers:
        one.kda_tp_audit = functools.partial(getattr(WorkerBase, WORKER_METHOD), one)
        proc = object.__new__(WorkerProc)
        proc.worker, proc.rank, proc.use_async_scheduling = one, rank, False
        proc.worker_response_mq = _Queue()
        procs.append((rank, proc))
    executor = object.__new__(MultiprocExecutor)
    executor.is_failed = False
    executor.futures_queue = collections.deque()
    executor.rpc_broadcast_mq = _Broadcast(procs)
    executor.response_mqs = [proc.worker_response_mq for _, proc in procs]
    executor.vllm_config = types.SimpleNamespace(
        parallel_config=ParallelConfig(tensor_parallel_size=2))
    return executor


def test_an_answer_left_by_a_failed_refit_is_named_never_taken_for_the_audits(vc):
    """vLLM's executor raises at the first failed worker and leaves the others' answers of
    that call queued: a refit stopped on both ranks leaves rank 1's GuardError for the next
    call, and rank 1 one call late after it."""
    workers = []
    for rank in range(2):
        model = loaded(vc, "k3", 2, rank)
        swap_q_into_k(model)  # the refit's loader bug, on both ranks
        one = worker(model, CKPT["k3"])
        tensors = sorted(fed("k3"), key=lambda t: "q_proj" not in t[0])
        one.refit = functools.partial(model.load_weights, tensors)
        workers.append((rank, one))
    executor = _executor(workers)
    with set_current_vllm_config(vc), pytest.raises(RuntimeError) as stopped:
        executor.collective_rpc("refit")
    assert "Worker failed with error 'kda_tp guard: vllm load_weights: tp rank 0/2: " in \
        str(stopped.value)
    assert len(executor.response_mqs[1].items) == 1  # rank 1's GuardError, never read
    llm = types.SimpleNamespace(collective_rpc=functools.partial(executor.collective_rpc))
    with set_current_vllm_config(vc):
        (first,) = audit_llm(llm)
    assert first["guarded"] is False and first["ok"] is None
    assert "Worker failed with error 'kda_tp guard: vllm load_weights: tp rank 1/2: " in \
        first["line"]  # the refit's error, not this audit's
    assert "kda_tp_audit never fails in a worker: vLLM's multiprocess executor stops reading" \
        in first["line"] and "restart the engine" in first["line"]
    with set_current_vllm_config(vc):
        rank_0, rank_1, stale = audit_llm(llm)
    # rank 0 answers this audit: its refit's own FAIL is the verdict on the weights now
    assert rank_0["guarded"] is True and rank_0["tp_rank"] == 0 and rank_0["ok"] is False
    assert rank_0["line"].endswith("; the last update's own verdict: FAIL (1 wrong))")
    assert rank_1["guarded"] is False and "did not answer" in rank_1["line"]
    assert stale["guarded"] is False
    assert stale["line"].startswith("unguarded: worker 1 answered an earlier call's "
                                    "kda_tp_audit (kda_tp guard: vllm audit: tp rank 1/2: ")
    with pytest.raises(GuardError):  # the engine-side bug is real: rank 1's own check
        with set_current_vllm_config(vc):
            workers[1][1].refit()
