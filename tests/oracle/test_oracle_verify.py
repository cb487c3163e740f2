"""The pure-Python oracle's checkpoint verifier (``kda_tp.oracle.verify``) against shardings
written by hand from the spec's axes: a correct one passes, at every TP size of the ``kda_small``
fixture and with a Qwen3-Next-style config; each mutation is named; the output's layout, the
command line, KDA-only output and recorded layers; configs read as transformers reads them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from kda_tp import oracle
from kda_tp.cli import main
from kda_tp.errors import CheckpointError
from kda_tp.shard import shard_checkpoint, verify_shards
from kda_tp.synth import write_small_checkpoint

from checkpoint_files import (
    kimi_config,
    narrow,
    qwen3_next_config,
    read_checkpoint_tensors,
    read_safetensors,
    write_checkpoint,
)
from paths import DATA


FIXTURE = DATA / "kda_small"


# --- the verifier -----------------------------------------------------------------------------


#: Sharded axis of each KDA tensor in its canonical on-disk shape (None = replicated), and the
#: unit it is split in; written from kda_in_the_field.md §2.5, not from the plan.
DISK_AXIS = {
    "q_proj": 0, "k_proj": 0, "v_proj": 0, "q_conv1d": 0, "k_conv1d": 0, "v_conv1d": 0,
    "f_a_proj": None, "f_b_proj": 0, "g_a_proj": None, "g_b_proj": 0, "b_proj": 0,
    "A_log": 2, "dt_bias": 0, "o_norm": None, "o_proj": 1,
}  # fmt: skip


def shard_checkpoint_by_hand(tensors: dict, kda_layers, tp_size: int) -> list[dict]:
    """Each rank's tensors, sliced with :func:`narrow` and :data:`DISK_AXIS` (independent of
    ``oracle.shard_bytes``). ``kda_layers`` are 0-based."""
    ranks = []
    for rank in range(tp_size):
        out = {}
        for name, (dtype, shape, data) in tensors.items():
            parts = name.split(".")
            kda = parts[:2] == ["model", "layers"] and int(parts[2]) in kda_layers
            axis = DISK_AXIS.get(parts[4]) if kda and parts[3] == "self_attn" else None
            if axis is None:
                out[name] = (dtype, shape, data)
                continue
            size = shape[axis] // tp_size
            local = shape[:axis] + (size,) + shape[axis + 1 :]
            elem = {"BF16": 2, "F32": 4}[dtype]
            out[name] = (
                dtype,
                local,
                narrow(data, shape, elem, axis, rank * size, (rank + 1) * size),
            )
        ranks.append(out)
    return ranks


def pattern(n: int, seed: int) -> bytes:
    """``n`` distinct-looking bytes (every position differs from its neighbours)."""
    return bytes((i * 31 + seed * 7 + (i >> 8)) % 251 for i in range(n))


def two_layer_checkpoint():
    """Layer 0 is KDA (hidden 8, 4 heads of 64, conv 3, gate 16); layer 1 is MLA, whose
    ``q_proj``/``o_proj`` share KDA's names and ``o_proj`` shape and must pass through."""
    hidden, heads, head_dim, conv, gate = 8, 4, 64, 3, 16
    channels = heads * head_dim
    p = oracle.plan(0, 1, hidden, head_dim, heads, conv, gate)
    tensors = {"model.embed_tokens.weight": ("BF16", (5, hidden), pattern(80, 1))}
    for i, t in enumerate(p.tensors):
        suffix = "" if t.name in ("A_log", "dt_bias") else ".weight"
        data = pattern(t.full_bytes, 10 + i)
        tensors[f"model.layers.0.self_attn.{t.name}{suffix}"] = (t.dtype, t.disk_shape, data)
    tensors["model.layers.1.self_attn.q_proj.weight"] = (
        "BF16",
        (channels, hidden),
        pattern(4096, 3),
    )
    tensors["model.layers.1.self_attn.o_proj.weight"] = (
        "BF16",
        (hidden, channels),
        pattern(4096, 4),
    )
    tensors["model.norm.weight"] = ("BF16", (hidden,), pattern(16, 5))
    config = kimi_config(hidden=hidden, head_dim=head_dim, heads=heads, conv=conv, kda_layers=[1])
    return config, tensors


def write_sharded(out: Path, config: dict, ranks: list[dict]) -> None:
    for rank, tensors in enumerate(ranks):
        meta = {"tp_rank": str(rank), "tp_size": str(len(ranks))}
        write_checkpoint(out / f"rank{rank}", config, tensors, metadata=meta, files=2)


@pytest.fixture
def sharded_pair(tmp_path):
    """(source dir, output dir, config, per-rank tensors) for a correct TP=2 sharding."""
    config, tensors = two_layer_checkpoint()
    src = tmp_path / "src"
    write_checkpoint(src, config, tensors, files=3)
    ranks = shard_checkpoint_by_hand(tensors, {0}, 2)
    out = tmp_path / "out"
    write_sharded(out, config, ranks)
    return src, out, config, ranks


def test_verify_accepts_a_correct_sharding(sharded_pair):
    src, out, _, ranks = sharded_pair
    assert oracle.verify(src, out) == []
    mla = ranks[1]["model.layers.1.self_attn.o_proj.weight"]
    assert mla[1] == (8, 256), "the MLA layer's o_proj is not a KDA tensor"


def test_verify_accepts_the_fixture_at_every_tp_size(tmp_path):
    tensors = read_safetensors(FIXTURE / "model.safetensors")
    config = json.loads((FIXTURE / "config.json").read_text())
    for tp_size in (1, 2, 4):
        out = tmp_path / f"tp{tp_size}"
        write_sharded(out, config, shard_checkpoint_by_hand(tensors, {0}, tp_size))
        # Each rank holds the input's other files byte for byte, as shard copies them.
        for rank in range(tp_size):
            for extra in FIXTURE.iterdir():
                if extra.suffix != ".safetensors":
                    shutil.copy(extra, out / f"rank{rank}" / extra.name)
        assert oracle.verify(FIXTURE, out) == [], tp_size


def test_verify_reads_a_qwen3_next_style_config(tmp_path):
    _, tensors = two_layer_checkpoint()
    config = qwen3_next_config(hidden=8, head_dim=64, heads=4, conv=3,
                               layer_types=["linear_attention", "full_attention"])
    assert oracle.read_kda_config(config) == oracle.KdaConfig(8, 64, 4, 3, frozenset({0}))
    src = tmp_path / "src"
    write_checkpoint(src, config, tensors)
    out = tmp_path / "out"
    write_sharded(out, config, shard_checkpoint_by_hand(tensors, {0}, 2))
    assert oracle.verify(src, out) == []


def mutate(ranks, rank, name, new):
    changed = [dict(r) for r in ranks]
    if new is None:
        del changed[rank][name]
    else:
        changed[rank][name] = new
    return changed


O_PROJ = "model.layers.0.self_attn.o_proj.weight"
MLA_O_PROJ = "model.layers.1.self_attn.o_proj.weight"


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("row_sliced_o_proj", "rank1: model.layers.0.self_attn.o_proj.weight: bytes differ"),
        ("sliced_mla_o_proj", "rank0: model.layers.1.self_attn.o_proj.weight: shape [8, 128]"),
        ("missing", "rank1: model.norm.weight: missing"),
        ("extra", "rank0: model.layers.0.self_attn.bonus.weight: not in the input"),
        ("changed_passthrough", "rank1: model.embed_tokens.weight: bytes differ"),
        ("wrong_dtype", "rank0: model.norm.weight: dtype F16, input has BF16"),
        (
            "unsliced_a_log",
            "rank0: model.layers.0.self_attn.A_log: shape [1, 1, 4, 1], expected [1, 1, 2, 1]",
        ),
    ],
)
def test_verify_names_each_problem(tmp_path, sharded_pair, how, needle):
    src, _, config, ranks = sharded_pair
    if how == "row_sliced_o_proj":
        dtype, shape, data = ranks[1][O_PROJ]
        full = dict(read_checkpoint_tensors(src))[O_PROJ][2]
        ranks = mutate(ranks, 1, O_PROJ, (dtype, shape, full[len(full) // 2 :]))
    elif how == "sliced_mla_o_proj":
        ranks = shard_checkpoint_by_hand(two_layer_checkpoint()[1], {0, 1}, 2)
    elif how == "missing":
        ranks = mutate(ranks, 1, "model.norm.weight", None)
    elif how == "extra":
        ranks = mutate(ranks, 0, "model.layers.0.self_attn.bonus.weight", ("BF16", (2,), b"abcd"))
    elif how == "changed_passthrough":
        dtype, shape, data = ranks[1]["model.embed_tokens.weight"]
        ranks = mutate(ranks, 1, "model.embed_tokens.weight", (dtype, shape, data[:-1] + b"\x00"))
    elif how == "wrong_dtype":
        _, shape, data = ranks[0]["model.norm.weight"]
        ranks = mutate(ranks, 0, "model.norm.weight", ("F16", shape, data))
    elif how == "unsliced_a_log":
        name = "model.layers.0.self_attn.A_log"
        ranks = mutate(ranks, 0, name, dict(read_checkpoint_tensors(src))[name])
    out = tmp_path / "bad"
    write_sharded(out, config, ranks)
    problems = oracle.verify(src, out)
    assert any(p.startswith(needle) for p in problems), problems
    assert len(problems) == (4 if how == "sliced_mla_o_proj" else 1), problems


def test_verify_checks_the_layout_of_the_output(tmp_path, sharded_pair):
    src, out, config, ranks = sharded_pair

    def broken(name):
        copy = tmp_path / name
        shutil.copytree(out, copy)
        return copy

    wrong_meta = broken("meta")
    write_checkpoint(
        wrong_meta / "rank1", config, ranks[1], metadata={"tp_rank": "0", "tp_size": "2"}
    )
    problems = oracle.verify(src, wrong_meta)
    assert problems and all("__metadata__ tp_rank is '0', expected '1'" in p for p in problems)

    gap = broken("gap")
    (gap / "rank1").rename(gap / "rank2")
    assert oracle.verify(src, gap) == [
        "output: rank directories ['rank0', 'rank2'] are not rank0 .. rank1 "
        "(tp_size 2; incomplete run?)"
    ]

    one_rank = broken("one_rank")
    shutil.rmtree(one_rank / "rank1")
    problems = oracle.verify(src, one_rank)
    assert problems == [
        "output: rank directories ['rank0'] are not rank0 .. rank1 (tp_size 2; incomplete run?)"
    ]

    no_index = broken("no_index")
    (no_index / "rank0" / "model.safetensors.index.json").unlink()
    [problem] = oracle.verify(src, no_index)
    assert problem.startswith("rank0: ") and "model.safetensors.index.json: missing" in problem

    assert oracle.verify(src, tmp_path / "nowhere") == [
        f"output: {tmp_path / 'nowhere'} is not a directory"
    ]
    assert oracle.verify(tmp_path / "nowhere", out)[0].startswith("input: ")


def test_verify_command_line(sharded_pair, tmp_path):
    src, out, config, ranks = sharded_pair
    env = dict(os.environ, PYTHONPATH=str(Path(oracle.__file__).parents[2]))

    def run(*args):
        return subprocess.run(
            [sys.executable, "-m", "kda_tp.oracle", "verify", *map(str, args)],
            capture_output=True, text=True, env=env, check=False, timeout=120,
        )  # fmt: skip

    good = run(src, out)
    assert good.returncode == 0, good.stderr
    assert good.stdout.count("\n") == 1 and good.stdout.startswith("OK")

    bad_dir = tmp_path / "bad"
    write_sharded(bad_dir, config, mutate(ranks, 0, "model.norm.weight", None))
    bad = run(src, bad_dir)
    assert bad.returncode == 1
    assert bad.stdout.count("\n") == 1 and bad.stdout.startswith("FAIL: 1 problem")
    assert "rank0: model.norm.weight: missing" in bad.stderr


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


def test_glm_configs_are_read_as_transformers_reads_them():
    """GLM-5.3-Flash: layer_types (or every index not 3 mod 4), never kda_layers; a
    linear_attn_config key wins over the flat one; the same as kda_tp.model.config."""
    from kda_tp.model import parse_config

    text = {"model_type": "glm5_next_text", "hidden_size": 64, "linear_head_dim": 32,
            "linear_num_heads": 4, "linear_conv_kernel_dim": 4, "num_hidden_layers": 6,
            "linear_attn_config": {"num_heads": 8, "kda_layers": [1, 2, 3, 4, 5, 6]}}  # fmt: skip
    wrapper = {"model_type": "glm5_next", "text_config": text}
    flat = {**text, "model_type": "glm5_next"}
    for config in (wrapper, flat):
        want = oracle.KdaConfig(64, 32, 8, 4, frozenset({0, 1, 2, 4, 5}))
        assert oracle.read_kda_config(config) == want
        ours = parse_config(config)
        assert (ours.hidden, ours.head_dim, ours.heads, ours.conv_kernel) == (64, 32, 8, 4)
        assert frozenset(ours.kda_layers or ()) == want.kda_layers
    typed = {**text, "layer_types": ["linear_attention", "indexed_attention"] * 3}
    read = oracle.read_kda_config({"model_type": "glm5_next", "text_config": typed})
    assert read.kda_layers == {0, 2, 4}


_LAC = {"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4}
_KIMI = {"model_type": "kimi_linear", "hidden_size": 64, "num_hidden_layers": 4}
_TEXT = {"model_type": "glm5_next_text", "hidden_size": 64, "num_hidden_layers": 4}


@pytest.mark.parametrize("config, needle", [
    ({**_KIMI, "linear_attn_config": {**_LAC, "kda_layers": [1, 1]}}, "repeats a layer"),
    ({**_KIMI, "linear_attn_config": {**_LAC, "kda_layers": [1, 5]}},
     "goes beyond num_hidden_layers 4"),
    ({"model_type": "glm5_next", "text_config": {**_TEXT, "layer_types": ["mamba"] * 3}},
     "layer_types has 3 entries, num_hidden_layers is 4"),
    ({**_TEXT, "layer_types": ["linear_attention", "kda_attention"] * 2},
     "layer_types has ['kda_attention', 'kda_attention']: transformers allows only"),
])
def test_the_oracle_refuses_the_configs_transformers_refuses(config, needle):
    """Kimi kda_layers listed twice or beyond num_hidden_layers; a GLM layer_types of the wrong
    length or with a type transformers does not know. kda_tp.model.config refuses them too."""
    from kda_tp.model import parse_config

    with pytest.raises(CheckpointError, match=re.escape(needle)):
        oracle.read_kda_config(config)
    with pytest.raises(CheckpointError):
        parse_config(config)


def test_the_oracle_reads_a_legacy_glm_layer_types_list():
    legacy = {**_TEXT, "layer_types": ["mamba", "attention", "mamba", "full_attention"]}
    assert oracle.read_kda_config(legacy).kda_layers == {0, 2}
