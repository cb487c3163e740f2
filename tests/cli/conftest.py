"""Fixtures shared by the command-line tests (a module's own fixture of the same name wins)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kda_tp.shard import shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from tp_fixtures import SHARD_GEOMETRY


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint of :data:`tp_fixtures.SHARD_GEOMETRY` (two KDA layers, BF16), written once
    per test module, for the shard writer, safety and never-touch tests."""
    return write_small_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "ckpt", **SHARD_GEOMETRY, seed=3
    )


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted tp_size 2 run of ``checkpoint``: what every other run must reproduce
    byte for byte (the shard safety and hazard tests)."""
    out = tmp_path_factory.mktemp("reference") / "out"
    shard_checkpoint(checkpoint, out, 2)
    assert verify_shards(checkpoint, out).ok
    return out
