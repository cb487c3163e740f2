"""A run never removes what it did not make (issue 38, F7 to F10), judged by what the run itself
created or what a mark names, never by a process id or a name alone:

* F7: a refused ``shard`` run removed ``OUT/.rank{r}.partial-<its own pid>`` unchecked; two
  containers on one volume both run their writer as pid 1, so the refused run deleted the live
  run's partial directory. Partial directories are now named per run and a run removes only
  those it created.
* F8: a user's file at ``OUT/.tp{N}.lock`` was refused as "not a kda-tp lock", then unlinked on
  the way out. A lock file is now unlinked only when empty or holding a holder line.
* F9: ``demo --keep DIR --tp-size N`` replaced the user's own ``kda-tp shard --out DIR/tpN``.
  The demo now replaces only what its mark names.
* F10: after a kill between moving ``rank{r}`` aside and renaming the new rank into place, a
  refused rerun removed the aside: the output lost that rank. An aside whose rank is missing
  is now put back.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path

import pytest
from kda_tp.errors import OutputError
from kda_tp.output import MARK_NAME, write_mark
from kda_tp.shard import shard_checkpoint, verify_shards

from cli_run import demo, run

HOLDER = "pid 1 on container-a, started 2026-01-02T03:04:05Z\n"


def files_and_modes(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` (hidden ones included): its bytes and mode bits."""
    return {str(p.relative_to(path)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


# --- F7: partial directories are the run's own ------------------------------------------------


def test_a_refused_run_never_removes_another_run_s_partial_of_the_same_pid(
    checkpoint: Path, tmp_path: Path
) -> None:
    """Another container's writer (pid 1 there, this test's pid here) is writing rank 0: its
    partial directory carries this process's pid, and it holds rank 0's lock. This run is
    refused by that lock, and the live partial directory stays, byte for byte."""
    out = tmp_path / "out"
    out.mkdir()
    live = out / f".rank0.partial-{os.getpid()}"
    live.mkdir()
    write_mark(live, "rank", ["model.safetensors"])
    (live / "model.safetensors").write_bytes(b"half written by the live run")
    before = files_and_modes(out)
    with open(out / ".rank0.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(HOLDER)
        held.flush()
        with pytest.raises(OutputError, match="rank 0 is being written by another kda-tp run"):
            shard_checkpoint(checkpoint, out, 2)
        assert files_and_modes(out) == {**before, ".rank0.lock": (HOLDER.encode(), 0o644)}


def test_partial_directories_are_named_by_the_run_not_the_pid(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two runs in one process name their partial directories apart (each run's own id)."""
    import kda_tp.shard.writer as writer

    seen: list[str] = []
    real = writer.write_mark

    def spy(directory: Path, kind: str, *args: object, **kwargs: object) -> None:
        seen.append(directory.name)
        real(directory, kind, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(writer, "write_mark", spy)
    for name in ("a", "b"):
        shard_checkpoint(checkpoint, tmp_path / name, 2, ranks=[0])
    partials = sorted(set(seen))
    assert len(partials) == 2 and all(p.startswith(f".rank0.partial-{os.getpid()}-")
                                      for p in partials), partials


# --- F8: a lock path holding the user's file is never removed ---------------------------------


@pytest.mark.parametrize("lock", [".tp2.lock", ".rank0.lock", ".rank1.lock"])
def test_a_user_s_file_at_a_lock_path_is_refused_and_kept(
    checkpoint: Path, tmp_path: Path, lock: str
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / lock).write_text("my notes\n")
    with pytest.raises(OutputError, match="holds something else than a kda-tp lock's holder"):
        shard_checkpoint(checkpoint, out, 2)
    assert sorted(os.listdir(out)) == [lock]
    assert (out / lock).read_text() == "my notes\n"


def test_a_user_s_world_lock_file_is_kept_through_the_command_line(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / ".tp2.lock").write_text("my notes\n")
    for flags in ([], ["--force"], ["--wait"]):
        status, _, err = run(capsys, "shard", checkpoint, "--tp-size", 2, "--out", out,
                             "--quiet", *flags)
        assert status == 2 and err.count("\n") == 1, err
        assert f"{out / '.tp2.lock'}: holds something else than a kda-tp lock's holder" in err
        assert (out / ".tp2.lock").read_text() == "my notes\n"


def test_a_long_file_starting_with_a_holder_line_is_not_a_lock(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A holder line followed by more than a holder line's bytes is not a lock kda-tp wrote."""
    out = tmp_path / "out"
    out.mkdir()
    text = HOLDER + "x" * 600 + "\n"
    (out / ".tp2.lock").write_text(text)
    with pytest.raises(OutputError, match="holds something else"):
        shard_checkpoint(checkpoint, out, 2)
    assert (out / ".tp2.lock").read_text() == text


# --- F9: demo --keep replaces only what its mark names ----------------------------------------


def test_demo_keep_never_replaces_the_user_s_own_shard_output(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kda-tp shard DIR/checkpoint --out DIR/tp4`` is the user's; ``demo --keep DIR
    --tp-size 4`` is refused in one line and leaves it as it was."""
    status, _, err = run(capsys, "shard", kept / "checkpoint", "--tp-size", 4, "--out",
                         kept / "tp4", "--quiet", "--qk-multiple", 1)
    assert status == 0, err
    before = files_and_modes(kept)
    status, out, err = demo(capsys, kept, "--tp-size", 4)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"kda-tp: error: OutputError: {kept / 'tp4'}: the demo would write "
                          f"tp4 here, and the demo's {MARK_NAME} does not name it"), err
    assert "choose another --keep DIR" in err
    assert files_and_modes(kept) == before
    # Its own tp2 it still replaces.
    status, _, err = demo(capsys, kept)
    assert status == 0, err
    assert verify_shards(kept / "checkpoint", kept / "tp4").ok


# --- F10: an aside without its rank is put back -----------------------------------------------


def _killed_between_aside_and_rename(out: Path) -> Path:
    """What a ``--force`` run killed between ``put_aside`` and ``take_name`` leaves: rank 0
    moved aside (one rename), no ``rank0``."""
    aside = out / ".rank0.replaced-4242-0123456789abcdef"
    os.rename(out / "rank0", aside)
    return aside


def test_a_refused_rerun_puts_a_killed_run_s_aside_back(
    checkpoint: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shard_checkpoint(checkpoint, out, 2)
    before = files_and_modes(out)
    _killed_between_aside_and_rename(out)
    # Refused (rank1 exists, no --force): rank 0 is back, the output as it was.
    status, _, err = run(capsys, "shard", checkpoint, "--tp-size", 2, "--out", out, "--quiet")
    assert status == 2 and err.count("\n") == 1, err
    assert f"{out / 'rank0'} already exists; pass --force" in err
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]
    assert files_and_modes(out) == before
    assert verify_shards(checkpoint, out).ok


def test_a_rerun_of_other_ranks_leaves_a_killed_run_s_aside(
    checkpoint: Path, tmp_path: Path
) -> None:
    """A run that does not write rank 0 (does not hold its lock) leaves its aside alone."""
    out = tmp_path / "out"
    shard_checkpoint(checkpoint, out, 2)
    aside = _killed_between_aside_and_rename(out)
    shard_checkpoint(checkpoint, out, 2, ranks=[1], force=True)
    assert aside.is_dir() and not (out / "rank0").exists()
    # The run that writes rank 0 puts it back, then replaces it (--force) as kda-tp's own.
    shard_checkpoint(checkpoint, out, 2, ranks=[0], force=True)
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]
    assert verify_shards(checkpoint, out).ok


def test_an_aside_beside_its_rank_is_still_removed(checkpoint: Path, tmp_path: Path) -> None:
    """Killed after the new rank took the name: the aside is the replaced copy, removed."""
    out = tmp_path / "out"
    shard_checkpoint(checkpoint, out, 2)
    aside = out / ".rank0.replaced-4242-0123456789abcdef"
    shutil_copytree(out / "rank0", aside)
    shard_checkpoint(checkpoint, out, 2, ranks=[0], force=True)
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]


def shutil_copytree(src: Path, dst: Path) -> None:
    import shutil

    shutil.copytree(src, dst)
