"""``demo --keep DIR`` builds first, then replaces: a bad ``--num-layers`` is a usage error that
leaves DIR as it was; a demo that fails while building changes nothing in DIR; files a user put
inside the demo's ``checkpoint/`` or ``tp{N}/`` are refused by name, never deleted; outputs
kda-tp wrote beside them (the README's ``shards`` and ``vllm-tp4``) are left in place.

(The ``kept`` fixture, a first demo's directory, is tests/conftest.py's.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from kda_tp.cli import main
from kda_tp.output import DEMO_MAX_LAYERS
from kda_tp.output import MARK_NAME
from kda_tp.shard import verify_shards

from cli_run import demo, run


def files_and_modes(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` (hidden ones included): its bytes and mode bits."""
    return {str(p.relative_to(path)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.mark.parametrize("layers", ["0", "-1", str(DEMO_MAX_LAYERS + 1), "many"])
def test_a_bad_num_layers_is_a_usage_error_that_leaves_the_kept_demo(
    kept: Path, capsys: pytest.CaptureFixture[str], layers: str
) -> None:
    before = files_and_modes(kept)
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--num-layers", layers, "--keep", str(kept)])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("kda-tp: error:")]
    assert len(errors) == 1 and "argument --num-layers" in errors[0], err
    assert files_and_modes(kept) == before
    assert verify_shards(kept / "checkpoint", kept / "tp2").ok


def test_the_most_layers_the_demo_takes_is_documented() -> None:
    assert DEMO_MAX_LAYERS == 64


def test_a_failed_demo_leaves_the_earlier_one_and_no_staging(
    kept: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo that fails while building (here: the shard step) changes nothing in DIR."""
    import kda_tp.shard.writer

    before = files_and_modes(kept)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (planted)")

    monkeypatch.setattr(kda_tp.shard.writer, "shard_checkpoint", broken)
    with pytest.raises(OSError, match="planted"):
        demo(capsys, kept)
    assert files_and_modes(kept) == before
    assert sorted(os.listdir(kept)) == [MARK_NAME, "checkpoint", "tp2"]


@pytest.mark.parametrize("where", ["tp2", "tp2/rank0", "checkpoint"])
def test_user_files_inside_the_demo_s_outputs_are_refused_not_deleted(
    kept: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    (kept / where / "notes.txt").write_text("mine")
    before = files_and_modes(kept)
    status, out, err = demo(capsys, kept)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kda-tp: error: OutputError: ") and "notes.txt" in err
    assert "move it away, or choose another --keep DIR" in err
    assert files_and_modes(kept) == before


def test_the_readme_path_reruns_the_demo_and_keeps_kda_tp_s_other_outputs(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --keep try``, ``shard`` into try/shards, ``dump`` into try/vllm-tp4, then the
    demo again: it replaces its own entries and leaves the shard and the dump as they were."""
    status, _, err = run(capsys, "shard", kept / "checkpoint", "--tp-size", 2, "--out",
                         kept / "shards", "--quiet")
    assert status == 0, err
    status, _, err = run(capsys, "dump", kept / "checkpoint", "--engine",
                         "vllm-0.33-kimi-linear", "--tp-size", 2, "--out", kept / "vllm-tp2")
    assert status == 0, err
    siblings = {name: files_and_modes(kept / name) for name in ("shards", "vllm-tp2")}
    status, out, err = run(capsys, "demo", "--tp-size", 4, "--num-layers", 1, "--no-numeric",
                           "--keep", kept)
    assert status == 0, err
    assert f"shard: wrote ranks [0, 1, 2, 3] of 4 to {kept / 'tp4'}: " in out
    assert f"checkpoint (" in out and f"s: {kept / 'checkpoint'}\n" in out
    assert sorted(os.listdir(kept)) == [MARK_NAME, "checkpoint", "shards", "tp4", "vllm-tp2"]
    assert {name: files_and_modes(kept / name) for name in siblings} == siblings
    assert verify_shards(kept / "checkpoint", kept / "tp4").ok


def test_a_file_beside_the_demo_that_kda_tp_did_not_write_is_still_refused(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (kept / "shards").mkdir()
    (kept / "shards" / "model.safetensors").write_bytes(b"someone's")
    before = files_and_modes(kept)
    status, _, err = demo(capsys, kept)
    assert status == 2 and f"{kept / 'shards'}: model.safetensors: its header carries no" in err
    assert files_and_modes(kept) == before
