"""The command line as a new user meets it: ``--layers``, Ctrl-C,
progress lines, ``--json``, messages that point at the fix, re-sharding an output, and
``.safetensors`` files the index does not name."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import kda_tp
import pytest
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import PlanError
from kda_tp.checkpoint import check_layers
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from children import kda_tp_child
from cli_run import run
from paths import DATA
from tp_fixtures import small_checkpoint_fixtures

# 4 decoder layers, 0-based 0..2 KDA and 3 full attention (MLA); Kimi's config says 1,2,3.
# TP 1 and 2 pass the 256-channel rule, TP 4 only with --qk-multiple 1.
SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=4)

ckpt, sharded = small_checkpoint_fixtures({**SMALL, "kda_layers": [0, 1, 2]}, seed=3)


def _retype(path: Path, name: str, dtype: str, data: bytes | None = None) -> None:
    """Rewrite one tensor of a safetensors file with another dtype (and, optionally, bytes)."""
    source = kda_tp.SafetensorsSource(path)
    specs = []
    for n in source.names():
        t = source.get(n)
        payload = bytes(t) if n != name else (data if data is not None else bytes(t))
        specs.append((n, dtype if n == name else t.dtype, t.shape, len(payload),
                      lambda p=payload: p))
    meta = source.files()[0][1]
    del source
    write_safetensors(path, specs, meta)


def _flip_byte(path: Path, name: str, offset: int) -> None:
    """Flip one byte of tensor ``name``'s data in place."""
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[:8], "little")
    begin = json.loads(data[8 : 8 + header_len])[name]["data_offsets"][0]
    data[8 + header_len + begin + offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- 1. --layers ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad, words", [
    ([-1], ["-1 is negative", "the model has 4 layers, 0..3"]),
    ([1, 1], ["1 given more than once", "the model has 4 layers"]),
    ([7], ["7 out of range", "the model has 4 layers, 0..3"]),
    ([0, 3], ["3 not a KDA layer", "0,1,2"]),
    # MLA layer 3: not a KDA layer, or Kimi's 1-based 3.
    ([3], ["3 not a KDA layer", "1-based", "--layers 2"]),
    ([1, 2, 3], ["1-based", "--layers 0,1,2"]),
    ([1, 4], ["4 out of range", "the model has 4 layers"]),
    ([], ["empty"]),
])
def test_check_layers_refuses_with_the_layer_count(bad, words):
    kda = (0, 1, 2)
    with pytest.raises(PlanError) as info:
        check_layers(bad, kda, 4)
    for word in words:
        assert word in str(info.value), (bad, str(info.value))


def test_check_layers_takes_0_based_layers_and_names_a_1_based_list():
    kda = (0, 1, 2)
    assert check_layers([2, 0], kda, 4) == (0, 2)
    assert check_layers([1, 2], kda, 4) == (1, 2)  # valid 0-based, though also 1 more than 0,1
    # Every layer KDA: 1..4 is out of range as 0-based, and recognised as 1-based.
    with pytest.raises(PlanError, match="1-based.*--layers 0,1,2,3"):
        check_layers([1, 2, 3, 4], (0, 1, 2, 3), 4)


def test_plan_from_config_checks_layers_as_the_command_line_does(ckpt):
    """``KdaTpPlan.from_config(..., layers=)`` refuses what ``--layers`` refuses, in the API's
    words, for a checkpoint and for its bare config (4 layers, KDA 0..2, MLA 3)."""
    for src in (ckpt, ckpt / "config.json"):
        for bad, message in [
            ([1, 2, 3], "layers=[1, 2, 3]: 3 not a KDA layer (the KDA layers, 0-based, are "
                        "0,1,2); the list looks 1-based (each entry is one more than a KDA "
                        "layer, as in Kimi-Linear's config.json), and layers takes 0-based "
                        "indices: layers=[0, 1, 2]"),
            # The MLA layer: not "KDA layer 3 lacks ...k_proj.weight".
            ([3], "layers=[3]: 3 not a KDA layer (the KDA layers, 0-based, are 0,1,2); the "
                  "list looks 1-based"),
            ([0, 3], "layers: 3 not a KDA layer (the KDA layers, 0-based, are 0,1,2)"),
            ([0, 9], "layers: 9 out of range (the model has 4 layers, 0..3)"),
            ([-1], "layers: -1 is negative; layers are 0-based indices"),
            ([], "layers is empty"),
        ]:
            with pytest.raises(PlanError, match=re.escape(message)):
                kda_tp.KdaTpPlan.from_config(src, 0, 2, layers=bad)
        plan = kda_tp.KdaTpPlan.from_config(src, 1, 2, layers=[2, 0])
        assert plan == kda_tp.KdaTpPlan.from_config(src, 1, 2)


def test_shard_layers_is_only_an_override(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--layers", "0,1")
    assert status == 2 and "every KDA layer the config lists (0,1,2)" in err
    assert "verify --numeric --layers" in err and not out.exists()
    # Kimi's own numbers, copied from config.json:
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--layers", "1,2,3")
    assert status == 2 and "1-based" in err and "--layers 0,1,2" in err and not out.exists()
    # The config's own list is accepted.
    assert run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--layers", "0,1,2",
               "--quiet")[0] == 0


@pytest.mark.parametrize("value, word", [("-1", "negative"), ("0,0,1,2", "more than once"),
                                         ("0,1,9", "range")])
def test_shard_layers_refusals_give_the_layer_count(ckpt, tmp_path, capsys, value, word):
    out = tmp_path / "out"
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out,
                         f"--layers={value}")
    assert status == 2 and word in err and "the model has 4 layers" in err, err
    assert not out.exists()


def test_shard_layers_for_a_config_without_the_list(ckpt, tmp_path, capsys):
    config = json.loads((ckpt / "config.json").read_text())
    del config["linear_attn_config"]["kda_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out)
    assert status == 2 and "does not list the KDA layers" in err and "pass --layers" in err
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--layers", "1,2,3")
    assert status == 2 and "1-based" in err and "--layers 0,1,2" in err
    assert run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--layers", "0,1,2",
               "--quiet")[0] == 0
    assert run(capsys, "verify", ckpt, out, "--quiet")[0] == 0


def test_verify_and_plan_layers_select(ckpt, sharded, capsys):
    status, out, _ = run(capsys, "verify", ckpt, sharded, "--numeric", "--layers", "1", "--json")
    doc = json.loads(out)
    assert status == 0 and [e["layer"] for e in doc["numeric"]["layers"]] == [1]
    assert doc["tensors"] == len(kda_tp.SafetensorsSource(ckpt).names())  # bytes: all
    status, _, err = run(capsys, "verify", ckpt, sharded, "--numeric", "--layers", "1,2,3")
    assert status == 2 and "1-based" in err and "--layers 0,1,2" in err
    status, _, err = run(capsys, "verify", ckpt, sharded, "--layers", "1")
    assert status == 2 and "--numeric" in err
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--layers", "0,2", "--json")
    assert status == 0 and json.loads(out)["kda_layers"] == [0, 2]
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--layers", "2")
    assert status == 0 and "1 KDA layer:" in out
    status, _, err = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2, "--layers", "1,2,3")
    assert status == 2 and "1-based" in err and "--layers 0,1,2" in err


# --- 2. Ctrl-C ------------------------------------------------------------------------------


# Ranks one at a time (one writer thread). Rank 1's writer holds its first write until the
# command has taken the Ctrl-C (it stops the writers, then waits for them), so when the test
# interrupts, rank 0 is complete and rank 1 half-written, however fast the machine is.
_HOLD_RANK_1 = """
import os, threading
from kda_tp.checkpoint import files as _files
from kda_tp.shard import writer as shard
os.cpu_count = lambda: 1
stopping = threading.Event()
write, shutdown = _files.checked_write, shard._shutdown
def held(f, path, data):
    if path.parent.name.startswith(".rank1.partial-"):
        stopping.wait()
    write(f, path, data)
def stop(pool):
    stopping.set()
    shutdown(pool)
_files.checked_write, shard._shutdown = held, stop
"""


def test_ctrl_c_stops_cleans_up_and_says_how_to_finish(ckpt, tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen(
        kda_tp_child(_HOLD_RANK_1, "shard", ckpt, "--tp-size", 4, "--qk-multiple", 1, "--out",
                     out, "--quiet"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Interrupt once rank 1 is being written (held there until the signal; the deadline only
    # turns a regression into a failure instead of a hung suite).
    deadline = time.monotonic() + 120
    while not list(out.glob(".rank1.partial-*")):
        assert child.poll() is None, child.communicate()
        if time.monotonic() > deadline:
            child.kill()
            pytest.fail(f"rank 1 was not being written after 120 s: {child.communicate()}")
        time.sleep(0.01)
    child.send_signal(signal.SIGINT)
    stdout, stderr = child.communicate(timeout=120)
    assert child.returncode == 130, (stdout, stderr)
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    # Only the complete rank is left: no partial directory of this run.
    assert sorted(p.name for p in out.iterdir()) == ["rank0"]
    first, second = stderr.splitlines()
    assert first == ("kda-tp: interrupted; removed this run's partial rank directories; "
                     "ranks completed by this run: 0")
    finish = second.removeprefix("kda-tp: to finish, run: ")
    assert finish == (f"kda-tp shard {shlex.quote(str(ckpt))} --tp-size 4 --out "
                      f"{shlex.quote(str(out))} --ranks 1,2,3 --qk-multiple 1")
    # The suggested command completes the job.
    assert main(shlex.split(finish)[1:] + ["--quiet"]) == 0
    assert main(["verify", str(ckpt), str(out), "--quiet"]) == 0


def test_ctrl_c_in_process_leaves_no_partial(ckpt, tmp_path, monkeypatch):
    """The library raises ShardInterrupted (a KeyboardInterrupt) after the writers stopped."""
    import kda_tp.shard.writer as shard

    calls = {"n": 0}

    def interrupted_wait(futures):
        calls["n"] += 1
        raise KeyboardInterrupt

    monkeypatch.setattr(shard, "wait", interrupted_wait)
    out = tmp_path / "out"
    with pytest.raises(shard.ShardInterrupted) as info:
        shard_checkpoint(ckpt, out, 2)
    assert calls["n"] == 1
    e = info.value
    assert isinstance(e, KeyboardInterrupt) and e.tp_size == 2
    # The output directory this run created stays only if a rank was completed in it.
    present = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert present == [f"rank{r}" for r in e.completed]
    assert e.remaining == tuple(r for r in range(2) if r not in e.completed)


def test_ctrl_c_elsewhere_exits_130_without_traceback(ckpt, sharded, capsys, monkeypatch):
    import kda_tp.shard.verify as shard

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(shard, "verify_shards", interrupted)
    status, out, err = run(capsys, "verify", ckpt, sharded, "--json")
    assert status == 130 and err == "kda-tp: interrupted\n"
    assert json.loads(out) == {"ok": False, "interrupted": True}


def test_already_exists_and_missing_ranks_name_the_finishing_ranks(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--ranks", 0, "--quiet")[0] == 0
    status, text, _ = run(capsys, "verify", ckpt, out)
    assert status == 1 and f"--out {out} --ranks 1" in text and "kda-tp shard" in text
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--quiet")
    assert status == 2 and "already exists" in err and "--ranks 1" in err


# --- 3. progress ----------------------------------------------------------------------------


def test_progress_lines_when_not_a_terminal(ckpt, tmp_path, capsys, monkeypatch):
    import kda_tp.cli._progress as cli_progress

    # A clock that stands still: the lines come every few seconds, not per tensor, so the run
    # prints its last line only, however long it takes.
    monkeypatch.setattr(cli_progress, "time", SimpleNamespace(monotonic=lambda: 0.0))
    out = tmp_path / "out"
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out)
    # After what it will write, the progress line (no --kda-only hint: the MLA layer is sliced
    # too, so the slices outweigh the copies; the hint: tests/cli/test_shard_writers.py).
    lines = err.splitlines(keepends=True)
    assert status == 0 and lines[0].startswith("shard: writing ") and len(lines) == 2
    unit = re.match(r"shard: writing [\d.]+ (\w+) ", lines[0]).group(1)  # one unit throughout
    assert re.fullmatch(rf"shard: [\d.]+ of [\d.]+ {unit} \(100%\), 0\.0 s\n", lines[1])
    status, _, err = run(capsys, "verify", ckpt, out)
    n = len(kda_tp.SafetensorsSource(ckpt).names())
    assert status == 0 and f"verify: {n} of {n} tensors (100%)" in err
    assert run(capsys, "verify", ckpt, out, "--quiet")[2] == ""
    assert run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--force", "--quiet")[2] == ""


# --- 4. --json ------------------------------------------------------------------------------


def test_json_documents(ckpt, tmp_path, capsys):
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--rank", 1, "--json")
    plan = json.loads(out)
    assert status == 0 and plan["tp_size"] == 2 and plan["tp_rank"] == 1
    assert plan["kda_layers"] == [0, 1, 2] and plan["all_reduce"] is True
    o_proj = next(t for t in plan["tensors"] if t["name"] == "o_proj")
    assert o_proj == {"name": "o_proj", "kind": "CHANNEL_COLS", "dtype": "BF16",
                      "full_shape": [96, 256], "local_shape": [96, 128], "sharded_axis": 1,
                      "offset": 128, "local_bytes": 96 * 128 * 2, "full_bytes": 96 * 256 * 2}
    a_log = next(t for t in plan["tensors"] if t["name"] == "A_log")
    assert a_log["dtype"] == "F32" and a_log["sharded_axis"] == 2 and a_log["offset"] == 2

    dest = tmp_path / "out"
    status, out, _ = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", dest, "--json")
    written = json.loads(out)
    assert status == 0 and written["ranks"] == [0, 1] and written["ok"] is True
    assert written["rank_dirs"] == [str(rank_dir(dest, r)) for r in (0, 1)]
    assert written["bytes_written"] > 0

    status, out, _ = run(capsys, "verify", ckpt, dest, "--numeric", "--json")
    checked = json.loads(out)
    assert status == 0 and checked["ok"] is True and checked["problems"] == []
    assert [e["layer"] for e in checked["numeric"]["layers"]] == [0, 1, 2]

    _flip_byte(dest / "rank1" / "model-00001-of-00002.safetensors",
               "model.layers.0.self_attn.q_proj.weight", 5)
    status, out, _ = run(capsys, "verify", ckpt, dest, "--json")
    failed = json.loads(out)
    assert status == 1 and failed["ok"] is False and len(failed["problems"]) == 1

    status, out, err = run(capsys, "shard", ckpt, "--tp-size", 3, "--out", tmp_path / "x",
                           "--json")
    refused = json.loads(out)
    assert status == 2 and refused["ok"] is False and refused["error"]["type"] == "PlanError"
    assert "PlanError" in err


# --- 5. messages that point at the fix ------------------------------------------------------


@pytest.mark.parametrize("command", ["plan", "shard", "verify"])
def test_one_file_of_an_indexed_checkpoint(ckpt, sharded, tmp_path, capsys, command):
    one = ckpt / "model-00001-of-00002.safetensors"
    args = {"plan": ["plan", one, "--tp-size", 2],
            "shard": ["shard", one, "--tp-size", 2, "--out", tmp_path / "o"],
            "verify": ["verify", one, sharded]}[command]
    status, _, err = run(capsys, *args)
    assert status == 2, args
    assert f"pass the directory {ckpt} (it has model.safetensors.index.json)" in err


def test_verify_against_another_checkpoint(ckpt, sharded, tmp_path, capsys):
    other = write_small_checkpoint(tmp_path / "other", **{**SMALL, "num_layers": 3},
                                   kda_layers=[0, 1], seed=3)
    status, _, err = run(capsys, "verify", other, sharded)
    assert status == 2 and "sharded from another checkpoint" in err and "lacks" not in err
    # Same names and shapes, other values (a fine-tune and its base model):
    twin = write_small_checkpoint(tmp_path / "twin", **SMALL, kda_layers=[0, 1, 2], seed=4)
    status, _, err = run(capsys, "verify", twin, sharded)
    assert status == 2 and "sharded from another checkpoint" in err


def test_verify_a_directory_that_is_not_an_output(ckpt, tmp_path, capsys):
    status, _, err = run(capsys, "verify", ckpt, ckpt)
    assert status == 2 and "not a kda-tp shard output" in err
    shard_checkpoint(ckpt, tmp_path / "out", 2)
    status, _, err = run(capsys, "verify", ckpt, tmp_path / "out" / "rank0")
    assert status == 2 and err.rstrip().endswith(
        f"it is one rank of an output: pass its parent directory {tmp_path / 'out'}")
    (tmp_path / "empty").mkdir()
    assert run(capsys, "verify", ckpt, tmp_path / "empty")[0] == 1  # nothing written yet


@pytest.mark.parametrize(
    "name, file, rank, words",
    [
        ("model.layers.1.self_attn.q_proj.weight", 1, 1, "CHANNEL_ROWS slices do not rejoin"),
        ("model.layers.0.self_attn.o_proj.weight", 0, 0, "CHANNEL_COLS slices do not rejoin"),
        ("model.layers.0.self_attn.f_a_proj.weight", 0, 1, "replicated copy on rank 1"),
        ("model.embed_tokens.weight", 0, 0, "the copy on rank 0 differs"),
    ],
)
def test_a_corrupted_byte_names_rank_and_tensor(ckpt, sharded, capsys, name, file, rank, words):
    rank_source = kda_tp.SafetensorsSource(rank_dir(sharded, rank))
    path = rank_source.file_of(name)
    del rank_source
    _flip_byte(path, name, 3)
    status, out, _ = run(capsys, "verify", ckpt, sharded)
    assert status == 1 and name in out and words in out and f"rank {rank}" in out, out


def test_the_qk_rule_names_the_flag_and_the_sizes_that_pass(ckpt, tmp_path, capsys):
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 4, "--out", tmp_path / "o")
    assert status == 2 and "--qk-multiple 1" in err and "qk_multiple=1" not in err
    assert ("with --qk-multiple 256 (the default) the TP sizes that pass are 1, 2 "
            "(1, 2, 4 with --qk-multiple 1)") in err
    status, _, err = run(capsys, "plan", ckpt, "--tp-size", 3)
    assert status == 2 and "divisible by tp_size (3)" in err and "pass are 1, 2 (" in err
    assert run(capsys, "plan", ckpt, "--tp-size", 4, "--qk-multiple", 1)[0] == 0
    # Where the plan's own list of divisors is the answer, it is not repeated.
    status, _, err = run(capsys, "plan", ckpt, "--tp-size", 3, "--qk-multiple", 1)
    assert status == 2 and "may be one of 1, 2, 4" in err and "pass are" not in err


def test_fp8_kda_tensor_names_the_dtypes_a_kda_tensor_may_have(ckpt, tmp_path, capsys):
    name = "model.layers.0.self_attn.q_proj.weight"
    path = kda_tp.SafetensorsSource(ckpt).file_of(name)
    size = 256 * 96
    _retype(path, name, "F8_E4M3", bytes(size))
    # No block-FP8 format in the config: refused, naming the formats that are supported.
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", tmp_path / "o")
    assert status == 2 and "q_proj.weight: an FP8 weight" in err
    assert "supported block-FP8 formats: ModelOpt FP8_PB_WO" in err
    assert "is not a floating-point dtype" not in err
    with pytest.raises(PlanError, match="F8_E4M3 is not allowed for a KDA tensor: BF16, F16, "
                                        "F32 or F64, and F8_E4M3 or F8_E5M2 only for a "
                                        "block-quantized projection"):
        kda_tp.KdaTpPlan(0, 2, 96, 64, 4, 4, 16, dtypes={"q_proj": "F8_E4M3"})


def test_demo_says_how_to_keep_its_files(capsys):
    status, out, _ = run(capsys, "demo", "--tp-size", 2, "--num-layers", 1, "--no-numeric")
    assert status == 0 and "deleted on exit; --keep DIR keeps it" in out


def test_oracle_command_line_prints_no_warning(ckpt, sharded):
    done = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-m", "kda_tp.oracle", "verify",
         str(ckpt), str(sharded)],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert done.returncode == 0 and done.stderr == "" and done.stdout.startswith("OK"), done


# --- 6. re-sharding an output ---------------------------------------------------------------


def test_a_rank_directory_is_not_taken_as_input(ckpt, sharded, tmp_path, capsys):
    status, _, err = run(capsys, "shard", rank_dir(sharded, 0), "--tp-size", 2, "--out",
                         tmp_path / "again")
    assert status == 2 and "already a tensor-parallel shard (rank 0 of 2" in err
    assert "--allow-resharding" in err and not (tmp_path / "again").exists()
    # A TP=1 output holds the full shapes, so with the override it shards like the original.
    single = tmp_path / "single"
    shard_checkpoint(ckpt, single, 1)
    status, _, err = run(capsys, "shard", rank_dir(single, 0), "--tp-size", 2, "--out",
                         tmp_path / "again")
    assert status == 2 and "already a tensor-parallel shard" in err
    assert run(capsys, "shard", rank_dir(single, 0), "--tp-size", 2, "--out",
               tmp_path / "again", "--allow-resharding", "--quiet")[0] == 0


# --- 8. files the index does not name -------------------------------------------------------


def test_an_unindexed_file_is_refused_or_skipped_by_flag(ckpt, tmp_path, capsys):
    extra = ckpt / "mtp.safetensors"
    write_safetensors(extra, [("model.mtp.weight", "BF16", (4, 4), 32, lambda: bytes(32))])
    out = tmp_path / "out"
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out)
    assert status == 2 and "mtp.safetensors" in err and "--skip-unindexed" in err
    assert not out.exists()
    status, _, err = run(capsys, "shard", ckpt, "--tp-size", 2, "--out", out, "--skip-unindexed",
                         "--quiet")
    assert status == 0 and f"warning: {extra} is not named by" in err
    assert not any(p.name == "mtp.safetensors" for p in out.rglob("*"))
    status, out_text, err = run(capsys, "verify", ckpt, out, "--json", "--quiet")
    assert status == 0 and json.loads(out_text)["unindexed"] == [str(extra)]
    assert f"warning: {extra} is not named by" in err


THREE_LAYERS = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3)


@pytest.fixture
def three_layer_ckpt(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "three_layer_ckpt", **THREE_LAYERS, kda_layers=[0, 2], seed=5)


def _cli_without_torch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """``kda-tp ARGS`` in a subprocess where ``import torch`` fails, with extra environment."""
    code = textwrap.dedent(f"""
        import sys
        sys.modules["torch"] = None
        from kda_tp.cli import main
        sys.exit(main({list(args)!r}))
    """)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=120)


def test_verify_under_torchrun_without_torch_is_a_named_error(tmp_path):
    out = tmp_path / "out"
    shard_checkpoint(DATA / "k3_small", out, 2)
    done = _cli_without_torch({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"},
                              "verify", str(DATA / "k3_small"), str(out))
    assert done.returncode == 2, done.stderr
    assert "MissingDependencyError" in done.stderr and "Traceback" not in done.stderr
    done = _cli_without_torch({"TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "abc"},
                              "verify", str(DATA / "k3_small"), str(out))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "WORLD_SIZE='abc' (set by torchrun) is not a positive integer" in done.stderr


def test_torchrun_processes_reads_torchruns_environment_without_importing_torch(monkeypatch):
    from kda_tp.shard.torchrun import torchrun_processes

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.setenv("WORLD_SIZE", "8")  # another launcher's: not a torchrun job
    assert torchrun_processes() == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert torchrun_processes() == 8
    done = subprocess.run([sys.executable, "-c", "import sys, kda_tp.shard.torchrun as t; "
                           "print(t.torchrun_processes(), 'torch' in sys.modules)"],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TORCHELASTIC_RUN_ID": "x", "WORLD_SIZE": "2"})
    assert done.stdout.strip() == "2 False", done.stderr


@pytest.mark.parametrize("bad", ["0", "-1", "two"])
def test_torchrun_processes_refuses_a_world_size_that_is_not_positive(monkeypatch, bad):
    from kda_tp.shard.torchrun import torchrun_processes

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", bad)
    with pytest.raises(PlanError, match=f"WORLD_SIZE={bad!r} .set by torchrun."):
        torchrun_processes()


def test_a_plan_from_the_config_alone_says_its_shapes_are_assumed(capsys):
    assert main(["plan", str(DATA / "k3_small" / "config.json"), "--tp-size", "2"]) == 0
    assert "from the config alone: on-disk shapes and dtypes are assumed" in capsys.readouterr().out
    assert main(["plan", str(DATA / "k3_small"), "--tp-size", "2"]) == 0
    text = capsys.readouterr().out
    assert "assumed" not in text and "1 KDA layer: " in text


def test_a_closed_pipe_ends_the_cli_without_a_traceback(tmp_path):
    code = ("import subprocess, sys\n"
            f"p = subprocess.Popen([sys.executable, '-m', 'kda_tp', 'plan', {str(DATA / 'k3_small')!r},"
            " '--tp-size', '2', '--json'], stdout=subprocess.PIPE, stderr=subprocess.PIPE)\n"
            "p.stdout.close()\n"
            "err = p.stderr.read().decode()\n"
            "print(err)\n"
            "print('status', p.wait())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stdout and "BrokenPipeError" not in done.stdout, done.stdout
    # 128 + SIGPIPE, as a shell reports `yes | head`; not 1 ("verification failed").
    assert done.stdout.rstrip().endswith("status 141"), done.stdout


def test_layers_argument_when_the_config_does_not_list_them(three_layer_ckpt, tmp_path):
    config = json.loads((three_layer_ckpt / "config.json").read_text())
    del config["linear_attn_config"]["kda_layers"]
    (three_layer_ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(kda_tp.CheckpointError, match="pass layers="):
        shard_checkpoint(three_layer_ckpt, tmp_path / "out", 2)
    shard_checkpoint(three_layer_ckpt, tmp_path / "out", 2, layers=[0, 2])
    rank1 = kda_tp.SafetensorsSource(rank_dir(tmp_path / "out", 1))
    assert rank1.info("model.layers.2.self_attn.q_proj.weight")[1] == (128, 96)
    assert rank1.info("model.layers.1.self_attn.q_proj.weight")[1] != (128, 96)  # not KDA
    assert verify_shards(three_layer_ckpt, tmp_path / "out").ok


def test_an_empty_kda_layer_list_is_a_named_error(three_layer_ckpt, tmp_path):
    config = json.loads((three_layer_ckpt / "config.json").read_text())
    config["linear_attn_config"]["kda_layers"] = []
    (three_layer_ckpt / "config.json").write_text(json.dumps(config))
    with pytest.raises(kda_tp.CheckpointError, match="no KDA layer"):
        shard_checkpoint(three_layer_ckpt, tmp_path / "out", 2)


def test_a_misspelt_flag_is_named_with_the_closest_real_one(ckpt, capsys):
    with pytest.raises(SystemExit) as info:
        main(["plan", str(ckpt), "--tp-szie", "4"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert "kda-tp: error: plan: unrecognized argument --tp-szie; did you mean --tp-size?" in err
    assert "required" not in err


def _refusal(capsys, *argv: str) -> str:
    """The last stderr line of ``kda-tp ARGV``, which must be argparse's refusal (exit 2) and the
    only ``kda-tp: error:`` line."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert sum(line.startswith("kda-tp: error:") for line in err.splitlines()) == 1, err
    return err.splitlines()[-1]


@pytest.mark.parametrize("flag", ["--tp", "--tp-s", "-tp"])
def test_an_abbreviated_or_one_dash_flag_is_refused_with_the_real_one(ckpt, capsys, flag):
    """No abbreviations (allow_abbrev=False): ``--tp 4`` is not silently ``--tp-size 4``."""
    assert _refusal(capsys, "plan", str(ckpt), flag, "4") == (
        f"kda-tp: error: plan: unrecognized argument {flag}; did you mean --tp-size?")


def test_a_misspelt_command_is_named_with_the_closest_real_one(capsys):
    assert _refusal(capsys, "shrad", "ckpt", "--tp-size", "4") == (
        "kda-tp: error: unknown command 'shrad'; did you mean shard?")
    assert _refusal(capsys, "bogus") == (
        "kda-tp: error: unknown command 'bogus'; choose from plan, shard, verify, audit, dump, "
        "digests, demo")
    assert _refusal(capsys, "--vers") == (
        "kda-tp: error: unrecognized argument --vers; did you mean --version?")


def test_a_bare_kda_tp_lists_its_commands_and_exits_2(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    err = capsys.readouterr().err
    assert info.value.code == 2
    for command, words in [("plan", "print the shard table"), ("shard", "write one checkpoint"),
                           ("verify", "check a shard output"), ("audit", "check the KDA weights"),
                           ("dump", "write the KDA parameters"), ("digests", "print the SHA-256"),
                           ("demo", "plan, shard and verify")]:
        assert re.search(rf"^ +{command} +{words}", err, re.M), (command, err)
    assert err.splitlines()[-1] == (
        "kda-tp: error: a command is required: plan, shard, verify, audit, dump, digests, demo "
        "(kda-tp COMMAND --help says more)")


def test_a_negative_number_stays_a_value_for_argparse_to_judge(ckpt, capsys):
    assert _refusal(capsys, "plan", str(ckpt), "--tp-size", "2", "--rank", "-1") == (
        "kda-tp: error: plan: argument --rank: must be an integer >= 0, got -1")


def test_a_subcommand_s_bad_flag_prints_that_subcommand_s_usage(ckpt, sharded, capsys):
    with pytest.raises(SystemExit) as info:
        main(["verify", str(ckpt), str(sharded), "--numerc"])
    err = capsys.readouterr().err
    assert info.value.code == 2
    assert err.startswith("usage: kda-tp verify ")
    assert err.splitlines()[-1] == ("kda-tp: error: verify: unrecognized argument --numerc; "
                                    "did you mean --numeric?")
    assert sum(line.startswith("kda-tp: error:") for line in err.splitlines()) == 1


def test_an_out_of_range_rank_gives_the_valid_ranks(ckpt, capsys):
    assert main(["plan", str(ckpt), "--tp-size", "2", "--rank", "2"]) == 2
    err = capsys.readouterr().err
    assert "rank 2 is out of range for --tp-size 2: valid ranks are 0..1" in err


def test_an_unreadable_input_companion_under_verify_is_a_named_error(
    ckpt, sharded, capsys, monkeypatch
):
    """Root reads any file, so the PermissionError is simulated for the input's config."""
    real = Path.read_bytes

    def read_bytes(self: Path) -> bytes:
        if self == ckpt / "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert main(["verify", str(ckpt), str(sharded), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kda-tp: error: CheckpointError: ") and "Permission denied" in err


def test_audit_names_the_config_file_of_a_bad_config_value(
    kept: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status, _, err = run(capsys, "dump", kept / "checkpoint", "--engine",
                         "vllm-0.33-kimi-linear", "--tp-size", 2, "--out", tmp_path / "dump")
    assert status == 0, err
    bad = tmp_path / "bad"
    shutil.copytree(kept / "checkpoint", bad)
    config = json.loads((bad / "config.json").read_text())
    config["linear_attn_config"]["head_dim"] = "many"
    (bad / "config.json").write_text(json.dumps(config))
    expected = (f"kda-tp: error: CheckpointError: {bad / 'config.json'}: "
                "'linear_attn_config.head_dim' = 'many' is not an integer in [1, 2**31)\n")
    for command in (["audit", bad, tmp_path / "dump", "--tp-size", 2],
                    ["plan", bad, "--tp-size", 2]):
        status, out, err = run(capsys, *command)
        assert (status, out, err) == (2, "", expected)
