"""The guard inside vLLM 0.33.0 checks every weight-update path against what it fed: a
trainer's refit through the model's ``load_weights`` in buckets, ``reload_weights`` and a
weight-transfer engine made by vLLM's own factory; the bugs of each path (rows landing in the
wrong part, a fused part dropped from a later bucket, a parameter never applied, GLM's merged
conv weight left stale, K3's decode copies). Built as test_vllm.py's (helpers:
vllm_guard.py)."""

from __future__ import annotations

import types
import warnings

import pytest

from vllm_guard import (ATTN, CKPT, build, default_load, expected_after, fed, loaded, model_config,
                        reload_config, set_rank, swap_q_into_k)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.reload import inplace

from kda_tp import GuardError

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]



@pytest.mark.parametrize("kind", ["k3", "kimi_linear", "glm"])
def test_honest_refits_in_several_buckets_pass_on_every_path(vc, kind, vllm_log):
    tensors = fed(kind)
    buckets = [tensors[:5], tensors[5:9], tensors[9:]]
    model = loaded(vc, kind, 4, 2)
    vllm_log.clear()
    with vllm_log:
        for bucket in buckets:  # collective_rpc straight into the model's load_weights
            model.load_weights(iter(bucket))
    lines = vllm_log.lines
    assert len(lines) == 3, lines
    assert all(line.startswith("kda_tp guard: vllm load_weights: tp rank 2/4: ")
               and line.endswith(": OK") for line in lines)
    want = expected_after(vc, kind, 4, 2, 2.0)
    set_rank(4, 2)
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    vllm_log.clear()
    config = reload_config(kind)
    with vllm_log:
        inplace.reload_weights(config, model, iter(fed(kind, 3.0)), None, True)
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 2/4: ")
    assert line.endswith(": OK")
    vllm_log.clear()
    engine = transfer_engine(vc, model, kind)
    with vllm_log:
        run_session(engine, [fed(kind, 4.0)[:7], fed(kind, 4.0)[7:]])
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm weight transfer: tp rank 2/4: ")
    assert line.endswith(": OK")


class _Bucket:
    """What the in-process "trainer" hands the engine for one update_weights call."""

    chunks: list[list[tuple[str, torch.Tensor]]] = []


def _engine_class():
    from dataclasses import dataclass as _dataclass

    from vllm.distributed.weight_transfer.base import (
        WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo)
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload, initialize_layerwise_reload)

    @_dataclass
    class InitInfo(WeightTransferInitInfo):
        pass

    @_dataclass
    class UpdateInfo(WeightTransferUpdateInfo):
        chunk: int = 0

    class InProcessEngine(WeightTransferEngine):
        """Built as vLLM 0.33's ipc engine is (``ipc_engine.py``): layerwise reload from
        start to finish, each chunk through the model's own load_weights; the trainer's
        tensors come from this process instead of CUDA IPC handles."""

        init_info_cls = InitInfo
        update_info_cls = UpdateInfo

        def init_transfer_engine(self, init_info):
            pass

        def start_weight_update(self):
            initialize_layerwise_reload(self.model)

        def finish_weight_update(self):
            finalize_layerwise_reload(self.model, self.model_config)

        def receive_weights(self, update_info):
            self.model.load_weights(list(_Bucket.chunks[update_info.chunk]))

        def shutdown(self):
            pass

    return InProcessEngine


def transfer_engine(vc, model, kind: str):
    """A weight-transfer engine made by vLLM's own factory (a backend registered by a user)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    if "kda_tp_test" not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine("kda_tp_test", _engine_class())
    config = VllmConfig()
    config.model_config = model_config(CKPT[kind])
    return WeightTransferEngineFactory.create_engine(
        types.SimpleNamespace(backend="kda_tp_test"), config, torch.device("cpu"), model)


def run_session(engine, chunks) -> None:
    """start_weight_update, one update_weights per chunk, finish_weight_update: what
    vLLM's worker does for LLM.start_weight_update / update_weights / finish_weight_update."""
    _Bucket.chunks = chunks
    engine.start_weight_update()
    for i in range(len(chunks)):
        engine.receive_weights(engine.parse_update_info({"chunk": i}))
    engine.finish_weight_update()


def test_q_rows_landing_in_ks_place_are_stopped_and_named(vc):
    model = loaded(vc, "k3", 2, 1)
    swap_q_into_k(model)
    tensors = sorted(fed("k3"), key=lambda t: "q_proj" not in t[0])  # q_proj first
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(tensors))
    text = str(caught.value)
    assert f"rank 1 {ATTN}in_proj_qkvgfab.weight: k_proj: holds what was fed as " \
           f"{ATTN}q_proj.weight (this rank's slice), not {ATTN}k_proj.weight" in text
    assert "tp rank 1/2: " in text and "FAIL (1 wrong)" in text


@pytest.mark.parametrize("kind", ["kimi_linear", "glm"])
def test_a_fused_part_dropped_from_a_later_bucket_is_stopped(vc, kind, caplog):
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, kind, 2, 0)
    real = model.load_weights
    calls = {"n": 0}

    def drops_later_parts(weights):  # SGLang #38298's pattern, in the model's load_weights:
        calls["n"] += 1  # a fused part arriving in a later call than the first is dropped
        later = calls["n"] > 2  # the first load, then the session's first chunk
        return real((n, w) for n, w in weights if not (later and "v_proj" in n))

    model.load_weights = drops_later_parts
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT[kind])
    suffix = {"kimi_linear": "in_proj_qkvgfab", "glm": "in_proj_qkvbfg_a"}[kind]
    tensors = fed(kind)
    first = [t for t in tensors if "v_proj" not in t[0]]
    later = [t for t in tensors if "v_proj" in t[0]]
    engine = transfer_engine(vc, model, kind)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        run_session(engine, [first, later])
    text = str(caught.value)
    assert "kda_tp guard: vllm weight transfer: tp rank 0/2: " in text
    assert f"rank 0 {ATTN}{suffix}.weight: v_proj: " in text


def test_a_sent_parameter_the_engine_never_applied_is_named(vc):
    model = loaded(vc, "glm", 4, 3)
    layer = model.model.layers[0].self_attn
    layer.dt_bias.weight_loader = lambda p, w, *a: None  # the refit drops dt_bias
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(fed("glm")))
    text = str(caught.value)
    assert (f"rank 3 {ATTN}dt_bias: dt_bias: holds the values from before the update: "
            f"{ATTN}dt_bias was fed but the engine never applied it") in text


def merged_conv(layer) -> torch.Tensor:
    """The statement of vLLM 0.33's ``Glm5NextLinearAttention._forward`` that builds
    ``_merged_conv_weight`` on the first forward (the forward itself needs a GPU kernel)."""
    def _w(m):
        return m.weight.view(m.weight.size(0), m.weight.size(2))
    return torch.cat([_w(layer.q_conv1d), _w(layer.k_conv1d), _w(layer.v_conv1d)], dim=0).contiguous()


def test_glm_merged_conv_weight_stale_after_a_reload_is_named_and_the_repair_switch_fixes_it(
        vc, monkeypatch, vllm_log):
    from kda_tp.guard.vllm import REPAIR_ENV
    model = loaded(vc, "glm", 2, 1)
    layer = model.model.layers[0].self_attn
    assert layer._merged_conv_weight is None  # vLLM builds it on the first forward
    layer._merged_conv_weight = merged_conv(layer)
    config = reload_config("glm")
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed("glm")), None, True)
    text = str(caught.value)
    assert (f"rank 1 {ATTN}_merged_conv_weight: differs from what q_conv1d.weight and "
            "k_conv1d.weight and v_conv1d.weight makes of it at [0, 0]") in text
    assert "stale (built before the last update and never rebuilt: " \
           "https://github.com/vllm-project/vllm/issues/55087)" in text
    monkeypatch.setenv(REPAIR_ENV, "1")
    vllm_log.clear()
    with vllm_log:
        inplace.reload_weights(config, model, iter(fed("glm", 3.0)), None, True)
    assert layer._merged_conv_weight is None  # vLLM rebuilds it from the new convs
    assert vllm_log.lines[-1].endswith(": OK")


def test_a_kernel_format_reload_warns_that_it_is_not_checked(vc):
    model = loaded(vc, "k3", 2, 0)
    config = reload_config("k3")
    state = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    with pytest.warns(RuntimeWarning, match="is_checkpoint_format=False feeds kernel-format"), \
            set_current_vllm_config(vc), torch.no_grad():
        inplace.reload_weights(config, model, iter(state), None, False)


def test_k3s_decode_copies_are_checked_after_every_update(vc, vllm_log):
    from vllm.model_executor.model_loader.reload import record_metadata_for_reloading
    model = build(vc, "k3", 4, 1, decode_copies=True)
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT["k3"])
    layer = model.model.layers[0].self_attn
    old = layer.decode_conv1d_weight.detach().clone()
    vllm_log.clear()
    with vllm_log:
        model.load_weights(iter(fed("k3")))  # vLLM's decode loaders refresh the copies
    assert vllm_log.lines[-1].endswith(": OK")
    assert not torch.equal(layer.decode_conv1d_weight, old)
    with torch.no_grad():
        layer.decode_conv1d_weight.copy_(old)  # a copy an update path left stale
    dt_bias = [(n, t) for n, t in fed("k3") if n.endswith("dt_bias")]
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights(iter(dt_bias))  # the next update, of dt_bias alone
    assert (f"rank 1 {ATTN}decode_conv1d_weight: differs from what conv1d.weight makes of it "
            "at [0, 0, 0]") in str(caught.value)


def test_vllms_own_sparse_nan_patch_is_judged_on_the_values_before_it(vc, vllm_log):
    """vLLM's ``load_checkpoint_weight_patches`` loads a sparse patch with ``torch.Tensor
    .copy_`` replaced by its own ``copy_non_nan_`` (a NaN keeps the old value): the guard knows
    that function of vLLM's and judges the patch on the values before it (issue 38, F6)."""
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)

    model = loaded(vc, "kimi_linear", 2, 1)
    param = model.model.layers[0].self_attn.dt_bias
    before = param.detach().clone()
    indices = torch.arange(0, 1536, 7)
    patch = CheckpointWeightPatch(f"{ATTN}dt_bias", (1536,), torch.float32,
                                  torch.full((indices.numel(),), 5.0), indices)
    vllm_log.clear()
    with vllm_log:
        load_checkpoint_weight_patches(model, [patch], validate_unique_indices=False)
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert line.endswith(": OK"), line
    new = (torch.arange(768, 1536) % 7) == 0  # rank 1's half: new where the patch has values
    assert torch.equal(param.detach()[new], torch.full((int(new.sum()),), 5.0))
    assert torch.equal(param.detach()[~new], before[~new])


def test_another_process_wide_copy_replacement_is_not_the_reference(vc, monkeypatch):
    """A ``torch.Tensor.copy_`` replaced by anything but vLLM's own NaN-sentinel copy (here a
    library's that halves what it writes) does not become the reference: the values the
    update fed are, and the halved write is stopped (issue 38, F6)."""
    model = loaded(vc, "kimi_linear", 2, 1)
    real = torch.Tensor.copy_

    def halving(dst, src, non_blocking=False):
        return real(dst, src * 0.5, non_blocking)

    name = f"{ATTN}dt_bias"
    (tensor,) = [t for n, t in fed("kimi_linear", 3.0) if n == name]
    monkeypatch.setattr(torch.Tensor, "copy_", halving)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        model.load_weights([(name, tensor)])
    monkeypatch.undo()
    assert f"rank 1 {name}: dt_bias: differs from what was fed as {name} at [0] (its [0]; " in \
        str(caught.value)
