"""kda-tp never touches what it did not write, through the command line.

* ``OUT/.rank{r}.lock`` planted as a symbolic link, a hard link, a FIFO or someone's file: the
  run is refused in one ``kda-tp: error:`` line (exit 2) and the file is left as it was.
* ``shard --force`` never removes a ``rank{N}/`` kda-tp did not write (another tool's optimizer
  states), nor a kda-tp rank directory something else was added to; ``dump --force`` never
  replaces a dump file kda-tp did not write (an engine's own), and a refused ``dump --force``
  (an F16 overflow) leaves the previous dump as it was.
* A dump-file name whose rank cannot be read (40 digits) is refused, never taken for "no dump
  file there"; JSON nested past ``json.loads``' stack (an index, a mark) is one refusal line.
* ``demo --keep DIR`` refuses a ``DIR`` it did not make and replaces its own: run twice with
  different models, the second run's sizes are its own.
* Outputs keep the input's mode bits: a 0600 checkpoint's ranks and dumps come out 0600.
* More files than ``RLIMIT_NOFILE`` allows open: an ``OpenFilesLimitError`` naming the limit,
  its value, the files needed and ``ulimit -n``, not the file where the limit was met.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from kda_tp import SafetensorsSource
from kda_tp.checkpoint.files import open_files_error
from kda_tp.checkpoint.writer import write_safetensors
from kda_tp.errors import OpenFilesLimitError
from kda_tp.output import FILE_MARK, MARK_NAME
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from children import kda_tp_child
from tp_fixtures import SHARD_GEOMETRY
from paths import DATA

KIMI_LINEAR = DATA / "engine_ranks" / "ckpt_kl"
ENGINE = ("--engine", "vllm-0.33-kimi-linear")
#: Seconds a child command may take (a bound on a hang, not a speed assertion).
BOUND = 300


def kda_tp(*args: object, limit_files: int | None = None) -> tuple[int, str, str]:
    """``python -m kda_tp ARGS`` in a child process: exit status, stdout, stderr. With
    ``limit_files``, the child's soft ``RLIMIT_NOFILE`` is set to it."""

    def limit() -> None:
        if limit_files is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, hard))

    run = subprocess.run([sys.executable, "-m", "kda_tp", *map(str, args)], capture_output=True,
                         text=True, timeout=BOUND, preexec_fn=limit)
    return run.returncode, run.stdout, run.stderr


def refused(status: int, err: str, error: str = "OutputError") -> str:
    """Assert a refusal (exit 2, one ``kda-tp: error:`` line of ``error``); return the line."""
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith(f"kda-tp: error: {error}: "), err
    return err


def files_and_modes(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` (hidden ones included): its bytes and mode bits."""
    return {str(p.relative_to(path)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


# --- locks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["symlink", "hard link", "fifo", "someone's file"])
@pytest.mark.parametrize("flags", [[], ["--force"], ["--wait"]])
def test_a_lock_path_kda_tp_did_not_make_is_refused_and_left_alone(
    checkpoint: Path, tmp_path: Path, planted: str, flags: list[str]
) -> None:
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 AAAAC3Nza the-admin\n")
    victim.chmod(0o600)
    out = tmp_path / "out"
    out.mkdir()
    lock = out / ".rank0.lock"
    if planted == "symlink":
        lock.symlink_to(victim)
        why = "a symbolic link where rank 0's lock file goes"
    elif planted == "hard link":
        os.link(victim, lock)
        why = "a file with 2 hard links where rank 0's lock file goes"
    elif planted == "fifo":
        os.mkfifo(lock)
        why = "not a regular file where rank 0's lock file goes"
    else:
        lock.write_text("my notes\n")
        why = "holds something else than a kda-tp lock's holder line"
    status, _, err = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--quiet", *flags)
    line = refused(status, err)
    assert f"{lock}: {why}" in line and "never writes to a file it did not create" in line
    assert victim.read_text() == "ssh-ed25519 AAAAC3Nza the-admin\n"
    assert stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert sorted(os.listdir(out)) == [".rank0.lock"]
    if planted == "someone's file":
        assert lock.read_text() == "my notes\n"


def test_a_stale_lock_of_a_dead_writer_is_taken_over(checkpoint: Path, tmp_path: Path) -> None:
    """A lock file a killed writer left (its holder line, its lock released) is kda-tp's."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".rank1.lock").write_text("pid 1 on elsewhere, started 2020-01-01T00:00:00Z\n")
    assert kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--quiet")[0] == 0
    assert sorted(os.listdir(out)) == ["rank0", "rank1"]


# --- shard --force ----------------------------------------------------------------------------


def _optimizer_states(directory: Path) -> None:
    directory.mkdir(parents=True)
    (directory / "optim_states.pt").write_bytes(b"adam moments")


@pytest.mark.parametrize("where", ["rank0", "rank3"])
def test_shard_force_never_removes_a_rank_directory_kda_tp_did_not_write(
    checkpoint: Path, tmp_path: Path, where: str
) -> None:
    """``rank0`` (a rank being written) or ``rank3`` (another world size's, which --force
    would remove) holding another tool's optimizer states: refused, naming it."""
    out = tmp_path / "out"
    _optimizer_states(out / where)
    status, _, err = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force",
                            "--quiet")
    line = refused(status, err)
    assert f"{out / where}: it holds optim_states.pt and no {MARK_NAME} (kda-tp's mark)" in line
    assert "only what it wrote, even with --force" in line
    assert sorted(p.name for p in out.iterdir()) == [where]
    assert (out / where / "optim_states.pt").read_bytes() == b"adam moments"


def test_shard_force_never_removes_what_was_added_to_a_kda_tp_rank(
    checkpoint: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shard_checkpoint(checkpoint, out, 2)
    (rank_dir(out, 1) / "optim_states.pt").write_bytes(b"adam moments")
    before = files_and_modes(out)
    status, _, err = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force",
                            "--quiet")
    line = refused(status, err)
    assert f"{rank_dir(out, 1)}: it holds optim_states.pt, which kda-tp did not write" in line
    assert files_and_modes(out) == before
    # The mark: kda-tp's, naming every entry it wrote.
    mark = json.loads((rank_dir(out, 0) / MARK_NAME).read_text())
    assert mark["written_by"] == "kda-tp" and mark["kind"] == "rank"
    assert sorted(mark["entries"]) == sorted(p.name for p in rank_dir(out, 0).iterdir()
                                             if p.name != MARK_NAME)


# --- dump --force -----------------------------------------------------------------------------


def test_a_refused_dump_force_leaves_the_previous_dump(tmp_path: Path) -> None:
    out = tmp_path / "dump"
    assert kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", out)[0] == 0
    before = files_and_modes(out)
    # F16 cannot hold the checkpoint's 80000.0: refused while building, before anything goes.
    status, _, err = kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", out,
                            "--dtype", "F16", "--force")
    assert "the cast from F32 to F16 overflows" in refused(status, err, "DtypeMismatchError")
    assert files_and_modes(out) == before  # no file lost, none half-replaced, nothing left
    assert kda_tp("audit", KIMI_LINEAR, out, "--tp-size", 2)[0] == 0


def test_dump_force_never_replaces_a_file_kda_tp_did_not_write(tmp_path: Path) -> None:
    """An engine's own ``save_sharded_state`` file (no kda-tp mark in its header)."""
    out = tmp_path / "dump"
    out.mkdir()
    engines = out / "model-rank-0-part-0.safetensors"
    write_safetensors(engines, [("model.embed_tokens.weight", "F32", (2,), 8, lambda: b"\0" * 8)],
                      {"tp_size": "2"})
    before = files_and_modes(out)
    status, _, err = kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", out, "--force")
    line = refused(status, err)
    assert f"{engines}: its header carries no {FILE_MARK}, so kda-tp did not write it" in line
    assert files_and_modes(out) == before


@pytest.mark.parametrize("force", [[], ["--force"]])
def test_a_dump_name_whose_rank_cannot_be_read_is_refused_not_taken_for_none(
        tmp_path: Path, force: list[str]) -> None:
    """A ``model-rank-<40 digits>-part-0.safetensors`` beside an engine's own file: the run is
    refused (the name's rank is past the digits kda-tp reads), never taken for a directory
    without dump files, which would replace the engine's file."""
    out = tmp_path / "dump"
    out.mkdir()
    (out / "model-rank-0-part-0.safetensors").write_bytes(b"an engine's own rank 0")
    (out / f"model-rank-{'9' * 40}-part-0.safetensors").touch()
    before = files_and_modes(out)
    status, _, err = kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", out, *force)
    assert "rank in the file name" in refused(status, err, "CheckpointError")
    assert files_and_modes(out) == before


def test_json_nested_past_python_s_stack_is_refused_in_one_line(
        checkpoint: Path, tmp_path: Path) -> None:
    """An index (read again to explain a failed open) and a ``.kda-tp.json`` mark nested
    deeper than ``json.loads`` can recurse: one refusal line, nothing removed."""
    deep = "[" * 100_000 + "]" * 100_000
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint, ckpt)
    index = {"weight_map": {}, "x": "@"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index).replace('"@"', deep))
    status, _, err = kda_tp("shard", ckpt, "--tp-size", 2, "--out", tmp_path / "o1")
    refused(status, err, "CheckpointError")
    out = tmp_path / "o2"
    (out / "rank0").mkdir(parents=True)
    (out / "rank0" / MARK_NAME).write_text(deep)
    before = files_and_modes(out)
    status, _, err = kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--quiet")
    assert f"its {MARK_NAME} is not a mark kda-tp wrote" in refused(status, err)
    assert files_and_modes(out) == before


# --- demo --keep ------------------------------------------------------------------------------


def test_demo_keep_refuses_a_directory_it_did_not_make(tmp_path: Path) -> None:
    keep = tmp_path / "keep"
    (keep / "checkpoint").mkdir(parents=True)
    (keep / "checkpoint" / "model.safetensors").write_bytes(b"the user's own model")
    before = files_and_modes(keep)
    status, out, err = kda_tp("demo", "--tp-size", 2, "--num-layers", 1, "--no-numeric",
                              "--keep", keep)
    line = refused(status, err)
    assert out == "" and f"{keep}: it holds checkpoint and no {MARK_NAME}" in line
    assert "choose another --keep DIR" in line and files_and_modes(keep) == before


def test_demo_keep_replaces_its_own_directory(tmp_path: Path) -> None:
    """Twice into one ``--keep DIR`` with different models and TP sizes: the second run
    replaces the first's files, and its size and verification count only its own."""
    keep = tmp_path / "keep"
    sizes = {}
    for model, tp_size in (("glm-5.3-flash", 2), ("kimi-linear", 4)):
        status, out, err = kda_tp("demo", "--model", model, "--tp-size", tp_size,
                                  "--num-layers", 1, "--no-numeric", "--keep", keep)
        assert status == 0, err
        assert "OK: " in out
        found = re.search(r"generated a 1-layer \S+ checkpoint \(([0-9.]+) GB\)", out)
        assert found, out
        sizes[model] = float(found.group(1))
        on_disk = sum(p.stat().st_size for p in (keep / "checkpoint").glob("*.safetensors"))
        assert round(on_disk / 1e9, 3) == sizes[model]
        assert sorted(os.listdir(keep)) == [MARK_NAME, "checkpoint", f"tp{tp_size}"]
        assert verify_shards(keep / "checkpoint", keep / f"tp{tp_size}").ok
    assert sizes["glm-5.3-flash"] != sizes["kimi-linear"]


# --- mode bits --------------------------------------------------------------------------------


def test_outputs_keep_the_input_s_mode_bits(tmp_path: Path) -> None:
    private = tmp_path / "private"
    write_small_checkpoint(private, **SHARD_GEOMETRY, seed=3)  # type: ignore[arg-type]
    for p in private.iterdir():
        p.chmod(0o600)
    private.chmod(0o700)
    out = tmp_path / "out"
    assert kda_tp("shard", private, "--tp-size", 2, "--out", out, "--quiet")[0] == 0
    for r in (0, 1):
        assert stat.S_IMODE(rank_dir(out, r).stat().st_mode) == 0o700
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in rank_dir(out, r).iterdir()}
        assert set(modes) >= {"config.json", "model.safetensors.index.json", MARK_NAME}
        assert set(modes.values()) == {0o600}, modes
    # A dump of a private checkpoint is private too.
    kl = tmp_path / "kl"
    shutil.copytree(KIMI_LINEAR, kl)
    for p in kl.glob("*.safetensors"):
        p.chmod(0o600)
    dump = tmp_path / "dump"
    assert kda_tp("dump", kl, *ENGINE, "--tp-size", 2, "--out", dump)[0] == 0
    assert {stat.S_IMODE(p.stat().st_mode) for p in dump.iterdir()} == {0o600}
    # An ordinary 0644 checkpoint gives 0644 files, whatever the umask.
    out644 = tmp_path / "out644"
    assert kda_tp("shard", KIMI_LINEAR, "--tp-size", 2, "--qk-multiple", 1, "--out", out644,
                  "--quiet")[0] == 0
    want = {p.name: stat.S_IMODE(p.stat().st_mode) for p in KIMI_LINEAR.glob("*.safetensors")}
    for name, mode in want.items():
        assert stat.S_IMODE((rank_dir(out644, 0) / name).stat().st_mode) == mode


# --- too many open files ----------------------------------------------------------------------


def test_more_files_than_the_open_files_limit_names_the_limit(tmp_path: Path) -> None:
    """A checkpoint in more files than the process may hold open: the limit, its value, the
    files needed and the fix, instead of "...safetensors: Too many open files"."""
    many = write_small_checkpoint(tmp_path / "many", **SHARD_GEOMETRY, seed=3,  # type: ignore[arg-type]
                                  max_file_bytes=1)
    files = len(list(many.glob("*.safetensors")))
    assert files >= 20
    limit = files  # the interpreter's own descriptors come on top: the files cannot all open
    status, _, err = kda_tp("shard", many, "--tp-size", 2, "--out", tmp_path / "out",
                            limit_files=limit)
    line = refused(status, err, "OpenFilesLimitError")
    assert f"{many}: reading it holds {files} files open at once" in line
    assert f"over this process's limit of {limit} open files (RLIMIT_NOFILE" in line
    assert "ulimit -n " in line and "Too many open files" not in line
    assert not (tmp_path / "out").exists()
    # With the limit raised as it says, the same command works.
    raised = int(re.search(r"ulimit -n ([0-9]+)", line).group(1))  # type: ignore[union-attr]
    status, _, err = kda_tp("shard", many, "--tp-size", 2, "--out", tmp_path / "out", "--quiet",
                            limit_files=raised)
    assert status == 0, err


# Lowers the soft RLIMIT_NOFILE to what the child has open (after its imports) plus $SPARE.
_FEW_FILES = """
import os, resource
import kda_tp.cli, kda_tp.audit.auditor, kda_tp.audit.dump
spare = int(os.environ["SPARE"])
_, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + spare, hard))
"""


def test_a_dump_rank_in_more_parts_than_the_limit_names_the_limit(tmp_path: Path) -> None:
    """A ``save_sharded_state`` rank in many part files (one parameter each here): the audit
    names the limit, not the part where it was met."""
    dump = tmp_path / "dump"
    assert kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", dump)[0] == 0
    parts = 0
    for r in (0, 1):
        whole = dump / f"model-rank-{r}-part-0.safetensors"
        source = SafetensorsSource(whole)
        meta = source.files()[0][1]
        tensors = [source.get(name) for name in source.names()]
        for p, t in enumerate(tensors):
            assert t is not None
            write_safetensors(dump / f"model-rank-{r}-part-{p}.safetensors",
                              [(t.name, t.dtype, t.shape, t.nbytes, lambda t=t: t.data)], meta)
        parts = len(tensors)
    assert parts >= 8
    assert kda_tp("audit", KIMI_LINEAR, dump, "--tp-size", 2)[0] == 0  # the parts are sound
    run = subprocess.run(kda_tp_child(_FEW_FILES, "audit", KIMI_LINEAR, dump, "--tp-size", 2),
                         capture_output=True, text=True, timeout=BOUND,
                         env={**os.environ, "SPARE": str(parts // 2)})
    line = refused(run.returncode, run.stderr, "OpenFilesLimitError")
    assert f"{dump}: reading it holds {parts} files open at once" in line
    assert "(RLIMIT_NOFILE" in line and "ulimit -n " in line
    assert "Too many open files" not in line


def test_the_open_files_error_carries_its_fields() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert open_files_error(1, "ckpt") is None
    error = open_files_error(soft + 1, "ckpt")
    assert isinstance(error, OpenFilesLimitError)
    assert (error.needed, error.limit, error.hard) == (soft + 1, soft, hard)
    assert error.open_now >= 3  # stdin, stdout, stderr at least
