"""The guard under the RL stacks' refit patterns, through vLLM 0.33.0's own code:
``initialize_layerwise_reload`` / ``finalize_layerwise_reload`` (prime-rl, vLLM's weight-transfer
engines), ``reload_weights`` with an iterator, ``load_checkpoint_weight_patches`` (verl's delta
sync), ``DummyModelLoader`` (verl, NeMo-RL, SkyRL boot with ``load_format=dummy``),
``process_weights_after_loading`` (the end of verl's bucketed sync) and the model's own
``load_weights`` one tensor per call (OpenRLHF, TRL colocate), for Kimi-Linear, Kimi K3 and
GLM-5.3-Flash. Honest variants pass in modes fail and warn; wrong ones are stopped (fail) or
logged (warn) and named; out of the engine's calls the guard raises only ``GuardError``.
Built as test_vllm.py's (helpers: vllm_guard.py)."""

from __future__ import annotations

import re
import warnings

import pytest

from vllm_guard import (ATTN, CKPT, build, default_load, expected_after, fed, loaded,
                        loading_as, model_config, reload_config, set_rank, swap_q_into_k)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from vllm.config import LoadConfig, set_current_vllm_config
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.checkpoint_weight_patch import (
        CheckpointWeightPatch, load_checkpoint_weight_patches)
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload, inplace,
                                                         record_metadata_for_reloading)

from kda_tp import GuardError
from kda_tp.errors import GuardWarning
from kda_tp.guard import MODE_ENV, followed

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]

KINDS = ["k3", "kimi_linear", "glm"]
# What v_proj's rows hold when the engine dropped the v_proj it was fed: vLLM rebuilt them from
# uninitialised memory (other values, by chance the old ones or another part's); each is named
# with the v_proj that was fed.
DROPPED = rf"[^\n]*{ATTN}v_proj\.weight"
FUSED = {"k3": "in_proj_qkvgfab", "kimi_linear": "in_proj_qkvgfab", "glm": "in_proj_qkvbfg_a"}


def q_k_first(tensors):
    """q_proj and k_proj first: a pack cut after them splits the fused projection."""
    return sorted(tensors, key=lambda t: (not t[0].endswith("q_proj.weight"),
                                          not t[0].endswith("k_proj.weight"), t[0]))


def layerwise(vc, model, kind, packs) -> None:
    """vLLM's layerwise reload as prime-rl and the weight-transfer engines run it."""
    with set_current_vllm_config(vc):
        initialize_layerwise_reload(model)
        for pack in packs:
            model.load_weights(pack)
        finalize_layerwise_reload(model, model_config(CKPT[kind]))


def holds(vc, model, kind, tp_size, rank, scale) -> bool:
    want = expected_after(vc, kind, tp_size, rank, scale)
    set_rank(tp_size, rank)
    return all(torch.equal(p, want[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("mode", ["fail", "warn"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_layerwise_reload_in_two_packs_cut_inside_the_fused_projection_passes(
        vc, kind, mode, monkeypatch, guard_log):
    monkeypatch.setenv(MODE_ENV, mode)
    model = loaded(vc, kind, 2, 1)
    tensors = q_k_first(fed(kind, 2.0))
    guard_log.clear()
    with guard_log:
        layerwise(vc, model, kind, [tensors[:2], tensors[2:]])
    (line,) = guard_log.lines
    assert line.startswith("kda_tp guard: vllm layerwise reload: tp rank 1/2: ")
    assert line.endswith(": OK")
    assert holds(vc, model, kind, 2, 1, 2.0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fused_part_the_layerwise_reload_never_applies_is_named(vc, kind, monkeypatch, guard_log):
    model = build(vc, kind, 4, 2)
    real = model.load_weights
    calls = {"n": 0}

    def drops_later_parts(weights):  # SGLang #38298's pattern, in the model's load_weights:
        calls["n"] += 1  # the fed v_proj of a call after the first pack is dropped
        return real((n, w) for n, w in weights if not (calls["n"] > 2 and "v_proj" in n))

    model.load_weights = drops_later_parts
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT[kind])  # the first load (call 1)
    # vLLM rebuilds the fused parameter from torch.empty_strided (reload/meta.py): memory that
    # could hold anything, even the values from before; here it holds 7.0, so the test is the
    # same on every run.
    empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *args, **kwargs: empty_strided(*args, **kwargs).fill_(7.0))
    tensors = q_k_first(fed(kind, 2.0))
    with pytest.raises(GuardError) as caught:
        layerwise(vc, model, kind, [tensors[:2], tensors[2:]])
    text = str(caught.value)
    assert text.startswith("kda_tp guard: vllm layerwise reload: tp rank 2/4: ")
    assert re.search(rf"rank 2 {ATTN}{FUSED[kind]}\.weight: v_proj: {DROPPED}", text), text
    monkeypatch.setenv(MODE_ENV, "warn")
    guard_log.clear()
    with guard_log, pytest.warns(GuardWarning, match="FAIL"):
        layerwise(vc, model, kind, [tensors[:2], tensors[2:]])
    (line,) = guard_log.lines
    assert "FAIL (1 wrong)" in line and re.search(f"v_proj: {DROPPED}", line), line


@pytest.mark.parametrize("kind", KINDS)
def test_rows_a_reload_never_fed_and_rebuilt_uninitialised_are_named(vc, kind, monkeypatch):
    """reload_weights whose iterator never sends b_proj and f_a_proj: vLLM rebuilds the fused
    projection from torch.empty_strided and copies every row of it back."""
    model = loaded(vc, kind, 2, 0)
    config = reload_config(kind)
    with set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed(kind, 3.0)), None, True)  # all: OK
        fused = getattr(model.model.layers[0].self_attn, FUSED[kind]).weight
        with torch.no_grad():  # what is not fed must hold its values: make them recognisable
            fused.fill_(7.0)
        # torch.empty_strided may hand back the freed memory still holding 7.0 (then the
        # rows would hold their values by chance): here it holds 5.0, the same on every run.
        empty_strided = torch.empty_strided
        monkeypatch.setattr(torch, "empty_strided",
                            lambda *args, **kwargs: empty_strided(*args, **kwargs).fill_(5.0))
        partial = [t for t in fed(kind, 2.0)
                   if not t[0].endswith((".b_proj.weight", ".f_a_proj.weight"))]
        with pytest.raises(GuardError) as caught:
            inplace.reload_weights(config, model, iter(partial), None, True)
    text = str(caught.value)
    assert "kda_tp guard: vllm reload_weights: tp rank 0/2: " in text
    for part in ("b_proj", "f_a_proj"):
        assert (f"rank 0 {ATTN}{FUSED[kind]}.weight: {part}: not fed by this update and no "
                "longer holds its values from before it (rebuilt uninitialised?)") in text


@pytest.mark.parametrize("kind", KINDS)
def test_a_sparse_nan_patch_is_judged_on_the_values_before_it(vc, kind, vllm_log):
    """vLLM's load_checkpoint_weight_patches: NaN marks "unchanged", vLLM's loader keeps the old
    value there; the reference is the patch applied to this rank's values before it."""
    model = loaded(vc, kind, 2, 1)
    base = dict(fed(kind, 1.0))
    g = torch.Generator().manual_seed(0)
    patches = []
    for name in sorted(base):
        if name.endswith(("q_proj.weight", "dt_bias", "o_proj.weight", "A_log")):
            full = base[name]
            index = torch.randperm(full.numel(), generator=g)[: max(1, full.numel() // 50)]
            patches.append(CheckpointWeightPatch(name, tuple(full.shape), full.dtype,
                                                 full.reshape(-1)[index] + 1.0, index))
    vllm_log.clear()
    with vllm_log:
        load_checkpoint_weight_patches(model, patches)
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert line.endswith(": OK")
    loading_as(model, 2, 0)  # the patch applied to rank 0's rows on rank 1
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        load_checkpoint_weight_patches(model, patches)
    assert f"rank 1 {ATTN}dt_bias: dt_bias: differs from what was fed as {ATTN}dt_bias" \
        in str(caught.value)


@pytest.mark.parametrize("kind", KINDS)
def test_after_a_dummy_load_the_first_sync_must_fill_every_kda_region(vc, kind, vllm_log):
    """verl, NeMo-RL and SkyRL boot with load_format=dummy: the first sync is the first load."""
    def dummy_boot():
        model = build(vc, kind, 2, 0)
        record_metadata_for_reloading(model)
        with set_current_vllm_config(vc):  # vLLM's own DummyModelLoader (wrapped by the plugin)
            DummyModelLoader(LoadConfig(load_format="dummy")).load_weights(
                model, model_config(CKPT[kind]))
        assert followed(model) is not None  # not checked at load, followed
        return model

    partial = [t for t in fed(kind, 2.0) if not t[0].endswith(("A_log", "dt_bias"))]
    config = model_config(CKPT[kind])
    model = dummy_boot()  # a layerwise first sync (SkyRL, NeMo-RL's native engines)
    with pytest.raises(GuardError) as caught:
        layerwise(vc, model, kind, [partial])
    for name in ("A_log", "dt_bias"):
        assert (f"rank 0 {ATTN}{name}: {name}: never loaded since the dummy load (random "
                "values): the update did not feed it") in str(caught.value)
    model = dummy_boot()  # verl's bucketed sync, ended by process_weights_after_loading
    with set_current_vllm_config(vc):
        model.load_weights(partial[:4])
        model.load_weights(partial[4:])  # each bucket right by itself
        with pytest.raises(GuardError) as caught:
            loader_utils.process_weights_after_loading(model, config, torch.device("cpu"))
    assert (f"kda_tp guard: vllm process_weights_after_loading: tp rank 0/2: 2 KDA parameters "
            f"updated ({followed(model).target.layout.name}), ") in str(caught.value)
    assert (f"rank 0 {ATTN}A_log: A_log: never loaded since the dummy load (random values): "
            "the refit did not feed it") in str(caught.value)
    model = dummy_boot()  # an honest first sync, one tensor per call, then a partial update
    vllm_log.clear()
    with vllm_log:
        for item in fed(kind, 2.0):
            model.load_weights([item])
        loader_utils.process_weights_after_loading(model, config, torch.device("cpu"))
        layerwise(vc, model, kind, [partial])  # later updates are judged as any update
    assert all(line.endswith(": OK") for line in vllm_log.lines)
    assert vllm_log.lines[-1].startswith("kda_tp guard: vllm layerwise reload: ")


def test_one_tensor_per_call_costs_a_lookup_and_names_what_an_earlier_call_fed(vc, vllm_log):
    model = loaded(vc, "k3", 2, 1)
    how = followed(model)
    target = how.target
    vllm_log.clear()
    with vllm_log:
        model.load_weights([(f"{ATTN}rotary_emb.inv_freq", torch.zeros(4))])  # vLLM skips it
    assert vllm_log.lines == [] and how.target is target and not how.memory
    swap_q_into_k(model)
    tensors = q_k_first(fed("k3"))
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        for item in tensors:
            model.load_weights([item])
    assert (f"rank 1 {ATTN}in_proj_qkvgfab.weight: k_proj: holds what was fed as "
            f"{ATTN}q_proj.weight in an earlier call of this refit (this rank's slice), not "
            f"{ATTN}k_proj.weight") in str(caught.value)
    assert how.target is target  # built once, reused while the parameters are the same


@pytest.mark.parametrize("kind", KINDS)
def test_trainer_dtypes_into_a_bf16_engine_are_judged_by_the_engines_cast(vc, kind, vllm_log,
                                                                         monkeypatch):
    """verl's FSDP sends FP32 master weights into a BF16 engine; OpenRLHF, SkyRL and NeMo-RL
    send BF16 for everything, A_log and dt_bias (F32 in the engine) included."""
    # A BF16 layer's repack at the end of the layerwise reload takes vLLM's sgl-kernel GEMM on a
    # CPU with AMX tiles, whose op this CUDA build of vLLM lacks (vllm._C): its plain GEMM.
    monkeypatch.setattr(layer_utils, "check_cpu_sgl_kernel", lambda *args: False)
    vc.model_config.dtype = torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build(vc, kind, 2, 1)
        record_metadata_for_reloading(model)
        config = model_config(CKPT[kind])
        config.dtype = torch.bfloat16
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
        with set_current_vllm_config(vc):
            DefaultModelLoader(LoadConfig()).load_weights(model, config)
        layer = model.model.layers[0].self_attn
        assert layer.A_log.dtype == torch.float32 and layer.o_proj.weight.dtype == torch.bfloat16
        fp32 = [(n, t + torch.linspace(0, 97, t.numel()).reshape(t.shape))
                for n, t in fed(kind, 1.0)]  # not representable in BF16
        bf16 = [(n, t.to(torch.bfloat16)) for n, t in fed(kind, 3.0)]
        vllm_log.clear()
        with vllm_log:
            model.load_weights(fp32)
            layerwise(vc, model, kind, [bf16])
        lines = vllm_log.lines
        assert len(lines) == 2 and all(line.endswith(": OK") for line in lines), lines
        layer.o_norm.weight.weight_loader = (  # a loader that truncates instead of rounding
            lambda p, w: p.data.copy_((w.view(torch.int32) & -65536).view(torch.float32)))
        with pytest.raises(GuardError, match=f"rank 1 {ATTN}o_norm.weight: o_norm: "), \
                set_current_vllm_config(vc):
            model.load_weights([t for t in fp32 if t[0].endswith("o_norm.weight")])
    finally:
        torch.set_default_dtype(previous)
        vc.model_config.dtype = torch.float32
