"""Issue 38 F11: ``shard`` copied every file beside the checkpoint into every rank (an
``optimizer.pt``, ``pytorch_model.bin`` weights) while the size it announced counted tensors
only (201 MB written, "999 kB" announced).

Now the files it copies (config, tokenizer, code: ``companion_files``) are counted and named in
the announcement, and heavy files (weights or training state in another format than
safetensors of 1 MB or more, any file of 100 MB or more: ``heavy_files``) are refused by name
before anything is written, or left out of every rank with ``--skip-heavy-files``.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from kda_tp import SafetensorsSource, oracle
from kda_tp.errors import CheckpointError
from kda_tp.shard import shard_checkpoint, shard_sizes, verify_shards
from kda_tp.shard.rankdir import (
    HEAVY_FILE_BYTES,
    WEIGHT_FILE_BYTES,
    companion_files,
    heavy_files,
)

from cli_run import run


@pytest.fixture
def with_files(checkpoint: Path, tmp_path: Path) -> Path:
    """The module's checkpoint with an optimizer state (2 MB) and a small ``training_args.bin``
    and ``tokenizer.json`` beside it."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "optimizer.pt").write_bytes(os.urandom(2 * WEIGHT_FILE_BYTES))
    (ckpt / "training_args.bin").write_bytes(b"\x80\x04small pickle")
    (ckpt / "tokenizer.json").write_text('{"model": {}}')
    return ckpt


def test_heavy_files_are_told_apart_from_companions(with_files: Path) -> None:
    source = SafetensorsSource(with_files)
    assert [p.name for p in companion_files(source)] == [
        "config.json", "tokenizer.json", "training_args.bin"]
    (heavy,) = heavy_files(source)
    assert heavy[0].name == "optimizer.pt" and heavy[1] == 2 * WEIGHT_FILE_BYTES
    assert "another format than safetensors" in heavy[2]
    # Any file of HEAVY_FILE_BYTES or more (sparse: no disk spent).
    with open(with_files / "notes.txt", "wb") as f:
        f.truncate(HEAVY_FILE_BYTES)
    assert [p.name for p, _, _ in heavy_files(source)] == ["notes.txt", "optimizer.pt"]


def test_a_heavy_file_is_refused_before_anything_is_written(
    with_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=r"optimizer\.pt \(2\.0 MB: weights or training "
                       r"state in another format than safetensors\) would be copied whole"):
        shard_checkpoint(with_files, out, 2)
    assert not out.exists()
    status, stdout, err = run(capsys, "shard", with_files, "--tp-size", 2, "--out", out)
    assert status == 2 and stdout == "" and err.count("\n") == 1, err
    assert "pass --skip-heavy-files (skip_heavy_files=True) to leave it out" in err
    assert not out.exists()


def test_skip_heavy_files_leaves_them_out_and_says_so(
    with_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    status, stdout, err = run(capsys, "shard", with_files, "--tp-size", 2, "--out", out,
                              "--skip-heavy-files", "--json")
    assert status == 0, err
    assert (f"kda-tp: warning: {with_files / 'optimizer.pt'} (2.00 MB: weights or training "
            "state in another format than safetensors) is left out of every rank "
            "(--skip-heavy-files)") in err
    doc = json.loads(stdout)
    assert doc["skipped_heavy"] == [str(with_files / "optimizer.pt")]
    for r in (0, 1):
        names = sorted(os.listdir(out / f"rank{r}"))
        assert "optimizer.pt" not in names
        assert {"config.json", "tokenizer.json", "training_args.bin"} <= set(names)
    assert verify_shards(with_files, out).ok
    assert oracle.verify(with_files, out) == []  # the spec's restatement agrees
    # One copied in by hand (or by an older kda-tp) is not a stray file.
    shutil.copy2(with_files / "optimizer.pt", out / "rank1")
    assert verify_shards(with_files, out).ok


def test_the_announcement_counts_and_names_the_copied_files(
    with_files: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (with_files / "optimizer.pt").unlink()
    copied = sum((with_files / n).stat().st_size
                 for n in ("config.json", "tokenizer.json", "training_args.bin"))
    sizes = shard_sizes(with_files, 2)
    assert sizes.companions == ("config.json", "tokenizer.json", "training_args.bin")
    assert sizes.companion_bytes == copied
    assert sizes.written_bytes == sizes.total_bytes + 2 * copied
    status, stdout, err = run(capsys, "shard", with_files, "--tp-size", 2, "--out",
                              tmp_path / "out", "--json")
    assert status == 0, err
    first = err.splitlines()[0]
    assert first.startswith("shard: writing ") and first.endswith(
        ", and copying 3 other files into every rank (config.json, tokenizer.json, "
        f"training_args.bin: {copied} B per rank)"), first  # (under 1 kB: in bytes)
    doc = json.loads(stdout)
    assert doc["sizes"]["companion_bytes"] == copied
    assert doc["sizes"]["written_bytes"] == sizes.written_bytes
    # What each rank holds besides its tensors is what was announced.
    for r in (0, 1):
        assert sum((tmp_path / "out" / f"rank{r}" / n).stat().st_size
                   for n in sizes.companions) == copied


def test_kda_only_copies_no_file_and_refuses_none(with_files: Path, tmp_path: Path) -> None:
    """``--kda-only`` copies no companion file, so a heavy one does not stand in its way."""
    sizes = shard_sizes(with_files, 2, kda_only=True)
    assert sizes.companions == () and sizes.companion_bytes == 0
    shard_checkpoint(with_files, tmp_path / "out", 2, kda_only=True)
    assert "optimizer.pt" not in os.listdir(tmp_path / "out" / "rank0")
