"""Where the guard's verdicts go (kda_tp.guard._modes: ``passed``, ``failed``), with no engine:
an OK line at INFO and a failing verdict at ERROR on the logger ``kda_tp.guard``, whatever an
engine's logger is set to; in mode warn also a GuardWarning; in mode fail the ERROR line
first, then the GuardError; on stderr through the guard's own handler when nothing else
shows them, and never twice when an application's handler does."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from kda_tp.errors import GuardError, GuardWarning, KdaTpError
from kda_tp.guard._modes import LOGGER, StderrFallback, failed, passed

OK = "kda_tp guard: test: tp rank 0/2: 9 KDA parameters, 64 bytes, 0.001 s: OK"
FAIL = "kda_tp guard: test: tp rank 1/2: 9 KDA parameters, 64 bytes, 0.001 s: FAIL (1 wrong)"
TEXT = f"{FAIL}\nthe KDA weights ...:\n  rank 1 model.layers.0.self_attn.A_log: values differ"

# A process whose engine logger is at ERROR with its own handler (vLLM's shape under TRL's
# VLLM_LOGGING_LEVEL=ERROR), the root logger not configured: the verdicts still reach stderr.
CHILD = f"""
import logging, sys, warnings
engine = logging.getLogger("vllm")
engine.addHandler(logging.StreamHandler(sys.stdout))
engine.setLevel(logging.ERROR)
from kda_tp.errors import GuardError
from kda_tp.guard._modes import failed, passed
passed({OK!r})
failed({TEXT!r}, ["model.layers.0.self_attn.A_log"], "warn")
try:
    failed({TEXT!r}, ["model.layers.0.self_attn.A_log"], "fail")
except GuardError as error:
    print("raised:", str(error).splitlines()[-1], file=sys.stderr)
"""


def test_verdicts_reach_stderr_whatever_the_engine_logger_is_set_to():
    done = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONWARNINGS": "default"})
    assert done.returncode == 0, done.stderr
    lines = done.stderr.splitlines()
    levels = [(line.split(" ", 1)[0], line.split(" ", 3)[3]) for line in lines
              if line.startswith(("INFO ", "ERROR "))]
    assert levels == [("INFO", OK), ("ERROR", FAIL),
                      ("ERROR", f"{FAIL}: model.layers.0.self_attn.A_log")]
    # warn: the whole diagnosis logged, and issued through warnings
    assert "  rank 1 model.layers.0.self_attn.A_log: values differ" in lines
    assert any("GuardWarning: " + FAIL in line for line in lines)
    # fail: the ERROR line first (above), then the error, its message the diagnosis
    assert lines[-1] == "raised: (set KDA_TP_GUARD=warn to go on anyway)"
    assert done.stdout == ""  # nothing through the engine's handler


def test_an_application_handler_shows_them_once(caplog, capsys):
    """A handler above the guard's logger that lets a record through (pytest's here, an
    application's ``basicConfig``) shows it; the guard's own handler then stays silent."""
    guard = logging.getLogger(LOGGER)
    assert [type(h) for h in guard.handlers] == [StderrFallback]
    assert guard.level == logging.INFO
    with caplog.at_level(logging.INFO, logger=LOGGER):
        passed(OK)
        with pytest.warns(GuardWarning) as warned:
            failed(TEXT, ["A_log"], "warn")
        with pytest.raises(GuardError) as raised:
            failed(TEXT, ["A_log"], "fail")
        failed(TEXT, ["A_log"], "off")
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.INFO, OK), (logging.ERROR, TEXT), (logging.ERROR, f"{FAIL}: A_log")]
    assert capsys.readouterr().err == ""
    (warning,) = warned
    assert isinstance(warning.message, KdaTpError) and str(warning.message) == TEXT
    assert str(raised.value) == f"{TEXT}\n(set KDA_TP_GUARD=warn to go on anyway)"
