"""Fixes for what a tester found trying kda-tp as a new user and as an adversary.

* ``demo --keep DIR`` builds first, then replaces: a bad ``--num-layers`` is a usage error that
  leaves DIR as it was; files a user put inside the demo's ``checkpoint/`` or ``tp{N}/`` are
  refused by name, never deleted; outputs kda-tp wrote beside them (the README's ``shards`` and
  ``vllm-tp4``) are left in place.
* ``open_rank``'s view iterates and counts its names like a dict; ``5 in view`` is False, and
  membership after ``close()`` raises the closed-view error as ``view[name]`` does. Opening a
  rank directory ``shard`` wrote says it is already a shard.
* ``audit`` with a bad config value names ``DIR/config.json``, as ``plan`` does.
* ``expected_digests`` refuses ``A_log``/``dt_bias`` of a layer its config does not list as
  KDA (another model's config), and items that are not ``(name, tensor)`` pairs.
* ``shard`` prints its sizes, progress and summary in one unit (that of its ``writing`` line).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import kda_tp
import pytest
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, UsageError
from kda_tp.output import DEMO_MAX_LAYERS
from kda_tp.output import MARK_NAME
from kda_tp.shard import verify_shards


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    """``kda-tp ARGS`` in this process: exit status, stdout, stderr."""
    status = main([str(a) for a in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def files_and_modes(path: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``path`` (hidden ones included): its bytes and mode bits."""
    return {str(p.relative_to(path)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(path.rglob("*")) if p.is_file() and not p.is_symlink()}


def demo(capsys: pytest.CaptureFixture[str], keep: Path, *args: object) -> tuple[int, str, str]:
    """A small, fast demo into ``keep``."""
    return run(capsys, "demo", "--tp-size", 2, "--num-layers", 1, "--no-numeric",
               "--keep", keep, *args)


@pytest.fixture
def kept(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """A ``demo --keep`` directory made by a first demo."""
    keep = tmp_path / "dz"
    status, _, err = demo(capsys, keep)
    assert status == 0, err
    return keep


@pytest.mark.parametrize("layers", ["0", "-1", str(DEMO_MAX_LAYERS + 1), "many"])
def test_a_bad_num_layers_is_a_usage_error_that_leaves_the_kept_demo(
    kept: Path, capsys: pytest.CaptureFixture[str], layers: str
) -> None:
    before = files_and_modes(kept)
    with pytest.raises(SystemExit) as exited:
        main(["demo", "--num-layers", layers, "--keep", str(kept)])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    errors = [line for line in err.splitlines() if line.startswith("kda-tp: error:")]
    assert len(errors) == 1 and "argument --num-layers" in errors[0], err
    assert files_and_modes(kept) == before
    assert verify_shards(kept / "checkpoint", kept / "tp2").ok


def test_the_most_layers_the_demo_takes_is_documented() -> None:
    assert DEMO_MAX_LAYERS == 64


def test_a_failed_demo_leaves_the_earlier_one_and_no_staging(
    kept: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo that fails while building (here: the shard step) changes nothing in DIR."""
    import kda_tp.shard.writer

    before = files_and_modes(kept)

    def broken(*args: object, **kwargs: object) -> None:
        raise OSError("disk full (planted)")

    monkeypatch.setattr(kda_tp.shard.writer, "shard_checkpoint", broken)
    with pytest.raises(OSError, match="planted"):
        demo(capsys, kept)
    assert files_and_modes(kept) == before
    assert sorted(os.listdir(kept)) == [MARK_NAME, "checkpoint", "tp2"]


@pytest.mark.parametrize("where", ["tp2", "tp2/rank0", "checkpoint"])
def test_user_files_inside_the_demo_s_outputs_are_refused_not_deleted(
    kept: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    (kept / where / "notes.txt").write_text("mine")
    before = files_and_modes(kept)
    status, out, err = demo(capsys, kept)
    assert status == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith("kda-tp: error: OutputError: ") and "notes.txt" in err
    assert "move it away, or choose another --keep DIR" in err
    assert files_and_modes(kept) == before


def test_the_readme_path_reruns_the_demo_and_keeps_kda_tp_s_other_outputs(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``demo --keep try``, ``shard`` into try/shards, ``dump`` into try/vllm-tp4, then the
    demo again: it replaces its own entries and leaves the shard and the dump as they were."""
    status, _, err = run(capsys, "shard", kept / "checkpoint", "--tp-size", 2, "--out",
                         kept / "shards", "--quiet")
    assert status == 0, err
    status, _, err = run(capsys, "dump", kept / "checkpoint", "--engine",
                         "vllm-0.33-kimi-linear", "--tp-size", 2, "--out", kept / "vllm-tp2")
    assert status == 0, err
    siblings = {name: files_and_modes(kept / name) for name in ("shards", "vllm-tp2")}
    status, out, err = run(capsys, "demo", "--tp-size", 4, "--num-layers", 1, "--no-numeric",
                           "--keep", kept)
    assert status == 0, err
    assert f"shard: wrote ranks [0, 1, 2, 3] of 4 to {kept / 'tp4'}: " in out
    assert f"checkpoint (" in out and f"s: {kept / 'checkpoint'}\n" in out
    assert sorted(os.listdir(kept)) == [MARK_NAME, "checkpoint", "shards", "tp4", "vllm-tp2"]
    assert {name: files_and_modes(kept / name) for name in siblings} == siblings
    assert verify_shards(kept / "checkpoint", kept / "tp4").ok


def test_a_file_beside_the_demo_that_kda_tp_did_not_write_is_still_refused(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (kept / "shards").mkdir()
    (kept / "shards" / "model.safetensors").write_bytes(b"someone's")
    before = files_and_modes(kept)
    status, _, err = demo(capsys, kept)
    assert status == 2 and f"{kept / 'shards'}: model.safetensors: its header carries no" in err
    assert files_and_modes(kept) == before


# --- open_rank's view: a mapping of names -----------------------------------------------------


def test_the_rank_view_iterates_and_counts_its_names_like_a_dict(kept: Path) -> None:
    view = kda_tp.open_rank(kept / "checkpoint", tp_rank=0, tp_size=2)
    names = view.names()
    assert list(view) == names and [n for n in view] == names and len(view) == len(names)
    assert len(names) == 20 and "model.layers.0.self_attn.q_proj.weight" in view
    assert 5 not in view and None not in view and "no.such.tensor" not in view
    assert dict(zip(view, view.keys())) == {n: n for n in names}
    view.close()
    for use in (lambda: names[0] in view, lambda: 5 in view, lambda: list(view),
                lambda: len(view), lambda: view[names[0]]):
        with pytest.raises(CheckpointError, match="(view|checkpoint) is closed"):
            use()


def test_open_rank_on_a_rank_directory_says_it_is_already_a_shard(kept: Path) -> None:
    with pytest.raises(CheckpointError) as raised:
        kda_tp.open_rank(kept / "tp2" / "rank0", tp_rank=0, tp_size=2)
    assert "already a tensor-parallel shard (rank 0 of 2, its header says); open the original " \
        "checkpoint" in str(raised.value)
    assert str(kept / "tp2" / "rank0") in str(raised.value)


# --- audit: a bad config value names the config file --------------------------------------------


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


# --- expected_digests: another model's config, a list of names ---------------------------------


def test_expected_digests_refuses_kda_tensors_of_a_layer_the_config_does_not_list(
    kept: Path,
) -> None:
    source = kda_tp.SafetensorsSource(kept / "checkpoint")
    tensors = {n: source.get(n) for n in source.names()}
    engine = {"engine": "vllm-0.33-kimi-linear", "tp_size": 2}
    digests = kda_tp.audit.expected_digests(tensors, kept / "checkpoint", **engine)
    assert digests == kda_tp.audit.engine_digests(kept / "checkpoint", **engine)
    copies = {n.replace("layers.0.", "layers.2."): t for n, t in tensors.items()
              if n.startswith("model.layers.0.self_attn.")}
    with pytest.raises(CheckpointError) as raised:
        kda_tp.audit.expected_digests({**tensors, **copies}, kept / "checkpoint", **engine)
    message = str(raised.value)
    assert message.startswith("model.layers.2.self_attn.A_log, model.layers.2.self_attn.dt_bias:"
                               " layer 2 holds KDA tensors, but the ")
    assert message.endswith("lists no KDA layer 2 (its KDA layers: [0]); is this the config of "
                            "the model being updated?")


@pytest.mark.parametrize("tensors", [["model.layers.0.self_attn.A_log"], [("a", 1, 2)], [7]])
def test_expected_digests_refuses_what_is_not_name_tensor_pairs(
    kept: Path, tensors: list[object]
) -> None:
    with pytest.raises(UsageError, match=r"^tensors: expected \(name, tensor\) pairs or a "
                       r"mapping of names to tensors, got an item "):
        kda_tp.audit.expected_digests(tensors, kept / "checkpoint",  # type: ignore[arg-type]
                                      engine="vllm-0.33-kimi-linear", tp_size=2)


# --- shard: one unit per output ---------------------------------------------------------------


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
