"""Output safety of ``kda-tp shard``.

* A run killed (SIGKILL) at any point leaves no ``rank{r}`` directory that is not complete,
  nothing ``kda-tp verify`` accepts unless every rank was written, and a re-run finishes.
* The input is never written; an output directory inside the input is refused, and so is
  overwriting without ``--force``; ``--force`` replaces only what kda-tp wrote (a symbolic link
  in a rank's way is refused), and only once the new ranks are complete.
* Ranks of another world size are never mixed into one output, and a failed ``--force`` run
  leaves the previous output as it was.

(A full disk, files that change while open and concurrent runs: test_shard_hazards.py.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import kda_tp
import pytest
from kda_tp import SafetensorsSource, cli
from kda_tp.checkpoint import writer as _io
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, OutputError
from kda_tp.output import FILE_MARK
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from children import counting_setup, kda_tp_child
from tp_fixtures import hidden_entries, tree
from paths import DATA


def assert_complete_or_absent(out: Path, reference: Path) -> list[int]:
    """Every ``rank{r}`` under ``out`` is byte-identical to the reference's; returns the ranks."""
    present = []
    for entry in sorted(out.iterdir()) if out.exists() else []:
        if entry.name.startswith("rank"):
            assert tree(entry) == tree(reference / entry.name), f"{entry} is incomplete"
            present.append(int(entry.name[4:]))
    return present


# ----------------------------------------------------------------------------------------------
# killed runs

# Runs the CLI with one writer thread (the ranks one after the other, always in the same order)
# and counts its output events (children.counting_setup): each write and copy_file_range into a
# file, each rename (os.replace) and each directory removal (shutil.rmtree). With KILL_AT > 0
# it SIGKILLs itself just before event KILL_AT, so that a test kills a run inside the write of a
# file, between files, between ranks and around the renames, on any machine; with 0 it runs to
# the end and writes its events (kind and file name, one per line) to TRACE.
_COUNTING_CLI = counting_setup(
    "trace, event_at = Path(sys.argv.pop(1)), int(sys.argv.pop(1))",
    "os.kill(os.getpid(), signal.SIGKILL)",
    'trace.write_text("\\n".join(events))',
)


def _shard_cmd(checkpoint: Path, out: Path, trace: Path, kill_at: int, *extra: str) -> list[str]:
    return kda_tp_child(_COUNTING_CLI, trace, kill_at, "shard", checkpoint, "--tp-size", 2,
                        "--out", out, "--quiet", *extra)


def _events(checkpoint: Path, out: Path, *extra: str) -> list[str]:
    """The events of a whole run (see _COUNTING_CLI) that writes ``out``."""
    trace = out.parent / f"{out.name}.events"
    subprocess.run(_shard_cmd(checkpoint, out, trace, 0, *extra), timeout=120, check=True)
    return trace.read_text().splitlines()


def _kill_at(checkpoint: Path, out: Path, event: int, *extra: str) -> None:
    """Run the command and SIGKILL it just before its ``event``-th event (1-based)."""
    run = subprocess.run(_shard_cmd(checkpoint, out, Path(os.devnull), event, *extra),
                         timeout=120)
    assert run.returncode == -signal.SIGKILL, (event, run.returncode)


def test_kill_at_any_point_leaves_no_incomplete_rank(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    before = tree(checkpoint)
    events = _events(checkpoint, tmp_path / "whole")
    assert tree(tmp_path / "whole") == tree(reference)
    # Before every write, rename and removal, and before the first and every tenth copy into a
    # file: inside each file, between files, between ranks, around the renames.
    copies = [e.startswith("copy") for e in events]
    kills = [i for i, copy in enumerate(copies, 1)
             if not copy or i == 1 or not copies[i - 2] or i % 10 == 0]
    assert len(kills) >= 20 and any(copies)
    for i in kills:
        out = tmp_path / f"killed{i}"
        _kill_at(checkpoint, out, i)
        present = assert_complete_or_absent(out, reference)
        report = verify_shards(checkpoint, out) if out.exists() else None
        accepted = report is not None and report.ok
        # verify accepts the output only if every rank was renamed into place.
        assert accepted == (present == [0, 1]), (i, events[i - 1], present, report)
        # Rank 0 is there exactly when the kill came after its rename into place; the partial
        # directory of the rank being written is left behind.
        renamed = any(e.startswith("rename .rank0.partial-") for e in events[: i - 1])
        assert present == ([0] if renamed else []), (i, events[i - 1], present)
        assert hidden_entries(out), (i, events[i - 1])

        # Re-running the same command (in-process here, for speed): refused only where a
        # complete rank is already there...
        if present:
            with pytest.raises(OutputError, match="already exists; pass --force"):
                shard_checkpoint(checkpoint, out, 2)
        # ... and with --force where it was refused, it finishes cleanly: complete, verified,
        # no leftovers.
        shard_checkpoint(checkpoint, out, 2, force=bool(present))
        assert tree(out) == tree(reference)
        assert hidden_entries(out) == []
        assert verify_shards(checkpoint, out).ok
    assert tree(checkpoint) == before


def test_kill_during_a_forced_overwrite_never_half_deletes_a_rank(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    """With --force an existing rank is moved aside in one rename, never deleted in place: kills
    before and after every rename and removal of a directory."""
    whole = tmp_path / "whole"
    shutil.copytree(reference, whole)
    events = _events(checkpoint, whole, "--force")
    assert tree(whole) == tree(reference) and hidden_entries(whole) == []
    around = [i for i, e in enumerate(events, 1)
              if e.split()[0] in ("rename", "remove") and not e.split()[1].endswith(".partial")]
    kills = sorted({k for i in around for k in (i, i + 1) if k <= len(events)})
    # rank0 and rank1 moved aside, the new ones renamed in, the old ones removed.
    assert len(around) >= 6, events
    for i in kills:
        out = tmp_path / f"forced{i}"
        shutil.copytree(reference, out)
        _kill_at(checkpoint, out, i, "--force")
        assert_complete_or_absent(out, reference)
        shard_checkpoint(checkpoint, out, 2, force=True)
        assert tree(out) == tree(reference) and hidden_entries(out) == []


# ----------------------------------------------------------------------------------------------
# output directory rules


def test_never_writes_into_the_input(checkpoint: Path, tmp_path: Path) -> None:
    before = tree(checkpoint)
    entries = sorted(os.listdir(checkpoint))
    shard_checkpoint(checkpoint, tmp_path / "out", 2, backend="pread")
    # One file of the indexed checkpoint is refused before anything is read or written.
    with pytest.raises(CheckpointError, match="one file of an indexed checkpoint"):
        shard_checkpoint(
            checkpoint / "model-00001-of-00002.safetensors", tmp_path / "one", 1, layers=[0]
        )
    assert not (tmp_path / "one").exists()
    assert tree(checkpoint) == before and sorted(os.listdir(checkpoint)) == entries


@pytest.mark.parametrize(
    "where",
    ["same", "inside", "deep inside", "symlink into", "file's directory", "rank dir is the input"],
)
def test_output_in_the_input_is_refused(checkpoint: Path, tmp_path: Path, where: str) -> None:
    source = checkpoint
    if where == "same":
        out = checkpoint
    elif where == "inside":
        out = checkpoint / "tp2"
    elif where == "deep inside":
        out = checkpoint / "a" / "b"
    elif where == "symlink into":
        out = tmp_path / "link"
        out.symlink_to(checkpoint)
        out = out / "tp2"
    elif where == "file's directory":
        # A lone safetensors file (no index beside it) whose own directory is the output.
        lone = tmp_path / "lone"
        lone.mkdir()
        shutil.copy(checkpoint / "model-00001-of-00002.safetensors", lone)
        shutil.copy(checkpoint / "config.json", lone)
        source, out = lone / "model-00001-of-00002.safetensors", lone
    else:
        # Re-sharding OUT/rank0 into OUT with --force would delete the input.
        parent = tmp_path / "resharded"
        shutil.copytree(checkpoint, parent / "rank0")
        source, out = parent / "rank0", parent
    before = tree(source if source.is_dir() else source.parent)
    # (From the single file, only layer 0, which it holds whole.)
    layers = [0] if source.is_file() else None
    with pytest.raises(OutputError, match="input") as info:
        shard_checkpoint(source, out, 2, force=True, layers=layers)
    assert str(out) in str(info.value) or "rank0" in str(info.value)
    assert tree(source if source.is_dir() else source.parent) == before
    assert not (checkpoint / "tp2").exists() and not (checkpoint / "a").exists()


def test_refuses_to_overwrite_without_force(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    stale = out / "rank1" / "model-00001-of-00002.safetensors"
    # A rank that must be replaced only with --force: kda-tp's own file (its header's mark),
    # holding other bytes.
    write_safetensors(stale, [("x", "U8", (3,), 3, lambda: b"old")], {FILE_MARK: "0.0.1"})
    old = stale.read_bytes()
    with pytest.raises(OutputError, match=r"rank0 already exists; pass --force"):
        shard_checkpoint(checkpoint, out, 2)
    assert stale.read_bytes() == old
    shard_checkpoint(checkpoint, out, 2, force=True)
    assert tree(out) == tree(reference)

    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match=r"is not empty \(it holds notes.txt\); pass --force"):
        shard_checkpoint(checkpoint, other, 2)
    assert sorted(os.listdir(other)) == ["notes.txt"]
    shard_checkpoint(checkpoint, other, 2, force=True)
    assert (other / "notes.txt").read_text() == "mine" and verify_shards(checkpoint, other).ok


@pytest.mark.parametrize("target", ["a directory", "nothing"])
@pytest.mark.parametrize("name", ["rank0", ".rank1.partial-old-1", ".rank1.replaced-1"])
def test_force_over_a_symlink_in_a_rank_s_way_is_refused(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], target: str, name: str
) -> None:
    """``--force`` over ``OUT/rank0 -> elsewhere`` (or a dangling link, or a link under the
    partial name a killed run leaves): kda-tp never writes a link, so it is not kda-tp's to
    replace; refused in one line naming it, the link and what it points to untouched."""
    elsewhere = tmp_path / "elsewhere"
    if target == "a directory":
        elsewhere.mkdir()
        (elsewhere / "data.txt").write_text("keep")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(elsewhere)
    assert cli.main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(out), "--force",
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kda-tp: error: OutputError: ")
    assert f"{out / name}: a symbolic link (kda-tp writes directories, never links)" in err
    assert "only what it wrote, even with --force" in err
    assert sorted(os.listdir(out)) == [name] and (out / name).is_symlink()
    if target == "a directory":
        assert sorted(os.listdir(elsewhere)) == ["data.txt"]
        assert (elsewhere / "data.txt").read_text() == "keep"
    else:
        assert not elsewhere.exists()


@pytest.mark.parametrize("ranks", ["\u0660", "0,\u0661", "1" * 40])
def test_ranks_are_ascii_integers_as_tp_size_is(
        checkpoint: Path, tmp_path: Path, ranks: str) -> None:
    """``--ranks`` reads each rank as ``--tp-size`` is read: ASCII digits (``int`` also takes
    Arabic-Indic ones), at most 32 of them; otherwise one usage error, exit 2, nothing made."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "kda_tp", "shard", str(checkpoint), "--out",
                          str(out), "--quiet", "--tp-size", "2", "--ranks", ranks],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 2 and "argument --ranks: expected comma-separated integers" in (
        run.stderr.splitlines()[-1]), run.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp-size", "2", "--ranks", ""], "no ranks"),
        (["--tp-size", "2", "--ranks", "2"], "tp_rank 2 >= tp_size 2"),
        (["--tp-size", "2", "--ranks", "-1"], "tp_rank"),
        (["--tp-size", "3"], "divisible"),
    ],
)
def test_bad_sizes_are_plan_errors(
    checkpoint: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    args: list[str],
    message: str,
) -> None:
    out = tmp_path / "out"
    status = cli.main(["shard", str(checkpoint), "--out", str(out), "--quiet", *args])
    err = capsys.readouterr().err
    assert status == 2 and err.startswith("kda-tp: error: PlanError: ") and message in err, err
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize(
    "meta",
    [
        {"tp_size": "0"},
        {"tp_size": "-1"},
        {"tp_size": "x"},
        {"kda_tp_layers": "5"},
        {"kda_tp_layers": "[true]"},
        {"kda_tp_layers": "{"},
        {"tp_rank": "7"},
    ],
)
def test_verify_of_a_tampered_output_never_crashes(
    checkpoint: Path, reference: Path, tmp_path: Path, meta: dict[str, str]
) -> None:
    """The rank directories are checkpoints too: hostile metadata in them is an error or a
    reported problem, never a crash."""
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    for r in range(2):
        for path in sorted((out / f"rank{r}").glob("*.safetensors")):
            source = SafetensorsSource(path, "pread")
            names = source.names()
            file_meta = {**(source.files()[0][1] or {}), **meta}
            tensors = {n: source.get(n) for n in names}
            _io.write_safetensors(
                path,
                [(n, t.dtype, t.shape, t.nbytes, lambda t=t: t.data) for n, t in tensors.items()],
                file_meta,
            )
    try:
        report = verify_shards(checkpoint, out)
    except CheckpointError as e:
        assert "rank0" in str(e)
    else:
        assert not report.ok


THREE_LAYERS = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3)


@pytest.fixture
def three_layer_ckpt(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "three_layer_ckpt", **THREE_LAYERS, kda_layers=[0, 2], seed=5)


def test_ranks_of_another_world_size_get_the_advice_that_works(tmp_path, capsys):
    out = tmp_path / "out"
    shard_checkpoint(DATA / "kda_small", out, 4, qk_multiple=1, ranks=[0, 1])
    assert main(["shard", str(DATA / "kda_small"), "--tp-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rank0 holds output for tp_size 4, not 2; pass --force to replace it" in err
    assert "--ranks" not in err


def test_a_different_world_size_is_not_mixed_into_one_output(three_layer_ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 4, qk_multiple=128, ranks=[2, 3])
    with pytest.raises(kda_tp.OutputError, match="holds output for tp_size 4, not 2"):
        shard_checkpoint(three_layer_ckpt, out, 2)
    # --force replaces the other world size's ranks instead of leaving them beside the new ones.
    shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(three_layer_ckpt, out).ok


def test_verify_flags_ranks_beyond_tp_size(three_layer_ckpt, tmp_path):
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 2)
    shutil.copytree(rank_dir(out, 1), rank_dir(out, 2))
    report = verify_shards(three_layer_ckpt, out)
    assert not report.ok
    assert "rank directories [2] beyond tp_size 2" in report.problems[0]


def test_verify_on_an_empty_rank0(three_layer_ckpt, tmp_path):
    out = tmp_path / "out"
    rank_dir(out, 0).mkdir(parents=True)
    (rank_dir(out, 0) / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    report = verify_shards(three_layer_ckpt, out)
    assert not report.ok and "holds no safetensors file" in report.problems[0]


def test_verify_refuses_an_absurd_tp_size_quickly(three_layer_ckpt, tmp_path):
    out = tmp_path / "out"
    rank_dir(out, 0).mkdir(parents=True)
    write_safetensors(rank_dir(out, 0) / "model.safetensors",
                      [("x", "U8", (1,), 1, lambda: b"\0")], {"tp_size": str(10**9), "tp_rank": "0"})
    with pytest.raises(kda_tp.PlanError, match="divisible by tp_size"):
        verify_shards(three_layer_ckpt, out)


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("name", ["rank5", ".rank0.partial-keep"])
def test_an_input_inside_the_output_is_never_removed(three_layer_ckpt, tmp_path, name, force):
    out = tmp_path / "out"
    inside = out / name
    shutil.copytree(three_layer_ckpt, inside)
    before = sorted(p.name for p in inside.iterdir())
    with pytest.raises(kda_tp.OutputError, match="is \\(or holds\\) the input checkpoint"):
        shard_checkpoint(inside, out, 2, force=force)
    assert sorted(p.name for p in inside.iterdir()) == before


def files_under(out: Path) -> dict[Path, bytes]:
    """Every file under ``out``: its path relative to ``out`` -> its bytes."""
    return {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def fail_writing_rank1(monkeypatch: pytest.MonkeyPatch) -> None:
    """From now on (until ``monkeypatch.undo()``), writing rank 1's files fails as a full disk
    does (an OutputError from ``write_safetensors``); rank 0 is written as usual."""
    import kda_tp.shard.writer as shard_module

    real = shard_module.write_safetensors

    def fail_on_rank1(path, *args, **kwargs):
        if ".rank1.partial" in str(path):
            raise kda_tp.OutputError(f"{path}: write failed: [Errno 28] No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_module, "write_safetensors", fail_on_rank1)


def test_a_failed_force_rerun_restores_the_previous_output(three_layer_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 2)
    before = files_under(out)
    fail_writing_rank1(monkeypatch)
    with pytest.raises(kda_tp.OutputError, match="No space left"):
        shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    after = files_under(out)
    assert after == before
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(three_layer_ckpt, out).ok


def test_a_failed_force_run_keeps_another_world_size_s_ranks(
    three_layer_ckpt, tmp_path, monkeypatch
):
    """``--force`` removes another world size's ranks only once this run's ranks are all in
    place: a run that fails on rank 1 leaves them as they were."""
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 4, qk_multiple=128, ranks=[2, 3])
    before = files_under(out)
    fail_writing_rank1(monkeypatch)
    with pytest.raises(kda_tp.OutputError, match="No space left"):
        shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    after = files_under(out)
    assert after == before and sorted(p.name for p in out.iterdir()) == ["rank2", "rank3"]
    monkeypatch.undo()
    shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(three_layer_ckpt, out).ok
