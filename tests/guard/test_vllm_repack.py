"""The guard after vLLM's CPU post-load repack (issue 34, item 2), through vLLM 0.33.0's own
``dispatch_cpu_unquantized_gemm`` (``vllm/model_executor/layers/utils.py``): every Linear
weight of the KDA layer moved into the kernel's closure (``layer.cpu_linear``) and replaced
with an empty tensor, as vLLM does on a CPU host after ``load_weights``. This CPU build of vLLM
has no oneDNN (``vllm._C``), so its zentorch branch runs, with ``torch.ops.zentorch
.zentorch_linear_unary`` defined here as a plain ``torch.nn.functional.linear`` (a GEMM: it
reads -0.0 as +0.0, as oneDNN does). The live audit then reads the weights back through the
engine's GEMM: a correct rank is OK, a wrong one is named, a value the GEMM cannot carry and a
weight kda_tp cannot read back are "not checkable", never wrong. Helpers in vllm_guard.py."""

from __future__ import annotations

import shutil
import warnings

import pytest

from vllm_guard import ATTN, CKPT, build, default_load, fake_llm, worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.model_executor.layers.linear import LinearBase

from kda_tp.guard.vllm import audit_llm

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]


@pytest.fixture(scope="module")
def zentorch():
    """``torch.ops.zentorch.zentorch_linear_unary``: the kernel vLLM's zentorch branch calls,
    here a plain GEMM."""
    if not hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
        lib = torch.library.Library("zentorch", "DEF")
        lib.define("zentorch_linear_unary(Tensor x, Tensor w, Tensor? b, *, "
                   "bool is_weight_prepacked=False) -> Tensor")
        lib.impl("zentorch_linear_unary",
                 lambda x, w, b, is_weight_prepacked=False: torch.nn.functional.linear(x, w, b),
                 "CPU")
        yield lib
    else:
        yield None


def repack(model, monkeypatch) -> None:
    """vLLM's own CPU GEMM dispatch on every Linear of ``model``, weights removed."""
    monkeypatch.setattr(layer_utils.current_platform, "is_zen_cpu", lambda: True)
    for module in model.modules():
        if isinstance(module, LinearBase):
            layer_utils.dispatch_cpu_unquantized_gemm(module, remove_weight=True)


def rank_1_audit(model, checkpoint=None) -> dict:
    """``audit_llm``'s report of rank 1 of 2 holding ``model`` (Kimi-Linear's fixture, or
    ``checkpoint``)."""
    silent, report = audit_llm(fake_llm([(1, worker(model, checkpoint or CKPT["kimi_linear"]))]))
    assert (silent["tp_rank"], silent["guarded"]) == (0, False)  # rank 0 is not asked here
    return report


def rank_1_loaded(vc, checkpoint=None):
    """Kimi-Linear's rank 1 of 2 (of the fixture, or ``checkpoint``), loaded by vLLM."""
    model = build(vc, "kimi_linear", 2, 1)
    default_load(vc, model, checkpoint or CKPT["kimi_linear"])
    return model


def test_an_honest_rank_reads_back_ok_through_the_engines_gemm(vc, zentorch, monkeypatch):
    model = rank_1_loaded(vc)
    before = rank_1_audit(model)
    repack(model, monkeypatch)
    emptied = [n for n, p in model.named_parameters() if p.numel() == 0]
    assert f"{ATTN}o_proj.weight" in emptied and len(emptied) >= 3, emptied
    after = rank_1_audit(model)
    assert after["ok"] is True, after["text"]
    assert after["unchecked"] == [] and after["line"].endswith(" s: OK")
    assert (after["params"], after["bytes"]) == (before["params"], before["bytes"]) == \
        (9, before["bytes"])


def test_a_wrong_repacked_weight_is_named(vc, zentorch, monkeypatch):
    model = rank_1_loaded(vc)
    with torch.no_grad():
        model.model.layers[0].self_attn.o_proj.weight[0, 3] += 1.0
    repack(model, monkeypatch)
    report = rank_1_audit(model)
    assert report["ok"] is False and report["line"].endswith("FAIL (1 wrong)")
    (wrong,) = [p for p in report["report"]["params"] if p["status"] != "exact"]
    assert wrong["name"] == f"{ATTN}o_proj.weight"
    assert "values differ in o_proj" in wrong["problem"]


def test_a_value_the_gemm_cannot_carry_is_not_checkable_never_wrong(vc, zentorch, monkeypatch,
                                                                     tmp_path):
    tensors = load_file(str(CKPT["kimi_linear"] / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    # -0.0 in rank 1's columns of o_proj (row-parallel: its second half)
    tensors[name][2, tensors[name].shape[1] - 1] = -0.0
    shutil.copy(CKPT["kimi_linear"] / "config.json", tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    model = rank_1_loaded(vc, tmp_path)
    assert rank_1_audit(model, tmp_path)["ok"] is True  # before the repack: -0.0 held
    repack(model, monkeypatch)
    report = rank_1_audit(model, tmp_path)
    assert report["ok"] is True, report["text"]
    (line,) = report["unchecked"]
    assert line == (f"{ATTN}o_proj.weight: repacked by the engine; not checkable: its expected "
                    "values hold -0.0 (reads +0.0), which the engine's GEMM read-back cannot "
                    "carry")
    assert report["line"].endswith(", 1 not checkable (repacked): OK")
    assert report["params"] == 9


def test_a_weight_kda_tp_cannot_read_back_is_not_checkable(vc, zentorch, monkeypatch):
    model = rank_1_loaded(vc)
    repack(model, monkeypatch)
    del model.model.layers[0].self_attn.o_proj.cpu_linear  # a repack kda_tp does not know
    report = rank_1_audit(model)
    assert report["ok"] is True, report["text"]
    (line,) = report["unchecked"]
    assert line.startswith(f"{ATTN}o_proj.weight: not checkable (repacked): the engine "
                           "replaced it with an empty tensor")


def test_a_layerwise_reload_after_the_repack_is_checked_on_what_vllm_holds(vc, zentorch,
                                                                          monkeypatch, vllm_log):
    """vLLM's layerwise ``reload_weights`` restores the repacked weights, loads, and repacks
    again inside the session (``process_weights_after_loading``): the update's check reads
    the weights back; an honest reload passes, the rank-0 bug is named."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import inplace, record_metadata_for_reloading

    from kda_tp import GuardError
    from vllm_guard import fed, loading_as, reload_config

    model = build(vc, "kimi_linear", 2, 1)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT["kimi_linear"])
    repack(model, monkeypatch)
    config = reload_config("kimi_linear")
    with vllm_log:
        inplace.reload_weights(config, model, iter(fed("kimi_linear", 3.0)), None, True)
    (line,) = vllm_log.lines
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ")
    assert line.endswith(": OK"), line
    assert model.model.layers[0].self_attn.o_proj.weight.numel() == 0  # repacked again
    loading_as(model, 2, 0)
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        inplace.reload_weights(config, model, iter(fed("kimi_linear", 4.0)), None, True)
    assert "rank 1 model.layers.0.self_attn." in str(caught.value)
    assert "holds 0" not in str(caught.value)


def _reload_after_repack(vc, monkeypatch, vllm_log, weights, unpack=None) -> list[str]:
    """A layerwise ``reload_weights`` of ``weights`` into the rank-1 model after the repack
    (``unpack(model)`` first, if given), in mode fail; the guard's lines."""
    from vllm.model_executor.model_loader.reload import inplace, record_metadata_for_reloading

    from vllm_guard import reload_config

    model = build(vc, "kimi_linear", 2, 1)
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT["kimi_linear"])
    repack(model, monkeypatch)
    if unpack is not None:
        unpack(model)
    monkeypatch.setenv("KDA_TP_GUARD", "fail")
    with vllm_log:
        inplace.reload_weights(reload_config("kimi_linear"), model, iter(weights), None, True)
    return vllm_log.lines


def test_an_honest_reload_feeding_a_value_the_gemm_cannot_carry_is_never_stopped(
        vc, zentorch, monkeypatch, vllm_log):
    """A refit whose o_proj holds -0.0 in this rank's columns: the weight read back after
    vLLM repacks it again holds +0.0 there. Not checkable, never wrong: the update goes on
    in mode fail, the line says so."""
    from vllm_guard import fed

    weights = fed("kimi_linear", 3.0)
    name = "model.layers.0.self_attn.o_proj.weight"
    (o_proj,) = [t for n, t in weights if n == name]
    o_proj[2, o_proj.shape[1] - 1] = -0.0  # rank 1's half of the row-parallel columns
    (line, detail) = _reload_after_repack(vc, monkeypatch, vllm_log, weights)[0].split("\n")
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ")
    assert line.endswith(", 1 not checkable (repacked): OK"), line
    assert detail == (f"  rank 1 not checkable: {ATTN}o_proj.weight: repacked by the engine; "
                      "not checkable: its values hold -0.0 (reads +0.0)")


def test_a_reload_into_a_weight_kda_tp_cannot_read_back_is_not_checkable_never_wrong(
        vc, zentorch, monkeypatch, vllm_log):
    """The repack replaced o_proj with an empty tensor and kda_tp finds no ``cpu_linear`` to
    read it through: never "holds 0", never a stopped update."""
    from vllm_guard import fed

    def unknown_repack(model) -> None:
        # Every later repack of o_proj is one kda_tp does not know: no cpu_linear.
        layer = model.model.layers[0].self_attn.o_proj
        real = layer.quant_method.process_weights_after_loading

        def process(module):
            real(module)
            if module is layer:
                del module.cpu_linear
        monkeypatch.setattr(layer.quant_method, "process_weights_after_loading", process)
        del layer.cpu_linear

    (text,) = _reload_after_repack(vc, monkeypatch, vllm_log, fed("kimi_linear", 3.0),
                                   unknown_repack)
    line, detail = text.split("\n")
    assert line.endswith(", 1 not checkable (repacked): OK"), text
    assert detail.startswith(f"  rank 1 not checkable: {ATTN}o_proj.weight: not checkable "
                             "(repacked): the engine replaced it with an empty tensor")
    assert "holds 0" not in text
