"""Hostile input for the command line: each is one ``kda-tp`` command line, refused
with exit 2 and one ``kda-tp: error:`` line, fast and in little memory
(tests/checkpoint/test_malformed.py runs each in a subprocess under a time and a memory bound)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .core import (
    ATTN,
    CliKinds,
    base_checkpoint,
    config_text,
    copy_base,
    edit_config,
    edit_index,
    fresh,
    pack,
    parse,
    rewritten,
    write_raw,
)

CLI_KINDS = CliKinds()


def _shard(target: Path, *extra: str) -> tuple[str, ...]:
    return ("shard", str(target), "--tp-size", "2", "--out",
            str(target.parent / f"{target.name}-out"), "--quiet", *extra)


def _sharded(root: Path) -> Path:
    """A real 2-rank output of the base checkpoint (written once per root)."""
    out = root / "_base-tp2"
    if not (out / "rank1").is_dir():
        from kda_tp.shard import shard_checkpoint
        shard_checkpoint(base_checkpoint(root), out, 2)
    return out


def _rank_meta(root: Path, kind: str, **meta: str) -> tuple[str, ...]:
    """``kda-tp verify`` of the base checkpoint against a copy of its 2-rank output, with
    rank0's first file's metadata updated by ``meta``."""
    out = fresh(root / kind)
    shutil.copytree(_sharded(root), out)
    first = sorted((out / "rank0").glob("*.safetensors"))[0]
    header, entries, data = parse(first.read_bytes())
    header["__metadata__"].update(meta)
    packed, body = pack([(n, i["dtype"], i["shape"], data[slice(*i["data_offsets"])])
                         for n, i in entries], header["__metadata__"])
    write_raw(first, packed, body)
    return ("verify", str(base_checkpoint(root)), str(out))


def _too_many_axes(root: Path, kind: str) -> Path:
    """The base checkpoint with layer 1's q_proj stored with 63 unit axes appended (65 axes:
    the same bytes, which the plan would take, but no numpy array can hold): refused at the
    header check, before any command reads a tensor (issue 33.5)."""
    name = ATTN.format(1) + "q_proj.weight"
    return rewritten(root, kind, lambda tensors: [
        (n, d, [*s, *[1] * 63] if n == name else s, b) for n, d, s, b in tensors])


def _verify(root: Path, *extra: str) -> tuple[str, ...]:
    return ("verify", str(base_checkpoint(root)), str(_sharded(root)), *extra)


@CLI_KINDS.kind("MAX_JSON_DEPTH")
def cli_config_deep(root: Path, kind: str) -> tuple[str, ...]:
    return _shard(config_text("[" * 200_000 + "]" * 200_000)(root, kind))


@CLI_KINDS.kind("MAX_INT_DIGITS")
def cli_config_digits(root: Path, kind: str) -> tuple[str, ...]:
    config = json.loads((base_checkpoint(root) / "config.json").read_text())
    text = json.dumps(config).replace('"hidden_size": 64', '"hidden_size": ' + "7" * 5000)
    return _shard(config_text(text)(root, kind))


@CLI_KINDS.kind("MAX_JSON_BYTES")
def cli_config_huge(root: Path, kind: str) -> tuple[str, ...]:
    return _shard(config_text('{"pad": "' + "x" * (17 * 2**20) + '"}')(root, kind))


@CLI_KINDS.kind("MAX_JSON_DEPTH")
def cli_quant_config_deep(root: Path, kind: str) -> tuple[str, ...]:
    t = copy_base(root, kind)
    deep = "[" * 100_000 + "]" * 100_000
    (t / "hf_quant_config.json").write_text('{"quantization": ' + deep + "}")
    return _shard(t)


@CLI_KINDS.kind("more than once")
def cli_kda_layers_repeated(root: Path, kind: str) -> tuple[str, ...]:
    """690 KB of kda_layers: checked in linear time."""
    return _shard(edit_config(root, kind,
                              lambda c: c["linear_attn_config"].update(kda_layers=[1, 2] * 80_000)))


@CLI_KINDS.kind("MAX_LAYERS")
def cli_glm_layers_huge(root: Path, kind: str) -> tuple[str, ...]:
    def edit(c: dict) -> None:
        c.clear()
        c.update(model_type="glm5_next", num_hidden_layers=2147483647)

    return _shard(edit_config(root, kind, edit))


@CLI_KINDS.kind("does not exist")
def cli_index_many_files(root: Path, kind: str) -> tuple[str, ...]:
    """100,000 distinct file names in the index: parsed in linear time, then the first missing
    file named."""
    return _shard(edit_index(root, kind, lambda i: i["weight_map"].update(
        {f"extra.{n}": f"missing-{n}.safetensors" for n in range(100_000)})))


@CLI_KINDS.kind("not written in ASCII digits")
def cli_arabic_layer_number(root: Path, kind: str) -> tuple[str, ...]:
    name = ATTN.format(1) + "q_proj.weight"
    arabic = name.replace(".1.", ".\u0661.")
    return _shard(rewritten(
        root, kind, lambda ts: [(arabic if n == name else n, d, sh, b) for n, d, sh, b in ts]))


@CLI_KINDS.kind("more than 2147483647")
def cli_tp_size_2_64(root: Path, kind: str) -> tuple[str, ...]:
    return _shard(base_checkpoint(root))[:3] + ("18446744073709551616", "--out", str(root / "x"))


@CLI_KINDS.kind("more than 2147483647")
def cli_tp_size_2_40(root: Path, kind: str) -> tuple[str, ...]:
    return ("audit", str(base_checkpoint(root)), str(root / "x"), "--tp-size", "1099511627776")


@CLI_KINDS.kind("divisible")
def cli_shard_tp_size_1e8(root: Path, kind: str) -> tuple[str, ...]:
    return ("shard", str(base_checkpoint(root)), "--tp-size", "100000000", "--out",
            str(root / "x"), "--quiet")


@CLI_KINDS.kind("divisible")
def cli_audit_tp_size_3e7(root: Path, kind: str) -> tuple[str, ...]:
    return ("audit", str(base_checkpoint(root)), str(_sharded(root) / "rank0"), "--tp-size",
            "30000000")


@CLI_KINDS.kind("must be a positive integer, got 0")
def cli_tp_size_zero(root: Path, kind: str) -> tuple[str, ...]:
    return ("plan", str(base_checkpoint(root)), "--tp-size", "0")


@CLI_KINDS.kind("valid ranks are 0..1")
def cli_rank_out_of_range(root: Path, kind: str) -> tuple[str, ...]:
    return ("plan", str(base_checkpoint(root)), "--tp-size", "2", "--rank", "2")


@CLI_KINDS.kind("--seq-len: must be a positive integer")
def cli_seq_len_zero(root: Path, kind: str) -> tuple[str, ...]:
    return _verify(root, "--numeric", "--seq-len", "0")


@CLI_KINDS.kind("--seq-len: must be a positive integer")
def cli_seq_len_negative(root: Path, kind: str) -> tuple[str, ...]:
    return _verify(root, "--numeric", "--seq-len", "-3")


@CLI_KINDS.kind("--seed: must be an integer >= 0")
def cli_seed_negative(root: Path, kind: str) -> tuple[str, ...]:
    return _verify(root, "--numeric", "--seed", "-1")


@CLI_KINDS.kind("--seq-len")
def cli_demo_seq_len_zero(root: Path, kind: str) -> tuple[str, ...]:
    return ("demo", "--seq-len", "0")


@CLI_KINDS.kind("UsageError: KDA_TP_BACKEND='bogus'", env={"KDA_TP_BACKEND": "bogus"})
def cli_backend_bogus(root: Path, kind: str) -> tuple[str, ...]:
    return ("plan", str(base_checkpoint(root)), "--tp-size", "2")


@CLI_KINDS.kind("MAX_INT_DIGITS")
def cli_header_tp_size_digits(root: Path, kind: str) -> tuple[str, ...]:
    return _rank_meta(root, kind, tp_size="7" * 5000)


@CLI_KINDS.kind("MAX_JSON_DEPTH")
def cli_header_layers_deep(root: Path, kind: str) -> tuple[str, ...]:
    return _rank_meta(root, kind, kda_tp_layers="[" * 100_000 + "]" * 100_000)


@CLI_KINDS.kind("unrecognized argument --tp-szie; did you mean --tp-size?")
def cli_misspelt_flag(root: Path, kind: str) -> tuple[str, ...]:
    return ("plan", str(base_checkpoint(root)), "--tp-szie", "4")


@CLI_KINDS.kind("has 65 axes, more than the 32 kda_tp reads")
def cli_verify_numeric_65_axes(root: Path, kind: str) -> tuple[str, ...]:
    return ("verify", str(_too_many_axes(root, kind)), str(_sharded(root)), "--numeric")


@CLI_KINDS.kind("has 65 axes, more than the 32 kda_tp reads")
def cli_audit_65_axes(root: Path, kind: str) -> tuple[str, ...]:
    return ("audit", str(_too_many_axes(root, kind)), str(_sharded(root) / "rank0"),
            "--tp-size", "2")
