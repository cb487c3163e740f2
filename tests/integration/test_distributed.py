"""Real torch.distributed (gloo, CPU) jobs: one process per TP rank loading with kda_tp.torch, and
``kda-tp shard`` / ``verify --numeric`` under torchrun. Every job is time-bounded."""

from __future__ import annotations

import filecmp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import tp_fixtures

from kda_tp import cli

torch = pytest.importorskip("torch")
mp = pytest.importorskip("torch.multiprocessing")

import dist_workers  # noqa: E402 - needs torch

JOB_TIMEOUT = 240  # seconds per job; a hung collective fails the test instead of hanging CI

CASES = [(f, world) for f in tp_fixtures.FIXTURES.values() for world in f.gloo_worlds]
# torchrun sharding with 3 processes and TP 6, on every fixture whose heads split 6 ways.
SIX_WAY = [f for f in tp_fixtures.FIXTURES.values() if 6 in f.tp_sizes]


def _spawn(fn, nprocs: int, *args) -> None:
    """Run ``fn(rank, nprocs, *args)`` in ``nprocs`` spawned processes; raise on a failure or
    after JOB_TIMEOUT seconds (killing the processes)."""
    context = mp.start_processes(fn, (nprocs, *args), nprocs=nprocs, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + JOB_TIMEOUT
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{fn.__name__} with {nprocs} processes ran past {JOB_TIMEOUT} s")


@pytest.mark.parametrize("fixture,world", CASES, ids=[f"{f.name}-{n}proc" for f, n in CASES])
def test_gloo_ranks_load_all_reduce_and_rejoin(fixture, world, tmp_path, tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    _spawn(dist_workers.load_rank_allreduce_and_dtensors, world, str(tmp_path / "store"),
           str(path), fixture.qk_multiple)


@pytest.fixture(autouse=True)
def _children_keep_out_of_tmp(tmp_path, monkeypatch):
    """torchrun's launcher makes a ``torchelastic_*`` log directory with ``tempfile`` and leaves
    it behind: every child of these tests gets a TMPDIR inside the test's own ``tmp_path``, and
    the test fails if a new ``torchelastic_*`` appears in the real temporary directory."""
    real = Path(tempfile.gettempdir())
    before = {p.name for p in real.glob("torchelastic_*")}
    children = tmp_path / "tmpdir"
    children.mkdir()
    monkeypatch.setenv("TMPDIR", str(children))
    yield
    left = sorted({p.name for p in real.glob("torchelastic_*")} - before)
    assert not left, f"left in {real}: {left}"


def _torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         "--nproc-per-node", str(nproc), "-m", "kda_tp", *args],
        capture_output=True, text=True, timeout=JOB_TIMEOUT, env=env, check=False,
    )


def _same_tree(a: Path, b: Path) -> None:
    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert files_a == files_b
    for rel in files_a:
        assert filecmp.cmp(a / rel, b / rel, shallow=False), rel


@pytest.mark.parametrize("fixture", SIX_WAY, ids=[f.name for f in SIX_WAY])
@pytest.mark.parametrize("kda_only", [False, True], ids=["full", "kda-only"])
def test_torchrun_shard_equals_a_one_process_run_and_verifies(fixture, kda_only, tmp_path,
                                                              tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    extra = ["--qk-multiple", str(fixture.qk_multiple), "--quiet"]
    extra += ["--kda-only"] if kda_only else []
    one, many = tmp_path / "one", tmp_path / "many"
    assert cli.main(["shard", str(path), "--tp-size", "6", "--out", str(one), *extra]) == 0
    done = _torchrun(3, "shard", str(path), "--tp-size", "6", "--out", str(many), *extra)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [line for line in done.stdout.splitlines() if line.startswith("wrote ranks")]
    assert reports == [reports[0]] and "[0, 1, 2, 3, 4, 5] of 6" in reports[0], done.stdout
    assert "3 torchrun processes" in reports[0]
    _same_tree(one, many)
    assert cli.main(["verify", str(path), str(many)]) == 0


def test_torchrun_verify_numeric_all_reduces_over_the_processes(tmp_path, tmp_path_factory):
    fixture = tp_fixtures.FIXTURES["kimi12"]
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    out = tmp_path / "out"
    assert cli.main(["shard", str(path), "--tp-size", "4", "--out", str(out), "--quiet",
                     "--qk-multiple", "1"]) == 0
    done = _torchrun(2, "verify", str(path), str(out), "--numeric")
    assert done.returncode == 0, done.stderr[-4000:]
    assert done.stdout.count("numerical TP equivalence passes") == 1, done.stdout
    assert done.stdout.count("layer 0:") == 1 and "layer 1:" in done.stdout
    # A wrong rank fails on every process (the exit status of the job is 1).
    (out / "rank2").rename(out / "held")
    (out / "rank1").rename(out / "rank2")
    (out / "held").rename(out / "rank1")
    done = _torchrun(2, "verify", str(path), str(out), "--numeric")
    assert done.returncode != 0
    assert "FAIL" in done.stdout


def test_torchrun_shard_reports_a_refusal_once_and_writes_nothing(tmp_path, tmp_path_factory):
    fixture = tp_fixtures.FIXTURES["kimi12"]
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    done = _torchrun(2, "shard", str(path), "--tp-size", "5", "--out", str(tmp_path / "o"))
    assert done.returncode != 0  # each process exits 2; torchrun reports 1
    assert done.stderr.count("kda-tp: error: PlanError") == 1, done.stderr[-4000:]
    # A refused output directory (rank 3 exists, no --force) is refused before any process
    # writes its ranks.
    out = tmp_path / "out"
    (out / "rank3").mkdir(parents=True)
    done = _torchrun(2, "shard", str(path), "--tp-size", "4", "--out", str(out),
                     "--qk-multiple", "1")
    assert done.returncode != 0  # each process exits 2; torchrun reports 1
    assert done.stderr.count("kda-tp: error: OutputError") == 1, done.stderr[-4000:]
    assert sorted(p.name for p in out.iterdir()) == ["rank3"]


def test_torchrun_shard_takes_allow_resharding_skip_unindexed_and_json(tmp_path,
                                                                      tmp_path_factory):
    """The flags of a one-process ``shard`` work under torchrun too: refusals once, in JSON
    when asked, and the flag that lifts each."""
    import json
    import shutil

    fixture = tp_fixtures.FIXTURES["kimi12"]
    path = tmp_path / "ckpt"
    shutil.copytree(tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp()), path)
    extra = path / "mtp.safetensors"  # a file the index does not name
    shutil.copy(next(path.glob("model-*.safetensors")), extra)
    common = ["--tp-size", "2", "--qk-multiple", "1", "--quiet", "--json"]

    out = tmp_path / "out"
    done = _torchrun(2, "shard", str(path), "--out", str(out), *common)
    assert done.returncode != 0
    refused = json.loads(done.stdout)  # one document: process 0's
    assert refused["ok"] is False and "--skip-unindexed" in refused["error"]["message"]
    assert not out.exists() or list(out.iterdir()) == []

    done = _torchrun(2, "shard", str(path), "--out", str(out), "--skip-unindexed", *common)
    assert done.returncode == 0, done.stderr[-4000:]
    written = json.loads(done.stdout)
    assert written["ok"] is True and written["ranks"] == [0, 1] and written["processes"] == 2
    assert written["skipped_unindexed"] == [str(extra)]
    assert done.stderr.count("mtp.safetensors is not named by") == 1, done.stderr[-4000:]
    assert cli.main(["verify", str(path), str(out), "--quiet"]) == 0

    # A TP 1 output holds the full shapes: with the override it shards like the original.
    single = tmp_path / "single"
    assert cli.main(["shard", str(path), "--tp-size", "1", "--out", str(single), "--quiet",
                     "--skip-unindexed", "--qk-multiple", "1"]) == 0
    again = tmp_path / "again"
    done = _torchrun(2, "shard", str(single / "rank0"), "--out", str(again), *common)
    assert done.returncode != 0
    assert "already a tensor-parallel shard" in json.loads(done.stdout)["error"]["message"]
    assert done.stderr.count("kda-tp: error: CheckpointError") == 1, done.stderr[-4000:]
    assert not again.exists() or list(again.iterdir()) == []
    done = _torchrun(2, "shard", str(single / "rank0"), "--out", str(again),
                     "--allow-resharding", *common)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout)["ranks"] == [0, 1]
    assert cli.main(["verify", str(single / "rank0"), str(again), "--quiet"]) == 0


def test_torchrun_shard_respects_a_live_writers_lock_and_reports_sizes(tmp_path,
                                                                        tmp_path_factory):
    """A rank another process is writing (its lock held) refuses the whole job once, naming
    the holder, before any process writes; then the job writes, and ``--json`` carries the
    sizes of all the ranks (process 0's report)."""
    import fcntl
    import json

    fixture = tp_fixtures.FIXTURES["kimi12"]
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    out = tmp_path / "out"
    out.mkdir()
    common = ["--tp-size", "4", "--qk-multiple", "1", "--quiet", "--json"]
    with open(out / ".rank3.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("pid 4242 on node7, started 2026-01-02T03:04:05Z\n")
        held.flush()
        done = _torchrun(2, "shard", str(path), "--out", str(out), *common)
        assert done.returncode != 0
        assert done.stderr.count("kda-tp: error: OutputError") == 1, done.stderr[-4000:]
        assert ("rank 3 is being written by another kda-tp run (held by pid 4242 on node7, "
                "started 2026-01-02T03:04:05Z;") in done.stderr
        assert sorted(p.name for p in out.iterdir()) == [".rank3.lock"]
    done = _torchrun(2, "shard", str(path), "--out", str(out), *common)
    assert done.returncode == 0, done.stderr[-4000:]
    written = json.loads(done.stdout)
    sizes = written["sizes"]
    assert sizes["ranks"] == [0, 1, 2, 3] and sizes["total_bytes"] == written["bytes_written"]
    assert sizes["rank_bytes"] == [
        sum(p.stat().st_size for p in (out / f"rank{r}").glob("*.safetensors")) - headers
        for r, headers in enumerate(
            sum(8 + int.from_bytes(p.read_bytes()[:8], "little")
                for p in (out / f"rank{r}").glob("*.safetensors")) for r in range(4))
    ]
    assert sorted(p.name for p in out.iterdir()) == ["rank0", "rank1", "rank2", "rank3"]
