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


def test_demo_keep_makes_only_the_last_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 39 item 7: ``demo --keep /nonexistent/dir`` made every missing parent. Now the
    parent must exist: one refusal naming it, in the one wording of a missing path, and
    nothing made."""
    keep = tmp_path / "a" / "b" / "keep"
    status, out, err = demo(capsys, keep)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kda-tp: error: OutputError: {keep.parent}: no such file or "
                          "directory; demo --keep creates only the last directory"), err
    assert os.listdir(tmp_path) == []
    (tmp_path / "a" / "b").mkdir(parents=True)
    status, _, err = demo(capsys, keep)
    assert status == 0, err
    assert sorted(os.listdir(keep)) == [MARK_NAME, "checkpoint", "tp2"]


@pytest.mark.parametrize("errno_", ["EROFS", "EACCES"])
def test_demo_keep_on_a_directory_it_cannot_write_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
    errno_: str
) -> None:
    """Issue 38 F15: ``demo --keep`` on a read-only file system, or a directory this user may
    not write into, ended in a traceback and exit 1. (The refusal is planted where the OS
    gives it, the demo's working directory: tests may run as root, whom modes do not stop.)"""
    import errno
    import tempfile

    keep = tmp_path / "keep"
    keep.mkdir()
    code = getattr(errno, errno_)

    def refused(*args: object, **kwargs: object) -> str:
        raise OSError(code, os.strerror(code), str(keep / ".kda-tp-demo-x"))

    monkeypatch.setattr(tempfile, "mkdtemp", refused)
    status, out, err = demo(capsys, keep)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kda-tp: error: OutputError: {keep}: cannot create the demo's "
                          f"working directory in it: [Errno {code}] {os.strerror(code)}"), err
    assert os.listdir(keep) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a 0555 directory")
def test_demo_keep_on_an_unwritable_directory_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    keep.chmod(0o555)
    try:
        status, _, err = demo(capsys, keep)
    finally:
        keep.chmod(0o755)
    assert status == 2 and err.count("\n") == 1 and "Permission denied" in err, err
