"""kda_tp.audit on random geometries (parameters built from the engine tables pass; a part
taken from a wrong rank is caught), FP8 parameters, and the findings of an adversarial review:
NaN, overflowing casts, a wrong world size or checkpoint, single-part parameters, zeros,
malformed input."""

from __future__ import annotations

import math
import re
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

import kda_tp
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.audit import audit_path
from kda_tp.engines import LAYOUTS, build_param, param_plan
from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError
from kda_tp.synth import write_small_checkpoint

from audit_helpers import audit_file, fixture, only_failure, rank_params, run, sharded_state
from paths import ENGINE_RANKS as DATA
from tp_fixtures import CKPT, PRE, load  # the engine_ranks fixtures


# ------------------------------------------------------------------------------------------
# Random geometries: parameters built from the tables pass; a part from a wrong rank is caught

PROPERTY = settings(max_examples=40, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
TP_LAYOUTS = sorted(n for n, lay in LAYOUTS.items() if lay.tensor_parallel)


@st.composite
def audit_cases(draw):
    layout = draw(st.sampled_from(TP_LAYOUTS))
    tp = draw(st.sampled_from([1, 2, 3, 4]))
    family = LAYOUTS[layout].family
    k3 = family == "kimi-k3"
    heads = tp * draw(st.integers(1, 3))
    head_dim = draw(st.sampled_from([2, 4, 8]))
    geometry = dict(hidden=draw(st.integers(1, 12)), heads=heads, head_dim=head_dim,
                    conv_kernel=draw(st.integers(1, 4)), gate_rank=draw(st.integers(1, 6)),
                    num_layers=2, kda_layers=draw(st.sampled_from([[0], [1], [0, 1]])),
                    seed=draw(st.integers(0, 1000)),
                    style={"kimi-k3": "k3", "glm-5.3": "glm"}.get(family, "kimi"),
                    weight_dtype=draw(st.sampled_from(["BF16", "F32"])))
    if k3:
        geometry["a_log_len"] = heads + draw(st.integers(0, 4))
    return (layout, geometry, draw(st.integers(0, tp - 1)), tp,
            draw(st.sampled_from([None, "F32"])), draw(st.sampled_from(["model.", "x.model."])),
            draw(st.randoms(use_true_random=False)))


@PROPERTY
@given(audit_cases())
def test_random_geometries_pass_and_a_wrong_ranks_part_is_caught(case):
    layout_name, geometry, rank, tp, model_dtype, prefix, rnd = case
    if model_dtype is None and geometry["style"] == "k3":
        # K3 checkpoints hold o_norm in F32 beside BF16 weights; an engine casts it to its one
        # model dtype with the others (a rank of mixed dtypes is wrong: audit checks that).
        model_dtype = geometry["weight_dtype"]
    layout = LAYOUTS[layout_name]
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_small_checkpoint(Path(tmp) / "ckpt", **geometry)
        source = SafetensorsSource(ckpt)
        shards = [KdaShardedSource(source, KdaTpPlan.from_config(source, r, tp, qk_multiple=1))
                  for r in range(tp)]
        params = {r: {(layer, p.suffix): build_param(shards[r], layout, p.suffix, layer,
                                                     model_dtype=model_dtype)
                      for layer in shards[r].layers for p in layout.params_for(shards[r].plan)}
                  for r in range(tp)}
        name = f"{prefix}layers.{{}}.self_attn.{{}}"
        state = {name.format(*key): value for key, value in params[rank].items()}
        state[f"{prefix}embed_tokens.weight"] = np.zeros(3, np.float32)
        report = kda_tp.audit.audit(state, source, tp_rank=rank, tp_size=tp,
                                    model_dtype=model_dtype or geometry["weight_dtype"])
        assert report.passed, report.format()
        assert report.engine == layout_name and report.ignored == 1
        assert len(report.params) == len(params[rank])
        if tp == 1:
            return
        # one part of one parameter taken from another rank
        other = rnd.choice([r for r in range(tp) if r != rank])
        choices = []
        for (layer, suffix), value in params[rank].items():
            plan = param_plan(shards[rank], layout, suffix, model_dtype=model_dtype)
            theirs = params[other][layer, suffix].view(np.uint8).reshape(-1)
            mine = value.view(np.uint8).reshape(-1)
            for region in plan.regions:
                a, b = region.byte_range
                if mine[a:b].tobytes() != theirs[a:b].tobytes():  # not a replicated part
                    choices.append((layer, suffix, region, a, b))
        layer, suffix, region, a, b = rnd.choice(choices)
        bad = params[rank][layer, suffix].copy()
        bad.view(np.uint8).reshape(-1)[a:b] = params[other][layer, suffix].view(
            np.uint8).reshape(-1)[a:b]
        state[name.format(layer, suffix)] = bad
        report = kda_tp.audit.audit(state, source, tp_rank=rank, tp_size=tp,
                                    model_dtype=model_dtype or geometry["weight_dtype"])
        assert not report.passed
        [failure] = report.failures
        assert failure.name == name.format(layer, suffix) and failure.layer == layer
        [diff] = failure.differences
        assert diff.part == region.part
        assert diff.equals == f"rank {other}'s slice of {region.part}"


def test_fp8_fused_weight_and_scales_and_a_missing_scale(tmp_path):
    """vLLM K3 under ModelOpt FP8_PB_WO: the fused weight padded to 128 rows and its fused
    scale grid pass; a scale grid missing, or a part's scales from another rank, fail."""
    ckpt = write_small_checkpoint(tmp_path / "k3fp8", hidden=256, heads=4, head_dim=128,
                                  conv_kernel=4, gate_rank=128, num_layers=1, kda_layers=[0],
                                  style="k3", fp8=True)
    prefix = "language_model.model.layers.0.self_attn."
    state = rank_params(ckpt, "vllm-0.33-k3", 1, 2, prefix)
    assert state[prefix + "in_proj_qkvgfab.weight"].shape == (1280, 256)  # 1154 rows, padded
    report = kda_tp.audit.audit(state, ckpt, tp_rank=1, tp_size=2, model_dtype="F32")
    assert report.passed and report.engine == "vllm-0.33-k3", report.format()
    assert len(report.params) == 10  # 7 parameters, 3 scale grids (in_proj, f_b, o_proj)
    rank0 = rank_params(ckpt, "vllm-0.33-k3", 0, 2, prefix)
    scale = state[prefix + "in_proj_qkvgfab.weight_scale"].copy()
    scale[2:4] = rank0[prefix + "in_proj_qkvgfab.weight_scale"][2:4]  # k_proj's 2 block rows
    bad = {**state, prefix + "in_proj_qkvgfab.weight_scale": scale}
    [failure] = kda_tp.audit.audit(bad, ckpt, tp_rank=1, tp_size=2, model_dtype="F32").failures
    [diff] = failure.differences
    assert (diff.part, diff.equals) == ("k_proj.scale", "rank 0's slice of k_proj.scale")
    del bad[prefix + "in_proj_qkvgfab.weight_scale"]
    [failure] = kda_tp.audit.audit(bad, ckpt, tp_rank=1, tp_size=2, model_dtype="F32").failures
    assert failure.status == "missing" and failure.problem == (
        "missing: vllm-0.33-k3 holds in_proj_qkvgfab.weight_scale [10, 2] here")


def test_numpy_input_never_imports_torch():
    code = (
        "import sys, kda_tp\n"
        "from safetensors.numpy import load_file\n"
        f"t = load_file({str(DATA / 'vllm_k3_tp4_r1.safetensors')!r})\n"
        f"assert kda_tp.audit.audit(t, {str(DATA / 'ckpt_k3')!r}, tp_rank=1, tp_size=4,\n"
        "                     model_dtype='F32').passed\n"
        "assert 'torch' not in sys.modules\n"
    )
    import subprocess

    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ------------------------------------------------------------------------------------------
# Findings of an adversarial review: NaN, overflowing casts, wrong world size or checkpoint,
# single-part parameters, zeros, malformed input


def checkpoint_copy(tmp_path: Path, model: str, edit) -> Path:
    """A copy of the fixture checkpoint of ``model`` (a ``CKPT`` key) with ``edit(tensors)``
    applied."""
    out = tmp_path / model
    out.mkdir()
    (out / "config.json").write_text((CKPT[model] / "config.json").read_text())
    tensors = load(CKPT[model] / "model.safetensors")[1]
    edit(tensors)
    save_file(tensors, out / "model.safetensors")
    return out


def test_nan_matches_any_nan_and_negative_zero_is_caught(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")

    def nan(tensors):
        tensors[PRE + "q_proj.weight"][2 * 384 + 5, 3] = np.nan  # rank 2's q_proj row 5
    ckpt = checkpoint_copy(tmp_path, "kimi_linear", nan)
    meta, tensors, _ = fixture("vllm_kimi_linear_tp4_r2")
    name = PRE + "in_proj_qkvgfab.weight"
    w = tensors[name].copy()
    w.view(np.uint32)[5, 3] = 0x7FC00001  # a NaN with another payload
    tensors[name] = w
    assert kda_tp.audit.audit(tensors, ckpt, tp_rank=2, tp_size=4, model_dtype="F32").passed
    # a BF16 dump: ml_dtypes casts the NaN to 0x7FC0, torch to another pattern; any NaN matches
    fixed = {"A_log", "dt_bias", "conv1d.weight"}
    bf16 = {k: v if k.removeprefix(PRE) in fixed else v.astype(ml_dtypes.bfloat16)
            for k, v in tensors.items()}
    for bits in (0x7FC0, 0xFFC0, 0x7F81):
        bf16[name].view(np.uint16)[5, 3] = bits
        assert kda_tp.audit.audit(bf16, ckpt, tp_rank=2, tp_size=4,
                                  model_dtype="BF16").passed, hex(bits)
    # a number where the checkpoint has NaN is still a difference
    bf16[name][5, 3] = 5.0
    [failure] = kda_tp.audit.audit(bf16, ckpt, tp_rank=2, tp_size=4, model_dtype="BF16").failures
    [diff] = failure.differences
    assert (diff.part, diff.index, math.isnan(diff.expected), diff.actual) == (
        "q_proj", (5, 3), True, 5.0)
    # -0.0 is not 0.0: a sign bit in vLLM K3's zero padding rows is caught
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    name = PRE + "in_proj_qkvgfab.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][1679, 0] = -0.0
    [failure] = kda_tp.audit.audit(tensors, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").failures
    assert failure.differences[0].equals == (
        "non-zero padding: rows 1667..1679 must be zero, row 1679 is not")


def test_a_cast_that_overflows_never_passes():
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    fixed = {"A_log", "dt_bias", "conv1d.weight"}
    with np.errstate(over="ignore"):
        f16 = {k: v if k.removeprefix(PRE) in fixed else v.astype(np.float16)
               for k, v in tensors.items()}
        # o_proj's columns hold 110000 + j: every rank's slice is inf in F16
        f16_rank0 = rank_params(ckpt, "vllm-0.33-k3", 0, 4)[PRE + "o_proj.weight"].astype(
            np.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's RuntimeWarning does not leak
        for o_proj in (f16[PRE + "o_proj.weight"], f16_rank0):
            report = kda_tp.audit.audit({**f16, PRE + "o_proj.weight": o_proj}, ckpt, tp_rank=1,
                                        tp_size=4, model_dtype="F16")
            assert not report.passed
            by_name = {p.name.removeprefix(PRE): p for p in report.failures}
            assert sorted(by_name) == ["in_proj_qkvgfab.weight", "o_proj.weight"]
            assert by_name["o_proj.weight"].problem == (
                "the cast from F32 to F16 overflows: o_proj's 110384.0 (its [0, 0]) becomes "
                "inf, as do 24576 of its 24576 values; F16 cannot hold this checkpoint's "
                "weights, and the bytes cannot tell which slice was loaded")
            assert by_name["in_proj_qkvgfab.weight"].problem.startswith(
                "the cast from F32 to F16 overflows: b_proj's 80003.0 (its [0, 0]) becomes inf")


def test_wrong_world_size(tmp_path, capsys):
    out, ckpt, tp = sharded_state(tmp_path, "vllm_k3_tp4_r1")  # no header metadata
    status, text, _ = run(capsys, "audit", ckpt, out, "--tp-size", 6, "--quiet", "--dtype", "F32")
    assert status == 1
    # rank 0's dt_bias: head offset 0 = channel offset 0, so no head-offset diagnosis
    assert f"rank 0 {PRE}dt_bias: shape [384], expected [256]\n" in text
    assert "head offset" not in text
    # the fixture file's metadata says tp_size 4 and tp_rank 1: said first, refused
    path = DATA / "vllm_k3_tp4_r1.safetensors"
    status, _, err = run(capsys, "audit", ckpt, path, "--tp-size", 6, "--dtype", "F32")
    assert status == 2 and err.strip() == (
        f"kda-tp: error: PlanError: {path}: the dump's metadata says tp_size 4; pass "
        "--tp-size 4 (tp_size=), not 6")
    status, _, err = run(capsys, "audit", ckpt, path, "--tp-size", 4, "--rank", 2, "--dtype", "F32")
    assert status == 2 and err.strip() == (
        f"kda-tp: error: PlanError: {path}: the dump's metadata says tp_rank 1, --rank "
        "(rank=) says rank 2; pass --rank 1 (rank=)")


def test_the_world_size_comes_from_the_dump(tmp_path, capsys):
    # Without --tp-size, the dump's metadata (else its file names) tell it
    path = DATA / "vllm_k3_tp4_r1.safetensors"  # tp_size 4 in its metadata
    status, out, _ = run(capsys, "audit", CKPT["k3"], path, "--dtype", "F32")
    assert status == 0 and "exact on rank 1 of 4 (vllm-0.33-k3)" in out
    out_dir, ckpt, _ = sharded_state(tmp_path, "vllm_k3_tp4_r1")  # no metadata: the names
    report = audit_path(ckpt, out_dir, model_dtype="F32")
    assert report.passed and report.tp_size == 4 and report.ranks == (0, 1, 2, 3)
    # one file without metadata does not tell it
    lone = tmp_path / "rank.safetensors"
    save_file(load(path)[1], str(lone))
    status, _, err = run(capsys, "audit", ckpt, lone, "--rank", 1, "--dtype", "F32")
    assert status == 2 and err.strip() == (
        f"kda-tp: error: PlanError: {lone}: the dump does not say its world size (no tp_size "
        "metadata, one rank's file); pass --tp-size (tp_size=)")


@pytest.mark.parametrize("tp_size", [2, 3, 8])
def test_one_wrong_world_size_one_error_class(tmp_path, capsys, tp_size):
    # A --tp-size the dump contradicts is a PlanError whatever the size (8 does
    # not divide the 12 heads; 2 is below the ranks the files name; 3 divides them)
    out_dir, ckpt, _ = sharded_state(tmp_path, "vllm_kimi_linear_tp4_r2")
    with pytest.raises(PlanError):
        audit_path(ckpt, out_dir, tp_size=tp_size, model_dtype="F32")
    status, _, err = run(capsys, "audit", ckpt, out_dir, "--tp-size", tp_size, "--dtype", "F32")
    assert status == 2 and err.startswith("kda-tp: error: PlanError: ")


def test_a_single_part_parameter_holding_another_tensor(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    # g_a_proj [128, 64] given f_a_proj's rows (the last 128 of in_proj_qkvgfab)
    tensors[PRE + "g_a_proj.weight"] = tensors[PRE + "in_proj_qkvgfab.weight"][-128:].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_kimi_linear_tp4_r2", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert diff["equals"] == "this rank's slice of f_a_proj: the wrong tensor was loaded"


def test_an_empty_parameter_is_a_shape_problem_only(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    tensors[PRE + "o_norm.weight"] = np.zeros(0, np.float32)
    status, out, doc = audit_file(tmp_path, capsys, "vllm_kimi_linear_tp4_r2", tensors)
    failure = only_failure(doc)
    assert status == 1 and failure["problem"] == "shape [0], expected [128]"
    assert failure["equals"] is None and failure["differences"] == []


def test_malformed_input_raises_named_errors(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    # a header tp_rank that str.isdigit() accepts and int() refuses
    path = tmp_path / "rank.safetensors"
    save_file(tensors, path, metadata={"tp_rank": "²"})
    status, _, err = run(capsys, "audit", ckpt, path, "--tp-size", 4, "--dtype", "F32")
    assert status == 2 and err.strip() == (
        f"kda-tp: error: CheckpointError: {path}: its metadata's tp_rank '²' is not a rank "
        "(0, 1, ...); pass --rank (rank=)")
    short = kda_tp.Tensor(PRE + "A_log", "F32", (3,), np.zeros(8, np.uint8))
    with pytest.raises(ShapeMismatchError, match=re.escape(
            f"{PRE}A_log: a kda_tp.Tensor of shape [3] x F32 needs 12 bytes of data, it has "
            "8 bytes")):
        kda_tp.audit.audit({**tensors, PRE + "A_log": short}, ckpt, tp_rank=1, tp_size=4,
                           model_dtype="F32")
    with pytest.raises(CheckpointError, match=re.escape(
            "state_dict: the key 5 (int) is not a parameter name (a str)")):
        kda_tp.audit.audit({**tensors, 5: np.zeros(3)}, ckpt, tp_rank=1, tp_size=4,
                           model_dtype="F32")
    with pytest.raises(PlanError, match="tp_rank must be an integer >= 0, got True"):
        kda_tp.audit.audit(tensors, ckpt, tp_rank=True, tp_size=4, model_dtype="F32")
    with pytest.raises(PlanError, match="tp_size must be an integer >= 1, got 4.0"):
        kda_tp.audit.audit(tensors, ckpt, tp_rank=1, tp_size=4.0, model_dtype="F32")
    assert kda_tp.audit.audit(tensors, ckpt, tp_rank=np.int64(1), tp_size=4,
                              model_dtype="F32").passed


def test_a_rank_without_kda_parameters_is_all_missing(tmp_path, capsys):
    out, ckpt, tp = sharded_state(tmp_path, "vllm_k3_tp4_r1")
    other = {"model.embed_tokens.weight": np.zeros((16, 64), np.float32)}
    save_file(other, out / "model-rank-2-part-0.safetensors")
    status, text, _ = run(capsys, "audit", ckpt, out, "--tp-size", 4, "--quiet", "--dtype", "F32")
    assert status == 1
    lines = text.splitlines()
    assert lines[0] == (f"rank 2 {PRE}in_proj_qkvgfab.weight: missing: vllm-0.33-k3 holds "
                        "in_proj_qkvgfab.weight [1680, 64] here")
    assert [line.split()[1] for line in lines[:-1]] == ["2"] * 7
    assert lines[-1] == ("FAIL: 7 KDA parameter(s) wrong; 21 of 28 KDA parameters exact on "
                         "ranks 0, 1, 2, 3 of 4 (vllm-0.33-k3); 4 other parameters ignored")
    for r in range(4):  # no rank has one: not a dump of this model
        save_file(other, out / f"model-rank-{r}-part-0.safetensors")
    status, _, err = run(capsys, "audit", ckpt, out, "--tp-size", 4, "--dtype", "F32")
    assert status == 2 and "no KDA parameter of the checkpoint's KDA layers [0]" in err


def test_a_dump_against_the_checkpoint_of_another_model(capsys):
    glm = CKPT["glm"]
    path = DATA / "vllm_kimi_linear_tp4_r2.safetensors"
    status, _, err = run(capsys, "audit", glm, path, "--tp-size", 4, "--dtype", "F32")
    assert status == 2 and err.strip() == (
        f"kda-tp: error: EngineLayoutError: {path}: these names are vllm-0.33-kimi-linear's; "
        f"is {glm} the checkpoint this dump was loaded from? its config is GLM-5.3-Flash; "
        f"{path}: the dump's metadata says model 'kimi_linear'; the checkpoint's config is "
        "GLM-5.3-Flash")
    # SGLang holds Kimi-Linear and GLM under the same names (and the fixtures' values agree):
    # the metadata's model is what tells
    path = DATA / "sglang_kimi_linear_tp4_r2.safetensors"
    status, text, _ = run(capsys, "audit", glm, path, "--tp-size", 4, "--dtype", "F32")
    assert status == 1
    assert text.splitlines()[0] == (f"{path}: the dump's metadata says model 'kimi_linear'; "
                                    "the checkpoint's config is GLM-5.3-Flash")
    # names that a layout of the checkpoint's family holds only in part (here with g_a and g_b
    # missing), but another family's layout holds whole: named first, in the report
    meta, tensors, _ = fixture("vllm_k3_tp4_r1")
    report = kda_tp.audit.audit(tensors, CKPT["kimi_linear"], tp_rank=1, tp_size=4,
                                model_dtype="F32")
    assert not report.passed and report.problems == [
        f"state_dict: these names are vllm-0.33-k3's; is {CKPT['kimi_linear']} the checkpoint "
        "this dump was loaded from? its config is Kimi-Linear"]
    assert report.format().splitlines()[0] == report.problems[0]
