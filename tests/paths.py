"""Where the tests' files are, computed once for every test directory (a folder per room of the
package, integration/, realengine/): the repository root, tests/ itself, and the fixture
checkpoints."""

from __future__ import annotations

from pathlib import Path

#: tests/: the shared helper modules (tp_fixtures, children, cli_run, full_disk, malformed,
#: dist_workers, audit_helpers, checkpoint_files, the vLLM and SGLang layer builders, this one)
#: and conftest.py's shared fixtures; passed to child scripts that import them.
TESTS = Path(__file__).resolve().parent
#: The repository root (README.md, docs/, tools/, examples/, pyproject.toml).
ROOT = TESTS.parent
#: The fixture checkpoints (kda_small, k3_small, k3_fp8_small, engine_ranks; each has a README).
DATA = TESTS / "data"
#: One rank's KDA parameters as vLLM 0.33.0 and SGLang 0.5.23 load them, with their checkpoints.
ENGINE_RANKS = DATA / "engine_ranks"
