"""``verify`` on outputs that are damaged or incomplete, its progress and what it reports, and
how much of the checkpoints it keeps resident.

A damaged output (a truncated rank file, a garbled header, a broken index) is a failed
verification (exit 1), as the oracle says, never refused input (exit 2).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

import kda_tp
from kda_tp import oracle
from kda_tp import SafetensorsSource
from kda_tp.shard import rank_dir, shard_checkpoint, verify_shards

from cli_run import run
from paths import ENGINE_RANKS
from tp_fixtures import small_checkpoint_fixtures

# 3 decoder layers, 0-based 0..2 all KDA; 8 heads, so TP 8 works with --qk-multiple 1.
SMALL = dict(hidden=96, heads=8, head_dim=32, conv_kernel=4, gate_rank=16, num_layers=3)

ckpt, sharded = small_checkpoint_fixtures({**SMALL, "kda_layers": [0, 1, 2]}, seed=5,
                                          qk_multiple=1)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)


def _garble_header(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(3)
        f.write(b"garbage")


def _break_index(path: Path) -> None:
    (path.parent / "model.safetensors.index.json").write_text("{not json")


@pytest.mark.parametrize(
    ("damage", "words"),
    [(_truncate, "truncated"), (_garble_header, "header length"), (_break_index, "index")],
    ids=["truncated", "garbled-header", "broken-index"],
)
def test_a_damaged_rank_file_fails_verification_like_the_oracle(
    ckpt, sharded, capsys, damage, words
):
    path = sorted(rank_dir(sharded, 1).glob("*.safetensors"))[-1]
    damage(path)
    report = verify_shards(ckpt, sharded)
    assert not report.ok and len(report.problems) == 1
    assert report.problems[0].startswith(f"{rank_dir(sharded, 1)}: rank 1 cannot be read: ")
    assert words in report.problems[0]
    assert oracle.verify(ckpt, sharded) != []  # the oracle fails it too

    status, out, err = run(capsys, "verify", ckpt, sharded)
    assert status == 1 and "rank 1 cannot be read" in out and "Traceback" not in err
    status, out, _ = run(capsys, "verify", ckpt, sharded, "--json")
    doc = json.loads(out)
    assert status == 1 and doc["ok"] is False and "rank 1 cannot be read" in doc["problems"][0]


def _corrupt(path: Path) -> None:
    path.write_text("{not json")


def _edit(path: Path) -> None:
    # Same size, one digit changed: what a hand edit of a value looks like.
    text = path.read_text()
    at = next(i for i, c in enumerate(text) if c.isdigit())
    path.write_text(text[:at] + str((int(text[at]) + 1) % 10) + text[at + 1:])


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_corrupt, "{copy}: rank 1's {name} differs from the input's {original}"),
        (_edit, "{copy}: rank 1's {name} differs from the input's {original}"),
        (Path.unlink,
         "{copy}: rank 1 lacks {name} (shard copies the input's {original} into every rank)"),
    ],
    ids=["corrupt", "edited", "missing"],
)
@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_a_rank_s_companion_file_must_equal_the_input_s(ckpt, tmp_path, capsys, damage, message,
                                                         name):
    """config.json and every other file shard copies into each rank, byte for byte."""
    (ckpt / "tokenizer_config.json").write_text('{"model_max_length": 4096}')
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2, qk_multiple=1)
    assert verify_shards(ckpt, out).ok and oracle.verify(ckpt, out) == []
    copy, original = rank_dir(out, 1) / name, ckpt / name
    damage(copy)
    if damage is _edit:
        assert copy.stat().st_size == original.stat().st_size
    want = message.format(copy=copy, name=name, original=original)
    report = verify_shards(ckpt, out)
    assert report.problems == [want]
    status, text, err = run(capsys, "verify", ckpt, out)
    assert (status, text.splitlines()[-1]) == (1, f"FAIL: {want}")
    assert "Traceback" not in err
    # The oracle fails it too (a config.json it cannot parse, in its own words).
    problems = oracle.verify(ckpt, out)
    assert len(problems) == 1 and problems[0].startswith("rank1: ") and name in problems[0]


def test_a_damaged_first_rank_still_fails_rather_than_refuses(ckpt, sharded, capsys):
    """The world size is read from the first rank that can be read."""
    _garble_header(sorted(rank_dir(sharded, 0).glob("*.safetensors"))[0])
    report = verify_shards(ckpt, sharded)
    assert not report.ok and report.tp_size == 2
    assert "rank 0 cannot be read" in report.problems[0]
    assert run(capsys, "verify", ckpt, sharded)[0] == 1


def test_an_incomplete_output_is_reported_once(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 8, ranks=[0, 1, 2, 3], qk_multiple=1)
    status, text, _ = run(capsys, "verify", ckpt, out)
    assert status == 1
    assert text.count("ranks missing") == 1
    assert f"FAIL: {out}: 4 of 8 ranks missing: [4, 5, 6, 7] (incomplete run?)" in text
    assert "e.g." not in text
    assert "--ranks 4,5,6,7 --qk-multiple 1" in text


def test_several_problems_are_listed_then_counted(ckpt, sharded, capsys):
    for rank in (0, 1):
        _truncate(sorted(rank_dir(sharded, rank).glob("*.safetensors"))[-1])
    status, text, _ = run(capsys, "verify", ckpt, sharded)
    lines = text.splitlines()
    assert status == 1 and lines[-1] == "FAIL: 2 problems"
    assert [line.strip().split(":")[0] for line in lines[:-1]] == [
        str(rank_dir(sharded, 0)), str(rank_dir(sharded, 1))
    ]


def test_numeric_verify_reports_progress_per_layer_and_each_phase_s_time(ckpt, sharded, capsys):
    status, out, err = run(capsys, "verify", ckpt, sharded, "--numeric")
    assert status == 0
    progress = [line for line in err.splitlines() if line.startswith("verify --numeric:")]
    assert [line.split(" (")[0] for line in progress] == [
        f"verify --numeric: {i} of 3 KDA layers" for i in range(4)
    ]
    summary = out.splitlines()[-1]
    assert summary.startswith("OK: ") and " GB checked in " in summary
    assert "numerical TP equivalence passes (3 KDA layers in " in summary
    assert "GB/s" not in out + err  # no rate of one phase's bytes over another's time
    status, _, err = run(capsys, "verify", ckpt, sharded, "--numeric", "--quiet")
    assert status == 0 and err == ""
    status, out, _ = run(capsys, "verify", ckpt, sharded, "--numeric", "--quiet", "--json")
    doc = json.loads(out)
    assert status == 0 and doc["byte_seconds"] > 0 and doc["numeric_seconds"] > 0


def test_the_demo_reports_no_input_rate(capsys):
    status, out, _ = run(capsys, "demo", "--model", "kimi-linear", "--num-layers", "1",
                         "--tp-size", 2, "--no-numeric")
    assert status == 0 and "input read at" not in out
    assert " GB checked in " in out


def test_verify_drops_each_tensor_s_pages_once_checked(ckpt, sharded, monkeypatch):
    """The resident set stays near one tensor: every input tensor and every rank's copy of it
    is released (``SafetensorsSource.release``) after it is checked, numeric check included."""
    released: dict[str, list[str]] = {}
    real = SafetensorsSource.release

    def record(self, name):
        released.setdefault(str(self.root), []).append(name)
        real(self, name)

    monkeypatch.setattr(SafetensorsSource, "release", record)
    assert verify_shards(ckpt, sharded, numeric=True).ok
    names = SafetensorsSource(ckpt).names()
    assert set(released[str(ckpt)]) == set(names)
    for rank in (0, 1):
        assert set(released[str(rank_dir(sharded, rank))]) == set(names)
    # The numeric check releases each KDA tensor of each layer on the input and every rank.
    kda = [n for n in names if ".self_attn." in n]
    assert all(released[str(ckpt)].count(n) >= 2 for n in kda)
    assert all(released[str(rank_dir(sharded, 1))].count(n) >= 2 for n in kda)


def test_check_tp_equivalence_reports_progress_per_layer(ckpt):
    steps: list[tuple[int, int]] = []

    def factory(total):
        steps.append((total, 0))
        return lambda n: steps.append((total, steps[-1][1] + n))

    report = kda_tp.reference.check_tp_equivalence(ckpt, 2, qk_multiple=1, progress=factory)
    assert report.passed and steps == [(3, 0), (3, 1), (3, 2), (3, 3)]


def test_a_failing_numeric_check_is_a_failed_summary_though_the_bytes_match():
    from kda_tp.reference import EquivalenceReport, LayerEquivalence
    from kda_tp.shard import VerifyReport

    def report(passed: bool) -> VerifyReport:
        layer = LayerEquivalence(layer=0, max_abs_error=0.5 if not passed else 1e-7,
                                 max_rel_error=0.6, y_abs_max=0.8, tolerance=9e-5, passed=passed)
        numeric = EquivalenceReport(tp_size=2, seq_len=16, seed=0, atol=1e-5, rtol=1e-4,
                                    layers=(layer,))
        return VerifyReport(tp_size=2, tensors=30, bytes_checked=10**6, numeric=numeric)

    failed = report(False)
    assert not failed.ok
    assert failed.summary().startswith("FAIL: 30 tensors x 2 ranks rejoin to the input byte for byte")
    assert "numerical TP equivalence FAILS (1 KDA layer in" in failed.summary()
    assert report(True).summary().startswith("OK: 30 tensors x 2 ranks")


def test_a_non_finite_reference_output_is_named_without_numpy_warnings(tmp_path, capsys):
    """engine_ranks' index-coded weights (A_log ~ 90000) overflow float32 in exp(A_log): the
    full weights' output is NaN, which verify --numeric names, with no numpy RuntimeWarning."""
    ckpt = ENGINE_RANKS / "ckpt_kl"
    out = tmp_path / "out"
    shard_checkpoint(ckpt, out, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a numpy RuntimeWarning would raise
        report = verify_shards(ckpt, out, numeric=True)
        assert report.problems == [] and report.numeric is not None
        assert [(e.layer, e.passed, e.non_finite) for e in report.numeric.layers] == [
            (0, False, "full")
        ]
        status, text, err = run(capsys, "verify", ckpt, out, "--numeric", "--quiet")
        assert status == 1
        assert text.splitlines()[0] == (
            "layer 0: the reference output of the full weights is not finite (NaN or inf), so "
            "TP equivalence cannot be judged: the stored weights overflow float32 or hold "
            "NaN/inf (e.g. a large A_log, whose exp is inf); check the input checkpoint FAIL"
        )
        assert "numerical TP equivalence FAILS (1 KDA layer in" in text.splitlines()[1]
        assert err == ""
        status, text, _ = run(capsys, "verify", ckpt, out, "--numeric", "--quiet", "--json")
        layer = json.loads(text)["numeric"]["layers"][0]
        assert (status, layer["passed"], layer["non_finite"]) == (1, False, "full")


def test_verify_report_to_dict_is_what_verify_json_prints(ckpt, sharded, capsys):
    report = verify_shards(ckpt, sharded, numeric=True)
    status, out, _ = run(capsys, "verify", ckpt, sharded, "--numeric", "--quiet", "--json")
    doc, mine = json.loads(out), report.to_dict()
    assert status == 0 and list(doc) == list(mine) and mine["ok"] is True
    timings = ("byte_seconds", "numeric_seconds")  # each run's own wall times
    assert {k: v for k, v in doc.items() if k not in timings} == {
        k: v for k, v in mine.items() if k not in timings}
    assert mine["numeric"]["layers"][0]["layer"] == 0 and mine["unindexed"] == []
    assert report.to_dict([Path("extra.bin")])["unindexed"] == ["extra.bin"]
