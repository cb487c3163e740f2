"""Property-based fuzzing (hypothesis) of everything that reads untrusted input.

Random and mutated safetensors files, random headers, random plan parameters and random
configs must either work or raise a :mod:`kda_tp.errors` exception: never another exception
type, never a Rust panic reaching Python (``pyo3_runtime.PanicException``, a ``BaseException``,
which ``except Exception`` would not even catch), never a crash or a hang.

300 examples per property by default; set ``KDA_TP_FUZZ_EXAMPLES`` for a longer run by hand,
e.g. ``KDA_TP_FUZZ_EXAMPLES=20000 pytest tests/checkpoint/test_fuzz.py``. The coverage-guided fuzzer of
the Rust side is in ``fuzz/`` (cargo-fuzz).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import malformed
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource, shard_bytes
from kda_tp.errors import CheckpointError, KdaTpError
from kda_tp import KdaShard
from kda_tp.shard import shard_checkpoint

from checkpoint_files import kimi_config, qwen3_next_config

EXAMPLES = int(os.environ.get("KDA_TP_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
# The shard path writes a checkpoint per example: fewer of them.
FUZZ_SHARD = settings(FUZZ, max_examples=max(1, EXAMPLES // 3))

DTYPES = [
    "BOOL",
    "U8",
    "I8",
    "F8_E5M2",
    "F8_E4M3",
    "F8_E8M0",
    "I16",
    "U16",
    "F16",
    "BF16",
    "I32",
    "U32",
    "F32",
    "C64",
    "F64",
    "I64",
    "U64",
    "F4",
    "F6_E2M3",
    "F6_E3M2",
    "Q7",
    "",
]


def expect_only_kda_errors(action: Callable[[], Any]) -> None:
    """Run ``action``; a kda_tp error is fine, anything else (PanicException included) fails."""
    try:
        action()
    except KdaTpError:
        pass
    except BaseException as e:
        if type(e).__name__ == "PanicException":
            pytest.fail(f"a Rust panic reached Python: {e}")
        raise


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    path = Path(
        tempfile.mkdtemp(
            prefix="kda_tp_fuzz_", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
    )
    yield path
    shutil.rmtree(path, ignore_errors=True)


def read_everything(path: Path) -> None:
    """Open ``path`` on both backends and touch every tensor's bytes and typed view."""
    for backend in ("mmap", "pread"):
        source = SafetensorsSource(path, backend)
        for name in source.names():
            tensor = source.get(name)
            assert tensor is not None
            assert tensor.nbytes == len(bytes(tensor))
            try:
                array = tensor.array
            except KdaTpError:
                continue  # a dtype numpy cannot represent (F4, F6, ...): refused by name
            assert array.shape == tensor.shape
            assert array.nbytes == tensor.nbytes


# ----------------------------------------------------------------------------------------------
# files


def _seeds() -> list[bytes]:
    header, data = malformed.pack(
        [
            ("w", "F32", [2, 3], bytes(range(24))),
            ("b", "BF16", [4], bytes(8)),
            ("m", "U8", [5], b"abcde"),
        ],
        {"format": "pt"},
    )
    encoded = json.dumps(header).encode()
    small = struct.pack("<Q", len(encoded)) + encoded + data
    empty = struct.pack("<Q", 8) + b"{}      "
    return [small, empty]


SEEDS = _seeds()


@st.composite
def mutated_files(draw: st.DrawFn) -> bytes:
    """A valid file with byte flips, insertions, deletions, truncation or a new length field."""
    raw = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "truncate", "length", "append"]))
        at = draw(st.integers(0, max(0, len(raw) - 1)))
        if op == "flip" and raw:
            raw[at] = draw(st.integers(0, 255))
        elif op == "insert":
            raw[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and raw:
            del raw[at : at + draw(st.integers(1, 8))]
        elif op == "truncate":
            del raw[at:]
        elif op == "length":
            value = draw(st.one_of(st.integers(0, 2**64 - 1), st.integers(0, len(raw) + 8)))
            raw[:8] = struct.pack("<Q", value)
        elif op == "append":
            raw += draw(st.binary(max_size=16))
    return bytes(raw)


@FUZZ
@given(data=st.one_of(mutated_files(), st.binary(max_size=64)))
def test_random_and_mutated_files_never_crash(scratch: Path, data: bytes) -> None:
    path = scratch / "f.safetensors"
    path.write_bytes(data)
    expect_only_kda_errors(lambda: read_everything(path))


_int = st.one_of(
    st.integers(0, 64), st.integers(-(2**63), 2**64 + 5), st.sampled_from([2**32, 2**63, 2**64 - 1])
)


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, bytes]:
    """A JSON header of random tensor entries (valid, or wrong in any field), and data whose
    length is right, or not."""
    header: dict[str, Any] = {}
    offset = 0
    for i in range(draw(st.integers(0, 5))):
        name = draw(st.one_of(st.just(f"t{i}"), st.text(max_size=6)))
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(st.lists(st.integers(0, 6), max_size=3))
        size = int(np.prod(shape, dtype=object)) * {
            "BOOL": 1,
            "U8": 1,
            "I8": 1,
            "F16": 2,
            "BF16": 2,
            "F32": 4,
            "F64": 8,
        }.get(dtype, 1)
        entry: dict[str, Any] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + size],
        }
        if draw(st.booleans()):  # break something
            key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra", "drop"]))
            if key == "drop":
                entry.pop(draw(st.sampled_from(["dtype", "shape", "data_offsets"])))
            elif key == "shape":
                entry["shape"] = draw(st.one_of(st.lists(_int, max_size=4), _int, st.none()))
            elif key == "data_offsets":
                entry["data_offsets"] = draw(
                    st.one_of(st.lists(_int, max_size=3), st.text(max_size=3))
                )
            elif key == "dtype":
                entry["dtype"] = draw(st.one_of(st.text(max_size=5), _int))
            else:
                entry["extra"] = 1
        header[name] = entry
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = draw(
            st.dictionaries(st.text(max_size=3), st.one_of(st.text(max_size=3), _int), max_size=2)
        )
    raw = json.dumps(header).encode()
    raw += b" " * draw(st.integers(0, 9))
    slack = draw(st.sampled_from([0, 0, 0, -1, 1, 5]))
    return raw, bytes(max(0, offset + slack))


@FUZZ
@given(header=headers())
def test_random_headers_never_crash(scratch: Path, header: tuple[bytes, bytes]) -> None:
    raw, data = header
    path = scratch / "h.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    expect_only_kda_errors(lambda: read_everything(path))


@pytest.fixture(scope="module")
def kda_file(scratch: Path) -> tuple[Path, bytes]:
    """A one-file KDA checkpoint directory (config.json + model.safetensors) to mutate."""
    root = scratch / "kda_base"
    malformed.base_checkpoint(root)
    case_dir = malformed.rewritten(root, "single", lambda ts: ts)
    return case_dir, (case_dir / "model.safetensors").read_bytes()


@st.composite
def mutated_kda_headers(draw: st.DrawFn, raw: bytes) -> bytes:
    """The KDA file with its JSON header edited: a tensor's dtype, shape or offsets changed,
    a tensor renamed or removed."""
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    names = sorted(n for n in header if n != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        if name not in header:
            continue
        op = draw(st.sampled_from(["dtype", "shape", "offsets", "rename", "drop"]))
        if op == "dtype":
            header[name]["dtype"] = draw(st.sampled_from(DTYPES))
        elif op == "shape":
            shape = header[name]["shape"]
            header[name]["shape"] = draw(
                st.one_of(
                    st.permutations(shape).map(list),
                    st.just([*shape, 1]),
                    st.just([1, *shape]),
                    st.lists(st.integers(0, 300), max_size=4),
                )
            )
        elif op == "offsets":
            b, e = header[name]["data_offsets"]
            header[name]["data_offsets"] = [b, e + draw(st.sampled_from([-2, -1, 1, 2, 2**40]))]
        elif op == "rename":
            header[name.replace(draw(st.sampled_from(["0", "1", "self_attn", "weight"])), "x")] = (
                header.pop(name)
            )
        else:
            header.pop(name)
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + raw[8 + length :]


@FUZZ_SHARD
@given(
    data=st.data(), tp_size=st.sampled_from([1, 2, 4]), backend=st.sampled_from(["mmap", "pread"])
)
def test_mutated_kda_checkpoints_shard_or_refuse(
    scratch: Path, kda_file: tuple[Path, bytes], data: st.DataObject, tp_size: int, backend: str
) -> None:
    """The whole ``kda-tp shard`` path on a KDA checkpoint whose header was edited."""
    directory, raw = kda_file
    mutated = data.draw(mutated_kda_headers(raw))
    (directory / "model.safetensors").write_bytes(mutated)
    out = scratch / "out"
    shutil.rmtree(out, ignore_errors=True)
    try:
        expect_only_kda_errors(
            lambda: shard_checkpoint(directory, out, tp_size, qk_multiple=1, backend=backend)
        )
    finally:
        (directory / "model.safetensors").write_bytes(raw)


# ----------------------------------------------------------------------------------------------
# plan parameters and configs

_size = st.one_of(
    st.integers(0, 16),
    st.integers(0, 4096),
    st.integers(-(2**70), 2**70),
    st.sampled_from([2**31, 2**32, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64]),
)
_plan_dtypes = st.one_of(
    st.none(),
    st.dictionaries(
        st.one_of(st.sampled_from(["q_proj", "A_log", "o_proj", "dt_bias"]), st.text(max_size=6)),
        st.one_of(st.sampled_from(DTYPES), st.text(max_size=5)),
        max_size=3,
    ),
)


@FUZZ
@given(
    # KdaTpPlan's positional sizes: tp_rank, tp_size, hidden, head_dim, heads, conv, gate
    sizes=st.tuples(*[_size] * 7),
    qk_multiple=st.one_of(st.none(), _size),
    dtypes=_plan_dtypes,
    extra=st.integers(-3, 3),
)
def test_random_plan_parameters_never_crash(
    sizes: tuple[int, int, int, int, int, int, int],
    qk_multiple: int | None,
    dtypes: dict[str, str] | None,
    extra: int,
) -> None:
    def run() -> None:
        kwargs: dict[str, Any] = {"dtypes": dtypes}
        if qk_multiple is not None:
            kwargs["qk_multiple"] = qk_multiple
        plan = KdaTpPlan(*sizes, **kwargs)
        assert plan.local_heads * plan.tp_size == plan.full_heads
        _ = plan.local_bytes, plan.full_bytes, plan.needs_output_all_reduce
        for t in plan.tensors:
            assert t.local_bytes <= t.full_bytes
            assert t.local_shape(list(t.disk_shape))
            if t.full_bytes + extra <= 1 << 16 and t.full_bytes + extra >= 0:
                buffer = np.arange(t.full_bytes + extra, dtype=np.uint64).astype(np.uint8)
                try:
                    local = shard_bytes(t, buffer)
                except KdaTpError:
                    assert extra != 0
                    continue
                assert extra == 0 and local.nbytes == t.local_bytes
                if t.kind != KdaShard.CHANNEL_COLS:
                    lo = t.src_row_offset * t.full_row_elems * t.elem_bytes
                    assert bytes(local) == bytes(buffer[lo : lo + t.local_bytes])

    expect_only_kda_errors(run)


_json = st.recursive(
    st.one_of(st.none(), st.booleans(), _size, st.floats(allow_nan=True), st.text(max_size=4)),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=8,
)


@st.composite
def configs(draw: st.DrawFn) -> Any:
    """A Kimi- or Qwen3-Next-style config with any value replaced by random JSON, or random JSON."""
    kimi = {**kimi_config(hidden=64, head_dim=64, heads=4, conv=4, kda_layers=[1, 2]),
            "rms_norm_eps": 1e-5}
    qwen = qwen3_next_config(hidden=64, head_dim=64, heads=4, conv=4,
                             layer_types=["linear_attention", "full_attention"])
    config = draw(st.sampled_from([kimi, qwen, None]))
    if config is None:
        return draw(_json)
    config = json.loads(json.dumps(config))
    for _ in range(draw(st.integers(0, 3))):
        target = config
        if (
            "linear_attn_config" in config
            and draw(st.booleans())
            and isinstance(config["linear_attn_config"], dict)
        ):
            target = config["linear_attn_config"]
        key = draw(st.sampled_from(sorted(target) + ["kda_layers", "layer_types", "rms_norm_eps"]))
        if draw(st.booleans()):
            target[key] = draw(_json)
        else:
            target.pop(key, None)
    return config


@FUZZ
@example(config=None, tp_rank=0, tp_size=0, gate=None, qk=0)  # found: AttributeError
@given(
    config=configs(),
    tp_rank=st.integers(-1, 4),
    tp_size=st.integers(-1, 8),
    gate=st.one_of(st.none(), _size),
    qk=_size,
)
def test_random_configs_never_crash(
    config: Any, tp_rank: int, tp_size: int, gate: int | None, qk: int
) -> None:
    expect_only_kda_errors(
        lambda: KdaTpPlan.from_config(config, tp_rank, tp_size, gate_rank=gate, qk_multiple=qk)
    )


@FUZZ_SHARD
@given(
    layers=st.one_of(st.none(), st.lists(st.integers(-3, 5), max_size=4)),
    tp_rank=st.integers(0, 3),
    tp_size=st.sampled_from([1, 2, 4]),
    qk=st.sampled_from([1, 64, 256]),
)
def test_random_layers_for_the_adapter_never_crash(
    kda_file: tuple[Path, bytes], layers: list[int] | None, tp_rank: int, tp_size: int, qk: int
) -> None:
    directory, _ = kda_file

    def run() -> None:
        source = SafetensorsSource(directory)
        shard = KdaShardedSource(
            source, KdaTpPlan.from_config(source, tp_rank, tp_size, qk_multiple=qk), layers
        )
        for name in source.names():
            full, part = source.get(name), shard[name]
            local_shape = shard.info(name)[1]
            assert tuple(part.shape) == tuple(local_shape)
            # Same dtype: bytes per element agree between the full tensor and the slice.
            assert part.nbytes * int(np.prod(full.shape)) == full.nbytes * int(np.prod(local_shape))

    expect_only_kda_errors(run)


# ----------------------------------------------------------------------------------------------
# regressions: each crash the fuzzing found, as a plain test


@pytest.mark.parametrize("config", [None, [], 64, "not a mapping", 1.5])
def test_regression_a_config_that_is_not_a_mapping(config: Any) -> None:
    """Found by test_random_configs_never_crash: ``from_config(None, ...)`` raised
    AttributeError ('NoneType' object has no attribute 'get'). (A str is a path: wrapped.)"""
    with pytest.raises(CheckpointError, match="not a JSON object"):
        KdaTpPlan.from_config([config] if isinstance(config, str) else config, 0, 1)


# JSON as kda_tp reads it (config.json, hf_quant_config.json, kda_tp_layers): any document,
# nested or not, with big integers, or bytes of JSON mutated.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                               max_size=4),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


@FUZZ
@given(value=_JSON, wrap=st.integers(0, 80), junk=st.text(max_size=6), at=st.integers(0, 200))
def test_parse_json_agrees_with_json_or_refuses_by_name(
    value: Any, wrap: int, junk: str, at: int
) -> None:
    """``parse_json`` returns what ``json.loads`` does, or raises CheckpointError: for depth
    past MAX_JSON_DEPTH, integers past MAX_INT_DIGITS digits, or text that is not JSON."""
    from kda_tp.model.json_reader import MAX_INT_DIGITS, MAX_JSON_DEPTH, parse_json

    text = "[" * wrap + json.dumps(value) + "]" * wrap
    text = text if at > len(text) else text[:at] + junk + text[at:]
    try:
        expected: Any = json.loads(text)
    except ValueError:
        expected = ValueError
    try:
        got = parse_json(text, "fuzz")
    except CheckpointError as e:
        assert expected is ValueError or _depth(expected) > MAX_JSON_DEPTH or (
            "MAX_INT_DIGITS" in str(e) and MAX_INT_DIGITS < len(text)), (text, e)
        return
    assert expected is not ValueError and got == expected
    assert _depth(got) <= MAX_JSON_DEPTH


def test_regression_mixed_brackets_count_one_level_each() -> None:
    """``{[]}`` is two levels: 63 lists around ``{"": []}`` nest 65 deep and are refused (the
    depth scan once removed ``[]`` and then ``{}`` in one round; hypothesis found it)."""
    from kda_tp.model.json_reader import MAX_JSON_DEPTH, parse_json

    inner = '{"": []}'
    ok = "[" * (MAX_JSON_DEPTH - 2) + inner + "]" * (MAX_JSON_DEPTH - 2)
    assert _depth(parse_json(ok, "fuzz")) == MAX_JSON_DEPTH
    deep = "[" + ok + "]"
    with pytest.raises(CheckpointError, match="nested more than MAX_JSON_DEPTH = 64 deep"):
        parse_json(deep, "fuzz")


@FUZZ
@given(names=st.lists(st.text(min_size=1, max_size=6), max_size=30))
def test_random_index_file_names_never_crash(scratch: Path, names: list[str]) -> None:
    """An index naming random files (absolute, ``..``, empty, unicode) is refused with a
    CheckpointError, never another exception."""
    base = malformed.base_checkpoint(scratch)
    target = scratch / "index-names"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(base, target)
    index = json.loads((target / malformed.INDEX).read_text())
    for i, name in enumerate(names):
        index["weight_map"][f"extra.{i}"] = name
    (target / malformed.INDEX).write_text(json.dumps(index))
    try:
        SafetensorsSource(target)
    except CheckpointError:
        return
    assert not names
