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

import re
import shutil
import warnings

import pytest

from vllm_guard import ATTN, CKPT, build, default_load, fake_llm, worker

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from safetensors.torch import load_file, save_file
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.config import set_current_vllm_config
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


def _odd_values(tmp_path, *, nan: bool = False):
    """The Kimi-Linear fixture with values a GEMM read-back does not carry in rank 1's columns
    of o_proj (row-parallel: its second half): a -0.0, a subnormal, and with ``nan`` a NaN
    in row 5."""
    tensors = load_file(str(CKPT["kimi_linear"] / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    last = tensors[name].shape[1] - 1
    tensors[name][2, last] = -0.0
    tensors[name][3, last - 1] = 1e-40  # an F32 subnormal
    if nan:
        tensors[name][5, last - 2] = float("nan")
    shutil.copy(CKPT["kimi_linear"] / "config.json", tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_values_the_gemm_reads_alike_are_judged_alike(vc, zentorch, monkeypatch, tmp_path):
    """-0.0 reads +0.0 and a subnormal reads 0 through the GEMM: judged alike, OK, nothing set
    aside (issue 38, F2)."""
    odd = _odd_values(tmp_path)
    model = rank_1_loaded(vc, odd)
    assert rank_1_audit(model, odd)["ok"] is True  # before the repack: held as loaded
    repack(model, monkeypatch)
    report = rank_1_audit(model, odd)
    assert report["ok"] is True, report["text"]
    assert report["unchecked"] == [] and report["line"].endswith(" s: OK")
    assert report["params"] == 9


def test_a_wrong_load_is_wrong_whatever_its_expected_values_hold(vc, zentorch, monkeypatch,
                                                                 tmp_path):
    """o_proj loaded from rank 0's columns where rank 1's expected hold a -0.0 and a
    subnormal: FAIL, never "not checkable" (issue 38, F2)."""
    odd = _odd_values(tmp_path)
    model = rank_1_loaded(vc, odd)
    full = load_file(str(odd / "model.safetensors"))[f"{ATTN}o_proj.weight"]
    with torch.no_grad():  # rank 0's columns
        model.model.layers[0].self_attn.o_proj.weight.copy_(full[:, :full.shape[1] // 2])
    repack(model, monkeypatch)
    report = rank_1_audit(model, odd)
    assert report["ok"] is False, report["text"]
    wrong = {p["name"]: p for p in report["report"]["params"] if p["status"] != "exact"}
    assert f"{ATTN}o_proj.weight" in wrong, report["text"]
    assert "read back through the engine's GEMM" in wrong[f"{ATTN}o_proj.weight"]["problem"]
    assert report["unchecked"] == []


def test_only_the_rows_a_nan_spoils_are_set_aside_and_counted(vc, zentorch, monkeypatch,
                                                              tmp_path):
    """A NaN in row 5 of o_proj: the GEMM reads that row NaN; its 768 elements are set
    aside, counted and named, every other element judged (issue 38, F2)."""
    odd = _odd_values(tmp_path, nan=True)
    model = rank_1_loaded(vc, odd)
    repack(model, monkeypatch)
    report = rank_1_audit(model, odd)
    assert report["ok"] is True, report["text"]
    (line,) = report["unchecked"]
    assert line == (f"{ATTN}o_proj.weight: repacked by the engine; 768 of 49152 elements not "
                    "checkable: their rows hold a NaN or an infinity, which the engine's GEMM "
                    "reads back as a row of NaN (every other element checked)")
    model = rank_1_loaded(vc, odd)
    with torch.no_grad():  # one more wrong element, outside the NaN row: FAIL
        model.model.layers[0].self_attn.o_proj.weight[0, 0] += 1.0
    repack(model, monkeypatch)
    report = rank_1_audit(model, odd)
    assert report["ok"] is False and report["line"].endswith("FAIL (1 wrong)"), report["text"]


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


def test_a_reload_is_judged_as_the_gemm_reads_it_back(vc, zentorch, monkeypatch, vllm_log):
    """A refit whose o_proj holds -0.0 and a subnormal in this rank's columns: read back after
    vLLM repacks it again as +0.0 and 0, judged alike, OK in mode fail; the same refit loaded
    by a loader that takes rank 0's columns is stopped (issue 38, F2)."""
    from kda_tp import GuardError
    from vllm_guard import fed

    weights = fed("kimi_linear", 3.0)
    name = "model.layers.0.self_attn.o_proj.weight"
    (o_proj,) = [t for n, t in weights if n == name]
    last = o_proj.shape[1] - 1  # rank 1's half of the row-parallel columns
    o_proj[2, last], o_proj[3, last - 1] = -0.0, 1e-40
    (line,) = _reload_after_repack(vc, monkeypatch, vllm_log, weights)
    assert line.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ")
    assert line.endswith(" s: OK"), line

    def rank_0_columns(model) -> None:  # the row-parallel loader told rank 0
        from vllm.model_executor.parameter import RowvLLMParameter

        real = RowvLLMParameter.load_row_parallel_weight

        def load(param, loaded_weight):
            rank, param.tp_rank = param.tp_rank, 0
            try:
                return real(param, loaded_weight)
            finally:
                param.tp_rank = rank
        monkeypatch.setattr(RowvLLMParameter, "load_row_parallel_weight", load)

    with pytest.raises(GuardError) as caught:
        _reload_after_repack(vc, monkeypatch, vllm_log, weights, rank_0_columns)
    text = str(caught.value)
    assert re.search(rf"rank 1 {ATTN}o_proj\.weight: o_proj: differs from what was fed as "
                     rf"{name} at \[\d+, \d+\] \(its \[\d+, \d+\]\) as the engine's GEMM reads "
                     "it back", text), text
    assert "not checkable" not in text


def test_a_reload_into_a_weight_kda_tp_cannot_read_back_is_not_checked(
        vc, zentorch, monkeypatch, vllm_log):
    """The repack replaced o_proj with an empty tensor and kda_tp finds no ``cpu_linear`` to
    read it through: never "holds 0", never OK: not checked, which mode fail refuses (issue
    40, item 1)."""
    from kda_tp import GuardError
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

    with pytest.raises(GuardError) as caught:
        _reload_after_repack(vc, monkeypatch, vllm_log, fed("kimi_linear", 3.0), unknown_repack)
    text = str(caught.value)
    assert text.split("\n")[0].endswith(": NOT CHECKED (1 checks could not run)"), text
    assert f"rank 1 not checked: {ATTN}o_proj.weight: not checkable (repacked): the engine " \
        "replaced it with an empty tensor" in text
    assert "holds 0" not in text


@pytest.mark.parametrize("repacked", [True, False], ids=["repacked", "kept"])
def test_a_layerwise_refit_leaving_out_b_proj_is_stopped_on_either_host(
        vc, zentorch, monkeypatch, repacked):
    """prime-rl's refit through vLLM's own layerwise reload (``initialize_layerwise_reload``,
    the model's ``load_weights``, ``finalize_layerwise_reload``) that leaves out K3's
    ``b_proj``: vLLM rebuilds ``in_proj_qkvgfab`` from fresh memory (here filled with 7.0 to
    make it visible) and repacks it; b_proj's rows are judged where vLLM reads them, before
    and after, through its GEMM on a repacking host: stopped, never a silent byte count
    (issue 40, item 1)."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload, initialize_layerwise_reload, meta,
        record_metadata_for_reloading)

    from kda_tp import GuardError
    from vllm_guard import fed

    model = build(vc, "k3", 2, 1)
    record_metadata_for_reloading(model)
    default_load(vc, model, CKPT["k3"])
    if repacked:
        repack(model, monkeypatch)
        assert model.model.layers[0].self_attn.in_proj_qkvgfab.weight.numel() == 0
    real = meta.materialize_meta_tensor

    def uninitialised(tensor):
        made = real(tensor)
        with torch.no_grad():
            made.fill_(7)
        return made

    monkeypatch.setattr(meta, "materialize_meta_tensor", uninitialised)
    weights = [(n, t) for n, t in fed("k3", 3.0) if not n.endswith(".b_proj.weight")]
    monkeypatch.setenv("KDA_TP_GUARD", "fail")
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc):
        initialize_layerwise_reload(model)
        model.load_weights(iter(weights))
        finalize_layerwise_reload(model, vc.model_config)
    text = str(caught.value)
    assert f"rank 1 {ATTN}in_proj_qkvgfab.weight: b_proj: not fed by this update and no " \
        "longer holds its values from before it (rebuilt uninitialised?)" in text, text
    assert "not checked" not in text
