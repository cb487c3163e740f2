"""kda_tp.audit (kda_tp.engine_audit) and `kda-tp audit` (issue 16): the vLLM and SGLang fixture dumps pass, each bug
class made by editing one fails with the parameter named and what it equals instead, a
sharded_state directory passes only with every rank, and random geometries built from the
engine tables pass while a part taken from a wrong rank is caught."""

from __future__ import annotations

import json
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
from safetensors import safe_open
from safetensors.numpy import save_file

import kda_tp
from kda_tp import EngineLayoutError, KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.engine_audit import audit_path, sharded_state_files
from kda_tp.cli import main
from kda_tp.engines import LAYOUTS, get_layout
from kda_tp.errors import CheckpointError, PlanError, ShapeMismatchError
from kda_tp.synth import write_small_checkpoint

from paths import ENGINE_RANKS as DATA
from tp_fixtures import CKPT, DUMPS, PRE, load  # the engine_ranks fixtures


def fixture(stem: str) -> tuple[dict[str, str], dict[str, np.ndarray], Path]:
    meta, tensors = load(DATA / f"{stem}.safetensors")
    return meta, tensors, CKPT[meta["model"]]


def run(capsys, *args: object) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def rank_params(checkpoint: Path, layout: str, rank: int, tp_size: int,
                prefix: str = PRE) -> dict[str, np.ndarray]:
    """Every KDA parameter of layer 0 of ``rank`` as ``layout`` holds it, built by the engines'
    build API (what the engine's loader leaves in them)."""
    source = SafetensorsSource(checkpoint)
    shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=1))
    lay = get_layout(layout)
    return {prefix + p.suffix: shard.build_param(lay, p.suffix, 0)
            for p in lay.params_for(shard.plan)}


# ------------------------------------------------------------------------------------------
# The fixture dumps, as vLLM 0.33.0 and SGLang 0.5.23 loaded them


@pytest.mark.parametrize("path", DUMPS, ids=lambda p: p.stem)
def test_every_fixture_dump_passes(path, capsys):
    meta, tensors = load(path)
    ckpt = CKPT[meta["model"]]
    rank, tp_size = int(meta["tp_rank"]), int(meta["tp_size"])
    report = kda_tp.audit(tensors, ckpt, tp_rank=rank, tp_size=tp_size, model_dtype="F32")
    assert report.passed, report.format()
    assert report.ranks == (rank,) and len(report.params) == len(tensors)
    assert all(p.status == "exact" for p in report.params)
    status, out, err = run(capsys, "audit", ckpt, path, "--tp-size", tp_size, "--rank", rank,
                           "--dtype", "F32")
    assert status == 0, out + err
    assert out.startswith(f"OK: {len(tensors)} of {len(tensors)} KDA parameters exact on rank "
                          f"{rank} of {tp_size} ({report.engine})")
    # the rank is also read from the file's tp_rank metadata
    assert run(capsys, "audit", ckpt, path, "--tp-size", tp_size, "--dtype", "F32")[0] == 0


def test_engine_recognised_per_fixture():
    engines = {}
    for path in DUMPS:
        meta, tensors = load(path)
        report = kda_tp.audit(tensors, CKPT[meta["model"]], tp_rank=int(meta["tp_rank"]),
                              tp_size=int(meta["tp_size"]), model_dtype="F32")
        engines[path.stem] = report.engine
    assert engines == {
        "sglang_glm_tp4_r3": "sglang-0.5.23-glm-5.3", "sglang_k3_tp4_r1": "sglang-0.5.23-k3",
        "sglang_kimi_linear_tp4_r2": "sglang-0.5.23-kimi-linear",
        "vllm_glm_tp4_r3": "vllm-0.33-glm-5.3", "vllm_k3_tp4_r1": "vllm-0.33-k3",
        "vllm_kimi_linear_tp4_r2": "vllm-0.33-kimi-linear",
    }


def test_any_prefix_non_kda_counted_and_torch_free_inputs():
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    # a multimodal wrapper's prefix, plus non-KDA parameters (an MLA layer's self_attn, the
    # embedding, a vision tower's layer 0 with KDA-looking names)
    renamed = {k.replace("model.", "language_model.model.", 1): v for k, v in tensors.items()}
    renamed["language_model.model.embed_tokens.weight"] = np.zeros((4, 64), np.float32)
    renamed["language_model.model.layers.1.self_attn.o_proj.weight"] = np.zeros(3, np.float32)
    renamed["vision_tower.encoder.layers.0.self_attn.o_proj.weight"] = np.zeros(3, np.float32)
    records = {k: kda_tp.Tensor(k, "F32", v.shape, v.reshape(-1).view(np.uint8))
               for k, v in renamed.items()}
    for state in (renamed, records):
        report = kda_tp.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="F32")
        assert report.passed and report.ignored == 3 and len(report.params) == 7
        assert report.params[0].name.startswith("language_model.model.layers.0.self_attn.")


def test_an_engine_kda_layer_the_checkpoint_does_not_describe_is_wrong(tmp_path, capsys):
    # issue 27.3: the engine holds a second KDA layer (never loaded from this checkpoint, which
    # lists one): not "other parameters ignored"
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    extra = {**tensors, **{k.replace("layers.0.", "layers.1.", 1): np.zeros_like(v)
                           for k, v in tensors.items()}}
    report = kda_tp.audit(extra, ckpt, tp_rank=1, tp_size=4, model_dtype="F32")
    assert not report.passed and report.ignored == 0
    assert all(p.passed for p in report.params) and len(report.params) == 7
    [problem] = report.problems
    assert problem == (
        f"state_dict: layer 1 holds KDA parameters "
        f"({', '.join(sorted(n for n in extra if '.1.' in n))}) but the config of {ckpt} "
        "describes no KDA layer 1 (its KDA layers: [0]); is this the checkpoint the engine "
        "loaded?")
    assert report.summary().startswith("FAIL: 0 KDA parameter(s) wrong, 1 other problem(s);")
    path = tmp_path / "model-rank-1-part-0.safetensors"
    save_file(extra, str(path))
    status, out, _ = run(capsys, "audit", ckpt, path, "--tp-size", 4, "--dtype", "F32")
    assert status == 1 and "is this the checkpoint the engine loaded?" in out
    # a non-KDA layer's attention (no A_log/dt_bias) stays ignored
    mla = {**tensors, "model.layers.1.self_attn.o_proj.weight": np.zeros(3, np.float32)}
    assert kda_tp.audit(mla, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed


def test_two_names_for_one_parameter_are_refused():
    # issue 27.3: `layers.0` and `layers.00` are one (layer, parameter): never "the last wins"
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    bad = {**tensors, PRE.replace(".0.", ".00.") + "A_log": np.zeros_like(tensors[PRE + "A_log"])}
    with pytest.raises(CheckpointError) as caught:
        kda_tp.audit(bad, ckpt, tp_rank=2, tp_size=4, model_dtype="F32")
    assert str(caught.value) == (
        f"state_dict: {PRE}A_log and model.layers.00.self_attn.A_log name one parameter (layer "
        "0, A_log); an engine holds each parameter once: which one did it load? pass a state "
        "dict with one name per parameter")


def test_a_rank_audit_builds_that_ranks_view_only(monkeypatch):
    # issue 25.4: auditing rank 3 plans rank 3 only (the guard on rank r builds rank r's view)
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    module = sys.modules["kda_tp.engine_audit"]
    built = []
    real = module.KdaTpPlan.from_config

    def counting(source, rank, tp_size, **kw):
        built.append(rank)
        return real(source, rank, tp_size, **kw)

    monkeypatch.setattr(module.KdaTpPlan, "from_config", counting)
    assert kda_tp.audit(tensors, ckpt, tp_rank=3, tp_size=4, model_dtype="F32").passed
    assert built == [3]


def test_torch_state_dict():
    torch = pytest.importorskip("torch")
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    assert kda_tp.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed
    # dict(model.named_parameters()): Parameters (engines subclass them)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in state.items()}
    assert kda_tp.audit(params, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed
    # BF16 parameters: the expected F32 values are cast to BF16 the way the engine casts
    state = {k: (v if k.endswith(("A_log", "dt_bias", "conv1d.weight")) else v.bfloat16())
             for k, v in state.items()}
    report = kda_tp.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert report.passed, report.format()
    state[PRE + "A_log"] = state[PRE + "A_log"].bfloat16()
    [bad] = kda_tp.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16").failures
    assert bad.problem == "dtype BF16, expected F32 (sglang-0.5.23-k3 holds it in F32)"


def test_f16_held_by_a_bf16_engine_is_wrong():
    # issue 27.4: the model dtype is the engine's (its --dtype, else its default for the
    # config), never inferred from the parameters: F16 weights in a BF16 engine are a lossy
    # cast, wrong even where every value fits
    ml_dtypes = pytest.importorskip("ml_dtypes")
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    fixed = ("A_log", "dt_bias", "conv1d.weight")
    f16 = {k: v if k.endswith(fixed) else (v / 4).astype(np.float16) for k, v in tensors.items()}
    report = kda_tp.audit(f16, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert not report.passed and len(report.failures) == 6
    assert report.failures[0].problem == (
        "dtype F16, expected BF16 (the engine's model dtype, as passed: an engine casts these "
        "parameters to its model dtype; pass the dtype it ran in as --dtype (model_dtype=) if "
        "it is another)")
    # SGLang's default for this F32, dtype-less config is F16 (its auto rule): the dtype is
    # right, the values are then compared (and these are not the checkpoint's)
    failures = kda_tp.audit(f16, ckpt, tp_rank=1, tp_size=4).failures
    assert len(failures) == 6 and not any(p.problem.startswith("dtype") for p in failures)
    bf16 = {k: v if k.endswith(fixed) else v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    assert kda_tp.audit(bf16, ckpt, tp_rank=1, tp_size=4, model_dtype="bfloat16").passed
    with pytest.raises(kda_tp.DtypeMismatchError, match="model_dtype 'INT8' is not a model dtype"):
        kda_tp.audit(bf16, ckpt, tp_rank=1, tp_size=4, model_dtype="INT8")


@pytest.mark.parametrize(("config", "vllm", "sglang"), [
    ({}, "BF16", "F16"),  # no dtype: F32 (vLLM: its tensors'), then each engine's auto rule
    ({"torch_dtype": "float32"}, "BF16", "F16"),
    ({"torch_dtype": "bfloat16"}, "BF16", "BF16"),
    ({"dtype": "float16"}, "F16", "F16"),
    # a wrapper: vLLM reads the top level first, SGLang its text config first
    ({"torch_dtype": "float16", "text_config": {"dtype": "bfloat16"}}, "F16", "BF16"),
    ({"text_config": {"torch_dtype": "bfloat16"}}, "BF16", "BF16"),
])
def test_the_engines_model_dtype_rule(tmp_path, config, vllm, sglang):
    from kda_tp.model_dtype import engine_model_dtype

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": np.zeros(2, np.float32)}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(config))
    source = SafetensorsSource(ckpt)
    assert engine_model_dtype(source, "vllm") == vllm
    assert engine_model_dtype(source, "sglang") == sglang
    assert engine_model_dtype(source, "vllm", "float32") == "F32"
    if not config:  # vLLM reads a dtype-less config's dtype from its tensors
        save_file({"w": np.zeros(2, np.float16)}, str(ckpt / "model.safetensors"))
        assert engine_model_dtype(SafetensorsSource(ckpt), "vllm") == "F16"


def test_bf16_dump_compared_after_the_engines_cast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    fixed = {"A_log", "dt_bias", "conv1d.weight"}  # F32 in every vLLM layout
    cast = {k: v if k.removeprefix(PRE) in fixed else v.astype(ml_dtypes.bfloat16)
            for k, v in tensors.items()}
    # vLLM's model dtype for a checkpoint whose config names none and whose tensors are F32:
    # its auto rule turns F32 into BF16 (issue 27.4)
    assert kda_tp.audit(cast, ckpt, tp_rank=2, tp_size=4).passed


# ------------------------------------------------------------------------------------------
# Bug classes, each made by editing a fixture dump: exit 1, the parameter and what it equals


def audit_file(tmp_path, capsys, stem: str, tensors: dict[str, np.ndarray], *extra: object
               ) -> tuple[int, str, dict]:
    """Save an edited dump as rank file and run `kda-tp audit` on it (text, then --json)."""
    meta, _, ckpt = fixture(stem)
    path = tmp_path / f"model-rank-{meta['tp_rank']}-part-0.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
    status, out, _ = run(capsys, "audit", ckpt, path, "--tp-size", meta["tp_size"], *extra,
                         "--dtype", "F32")
    json_status, json_out, _ = run(capsys, "audit", ckpt, path, "--tp-size", meta["tp_size"],
                                   "--json", "--quiet", "--dtype", "F32")
    assert json_status == status
    return status, out, json.loads(json_out)


def only_failure(document: dict) -> dict:
    [failure] = [p for p in document["params"] if p["status"] != "exact"]
    return failure


def test_another_ranks_slice(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    rank0 = rank_params(ckpt, "vllm-0.33-glm-5.3", 0, 4)
    tensors[PRE + "o_proj.weight"] = rank0[PRE + "o_proj.weight"]
    status, out, doc = audit_file(tmp_path, capsys, "vllm_glm_tp4_r3", tensors)
    assert status == 1 and not doc["ok"]
    line = next(line for line in out.splitlines() if "o_proj" in line)
    assert line.startswith(f"rank 3 {PRE}o_proj.weight: values differ in o_proj")
    assert "equals rank 0's slice of o_proj" in line
    failure = only_failure(doc)
    assert failure["name"] == PRE + "o_proj.weight"
    [diff] = failure["differences"]
    # column j of o_proj holds 110000 + j: rank 3 starts at column 1152, rank 0 at 0
    assert diff == {"part": "o_proj", "index": [0, 0], "part_index": [0, 0],
                    "expected": 111152.0, "actual": 110000.0,
                    "equals": "rank 0's slice of o_proj", "untried": 0}
    assert out.splitlines()[-1].startswith("FAIL: 1 KDA parameter(s) wrong; 9 of 10")


def test_another_ranks_part_inside_a_fused_parameter(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    rank2 = rank_params(ckpt, "vllm-0.33-k3", 2, 4)
    name = PRE + "in_proj_qkvgfab.weight"
    w = tensors[name].copy()
    w[768:1152] = rank2[name][768:1152]  # v_proj's rows, from rank 2
    tensors[name] = w
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert (diff["part"], diff["index"], diff["equals"]) == (
        "v_proj", [768, 0], "rank 2's slice of v_proj")
    assert "part v_proj differs at [768, 0]" in out


def test_even_split_of_a_padded_a_log(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    full = SafetensorsSource(ckpt).get(PRE + "A_log").array  # 128 stored, 12 heads
    # the [h] parameter narrowed at rank x 128/4 = 32 instead of rank x 12/4 = 3
    tensors[PRE + "A_log"] = full[32:35].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    failure = only_failure(doc)
    assert failure["name"] == PRE + "A_log"
    # entries 32..34 are padding: zero, like a parameter never loaded; both are said
    assert failure["differences"][0]["equals"] == (
        "zeros (never loaded?), or the even split of the padded A_log: entries 32..34 of the "
        "128 stored (padding included, 32 per rank), instead of heads 3..5 of 12: both are "
        "all zero")
    # the even split by shape: 128/4 = 32 entries per rank
    tensors[PRE + "A_log"] = full[32:64].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    failure = only_failure(doc)
    assert status == 1 and failure["problem"] == "shape [32], expected [3]"
    assert failure["equals"].startswith(
        "zeros (never loaded?), or the even split of the padded A_log: entries 32..63")
    assert f"rank 1 {PRE}A_log: shape [32], expected [3]; equals zeros (never loaded?), or " \
           "the even split" in out
    # rank 0's even split holds real heads (entries 0..31: heads 0..11, then padding)
    tensors[PRE + "A_log"] = full[0:32].copy()
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert only_failure(doc)["equals"] is None  # not rank 1's even split: no diagnosis


def test_dt_bias_at_the_head_offset(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_kimi_linear_tp4_r2")
    full = SafetensorsSource(ckpt).get(PRE + "dt_bias").array
    tensors[PRE + "dt_bias"] = full[6 : 6 + 384].copy()  # rank 2 x 3 heads, not x 384 channels
    status, out, doc = audit_file(tmp_path, capsys, "sglang_kimi_linear_tp4_r2", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert diff["part"] == "dt_bias" and diff["index"] == [0]
    assert diff["equals"] == ("dt_bias[6:390]: sliced at the head offset rank x H/T = 6 "
                              "instead of the channel offset rank x C/T = 768")


def test_parts_in_another_order(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_glm_tp4_r3")
    name = PRE + "fused_qkvbfg_a_proj.weight"  # q, k, v (384 rows each), b (3), f_a, g_a (128)
    w = tensors[name]
    q, k, v, b, f_a, g_a = np.split(w, [384, 768, 1152, 1155, 1283])
    tensors[name] = np.concatenate([q, k, v, f_a, g_a, b])  # b last: the sizes differ
    status, out, doc = audit_file(tmp_path, capsys, "sglang_glm_tp4_r3", tensors)
    assert status == 1
    failure = only_failure(doc)
    assert failure["equals"] == ("its parts in another order: q_proj, k_proj, v_proj, f_a_proj, "
                                 "g_a_proj, b_proj (expected q_proj, k_proj, v_proj, b_proj, "
                                 "f_a_proj, g_a_proj)")
    assert [d["part"] for d in failure["differences"]] == ["b_proj", "f_a_proj", "g_a_proj"]
    # same-size parts swapped: each part says whose slice it holds
    tensors[name] = np.concatenate([k, q, v, b, f_a, g_a])
    status, out, doc = audit_file(tmp_path, capsys, "sglang_glm_tp4_r3", tensors)
    diffs = only_failure(doc)["differences"]
    assert [(d["part"], d["equals"]) for d in diffs] == [
        ("q_proj", "this rank's slice of k_proj: parts in another order"),
        ("k_proj", "this rank's slice of q_proj: parts in another order"),
    ]


def test_f_b_and_g_b_swapped(tmp_path, capsys):
    for stem, names in (("sglang_kimi_linear_tp4_r2", None),
                        ("vllm_kimi_linear_tp4_r2", ("f_b_proj.weight", "g_b_proj.weight"))):
        meta, tensors, ckpt = fixture(stem)
        if names is None:  # SGLang: stack(f_b, g_b)
            tensors[PRE + "fused_fg_b_proj.weight"] = tensors[PRE + "fused_fg_b_proj.weight"][::-1]
            wrong = [PRE + "fused_fg_b_proj.weight"]
        else:  # vLLM: two parameters
            f, g = (PRE + n for n in names)
            tensors[f], tensors[g] = tensors[g], tensors[f]
            wrong = [f, g]
        status, out, doc = audit_file(tmp_path, capsys, stem, tensors)
        assert status == 1
        failures = [p for p in doc["params"] if p["status"] != "exact"]
        assert [p["name"] for p in failures] == wrong
        equals = [d["equals"] for p in failures for d in p["differences"]]
        assert equals == ["this rank's slice of g_b_proj: f_b and g_b swapped",
                          "this rank's slice of f_b_proj: f_b and g_b swapped"]


def test_the_diagnosis_stops_at_its_budget_and_says_what_it_did_not_try(monkeypatch):
    # issue 27.5: the verdict (which part, where) comes whatever the budget; the diagnosis
    # compares candidates only while the budget lasts, and counts those it did not try
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    rank0 = rank_params(ckpt, "vllm-0.33-glm-5.3", 0, 4)
    tensors[PRE + "o_proj.weight"] = rank0[PRE + "o_proj.weight"]
    monkeypatch.setattr(sys.modules["kda_tp.audit_diagnosis"], "DIAGNOSIS_BUDGET", 0)
    [failure] = kda_tp.audit(tensors, ckpt, tp_rank=3, tp_size=4, model_dtype="F32").failures
    [diff] = failure.differences
    # rank 0's column slice of o_proj starts as the part does (its first row's columns, read
    # in place): only a gather of the whole slice could tell, which the budget does not pay
    # for; ranks 1 and 2's first elements already differ
    assert (diff.part, diff.index, diff.equals, diff.untried) == ("o_proj", (0, 0), None, 1)
    assert failure.format().endswith(
        "part o_proj differs at [0, 0] (its [0, 0]; expected 111152.0, got 110000.0) (1 "
        "candidate slice(s) not tried: the diagnosis budget is spent)")
    assert diff.to_dict()["untried"] == 1


def test_non_zero_padding_rows(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    name = PRE + "in_proj_qkvgfab.weight"
    w = tensors[name].copy()
    w[1670, 5] = 7.0  # rows 1667..1679 pad q,k,v,g,f_a,b to a multiple of 16
    tensors[name] = w
    status, out, doc = audit_file(tmp_path, capsys, "vllm_k3_tp4_r1", tensors)
    assert status == 1
    [diff] = only_failure(doc)["differences"]
    assert diff == {"part": "padding", "index": [1670, 5], "part_index": [3, 5],
                    "expected": 0.0, "actual": 7.0,
                    "equals": "non-zero padding: rows 1667..1679 must be zero, row 1670 is not",
                    "untried": 0}
    assert "part padding differs at [1670, 5]" in out


def test_missing_parameter_and_zeros(tmp_path, capsys):
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    del tensors[PRE + "f_b_proj.weight"]
    tensors[PRE + "dt_bias"] = np.zeros_like(tensors[PRE + "dt_bias"])
    status, out, doc = audit_file(tmp_path, capsys, "sglang_k3_tp4_r1", tensors)
    assert status == 1
    by_name = {p["name"]: p for p in doc["params"] if p["status"] != "exact"}
    assert by_name[PRE + "f_b_proj.weight"]["status"] == "missing"
    assert by_name[PRE + "f_b_proj.weight"]["problem"] == (
        "missing: sglang-0.5.23-k3 holds f_b_proj.weight [384, 128] here")
    assert by_name[PRE + "dt_bias"]["differences"][0]["equals"] == "zeros (never loaded?)"
    assert f"rank 1 {PRE}f_b_proj.weight: missing" in out


def test_a_value_that_matches_nothing_known(tmp_path, capsys):
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    a = tensors[PRE + "o_norm.weight"].copy()
    a[5] += 0.5
    tensors[PRE + "o_norm.weight"] = a
    status, out, doc = audit_file(tmp_path, capsys, "vllm_kimi_linear_tp4_r2", tensors)
    [diff] = only_failure(doc)["differences"]
    assert status == 1 and diff["index"] == [5] and diff["equals"] is None
    assert (diff["expected"], diff["actual"]) == (5.0, 5.5)


# ------------------------------------------------------------------------------------------
# sharded_state directories


def sharded_state(tmp_path: Path, stem: str, pattern: str = "model-rank-{r}-part-{p}",
                  parts: int = 1) -> tuple[Path, Path, int]:
    """A save_sharded_state directory: the fixture's rank as the engine loaded it, the other
    ranks built with the engines' build API, each rank split into ``parts`` files."""
    meta, tensors, ckpt = fixture(stem)
    tp_size, layout = int(meta["tp_size"]), kda_tp.audit(
        tensors, ckpt, tp_rank=int(meta["tp_rank"]), tp_size=int(meta["tp_size"]),
        model_dtype="F32").engine
    out = tmp_path / "dump"
    out.mkdir()
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    for r in range(tp_size):
        state = tensors if r == int(meta["tp_rank"]) else rank_params(ckpt, layout, r, tp_size)
        state = {**state, "model.embed_tokens.weight": np.zeros((16, 64), np.float32)}
        names = sorted(state)
        for p in range(parts):
            chunk = {n: np.ascontiguousarray(state[n]) for n in names[p::parts]}
            save_file(chunk, out / (pattern.format(r=r, p=p) + ".safetensors"))
    return out, ckpt, tp_size


@pytest.mark.parametrize("stem", ["vllm_k3_tp4_r1", "sglang_glm_tp4_r3"])
def test_sharded_state_directory_passes_only_with_every_rank(tmp_path, capsys, stem):
    out, ckpt, tp = sharded_state(tmp_path, stem, parts=2)
    assert sorted(sharded_state_files(out)) == [0, 1, 2, 3]
    status, text, err = run(capsys, "audit", ckpt, out, "--tp-size", tp, "--dtype", "F32")
    assert status == 0, text
    assert "on ranks 0, 1, 2, 3 of 4" in text and "4 other parameters ignored" in text
    assert "audit: " in err  # progress lines, as verify prints them
    report = audit_path(ckpt, out, tp_size=tp, model_dtype="F32")
    assert report.passed and report.ranks == (0, 1, 2, 3)
    # a rank missing: the others are audited, the whole does not pass
    for f in out.glob("model-rank-2-part-*.safetensors"):
        f.unlink()
    status, text, _ = run(capsys, "audit", ckpt, out, "--tp-size", tp, "--dtype", "F32")
    assert status == 1
    assert text.splitlines()[0] == (
        f"{out}: rank 2 of 4 is missing (no model-rank-2-part-*.safetensors or "
        "model-pp-*-tp-2-part-*.safetensors)")
    assert "ranks 0, 1, 3 of 4" in text.splitlines()[-1]
    status, text, _ = run(capsys, "audit", ckpt, out, "--tp-size", tp, "--json", "--dtype", "F32")
    doc = json.loads(text)
    assert status == 1 and not doc["ok"] and doc["ranks"] == [0, 1, 3]
    assert doc["problems"] and all(p["status"] == "exact" for p in doc["params"])
    # one rank of the directory
    assert run(capsys, "audit", ckpt, out, "--tp-size", tp, "--rank", 3, "--dtype", "F32")[0] == 0


def test_vllm_pipeline_stage_names(tmp_path, capsys):
    out, ckpt, tp = sharded_state(tmp_path, "vllm_kimi_linear_tp4_r2",
                                  pattern="model-pp-0-tp-{r}-part-{p}")
    assert run(capsys, "audit", ckpt, out, "--tp-size", tp, "--dtype", "F32")[0] == 0


def test_refused_inputs_exit_2(tmp_path, capsys):
    out, ckpt, tp = sharded_state(tmp_path, "vllm_k3_tp4_r1")
    status, _, err = run(capsys, "audit", ckpt, out, "--tp-size", 2, "--dtype", "F32")
    assert status == 2 and "holds the files of ranks [0, 1, 2, 3], but tp_size is 2" in err
    status, _, err = run(capsys, "audit", ckpt, tmp_path, "--tp-size", 4, "--dtype", "F32")
    assert status == 2 and "no sharded_state file" in err
    status, _, err = run(capsys, "audit", ckpt, out, "--tp-size", 4, "--rank", 4, "--dtype", "F32")
    assert status == 2 and "rank 4 is out of range for --tp-size 4: valid ranks are 0..3" in err
    # a layout of another family, forced
    status, _, err = run(capsys, "audit", ckpt, out, "--tp-size", 4,
                         "--engine", "sglang-0.5.23-glm-5.3", "--dtype", "F32")
    assert status == 2 and "EngineLayoutError" in err and "g_proj" in err
    status, _, err = run(capsys, "audit", ckpt, out, "--tp-size", 4, "--engine", "vllm-9",
                         "--dtype", "F32")
    assert status == 2 and "no engine layout 'vllm-9'" in err
    # one file without a rank in its name or metadata
    lone = tmp_path / "rank.safetensors"
    save_file(load(DATA / "vllm_k3_tp4_r1.safetensors")[1], lone)
    status, _, err = run(capsys, "audit", ckpt, lone, "--tp-size", 4, "--dtype", "F32")
    assert status == 2 and "pass --rank" in err
    # a checkpoint without its config.json (the dump file given in its place)
    with pytest.raises(CheckpointError, match="config"):
        kda_tp.audit(load(lone)[1], lone, tp_rank=1, tp_size=4, model_dtype="F32")
    # not a dump of this model
    with pytest.raises(CheckpointError, match="no KDA parameter"):
        kda_tp.audit({"lm_head.weight": np.zeros(2)}, ckpt, tp_rank=0, tp_size=4, model_dtype="F32")
    with pytest.raises(PlanError):
        kda_tp.audit(load(lone)[1], ckpt, tp_rank=0, tp_size=5, model_dtype="F32")


def test_names_no_layout_or_several_layouts_fit(monkeypatch):
    meta, tensors, ckpt = fixture("sglang_kimi_linear_tp4_r2")
    # SGLang's Kimi-Linear names against a Kimi K3 checkpoint: the layouts of another family
    # have them, so the checkpoint is the wrong one
    with pytest.raises(EngineLayoutError) as caught:
        kda_tp.audit(tensors, CKPT["k3"], tp_rank=2, tp_size=4, model_dtype="F32")
    assert str(caught.value) == (
        "state_dict: these names are sglang-0.5.23-kimi-linear or sglang-0.5.23-glm-5.3's; is "
        f"{CKPT['k3']} the checkpoint this dump was loaded from? its config is Kimi K3")
    # names of two engines mixed: no layout of any family has them
    mixed = {**tensors, PRE + "in_proj_qkvgfab.weight": np.zeros(3, np.float32)}
    with pytest.raises(EngineLayoutError, match="no kimi-k3 engine layout has the parameter "
                       r"names \['A_log', 'dt_bias', 'fused_fg_b_proj.weight'"):
        kda_tp.audit(mixed, CKPT["k3"], tp_rank=2, tp_size=4, model_dtype="F32")
    # With the model family known, no two tables of this release tie on any set of names;
    # were a new table to, the refusal names both.
    module = sys.modules["kda_tp.engine_audit"]
    monkeypatch.setattr(module, "recognise", lambda names, family: [
        LAYOUTS["sglang-0.5.23-kimi-linear"], LAYOUTS["sglang-0.5.23-kimi-linear-unfused"]])
    with pytest.raises(EngineLayoutError, match="fit several engine layouts: "
                       "sglang-0.5.23-kimi-linear, sglang-0.5.23-kimi-linear-unfused; pass "
                       r"--engine \(engine=\)"):
        kda_tp.audit(tensors, ckpt, tp_rank=2, tp_size=4, model_dtype="F32")
    assert kda_tp.audit(tensors, ckpt, tp_rank=2, tp_size=4,
                        engine="sglang-0.5.23-kimi-linear", model_dtype="F32").passed
    # forcing the unfused layout: its parameters are missing, the fused ones ignored
    report = kda_tp.audit(tensors, ckpt, tp_rank=2, tp_size=4,
                          engine="sglang-0.5.23-kimi-linear-unfused", model_dtype="F32")
    assert report.ignored == 2
    assert {p.name.removeprefix(PRE) for p in report.failures if p.status == "missing"} == {
        "qkv_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
        "g_a_proj.weight", "g_b_proj.weight"}


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
        params = {r: {(layer, p.suffix): shards[r].build_param(layout, p.suffix, layer,
                                                              model_dtype=model_dtype)
                      for layer in shards[r].layers for p in layout.params_for(shards[r].plan)}
                  for r in range(tp)}
        name = f"{prefix}layers.{{}}.self_attn.{{}}"
        state = {name.format(*key): value for key, value in params[rank].items()}
        state[f"{prefix}embed_tokens.weight"] = np.zeros(3, np.float32)
        report = kda_tp.audit(state, source, tp_rank=rank, tp_size=tp,
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
            plan = shards[rank].param_plan(layout, suffix, model_dtype=model_dtype)
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
        report = kda_tp.audit(state, source, tp_rank=rank, tp_size=tp,
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
    report = kda_tp.audit(state, ckpt, tp_rank=1, tp_size=2, model_dtype="F32")
    assert report.passed and report.engine == "vllm-0.33-k3", report.format()
    assert len(report.params) == 10  # 7 parameters, 3 scale grids (in_proj, f_b, o_proj)
    rank0 = rank_params(ckpt, "vllm-0.33-k3", 0, 2, prefix)
    scale = state[prefix + "in_proj_qkvgfab.weight_scale"].copy()
    scale[2:4] = rank0[prefix + "in_proj_qkvgfab.weight_scale"][2:4]  # k_proj's 2 block rows
    bad = {**state, prefix + "in_proj_qkvgfab.weight_scale": scale}
    [failure] = kda_tp.audit(bad, ckpt, tp_rank=1, tp_size=2, model_dtype="F32").failures
    [diff] = failure.differences
    assert (diff.part, diff.equals) == ("k_proj.scale", "rank 0's slice of k_proj.scale")
    del bad[prefix + "in_proj_qkvgfab.weight_scale"]
    [failure] = kda_tp.audit(bad, ckpt, tp_rank=1, tp_size=2, model_dtype="F32").failures
    assert failure.status == "missing" and failure.problem == (
        "missing: vllm-0.33-k3 holds in_proj_qkvgfab.weight_scale [10, 2] here")


def test_numpy_input_never_imports_torch():
    code = (
        "import sys, kda_tp\n"
        "from safetensors.numpy import load_file\n"
        f"t = load_file({str(DATA / 'vllm_k3_tp4_r1.safetensors')!r})\n"
        f"assert kda_tp.audit(t, {str(DATA / 'ckpt_k3')!r}, tp_rank=1, tp_size=4,\n"
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
    assert kda_tp.audit(tensors, ckpt, tp_rank=2, tp_size=4, model_dtype="F32").passed
    # a BF16 dump: ml_dtypes casts the NaN to 0x7FC0, torch to another pattern; any NaN matches
    fixed = {"A_log", "dt_bias", "conv1d.weight"}
    bf16 = {k: v if k.removeprefix(PRE) in fixed else v.astype(ml_dtypes.bfloat16)
            for k, v in tensors.items()}
    for bits in (0x7FC0, 0xFFC0, 0x7F81):
        bf16[name].view(np.uint16)[5, 3] = bits
        assert kda_tp.audit(bf16, ckpt, tp_rank=2, tp_size=4, model_dtype="BF16").passed, hex(bits)
    # a number where the checkpoint has NaN is still a difference
    bf16[name][5, 3] = 5.0
    [failure] = kda_tp.audit(bf16, ckpt, tp_rank=2, tp_size=4, model_dtype="BF16").failures
    [diff] = failure.differences
    assert (diff.part, diff.index, math.isnan(diff.expected), diff.actual) == (
        "q_proj", (5, 3), True, 5.0)
    # -0.0 is not 0.0: a sign bit in vLLM K3's zero padding rows is caught
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    name = PRE + "in_proj_qkvgfab.weight"
    tensors[name] = tensors[name].copy()
    tensors[name][1679, 0] = -0.0
    [failure] = kda_tp.audit(tensors, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").failures
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
            report = kda_tp.audit({**f16, PRE + "o_proj.weight": o_proj}, ckpt, tp_rank=1,
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
    # issue 27.7: without --tp-size, the dump's metadata (else its file names) tell it
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
    # issue 27.7: a --tp-size the dump contradicts is a PlanError whatever the size (8 does
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
        kda_tp.audit({**tensors, PRE + "A_log": short}, ckpt, tp_rank=1, tp_size=4,
                     model_dtype="F32")
    with pytest.raises(CheckpointError, match=re.escape(
            "state_dict: the key 5 (int) is not a parameter name (a str)")):
        kda_tp.audit({**tensors, 5: np.zeros(3)}, ckpt, tp_rank=1, tp_size=4, model_dtype="F32")
    with pytest.raises(PlanError, match="tp_rank must be an integer >= 0, got True"):
        kda_tp.audit(tensors, ckpt, tp_rank=True, tp_size=4, model_dtype="F32")
    with pytest.raises(PlanError, match="tp_size must be an integer >= 1, got 4.0"):
        kda_tp.audit(tensors, ckpt, tp_rank=1, tp_size=4.0, model_dtype="F32")
    assert kda_tp.audit(tensors, ckpt, tp_rank=np.int64(1), tp_size=4, model_dtype="F32").passed


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
    report = kda_tp.audit(tensors, CKPT["kimi_linear"], tp_rank=1, tp_size=4, model_dtype="F32")
    assert not report.passed and report.problems == [
        f"state_dict: these names are vllm-0.33-k3's; is {CKPT['kimi_linear']} the checkpoint "
        "this dump was loaded from? its config is Kimi-Linear"]
    assert report.format().splitlines()[0] == report.problems[0]
