"""The guard inside SGLang 0.5.23, through SGLang's own plugin loader and classes, on CPU.

One child process (``sglang_guard_child.py`` here, which says what is SGLang's and what stands
in for it) runs every scenario: SGLang's ``load_plugins()`` finds kda_tp's
``sglang.srt.plugins`` entry point and applies its hooks to ``ModelRunner.load_model`` (and
``finalize_startup_weight_load``, ``WeightUpdater.update_weights_from_disk``,
``Scheduler.handle_rpc_request``); SGLang's KDA layers and ``load_weights`` (and its
``ShardedStateLoader``) load the tiny fixture checkpoints of ``tests/data/engine_ranks`` with
the TP rank faked. The tests read what each scenario logged, raised and returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from paths import ENGINE_RANKS, TESTS

pytestmark = pytest.mark.engines

HERE = Path(__file__).parent
FAMILIES = {"k3": "sglang-0.5.23-k3", "kimi_linear": "sglang-0.5.23-kimi-linear",
            "glm": "sglang-0.5.23-glm-5.3"}
FUSED = {"k3": "fused_qkvg_proj.weight", "kimi_linear": "fused_qkvbfg_a_proj.weight",
         "glm": "fused_qkvbfg_a_proj.weight"}
P = "model.layers.0.self_attn."


@pytest.fixture(scope="module")
def outcome(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("sglang")
    work = tmp_path_factory.mktemp("sglang_guard")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KDA_TP_GUARD", "SGLANG_PLUGINS"))}
    done = subprocess.run(
        [sys.executable, str(HERE / "sglang_guard_child.py"), str(ENGINE_RANKS),
         str(work), str(TESTS)], capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_importing_kda_tp_imports_no_sglang(outcome: dict[str, Any]) -> None:
    assert outcome["sglang_at_import"] is False


def test_load_plugins_applies_every_hook(outcome: dict[str, Any]) -> None:
    from kda_tp.guard import sglang as sglang_plugin

    assert outcome["hooked"] == sorted(sglang_plugin.TARGETS)


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("T,R", [(2, 0), (2, 1), (4, 1), (4, 3)])
def test_right_loads_pass_with_one_line(outcome: dict[str, Any], kind: str, T: int,
                                        R: int) -> None:
    run = outcome["pass"][f"{kind} tp{T} r{R}"]
    assert run["error"] is None
    params = 9 if kind == "k3" else 7
    (line,) = run["lines"]
    assert line.startswith(f"INFO kda_tp.guard: kda_tp guard: sglang: tp rank {R}/{T}: "
                           f"{params} KDA parameters ({FAMILIES[kind]}), ")
    assert line.endswith(": OK")


# (bug, rank the guard runs as, the parameter that must be named, what it must say)
BUGS = [
    ("rank0", 3, "FUSED", "equals rank 0's slice of q_proj"),
    ("swap12", 1, "FUSED", "equals rank 2's slice of q_proj"),
    ("swap21", 2, "FUSED", "equals rank 1's slice of q_proj"),
    ("o_proj_rows", 1, "o_proj.weight", "values differ in o_proj"),
    ("k_shift", 1, "FUSED", "values differ in k_proj; part k_proj differs at [384, 0]"),
    ("sharded_state other rank", 1, "FUSED", "equals rank 2's slice of q_proj"),
]


def test_a_bf16_checkpoint_under_dtype_float32_passes_as_sglang_builds_it(
        outcome: dict[str, Any]) -> None:
    """Seen beside issue 38's round, confirmed from SGLang 0.5.23's source: KimiDeltaAttention
    builds ``fused_fg_b_proj`` with ``dtype=config.dtype`` (the HF config's, BF16), whatever
    ``--dtype``; every other KDA parameter in the model dtype (float32). The guard follows the
    engine: the honest load passes."""
    run = outcome["bf16 config, float32 engine"]
    assert run["dtypes"][P + "fused_fg_b_proj.weight"] == "bfloat16"
    assert run["dtypes"][P + "fused_qkvbfg_a_proj.weight"] == "float32"
    assert run["error"] is None
    (line,) = [x for x in run["lines"] if "tp rank 1/2" in x]
    assert line.endswith(": OK"), line


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("bug,R,param,says", BUGS)
def test_loading_bugs_stop_the_load_naming_the_parameter(
        outcome: dict[str, Any], kind: str, bug: str, R: int, param: str, says: str) -> None:
    run = outcome["bugs"][f"{kind} {bug}"]
    error = run["error"]
    assert error is not None, run["lines"]
    name = P + (FUSED[kind] if param == "FUSED" else param)
    assert error.startswith(f"kda_tp guard: sglang: tp rank {R}/4: ")
    assert f"rank {R} {name}: " in error
    assert says in error
    assert error.endswith("(set KDA_TP_GUARD=warn to start anyway)")
    # no OK line; one ERROR line: the verdict, the rank and the wrong parameters
    (line,) = run["lines"]
    assert line.startswith(f"ERROR kda_tp.guard: {error.splitlines()[0]}: ") and name in line


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_right_sharded_state_load_passes(outcome: dict[str, Any], kind: str) -> None:
    run = outcome["bugs"][f"{kind} sharded_state right"]
    assert run["error"] is None
    assert run["lines"][0].endswith(": OK")


def test_sharded_state_without_the_checkpoint_is_one_warning(outcome: dict[str, Any]) -> None:
    run = outcome["sharded_no_checkpoint"]
    assert run["error"] is None and run["lines"] == []
    (warning,) = run["caught"]
    assert "set KDA_TP_GUARD_CHECKPOINT" in warning


def test_warn_logs_the_diagnosis_and_goes_on(outcome: dict[str, Any]) -> None:
    run = outcome["warn"]
    assert run["error"] is None
    (line,) = run["lines"]
    assert line.startswith("ERROR kda_tp.guard: kda_tp guard: sglang: tp rank 1/4: ")
    assert "FAIL (6 wrong)" in line and "equals rank 0's slice of q_proj" in line


def test_off_checks_nothing(outcome: dict[str, Any]) -> None:
    assert outcome["off"] == {"error": None, "caught": [], "after_load_model": [], "lines": []}


def test_draft_and_non_kda_models_are_skipped(outcome: dict[str, Any]) -> None:
    # The draft runner loaded rank 0's slices on rank 1: not looked at.
    assert outcome["draft"] == {"error": None, "caught": [], "after_load_model": [],
                                "lines": []}
    assert outcome["not_kda"] == "None"  # and its checkpoint path does not exist


def test_overlap_mode_checks_at_finalize(outcome: dict[str, Any]) -> None:
    run = outcome["overlap"]
    # load_model left placeholder values: not checked there, checked once committed
    assert run["after_load_model"] == []
    (line,) = run["lines"]
    assert line.startswith("INFO kda_tp.guard: kda_tp guard: sglang: tp rank 3/4: ")
    bad = outcome["overlap_bug"]
    assert bad["after_load_model"] == []
    assert "equals rank 0's slice of q_proj" in bad["error"]


def test_update_weights_from_disk_is_checked_on_the_new_checkpoint(
        outcome: dict[str, Any]) -> None:
    right = outcome["update"]["right"]
    assert right["ok"] is True, right["message"]
    (line,) = right["lines"]
    assert line.startswith("INFO kda_tp.guard: kda_tp guard: sglang: tp rank 2/4: 9 KDA ")
    stale = outcome["update"]["stale"]  # the update read the old checkpoint
    assert stale["ok"] is False
    assert stale["message"].startswith("the weights of ")
    assert "ckpt_k3_new" in stale["message"]
    assert f"rank 2 {P}fused_qkvg_proj.weight: values differ" in stale["message"]


def test_audit_engine_returns_every_ranks_report(outcome: dict[str, Any]) -> None:
    first, second = outcome["rpc"]
    assert (first["tp_rank"], first["tp_size"], first["ok"]) == (0, 2, True)
    assert first["engine"] == "sglang-0.5.23-kimi-linear"
    assert (second["tp_rank"], second["ok"]) == (1, False)
    assert second["summary"].startswith("FAIL: 6 KDA parameter(s) wrong")
    assert second["line"].startswith("kda_tp guard: sglang: tp rank 1/2: FAIL: 6 KDA ")
    assert "equals rank 0's slice of q_proj" in second["text"]
    assert outcome["rpc_files"] == ["kda_tp-guard-tp0.json", "kda_tp-guard-tp1.json"]


def test_audit_engine_reads_only_this_audits_reports(outcome: dict[str, Any]) -> None:
    """A rank that does not answer an audit is unguarded, though its report of an earlier
    audit is still in the report directory."""
    rank_0, rank_1 = outcome["rpc_silent"]
    assert (rank_0["tp_rank"], rank_0["guarded"], rank_0["ok"]) == (0, True, True)
    assert (rank_1["tp_rank"], rank_1["tp_size"], rank_1["guarded"], rank_1["ok"]) == (
        1, 2, False, None)
    assert rank_1["line"] == ("kda_tp guard: sglang: tp rank 1/2: unguarded: did not answer "
                              "(no guard loaded, or no answer)")


# -- RL updates through SGLang's own WeightUpdater -------------------------------------------


@pytest.mark.parametrize("kind", FAMILIES)
def test_right_refits_pass_on_the_tensor_and_distributed_paths(outcome: dict[str, Any],
                                                               kind: str) -> None:
    for path, T, R, calls in (("tensor", 4, 1, 2), ("distributed", 2, 0, 1)):
        run = outcome["updates"][f"{kind} {path}"]
        assert run["results"] == [[True, "Success" if path == "tensor" else
                                   "Succeeded to update parameter online."]] * calls
        where = ("update_weights_from_tensor" if path == "tensor"
                 else "update_weights_from_distributed")
        assert len(run["lines"]) == calls, run["lines"]
        for line in run["lines"]:
            assert line.startswith(f"INFO kda_tp.guard: kda_tp guard: sglang {where}: "
                                   f"tp rank {R}/{T}: ")
            assert f"KDA parameters updated ({FAMILIES[kind]})" in line and line.endswith(": OK")


@pytest.mark.parametrize("kind", FAMILIES)
def test_q_rows_in_ks_place_fail_the_update_naming_the_part(outcome: dict[str, Any],
                                                            kind: str) -> None:
    ((ok, message),) = outcome["updates"][f"{kind} q_in_k"]["results"]
    assert ok is False
    assert message.startswith("the update is loaded, but the kda_tp guard found this rank's KDA")
    assert (f"rank 2 {P}{FUSED[kind]}: k_proj: holds what was fed as {P}q_proj.weight (this "
            f"rank's slice), not {P}k_proj.weight") in message


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_fused_part_dropped_from_a_later_call_fails_that_update(outcome: dict[str, Any],
                                                                 kind: str) -> None:
    first, later = outcome["updates"][f"{kind} dropped_later"]["results"]
    assert first == [True, "Success"]
    assert later[0] is False
    assert (f"rank 3 {P}{FUSED[kind]}: v_proj: holds the values from before the update: "
            f"{P}v_proj.weight was fed but the engine never applied it") in later[1]


def test_a_sent_parameter_never_applied_is_named(outcome: dict[str, Any]) -> None:
    ((ok, message),) = outcome["updates"]["dt_bias_dropped"]["results"]
    assert ok is False
    assert (f"rank 1 {P}dt_bias: dt_bias: holds the values from before the update: "
            f"{P}dt_bias was fed but the engine never applied it") in message


def test_a_wrong_update_in_warn_mode_is_logged_and_succeeds(outcome: dict[str, Any]) -> None:
    run = outcome["updates"]["warn"]
    assert run["results"] == [[True, "Success"]]
    (line,) = run["lines"]
    assert line.startswith("ERROR kda_tp.guard: kda_tp guard: sglang update_weights_from_tensor")
    assert "FAIL (1 wrong)" in line and "k_proj: holds what was fed as" in line


def test_a_direct_tensor_update_warns_that_it_is_not_checked(outcome: dict[str, Any]) -> None:
    run = outcome["updates"]["direct"]
    assert run["results"] == [[True, "Success"]] and run["lines"] == []
    (warning,) = run["caught"]
    assert "load_format='direct') writes tensors without the model's load_weights" in warning


def test_audit_engine_reports_the_armed_record_of_every_rank(outcome: dict[str, Any]) -> None:
    from kda_tp.guard import sglang as sglang_plugin

    for report in outcome["rpc"]:
        assert report["guarded"] is True
        assert report["hooks"] == {**{t: "armed" for t in sglang_plugin.TARGETS},
                                   "model.load_weights (updates)": "armed"}
        assert report["versions"]["sglang"] == "0.5.23" and report["versions"]["kda_tp"]
        assert report["checks"]["first load"] >= 1 and report["checks"]["update"] >= 1
        assert report["last"].startswith("kda_tp guard: sglang")


def test_update_weights_from_ipc_is_checked(outcome: dict[str, Any]) -> None:
    run = outcome["updates"]["ipc"]
    assert run["results"] == [[True, "IPC weight update completed successfully"]]
    (line,) = run["lines"]
    assert line.startswith("INFO kda_tp.guard: kda_tp guard: sglang update_weights_from_ipc: "
                           "tp rank 3/4: ") and line.endswith(": OK")
    ((ok, message),) = outcome["updates"]["ipc_dt_bias_dropped"]["results"]
    assert ok is False
    assert f"rank 0 {P}dt_bias: dt_bias: holds the values from before the update" in message


# -- SGLang 0.5.23's weight-update sessions, through its scheduler's WeightUpdater ----


SESSION = "kda_tp guard: sglang weight update session: "


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_session_in_two_buckets_cut_inside_the_fused_projection_is_one_checked_update(
        outcome: dict[str, Any], kind: str) -> None:
    run = outcome["sessions"][f"{kind} right"]
    assert run["answers"] == [[True, "Success"]] * 4  # begin, two buckets, end
    (line,) = run["lines"]  # one verdict, at the end
    assert line.startswith(f"INFO kda_tp.guard: {SESSION}tp rank 1/4: ")
    assert f"KDA parameters updated ({FAMILIES[kind]})" in line and line.endswith(": OK")
    assert run["counted"] == 1


@pytest.mark.parametrize("kind", FAMILIES)
def test_a_wrong_session_fails_at_its_end_naming_the_part(outcome: dict[str, Any],
                                                          kind: str) -> None:
    *fed, (ok, message) = outcome["sessions"][f"{kind} q_in_k"]["answers"]
    assert fed == [[True, "Success"]] * 3 and ok is False
    assert message.startswith("the weight update is loaded, but the kda_tp guard found this "
                              "rank's KDA weights wrong")
    assert (f"rank 2 {P}{FUSED[kind]}: k_proj: holds what was fed as {P}q_proj.weight (this "
            f"rank's slice), not {P}k_proj.weight") in message


@pytest.mark.parametrize("kind", FAMILIES)
def test_after_a_dummy_load_the_first_session_must_fill_every_region(outcome: dict[str, Any],
                                                                     kind: str) -> None:
    right = outcome["sessions"][f"{kind} dummy right"]
    assert right["answers"][-1] == [True, "Success"]
    assert not any("tp rank 0/2: " in line and "KDA parameters (" in line
                   for line in right["lines"])  # the dummy load itself: not checked
    assert right["lines"][-1].endswith(": OK")
    *_, (ok, message) = outcome["sessions"][f"{kind} dummy no A_log"]["answers"]
    assert ok is False
    for name in ("A_log", "dt_bias"):
        assert (f"rank 1 {P}{name}: {name}: never loaded since the dummy load (random values): "
                "the update did not feed it") in message


def test_one_tensor_per_call_in_a_session_and_an_update_sglang_refuses(
        outcome: dict[str, Any]) -> None:
    run = outcome["sessions"]["per tensor"]
    assert all(answer == [True, "Success"] for answer in run["answers"])
    (line,) = run["lines"]
    assert line.startswith(f"INFO kda_tp.guard: {SESSION}tp rank 3/4: ") and line.endswith("OK")
    refused = outcome["sessions"]["refused"]  # no begin_weight_update: SGLang refuses it
    assert refused["answers"] == [[False, "update_weights_from_tensor must run between "
                                   "begin_weight_update() and end_weight_update()"]]
    assert refused["lines"] == [] and refused["counted"] == 0  # not reported as checked


def test_a_session_with_one_call_sglang_refuses_is_judged_whole(outcome: dict[str, Any]
                                                                 ) -> None:
    """Issue 38 F5: one call SGLang refuses inside a session ("partially updated"); in mode
    fail the session's end is a failed update naming every region fed before and after it."""
    run = outcome["sessions"]["one refused call"]
    begin, before, refused, after, end = run["answers"]
    assert begin[0] and before == [True, "Succeeded to update parameter online."]
    assert refused[0] is False and "partially updated" in refused[1]
    assert after[0] is True and end[0] is False
    assert "the session is not whole: update_weights_from_distributed failed in it" in end[1]
    for part in ("A_log", "dt_bias", "q_proj", "k_proj", "v_proj", "g_proj", "o_proj"):
        assert f"{P}" in end[1] and f": {part}" in end[1], part
    assert run["counted"] == 1


def test_a_later_bucket_writing_q_into_k_after_a_refused_call_fails_the_session(
        outcome: dict[str, Any]) -> None:
    run = outcome["sessions"]["one refused call, then q_in_k"]
    assert run["answers"][2][0] is False and run["answers"][3][0] is True
    ok, message = run["answers"][-1]
    assert ok is False
    assert "k_proj: holds what was fed as" in message
    assert "the session is not whole" in message


def test_sessions_in_warn_mode_pass_or_log_the_diagnosis(outcome: dict[str, Any]) -> None:
    right = outcome["sessions"]["warn right"]
    assert right["answers"][-1] == [True, "Success"] and right["lines"][-1].endswith(": OK")
    wrong = outcome["sessions"]["warn q_in_k"]
    assert wrong["answers"][-1] == [True, "Success"]
    (line,) = wrong["lines"]
    assert line.startswith(f"ERROR kda_tp.guard: {SESSION}tp rank 2/4: ")
    assert "FAIL (1 wrong)" in line and "k_proj: holds what was fed as" in line
