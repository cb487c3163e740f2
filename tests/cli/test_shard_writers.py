"""Two writers on one output, what a failed run leaves, stray files under ``verify``, and what
``shard`` says it will write.

* A second ``kda-tp shard`` into the ``--out`` of a live one is refused at once (one
  ``kda-tp: error:`` line naming the holder's pid, exit 2) and touches nothing, or with
  ``--wait`` waits for it; the first run finishes, byte-identical to an undisturbed run, at every
  stagger tried: the second starts while the first is held at a state (its first write into a
  partial directory, its first copy, just before and after renaming rank 0, just before renaming
  rank 1, its last event), a hook in the first's code, never a time.
* plain files named ``rank0``/``rank1`` are refused, ``--force`` or not, and kept; a failed run
  (full disk, truncated input, unreadable companion file) removes what it created, the output
  directory and its parents included, and nothing that was there before.
* ``verify`` fails, naming the file, on anything in a rank directory that ``shard`` does not write.
* ``shard`` prints the bytes it will write per rank and in all before writing (and suggests
  ``--kda-only`` when the tensors copied whole into every rank dominate); ``--json`` carries them.
"""

from __future__ import annotations

import errno
import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kda_tp.checkpoint import files as _files
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, OutputError
from kda_tp.output import write_mark
from kda_tp.shard import ShardSizes, shard_checkpoint, shard_sizes, verify_shards
from kda_tp.synth import write_small_checkpoint

from children import counting_setup, kda_tp_child, shard_cmd
from cli_run import run
from full_disk import FullDisk
from tp_fixtures import SHARD_GEOMETRY, tree

#: How long any one child may take on a loaded 2-core machine (a bound, not a synchronisation).
BOUND = 120


def everything(path: Path) -> list[str]:
    """Every entry under ``path`` (directories, hidden ones included), relative, sorted."""
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


# ----------------------------------------------------------------------------------------------
# two writers

# Runs the CLI with one writer thread and counts its output events, as the kill tests do
# (tests/cli/test_shard_safety.py): each write and copy_file_range into a file, each rename and each
# directory removal. Just before event PAUSE_AT it writes the event to the TOLD pipe and blocks
# reading the RESUME pipe: the test holds the run at that state while it starts a second writer.
# With PAUSE_AT 0 it runs through and writes all its events to TOLD at exit.
_PAUSING_CLI = counting_setup(
    "told, resume, event_at = (int(sys.argv.pop(1)) for _ in range(3))",
    'os.write(told, (events[-1] + "\\n").encode()); os.read(resume, 1)',
    'os.write(told, "\\n".join(events).encode())',
)

# A second writer that says on TOLD when it is about to block on a rank's lock (--wait).
_WAITING_CLI = """
import fcntl, os, sys, types
import kda_tp.output.locks as locks
told = int(sys.argv.pop(1))
def flock(fd, op):
    name = os.readlink(f"/proc/self/fd/{fd}")
    if op == fcntl.LOCK_EX and os.path.basename(name).startswith(".rank"):
        os.write(told, b"waiting\\n")
    return fcntl.flock(fd, op)
locks.fcntl = types.SimpleNamespace(**{**vars(fcntl), "flock": flock})
"""


def _read_line(fd: int) -> str:
    """One line from a child's pipe, waiting at most BOUND seconds for it."""
    data = b""
    while not data.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], BOUND)
        assert ready, f"no word from the child within {BOUND} s (got {data!r})"
        chunk = os.read(fd, 4096)
        assert chunk, f"the child exited first (got {data!r})"
        data += chunk
    return data.decode().strip()


class Paused:
    """A ``kda-tp shard`` child held just before its ``pause_at``-th output event."""

    def __init__(self, checkpoint: Path, out: Path, pause_at: int):
        told_r, told_w = os.pipe()
        resume_r, self.resume = os.pipe()
        self.proc = subprocess.Popen(
            kda_tp_child(_PAUSING_CLI, told_w, resume_r, pause_at, *shard_cmd(checkpoint, out)[3:]),
            pass_fds=(told_w, resume_r), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        os.close(told_w)
        os.close(resume_r)
        self.told = told_r
        self.event = _read_line(told_r)

    def finish(self) -> tuple[int, str]:
        os.write(self.resume, b"x")
        os.close(self.resume)
        _, err = self.proc.communicate(timeout=BOUND)
        os.close(self.told)
        return self.proc.returncode, err


def _all_events(checkpoint: Path, out: Path) -> list[str]:
    told_r, told_w = os.pipe()
    proc = subprocess.Popen(kda_tp_child(_PAUSING_CLI, told_w, 0, 0, *shard_cmd(checkpoint, out)[3:]),
                            pass_fds=(told_w,), stdout=subprocess.DEVNULL)
    os.close(told_w)
    assert proc.wait(timeout=BOUND) == 0
    with os.fdopen(told_r) as f:
        return f.read().splitlines()


#: The id a run names its hidden entries by (``kda_tp.output.names.run_id``).
RUN_ID = re.compile(r"-[0-9]+-[0-9a-f]{16}")


def _staggers(events: list[str]) -> dict[str, int]:
    """The 1-based events at which the second writer starts, by the state the first is in."""
    first_rename = next(i for i, e in enumerate(events, 1) if e.startswith("rename .rank0"))
    return {
        "partial directory exists, first write": next(
            i for i, e in enumerate(events, 1) if e.startswith("write")),
        "first copy into a file": next(i for i, e in enumerate(events, 1) if e.startswith("copy")),
        "renaming rank 0": first_rename,
        "rank 0 in place": first_rename + 1,
        "renaming rank 1 (the last event)": next(
            i for i, e in enumerate(events, 1) if e.startswith("rename .rank1")),
    }


def test_a_second_writer_is_refused_and_the_first_finishes(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    events = _all_events(checkpoint, tmp_path / "whole")
    assert tree(tmp_path / "whole") == tree(reference)
    assert events[-1].startswith("rename .rank1.partial-")
    for state, at in _staggers(events).items():
        out = tmp_path / f"out{at}"
        first = Paused(checkpoint, out, at)
        # The same event but for the run's own id (a pid and random digits).
        assert RUN_ID.sub("", first.event) == RUN_ID.sub("", events[at - 1])
        before = everything(out), tree(out)
        second = subprocess.run(shard_cmd(checkpoint, out), capture_output=True, text=True,
                                timeout=BOUND)
        # Refused at once, one line naming the holder; nothing of the first's touched.
        assert second.returncode == 2, (state, second.stderr)
        assert second.stderr.count("\n") == 1 and second.stderr.startswith(
            "kda-tp: error: OutputError: "), (state, second.stderr)
        assert f"rank 0 is being written by another kda-tp run (held by pid {first.proc.pid} " \
               f"on " in second.stderr, (state, second.stderr)
        assert "started 20" in second.stderr and "--wait" in second.stderr
        assert (everything(out), tree(out)) == before, state
        # The first run finishes as if alone, and leaves nothing hidden behind (its locks go).
        status, err = first.finish()
        assert status == 0, (state, err)
        assert tree(out) == tree(reference), state
        assert everything(out) == everything(reference), state
        assert verify_shards(checkpoint, out).ok


@pytest.mark.parametrize("force", [False, True])
def test_a_second_writer_with_wait_waits_for_the_first(
    checkpoint: Path, reference: Path, tmp_path: Path, force: bool
) -> None:
    events = _all_events(checkpoint, tmp_path / "whole")
    at = _staggers(events)["renaming rank 0" if force else "partial directory exists, first write"]
    out = tmp_path / "out"
    first = Paused(checkpoint, out, at)
    told_r, told_w = os.pipe()
    second = subprocess.Popen(
        kda_tp_child(_WAITING_CLI, told_w, *shard_cmd(checkpoint, out, "--wait")[3:],
                     *(["--force"] if force else [])),
        pass_fds=(told_w,), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    os.close(told_w)
    assert _read_line(told_r) == "waiting"  # about to block on rank 0's lock
    status, err = first.finish()
    assert status == 0, err
    _, second_err = second.communicate(timeout=BOUND)
    os.close(told_r)
    if force:  # it waited, then replaced the first's ranks by the same bytes
        assert second.returncode == 0, second_err
    else:  # it waited, then found the ranks there
        assert second.returncode == 2 and "rank0 already exists; pass --force" in second_err
        assert second_err.count("\n") == 1
    assert tree(out) == tree(reference)
    assert everything(out) == everything(reference)


def test_a_stale_partial_is_one_whose_lock_is_free(
    checkpoint: Path, reference: Path, tmp_path: Path
) -> None:
    """A partial directory and a lock file left by a dead writer (the kernel released its lock)
    are cleaned by the next run, whatever their pid or age."""
    out = tmp_path / "out"
    partial = out / f".rank0.partial-{os.getpid()}"  # a live pid: no guessing
    partial.mkdir(parents=True)
    write_mark(partial, "rank", [])  # what a writer does first in its partial directory
    (partial / "model.safetensors").write_bytes(b"half")
    (out / ".rank1.lock").write_text("pid 1 on elsewhere, started 2020-01-01T00:00:00Z\n")
    shard_checkpoint(checkpoint, out, 2)
    assert tree(out) == tree(reference) and everything(out) == everything(reference)


def test_a_held_lock_in_python_names_the_holder(checkpoint: Path, tmp_path: Path) -> None:
    import fcntl

    out = tmp_path / "out"
    out.mkdir()
    with open(out / ".rank1.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on node7, started 2026-01-02T03:04:05Z\n")
        held.flush()
        with pytest.raises(OutputError, match=r"rank 1 is being written by another kda-tp "
                           r"run \(held by pid 4242 on node7, started 2026-01-02T03:04:05Z;"):
            shard_checkpoint(checkpoint, out, 2)
        # Rank 0 alone is free: writing it is fine.
        shard_checkpoint(checkpoint, out, 2, ranks=[0])
    assert sorted(p.name for p in out.iterdir()) == [".rank1.lock", "rank0"]


# ----------------------------------------------------------------------------------------------
# leftovers


def test_force_over_plain_files_named_like_ranks_leaves_them(
    checkpoint: Path, reference: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Files named ``rank0``/``rank1`` are not kda-tp's: refused with or without --force,
    kept as they were; once moved away, the run writes the reference."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "rank0").write_text("not a directory")
    (out / "rank1").write_text("nor this")
    for force in ([], ["--force"]):
        assert main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(out), "--quiet",
                     *force]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{out / 'rank0'}: not a directory; kda-tp " in err
        assert everything(out) == ["rank0", "rank1"]
        assert (out / "rank0").read_text() == "not a directory"
    for name in ("rank0", "rank1"):
        (out / name).unlink()
    assert main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    assert tree(out) == tree(reference) and everything(out) == everything(reference)


def test_a_full_disk_removes_the_directories_the_run_created(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "mine.txt").write_text("the user's")
    monkeypatch.setattr(_files, "open", FullDisk(300_000), raising=False)  # one rank fits
    with pytest.raises(OutputError, match="No space left on device"):
        shard_checkpoint(checkpoint, keep / "a" / "b" / "out", 2)
    assert everything(keep) == ["mine.txt"]  # a/, a/b/ and out/ are gone, keep/ stays
    # An output directory that was there stays, with what it held (--force writes beside it).
    (keep / "out").mkdir()
    (keep / "out" / "notes.txt").write_text("kept")
    with pytest.raises(OutputError, match="No space left on device"):
        shard_checkpoint(checkpoint, keep / "out", 2, force=True)
    assert everything(keep) == ["mine.txt", "out", "out/notes.txt"]
    # The CLI: one line, exit 2, and the same clean-up.
    status = main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(keep / "x" / "out"),
                   "--quiet"])
    assert status == 2 and everything(keep) == ["mine.txt", "out", "out/notes.txt"]


def test_a_truncated_input_leaves_nothing(checkpoint: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    second = ckpt / "model-00002-of-00002.safetensors"
    # Truncated before the run: refused while opening, before anything is created.
    data = second.read_bytes()
    second.write_bytes(data[:-100])
    with pytest.raises(CheckpointError):
        shard_checkpoint(ckpt, tmp_path / "a" / "out", 2)
    assert not (tmp_path / "a").exists()
    # Truncated while the run reads it (pread: an error, not SIGBUS): the ranks written so far
    # and the directories created are removed.
    second.write_bytes(data)
    import kda_tp.shard.writer as shard_module

    real = shard_module.write_safetensors

    def truncate_then_write(path, *args, **kwargs):
        if path.name == second.name and ".rank1." in str(path.parent):
            with open(second, "r+b") as f:
                f.truncate(len(data) // 2)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_module, "write_safetensors", truncate_then_write)
    with pytest.raises(CheckpointError, match="truncated while open"):
        shard_checkpoint(ckpt, tmp_path / "b" / "out", 2, backend="pread")
    assert not (tmp_path / "b").exists()


def test_an_unreadable_companion_file_leaves_nothing(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    (ckpt / "tokenizer.json").write_text("{}")
    import kda_tp.shard.writer as shard_module

    def denied(*_args, **_kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(ckpt / "tokenizer.json"))

    # Unreadable from the start (the check before writing; as root, chmod would not stop it).
    real_open = open
    monkeypatch.setattr(shard_module, "open",
                        lambda p, *a, **k: denied() if Path(p).name == "tokenizer.json"
                        else real_open(p, *a, **k), raising=False)
    status = main(["shard", str(ckpt), "--tp-size", "2", "--out", str(tmp_path / "a" / "out"),
                   "--quiet"])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1
    assert err.startswith("kda-tp: error: CheckpointError: ") and "tokenizer.json: cannot be read" in err
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()
    # Unreadable when it is copied: the run fails and removes what it created.
    monkeypatch.setattr(shard_module.shutil, "copy2", denied)
    with pytest.raises(OutputError, match="Permission denied"):
        shard_checkpoint(ckpt, tmp_path / "b" / "out", 2)
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------------------------
# verify: files shard does not write


@pytest.mark.parametrize("stray", ["extra.safetensors", "notes.txt", ".hidden", "subdir/"])
def test_verify_fails_on_a_file_shard_did_not_write(
    checkpoint: Path, reference: Path, tmp_path: Path, capsys, stray: str
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    target = out / "rank1" / stray.rstrip("/")
    if stray.endswith("/"):
        target.mkdir()
    elif stray.endswith(".safetensors"):  # a real, loadable file no index names
        shutil.copy(out / "rank1" / "model-00001-of-00002.safetensors", target)
    else:
        target.write_text("x")
    report = verify_shards(checkpoint, out)
    assert not report.ok
    assert report.problems == [
        f"{target}: rank 1 holds {target.name}, which shard does not write (the input has no "
        "such file); remove it, or shard again"
    ]
    assert main(["verify", str(checkpoint), str(out), "--quiet"]) == 1
    assert str(target) in capsys.readouterr().out


def test_verify_of_kda_only_output_flags_a_companion_file(checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shard_checkpoint(checkpoint, out, 2, kda_only=True)
    assert verify_shards(checkpoint, out).ok
    shutil.copy(checkpoint / "config.json", out / "rank0" / "config.json")
    report = verify_shards(checkpoint, out)
    assert [p.split(":")[0] for p in report.problems] == [str(out / "rank0" / "config.json")]


# ----------------------------------------------------------------------------------------------
# what shard will write


def _span_bytes(path: Path) -> dict[str, int]:
    """Tensor name -> its data bytes, from a safetensors header read here (not by kda_tp)."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {n: v["data_offsets"][1] - v["data_offsets"][0]
            for n, v in header.items() if n != "__metadata__"}


def _dir_bytes(path: Path) -> dict[str, int]:
    return {n: b for f in sorted(path.glob("*.safetensors")) for n, b in _span_bytes(f).items()}


# Per KDA layer of SHARD_GEOMETRY (BF16 but A_log/dt_bias F32): sliced over the ranks q/k/v
# 3*256*64*2, convs 3*256*4*2, f_b/g_b 2*256*16*2, b_proj 4*64*2, A_log 4*4, dt_bias 256*4,
# o_proj 64*256*2 = 155152 bytes; whole on every rank f_a/g_a 2*16*64*2 and o_norm 64*2 = 4224.
SLICED, REPLICATED = 155152, 4224


@pytest.mark.parametrize(("vocab", "tp"), [(64, 2), (4096, 2), (4096, 4)])
def test_sizes_before_writing_are_what_is_written(
    tmp_path: Path, capsys, vocab: int, tp: int
) -> None:
    ckpt = write_small_checkpoint(tmp_path / "ckpt", **SHARD_GEOMETRY, vocab_size=vocab, seed=1)
    # Not KDA: embed_tokens and lm_head (vocab x 64 BF16), the norms (5 x 64 BF16).
    other = 2 * vocab * 64 * 2 + 5 * 64 * 2
    kda = 2 * (SLICED // tp + REPLICATED)
    sizes = shard_sizes(ckpt, tp, qk_multiple=1)
    config = (ckpt / "config.json").stat().st_size  # the one file copied into every rank
    assert sizes == ShardSizes(input_bytes=2 * (SLICED + REPLICATED) + other,
                               ranks=tuple(range(tp)), kda_bytes=(kda,) * tp,
                               other_bytes=(other,) * tp, companions=("config.json",),
                               companion_bytes=config)
    assert sizes.total_bytes == tp * (kda + other)
    assert sizes.suggest_kda_only == (other > kda)
    # The input size is what its files hold; each rank's what the run writes.
    input_bytes = _dir_bytes(ckpt)
    assert sizes.input_bytes == sum(input_bytes.values())

    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", str(tp), "--out", str(out), "--json",
                 "--qk-multiple", "1"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["sizes"] == sizes.to_dict() and doc["bytes_written"] == sizes.total_bytes
    for r in range(tp):
        written = _dir_bytes(out / f"rank{r}")
        assert sum(written.values()) == sizes.rank_bytes[r]
        assert sum(b for n, b in written.items() if ".self_attn." in n) == kda
    # Printed on stderr before the progress, with the hint when the copies dominate.
    lines = captured.err.splitlines()
    assert lines[0].startswith(f"shard: writing {_decimal(sizes.total_bytes)} of tensors for "
                               f"{tp} ranks ({_decimal(kda + other)} per rank: ")
    assert lines[0].endswith(f"from a {_decimal(sizes.input_bytes)} input, and copying 1 other "
                             f"file into every rank (config.json: {_decimal(config)} per rank)")
    hint = [line for line in lines if line.startswith("shard: hint: ")]
    assert len(hint) == (1 if other > kda else 0)
    if hint:
        assert "--kda-only" in hint[0] and f"({_decimal(tp * kda)})" in hint[0]
        # --kda-only writes exactly the KDA bytes, and suggests nothing.
        kda_only = shard_sizes(ckpt, tp, qk_multiple=1, kda_only=True)
        assert kda_only.other_bytes == (0,) * tp and kda_only.kda_bytes == (kda,) * tp
        assert not kda_only.suggest_kda_only


def _decimal(n: int) -> str:
    """The CLI's byte format, restated from its rule rather than copied from its code: 3
    significant digits (2 decimals under 10, 1 under 100) in the decimal unit that the number of
    digits of ``n`` calls for (kB from 4 digits, MB from 7, GB from 10, TB from 13 on)."""
    if n < 1000:
        return f"{n} B"
    power = min((len(str(n)) - 1) // 3, 4)
    x = n / 10 ** (3 * power)
    digits = 2 if x < 10 else 1 if x < 100 else 0
    return f"{x:.{digits}f} {'kMGT'[power - 1]}B"


def test_shard_result_to_dict_is_what_shard_json_prints_first(checkpoint: Path, tmp_path: Path,
                                                              capsys) -> None:
    result = shard_checkpoint(checkpoint, tmp_path / "api", 2)
    mine = result.to_dict()
    assert mine == {"ok": True, "out_dir": str(tmp_path / "api"), "tp_size": 2, "ranks": [0, 1],
                    "rank_dirs": [str(tmp_path / "api" / "rank0"), str(tmp_path / "api" / "rank1")],
                    "bytes_written": result.bytes_written, "seconds": result.seconds}
    out = tmp_path / "cli"
    assert main(["shard", str(checkpoint), "--tp-size", "2", "--out", str(out), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert list(doc)[:len(mine)] == list(mine)
    assert doc["rank_dirs"] == [str(out / "rank0"), str(out / "rank1")]
    assert doc["bytes_written"] == result.bytes_written and doc["ok"] is True


def test_shard_prints_its_sizes_progress_and_summary_in_one_unit(
    kept: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, out, err = run(capsys, "shard", kept / "checkpoint", "--tp-size", 2, "--out",
                           tmp_path / "out")
    assert status == 0, err
    writing = re.match(r"shard: writing ([\d.]+) (MB) of tensors for 2 ranks \(", err)
    assert writing, err
    total = writing.group(1)
    assert f"shard: {total} of {total} MB (100%), " in err
    assert re.fullmatch(rf"wrote ranks \[0, 1\] of 2 to {re.escape(str(tmp_path / 'out'))}: "
                        rf"{total} MB of tensors in [\d.]+ s \([\d.]+ MB/s written\)\n", out), out
    assert " GB" not in err + out
