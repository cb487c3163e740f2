"""Regression tests for what a review of the K3, FP8 and torch features found: each was a Python
traceback, a false refusal, or the oracle disagreeing with ``kda-tp verify``."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp import oracle
from kda_tp._io import write_safetensors
from kda_tp.cli import main
from kda_tp.errors import CheckpointError, PlanError
from kda_tp.shard import shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

DATA = Path(__file__).parent / "data"


@pytest.mark.parametrize("text", ["[1, 2]", '{"quantization": "FP8_PB_WO"}', '"x"', "{}"])
def test_a_malformed_hf_quant_config_is_a_named_error(tmp_path, capsys, text):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "k3_fp8_small", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    del config["quantization_config"]
    (ckpt / "config.json").write_text(json.dumps(config))
    (ckpt / "hf_quant_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"hf_quant_config\.json: expected a JSON object"):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(tmp_path / "o")]) == 2
    assert "CheckpointError" in capsys.readouterr().err
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def _relaid(tmp_path: Path, shapes: dict[str, list[int]]) -> Path:
    """The k3_small fixture in one file, with some tensors stored under other shapes holding the
    same bytes in the same order (extra unit axes)."""
    source = kda_tp.SafetensorsSource(DATA / "k3_small")
    out = tmp_path / "relaid"
    out.mkdir()
    shutil.copy(DATA / "k3_small" / "config.json", out)
    specs = []
    for name in source.names():
        t = source.get(name)
        assert t is not None
        data = bytes(np.asarray(t.data))
        specs.append((name, t.dtype, shapes.get(name, list(t.shape)), len(data), lambda d=data: d))
    write_safetensors(out / "model.safetensors", specs)
    return out


def test_the_numeric_check_accepts_every_layout_shard_accepts(tmp_path, capsys):
    kda = "language_model.model.layers.0.self_attn."
    ckpt = _relaid(tmp_path, {
        kda + "A_log": [1, 1, 16, 1],          # K3's padded A_log in Kimi-Linear's 4-D layout
        kda + "q_conv1d.weight": [1, 256, 4],  # a leading unit axis
        kda + "o_proj.weight": [1, 128, 256],
        kda + "dt_bias": [1, 256],
    })
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--quiet"]) == 0
    rank1 = kda_tp.SafetensorsSource(out / "rank1")
    assert rank1.info(kda + "A_log") == ("F32", (1, 1, 2, 1))
    assert main(["verify", str(ckpt), str(out), "--numeric"]) == 0
    assert "numerical TP equivalence passes" in capsys.readouterr().out
    report = kda_tp.check_tp_equivalence(ckpt, 2)
    assert report.passed and report.layers[0].max_abs_error < 1e-5
    assert oracle.verify(ckpt, out) == []


@pytest.mark.parametrize("fixture", ["kda_small", "k3_small", "k3_fp8_small"])
def test_the_oracle_checks_kda_only_output(tmp_path, fixture):
    out = tmp_path / "out"
    shard_checkpoint(DATA / fixture, out, 2, qk_multiple=1, kda_only=True)
    assert verify_shards(DATA / fixture, out).ok
    assert oracle.verify(DATA / fixture, out) == []
    # It still catches a flipped byte of a KDA tensor.
    path = sorted((out / "rank1").glob("*.safetensors"))[-1]
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert any("bytes differ" in p for p in oracle.verify(DATA / fixture, out))


def test_the_oracle_uses_the_recorded_layers_when_the_config_lists_none(tmp_path):
    ckpt = write_small_checkpoint(tmp_path / "k3", hidden=128, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=2, kda_layers=[0],
                                  style="k3", a_log_len=16)
    config = json.loads((ckpt / "config.json").read_text())
    del config["text_config"]["linear_attn_config"]["kda_layers"]
    (ckpt / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert main(["shard", str(ckpt), "--tp-size", "2", "--out", str(out), "--layers", "0",
                 "--quiet"]) == 0
    assert main(["verify", str(ckpt), str(out)]) == 0
    assert oracle.verify(ckpt, out) == []


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


@pytest.mark.parametrize("block", [(-1, 128), (128, 2**70), ("a", 128), (128,), 5])
def test_a_bad_quant_block_is_a_plan_error(block):
    with pytest.raises(PlanError, match="quant_block"):
        kda_tp.KdaTpPlan(0, 1, 128, 64, 4, 4, 64, quant_block=block)


def test_a_gate_lower_bound_beyond_float32_is_refused():
    """An unknown model_type: any bound below 0 float32 holds (Kimi's own range: test_config)."""
    config = json.loads((DATA / "k3_small" / "config.json").read_text())
    config["model_type"] = config["text_config"]["model_type"] = "my_kda_model"
    config["text_config"]["linear_attn_config"]["gate_lower_bound"] = -1e308
    with pytest.raises(CheckpointError, match="gate_lower_bound' = -1e\\+308 is not a number"):
        kda_tp.config.parse_config(config)


def test_packed_4bit_weights_under_an_fp8_config_name_the_declared_format(tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(DATA / "k3_fp8_small", ckpt)
    source = kda_tp.SafetensorsSource(ckpt)
    name = "language_model.model.layers.0.self_attn.q_proj.weight"
    specs = []
    for n in source.names():
        t = source.get(n)
        assert t is not None
        data = bytes(np.asarray(t.data))
        if n == name:
            specs.append((n + "_packed", "U8", list(t.shape), len(data), lambda d=data: d))
        else:
            specs.append((n, t.dtype, list(t.shape), len(data), lambda d=data: d))
    for p in ckpt.glob("model*"):
        p.unlink()
    write_safetensors(ckpt / "model.safetensors", specs)
    with pytest.raises(CheckpointError, match=r"packed 4-bit KDA weights \(ModelOpt FP8_PB_WO "
                                              r"\(128x128 blocks\), whose weights are F8"):
        kda_tp.KdaTpPlan.from_config(ckpt, 0, 2)


# From a new user's first session.


def test_one_file_of_an_indexed_checkpoint_is_refused_by_the_api_too():
    member = DATA / "k3_small" / "model-00002-of-00002.safetensors"
    for given in (member, kda_tp.SafetensorsSource(member)):
        with pytest.raises(CheckpointError, match=r"one file of an indexed checkpoint; pass the "
                                                  r"directory .*k3_small \(it has model"):
            kda_tp.KdaTpPlan.from_config(given, 0, 2)


def test_ranks_of_another_world_size_get_the_advice_that_works(tmp_path, capsys):
    out = tmp_path / "out"
    shard_checkpoint(DATA / "kda_small", out, 4, qk_multiple=1, ranks=[0, 1])
    assert main(["shard", str(DATA / "kda_small"), "--tp-size", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "rank0 holds output for tp_size 4, not 2; pass --force to replace it" in err
    assert "--ranks" not in err


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
            "p.wait()\n"
            "print(err)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "Traceback" not in done.stdout and "BrokenPipeError" not in done.stdout, done.stdout
