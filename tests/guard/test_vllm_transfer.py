"""Transports that bypass the model's ``load_weights``, checked at the end of their
weight-transfer session: vLLM 0.33's own ``sharded_rdt`` engine (made by vLLM's factory, its
bake, static plan, chunk pipeline, scatter and kernel copy run as vLLM's code runs them), and
a user's engine that writes in place as ``nccl_m2n``'s reshard does. With the trainer's digests
(``kda_tp.audit.expected_digests``, handed over through ``expect_digests``) the verdict says
"checked by digests"; without, "invariants only" (padding rows, derived copies).

What stands in for what CPU lacks, and nothing else: the network (Ray's pull of a chunk: the
trainer's tensors sliced by each recorded op chain, as the producer's ``_pack_shared`` replays
it), CUDA events and streams (CPU work is synchronous: the scatter and the kernel copy run on
the calling thread, ``_process_item``'s own fallback when no quant thread exists), and, on
Python 3.11, hashable op chains (vLLM keys its plan by chains holding slices, hashable from
Python 3.12 on). Built as test_vllm_updates.py's (helpers: vllm_guard.py)."""

from __future__ import annotations

import threading
import types
import warnings

import pytest

from vllm_guard import ATTN, CKPT, build, default_load, expected_after, fed, model_config

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed.weight_transfer import sharded_rdt_engine as rdt
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.distributed.weight_transfer.sharded_rdt_common import RdtRouter
    from vllm.model_executor.model_loader.reload import meta, record_metadata_for_reloading

import kda_tp
from kda_tp import GuardError
from kda_tp.errors import GuardWarning
from kda_tp.guard.vllm import DIGESTS_METHOD, expect_digests

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]

LAYOUT = {"k3": "vllm-0.33-k3", "kimi_linear": "vllm-0.33-kimi-linear"}


class _Event:
    """A CUDA event on CPU, where work is done when the call returns."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def synchronize(self):
        pass


class _Stream(_Event):
    def wait_event(self, event):
        pass


class _Frozen(tuple):
    """A slice or list of a recorded op chain, hashable (Python 3.12's slices are)."""


def _freeze(x):
    if isinstance(x, slice):
        return _Frozen(("slice", x.start, x.stop, x.step))
    if isinstance(x, list):
        return _Frozen(("list", *map(_freeze, x)))
    if isinstance(x, tuple) and not isinstance(x, _Frozen):
        return tuple(map(_freeze, x))
    return x


def _thaw(x):
    if isinstance(x, _Frozen):
        return slice(*x[1:]) if x[0] == "slice" else [_thaw(i) for i in x[1:]]
    if isinstance(x, tuple):
        return tuple(map(_thaw, x))
    return x


class _Trainer:
    """The producer: its tensors by name, each chunk's slices cut by the recorded op chains
    (``_RDTProducerServer._pack_shared``), one element of one name changed if asked."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}

    def pull(self, chunk, slot):
        out = []
        for name, chain in chunk.keys:
            t = self.tensors[name]
            for op, args, kw in _thaw(chain):
                t = getattr(t, op)(*args, **dict(kw))
            out.append(t.contiguous().clone())
        return rdt._PendingPull(ref=None, keys=chunk.keys, targets=out, blob=None, slot=slot)


@pytest.fixture
def cpu_rdt(monkeypatch):
    """What CPU lacks for vLLM's sharded_rdt engine: CUDA events and streams, and Ray."""
    monkeypatch.setattr(torch, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(rdt, "check_ray_rdt_version", lambda: None)


def sharded_rdt(model, kind: str, tensors, trainer: _Trainer):
    """vLLM 0.33's ``sharded_rdt`` engine, made by its factory for ``model`` and initialised
    (its bake and static plan) for ``tensors``' names, pulling from ``trainer``."""
    config = VllmConfig()
    config.model_config = model_config(CKPT[kind])
    config.parallel_config.distributed_executor_backend = "ray"
    engine = WeightTransferEngineFactory.create_engine(
        types.SimpleNamespace(backend="sharded_rdt"), config, torch.device("cpu"), model)

    def resolve(info):  # the router vLLM builds, bound to no Ray actor
        engine._router = RdtRouter(1, 1, None, None, list(info.names), list(info.group_lens))

    build_plan = engine._build_static_plan

    def build_static_plan(info):
        for copies in {id(c): c for c in engine._name_to_plan.values()}.values():
            for scatter in copies:
                scatter.src = (scatter.src[0], _freeze(scatter.src[1]))
        build_plan(info)

    class Inline:
        def put(self, item):
            engine._process_item(item)

        def join(self):
            pass

    def proc_worker():
        k = engine._ring_depth
        engine._slot_read_done = [_Event() for _ in range(k)]
        engine._slot_queued, engine._slot_done = [0] * k, [0] * k
        engine._slot_cv = threading.Condition()
        engine._proc_stream, engine._proc_queue = _Stream(), Inline()

    engine._resolve_producers, engine._build_static_plan = resolve, build_static_plan
    engine._ensure_proc_worker, engine._preregister_at_init = proc_worker, lambda: None
    engine._signal_group_done = lambda group: None
    engine._issue_pull, engine._complete_pull = trainer.pull, lambda p: dict(zip(p.keys,
                                                                                p.targets))
    names = [n for n, _ in tensors]
    engine.init_transfer_engine(engine.parse_init_info(dict(
        trainer_actor_names=["trainer"], names=names, group_lens=[len(names)],
        dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in tensors],
        shapes=[list(t.shape) for _, t in tensors])))
    return engine


def loaded(vc, kind: str, tp_size: int, rank: int, **kwargs):
    model = build(vc, kind, tp_size, rank, **kwargs)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT[kind])
    return model


def worker_llm(model):
    """An ``LLM`` of one worker whose ``collective_rpc`` runs vLLM's ``WorkerBase`` methods."""
    from vllm.v1.worker.worker_base import WorkerBase
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model))
    return types.SimpleNamespace(collective_rpc=lambda method, args=(): [
        getattr(WorkerBase, method)(worker, *args)])


def sync(engine, trainer: _Trainer, tensors) -> None:
    """One sync as vLLM's worker runs it: start, one update_weights, finish."""
    trainer.tensors = dict(tensors)
    engine.start_weight_update()
    engine.update_weights({})
    engine.finish_weight_update()


def digests(kind: str, tensors, tp_size: int) -> dict[str, str]:
    return kda_tp.audit.expected_digests(tensors, CKPT[kind], engine=LAYOUT[kind],
                                         tp_size=tp_size, model_dtype="F32")


def test_an_honest_sharded_rdt_sync_is_checked_by_digests_or_by_invariants(vc, cpu_rdt,
                                                                           vllm_log):
    model = loaded(vc, "kimi_linear", 2, 1)
    trainer = _Trainer()
    with vllm_log:
        engine = sharded_rdt(model, "kimi_linear", fed("kimi_linear"), trainer)
        assert kda_tp.guard.followed(model).session is None  # the bake is no update
        tensors = fed("kimi_linear", 3.0)
        answers = expect_digests(worker_llm(model), digests("kimi_linear", tensors, 2))
        assert answers == [{"tp_rank": 1, "tp_size": 2, "digests": 9}]
        vllm_log.clear()
        sync(engine, trainer, tensors)
    want = expected_after(vc, "kimi_linear", 2, 1, 3.0)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm weight transfer (not through load_weights): "
                           "tp rank 1/2: 9 KDA parameters (vllm-0.33-kimi-linear), ")
    assert line.endswith("checked by digests (9 parameters), padding rows, derived copies: OK")
    vllm_log.clear()
    with vllm_log:
        sync(engine, trainer, fed("kimi_linear", 4.0))  # the digests were for one sync
    (line,) = vllm_log.lines
    assert line.endswith(", invariants only (padding rows zero, derived copies; no trainer "
                         "digests handed over: the values were not compared): OK")


def test_one_wrong_element_is_stopped_by_the_digests_and_named(vc, cpu_rdt):
    model = loaded(vc, "kimi_linear", 2, 1)
    trainer = _Trainer()
    with set_current_vllm_config(vc):
        engine = sharded_rdt(model, "kimi_linear", fed("kimi_linear"), trainer)
    tensors = fed("kimi_linear", 3.0)
    expect_digests(worker_llm(model), digests("kimi_linear", tensors, 2))
    wrong = dict(tensors)
    name = f"{ATTN}dt_bias"
    wrong[name] = wrong[name].clone()
    wrong[name][-1] += 1  # the last head: rank 1's slice
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        sync(engine, trainer, list(wrong.items()))
    text = str(caught.value)
    assert "checked by digests (9 parameters)" in text and "FAIL (1 wrong)" in text
    assert f"rank 1 {ATTN}dt_bias: SHA-256 " in text
    assert f"(dp0:pp0:pcp0:tp1:{ATTN}dt_bias): this rank does not hold what the trainer " \
           "sent" in text


def test_padding_rows_left_as_allocated_are_stopped(vc, cpu_rdt, monkeypatch, vllm_log):
    """vLLM's replay materializes each layer with ``empty_strided`` and skips the K3 loader that
    zeroes ``in_proj_qkvgfab``'s padding rows (10 per rank at TP 2 in the fixture): what the
    allocation held stays there (made visible here: NaN, as uninitialised memory may be)."""
    materialize = meta.materialize_meta_tensor
    monkeypatch.setattr(meta, "materialize_meta_tensor",
                        lambda t: materialize(t).fill_(float("nan")))
    model = loaded(vc, "k3", 2, 1)
    trainer = _Trainer()
    with set_current_vllm_config(vc):
        engine = sharded_rdt(model, "k3", fed("k3"), trainer)
    tensors = fed("k3", 3.0)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        sync(engine, trainer, tensors)
    text = str(caught.value)
    assert ", invariants only (" in text and "FAIL (1 wrong)" in text
    assert f"rank 1 {ATTN}in_proj_qkvgfab.weight: padding: 640 of 640 elements are not zero " \
           "(first at [3206, 0]: nan, expected 0): the transport left the padding rows as it " \
           "allocated them" in text
    monkeypatch.setenv("KDA_TP_GUARD", "warn")
    vllm_log.clear()
    with vllm_log, pytest.warns(GuardWarning, match="padding: 640 of 640 elements are not zero"):
        sync(engine, trainer, tensors)  # mode warn: logged at ERROR and warned, the sync goes on
    assert "padding: 640 of 640 elements are not zero" in vllm_log.lines[-1]


def _in_place_engine():
    """A user's backend that writes the rank's values straight into the live parameters, as
    vLLM's ``nccl_m2n`` reshards a parameter in place: no ``load_weights``, no loader."""
    from dataclasses import dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo)

    @dataclass
    class InitInfo(WeightTransferInitInfo):
        pass

    @dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        pass

    class InPlaceEngine(WeightTransferEngine):
        init_info_cls, update_info_cls = InitInfo, UpdateInfo
        values: dict[str, torch.Tensor] = {}

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            pass

        def finish_weight_update(self):
            pass

        def receive_weights(self, update_info):
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in self.values.items():
                    params[name].data.copy_(value)

        def shutdown(self):
            pass

    return InPlaceEngine


def test_k3_decode_buffers_left_from_the_previous_sync_are_stopped(vc, cpu_rdt, vllm_log):
    """vLLM's K3 decode buffers are refreshed only by its loaders: sharded_rdt refuses to bake
    a layer holding them (vLLM's own error), and a transport that writes the parameters in place
    leaves them at the previous sync's values, which the guard stops, digests or not."""
    model = loaded(vc, "k3", 2, 1, decode_copies=True)
    with pytest.raises(RuntimeError, match="live name.* did not bake"), \
            set_current_vllm_config(vc):
        sharded_rdt(model, "k3", fed("k3"), _Trainer())
    if "kda_tp_in_place" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("kda_tp_in_place", _in_place_engine())
    config = VllmConfig()
    config.model_config = model_config(CKPT["k3"])
    engine = WeightTransferEngineFactory.create_engine(
        types.SimpleNamespace(backend="kda_tp_in_place"), config, torch.device("cpu"), model)
    tensors = fed("k3", 3.0)
    engine.values = expected_after(vc, "k3", 2, 1, 3.0)  # what rank 1 must hold: in place
    expect_digests(worker_llm(model), digests("k3", tensors, 2))
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        engine.start_weight_update()
        engine.receive_weights(engine.parse_update_info({}))  # update_weights less its CUDA sync
        engine.finish_weight_update()
    text = str(caught.value)
    assert "checked by digests (7 parameters)" in text and "FAIL (2 wrong)" in text
    assert (f"rank 1 {ATTN}decode_conv1d_weight: differs from what conv1d.weight makes of it "
            "at [0, 0, 0] (expected 2304.0, got 768.0): the engine's decode copy is stale") in text
    assert (f"rank 1 {ATTN}decode_norm_weight: differs from what o_norm.weight makes of it at "
            "[1] (expected 3.0, got 1.0)") in text


def test_the_worker_method_refuses_what_is_no_digest(vc):
    from kda_tp.errors import UsageError
    from vllm.v1.worker.worker_base import WorkerBase
    assert hasattr(WorkerBase, DIGESTS_METHOD)
    with pytest.raises(UsageError, match="entry 'tp0:x': 'abc' is not a SHA-256 hex string"):
        expect_digests(worker_llm(None), {"tp0:x": "abc"})
