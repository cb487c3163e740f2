"""Every kind of malformed checkpoint in ``malformed.py`` gets its named kda_tp error, with a
message naming the file (and the tensor, where there is one), through the Python API on both
read backends and through ``kda-tp shard``; nothing is written for a refused input, and the
input is never modified."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import malformed
import numpy as np
import pytest
from kda_tp import SafetensorsSource, cli
from kda_tp.errors import KdaTpError
from kda_tp.shard import shard_checkpoint

from paths import TESTS as HERE


@pytest.fixture(scope="module")
def corpus_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("malformed")
    malformed.base_checkpoint(root)
    return root


def test_the_corpus_has_at_least_20_kinds() -> None:
    assert len(malformed.KINDS) >= 20
    refused = [k for k in malformed.KINDS if k != "misaligned_offset"]
    assert len(refused) >= 20


def _trigger(case: malformed.Case, backend: str, out: Path) -> None:
    if case.action == "open":
        source = SafetensorsSource(case.path, backend)
        for name in source.names():
            source.get(name)
    else:
        shard_checkpoint(case.path, out, 2, backend=backend)


def _snapshot(path: Path) -> dict[str, str]:
    """Relative path -> content hash (or link target) of everything under ``path``."""
    if path.is_file() or path.is_fifo():
        paths = [path]
    else:
        paths = sorted(path.rglob("*"))
    out = {}
    for p in paths:
        if p.is_symlink():
            out[str(p)] = "-> " + str(p.readlink())
        elif p.is_fifo():
            out[str(p)] = "fifo"
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _check_message(case: malformed.Case, message: str) -> None:
    for want in case.contains:
        assert want in message, f"{case.kind}: {want!r} not in {message!r}"


NON_BLOCKING = [
    k for k, f in malformed.KINDS.items() if k not in ("not_a_regular_file", "config_not_regular")
]


@pytest.mark.parametrize("kind", [k for k in NON_BLOCKING if k != "misaligned_offset"])
@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_refused_with_a_named_error(
    corpus_root: Path, tmp_path: Path, kind: str, backend: str
) -> None:
    case = malformed.build(kind, corpus_root)
    assert case.error is not None and issubclass(case.error, KdaTpError)
    before = _snapshot(case.path)
    out = tmp_path / "out"
    with pytest.raises(KdaTpError) as info:
        _trigger(case, backend, out)
    assert type(info.value) is case.error, f"{kind}: {type(info.value).__name__}: {info.value}"
    _check_message(case, str(info.value))
    # Nothing written for refused input, and the input untouched.
    assert not out.exists() or not any(out.iterdir())
    assert _snapshot(case.path) == before


@pytest.mark.parametrize("kind", NON_BLOCKING)
def test_cli_shard_reports_the_error(
    corpus_root: Path, tmp_path: Path, kind: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``kda-tp shard`` exits 2 with ``kda-tp: error: <Class>: <message>`` and writes nothing."""
    case = malformed.build(kind, corpus_root)
    out = tmp_path / "out"
    status = cli.main(["shard", str(case.path), "--tp-size", "2", "--out", str(out), "--quiet"])
    err = capsys.readouterr().err
    if case.error is None:
        # A single valid file without config.json: refused for the missing config, not the layout.
        assert status == 2 and "config.json" in err
        return
    assert status == 2, err
    assert err.startswith(f"kda-tp: error: {case.error.__name__}: "), err
    _check_message(case, err)
    assert not out.exists() or not any(out.iterdir())


@pytest.mark.parametrize("backend", ["mmap", "pread"])
def test_a_misaligned_tensor_loads_correctly_by_copying(corpus_root: Path, backend: str) -> None:
    case = malformed.build("misaligned_offset", corpus_root)
    source = SafetensorsSource(case.path, backend)
    assert source.names() == ["u8", "f32", "f64", "i16"]
    for name, want in case.expected.items():
        tensor = source.get(name)
        assert tensor.data.ctypes.data % want.dtype.itemsize == 0, name
        assert not tensor.data.flags.writeable
        np.testing.assert_array_equal(tensor.array, want)
        assert tensor.array.dtype == want.dtype
        assert bytes(tensor) == want.tobytes()


@pytest.mark.parametrize("kind", ["not_a_regular_file", "config_not_regular"])
def test_a_fifo_is_refused_without_blocking(corpus_root: Path, tmp_path: Path, kind: str) -> None:
    """A FIFO in place of a file would block a naive open() forever: run the attempt in a child
    process with a timeout, so a regression fails instead of hanging the suite."""
    case = malformed.build(kind, corpus_root)
    code = textwrap.dedent(
        f"""
        import sys
        sys.path[:0] = [{str(HERE)!r}, {str(Path(__file__).parent)!r}]  # malformed, this file
        from pathlib import Path
        import malformed
        from kda_tp.errors import KdaTpError
        from test_malformed import _trigger
        case = malformed.build({kind!r}, {str(corpus_root)!r})
        for backend in ("mmap", "pread"):
            try:
                _trigger(case, backend, Path({str(tmp_path / "out")!r}))
            except KdaTpError as e:
                print(type(e).__name__, e, sep="\\t")
            else:
                print("no error")
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=HERE
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert len(lines) == 2, run.stdout
    for line in lines:
        name, _, message = line.partition("\t")
        assert name == case.error.__name__, line
        _check_message(case, message)


def test_the_script_dumps_the_corpus(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(HERE / "malformed.py"), str(tmp_path / "corpus")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert f"{len(malformed.KINDS)} kinds written" in run.stdout
    for kind in malformed.KINDS:
        assert (tmp_path / "corpus" / kind).is_dir(), kind


@pytest.mark.parametrize("kind", list(malformed.CLI_KINDS))
def test_hostile_command_lines_are_refused_in_one_line(corpus_root: Path, kind: str) -> None:
    """Each hostile command line, in its own process: exit 2, exactly one ``kda-tp: error:``
    line holding the expected words, no traceback. Its time and peak memory (at most 5 s and
    600 MB) are measured by ``benchmarks/bench.py --only refuse``, not asserted here."""
    case = malformed.CLI_KINDS[kind](corpus_root)
    env = {**os.environ, **case.env}
    run = subprocess.run(
        [sys.executable, "-m", "kda_tp", *case.argv],
        capture_output=True, text=True, timeout=120, env=env,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("kda-tp: error:")]
    assert run.returncode == 2, run.stderr
    assert len(errors) == 1 and case.contains in errors[0], run.stderr
    assert "Traceback" not in run.stderr


def test_the_api_refuses_bools_bad_offsets_backends_and_plans(corpus_root: Path) -> None:
    """Issue 21, class 5: every refusal a KdaTpError subclass (a ValueError), or a TypeError."""
    from kda_tp import KdaShardedSource, KdaTpPlan
    from kda_tp.errors import PlanError, UsageError
    from kda_tp.checkpoint import check_layers

    base = malformed.base_checkpoint(corpus_root)
    source = SafetensorsSource(base)
    with pytest.raises(PlanError, match="tp_rank must be a non-negative integer .* got True"):
        KdaTpPlan.from_config(source, True, 2)
    with pytest.raises(PlanError, match="tp_size .* got False"):
        KdaTpPlan(0, False, 64, 64, 4, 4, 16)
    with pytest.raises(PlanError, match="True is not a layer index"):
        check_layers([True], None, None)
    with pytest.raises(UsageError, match="backend='bogus'") as info:
        SafetensorsSource(base, backend="bogus")
    assert isinstance(info.value, ValueError)
    with pytest.raises(TypeError, match="plan must be a KdaTpPlan .* got NoneType"):
        KdaShardedSource(source, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("start, stop", [(-5, 10), (True, 10), (0, 2**70), (0, 1.5)])
def test_read_range_refuses_what_is_not_a_byte_offset(corpus_root: Path, start: object,
                                                      stop: object) -> None:
    from kda_tp.errors import UsageError

    source = SafetensorsSource(malformed.base_checkpoint(corpus_root))
    name = source.names()[0]
    with pytest.raises(UsageError, match="must be a byte offset"):
        source.read_range(name, start, stop)  # type: ignore[arg-type]


def test_a_deep_or_huge_config_is_refused_in_the_api(corpus_root: Path) -> None:
    from kda_tp.model import load_config, parse_config
    from kda_tp.errors import CheckpointError

    case = malformed.CLI_KINDS["cli_config_deep"](corpus_root)
    with pytest.raises(CheckpointError, match="MAX_JSON_DEPTH = 64"):
        load_config(Path(case.argv[1]))
    with pytest.raises(CheckpointError, match="more than 32 digits"):
        parse_config({"hidden_size": 10**5000, "linear_attn_config": {
            "head_dim": 64, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1]}})
