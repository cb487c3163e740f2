"""Fixtures shared by the command-line tests (a module's own fixture of the same name wins)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kda_tp.synth import write_small_checkpoint

from tp_fixtures import SHARD_GEOMETRY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of :data:`tp_fixtures.SHARD_GEOMETRY` (two KDA layers, BF16), written once
    per test module, for the shard writer, safety and never-touch tests."""
    return write_small_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "ckpt", **SHARD_GEOMETRY, seed=3
    )
