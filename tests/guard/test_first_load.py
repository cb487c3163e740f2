"""kda_tp.guard, with no engine: the fixture ranks vLLM 0.33.0 and SGLang 0.5.23
loaded pass with one log line; a rank holding another rank's slices stops with GuardError naming
the parameter and the slice; the modes (KDA_TP_GUARD) fail, warn, off; non-KDA parameters, a
non-KDA config and a remote checkpoint are skipped; vLLM K3's derived decode copies are
checked."""

from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from kda_tp import GuardError, KdaShardedSource, KdaTpError, KdaTpPlan, SafetensorsSource
from kda_tp.engines import build_param, get_layout
from kda_tp.errors import GuardModeError, GuardWarning
from kda_tp.guard import MODE_ENV, GuardResult, check, mode

from tp_fixtures import CKPT, DUMPS, PRE, load  # the engine_ranks fixtures


def built(checkpoint: Path, layout: str, rank: int, tp_size: int) -> dict[str, np.ndarray]:
    """Layer 0's KDA parameters of ``rank`` as ``layout`` holds them (the build API)."""
    source = SafetensorsSource(checkpoint)
    shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=1))
    lay = get_layout(layout)
    return {PRE + p.suffix: build_param(shard, lay, p.suffix, 0)
            for p in lay.params_for(shard.plan)}


@pytest.fixture(autouse=True)
def _default_mode(monkeypatch):
    monkeypatch.delenv(MODE_ENV, raising=False)


@pytest.mark.parametrize("path", DUMPS, ids=lambda p: p.stem)
def test_every_engine_fixture_rank_passes_with_one_log_line(path, caplog, guard_log):
    meta, tensors = load(path)
    rank, tp_size = int(meta["tp_rank"]), int(meta["tp_size"])
    with guard_log:
        result = check(tensors, CKPT[meta["model"]], tp_rank=rank, tp_size=tp_size,
                       where="test worker", model_dtype="F32")
    assert isinstance(result, GuardResult) and result.passed
    assert (result.tp_rank, result.tp_size) == (rank, tp_size)
    assert result.engine.startswith(meta["engine"] + "-")
    assert result.params == len(tensors)
    assert result.bytes == sum(t.nbytes for t in tensors.values())
    assert [r.getMessage() for r in caplog.records] == [result.line()]
    assert result.line() == (
        f"kda_tp guard: test worker: tp rank {rank}/{tp_size}: {len(tensors)} KDA parameters "
        f"({result.engine}), {result.bytes} bytes, {result.seconds:.3f} s: OK")


def test_every_rank_of_every_layout_built_passes_and_pairs_are_accepted():
    for layout, ckpt in (("vllm-0.33-k3", "k3"), ("vllm-0.33-kimi-linear", "kimi_linear"),
                         ("vllm-0.33-glm-5.3", "glm")):
        for tp_size in (2, 4):
            for rank in range(tp_size):
                params = built(CKPT[ckpt], layout, rank, tp_size)
                result = check(iter(params.items()), CKPT[ckpt], tp_rank=rank, tp_size=tp_size,
                               model_dtype="F32")
                assert result is not None and result.passed and result.engine == layout


def test_rank_0s_slices_on_rank_2_stop_with_the_parameter_and_the_slice_named():
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 4)
    with pytest.raises(GuardError) as caught:
        check(params, CKPT["k3"], tp_rank=2, tp_size=4, where="vllm worker 2", model_dtype="F32")
    error = caught.value
    assert isinstance(error, KdaTpError) and isinstance(error, RuntimeError)
    text = str(error)
    assert text.startswith("kda_tp guard: vllm worker 2: tp rank 2/4: ")
    assert f"rank 2 {PRE}o_proj.weight: values differ in o_proj" in text
    assert "equals rank 0's slice of o_proj" in text
    assert f"rank 2 {PRE}in_proj_qkvgfab.weight: values differ in q_proj" in text
    assert f"(set {MODE_ENV}=warn to start anyway)" in text
    assert error.report is not None and not error.report.passed
    assert f"{PRE}o_proj.weight" in {p.name for p in error.report.failures}


def test_warn_logs_the_diagnosis_at_error_warns_and_returns_the_result(monkeypatch, caplog,
                                                                      guard_log):
    monkeypatch.setenv(MODE_ENV, "warn")
    params = built(CKPT["glm"], "vllm-0.33-glm-5.3", 1, 2)
    with guard_log, pytest.warns(GuardWarning) as warned:
        result = check(params, CKPT["glm"], tp_rank=0, tp_size=2, model_dtype="F32")
    assert result is not None and not result.passed
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert "FAIL" in record.getMessage() and "equals rank 1's slice of o_proj" in record.getMessage()
    (warning,) = warned
    assert str(warning.message) == record.getMessage()
    assert isinstance(warning.message, KdaTpError)


def test_off_checks_nothing(monkeypatch):
    monkeypatch.setenv(MODE_ENV, " OFF ")
    assert mode() == "off"
    params = built(CKPT["glm"], "vllm-0.33-glm-5.3", 1, 2)
    assert check(params, CKPT["glm"], tp_rank=0, tp_size=2, model_dtype="F32") is None
    assert check(params, "s3://bucket/model", tp_rank=0, tp_size=2,
                 model_dtype="F32") is None  # no warning


def test_a_bad_mode_is_refused_with_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(MODE_ENV, "strict")
    with pytest.raises(GuardModeError) as caught:
        mode()
    assert isinstance(caught.value, ValueError) and isinstance(caught.value, GuardError)
    assert str(caught.value) == (
        "KDA_TP_GUARD='strict' is not a guard mode; use fail (the default), warn or off")
    monkeypatch.setenv(MODE_ENV, "")
    assert mode() == "fail"


def test_non_kda_parameters_are_skipped_without_touching_the_checkpoint():
    params = {f"model.layers.{i}.self_attn.{n}.weight": np.zeros(1, np.float32)
              for i in range(64) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    params |= {f"model.layers.{i}.linear_attn.A_log": np.zeros(1) for i in range(8)}  # Qwen3-Next
    # No checkpoint read, no warning (a missing path would warn); its cost: benchmarks/bench.py.
    assert check(params, "/no/such/checkpoint", tp_rank=0, tp_size=8, model_dtype="F32") is None


def test_a_config_without_kda_layers_fails_in_fail_and_warns_in_warn(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 2}))
    params = {f"model.layers.0.self_attn.{n}": np.zeros(4, np.float32) for n in ("A_log", "dt_bias")}
    # KDA parameters and a config without KDA layers: a check that cannot run.
    with pytest.raises(GuardError, match=r"describes no KDA layer; the KDA weights are not "
                       r"checked \(is it the checkpoint the engine loaded\?"):
        check(params, tmp_path, tp_rank=0, tp_size=2)
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match=r"describes no KDA layer") as seen:
        assert check(params, tmp_path, tp_rank=0, tp_size=2) is None
    assert len(seen) == 1


def test_a_remote_checkpoint_is_one_warning_not_a_crash():
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 2)
    with pytest.warns(RuntimeWarning, match=r"s3://bucket/k3.* is not a local path") as seen:
        assert check(params, "s3://bucket/k3", tp_rank=0, tp_size=2, where="w0",
                     model_dtype="F32") is None
    assert len(seen) == 1


def test_parameters_of_another_family_stop_with_the_wrong_checkpoint_named():
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 2)
    with pytest.raises(GuardError) as caught:
        check(params, CKPT["kimi_linear"], tp_rank=0, tp_size=2, model_dtype="F32")
    assert caught.value.report is not None
    assert "these names are vllm-0.33-k3's; is " in str(caught.value)


def test_parameters_no_layout_fits_stop_with_the_audits_refusal():
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 2)
    with pytest.raises(GuardError) as caught:
        check(params, CKPT["k3"], tp_rank=0, tp_size=2, engine="vllm-9-k3", model_dtype="F32")
    assert caught.value.report is None
    assert str(caught.value).startswith(
        "kda_tp guard: tp rank 0/2: cannot check the KDA weights against ")
    assert "no engine layout 'vllm-9-k3'" in str(caught.value)


def _decode_copies(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """vLLM K3's decode buffers as its loaders fill them (written from vLLM's loader code: the
    conv's q, k, v shards each [Cl, 1, K] -> [K, Cl]; o_norm upcast to F32)."""
    conv = params[PRE + "conv1d.weight"]
    cl = conv.shape[0] // 3
    stacked = np.stack([conv[i * cl:(i + 1) * cl, 0, :].T for i in range(3)])
    return {PRE + "decode_conv1d_weight": np.ascontiguousarray(stacked),
            PRE + "decode_norm_weight": params[PRE + "o_norm.weight"].astype(np.float32)}


def test_vllm_k3_decode_copies_are_checked():
    params = built(CKPT["k3"], "vllm-0.33-k3", 1, 4)
    derived = _decode_copies(params)
    result = check(params, CKPT["k3"], tp_rank=1, tp_size=4, derived=derived, model_dtype="F32")
    assert result is not None and result.passed and result.params == len(params) + 2
    assert result.bytes == sum(a.nbytes for a in (*params.values(), *derived.values()))
    stale = dict(derived)
    other = _decode_copies(built(CKPT["k3"], "vllm-0.33-k3", 2, 4))
    stale[PRE + "decode_conv1d_weight"] = other[PRE + "decode_conv1d_weight"]
    with pytest.raises(GuardError) as caught:
        check(params, CKPT["k3"], tp_rank=1, tp_size=4, derived=stale, model_dtype="F32")
    assert f"rank 1 {PRE}decode_conv1d_weight: differs from what conv1d.weight makes of it at " \
           "[0, 0, 0] (expected 384.0, got 768.0)" in str(caught.value)


def test_a_pipeline_stage_checks_only_its_layers(tmp_path):
    from safetensors.numpy import save_file
    with safe_open(CKPT["glm"] / "model.safetensors", "np") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    # Two KDA layers, 0 and 1; this stage holds layer 1 only.
    tensors |= {k.replace("layers.0.", "layers.1."): v for k, v in tensors.items()}
    config = json.loads((CKPT["glm"] / "config.json").read_text())
    config["text_config"] |= {"num_hidden_layers": 2,
                              "layer_types": ["linear_attention", "linear_attention"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(tmp_path / "model.safetensors"))
    params = {k.replace("layers.0.", "layers.1."): v
              for k, v in built(tmp_path, "vllm-0.33-glm-5.3", 1, 2).items()}
    with pytest.raises(GuardError, match="missing"):
        check(params, tmp_path, tp_rank=1, tp_size=2, model_dtype="F32")
    result = check(params, tmp_path, tp_rank=1, tp_size=2, layers=[1], model_dtype="F32")
    assert result is not None and result.passed and result.params == len(params)


def test_holds_kda_looks_at_names_only():
    from kda_tp.guard._names import holds_kda
    assert holds_kda(["language_model.model.layers.3.self_attn.A_log"])
    assert holds_kda(iter(["layers.0.self_attn.forget_gate.dt_bias"]))
    assert not holds_kda(["model.layers.0.linear_attn.A_log", "model.layers.0.self_attn.o_proj.weight"])


def test_the_vllm_plugin_is_an_entry_point_and_imports_no_engine():
    import subprocess
    import sys
    from importlib.metadata import entry_points
    (found,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "kda_tp_guard"]
    assert found.value == "kda_tp.guard.vllm:register"
    code = ("import sys, kda_tp, kda_tp.guard, kda_tp.guard.vllm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('vllm', 'torch', 'sglang')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# -- the hostile tester's findings ------------------------------------------------------------


def test_a_kda_layer_without_a_log_and_dt_bias_fails_in_fail_and_warns_in_warn(monkeypatch):
    params = built(CKPT["kimi_linear"], "vllm-0.33-kimi-linear", 0, 2)
    del params[PRE + "A_log"], params[PRE + "dt_bias"]
    with pytest.raises(GuardError, match=r"tp rank 0/2: the parameters hold KDA layer names "
                       r".* but no ...self_attn.A_log or ...self_attn.dt_bias"):
        check(params, CKPT["kimi_linear"], tp_rank=0, tp_size=2)
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match=r"but no ...self_attn.A_log") as seen:
        assert check(params, CKPT["kimi_linear"], tp_rank=0, tp_size=2) is None
    assert len(seen) == 1


def test_the_layers_of_a_stage_come_from_every_kda_name_so_missing_markers_are_missing(tmp_path):
    from kda_tp.guard._names import stage_layers
    params = built(CKPT["glm"], "vllm-0.33-glm-5.3", 1, 2)
    moved = {k.replace("layers.0.", "layers.3."): v for k, v in params.items()
             if not k.endswith(("A_log", "dt_bias"))}
    assert stage_layers(params | moved) == [0, 3]  # layer 3 has no A_log / dt_bias


def test_the_checkpoint_variable_is_stripped_and_a_missing_one_fails(monkeypatch, tmp_path):
    from kda_tp.guard._modes import CHECKPOINT_ENV, explicit_checkpoint
    monkeypatch.setenv(CHECKPOINT_ENV, f"  {CKPT['k3']} ")
    assert explicit_checkpoint("w") == str(CKPT["k3"])
    monkeypatch.setenv(CHECKPOINT_ENV, str(tmp_path / "typo"))
    with pytest.raises(GuardError, match=rf"w: {CHECKPOINT_ENV}='.*typo' does not exist"):
        explicit_checkpoint("w")
    monkeypatch.setenv(MODE_ENV, "warn")
    with pytest.warns(RuntimeWarning, match="does not exist"):
        assert explicit_checkpoint("w") == ""
    monkeypatch.setenv(CHECKPOINT_ENV, "  ")
    assert explicit_checkpoint("w") is None


def test_the_model_dtype_names():
    import ml_dtypes
    from kda_tp.engines import model_dtype_name
    torch = pytest.importorskip("torch")
    assert [model_dtype_name(d) for d in (torch.bfloat16, torch.float16, torch.float32, "bfloat16",
                                          np.dtype(ml_dtypes.bfloat16), torch.int8)] == [
        "BF16", "F16", "F32", "BF16", "BF16", None]


def test_a_parameter_in_another_float_dtype_than_the_ranks_others_fails_naming_both():
    import ml_dtypes
    for suffix, dtype, name in (("o_norm.weight", ml_dtypes.bfloat16, "BF16"),
                                ("o_norm.weight", np.float16, "F16"),
                                ("o_norm.weight", np.float64, "F64"),
                                ("o_proj.weight", np.float64, "F64")):
        params = built(CKPT["kimi_linear"], "vllm-0.33-kimi-linear", 1, 4)
        params[PRE + suffix] = params[PRE + suffix].astype(dtype)
        with pytest.raises(GuardError) as caught:
            check(params, CKPT["kimi_linear"], tp_rank=1, tp_size=4, model_dtype="F32")
        assert (f"rank 1 {PRE}{suffix}: dtype {name}, expected F32 (the engine's model dtype, "
                "as passed") in str(caught.value)
        (wrong,) = caught.value.report.failures
        assert wrong.name == PRE + suffix
    # The F32-fixed parameters (A_log, dt_bias, convs) stay F32 in a BF16 engine.
    params = built(CKPT["kimi_linear"], "vllm-0.33-kimi-linear", 1, 4)
    fixed = ("A_log", "dt_bias", "conv1d.weight")
    params = {k: v if k.endswith(fixed) else v.astype(ml_dtypes.bfloat16) for k, v in params.items()}
    result = check(params, CKPT["kimi_linear"], tp_rank=1, tp_size=4, model_dtype="BF16")
    assert result is not None and result.passed


def test_a_torch_derived_copy_in_bf16_or_int_fails_its_dtype():
    torch = pytest.importorskip("torch")
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 4)
    good = {k: torch.from_numpy(v) for k, v in _decode_copies(params).items()}
    result = check(params, CKPT["k3"], tp_rank=0, tp_size=4, derived=good, model_dtype="F32")
    assert result is not None and result.passed
    for copy, cast, dtype in (("decode_norm_weight", lambda t: t.bfloat16(), "BF16"),
                              ("decode_conv1d_weight", lambda t: t.int(), "I32")):
        bad = dict(good) | {PRE + copy: cast(good[PRE + copy])}
        with pytest.raises(GuardError, match=rf"rank 0 {PRE}{copy}: shape \[.*\] x {dtype}, "
                           r"expected \[.*\] x F32"):
            check(params, CKPT["k3"], tp_rank=0, tp_size=4, derived=bad, model_dtype="F32")


def test_a_derived_copy_differing_in_the_sign_of_zero_is_a_difference():
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 4)
    derived = _decode_copies(params)
    norm = derived[PRE + "decode_norm_weight"].copy()
    (zero,) = np.flatnonzero(norm == 0)
    norm[zero] = -0.0
    with pytest.raises(GuardError) as caught:
        check(params, CKPT["k3"], tp_rank=0, tp_size=4,
              derived=derived | {PRE + "decode_norm_weight": norm}, model_dtype="F32")
    assert (f"rank 0 {PRE}decode_norm_weight: differs from what o_norm.weight makes of it at "
            f"[{zero}] (expected 0.0, got -0.0)") in str(caught.value)


@pytest.mark.parametrize("case", ["sparse", "uninitialized", "meta"])
def test_unreadable_tensors_are_a_guard_error_or_a_warning_never_a_crash(case, monkeypatch, caplog,
                                                                          guard_log):
    torch = pytest.importorskip("torch")
    params = {k: torch.from_numpy(v) for k, v in built(CKPT["k3"], "vllm-0.33-k3", 0, 4).items()}
    change, derived, why = {
        "sparse": ({PRE + "A_log": params[PRE + "A_log"].to_sparse()}, None,
                   "torch.sparse_coo tensor"),
        "uninitialized": ({PRE + "A_log": torch.nn.UninitializedParameter()}, None,
                          "uninitialized"),
        "meta": ({}, {PRE + "decode_norm_weight": torch.empty(128, device="meta")},
                 "a meta tensor"),
    }[case]
    monkeypatch.delenv(MODE_ENV, raising=False)
    with pytest.raises(GuardError, match=why):
        check(params | change, CKPT["k3"], tp_rank=0, tp_size=4, derived=derived,
              model_dtype="F32")
    monkeypatch.setenv(MODE_ENV, "warn")
    guard_log.clear()
    failing = case == "meta"  # a derived copy that cannot be read: a failing verdict
    with guard_log, pytest.warns(GuardWarning, match=why) if failing else \
            contextlib.nullcontext():
        out = check(params | change, CKPT["k3"], tp_rank=0, tp_size=4, derived=derived,
                    model_dtype="F32")
    assert out is None or not out.passed
    assert [r.levelno for r in caplog.records] == [logging.ERROR if failing else logging.WARNING]
    assert why in caplog.records[0].getMessage()


def test_a_negated_view_holds_its_values_once_resolved_and_passes():
    torch = pytest.importorskip("torch")
    params = {k: torch.from_numpy(v) for k, v in built(CKPT["k3"], "vllm-0.33-k3", 0, 4).items()}
    negated = (-params[PRE + "A_log"])._neg_view()
    assert negated.is_neg()
    result = check(params | {PRE + "A_log": negated}, CKPT["k3"], tp_rank=0, tp_size=4,
                   model_dtype="F32")
    assert result is not None and result.passed


def test_bad_argument_types_are_named_errors():
    from kda_tp import CheckpointError
    params = built(CKPT["k3"], "vllm-0.33-k3", 0, 4)
    with pytest.raises(CheckpointError, match=r"params: the key 3 \(int\) is not a parameter name"):
        check(params | {3: np.zeros(1)}, CKPT["k3"], tp_rank=0, tp_size=4, model_dtype="F32")
    with pytest.raises(TypeError, match=r"derived: the key 0 \(int\) is not a parameter name"):
        check(params, CKPT["k3"], tp_rank=0, tp_size=4, derived={0: np.zeros(1)}, model_dtype="F32")
    with pytest.raises(TypeError, match=r"params: item 0 is a str, not a \(name, tensor\) pair"):
        check(list(params), CKPT["k3"], tp_rank=0, tp_size=4, model_dtype="F32")
    with pytest.raises(TypeError, match=r"params: item 0 is a tuple, not a \(name, tensor\)"):
        check([(1, 2, 3)], CKPT["k3"], tp_rank=0, tp_size=4, model_dtype="F32")


def test_audit_engine_reports_a_rank_that_wrote_no_report_as_unguarded(tmp_path):
    from kda_tp.guard.sglang import audit_engine

    # an earlier audit's report of rank 1 is still there: never read as this audit's answer
    (tmp_path / "kda_tp-guard-tp1.json").write_text(json.dumps(
        {"ok": True, "guarded": True, "tp_rank": 1, "tp_size": 2, "where": "sglang",
         "line": "kda_tp guard: sglang: tp rank 1/2: OK", "audit": "an earlier one"}))

    def collective_rpc(method, report_dir, checkpoint, audit):  # only rank 0 of 2 answers
        (Path(report_dir) / "kda_tp-guard-tp0.json").write_text(json.dumps(
            {"ok": True, "guarded": True, "tp_rank": 0, "tp_size": 2, "where": "sglang",
             "line": "kda_tp guard: sglang: tp rank 0/2: OK", "audit": audit}))

    engine = type("Engine", (), {"collective_rpc": staticmethod(collective_rpc)})()
    first, second = audit_engine(engine, report_dir=tmp_path)
    assert (first["tp_rank"], first["guarded"]) == (0, True)
    assert (second["tp_rank"], second["guarded"], second["ok"]) == (1, False, None)
    assert second["line"] == ("kda_tp guard: sglang: tp rank 1/2: unguarded: did not answer "
                              "(no guard loaded, or no answer)")
    # nobody answers: one unguarded entry, never []
    engine = type("Engine", (), {"collective_rpc": staticmethod(lambda *a, **k: None)})()
    (nobody,) = audit_engine(engine)
    assert nobody["guarded"] is False and "no rank wrote a report" in nobody["line"]


def test_audit_engine_reads_report_files_bounded_without_links_or_blocking(tmp_path):
    """F13: each audit writes into its own directory; a FIFO, a link to /dev/zero, garbage
    and another audit's file among the reports are unguarded entries naming the file (no
    hang, no memory eaten, no raw error); an audit run while another writes into the same
    report_dir spoils neither."""
    import os
    import time

    from kda_tp.guard.sglang import audit_engine

    def answer(report_dir, audit, rank):
        (Path(report_dir) / f"kda_tp-guard-tp{rank}.json").write_text(json.dumps(
            {"ok": True, "guarded": True, "tp_rank": rank, "tp_size": 2, "where": "sglang",
             "line": f"kda_tp guard: sglang: tp rank {rank}/2: OK", "audit": audit}))

    def hostile(method, report_dir, checkpoint, audit):
        answer(report_dir, audit, 0)
        answer(report_dir, audit, 1)
        os.mkfifo(Path(report_dir) / "kda_tp-guard-fifo-tp2.json")
        os.symlink("/dev/zero", Path(report_dir) / "kda_tp-guard-zero-tp3.json")
        (Path(report_dir) / "kda_tp-guard-junk-tp4.json").write_bytes(b"\xff{not json")
        (Path(report_dir) / "kda_tp-guard-old-tp5.json").write_text('{"audit": "old"}')

    engine = type("Engine", (), {"collective_rpc": staticmethod(hostile)})()
    start = time.perf_counter()
    reports = audit_engine(engine, report_dir=tmp_path)
    assert time.perf_counter() - start < 5
    assert [(r["tp_rank"], r["ok"]) for r in reports[:2]] == [(0, True), (1, True)]
    lines = [r["line"] for r in reports[2:]]
    assert all(r["guarded"] is False for r in reports[2:]) and len(lines) == 4
    assert any("'kda_tp-guard-fifo-tp2.json' is not a regular file" in x for x in lines)
    assert any("'kda_tp-guard-zero-tp3.json' is not a regular file" in x for x in lines)
    assert any("'kda_tp-guard-junk-tp4.json' is not JSON" in x for x in lines)
    assert any("'kda_tp-guard-old-tp5.json' is not this audit's report" in x for x in lines)

    # two audits at once into one directory: the inner one runs while the outer one's
    # ranks are answering; both see their own two ranks OK
    inner: list = []

    def nested(method, report_dir, checkpoint, audit):
        answer(report_dir, audit, 0)
        if not inner:
            inner.append(None)
            inner[0] = audit_engine(engine_b, report_dir=tmp_path / "shared")
        answer(report_dir, audit, 1)

    def plain(method, report_dir, checkpoint, audit):
        answer(report_dir, audit, 0)
        answer(report_dir, audit, 1)

    engine_b = type("Engine", (), {"collective_rpc": staticmethod(plain)})()
    engine_a = type("Engine", (), {"collective_rpc": staticmethod(nested)})()
    outer = audit_engine(engine_a, report_dir=tmp_path / "shared")
    for got in (outer, inner[0]):
        assert [(r["tp_rank"], r["ok"], r["guarded"]) for r in got] == [(0, True, True),
                                                                          (1, True, True)]


def test_rank_report_is_one_shape_for_a_pass_a_failure_and_a_check_not_run():
    from kda_tp.guard import rank_report

    def audit(params, checkpoint, rank):
        return rank_report(lambda: check(params, checkpoint, tp_rank=rank, tp_size=4,
                                         where="w", guard_mode="fail", model_dtype="F32"),
                           tp_rank=rank, tp_size=4, where="w")

    good = audit(built(CKPT["k3"], "vllm-0.33-k3", 2, 4), CKPT["k3"], 2)
    wrong = audit(built(CKPT["k3"], "vllm-0.33-k3", 0, 4), CKPT["k3"], 2)
    remote = audit(built(CKPT["k3"], "vllm-0.33-k3", 2, 4), "s3://bucket/k3", 2)
    assert set(good) == set(wrong) == set(remote) == {
        "ok", "guarded", "line", "tp_rank", "tp_size", "where", "skipped", "engine", "params",
        "bytes", "seconds", "summary", "text", "report", "unchecked"}
    assert (good["ok"], good["skipped"], good["tp_rank"], good["engine"]) == (
        True, None, 2, "vllm-0.33-k3")
    assert good["line"].startswith("kda_tp guard: w: tp rank 2/4: ") and good["line"].endswith(
        ": OK")
    assert good["params"] > 0 and good["report"]["ok"] is True
    assert wrong["ok"] is False and wrong["line"].startswith("kda_tp guard: w: tp rank 2/4: ")
    assert "equals rank 0's slice of o_proj" in wrong["text"]
    assert wrong["summary"].startswith("FAIL: ") and wrong["report"]["ok"] is False
    assert remote["ok"] is None and remote["report"] is None
    assert "is not a local path" in remote["skipped"]
    assert remote["line"] == f"not checked: {remote['skipped']}"


def test_resolve_checkpoint_keeps_local_paths_and_urls_and_never_downloads(tmp_path):
    from kda_tp.guard._modes import resolve_checkpoint

    assert resolve_checkpoint(str(CKPT["k3"])) == str(CKPT["k3"])
    assert resolve_checkpoint("s3://bucket/k3") == "s3://bucket/k3"
    # an id not in the (empty) cache stays as it is: check() then warns it is not local
    assert resolve_checkpoint("no-such-org/no-such-model",
                              download_dir=str(tmp_path)) == "no-such-org/no-such-model"
    assert list(tmp_path.iterdir()) == []


def test_guard_result_to_dict_is_the_checked_ranks_report():
    from kda_tp.guard import rank_report

    params = built(CKPT["k3"], "vllm-0.33-k3", 1, 2)
    result = check(params, CKPT["k3"], tp_rank=1, tp_size=2, where="w1", model_dtype="F32")
    assert isinstance(result, GuardResult)
    assert result.to_dict() == {
        "ok": True, "line": result.line(), "tp_rank": 1, "tp_size": 2, "where": "w1",
        "engine": result.engine, "params": result.params, "bytes": result.bytes,
        "seconds": result.seconds, "summary": result.report.summary(),
        "text": result.report.format(), "report": result.report.to_dict(), "unchecked": []}
    assert json.loads(json.dumps(result.to_dict())) == result.to_dict()
    report = rank_report(lambda: result, tp_rank=1, tp_size=2, where="w1")
    assert report == {**result.to_dict(), "guarded": True, "skipped": None}


def test_a_gemm_read_back_is_judged_element_by_element():
    """The read-back rules, stated once (``read_back_difference``): -0.0 and +0.0 alike, a
    subnormal as zero, only the rows holding a NaN or an infinity set aside (issue 38, F2)."""
    import ml_dtypes

    from kda_tp.guard import read_back_difference

    bf16 = np.dtype(ml_dtypes.bfloat16)
    want = np.array([1.0, -0.0, 2.0 ** -130, -2.5], dtype=bf16)
    got = np.array([1.0, 0.0, 0.0, -2.5], dtype=bf16)
    assert read_back_difference(got, want, "BF16", 2) == (None, 0)
    assert read_back_difference(want, got, "BF16", 2) == (None, 0)  # both sides alike
    assert read_back_difference(np.array([2.0 ** -20], np.float16),
                                np.array([0.0], np.float16), "F16", 1) == (None, 0)
    assert read_back_difference(np.array([2.0 ** -20], np.float32),
                                np.array([0.0], np.float32), "F32", 1) == (0, 0)  # a normal
    wrong = np.array([1.0, 0.0, 0.0, 2.5], dtype=bf16)
    assert read_back_difference(wrong, want, "BF16", 2) == (3, 0)
    for bad in (np.nan, np.inf, -np.inf):  # rows of 2: the row of the bad value set aside
        want = np.array([1.0, bad, 3.0, 4.0], dtype=np.float32)
        got = np.array([np.nan, np.nan, 3.0, 4.0], dtype=np.float32)
        assert read_back_difference(got, want, "F32", 2) == (None, 2)
        assert read_back_difference(got + np.float32([0, 0, 0, 1]), want, "F32", 2) == (3, 2)
        # a region starting mid-row: its first element is in the row of the bad value
        assert read_back_difference(got[1:], want[1:], "F32", 2, start=1) == (None, 1)
