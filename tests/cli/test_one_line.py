"""Every refusal is one line that says what is really wrong (issue 33): ``kda-tp: error:``,
exit status 2, nothing left behind.

* ``dump`` into a read-only directory, or onto ``/dev/full``; a full disk under ``dump`` and
  ``demo --keep`` (no directory they made is left).
* A rank directory whose ``.kda-tp.json`` is not kda-tp's; a checkpoint holding one tensor under
  two spellings of its layer number (``layers.0``, ``layers.00``).
* Running out of file descriptors: the open-files limit, never a lock file or a rank.
* ``audit`` of ``/dev/null`` or a FIFO; ``plan`` of a lone ``.safetensors`` file; ``shard --ranks
  0,0,1``; an audit of an F32 engine's dump without ``--dtype F32`` names the likely cause; a
  tensor that does not fit in memory; ``examples/guard_cpu.py`` without vLLM.
"""

from __future__ import annotations

import os
import resource
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from kda_tp import cli
from kda_tp.audit import dump as dump_module
from kda_tp.checkpoint import SafetensorsSource, write_safetensors
from kda_tp.checkpoint import files as _files
from kda_tp.errors import PlanError
from kda_tp.output import MARK_NAME
from kda_tp.shard import shard_checkpoint

from full_disk import FullDisk
from paths import DATA, ROOT

KIMI_LINEAR = DATA / "engine_ranks" / "ckpt_kl"
ENGINE = ("--engine", "vllm-0.33-kimi-linear")
#: Seconds a child command may take (a bound on a hang, not a speed assertion).
BOUND = 300


def kda_tp(*args: object, limit_files: int | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m kda_tp ARGS`` in a child (its soft ``RLIMIT_NOFILE`` set to
    ``limit_files``)."""

    def limit() -> None:
        if limit_files is not None:
            _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (limit_files, hard))

    return subprocess.run([sys.executable, "-m", "kda_tp", *map(str, args)], capture_output=True,
                          text=True, timeout=BOUND, preexec_fn=limit)


def one_line(run: subprocess.CompletedProcess[str], error: str) -> str:
    """Assert a refusal (exit 2, one ``kda-tp: error: ERROR:`` line); return the line."""
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith(f"kda-tp: error: {error}: "), run.stderr
    return run.stderr


# --- read-only, /dev/full, a full disk --------------------------------------------------------


def _read_only(path: Path) -> bool:
    """Make the empty directory ``path`` read-only for this process: a read-only tmpfs mounted
    on it as root (root ignores mode bits), else its mode bits; False where neither works."""
    if os.geteuid() != 0:
        path.chmod(stat.S_IRUSR | stat.S_IXUSR)
        return True
    if shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,ro", "tmpfs", str(path)],
                          capture_output=True, timeout=60).returncode == 0


def test_dump_into_a_read_only_directory_is_one_line(tmp_path: Path) -> None:
    """Three chained tracebacks and exit 1 before (the clean-up unlinked a file it never
    created, and that raised EROFS)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if not _read_only(ro):
        pytest.skip("cannot make a read-only directory here")
    try:
        line = one_line(kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 4, "--out", ro),
                        "OutputError")
        assert str(ro) in line and ("Read-only file system" in line
                                    or "Permission denied" in line)
        assert os.listdir(ro) == []
        line = one_line(kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 4, "--out",
                               ro / "new" / "dump"), "OutputError")
        assert "cannot create the output directory" in line and os.listdir(ro) == []
    finally:
        if os.geteuid() == 0:
            subprocess.run(["umount", str(ro)], check=False, timeout=60)
        else:
            ro.chmod(stat.S_IRWXU)


@pytest.mark.parametrize("target", ["a file", "/dev/full"])
@pytest.mark.parametrize("command", ["dump", "shard"])
def test_an_output_that_is_a_file_or_a_device_is_named_as_such(
    command: str, target: str, checkpoint: Path, tmp_path: Path
) -> None:
    """``--out /dev/full`` said "[Errno 17] File exists" for dump."""
    plain = tmp_path / "plain"
    plain.write_text("mine")
    if target == "/dev/full" and not Path("/dev/full").exists():
        pytest.skip("no /dev/full here")
    out = plain if target == "a file" else Path("/dev/full")
    args = ((KIMI_LINEAR, *ENGINE, "--tp-size", 4) if command == "dump"
            else (checkpoint, "--tp-size", 2, "--quiet"))
    line = one_line(kda_tp(command, *args, "--out", out), "OutputError")
    assert f"{out}: cannot create the output directory: {out} exists and is not a " \
           "directory" in line and "File exists" not in line
    assert plain.read_text() == "mine"


@pytest.mark.parametrize("command", ["dump", "demo"])
def test_a_full_disk_leaves_no_directory_the_run_made(
    command: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``dump`` and ``demo --keep`` left the empty directories they had made."""
    monkeypatch.setattr(_files, "open", FullDisk(4096), raising=False)
    where = tmp_path / "new" / "deeper"
    args = (["dump", str(KIMI_LINEAR), *ENGINE, "--tp-size", "4", "--out", str(where)]
            if command == "dump" else  # demo --keep makes only its last directory
            ["demo", "--num-layers", "1", "--keep", str(where.parent), "--no-numeric"])
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("kda-tp: error: OutputError: ") == 1 and "No space left on device" in err
    assert os.listdir(tmp_path) == []


# --- messages that say the wrong thing ----------------------------------------------------------


def test_a_mark_that_is_not_kda_tp_s_is_named_as_such(checkpoint: Path, tmp_path: Path) -> None:
    """It said "it holds .kda-tp.json and no .kda-tp.json"."""
    out = tmp_path / "out"
    (out / "rank0").mkdir(parents=True)
    (out / "rank0" / MARK_NAME).write_text('{"written_by": "someone else"}')
    line = one_line(kda_tp("shard", checkpoint, "--tp-size", 2, "--out", out, "--force",
                           "--quiet"), "OutputError")
    assert f"rank0: its {MARK_NAME} is not a mark kda-tp wrote (unreadable, or another " \
           "tool's), so kda-tp did not write it" in line
    assert f"no {MARK_NAME}" not in line
    assert os.listdir(out / "rank0") == [MARK_NAME]


def test_a_layer_number_written_two_ways_is_named_as_such(
    checkpoint: Path, tmp_path: Path
) -> None:
    """It said "holds both weight_scale and weight_scale_inv" for a BF16 q_proj."""
    source = SafetensorsSource(checkpoint)
    alias = tmp_path / "alias"
    alias.mkdir()
    shutil.copy(checkpoint / "config.json", alias / "config.json")
    name = "model.layers.0.self_attn.q_proj.weight"
    names = [*source.names(), name.replace(".layers.0.", ".layers.00.")]
    specs = [(n, *source.info(n.replace(".layers.00.", ".layers.0.")),
              len(source.get(n.replace(".layers.00.", ".layers.0.")).data),
              lambda n=n: source.get(n.replace(".layers.00.", ".layers.0.")).data) for n in names]
    write_safetensors(alias / "model.safetensors", specs)
    line = one_line(kda_tp("shard", alias, "--tp-size", 2, "--out", tmp_path / "out",
                           "--quiet"), "CheckpointError")
    assert (f"KDA layer 0 holds q_proj.weight twice, as {name} and "
            "model.layers.00.self_attn.q_proj.weight (its layer number written two ways)") in line
    assert "weight_scale" not in line and not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["shard", "dump"])
def test_running_out_of_file_descriptors_is_the_open_files_limit(
    command: str, checkpoint: Path, tmp_path: Path
) -> None:
    """Each limit from too few to start with to enough: the run passes, or it is refused in
    one line naming ``RLIMIT_NOFILE``, never "Too many open files" blamed on a lock file, the
    output directory or a rank."""
    named = 0
    for limit in range(8, 24):
        out = tmp_path / f"out{limit}"
        args = ((KIMI_LINEAR, *ENGINE, "--tp-size", 4) if command == "dump"
                else (checkpoint, "--tp-size", 4, "--qk-multiple", 64, "--quiet"))
        run = kda_tp(command, *args, "--out", out, limit_files=limit)
        if run.returncode == 0:
            break
        assert "Too many open files" not in run.stderr, (limit, run.stderr)
        assert run.returncode == 2 and run.stderr.count("\n") == 1, (limit, run.stderr)
        if "OpenFilesLimitError" in run.stderr and "RLIMIT_NOFILE" in run.stderr:
            named += 1
            assert f"limit allows (RLIMIT_NOFILE" in run.stderr and "ulimit -n" in run.stderr
        assert not out.exists() or not [p for p in out.iterdir()], (limit, list(out.iterdir()))
    else:
        pytest.fail("no limit up to 23 files let the run pass")
    assert named, "no limit met a lock file or a rank"


@pytest.mark.parametrize("what", ["/dev/null", "fifo"])
def test_audit_of_a_device_or_a_fifo_says_what_it_is(what: str, tmp_path: Path) -> None:
    """It said "no such file or directory"."""
    path = Path(what)
    if what == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
    line = one_line(kda_tp("audit", KIMI_LINEAR, path, "--tp-size", 4), "CheckpointError")
    assert f"{path}: not a regular file or a directory (a device, FIFO or socket cannot be " \
           "read as a dump)" in line


def test_plan_of_a_lone_safetensors_file_asks_for_its_config(tmp_path: Path) -> None:
    """It gave json's UTF-8 decode error (the file was read as a config); shard's message."""
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(KIMI_LINEAR / "model.safetensors", lone / "model.safetensors")
    plan = one_line(kda_tp("plan", lone / "model.safetensors", "--tp-size", 2),
                    "CheckpointError")
    shard = one_line(kda_tp("shard", lone / "model.safetensors", "--tp-size", 2, "--out",
                            tmp_path / "out"), "CheckpointError")
    assert plan == shard and "no config.json in this directory" in plan
    assert "decode" not in plan
    # Beside its config.json, the file is the checkpoint.
    run = kda_tp("plan", KIMI_LINEAR / "model.safetensors", "--tp-size", 2)
    assert run.returncode == 0 and "heads 12 -> 6 per rank" in run.stdout, run.stderr


def test_a_rank_named_twice_is_refused_by_shard_as_by_dump(
    checkpoint: Path, tmp_path: Path
) -> None:
    shard = one_line(kda_tp("shard", checkpoint, "--tp-size", 2, "--ranks", "0,0,1", "--out",
                            tmp_path / "a", "--quiet"), "PlanError")
    dump = one_line(kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--ranks", "0,0,1",
                           "--out", tmp_path / "b"), "PlanError")
    assert shard == dump == ("kda-tp: error: PlanError: ranks [0, 0, 1] name a rank twice; pass "
                             "each rank once\n")
    with pytest.raises(PlanError, match="name a rank twice"):
        shard_checkpoint(checkpoint, tmp_path / "c", 2, ranks=[1, 1])
    assert os.listdir(tmp_path) == []


def test_an_f32_engine_s_dump_audited_without_its_dtype_names_the_cause(tmp_path: Path) -> None:
    """It said "24 KDA parameter(s) wrong", the cause (the engine's --dtype float32) only in
    each parameter's line."""
    out = tmp_path / "dump"
    assert kda_tp("dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--dtype", "float32", "--out",
                  out).returncode == 0
    run = kda_tp("audit", KIMI_LINEAR, out, "--tp-size", 2)
    assert run.returncode == 1
    summary = run.stdout.splitlines()[-1]
    assert summary.startswith("FAIL: 12 KDA parameter(s) wrong, each held in F32, not the model "
                              "dtype the audit expected: the engine likely ran with --dtype F32; "
                              "audit again with --dtype F32 (model_dtype=); "), summary
    run = kda_tp("audit", KIMI_LINEAR, out, "--tp-size", 2, "--dtype", "F32")
    assert run.returncode == 0 and run.stdout.startswith("OK: 18 of 18"), run.stdout


def test_a_tensor_that_does_not_fit_in_memory_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """numpy's MemoryError (a declared 1 TB parameter) was a traceback."""

    def build(*_args: object, **_kwargs: object) -> int:
        raise MemoryError("Unable to allocate 1.00 TiB for an array with shape (1099511627776,) "
                          "and data type uint8")

    monkeypatch.setattr(dump_module, "write_safetensors", build)
    assert cli.main(["dump", str(KIMI_LINEAR), *ENGINE, "--tp-size", "2", "--out",
                     str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err == ("kda-tp: error: MemoryError: Unable to allocate 1.00 TiB for an array with "
                   "shape (1099511627776,) and data type uint8; kda-tp holds one tensor or engine "
                   "parameter in memory at a time (and the numeric check the activations of "
                   "--seq-len tokens), and this does not fit in the memory free here\n")
    assert os.listdir(tmp_path) == []


def test_the_guard_example_without_vllm_is_one_line() -> None:
    """``examples/guard_cpu.py`` in a Python without vLLM was a ModuleNotFoundError traceback."""
    code = ("import sys, runpy; sys.modules['vllm'] = None; sys.argv = [sys.argv[1]]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", code, str(ROOT / "examples" / "guard_cpu.py")],
                         capture_output=True, text=True, timeout=BOUND)
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert run.stderr.startswith("guard_cpu.py: needs vLLM 0.33 (and its torch) in this Python (")
    assert "docs/guard-cpu.md" in run.stderr and "Traceback" not in run.stderr
