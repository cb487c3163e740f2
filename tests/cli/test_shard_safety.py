"""Output safety of ``kda-tp shard`` and reading checkpoints that change or are shared.

* A run killed (SIGKILL) at any point leaves no ``rank{r}`` directory that is not complete,
  nothing ``kda-tp verify`` accepts unless every rank was written, and a re-run finishes.
* The input is never written; an output directory inside the input is refused, and so is
  overwriting without ``--force``; ``--force`` replaces only what kda-tp wrote (a symbolic link
  in a rank's way is refused), and only once the new ranks are complete.
* A full disk (a small tmpfs where the machine allows mounting one, and an injected ENOSPC
  everywhere) is an ``OutputError`` naming the file, with no partial output left.
* A file truncated or replaced after it was opened: no crash with ``pread``, and the documented
  behaviour with ``mmap``.
* Threads sharing one source, and processes writing different ranks into one output directory,
  give the same bytes as one run.
"""

from __future__ import annotations

import errno
import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import kda_tp
import numpy as np
import pytest
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, _io, cli
from kda_tp._io import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, OutputError
from kda_tp.rankdir import MARK_NAME
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from children import kda_tp_child
from tp_fixtures import tree
from paths import DATA

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def reference(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted tp_size 2 run: what every other run must reproduce byte for byte."""
    out = tmp_path_factory.mktemp("reference") / "out"
    shard_checkpoint(checkpoint, out, 2)
    assert verify_shards(checkpoint, out).ok
    return out


def hidden_entries(out: Path) -> list[str]:
    """Partial directories and temporary files left anywhere under ``out`` (kda-tp's mark in
    each rank directory, ``.kda-tp.json``, is part of the output, not left over)."""
    return sorted(str(p.relative_to(out)) for p in out.rglob(".*")
                  if p.name != MARK_NAME) if out.exists() else []


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
# and counts its output events: each write and copy_file_range into a file, each rename
# (os.replace) and each directory removal (shutil.rmtree). With KILL_AT > 0 it SIGKILLs itself
# just before event KILL_AT, so that a test kills a run inside the write of a file, between
# files, between ranks and around the renames, on any machine; with 0 it runs to the end and
# writes its events (kind and file name, one per line) to TRACE.
_COUNTING_CLI = """
import os, shutil, signal, sys
from pathlib import Path
from kda_tp import _io
trace, kill_at = Path(sys.argv.pop(1)), int(sys.argv.pop(1))
events = []
def counted(kind, function, arg):
    def call(*args, **kwargs):
        events.append(f"{kind} {Path(args[arg]).name}")
        if len(events) == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return function(*args, **kwargs)
    return call
_io._checked_write = counted("write", _io._checked_write, 1)
_io._copy_file_range = counted("copy", _io._copy_file_range, 1)
os.replace = counted("rename", os.replace, 0)
shutil.rmtree = counted("remove", shutil.rmtree, 0)
os.cpu_count = lambda: 1
if not kill_at:
    import atexit
    atexit.register(lambda: trace.write_text("\\n".join(events)))
"""


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
    stale.write_bytes(b"old")  # a rank that must be replaced only with --force
    with pytest.raises(OutputError, match=r"rank0 already exists; pass --force"):
        shard_checkpoint(checkpoint, out, 2)
    assert stale.read_bytes() == b"old"
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
@pytest.mark.parametrize("name", ["rank0", ".rank1.partial-old-1"])
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


# ----------------------------------------------------------------------------------------------
# full disk


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir()
    if not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    run = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
        timeout=60,
    )
    return run.returncode == 0


def test_full_disk_on_a_small_tmpfs(checkpoint: Path, reference: Path, tmp_path: Path) -> None:
    """A real ENOSPC: a 320 KiB tmpfs holds one rank (about 192 KB) but not two."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "320k"):
        pytest.skip("cannot mount a tmpfs here (needs root); the injected ENOSPC tests still run")
    try:
        out = disk / "out"
        with pytest.raises(OutputError, match="No space left on device") as info:
            shard_checkpoint(checkpoint, out, 2)
        assert str(out) in str(info.value)
        # Everything this run created was removed, the output directory included.
        assert not out.exists()
        # The space is free again.
        usage = shutil.disk_usage(disk)
        assert usage.used <= 8192, usage
        # The CLI says so too, exit status 2.
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "kda_tp",
                "shard",
                str(checkpoint),
                "--tp-size",
                "2",
                "--out",
                str(out),
                "--quiet",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and "OutputError" in run.stderr and "No space left" in run.stderr
        assert not out.exists() and list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False, timeout=60)


class _FullDisk:
    """A stand-in for ``open(fd, "wb")`` whose writes fail with ENOSPC past ``budget`` bytes
    (shared by every file, like a disk) or, with ``at="flush"``, whose flush fails."""

    def __init__(self, budget: int, at: str = "write"):
        self.budget, self.at, self.lock = budget, at, threading.Lock()

    def __call__(self, fd: int, mode: str):
        real = open(fd, mode)  # noqa: SIM115
        disk = self

        class File:
            def write(self, data) -> int:
                n = memoryview(data).nbytes
                with disk.lock:
                    if disk.at == "write" and n > disk.budget:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                    disk.budget -= n
                return real.write(data)

            def flush(self) -> None:
                if disk.at == "flush":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                real.flush()

            def __getattr__(self, name):
                return getattr(real, name)

        return File()


# A rank is about 192 KB: at 300 KB one rank completes before the other fails.
@pytest.mark.parametrize("budget", [0, 1000, 150_000, 300_000])
def test_injected_enospc_on_write(
    checkpoint: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    monkeypatch.setattr(_io, "open", _FullDisk(budget), raising=False)
    out = tmp_path / "out"
    with pytest.raises(OutputError, match="No space left on device") as info:
        shard_checkpoint(checkpoint, out, 2)
    assert str(out) in str(info.value)
    # Even a rank that fitted is removed, and so is the output directory this run created.
    assert not out.exists()
    monkeypatch.undo()
    shard_checkpoint(checkpoint, out, 2, force=True)  # and the disk freed, a re-run finishes
    assert tree(out) == tree(reference)


def test_injected_enospc_on_flush_and_on_copying_the_config(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_io, "open", _FullDisk(0, at="flush"), raising=False)
    with pytest.raises(OutputError, match="No space left on device"):
        shard_checkpoint(checkpoint, tmp_path / "a", 2)
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()

    def copy2(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("kda_tp.shard.shutil.copy2", copy2)
    with pytest.raises(OutputError, match="writing rank .* failed: .*No space left on device"):
        shard_checkpoint(checkpoint, tmp_path / "b", 2)
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------------------------
# files that change while open, and the pread backend


def _single_file(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    """A file of 8 F32 tensors of 64 KiB each; returns it and the tensors' bytes."""
    rng = np.random.default_rng(0)
    arrays = {f"t{i}": rng.standard_normal(16384).astype(np.float32) for i in range(8)}
    path = tmp_path / "w.safetensors"
    _io.write_safetensors(
        path, [(n, "F32", (16384,), a.nbytes, lambda a=a: a) for n, a in arrays.items()]
    )
    return path, {n: a.tobytes() for n, a in arrays.items()}


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_replaced_file_keeps_its_old_contents(tmp_path: Path, backend: str) -> None:
    """Rewriting a checkpoint by rename (what _io and most tools do) while it is open: the open
    source keeps reading the file it opened."""
    path, data = _single_file(tmp_path)
    source = SafetensorsSource(path, backend)
    early = source.get("t0")
    other = tmp_path / "other.safetensors"
    _io.write_safetensors(other, [("t0", "U8", (3,), 3, lambda: b"new")])
    os.replace(other, path)
    for name, want in data.items():
        assert bytes(source.get(name)) == want
    assert bytes(early) == data["t0"]


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_truncation_after_open_is_an_error_not_a_crash(tmp_path: Path, backend: str) -> None:
    path, data = _single_file(tmp_path)
    source = SafetensorsSource(path, backend)
    header = path.stat().st_size - sum(len(b) for b in data.values())
    # Cut the file in the middle of t5: t0..t4 are still there, t5..t7 are not.
    os.truncate(path, header + 5 * 65536 + 100)
    for i, (name, want) in enumerate(data.items()):
        if i < 5:
            assert bytes(source.get(name)) == want
        else:
            with pytest.raises(CheckpointError, match="truncated") as info:
                source.get(name)
            assert str(path) in str(info.value) and f'"{name}"' in str(info.value)
    # Grown again (e.g. rewritten in place): readable again, no crash either way.
    with open(path, "r+b") as f:
        f.truncate(header + 8 * 65536)
    assert len(bytes(source.get("t7"))) == 65536


def test_mmap_truncation_under_a_live_view_is_sigbus(tmp_path: Path) -> None:
    """Documents the one case no library can turn into an error: a zero-copy mmap view taken
    before the file was truncated, touched after. The process dies with SIGBUS (in a child
    here); the pread backend copies, so the same sequence is harmless there."""
    path, data = _single_file(tmp_path)
    code = textwrap.dedent(
        f"""
        import os, sys
        from kda_tp import SafetensorsSource
        source = SafetensorsSource({str(path)!r}, sys.argv[1])
        view = source.get("t7").data
        os.truncate({str(path)!r}, 0)
        print(int(view.sum()), flush=True)
        """
    )
    shutil.copy(path, tmp_path / "backup")
    mapped = subprocess.run([sys.executable, "-c", code, "mmap"], capture_output=True, timeout=60)
    assert mapped.returncode == -signal.SIGBUS, (mapped.returncode, mapped.stderr)
    shutil.copy(tmp_path / "backup", path)
    copied = subprocess.run(
        [sys.executable, "-c", code, "pread"], capture_output=True, text=True, timeout=60
    )
    assert copied.returncode == 0, copied.stderr
    assert int(copied.stdout) == int(np.frombuffer(data["t7"], np.uint8).sum())


def test_the_backend_is_chosen_by_argument_or_environment(
    checkpoint: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert SafetensorsSource(checkpoint).backend == "mmap"
    assert SafetensorsSource(checkpoint).mappings()
    monkeypatch.setenv("KDA_TP_BACKEND", "pread")
    source = SafetensorsSource(checkpoint)
    assert source.backend == "pread" and source.mappings() == []
    assert SafetensorsSource(checkpoint, "mmap").backend == "mmap"  # the argument wins
    out = tmp_path / "env"
    shard_checkpoint(checkpoint, out, 2)
    assert tree(out) == tree(reference)
    monkeypatch.delenv("KDA_TP_BACKEND")
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "kda_tp",
            "shard",
            str(checkpoint),
            "--tp-size",
            "2",
            "--out",
            str(tmp_path / "cli"),
            "--backend",
            "pread",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert tree(tmp_path / "cli") == tree(reference)


# ----------------------------------------------------------------------------------------------
# concurrency


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_threads_share_one_source(checkpoint: Path, backend: str) -> None:
    source = SafetensorsSource(checkpoint, backend)
    names = source.names()
    want = {n: hashlib.sha256(bytes(source.get(n))).hexdigest() for n in names}
    shards = [KdaShardedSource(source, KdaTpPlan.from_config(source, r, 2)) for r in range(2)]
    want_shards = [{n: bytes(s.get(n)) for n in names} for s in shards]
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            rng = random.Random(seed)
            for _ in range(3):
                order = names[:]
                rng.shuffle(order)
                for n in order:
                    assert hashlib.sha256(bytes(source.get(n))).hexdigest() == want[n], n
                    r = rng.randrange(2)
                    assert bytes(shards[r].get(n)) == want_shards[r][n], n
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[0]
    assert not any(t.is_alive() for t in threads)


def test_processes_writing_different_ranks_into_one_directory(
    checkpoint: Path, tmp_path: Path
) -> None:
    single = tmp_path / "single"
    shard_checkpoint(checkpoint, single, 4, qk_multiple=128)
    out = tmp_path / "shared"
    cmds = [
        [
            sys.executable,
            "-m",
            "kda_tp",
            "shard",
            str(checkpoint),
            "--tp-size",
            "4",
            "--qk-multiple",
            "128",
            "--out",
            str(out),
            "--ranks",
            ranks,
            "--quiet",
        ]
        for ranks in ("0,1", "2,3")
    ]
    for attempt in range(2):  # twice: once into a missing directory, once with --force
        procs = [
            subprocess.Popen(
                c + (["--force"] if attempt else []),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for c in cmds
        ]
        results = [p.communicate(timeout=120) for p in procs]
        for p, (_, err) in zip(procs, results):
            assert p.returncode == 0, err
        assert tree(out) == tree(single)
        assert hidden_entries(out) == []
    run = subprocess.run(
        [sys.executable, "-m", "kda_tp", "verify", str(checkpoint), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0 and "OK:" in run.stdout, run.stdout + run.stderr




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


@pytest.mark.parametrize("name", ["rank5", ".rank0.partial-keep"])
def test_an_input_inside_the_output_is_never_removed(three_layer_ckpt, tmp_path, name):
    out = tmp_path / "out"
    inside = out / name
    shutil.copytree(three_layer_ckpt, inside)
    before = sorted(p.name for p in inside.iterdir())
    for force in (False, True):
        with pytest.raises(kda_tp.OutputError, match="is \\(or holds\\) the input checkpoint"):
            shard_checkpoint(inside, out, 2, force=force)
    assert sorted(p.name for p in inside.iterdir()) == before


def test_a_failed_force_rerun_restores_the_previous_output(three_layer_ckpt, tmp_path, monkeypatch):
    out = tmp_path / "out"
    shard_checkpoint(three_layer_ckpt, out, 2)
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    import kda_tp.shard as shard_module

    real = shard_module.write_safetensors

    def fail_on_rank1(path, *args, **kwargs):
        if ".rank1.partial" in str(path):
            raise kda_tp.OutputError(f"{path}: write failed: [Errno 28] No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_module, "write_safetensors", fail_on_rank1)
    with pytest.raises(kda_tp.OutputError, match="No space left"):
        shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
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
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    import kda_tp.shard as shard_module

    real = shard_module.write_safetensors

    def fail_on_rank1(path, *args, **kwargs):
        if ".rank1.partial" in str(path):
            raise kda_tp.OutputError(f"{path}: write failed: [Errno 28] No space left on device")
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shard_module, "write_safetensors", fail_on_rank1)
    with pytest.raises(kda_tp.OutputError, match="No space left"):
        shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before and sorted(p.name for p in out.iterdir()) == ["rank2", "rank3"]
    monkeypatch.undo()
    shard_checkpoint(three_layer_ckpt, out, 2, force=True)
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1"]
    assert verify_shards(three_layer_ckpt, out).ok
