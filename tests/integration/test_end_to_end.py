"""End to end: generated checkpoints in both config layouts, sharded and verified at several
tp_size values through the Python API and the ``kda-tp`` command line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards
from kda_tp.synth import write_checkpoint, write_small_checkpoint

# Smallest geometry the default 256-channel rule allows at TP=2: 4 heads x 64.
SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=16, num_layers=3)


@pytest.fixture(params=["kimi", "glm"])
def small_checkpoint(request, tmp_path) -> Path:
    return write_small_checkpoint(
        tmp_path / "ckpt", **SMALL, kda_layers=[0, 2], seed=7, style=request.param
    )


def _layers(checkpoint: Path) -> str:
    """Name prefix of the decoder layers: GLM nests them under ``model.language_model.``."""
    glm = json.loads((checkpoint / "config.json").read_text())["model_type"] == "glm5_next"
    return "model.language_model.layers." if glm else "model.layers."


def _files_state(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_shard_then_verify_small(small_checkpoint, tmp_path, tp_size):
    before = _files_state(small_checkpoint)
    out = tmp_path / "out"
    result = shard_checkpoint(small_checkpoint, out, tp_size)
    assert result.ranks == tuple(range(tp_size))
    report = verify_shards(small_checkpoint, out, numeric=True)
    assert report.ok, report.problems
    assert report.numeric.passed
    # The independent stdlib verifier agrees.
    assert oracle.verify(small_checkpoint, out) == []
    # The input is untouched.
    assert _files_state(small_checkpoint) == before
    for r in range(tp_size):
        rank = kda_tp.SafetensorsSource(rank_dir(out, r))
        q = rank.get(f"{_layers(small_checkpoint)}0.self_attn.q_proj.weight")
        assert q.shape == (256 // tp_size, 96)
        assert rank.files()[0][1]["tp_rank"] == str(r)
        assert (rank_dir(out, r) / "config.json").read_bytes() == (
            small_checkpoint / "config.json"
        ).read_bytes()
        # Layer 1 is full attention (MLA): each rank holds the oracle's MLA slice, and says so.
        assert json.loads(rank.files()[0][1]["kda_tp_mla_layers"]) == [1]
        names = [n for n in rank.names() if ".layers.1.self_attn." in n]
        assert names
        full = kda_tp.SafetensorsSource(small_checkpoint)
        config = json.loads((small_checkpoint / "config.json").read_text())
        mla = oracle.mla_plan(r, tp_size, **oracle.read_mla_geometry(config))
        sliced = 0
        for n in names:
            entry = mla.get(oracle.plan_name(n.split(".self_attn.")[1]))
            assert entry is not None, n
            assert bytes(rank.get(n)) == oracle.shard_bytes(entry, bytes(full.get(n)))
            assert rank.get(n).shape == oracle.local_shape(entry, full.get(n).shape)
            sliced += entry.local_bytes < entry.full_bytes
        assert sliced == (3 if tp_size == 2 else 0)  # q_proj or q_b_proj, kv_b_proj, o_proj


def test_tp4_needs_the_rule_relaxed(small_checkpoint, tmp_path):
    with pytest.raises(kda_tp.PlanError, match="multiple of 256"):
        shard_checkpoint(small_checkpoint, tmp_path / "out", 4)
    assert not (tmp_path / "out").exists()
    shard_checkpoint(small_checkpoint, tmp_path / "out", 4, qk_multiple=128)
    report = verify_shards(small_checkpoint, tmp_path / "out", numeric=True)
    assert report.ok and report.tp_size == 4


def test_cli_plan_shard_verify(small_checkpoint, tmp_path, capsys):
    assert main(["plan", str(small_checkpoint), "--tp-size", "2", "--rank", "1"]) == 0
    table = capsys.readouterr().out
    assert "o_proj    CHANNEL_COLS" in table
    # A_log: Kimi-Linear's [1, 1, H, 1], GLM-5.3-Flash's [H].
    glm = _layers(small_checkpoint) != "model.layers."
    kimi_a_log = "[1, 1, 4, 1]  [1, 1, 2, 1]  dim 2 @ 2"
    assert ("[4]          [2]           dim 0 @ 2" if glm else kimi_a_log) in table
    assert "all-reduce" in table
    out = tmp_path / "out"
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    assert main(["verify", str(small_checkpoint), str(out), "--numeric"]) == 0
    text = capsys.readouterr().out
    assert text.strip().splitlines()[-1].startswith("OK: ")
    # A second run refuses to overwrite without --force.
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet",
                 "--force"]) == 0


def test_python_dash_m_runs_the_cli(small_checkpoint):
    done = subprocess.run(
        [sys.executable, "-m", "kda_tp", "plan", str(small_checkpoint), "--tp-size", "2"],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "q_proj" in done.stdout


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--tp-size", "3"], "PlanError: KDA TP requires heads (4) divisible by tp_size (3)"),
        (["--tp-size", "2", "--ranks", "2"], "PlanError: tp_rank 2 >= tp_size 2"),
    ],
)
def test_refused_geometry_writes_nothing(small_checkpoint, tmp_path, capsys, args, error):
    out = tmp_path / "out"
    assert main(["shard", str(small_checkpoint), "--out", str(out), "--quiet", *args]) == 2
    assert error in capsys.readouterr().err
    assert not out.exists()


def _rewrite(path: Path, name: str, data: bytes) -> None:
    """Replace one tensor's bytes in a safetensors file (same dtype and shape)."""
    source = kda_tp.SafetensorsSource(path)
    specs = []
    for n in source.names():
        t = source.get(n)
        payload = data if n == name else bytes(t)
        specs.append((n, t.dtype, t.shape, len(payload), lambda p=payload: p))
    meta = source.files()[0][1]
    del source
    write_safetensors(path, specs, meta)


def test_wrong_size_on_disk_is_refused(small_checkpoint, tmp_path, capsys):
    source = kda_tp.SafetensorsSource(small_checkpoint)
    name = f"{_layers(small_checkpoint)}2.self_attn.f_b_proj.weight"
    path = source.file_of(name)
    t = source.get(name)
    # Store f_b_proj with one row too few: the header is valid, the shape is not the plan's.
    specs = []
    for n in kda_tp.SafetensorsSource(path).names():
        rec = source.get(n)
        shape, data = rec.shape, bytes(rec)
        if n == name:
            shape, data = (t.shape[0] - 1, t.shape[1]), data[: -t.shape[1] * 2]
        specs.append((n, rec.dtype, shape, len(data), lambda d=data: d))
    del source, t
    write_safetensors(path, specs)
    out = tmp_path / "out"
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "ShapeMismatchError" in err and name in err and "[255, 16]" in err
    assert not out.exists()


def test_missing_index_shard_is_refused(small_checkpoint, tmp_path, capsys):
    index = json.loads((small_checkpoint / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[-1]
    (small_checkpoint / victim).unlink()
    out = tmp_path / "out"
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "CheckpointError" in err and victim in err
    assert not out.exists()


def test_corrupt_file_is_refused(small_checkpoint, tmp_path, capsys):
    victim = sorted(small_checkpoint.glob("*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    out = tmp_path / "out"
    assert main(["shard", str(small_checkpoint), "--tp-size", "2", "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "CheckpointError" in err and victim.name in err
    assert not out.exists()


def test_verify_catches_a_wrong_plan(small_checkpoint, tmp_path, capsys):
    """dt_bias cut at the head offset instead of the channel offset: every shape and size is
    right, the byte check and the numerical check both fail and name the tensor / layer."""
    out = tmp_path / "out"
    shard_checkpoint(small_checkpoint, out, 2)
    name = f"{_layers(small_checkpoint)}2.self_attn.dt_bias"
    full = kda_tp.SafetensorsSource(small_checkpoint).get(name).array
    local = 256 // 2
    for r in range(2):
        rank = rank_dir(out, r)
        path = kda_tp.SafetensorsSource(rank).file_of(name)
        head_offset = r * 2  # local_heads * r, in the wrong unit
        _rewrite(path, name, full[head_offset : head_offset + local].tobytes())
    assert main(["verify", str(small_checkpoint), str(out), "--numeric"]) == 1
    text = capsys.readouterr().out
    assert f"{name}: the ranks' CHANNEL_ROWS slices do not rejoin" in text
    assert "layer 2" in text and "FAIL" in text
    assert oracle.verify(small_checkpoint, out)


def test_verify_rejects_an_incomplete_output(small_checkpoint, tmp_path):
    out = tmp_path / "out"
    shard_checkpoint(small_checkpoint, out, 2, ranks=[0])
    report = verify_shards(small_checkpoint, out)
    assert not report.ok and "1 of 2 ranks missing: [1]" in report.problems[0]
    shard_checkpoint(small_checkpoint, out, 2, ranks=[1])
    assert verify_shards(small_checkpoint, out).ok


def test_output_inside_the_input_is_refused(small_checkpoint):
    with pytest.raises(kda_tp.OutputError, match="inside the input"):
        shard_checkpoint(small_checkpoint, small_checkpoint / "shards", 2)


@pytest.mark.slow
def test_kimi_linear_tp8_acceptance(tmp_path, capsys):
    """Issue acceptance: a 4-layer Kimi-Linear checkpoint at TP=8."""
    ckpt = write_checkpoint(tmp_path / "kimi", "kimi-linear", 4)
    out = tmp_path / "tp8"
    assert main(["shard", str(ckpt), "--tp-size", "8", "--out", str(out), "--quiet"]) == 0
    assert main(["verify", str(ckpt), str(out)]) == 0
    rank3 = kda_tp.SafetensorsSource(rank_dir(out, 3))
    assert rank3.get("model.layers.0.self_attn.A_log").shape == (1, 1, 4, 1)
    assert rank3.get("model.layers.0.self_attn.o_proj.weight").shape == (2304, 512)
    full = kda_tp.SafetensorsSource(ckpt)
    # Layer 3 is full attention (MLA): rank 3 holds the oracle's MLA slice of each tensor.
    mla = oracle.mla_plan(3, 8, **oracle.read_mla_geometry(
        json.loads((ckpt / "config.json").read_text())))
    for name in full.names():
        if ".layers.3.self_attn." in name:
            entry = mla.get(oracle.plan_name(name.split(".self_attn.")[1]))
            assert entry is not None, name
            assert rank3.get(name).shape == oracle.local_shape(entry, full.get(name).shape)
            assert bytes(rank3.get(name)) == oracle.shard_bytes(entry, bytes(full.get(name)))
        elif ".self_attn." not in name:  # non-attention: whole
            assert rank3.get(name).shape == full.get(name).shape
            assert np.array_equal(rank3.get(name).data, full.get(name).data), name


@pytest.mark.slow
def test_kimi_linear_tp4_numeric(tmp_path, capsys):
    ckpt = write_checkpoint(tmp_path / "kimi", "kimi-linear", 4)
    out = tmp_path / "tp4"
    shard_checkpoint(ckpt, out, 4)
    assert main(["verify", str(ckpt), str(out), "--numeric", "--seq-len", "64"]) == 0
    text = capsys.readouterr().out
    for layer in (0, 1, 2):
        assert f"layer {layer}: max abs err" in text
    assert "layer 3" not in text  # MLA


@pytest.mark.slow
@pytest.mark.parametrize(("model", "tp_size"), [("kimi-linear", 4), ("glm-5.3-flash", 2)])
def test_demo(model, tp_size, capsys):
    assert main(["demo", "--model", model, "--tp-size", str(tp_size), "--num-layers",
                 "4" if model == "kimi-linear" else "2"]) == 0
    text = capsys.readouterr().out
    assert "OK: " in text and "numerical TP equivalence passes" in text


@pytest.mark.slow
@pytest.mark.parametrize(("model", "tp_sizes"), [("kimi-linear", (2, 8)), ("glm-5.3-flash", (4, 8))])
def test_real_geometry_numeric_equivalence(tmp_path, model, tp_sizes):
    ckpt = write_checkpoint(tmp_path / "ckpt", model, 1)
    for tp_size in tp_sizes:
        report = kda_tp.reference.check_tp_equivalence(ckpt, tp_size, seq_len=32)
        assert report.passed and [r.layer for r in report.layers] == [0], report.format()
