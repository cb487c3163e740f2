"""What the vLLM guard reports (issue 34, item 4; issue 34, item 1's one stderr line), through
vLLM 0.33.0's own loaders, ``reload_weights`` and ``WorkerBase`` on CPU: a failing rank's real
numbers in ``audit_llm``, every verdict counted (a FAIL raised in mode ``fail`` included, the
audit's own check never), the last verdict kept, the registration line in mode ``off``, and one
ERROR line naming the rank and the wrong parameters before a ``GuardError``. Helpers in
vllm_guard.py."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
import warnings

import pytest

from vllm_guard import (ATTN, CKPT, build, default_load, fake_llm, loading_as,
                        reload_config, worker)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's own import-time deprecations
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import inplace, record_metadata_for_reloading

from kda_tp import GuardError
from kda_tp.guard._modes import verdict_line
from kda_tp.guard._record import RECORD
from kda_tp.guard.vllm import audit_llm

pytestmark = [pytest.mark.engines, pytest.mark.usefixtures("guard_env_unset")]


def _workers(vc, kind: str, wrong_rank: int | None = None) -> list[tuple[int, types.SimpleNamespace]]:
    workers = []
    for rank in range(2):
        model = build(vc, kind, 2, rank)
        default_load(vc, model, CKPT[kind])
        workers.append((rank, worker(model, CKPT[kind])))
    if wrong_rank is not None:
        with torch.no_grad():  # its o_proj overwritten after start-up
            model = workers[wrong_rank][1].model_runner.get_model()
            model.model.layers[0].self_attn.o_proj.weight.zero_()
    return workers


def test_audit_llm_gives_a_failing_ranks_numbers_and_does_not_count_itself(vc):
    workers = _workers(vc, "kimi_linear", wrong_rank=1)
    before = dict(RECORD.checks)
    rank_0, rank_1 = audit_llm(fake_llm(workers))
    assert rank_0["ok"] is True and rank_1["ok"] is False
    assert rank_1["params"] == rank_0["params"] == 9
    assert rank_1["bytes"] == rank_0["bytes"] > 0 and rank_1["seconds"] > 0
    assert rank_1["line"].endswith("FAIL (1 wrong)") and ": 9 KDA parameters (" in rank_1["line"]
    assert rank_1["engine"] == "vllm-0.33-kimi-linear"
    # the audit's own checks are no load: not counted, and last is not the audit's line
    assert RECORD.checks == before
    assert not rank_1["last"].startswith("kda_tp guard: vllm audit:")


def test_a_fail_raised_at_a_reload_is_counted_last_and_logged_in_one_error_line(vc, caplog,
                                                                                guard_log):
    model = build(vc, "kimi_linear", 2, 1)
    record_metadata_for_reloading(model)  # as vLLM's initialize_model does
    default_load(vc, model, CKPT["kimi_linear"])
    before = RECORD.checks.get("reload_weights", 0)
    loading_as(model, 2, 0)  # the reload loads rank 0's slices
    config = reload_config("kimi_linear")
    with pytest.raises(GuardError) as caught, set_current_vllm_config(vc), \
            guard_log:
        inplace.reload_weights(config, model, None, str(CKPT["kimi_linear"]), True)
    first = str(caught.value).splitlines()[0]
    assert first.startswith("kda_tp guard: vllm reload_weights: tp rank 1/2: ")
    assert caught.value.result is not None and first == caught.value.result.line()
    assert RECORD.checks["reload_weights"] == before + 1 and RECORD.last == first
    # one ERROR line: the verdict, the rank and the wrong parameters' names
    (error,) = [r.getMessage() for r in caplog.records
                if r.name == "kda_tp.guard" and r.levelno == logging.ERROR]
    assert error.startswith(first + ": ") and "tp rank 1/2" in error
    assert error == f"{first}: {ATTN}A_log, {ATTN}dt_bias"  # what rank 0's slices spoil
    assert verdict_line("x", [f"p{i}" for i in range(5)] + ["p0"]) == "x: p0, p1, p2 +2 more"


def test_mode_off_registers_saying_it_checks_nothing():
    code = ("import logging, warnings; warnings.simplefilter('ignore'); "
            "logging.basicConfig(level=logging.INFO); "
            "from vllm.plugins import load_general_plugins; load_general_plugins()")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "VLLM_TARGET_DEVICE": "cpu",
                                            "KDA_TP_GUARD": "off"})
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [x for x in done.stderr.splitlines() if "kda_tp guard: registered" in x]
    assert line.endswith("kda_tp guard: registered in vLLM (mode off): checks nothing "
                         "(KDA_TP_GUARD=off); audit_llm still audits on request")
