"""vLLM's MLA derived copies (``W_UK_T`` / ``W_UV``, built by ``process_weights_after_loading``
after the guard's first-load check) judged where vLLM builds them: at the first load's
post-processing and after every refit's, against what the local ``kv_b_proj`` derives.

A hybrid of each family (``kda_tp.synth``: layer 0 KDA, layer 1 MLA, 4 MLA heads) has its MLA
layer built at TP 2 by vLLM 0.33.0's own class and loaded by its model class's
``load_weights`` (tests/mla_engine_child.py's ``vllm_layer``, on a stand-in); the first-load
check (its KDA layer built by the layout, as test_mla_first_load.py does) gives the follower
its MLA plan, and vLLM's own ``process_weights_after_loading`` (the guard's hook on it) builds
and judges the copies (vLLM's layerwise reload too, which post-processes each layer). An
honest load and refit pass with the copies counted; a copy left
stale by a refit of ``kv_b_proj`` (a post-load hook not forwarded) is stopped and named; a
``kv_b_proj`` the backend emptied (``AMX_MLA``) is not checkable (repacked), said, stopping
nothing, and a copy the backend did not build is refused in mode fail. An update
that feeds the MLA layer's tensors through the model's ``load_weights`` (buckets, the whole
layer, a layerwise reload) is judged for them as for the KDA ones, counted as MLA; a loader
that narrows rank 1's ``kv_b_proj`` at rank 0 is stopped, named.
"""

from __future__ import annotations

import logging
import os
import re
import warnings

import pytest

import kda_tp
from kda_tp.engines import LAYOUTS, build_param
from kda_tp.errors import GuardError
from kda_tp.guard import MODE_ENV, follow
from kda_tp.synth import write_small_checkpoint

pytestmark = pytest.mark.engines
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    pytest.importorskip("vllm")
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.model_loader import utils as loader_utils
    from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                         initialize_layerwise_reload,
                                                         record_metadata_for_reloading)
    from vllm.model_executor.utils import replace_parameter

from kda_tp.guard.vllm import register
from mla_engine_child import FromLayers, _checkpoint, vllm_layer

LAYOUT = {"k3": "vllm-0.33-k3", "glm": "vllm-0.33-glm-5.3"}
COPY = {"k3": "layers.1.self_attn.", "glm": "layers.1.self_attn.mla_attn.mla_attn."}
MLA_LAYER, TP, RANK = 1, 2, 1


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Each family's hybrid checkpoint, written once."""
    return {kind: write_small_checkpoint(tmp_path_factory.mktemp(kind) / "ckpt", 64, 4, 16, 4,
                                         16, 2, [0], style=kind) for kind in LAYOUT}


@pytest.fixture(autouse=True)
def _bf16(monkeypatch):
    """vLLM builds the model in its model dtype (BF16); the guard hooked, mode fail. A BF16
    layer's repack in post-processing takes vLLM's sgl-kernel GEMM on a CPU with AMX tiles,
    whose op this CUDA build of vLLM lacks (vllm._C): its plain GEMM."""
    monkeypatch.delenv(MODE_ENV, raising=False)
    monkeypatch.setattr(layer_utils, "check_cpu_sgl_kernel", lambda *args: False)
    register()
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    yield
    torch.set_default_dtype(before)


def loaded(kind: str, ckpt):
    """Rank 1's MLA layer loaded by vLLM's own classes, its first load checked and followed:
    ``(vllm_config, stand-in, the MLAAttention that absorbs kv_b_proj, checkpoint tensors)``."""
    text, mla = _checkpoint(ckpt, MLA_LAYER)
    vc, stack, attn, absorbing = vllm_layer(kind, text, mla, MLA_LAYER, TP, RANK)
    layout = LAYOUTS[LAYOUT[kind]]
    view = kda_tp.open_rank(ckpt, tp_rank=RANK, tp_size=TP, qk_multiple=1, mla=True)
    base = layout.state_dict_prefix(view.prefix)
    params = {f"{base}0.self_attn.{p.suffix}": build_param(view, layout, p.suffix, 0,
                                                           model_dtype="BF16")
              for p in layout.params_for(view.plan)}
    params.update({f"{base}{MLA_LAYER}.self_attn.{n}": p for n, p in attn.named_parameters()})
    result = kda_tp.guard.check(params, ckpt, tp_rank=RANK, tp_size=TP, engine=layout.name)
    assert result is not None and result.passed and result.mla_plan is not None
    follow(stack, "vllm", plan=result.plan, tp_rank=RANK, tp_size=TP, mla_plan=result.mla_plan,
           reader=FromLayers("layers."))
    return vc, stack, absorbing, mla




def post_process(vc, stack) -> None:
    """vLLM's own ``process_weights_after_loading`` (the guard's hook on it)."""
    vc.model_config.word_embeddings_untied_by_checkpoint = False
    vc.model_config.quantization = None
    with set_current_vllm_config(vc):
        loader_utils.process_weights_after_loading(stack, vc.model_config,
                                                   torch.device("cpu"))


def line(kind: str, nbytes: int, verdict: str) -> str:
    return (rf"kda_tp guard: vllm process_weights_after_loading: tp rank {RANK}/{TP}: "
            rf"2 MLA derived copies \({LAYOUT[kind]}\), {nbytes} bytes, [0-9.]+ s: {verdict}")


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_the_copies_are_judged_at_the_first_load_and_after_an_honest_refit(kind, ckpts,
                                                                           caplog, guard_log):
    vc, stack, absorbing, mla = loaded(kind, ckpts[kind])
    for refit in (False, True):
        if refit:  # kv_b_proj refit, then vLLM rebuilds the copies
            name = f"layers.{MLA_LAYER}.self_attn.kv_b_proj.weight"
            stack.load_weights(iter([(name, mla[name] * 2)]))
        caplog.clear()
        with guard_log:
            post_process(vc, stack)
        nbytes = absorbing.W_UK_T.nbytes + absorbing.W_UV.nbytes
        lines = [r.getMessage() for r in caplog.records
                 if "process_weights_after_loading" in r.getMessage()]
        assert len(lines) == 1 and re.fullmatch(line(kind, nbytes, "OK"), lines[0]), lines


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_a_copy_left_stale_by_a_kv_b_proj_refit_is_stopped_named(kind, ckpts, monkeypatch):
    vc, stack, absorbing, mla = loaded(kind, ckpts[kind])
    post_process(vc, stack)
    # the copy held apart from kv_b_proj (not a view), and a wrapper that does not forward
    # the post-load hook: the refit leaves it as the first load built it
    replace_parameter(absorbing, "W_UK_T", absorbing.W_UK_T.detach().clone())
    monkeypatch.setattr(absorbing, "process_weights_after_loading", lambda dtype: None)
    name = f"layers.{MLA_LAYER}.self_attn.kv_b_proj.weight"
    stack.load_weights(iter([(name, mla[name] * 2)]))
    with pytest.raises(GuardError) as caught:
        post_process(vc, stack)
    text = str(caught.value)
    assert re.fullmatch(line(kind, r"\d+", r"FAIL \(1 wrong\)"), text.splitlines()[0])
    assert (f"  rank {RANK} {COPY[kind]}W_UK_T: differs from what kv_b_proj.weight makes of "
            "it at [0, 0, 0]") in text
    assert "W_UV" not in text  # vLLM's W_UV is a view of kv_b_proj: it follows the refit


@pytest.mark.parametrize("kind", ["k3"])
def test_a_kv_b_proj_the_backend_emptied_is_not_checkable_and_stops_nothing(kind, ckpts,
                                                                            monkeypatch, caplog,
                                                                            guard_log):
    vc, stack, absorbing, _ = loaded(kind, ckpts[kind])

    def amx(dtype):  # AMX_MLA packs its own copies, then releases the raw weight
        replace_parameter(absorbing.kv_b_proj, "weight",
                          absorbing.kv_b_proj.weight.new_empty(0))

    post_process(vc, stack)
    monkeypatch.setattr(absorbing, "process_weights_after_loading", amx)
    caplog.clear()
    with guard_log:
        post_process(vc, stack)  # stops nothing in mode fail: the KDA repacked rule
    (record,) = [r for r in caplog.records if "process_weights_after_loading" in r.getMessage()]
    assert record.levelno == logging.INFO
    text = record.getMessage()
    assert re.fullmatch(line(kind, "0", r"OK").replace("2 MLA", "0 MLA").replace(
        r" s: OK", r" s, 2 not checkable \(repacked\): OK"), text.splitlines()[0]), text
    for copy in ("W_UK_T", "W_UV"):
        assert (f"rank {RANK} not checkable: {COPY[kind]}{copy}: "
                f"layers.{MLA_LAYER}.self_attn.kv_b_proj.weight is empty") in text


@pytest.mark.parametrize("kind", ["k3"])
def test_a_copy_the_engine_did_not_build_is_not_checked_and_refused(kind, ckpts, monkeypatch,
                                                                     guard_log):
    vc, stack, absorbing, _ = loaded(kind, ckpts[kind])
    post_process(vc, stack)
    original = absorbing.process_weights_after_loading

    def forgets(dtype):  # a backend that builds W_UK_T but never W_UV
        original(dtype)
        del absorbing.W_UV

    monkeypatch.setattr(absorbing, "process_weights_after_loading", forgets)
    with guard_log, pytest.raises(GuardError) as caught:
        post_process(vc, stack)
    text = str(caught.value)
    assert re.fullmatch(line(kind, r"\d+", r"NOT CHECKED \(1 checks could not run\)").replace(
        "2 MLA", "1 MLA"), text.splitlines()[0]), text
    assert (f"rank {RANK} not checked: {COPY[kind]}W_UV: the engine built no such copy of "
            f"layers.{MLA_LAYER}.self_attn.kv_b_proj.weight") in text


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_the_copies_are_judged_after_a_layerwise_reload(kind, ckpts, caplog, guard_log):
    vc, stack, absorbing, mla = loaded(kind, ckpts[kind])
    post_process(vc, stack)
    record_metadata_for_reloading(stack)
    refit = [(n, w * 2 if n.endswith("kv_b_proj.weight") else w) for n, w in mla.items()]
    caplog.clear()
    with guard_log, set_current_vllm_config(vc):  # prime-rl's and the transfer engines' path
        initialize_layerwise_reload(stack)
        stack.load_weights(iter(refit))
        finalize_layerwise_reload(stack, vc.model_config)
    nbytes = absorbing.W_UK_T.nbytes + absorbing.W_UV.nbytes
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and re.fullmatch(
        update_line(kind, MLA_PARAMS[kind], "OK").replace("load_weights", "layerwise reload"),
        lines[0]), lines  # the MLA parameters fed, judged when the reload finalizes
    assert re.fullmatch(
        line(kind, nbytes, "OK").replace("process_weights_after_loading", "layerwise reload"),
        lines[1]), lines


MLA_PARAMS = {"k3": 6, "glm": 6}  # the layer's MLA parameters in the layout (vLLM 0.33)


def update_line(kind: str, params: int, verdict: str) -> str:
    return (rf"kda_tp guard: vllm load_weights: tp rank {RANK}/{TP}: 0 KDA and {params} MLA "
            rf"parameters updated \({LAYOUT[kind]}\), [1-9][0-9]* bytes, [0-9.]+ s: {verdict}")


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_an_honest_mla_refit_passes_with_the_mla_parameters_counted(kind, ckpts, caplog,
                                                                    guard_log):
    vc, stack, _, mla = loaded(kind, ckpts[kind])
    post_process(vc, stack)
    refit = [(n, w * 2) for n, w in mla.items()]
    caplog.clear()
    with guard_log, set_current_vllm_config(vc):
        stack.load_weights(iter(refit[:3]))  # buckets: each call one update
        stack.load_weights(iter(refit[3:]))
        stack.load_weights(iter(refit))  # the whole layer in one call
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3 and all(line.endswith(": OK") for line in lines), lines
    assert re.fullmatch(update_line(kind, MLA_PARAMS[kind], "OK"), lines[2]), lines[2]
    assert not any("MLA parameters not checked" in line for line in lines)


@pytest.mark.parametrize("kind", sorted(LAYOUT))
def test_a_loader_bug_on_rank_1s_kv_b_proj_in_a_refit_is_stopped_named(kind, ckpts,
                                                                        monkeypatch):
    vc, stack, absorbing, mla = loaded(kind, ckpts[kind])
    post_process(vc, stack)
    # its loader told rank 0 (the module's and its parameter's rank, whichever loads it)
    monkeypatch.setattr(absorbing.kv_b_proj, "tp_rank", 0)
    monkeypatch.setattr(absorbing.kv_b_proj.weight, "tp_rank", 0, raising=False)
    name = f"layers.{MLA_LAYER}.self_attn.kv_b_proj.weight"
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        stack.load_weights(iter([(name, mla[name] * 2)]))
    text = str(caught.value)
    assert re.fullmatch(update_line(kind, 1, r"FAIL \(1 wrong\)"), text.splitlines()[0])
    assert f"  rank {RANK} layers.{MLA_LAYER}.self_attn.kv_b_proj.weight: kv_b_proj: " in text
