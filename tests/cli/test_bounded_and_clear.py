"""Bounded and clear (issue 38 F12 and F19, issue 39 item 7): every refusal one ``kda-tp:
error:`` line and exit 2, within seconds, naming what to change.

* F12: ``--seq-len 1048576`` (the numeric check of ``verify`` and ``demo``) reached 19 GB
  resident, and under a memory cap the refusal blamed "one tensor". Now ``--seq-len`` is bounded
  by the memory its activations need, refused before anything is generated or checked, naming
  it.
* F19: ``--qk-multiple``, ``--gate-rank`` and ``dump``/``digests``' ``--tp-size`` took ``1_6``
  and fullwidth digits that ``--tp-size`` refuses elsewhere: one integer reader for every
  integer option. A path holding a newline split the error line: escaped in the one place error
  lines are formatted. ``dump`` of world size 4 into an output holding a tp2 shard was accepted
  without ``--force``: one world size per output for ``dump`` too.
* Issue 39 item 7: a missing path was said three ways (``no such directory``, ``no such file or
  directory``, Rust's ``No such file or directory (os error 2)``): one wording now.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import kda_tp
from kda_tp.cli.entry import _parser
from kda_tp.errors import CheckpointError, OutputError, UsageError
from kda_tp.reference.equivalence import check_numeric_memory, numeric_check_bytes
from kda_tp.shard import shard_checkpoint

from cli_run import run
from paths import DATA

KIMI_LINEAR = DATA / "engine_ranks" / "ckpt_kl"
ENGINE = ("--engine", "vllm-0.33-kimi-linear")
#: Seconds a refusal may take (a bound on a hang, not a speed assertion).
SECONDS = 30


def one_line(status: int, err: str, error: str) -> str:
    """Assert a refusal (exit 2, one ``kda-tp: error:`` line of ``error``); return it."""
    assert status == 2, err
    assert err.count("\n") == 1 and err.startswith(f"kda-tp: error: {error}"), err
    return err


# --- F12: --seq-len bounded by the memory it needs ---------------------------------------------


def test_the_activations_grow_with_seq_len_and_are_refused_past_the_memory_free() -> None:
    per_token = numeric_check_bytes(2304, 32, 128, 1)
    assert numeric_check_bytes(2304, 32, 128, 1000) == 1000 * per_token
    check_numeric_memory(2304, 32, 128, 16, free=per_token * 16)
    with pytest.raises(UsageError) as info:
        check_numeric_memory(2304, 32, 128, 1_048_576, free=8 * 10**9)
    message = str(info.value)
    assert message.startswith("seq_len (--seq-len) 1048576: the numeric check would hold about "
                              "245 GB of float32 activations (233 kB per token for 32 heads of "
                              "128 and hidden 2304), more than the 8 GB of memory free here; "
                              f"pass a --seq-len of at most {8 * 10**9 // per_token}"), message


def _capped(*args: object, limit: int = 4 << 30) -> tuple[int, str, str, float]:
    """``python -m kda_tp ARGS`` in a child whose address space is capped (``ulimit -v``)."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kda_tp", *map(str, args)], capture_output=True,
                          text=True, timeout=300, preexec_fn=cap)
    return done.returncode, done.stdout, done.stderr, time.perf_counter() - start


def test_demo_refuses_a_seq_len_past_its_memory_before_generating(tmp_path: Path) -> None:
    """Under a 4 GiB cap the demo used to generate, shard, then die in the numeric check with
    "kda-tp holds one tensor ... in memory at a time"."""
    status, out, err, seconds = _capped("demo", "--num-layers", 1, "--tp-size", 2,
                                        "--seq-len", 65536, "--keep", tmp_path / "keep")
    line = one_line(status, err, "UsageError: seq_len (--seq-len) 65536: the numeric check "
                    "would hold about 15.3 GB of float32 activations")
    assert "one tensor" not in line and "pass a --seq-len of at most " in line
    assert out == "" and seconds < SECONDS and not (tmp_path / "keep").exists()


def test_verify_refuses_a_seq_len_past_its_memory_before_the_byte_check(
    kept: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import kda_tp.reference.equivalence as equivalence
    import kda_tp.shard.verify as verify

    monkeypatch.setattr(equivalence, "free_memory", lambda: 10**9)
    checked = []
    monkeypatch.setattr(verify, "_check_tensor", lambda *a: checked.append(a) or None)
    status, _, err = run(capsys, "verify", kept / "checkpoint", kept / "tp2", "--numeric",
                         "--seq-len", 8192)
    one_line(status, err, "UsageError: seq_len (--seq-len) 8192: the numeric check would hold "
             "about 1.91 GB")
    assert checked == [], "refused before the byte check"
    status, _, err = run(capsys, "verify", kept / "checkpoint", kept / "tp2", "--numeric",
                         "--seq-len", 16)
    assert status == 0, err


def test_running_out_of_memory_in_the_check_names_the_seq_len(
    kept: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the estimate did not see (another process took the memory meanwhile) is still named
    as the seq_len's, not as one tensor's."""
    import kda_tp.reference.equivalence as equivalence

    def full(*args: object, **kwargs: object) -> None:
        raise MemoryError("Unable to allocate 1.00 GiB for an array")

    monkeypatch.setattr(equivalence, "source_layer_forward", full)
    status, _, err = run(capsys, "verify", kept / "checkpoint", kept / "tp2", "--numeric",
                         "--quiet")
    line = one_line(status, err, "UsageError: seq_len (--seq-len) 16: out of memory in the "
                    "numeric check")
    assert "pass a smaller --seq-len" in line and "one tensor" not in line


# --- F19: one integer reader for every integer option ----------------------------------------


def _integer_options() -> list[tuple[str, str, argparse.Action]]:
    """Every option of every command whose value is an integer (or a list of them)."""
    parser = _parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found = []
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.type is int or getattr(action.type, "__name__", "") in (
                    "_tp_size", "_rank", "_seq_len", "_seed", "_demo_layers", "_int_list",
                    "_qk_multiple", "_gate_rank"):
                found.append((command, action.option_strings[0], action))
    return found


def test_no_option_reads_an_integer_with_int() -> None:
    options = _integer_options()
    assert [(c, o) for c, o, a in options if a.type is int] == []
    named = {(c, o) for c, o, _ in options}
    assert {("plan", "--qk-multiple"), ("plan", "--gate-rank"), ("shard", "--qk-multiple"),
            ("dump", "--tp-size"), ("digests", "--tp-size")} <= named


@pytest.mark.parametrize("value", ["1_6", "１６", " 1_6", "16.0", "0x10"])
def test_every_integer_option_refuses_what_tp_size_refuses(value: str) -> None:
    for command, option, action in _integer_options():
        with pytest.raises(argparse.ArgumentTypeError, match="expected"):
            action.type(value)  # type: ignore[misc]


@pytest.mark.parametrize("args", [
    ("plan", DATA / "kda_small", "--tp-size", "2", "--qk-multiple", "1_6"),
    ("plan", DATA / "kda_small" / "config.json", "--tp-size", "2", "--gate-rank", "１６"),
    ("dump", KIMI_LINEAR, *ENGINE, "--tp-size", "1_6", "--out", "/nonexistent/x"),
    ("digests", KIMI_LINEAR, *ENGINE, "--tp-size", "２"),
])
def test_the_refusal_is_argparse_s_one_line(
    args: tuple[object, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        kda_tp.cli.main([str(a) for a in args])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kda-tp: error:")]
    assert exited.value.code == 2 and len(lines) == 1 and "expected an integer" in lines[0], err


def test_a_path_holding_a_newline_stays_on_one_error_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    where = tmp_path / "two\nlines\r\x1b[31m"
    status, _, err = run(capsys, "plan", where, "--tp-size", 2)
    line = one_line(status, err, "CheckpointError: ")
    assert "two\\nlines\\r\\x1b[31m: no such file or directory" in line
    status, _, err = run(capsys, "verify", where, where)
    one_line(status, err, "CheckpointError: ")


def test_dump_refuses_an_output_holding_another_world_size_s_shard(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    shard_checkpoint(KIMI_LINEAR, out, 2, qk_multiple=1)
    before = sorted(os.listdir(out))
    for force in ([], ["--force"]):
        status, _, err = run(capsys, "dump", KIMI_LINEAR, *ENGINE, "--tp-size", 4, "--out", out,
                             *force)
        line = one_line(status, err, "OutputError: ")
        assert (f"{out / 'rank0'} holds shard output for tp_size 2; one output directory holds "
                "one world size, so this tp_size 4 dump may not write beside it") in line
        assert sorted(os.listdir(out)) == before
    # The same world size beside it is one world size.
    status, _, err = run(capsys, "dump", KIMI_LINEAR, *ENGINE, "--tp-size", 2, "--out", out)
    assert status == 0, err


# --- issue 39 item 7: one wording for a missing path -----------------------------------------


@pytest.mark.parametrize("args", [
    ("plan", "{missing}", "--tp-size", "2"),
    ("plan", "{missing}/config.json", "--tp-size", "2"),
    ("shard", "{missing}", "--tp-size", "2", "--out", "{tmp}/out"),
    ("verify", "{missing}", "{tmp}"),
    ("verify", DATA / "kda_small", "{missing}"),
    ("audit", DATA / "kda_small", "{missing}"),
    ("dump", "{missing}", *ENGINE, "--tp-size", "2", "--out", "{tmp}/out"),
    ("digests", "{missing}", *ENGINE, "--tp-size", "2"),
])
def test_a_missing_path_is_said_one_way(
    args: tuple[object, ...], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nowhere"
    given = [str(a).format(missing=missing, tmp=tmp_path) for a in args]
    status, _, err = run(capsys, *given)
    one_line(status, err, "CheckpointError: ")
    assert err.endswith(f"{missing}: no such file or directory\n"), err
    assert "os error" not in err and "Errno" not in err


def test_the_api_says_a_missing_path_the_same_way(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    for call in (lambda: kda_tp.open_rank(missing, tp_rank=0, tp_size=2),
                 lambda: kda_tp.SafetensorsSource(missing / "model.safetensors"),
                 lambda: kda_tp.describe(missing)):
        with pytest.raises(CheckpointError) as info:
            call()
        assert str(info.value).endswith(": no such file or directory"), info.value
        assert "os error" not in str(info.value)
