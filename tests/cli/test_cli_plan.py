"""``kda-tp plan`` on a checkpoint directory, a bare ``config.json`` and paths that are not
there: the same layers and totals either way, a JSON verdict, and advice that works."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kda_tp.synth import write_small_checkpoint

from cli_run import run

# 4 decoder layers, 0-based 0 and 2 KDA; TP 1 and 2 pass the 256-channel rule.
SMALL = dict(hidden=96, heads=4, head_dim=64, conv_kernel=4, gate_rank=64, num_layers=4)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    return write_small_checkpoint(tmp_path / "ckpt", **SMALL, kda_layers=[0, 2], seed=1)


def test_a_bare_config_gives_the_config_s_layers_and_totals(ckpt, capsys):
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 2, "--json")
    from_dir = json.loads(out)
    status_c, out_c, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2, "--json")
    from_config = json.loads(out_c)
    assert status == status_c == 0
    assert from_dir["ok"] is from_config["ok"] is True
    assert from_dir["kda_layers"] == from_config["kda_layers"] == [0, 2]
    layer = from_config["layer_local_bytes"]
    assert from_config["total_local_bytes"] == 2 * layer
    assert from_config["total_full_bytes"] == 2 * from_config["layer_full_bytes"]
    assert from_dir["total_local_bytes"] == 2 * from_dir["layer_local_bytes"]
    # The text form has the same total line.
    status, text, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2)
    # Decimal units, 3 significant digits, as shard prints its sizes (here some 100 kB).
    assert 1e5 <= 2 * layer < 1e6
    assert status == 0 and f"2 KDA layers: {2 * layer / 1e3:.0f} kB per rank of" in text
    status, text, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2, "--layers", "2")
    assert status == 0 and "1 KDA layer:" in text


def test_a_refusal_in_json_says_not_ok(ckpt, capsys):
    status, out, _ = run(capsys, "plan", ckpt, "--tp-size", 3, "--json")
    doc = json.loads(out)
    assert status == 2 and doc["ok"] is False and doc["error"]["type"] == "PlanError"


@pytest.mark.parametrize("tp_size", [-2, 0])
@pytest.mark.parametrize("command", ["plan", "shard", "demo"])
def test_a_tp_size_below_one_is_named_positive(ckpt, capsys, tp_size, command):
    command = {"plan": ["plan", ckpt], "shard": ["shard", ckpt, "--out", ckpt.parent / "out"],
               "demo": ["demo"]}[command]
    with pytest.raises(SystemExit) as exit_info:
        run(capsys, *command, "--tp-size", tp_size)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, command
    assert f"argument --tp-size: must be a positive integer, got {tp_size}" in err
    assert "non-negative" not in err
    assert not (ckpt.parent / "out").exists()


@pytest.fixture
def bare(ckpt, tmp_path) -> Path:
    """``ckpt``'s safetensors files in a directory without its config.json."""
    bare = tmp_path / "weights"
    bare.mkdir()
    for path in ckpt.glob("*.safetensors*"):
        (bare / path.name).write_bytes(path.read_bytes())
    return bare


@pytest.mark.parametrize("command, extra", [
    ("plan", []), ("plan", ["--layers", "0"]), ("shard", []), ("shard", ["--layers", "0,2"]),
])
def test_a_directory_without_config_json_is_told_to_add_it(bare, tmp_path, capsys, command,
                                                             extra):
    """Not to pass --layers: without the config the geometry is unknown, so that fails too."""
    fix = "no config.json in this directory; kda_tp reads the model's geometry"
    out = ["--out", tmp_path / "out"] if command == "shard" else []
    args = [command, bare, "--tp-size", 2, *out, *extra]
    status, _, err = run(capsys, *args)
    assert status == 2 and fix in err and "put the model's config.json there" in err, args
    assert "--layers" not in err, args


def test_following_the_advice_to_add_config_json_works(ckpt, bare, capsys):
    (bare / "config.json").write_bytes((ckpt / "config.json").read_bytes())
    assert run(capsys, "plan", bare, "--tp-size", 2)[0] == 0


def test_missing_paths_are_named_for_what_is_missing(tmp_path, capsys):
    # One wording for a missing path (issue 39 item 7), the missing part named.
    status, _, err = run(capsys, "plan", tmp_path / "nowhere", "--tp-size", 2)
    assert status == 2 and f"{tmp_path / 'nowhere'}: no such file or directory" in err
    status, _, err = run(capsys, "plan", tmp_path / "nowhere" / "config.json", "--tp-size", 2)
    assert status == 2 and f"{tmp_path / 'nowhere'}: no such file or directory" in err
    status, _, err = run(capsys, "plan", tmp_path / "config.json", "--tp-size", 2)
    assert status == 2 and f"{tmp_path / 'config.json'}: no such file or directory" in err
    (tmp_path / "empty").mkdir()
    status, _, err = run(capsys, "plan", tmp_path / "empty", "--tp-size", 2)
    assert status == 2 and f"{tmp_path / 'empty'}: no config.json in this directory" in err


@pytest.mark.parametrize(("style", "family"),
                         [("glm", "GLM-5.3-Flash's"), ("kimi", "Kimi-Linear's")])
def test_a_bare_config_assumes_what_its_family_s_checkpoints_store(tmp_path, capsys, style,
                                                                    family):
    """GLM-5.3-Flash checkpoints (transformers' glm5_next, and synth's style="glm") store F32
    convs, a 1-D F32 A_log [H] and F32 dt_bias: the plan of the bare config says so, and agrees
    with the plan of the checkpoint tensor for tensor."""
    ckpt = write_small_checkpoint(tmp_path / "ckpt", **SMALL, kda_layers=[0, 2], seed=1,
                                  style=style)
    docs = []
    for src in (ckpt, ckpt / "config.json"):
        status, out, _ = run(capsys, "plan", src, "--tp-size", 2, "--json")
        assert status == 0
        docs.append({t["name"]: (t["dtype"], t["full_shape"], t["local_shape"], t["local_bytes"])
                     for t in json.loads(out)["tensors"]})
    assert docs[0] == docs[1]
    conv = "F32" if style == "glm" else "BF16"
    a_log = [4] if style == "glm" else [1, 1, 4, 1]
    conv_bytes = 128 * 4 * (4 if conv == "F32" else 2)
    assert docs[1]["q_conv1d"] == (conv, [256, 1, 4], [128, 1, 4], conv_bytes)
    assert docs[1]["A_log"] == ("F32", a_log, [2 if n == 4 else n for n in a_log], 8)
    assert docs[1]["dt_bias"] == ("F32", [256], [128], 512)
    status, text, _ = run(capsys, "plan", ckpt / "config.json", "--tp-size", 2)
    assert status == 0 and text.splitlines()[-1] == (
        f"(from the config alone: on-disk shapes and dtypes are assumed, {family} defaults; "
        "pass the checkpoint directory to read its own, e.g. Kimi K3's padded A_log and F32 "
        "convs)"
    )
