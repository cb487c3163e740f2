"""`kda-tp dump` / kda_tp.audit.write_engine_dump and `kda-tp digests` /
kda_tp.audit.engine_digests: a dump of what an engine's ranks must hold passes `kda-tp audit`, the
same dump damaged fails it with the parameter named, and the digests are SHA-256 over the bytes of
each parameter, keyed as vLLM's Worker.compute_weight_checksums keys them. The engines' own
digests are compared in tests/audit/test_digests_vllm.py."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
from safetensors import safe_open

import kda_tp
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.checkpoint import write_safetensors
from kda_tp.cli import main
from kda_tp.audit import audit_path
from kda_tp.audit import DIGEST_KEY
from kda_tp.engines import LAYOUTS, build_param, get_layout, layouts_for
from kda_tp.errors import DtypeMismatchError, EngineLayoutError, OutputError, PlanError
from kda_tp.output import FILE_MARK
from kda_tp.synth import write_small_checkpoint

from paths import DATA as FIXTURES, ENGINE_RANKS as DATA

CKPTS = {"kimi-k3": DATA / "ckpt_k3", "kimi-linear": DATA / "ckpt_kl", "glm-5.3": DATA / "ckpt_glm"}
# Every tensor-parallel layout with the fixture checkpoint of its family.
TP_LAYOUTS = [(name, CKPTS[lay.family]) for name, lay in LAYOUTS.items() if lay.tensor_parallel]


def run(capsys, *args: object) -> tuple[int, str, str]:
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def header(path: Path) -> tuple[int, dict]:
    """A safetensors file's header, and where its data section starts."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


@pytest.mark.parametrize(("engine", "ckpt"), TP_LAYOUTS, ids=[n for n, _ in TP_LAYOUTS])
def test_a_dump_passes_the_audit(engine, ckpt, tmp_path, capsys):
    status, out, err = run(capsys, "dump", ckpt, "--engine", engine, "--tp-size", 4,
                           "--out", tmp_path / "dump", "--dtype", "F32")
    assert status == 0, err
    assert f"kda-tp audit {ckpt} {tmp_path / 'dump'} --tp-size 4" in out
    assert sorted(p.name for p in (tmp_path / "dump").iterdir()) == [
        f"model-rank-{r}-part-0.safetensors" for r in range(4)]
    status, out, err = run(capsys, "audit", ckpt, tmp_path / "dump", "--tp-size", 4, "--quiet",
                           "--dtype", "F32")
    assert status == 0, out + err
    assert f"on ranks 0, 1, 2, 3 of 4 ({engine})" in out and "0 other parameters ignored" in out


def test_the_dump_holds_what_build_param_builds_under_the_engines_names(tmp_path):
    ckpt, engine = CKPTS["kimi-k3"], "vllm-0.33-k3"
    result = kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine=engine, tp_size=4, ranks=[2, 0],
                                            model_dtype="F32")
    assert result.ranks == (0, 2) and result.engine == engine and result.tp_size == 4
    assert result.files == (tmp_path / "model-rank-0-part-0.safetensors",
                            tmp_path / "model-rank-2-part-0.safetensors")
    source = SafetensorsSource(ckpt)
    layout = get_layout(engine)
    nbytes = 0
    for rank, path in zip(result.ranks, result.files):
        shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, 4, qk_multiple=1))
        with safe_open(path, "np") as f:
            assert f.metadata() == {"tp_size": "4", "tp_rank": str(rank), "engine": engine,
                                    FILE_MARK: kda_tp.__version__}
            names = list(f.keys())
            # Exactly the layout's parameters of the one KDA layer, nothing else.
            assert sorted(names) == sorted(f"model.layers.0.self_attn.{p.suffix}"
                                           for p in layout.params_for(shard.plan))
            for name in names:
                want = build_param(shard, layout, name.rsplit("self_attn.", 1)[1], 0)
                got = f.get_tensor(name)
                assert got.dtype == want.dtype and got.shape == want.shape
                assert got.tobytes() == want.tobytes()
                nbytes += want.nbytes
    assert result.params == 14 and result.bytes_written == nbytes
    # vLLM K3's fused projection: q, k, v, g (3 heads of 128 each), f_a (128), b (3) = 1667
    # rows, padded with zeros to 1680; rank 2's q rows hold 0 + 768.. (row i holds base + i).
    with safe_open(result.files[1], "np") as f:
        fused = f.get_tensor("model.layers.0.self_attn.in_proj_qkvgfab.weight")
        a_log = f.get_tensor("model.layers.0.self_attn.A_log")
    assert fused.shape == (1680, 64) and not fused[1667:].any()
    assert fused[0, 0] == 768.0 and fused[384, 0] == 10768.0
    assert a_log.tolist() == [90006.0, 90007.0, 90008.0]


def test_a_damaged_dump_fails_the_audit_naming_the_parameter(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    assert run(capsys, "dump", ckpt, "--engine", "vllm-0.33-kimi-linear", "--tp-size", 2,
               "--out", tmp_path, "--dtype", "F32")[0] == 0
    # Rank 1's A_log (heads 6..11 of 12: 90006.0, ...) overwritten with zeros, in place.
    path = tmp_path / "model-rank-1-part-0.safetensors"
    start, meta = header(path)
    begin, end = meta["model.layers.0.self_attn.A_log"]["data_offsets"]
    with open(path, "r+b") as f:
        f.seek(start + begin)
        f.write(bytes(end - begin))
    status, out, _ = run(capsys, "audit", ckpt, tmp_path, "--tp-size", 2, "--quiet",
                         "--dtype", "F32")
    assert status == 1
    assert ("rank 1 model.layers.0.self_attn.A_log: values differ in A_log; part A_log differs "
            "at [0] (its [0, 0]; expected 90006.0, got 0.0): equals zeros (never loaded?)") in out
    assert out.splitlines()[-1].startswith("FAIL: 1 KDA parameter(s) wrong")


def test_a_rank_written_with_another_ranks_bytes_is_named(tmp_path, capsys):
    """The dump of rank 0 renamed as rank 1's (its metadata removed): what a loader that
    loads rank 0's slice on every rank leaves."""
    ckpt = CKPTS["glm-5.3"]
    kda_tp.audit.write_engine_dump(ckpt, tmp_path / "a", engine="sglang-0.5.23-glm-5.3", tp_size=2,
                                   model_dtype="F32")
    with safe_open(tmp_path / "a" / "model-rank-0-part-0.safetensors", "np") as f:
        rank0 = {k: f.get_tensor(k) for k in f.keys()}
    from safetensors.numpy import save_file

    (tmp_path / "b").mkdir()
    save_file(rank0, str(tmp_path / "b" / "model-rank-1-part-0.safetensors"))
    status, out, _ = run(capsys, "audit", ckpt, tmp_path / "b" / "model-rank-1-part-0.safetensors",
                         "--tp-size", 2, "--dtype", "F32")
    assert status == 1
    assert "rank 1 model.layers.0.self_attn.dt_bias: values differ in dt_bias" in out
    assert "equals rank 0's slice of dt_bias" in out


def test_a_wrapped_checkpoint_is_named_as_the_engine_names_it(tmp_path):
    """A Kimi K3 checkpoint under language_model.model.layers. (synth's K3 style): vLLM's
    KimiK3ForConditionalGeneration holds its layers as language_model.model.layers."""
    ckpt = write_small_checkpoint(tmp_path / "k3", hidden=64, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=64, num_layers=2, kda_layers=[0],
                                  style="k3", weight_dtype="F32")
    assert kda_tp.describe(ckpt).family.name == "kimi-k3"
    result = kda_tp.audit.write_engine_dump(ckpt, tmp_path / "dump", engine="vllm-0.33-k3",
                                            tp_size=2, model_dtype="F32")
    with safe_open(result.files[0], "np") as f:
        names = sorted(f.keys())
    assert "language_model.model.layers.0.self_attn.in_proj_qkvgfab.weight" in names
    # layer 1 is K3's MLA layer: its parameters are dumped too, under the same prefix
    assert "language_model.model.layers.1.self_attn.fused_qkv_a_g_proj.weight" in names
    assert all(n.startswith(("language_model.model.layers.0.self_attn.",
                             "language_model.model.layers.1.self_attn.")) for n in names)
    report = audit_path(ckpt, tmp_path / "dump", tp_size=2, model_dtype="F32")
    assert report.passed and sum(p.mla for p in report.params) == 12, report.format()


def test_state_dict_prefixes_follow_the_engines_mappers():
    assert get_layout("vllm-0.33-kimi-linear").state_dict_prefix("model.layers.") == "model.layers."
    for name in ("vllm-0.33-k3", "vllm-0.33-glm-5.3", "sglang-0.5.23-k3"):
        for nested in ("language_model.layers.", "model.language_model.layers.",
                       "language_model.model.layers."):
            assert get_layout(name).state_dict_prefix(nested) == "language_model.model.layers."
    assert get_layout("sglang-0.5.23-glm-5.3").state_dict_prefix(
        "model.language_model.layers.") == "model.layers."
    assert get_layout("transformers-5-glm-5.3").state_dict_prefix(
        "model.language_model.layers.") == "model.language_model.layers."


def test_dump_refusals(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    engine = ("--engine", "vllm-0.33-kimi-linear")
    assert run(capsys, "dump", ckpt, *engine, "--tp-size", 2, "--out", tmp_path,
               "--dtype", "F32")[0] == 0
    # A rank file already there (maybe an engine's own dump): refused, then replaced with --force.
    status, out, err = run(capsys, "dump", ckpt, *engine, "--tp-size", 2, "--out", tmp_path,
                           "--ranks", "1", "--dtype", "F32")
    assert status == 2 and out == ""
    assert err.startswith("kda-tp: error: OutputError: ") and "--force" in err
    assert len(err.splitlines()) == 1
    assert run(capsys, "dump", ckpt, *engine, "--tp-size", 2, "--out", tmp_path, "--ranks", "1",
               "--force", "--dtype", "F32")[0] == 0
    # Another world size's files in the directory.
    with pytest.raises(OutputError, match=r"model-rank-0-part-0.safetensors: a dump file of tp_size 2 "
                       r"\(its metadata\), so of another world size than tp_size 1 \(and 1 more\)"):
        kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear", tp_size=1,
                                       model_dtype="F32")
    with pytest.raises(OutputError, match="lies inside the checkpoint"):
        kda_tp.audit.write_engine_dump(ckpt, ckpt / "dump", engine="vllm-0.33-kimi-linear",
                                       tp_size=2, model_dtype="F32")
    assert not (ckpt / "dump").exists()
    with pytest.raises(PlanError, match=r"rank 4 is out of range for tp_size 4: valid ranks are 0\.\.3"):
        kda_tp.audit.write_engine_dump(ckpt, tmp_path / "x", engine="vllm-0.33-kimi-linear",
                                       tp_size=4, ranks=[4], model_dtype="F32")
    with pytest.raises(PlanError, match=r"ranks \[1, 1\] name a rank twice"):
        kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=2, ranks=[1, 1],
                                    model_dtype="F32")
    # A world size is checked against the heads before anything is sized by it.
    with pytest.raises(PlanError, match=r"divisible by tp_size \(1000000000\)"):
        kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=10**9,
                                    model_dtype="F32")
    with pytest.raises(EngineLayoutError, match="this layout is for kimi-k3"):
        kda_tp.audit.write_engine_dump(ckpt, tmp_path / "x", engine="vllm-0.33-k3", tp_size=2,
                                       model_dtype="F32")
    status, _, err = run(capsys, "dump", ckpt, "--engine", "vllm-9", "--tp-size", 2,
                         "--out", tmp_path / "y", "--json", "--dtype", "F32")
    assert status == 2 and "no engine layout 'vllm-9'" in err


def test_dump_json(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    status, out, _ = run(capsys, "dump", ckpt, "--engine", "sglang-0.5.23-kimi-linear",
                         "--tp-size", 4, "--ranks", "3", "--out", tmp_path, "--json",
                         "--dtype", "F32")
    doc = json.loads(out)
    assert status == 0 and doc["ok"] is True
    assert doc["engine"] == "sglang-0.5.23-kimi-linear" and doc["tp_size"] == 4
    assert doc["ranks"] == [3] and doc["params"] == 7
    assert doc["files"] == [str(tmp_path / "model-rank-3-part-0.safetensors")]
    _, meta = header(tmp_path / "model-rank-3-part-0.safetensors")
    assert doc["bytes_written"] == sum(v["data_offsets"][1] - v["data_offsets"][0]
                                       for k, v in meta.items() if k != "__metadata__")
    # the document is DumpResult.to_dict()
    result = kda_tp.audit.write_engine_dump(ckpt, tmp_path / "again",
                                            engine="sglang-0.5.23-kimi-linear", tp_size=4,
                                            ranks=[3], model_dtype="F32")
    again = result.to_dict()
    assert set(again) == set(doc) and again["bytes_written"] == doc["bytes_written"]
    assert again["files"] == [str(tmp_path / "again" / "model-rank-3-part-0.safetensors")]


def test_dtype_casts_the_model_dtype_parameters_only(tmp_path):
    ckpt = CKPTS["kimi-linear"]
    result = kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear",
                                            tp_size=2, ranks=[0], model_dtype="BF16")
    with safe_open(result.files[0], "np") as f:
        dtypes = {k.rsplit("self_attn.", 1)[1]: str(f.get_tensor(k).dtype) for k in f.keys()}
    assert dtypes["in_proj_qkvgfab.weight"] == "bfloat16" and dtypes["o_proj.weight"] == "bfloat16"
    assert dtypes["A_log"] == dtypes["dt_bias"] == dtypes["conv1d.weight"] == "float32"
    # vLLM's default model dtype for this dtype-less F32 checkpoint is BF16
    assert audit_path(ckpt, tmp_path, tp_size=2, tp_rank=0).passed


def test_audit_paths_rank_is_tp_rank(tmp_path):
    ckpt = CKPTS["kimi-linear"]
    kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear", tp_size=2,
                                   ranks=[1], model_dtype="F32")
    by_name = audit_path(ckpt, tmp_path, tp_size=2, tp_rank=1, model_dtype="F32")
    assert by_name.passed and by_name.ranks == (1,)
    with pytest.raises(PlanError, match=r"tp_rank must be an integer >= 0, got -1"):
        audit_path(ckpt, tmp_path, tp_size=2, tp_rank=-1)


# ------------------------------------------------------------------------------------------
# digests


def expected_digests(ckpt: Path, engine: str, tp_size: int) -> dict[str, str]:
    """hashlib over each parameter's bytes, built here rank by rank, layer by layer."""
    source = SafetensorsSource(ckpt)
    layout = get_layout(engine)
    out = {}
    for rank in range(tp_size):
        shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp_size,
                                                               qk_multiple=1))
        for layer in shard.layers:
            for p in layout.params_for(shard.plan):
                data = build_param(shard, layout, p.suffix, layer).tobytes()
                key = f"dp0:pp0:pcp0:tp{rank}:model.layers.{layer}.self_attn.{p.suffix}"
                out[key] = hashlib.sha256(data).hexdigest()
    return out


@pytest.mark.parametrize("engine", [n for n, lay in LAYOUTS.items() if lay.engine == "vllm"])
def test_digests_are_sha256_of_each_parameters_bytes(engine, capsys):
    ckpt = CKPTS[get_layout(engine).family]
    want = expected_digests(ckpt, engine, 4)
    assert kda_tp.audit.engine_digests(ckpt, engine=engine, tp_size=4, model_dtype="F32") == want
    status, out, _ = run(capsys, "digests", ckpt, "--engine", engine, "--tp-size", 4,
                         "--dtype", "F32")
    assert status == 0
    assert out.splitlines() == [f"{d}  {k}" for k, d in want.items()]
    status, out, _ = run(capsys, "digests", ckpt, "--engine", engine, "--tp-size", 4,
                         "--ranks", "2", "--json", "--dtype", "F32")
    doc = json.loads(out)
    assert status == 0 and doc["ok"] is True and doc["ranks"] == [2] and doc["tp_size"] == 4
    assert doc["engine"] == engine
    assert doc["checksums"] == {k: d for k, d in want.items() if k.startswith("dp0:pp0:pcp0:tp2:")}


def test_digests_equal_the_hash_of_the_dumps_tensors(tmp_path):
    ckpt = CKPTS["kimi-k3"]
    dump = kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-k3", tp_size=2,
                                          model_dtype="F32")
    digests = kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-k3", tp_size=2, model_dtype="F32")
    from_files = {}
    for rank, path in zip(dump.ranks, dump.files):
        start, meta = header(path)
        raw = path.read_bytes()
        for name, info in meta.items():
            if name != "__metadata__":
                begin, end = info["data_offsets"]
                key = DIGEST_KEY.format(rank=rank, name=name)
                from_files[key] = hashlib.sha256(raw[start + begin : start + end]).hexdigest()
    assert from_files == digests and len(digests) == 2 * 7


def test_digests_refuse_a_layout_of_another_engine(capsys):
    status, out, err = run(capsys, "digests", CKPTS["kimi-k3"], "--engine", "sglang-0.5.23-k3",
                           "--tp-size", 2, "--json", "--dtype", "F32")
    assert status == 2 and len(err.splitlines()) == 1
    doc = json.loads(out)
    assert doc["ok"] is False and doc["error"]["type"] == "EngineLayoutError"
    assert "Pass a vLLM layout: vllm-0.33-k3, vllm-0.33-kimi-linear, vllm-0.33-glm-5.3" in (
        doc["error"]["message"])


def test_the_audits_enumeration_is_the_dumps(tmp_path):
    """The audit checks exactly the parameters the dump writes (one enumeration:
    kda_tp.engines.engine_params)."""
    ckpt = CKPTS["glm-5.3"]
    for layout in layouts_for("glm-5.3"):
        if not layout.tensor_parallel:
            continue
        out = tmp_path / layout.name
        dump = kda_tp.audit.write_engine_dump(ckpt, out, engine=layout, tp_size=2, ranks=[1],
                                              model_dtype="F32")
        report = audit_path(ckpt, out, tp_size=2, tp_rank=1, model_dtype="F32")
        with safe_open(dump.files[0], "np") as f:
            assert sorted(f.keys()) == sorted(p.name for p in report.params)
        assert report.passed and report.ignored == 0 and dump.params == len(report.params)


def test_a_block_fp8_dump_holds_the_scale_grids_and_passes(tmp_path):
    ckpt = FIXTURES / "k3_fp8_small"
    dump = kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="sglang-0.5.23-k3", tp_size=2,
                                          model_dtype="F32")
    _, meta = header(dump.files[1])  # numpy cannot hold FP8: the header says the dtypes
    pre = "language_model.model.layers.0.self_attn."
    assert meta[pre + "fused_qkvg_proj.weight"]["dtype"] == "F8_E4M3"  # as stored, never cast
    assert meta[pre + "fused_qkvg_proj.weight_scale_inv"]["dtype"] == "F32"
    assert meta[pre + "o_proj.weight_scale_inv"]["dtype"] == "F32"
    assert audit_path(ckpt, tmp_path, tp_size=2, model_dtype="F32").passed


def test_dtype_flag_takes_the_engines_spelling_too(capsys):
    ckpt = CKPTS["kimi-linear"]
    want = kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=2,
                                       model_dtype="BF16")
    assert want != kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=2,
                                               model_dtype="F32")
    for spelling in ("bfloat16", "BF16", "bf16"):
        status, out, _ = run(capsys, "digests", ckpt, "--engine", "vllm-0.33-kimi-linear",
                             "--tp-size", 2, "--dtype", spelling, "--json")
        assert status == 0 and json.loads(out)["checksums"] == want
    with pytest.raises(SystemExit) as exit_info:
        main(["digests", str(ckpt), "--engine", "vllm-0.33-kimi-linear", "--tp-size", "2",
              "--dtype", "int8"])
    assert exit_info.value.code == 2
    assert "argument --dtype: invalid choice: 'INT8'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------
# refusals found by a hostile tester


def test_an_output_path_in_a_symlink_loop_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "loop").symlink_to("loop")
    ckpt = CKPTS["kimi-linear"]
    for command in (["dump", ckpt, "--engine", "vllm-0.33-kimi-linear"], ["shard", ckpt]):
        status, out, err = run(capsys, *command, "--tp-size", 2, "--out", "loop")
        assert status == 2 and out == "", err
        assert err.startswith("kda-tp: error: OutputError: loop: cannot resolve the output path")
        assert len(err.splitlines()) == 1 and "Traceback" not in err
    status, _, err = run(capsys, "dump", ckpt, "--engine", "vllm-0.33-kimi-linear",
                         "--tp-size", 2, "--out", tmp_path / "loop" / "sub", "--dtype", "F32")
    assert status == 2 and "OutputError" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("command", ["dump", "digests"])
def test_a_layout_of_another_model_family_is_refused(command, tmp_path, capsys):
    out = ["--out", tmp_path / "d"] if command == "dump" else []
    status, _, err = run(capsys, command, CKPTS["kimi-linear"], "--engine", "vllm-0.33-glm-5.3",
                         "--tp-size", 2, *out)
    assert status == 2 and len(err.splitlines()) == 1
    assert err.startswith("kda-tp: error: EngineLayoutError: vllm-0.33-glm-5.3: this layout is "
                          "for glm-5.3, but the checkpoint ")
    assert ("is kimi-linear; layouts that fit it: vllm-0.33-kimi-linear, "
            "sglang-0.5.23-kimi-linear") in err
    status, _, err = run(capsys, command, CKPTS["glm-5.3"], "--engine", "vllm-0.33-kimi-linear",
                         "--tp-size", 2, *out)
    assert status == 2 and "this layout is for kimi-linear" in err and "is glm-5.3" in err
    assert "vllm-0.33-glm-5.3" in err and "sglang-0.5.23-glm-5.3" in err
    assert not (tmp_path / "d").exists() or not any((tmp_path / "d").iterdir())


def test_an_overflowing_dtype_is_refused_naming_the_parameter(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    engine = ("--engine", "vllm-0.33-kimi-linear", "--tp-size", 2, "--dtype", "F16")
    status, out, err = run(capsys, "dump", ckpt, *engine, "--out", tmp_path / "d")
    assert status == 2 and out == "", err
    assert len(err.splitlines()) == 1 and "RuntimeWarning" not in err
    assert err.startswith("kda-tp: error: DtypeMismatchError: rank 0 model.layers.")
    assert ("self_attn.in_proj_qkvgfab.weight: the cast from F32 to F16 overflows: b_proj's "
            "80000.0 (its [0, 0]) becomes inf, as do 384 of its 384 values") in err
    assert not (tmp_path / "d").exists()  # no file, no temporary file, no directory it made
    status, out, err2 = run(capsys, "digests", ckpt, *engine)
    assert status == 2 and out == "" and err2 == err
    # The audit's rule, in its words (one function: cast_overflow).
    with pytest.raises(DtypeMismatchError, match="the cast from F32 to F16 overflows"):
        kda_tp.audit.engine_digests(ckpt, engine="vllm-0.33-kimi-linear", tp_size=1,
                                    model_dtype="F16")


def test_another_world_sizes_files_are_refused_and_force_removes_them(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    engine = ("--engine", "vllm-0.33-kimi-linear")
    assert run(capsys, "dump", ckpt, *engine, "--tp-size", 2, "--out", tmp_path,
               "--dtype", "F32")[0] == 0
    status, _, err = run(capsys, "dump", ckpt, *engine, "--tp-size", 4, "--ranks", "2,3",
                         "--out", tmp_path, "--dtype", "F32")
    assert status == 2 and len(err.splitlines()) == 1
    assert ("model-rank-0-part-0.safetensors: a dump file of tp_size 2 (its metadata), so of "
            "another world size than tp_size 4 (and 1 more); pass --force") in err
    assert run(capsys, "dump", ckpt, *engine, "--tp-size", 4, "--ranks", "2,3", "--out",
               tmp_path, "--force", "--dtype", "F32")[0] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model-rank-2-part-0.safetensors", "model-rank-3-part-0.safetensors"]


def test_force_removes_every_file_of_the_ranks_written(tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear", tp_size=2,
                                   model_dtype="F32")
    stale = ["model-rank-0-part-1.safetensors", "model-pp-0-tp-0-part-0.safetensors",
             "model-pp-1-tp-0-part-3.safetensors"]
    for name in stale:  # an earlier kda-tp dump's (its mark in the header)
        write_safetensors(tmp_path / name, [("old", "U8", (3,), 3, lambda: b"old")],
                          {FILE_MARK: "0.1.0"})
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(OutputError, match="already exists"):
        kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear", tp_size=2,
                                       ranks=[0], model_dtype="F32")
    kda_tp.audit.write_engine_dump(ckpt, tmp_path, engine="vllm-0.33-kimi-linear", tp_size=2,
                                   ranks=[0], force=True, model_dtype="F32")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json", "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    assert audit_path(ckpt, tmp_path, tp_size=2, model_dtype="F32").passed


def test_an_empty_rank_list_or_output_path_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = CKPTS["kimi-linear"]
    engine = ("--engine", "vllm-0.33-kimi-linear", "--tp-size", 2)
    for command in (["dump", ckpt, *engine, "--out", "d"], ["digests", ckpt, *engine]):
        status, out, err = run(capsys, *command, "--ranks", ",")
        assert status == 2 and out == ""
        assert err.startswith("kda-tp: error: PlanError: no ranks to write: --ranks is empty")
    assert not (tmp_path / "d").exists()
    with pytest.raises(SystemExit) as exit_info:
        main(["dump", str(ckpt), *map(str, engine), "--out", ""])
    assert exit_info.value.code == 2
    assert "argument --out: empty path" in capsys.readouterr().err
    with pytest.raises(OutputError, match="an empty path"):
        kda_tp.audit.write_engine_dump(ckpt, "", engine="vllm-0.33-kimi-linear", tp_size=2,
                                       model_dtype="F32")
    # shard's --out too: Path("") is the current directory, where rank0/ would land.
    with pytest.raises(SystemExit) as exit_info:
        main(["shard", str(ckpt), "--tp-size", "2", "--out", ""])
    assert exit_info.value.code == 2
    assert "argument --out: empty path" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["audit", "dump", "digests"])
def test_a_tp_size_hint_names_only_the_commands_flags(command, tmp_path, capsys):
    ckpt = CKPTS["kimi-linear"]
    args = {"audit": [tmp_path], "dump": ["--engine", "vllm-0.33-kimi-linear", "--out", tmp_path],
            "digests": ["--engine", "vllm-0.33-kimi-linear"]}[command]
    status, _, err = run(capsys, command, ckpt, *args, "--tp-size", 5)
    assert status == 2 and err.startswith("kda-tp: error: PlanError: ")
    assert "--qk-multiple" not in err and "qk_multiple" not in err
    assert "1, 2, 3, 4, 6, 12" in err


@pytest.mark.parametrize("engine", ["vllm-0.33-k3", "sglang-0.5.23-k3"])
def test_a_k3_dump_with_no_flag_passes_the_audit_with_no_flag(engine, tmp_path, capsys):
    # K3 stores o_norm in F32 beside BF16 weights (config torch_dtype bfloat16);
    # the engine holds it in its model dtype, BF16: dump, digests and audit agree on that
    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=32, heads=4, head_dim=8,
                                  conv_kernel=4, gate_rank=8, num_layers=1, kda_layers=[0],
                                  style="k3", weight_dtype="BF16")
    assert SafetensorsSource(ckpt).info(
        "language_model.model.layers.0.self_attn.o_norm.weight")[0] == "F32"
    assert run(capsys, "dump", ckpt, "--engine", engine, "--tp-size", 2, "--out",
               tmp_path / "dump")[0] == 0
    rank1 = SafetensorsSource(tmp_path / "dump" / "model-rank-1-part-0.safetensors")
    held = {k.rsplit("self_attn.", 1)[1]: rank1.info(k)[0] for k in rank1.names()}
    assert held["o_norm.weight"] == "BF16" and held["A_log"] == "F32"
    status, out, _ = run(capsys, "audit", ckpt, tmp_path / "dump", "--quiet")
    assert status == 0 and out.startswith("OK: "), out
    # an engine told --dtype float32 holds o_norm in F32: that dump fails the default audit
    assert run(capsys, "dump", ckpt, "--engine", engine, "--tp-size", 2, "--out",
               tmp_path / "f32", "--dtype", "F32")[0] == 0
    status, out, _ = run(capsys, "audit", ckpt, tmp_path / "f32", "--quiet")
    assert status == 1 and "o_norm.weight: dtype F32, expected BF16" in out
    assert run(capsys, "audit", ckpt, tmp_path / "f32", "--quiet", "--dtype", "F32")[0] == 0
