"""``kda-tp shard`` under hazards: a full disk, files that change while open, concurrency.

* A full disk (a small tmpfs where the machine allows mounting one, and an injected ENOSPC
  everywhere) is an ``OutputError`` naming the file, with no partial output left.
* A file truncated or replaced after it was opened: truncated, every read refused (both
  backends); replaced by rename, the old bytes still read; the documented SIGBUS of an ``mmap``
  view taken before a truncation (rewrites in place: ``tests/checkpoint/test_changed_files.py``).
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
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, cli
from kda_tp.checkpoint import files as _files, writer as _io
from kda_tp.errors import CheckpointError, OutputError
from kda_tp.shard import shard_checkpoint

from children import shard_cmd
from full_disk import FullDisk
from tp_fixtures import hidden_entries, tree


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
            shard_cmd(checkpoint, out),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert run.returncode == 2 and "OutputError" in run.stderr and "No space left" in run.stderr
        assert not out.exists() and list(disk.iterdir()) == []
    finally:
        subprocess.run(["umount", str(disk)], check=False, timeout=60)


# A rank is about 192 KB: at 300 KB one rank completes before the other fails.
@pytest.mark.parametrize("budget", [0, 1000, 150_000, 300_000])
def test_injected_enospc_on_write(
    checkpoint: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    monkeypatch.setattr(_files, "open", FullDisk(budget), raising=False)
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
    monkeypatch.setattr(_files, "open", FullDisk(0, at="flush"), raising=False)
    with pytest.raises(OutputError, match="No space left on device"):
        shard_checkpoint(checkpoint, tmp_path / "a", 2)
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()

    def copy2(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("kda_tp.shard.writer.shutil.copy2", copy2)
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
    """A file truncated while open is refused for every tensor, also those whose bytes are
    still there (the file is no longer the one whose header was read), and stays refused when
    it grows again (rewritten in place): a CheckpointError naming the file, the tensor and the
    change, never a crash and never bytes at the old offsets. A source opened anew reads it."""
    path, data = _single_file(tmp_path)
    source = SafetensorsSource(path, backend)
    size = path.stat().st_size
    header = size - sum(len(b) for b in data.values())
    # Cut the file in the middle of t5: t0..t4 are still there, t5..t7 are not.
    os.truncate(path, header + 5 * 65536 + 100)
    for name in data:
        with pytest.raises(CheckpointError, match="truncated") as info:
            source.get(name)
        assert str(path) in str(info.value) and f'"{name}"' in str(info.value)
        assert (f"the file changed since it was opened (size {size} -> "
                f"{header + 5 * 65536 + 100} bytes (truncated while open)") in str(info.value)
    # Grown again (e.g. rewritten in place): still refused, no crash either way.
    with open(path, "r+b") as f:
        f.truncate(header + 8 * 65536)
    with pytest.raises(CheckpointError, match="changed since it was opened"):
        source.get("t7")
    assert len(bytes(SafetensorsSource(path, backend).get("t7"))) == 65536


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
        shard_cmd(checkpoint, tmp_path / "cli", "--backend", "pread"),
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
    want_shards = [{n: bytes(s[n]) for n in names} for s in shards]
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
                    assert bytes(shards[r][n]) == want_shards[r][n], n
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
        shard_cmd(checkpoint, out, "--qk-multiple", "128", "--ranks", ranks, tp_size=4)
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
