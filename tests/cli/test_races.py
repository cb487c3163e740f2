"""kda-tp never removes or replaces what it did not write, judged at the moment it does (issue
33): what another process puts into an output while a run writes is kept, and the run says so.

The races are made deterministic through the writers' own pause points: ``shard``'s
``report_sizes`` callback (called once every check has passed, before the first byte is
written), the dump's ``write_safetensors`` (it builds one file per rank), and the moves' own
functions (``kda_tp.output.moves``): each plants what another process would, at that moment.

* ``shard --force``: a file put into a rank directory it replaces, or into another world size's
  rank directory it removes, is kept (the run refused and undone, or the file kept beside);
  without ``--force`` a ``rank1/`` made during the run is refused, never moved aside.
* ``dump``: an engine's ``model-rank-1-part-0.safetensors`` written during the build is refused,
  never replaced; two dumps of different world sizes into one ``--out`` cannot both run.
* Two ``shard`` runs of different world sizes on one ``--out``: the second is refused naming
  the first, or waits for it with ``--wait``.
* ``--force`` judges each file by its own mark: a user's ``config.json`` or safetensors file put
  under a name kda-tp used is refused; kda-tp's own file there is replaced.
* The rename that never replaces, with ``renameat2`` and with its fallback.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from kda_tp import cli
from kda_tp.audit import dump as dump_module
from kda_tp.audit.dump import write_engine_dump
from kda_tp.checkpoint import write_safetensors
from kda_tp.errors import OutputError
from kda_tp.output import FILE_MARK, MARK_NAME, moves, take_name
from kda_tp.shard import shard_checkpoint, verify_shards

from children import shard_cmd, wait_blocked
from paths import DATA
from tp_fixtures import hidden_entries, tree

KIMI_LINEAR = DATA / "engine_ranks" / "ckpt_kl"
ENGINE = "vllm-0.33-kimi-linear"
#: Seconds a child command may take (a bound on a hang, not a speed assertion).
BOUND = 300


def kda_tp(*args: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kda_tp", *map(str, args)], capture_output=True,
                          text=True, timeout=BOUND)


def one_line(run: subprocess.CompletedProcess[str], error: str = "OutputError") -> str:
    """Assert a refusal (exit 2, one ``kda-tp: error:`` line); return the line."""
    assert run.returncode == 2, run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"kda-tp: error: {error}: "), run.stderr
    return run.stderr


def visible(out: Path) -> dict[str, str]:
    """Every file under ``out`` but the hidden entries at its top (locks): path -> sha256."""
    return {k: v for k, v in tree(out).items() if not k.startswith(".")}


@pytest.fixture(scope="module")
def tp4(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted tp_size 4 run of ``checkpoint``."""
    out = tmp_path_factory.mktemp("tp4") / "out"
    shard_checkpoint(checkpoint, out, 4, qk_multiple=64)
    return out


# --- shard ------------------------------------------------------------------------------------


def test_a_file_put_into_a_rank_being_replaced_is_kept_and_the_run_refused(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)

    def plant(_sizes: object) -> None:  # another process, once every check has passed
        (out / "rank0" / "notes.txt").write_text("mine")

    with pytest.raises(OutputError, match=r"rank0: it holds notes\.txt, which kda-tp did not "
                       r"write; kda-tp replaces only what it wrote"):
        shard_checkpoint(checkpoint, out, 2, force=True, report_sizes=plant)
    # Nothing lost: the note where it was written, the previous output as it was, no leftovers.
    assert (out / "rank0" / "notes.txt").read_text() == "mine"
    assert visible(out) == {**tree(reference), "rank0/notes.txt": visible(out)["rank0/notes.txt"]}
    assert hidden_entries(out) == []


def test_a_file_put_into_another_world_size_s_rank_undoes_the_forced_run(
    checkpoint: Path, tp4: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(tp4, out)

    def plant(_sizes: object) -> None:
        (out / "rank3" / "optimizer.pt").write_text("state")

    with pytest.raises(OutputError, match=r"rank3: it holds optimizer\.pt, which kda-tp did not "
                       r"write; kda-tp removes only what it wrote"):
        shard_checkpoint(checkpoint, out, 2, force=True, report_sizes=plant)
    # The run is undone: the tp_size 4 output is as it was, the file with it.
    after = visible(out)
    assert after.pop("rank3/optimizer.pt") and after == tree(tp4)
    assert hidden_entries(out) == []


def test_a_rank_directory_made_during_a_run_without_force_is_refused_not_moved(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"

    def plant(_sizes: object) -> None:
        (out / "rank1").mkdir()
        (out / "rank1" / "optimizer.pt").write_text("state")

    with pytest.raises(OutputError, match=r"rank1: appeared while kda-tp wrote rank 1"):
        shard_checkpoint(checkpoint, out, 2, report_sizes=plant)
    # Left where it was made; this run's rank 0 taken back; nothing hidden left.
    assert sorted(os.listdir(out)) == ["rank1"]
    assert os.listdir(out / "rank1") == ["optimizer.pt"]


def test_a_file_put_in_after_the_last_look_is_kept_beside(
    checkpoint: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A file written into a replaced rank directory after it was moved aside and judged (by a
    process holding it open): the old directory is removed file by file, the note kept, the
    run done, the place named on stderr."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    real = moves.read_mark

    def read_mark(directory: Path):  # discard_ours looks at the mark first
        if ".replaced-" in directory.name:
            (directory / "notes.txt").write_text("late")
        return real(directory)

    monkeypatch.setattr(moves, "read_mark", read_mark)
    result = shard_checkpoint(checkpoint, out, 2, force=True)
    kept = [out / f"rank{r}.kept-{os.getpid()}" for r in (0, 1)]
    assert result.kept == tuple(kept)
    assert os.listdir(kept[0]) == ["notes.txt"] and (kept[0] / "notes.txt").read_text() == "late"
    assert {k: v for k, v in visible(out).items() if ".kept-" not in k} == tree(reference)
    assert verify_shards(checkpoint, out).ok
    # The command line names each on stderr, and its JSON lists them.
    for path in kept:
        shutil.rmtree(path)
    assert cli.main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(out), "--force",
                     "--quiet", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["kept"] == [str(p) for p in kept]
    assert captured.err.splitlines() == [
        f"kda-tp: warning: {p} holds files another process put there while kda-tp replaced or "
        "removed it; kda-tp removed only what it wrote and kept the rest there" for p in kept]


def test_a_file_put_in_between_the_check_and_the_move_goes_back(
    checkpoint: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between the last look at ``rank0/`` and its move aside: the move is judged again where
    it went, and moved back."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    real = moves._rename

    def rename(src: Path, dst: Path) -> None:
        if src.name == "rank0" and ".replaced-" in dst.name:
            (src / "notes.txt").write_text("just in time")
        real(src, dst)

    monkeypatch.setattr(moves, "_rename", rename)
    with pytest.raises(OutputError, match=r"rank0: it holds notes\.txt.*put there while kda-tp "
                       "was writing"):
        shard_checkpoint(checkpoint, out, 2, force=True)
    assert (out / "rank0" / "notes.txt").read_text() == "just in time"
    after = visible(out)
    assert after.pop("rank0/notes.txt") and after == tree(reference)
    assert hidden_entries(out) == []


def test_shard_force_judges_each_file_by_its_own_mark(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    # Your own config.json where kda-tp's copy was: refused by its SHA-256, kept.
    (out / "rank0" / "config.json").write_text('{"my": "own config"}')
    run = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force", "--quiet")
    assert "rank0: its config.json: it is not the file kda-tp wrote there" in one_line(run)
    assert (out / "rank0" / "config.json").read_text() == '{"my": "own config"}'
    shutil.copy(reference / "rank0" / "config.json", out / "rank0" / "config.json")
    # A safetensors file of yours under a rank file's name: refused by its header.
    mine = out / "rank1" / "model-00001-of-00002.safetensors"
    write_safetensors(mine, [("x", "U8", (3,), 3, lambda: b"abc")])
    before = mine.read_bytes()
    run = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force", "--quiet")
    assert (f"rank1: its model-00001-of-00002.safetensors: its header carries no {FILE_MARK}"
            in one_line(run))
    assert mine.read_bytes() == before
    # kda-tp's own file there (its header's mark): replaced.
    write_safetensors(mine, [("x", "U8", (3,), 3, lambda: b"abc")], {FILE_MARK: "0.1.0"})
    assert kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force",
                  "--quiet").returncode == 0
    assert tree(out) == tree(reference)


def test_two_shards_of_different_world_sizes_never_share_an_output(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    second = shard_cmd(checkpoint, out, "--qk-multiple", 64, "--ranks", "2,3", tp_size=4)
    refused: list[subprocess.CompletedProcess[str]] = []

    def run_second(_sizes: object) -> None:  # while the first holds its locks
        refused.append(subprocess.run(second, capture_output=True, text=True, timeout=BOUND))

    shard_checkpoint(checkpoint, out, 2, report_sizes=run_second)
    line = one_line(refused[0])
    assert (f"another kda-tp run is writing tp_size 2 output into it (held by pid {os.getpid()} "
            in line and "lock file .tp2.lock); one output directory holds one world size" in line
            and "pass --wait" in line)
    assert tree(out) == tree(reference) and hidden_entries(out) == []
    assert verify_shards(checkpoint, out).ok


def test_a_second_world_size_with_wait_waits_for_the_first(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    waiting: list[subprocess.Popen[str]] = []

    def start_second(_sizes: object) -> None:  # held until it blocks on the first's world lock
        waiting.append(subprocess.Popen(
            shard_cmd(checkpoint, out, "--qk-multiple", 64, "--ranks", "2,3", "--wait",
                      tp_size=4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        wait_blocked(waiting[0], BOUND)

    shard_checkpoint(checkpoint, out, 2, report_sizes=start_second)
    _, err = waiting[0].communicate(timeout=BOUND)
    # It waited, then found the first's ranks: another world size, refused without --force.
    assert waiting[0].returncode == 2 and err.count("\n") == 1, err
    assert "holds output for tp_size 2, not 4" in err
    assert tree(out) == tree(reference) and hidden_entries(out) == []


def test_force_with_wait_waits_for_another_world_size_s_rank_lock(
    checkpoint: Path, tp4: Path, reference: Path, tmp_path: Path
) -> None:
    """``--force`` removing rank 3 of a tp_size 4 output waits for rank 3's lock with
    ``--wait`` (it said "pass --wait" to a run that had passed it, and never waited)."""
    out = tmp_path / "out"
    shutil.copytree(tp4, out)
    with open(out / ".rank3.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on node7, started 2026-01-02T03:04:05Z\n")
        held.flush()
        run = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force", "--quiet")
        assert "rank 3 is being written by another kda-tp run (held by pid 4242" in one_line(run)
        second = subprocess.Popen(shard_cmd(checkpoint, out, "--force", "--wait"),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_blocked(second, BOUND)
    _, err = second.communicate(timeout=BOUND)
    assert second.returncode == 0, err
    assert tree(out) == tree(reference) and hidden_entries(out) == []


# --- dump -------------------------------------------------------------------------------------


@pytest.fixture
def planting(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[object]]:
    """Run each callable appended to the list right after the dump writes its first file."""
    actions: list[object] = []
    real = dump_module.write_safetensors

    def write(path: Path, *args: object, **kwargs: object) -> int:
        written = real(path, *args, **kwargs)
        while actions:
            action = actions.pop(0)
            assert callable(action)
            action()
        return written

    monkeypatch.setattr(dump_module, "write_safetensors", write)
    yield actions


def test_an_engine_s_file_written_during_a_dump_is_never_replaced(
    tmp_path: Path, planting: list[object]
) -> None:
    out = tmp_path / "dump"
    engine_file = out / "model-rank-1-part-0.safetensors"
    planting.append(lambda: engine_file.write_bytes(b"the engine's own dump"))
    with pytest.raises(OutputError, match=r"model-rank-1-part-0\.safetensors: appeared while "
                       "kda-tp was writing"):
        write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=4)
    assert engine_file.read_bytes() == b"the engine's own dump"
    assert os.listdir(out) == [engine_file.name]  # no file of the refused dump left


def test_an_engine_s_file_written_during_a_forced_dump_is_never_replaced(
    tmp_path: Path, planting: list[object]
) -> None:
    out = tmp_path / "dump"
    write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=4)
    before = tree(out)
    theirs = out / "model-rank-2-part-0.safetensors"
    planting.append(lambda: write_safetensors(theirs, [("x", "U8", (1,), 1, lambda: b"e")]))
    with pytest.raises(OutputError, match=r"model-rank-2-part-0\.safetensors: its header "
                       f"carries no {FILE_MARK}"):
        write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=4, force=True)
    assert {k: v for k, v in tree(out).items() if k != theirs.name} == {
        k: v for k, v in before.items() if k != theirs.name}
    assert theirs.read_bytes().endswith(b"e") and sorted(os.listdir(out)) == sorted(before)


def test_two_dumps_of_different_world_sizes_never_share_an_output(
    tmp_path: Path, planting: list[object]
) -> None:
    out = tmp_path / "dump"
    second = [sys.executable, "-m", "kda_tp", "dump", str(KIMI_LINEAR), "--engine", ENGINE,
              "--tp-size", "2", "--out", str(out)]
    refused: list[subprocess.CompletedProcess[str]] = []
    planting.append(lambda: refused.append(subprocess.run(second, capture_output=True, text=True,
                                                          timeout=BOUND)))
    write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=4)
    line = one_line(refused[0])
    assert "another kda-tp run is writing tp_size 4 output into it (held by pid" in line
    assert sorted(os.listdir(out)) == [f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    # With --wait (and --force) the second waits for the first, then replaces its dump.
    waiting: list[subprocess.Popen[str]] = []

    def start() -> None:
        waiting.append(subprocess.Popen([*second, "--wait", "--force"], stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True))
        wait_blocked(waiting[0], BOUND)

    planting.append(start)
    write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=4, force=True)
    _, err = waiting[0].communicate(timeout=BOUND)
    assert waiting[0].returncode == 0, err
    assert sorted(os.listdir(out)) == [f"model-rank-{r}-part-0.safetensors" for r in range(2)]
    run = kda_tp("audit", KIMI_LINEAR, out)
    assert run.returncode == 0 and "of 2 (vllm-0.33-kimi-linear)" in run.stdout, run.stdout


def test_dump_force_judges_each_file_by_its_own_mark(tmp_path: Path) -> None:
    out = tmp_path / "dump"
    write_engine_dump(KIMI_LINEAR, out, engine=ENGINE, tp_size=2)
    theirs = out / "model-rank-1-part-0.safetensors"
    write_safetensors(theirs, [("x", "U8", (1,), 1, lambda: b"e")])
    before = tree(out)
    run = kda_tp("dump", KIMI_LINEAR, "--engine", ENGINE, "--tp-size", 2, "--out", out,
                 "--force")
    assert f"model-rank-1-part-0.safetensors: its header carries no {FILE_MARK}" in one_line(run)
    assert tree(out) == before


# --- the rename that never replaces -----------------------------------------------------------


@pytest.mark.parametrize("native", [True, False], ids=["renameat2", "fallback"])
def test_take_name_takes_a_free_name_and_never_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, native: bool
) -> None:
    if native and moves._RENAMEAT2 is None:
        pytest.skip("no renameat2 in this C library")
    if not native:
        monkeypatch.setattr(moves, "_RENAMEAT2", None)
    (tmp_path / "new").write_text("new")
    (tmp_path / "taken").write_text("theirs")
    with pytest.raises(FileExistsError):
        take_name(tmp_path / "new", tmp_path / "taken")
    assert (tmp_path / "taken").read_text() == "theirs" and (tmp_path / "new").exists()
    take_name(tmp_path / "new", tmp_path / "free")
    assert (tmp_path / "free").read_text() == "new" and not (tmp_path / "new").exists()
    # Directories: onto a file, a non-empty directory or an empty one, refused alike.
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / MARK_NAME).write_text("{}")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "data").write_text("keep")
    (tmp_path / "empty").mkdir()
    for target in ("taken", "full", "empty"):
        with pytest.raises(FileExistsError):
            take_name(tmp_path / "dir", tmp_path / target)
    assert (tmp_path / "full" / "data").read_text() == "keep"
    assert (tmp_path / "empty").is_dir() and (tmp_path / "taken").read_text() == "theirs"
    take_name(tmp_path / "dir", tmp_path / "moved")
    assert (tmp_path / "moved" / MARK_NAME).exists() and not (tmp_path / "dir").exists()
