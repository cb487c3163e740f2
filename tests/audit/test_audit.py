"""kda_tp.audit (kda_tp.audit.auditor) and `kda-tp audit`: the vLLM and SGLang fixture dumps pass,
each bug class made by editing one fails with the parameter named and what it equals instead, a
sharded_state directory passes only with every rank, and random geometries built from the
engine tables pass while a part taken from a wrong rank is caught."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

import kda_tp
from kda_tp import EngineLayoutError, SafetensorsSource
from kda_tp.audit import audit_path, sharded_state_files
from kda_tp.engines import LAYOUTS
from kda_tp.errors import CheckpointError, PlanError

from audit_helpers import fixture, run, sharded_state
from paths import ENGINE_RANKS as DATA
from tp_fixtures import CKPT, DUMPS, PRE, load  # the engine_ranks fixtures


# ------------------------------------------------------------------------------------------
# The fixture dumps, as vLLM 0.33.0 and SGLang 0.5.23 loaded them


@pytest.mark.parametrize("path", DUMPS, ids=lambda p: p.stem)
def test_every_fixture_dump_passes(path, capsys):
    meta, tensors = load(path)
    ckpt = CKPT[meta["model"]]
    rank, tp_size = int(meta["tp_rank"]), int(meta["tp_size"])
    report = kda_tp.audit.audit(tensors, ckpt, tp_rank=rank, tp_size=tp_size, model_dtype="F32")
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
        report = kda_tp.audit.audit(tensors, CKPT[meta["model"]], tp_rank=int(meta["tp_rank"]),
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
        report = kda_tp.audit.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="F32")
        assert report.passed and report.ignored == 3 and len(report.params) == 7
        assert report.params[0].name.startswith("language_model.model.layers.0.self_attn.")


def test_an_engine_kda_layer_the_checkpoint_does_not_describe_is_wrong(tmp_path, capsys):
    # The engine holds a second KDA layer (never loaded from this checkpoint, which
    # lists one): not "other parameters ignored"
    meta, tensors, ckpt = fixture("vllm_k3_tp4_r1")
    extra = {**tensors, **{k.replace("layers.0.", "layers.1.", 1): np.zeros_like(v)
                           for k, v in tensors.items()}}
    report = kda_tp.audit.audit(extra, ckpt, tp_rank=1, tp_size=4, model_dtype="F32")
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
    assert kda_tp.audit.audit(mla, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed


def test_two_names_for_one_parameter_are_refused():
    # `layers.0` and `layers.00` are one (layer, parameter): never "the last wins"
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    bad = {**tensors, PRE.replace(".0.", ".00.") + "A_log": np.zeros_like(tensors[PRE + "A_log"])}
    with pytest.raises(CheckpointError) as caught:
        kda_tp.audit.audit(bad, ckpt, tp_rank=2, tp_size=4, model_dtype="F32")
    assert str(caught.value) == (
        f"state_dict: {PRE}A_log and model.layers.00.self_attn.A_log name one parameter (layer "
        "0, A_log); an engine holds each parameter once: which one did it load? pass a state "
        "dict with one name per parameter")


def test_a_rank_audit_builds_that_ranks_view_only(monkeypatch):
    # Auditing rank 3 plans rank 3 only (the guard on rank r builds rank r's view)
    meta, tensors, ckpt = fixture("vllm_glm_tp4_r3")
    module = sys.modules["kda_tp.audit.auditor"]
    built = []
    real = module.KdaTpPlan.from_description

    def counting(description, rank, tp_size, **kw):
        built.append(rank)
        return real(description, rank, tp_size, **kw)

    monkeypatch.setattr(module.KdaTpPlan, "from_description", counting)
    assert kda_tp.audit.audit(tensors, ckpt, tp_rank=3, tp_size=4, model_dtype="F32").passed
    assert built == [3]


def test_torch_state_dict():
    torch = pytest.importorskip("torch")
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    assert kda_tp.audit.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed
    # dict(model.named_parameters()): Parameters (engines subclass them)
    params = {k: torch.nn.Parameter(v, requires_grad=False) for k, v in state.items()}
    assert kda_tp.audit.audit(params, ckpt, tp_rank=1, tp_size=4, model_dtype="F32").passed
    # BF16 parameters: the expected F32 values are cast to BF16 the way the engine casts
    state = {k: (v if k.endswith(("A_log", "dt_bias", "conv1d.weight")) else v.bfloat16())
             for k, v in state.items()}
    report = kda_tp.audit.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert report.passed, report.format()
    state[PRE + "A_log"] = state[PRE + "A_log"].bfloat16()
    [bad] = kda_tp.audit.audit(state, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16").failures
    assert bad.problem == "dtype BF16, expected F32 (sglang-0.5.23-k3 holds it in F32)"


def test_f16_held_by_a_bf16_engine_is_wrong():
    # The model dtype is the engine's (its --dtype, else its default for the
    # config), never inferred from the parameters: F16 weights in a BF16 engine are a lossy
    # cast, wrong even where every value fits
    ml_dtypes = pytest.importorskip("ml_dtypes")
    meta, tensors, ckpt = fixture("sglang_k3_tp4_r1")
    fixed = ("A_log", "dt_bias", "conv1d.weight")
    f16 = {k: v if k.endswith(fixed) else (v / 4).astype(np.float16) for k, v in tensors.items()}
    report = kda_tp.audit.audit(f16, ckpt, tp_rank=1, tp_size=4, model_dtype="BF16")
    assert not report.passed and len(report.failures) == 6
    assert report.failures[0].problem == (
        "dtype F16, expected BF16 (the engine's model dtype, as passed: an engine casts these "
        "parameters to its model dtype; pass the dtype it ran in as --dtype (model_dtype=) if "
        "it is another)")
    # SGLang's default for this F32, dtype-less config is F16 (its auto rule): the dtype is
    # right, the values are then compared (and these are not the checkpoint's)
    failures = kda_tp.audit.audit(f16, ckpt, tp_rank=1, tp_size=4).failures
    assert len(failures) == 6 and not any(p.problem.startswith("dtype") for p in failures)
    bf16 = {k: v if k.endswith(fixed) else v.astype(ml_dtypes.bfloat16) for k, v in tensors.items()}
    assert kda_tp.audit.audit(bf16, ckpt, tp_rank=1, tp_size=4, model_dtype="bfloat16").passed
    with pytest.raises(kda_tp.DtypeMismatchError, match="model_dtype 'INT8' is not a model dtype"):
        kda_tp.audit.audit(bf16, ckpt, tp_rank=1, tp_size=4, model_dtype="INT8")


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
    from kda_tp.engines import engine_model_dtype

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    save_file({"w": np.zeros(2, np.float32)}, str(ckpt / "model.safetensors"))
    (ckpt / "config.json").write_text(json.dumps(config))
    source = SafetensorsSource(ckpt)
    assert engine_model_dtype(kda_tp.describe(source), "vllm") == vllm
    assert engine_model_dtype(kda_tp.describe(source), "sglang") == sglang
    assert engine_model_dtype(kda_tp.describe(source), "vllm", "float32") == "F32"
    if not config:  # vLLM reads a dtype-less config's dtype from its tensors
        save_file({"w": np.zeros(2, np.float16)}, str(ckpt / "model.safetensors"))
        f16 = SafetensorsSource(ckpt)
        assert engine_model_dtype(kda_tp.describe(f16), "vllm") == "F16"


def test_bf16_dump_compared_after_the_engines_cast():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    meta, tensors, ckpt = fixture("vllm_kimi_linear_tp4_r2")
    fixed = {"A_log", "dt_bias", "conv1d.weight"}  # F32 in every vLLM layout
    cast = {k: v if k.removeprefix(PRE) in fixed else v.astype(ml_dtypes.bfloat16)
            for k, v in tensors.items()}
    # vLLM's model dtype for a checkpoint whose config names none and whose tensors are F32:
    # its auto rule turns F32 into BF16
    assert kda_tp.audit.audit(cast, ckpt, tp_rank=2, tp_size=4).passed

# ------------------------------------------------------------------------------------------
# sharded_state directories


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


def _lone(tmp_path):
    """One rank's dump file without a rank in its name or metadata."""
    lone = tmp_path / "rank.safetensors"
    save_file(load(DATA / "vllm_k3_tp4_r1.safetensors")[1], lone)
    return lone


@pytest.mark.parametrize("dump, args, needles", [
    ("out", ("--tp-size", 2), ["holds the files of ranks [0, 1, 2, 3], but tp_size is 2"]),
    ("no dump", ("--tp-size", 4), ["no sharded_state file"]),
    ("out", ("--tp-size", 4, "--rank", 4),
     ["rank 4 is out of range for --tp-size 4: valid ranks are 0..3"]),
    # a layout of another family, forced
    ("out", ("--tp-size", 4, "--engine", "sglang-0.5.23-glm-5.3"), ["EngineLayoutError", "g_proj"]),
    ("out", ("--tp-size", 4, "--engine", "vllm-9"), ["no engine layout 'vllm-9'"]),
    # one file without a rank in its name or metadata
    ("lone", ("--tp-size", 4), ["pass --rank"]),
], ids=["tp-size", "no-dump", "rank", "engine-of-another-family", "unknown-engine", "no-rank"])
def test_refused_inputs_exit_2(tmp_path, capsys, dump, args, needles):
    out, ckpt, tp = sharded_state(tmp_path, "vllm_k3_tp4_r1")
    where = {"out": out, "no dump": tmp_path, "lone": _lone(tmp_path)}[dump]
    status, _, err = run(capsys, "audit", ckpt, where, *args, "--dtype", "F32")
    assert status == 2 and all(needle in err for needle in needles), err


@pytest.mark.parametrize("case", ["a dump as the checkpoint", "not a dump of this model",
                                  "tp_size 5"])
def test_refused_audit_inputs_raise(tmp_path, case):
    _, _, ckpt = fixture("vllm_k3_tp4_r1")
    lone = _lone(tmp_path)
    if case == "a dump as the checkpoint":  # a checkpoint without its config.json
        with pytest.raises(CheckpointError, match="config"):
            kda_tp.audit.audit(load(lone)[1], lone, tp_rank=1, tp_size=4, model_dtype="F32")
    elif case == "not a dump of this model":
        with pytest.raises(CheckpointError, match="no KDA parameter"):
            kda_tp.audit.audit({"lm_head.weight": np.zeros(2)}, ckpt, tp_rank=0, tp_size=4,
                               model_dtype="F32")
    else:
        with pytest.raises(PlanError):
            kda_tp.audit.audit(load(lone)[1], ckpt, tp_rank=0, tp_size=5, model_dtype="F32")


def test_names_no_layout_or_several_layouts_fit(monkeypatch):
    meta, tensors, ckpt = fixture("sglang_kimi_linear_tp4_r2")
    # SGLang's Kimi-Linear names against a Kimi K3 checkpoint: the layouts of another family
    # have them, so the checkpoint is the wrong one
    with pytest.raises(EngineLayoutError) as caught:
        kda_tp.audit.audit(tensors, CKPT["k3"], tp_rank=2, tp_size=4, model_dtype="F32")
    assert str(caught.value) == (
        "state_dict: these names are sglang-0.5.23-kimi-linear or sglang-0.5.23-glm-5.3's; is "
        f"{CKPT['k3']} the checkpoint this dump was loaded from? its config is Kimi K3")
    # names of two engines mixed: no layout of any family has them
    mixed = {**tensors, PRE + "in_proj_qkvgfab.weight": np.zeros(3, np.float32)}
    with pytest.raises(EngineLayoutError, match="no kimi-k3 engine layout has the parameter "
                       r"names \['A_log', 'dt_bias', 'fused_fg_b_proj.weight'"):
        kda_tp.audit.audit(mixed, CKPT["k3"], tp_rank=2, tp_size=4, model_dtype="F32")
    # With the model family known, no two tables of this release tie on any set of names;
    # were a new table to, the refusal names both.
    module = sys.modules["kda_tp.audit.auditor"]
    monkeypatch.setattr(module, "recognise", lambda names, family: [
        LAYOUTS["sglang-0.5.23-kimi-linear"], LAYOUTS["sglang-0.5.23-kimi-linear-unfused"]])
    with pytest.raises(EngineLayoutError, match="fit several engine layouts: "
                       "sglang-0.5.23-kimi-linear, sglang-0.5.23-kimi-linear-unfused; pass "
                       r"--engine \(engine=\)"):
        kda_tp.audit.audit(tensors, ckpt, tp_rank=2, tp_size=4, model_dtype="F32")
    assert kda_tp.audit.audit(tensors, ckpt, tp_rank=2, tp_size=4,
                              engine="sglang-0.5.23-kimi-linear", model_dtype="F32").passed
    # forcing the unfused layout: its parameters are missing, the fused ones ignored
    report = kda_tp.audit.audit(tensors, ckpt, tp_rank=2, tp_size=4,
                                engine="sglang-0.5.23-kimi-linear-unfused", model_dtype="F32")
    assert report.ignored == 2
    assert {p.name.removeprefix(PRE) for p in report.failures if p.status == "missing"} == {
        "qkv_proj.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight",
        "g_a_proj.weight", "g_b_proj.weight"}
