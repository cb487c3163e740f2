"""kda_tp.torch in one process: Tensor.to_torch against real torch, load_rank, placement; and
``import kda_tp`` without torch (these last tests run in every venv, with torch hidden)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tp_fixtures

import kda_tp
from kda_tp import KdaShard, KdaShardedSource, KdaTpPlan, SafetensorsSource, oracle
from kda_tp.rank import MlaTpPlan
from kda_tp.rank.mla import rank_mla_plan

from mappings import in_file_copy_on_write

SMALL = tp_fixtures.DATA / "kda_small"


def _run_without_torch(code: str) -> str:
    """Run ``code`` in a fresh interpreter where ``import torch`` fails; return its stdout."""
    prelude = "import sys; sys.modules['torch'] = None\n"
    done = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_kda_tp_never_imports_torch():
    code = """
    import sys
    sys.modules.pop('torch')
    import kda_tp, kda_tp.cli, kda_tp.shard, kda_tp.reference, kda_tp.reference.equivalence
    print('torch' in sys.modules)
    """
    assert _run_without_torch(code).strip() == "False"


def test_missing_torch_names_the_extra():
    code = f"""
    import kda_tp
    from kda_tp.errors import MissingDependencyError
    tensor = kda_tp.SafetensorsSource({str(SMALL)!r}).get('model.norm.weight')
    for attempt in (tensor.to_torch, lambda: __import__('kda_tp.torch')):
        try:
            attempt()
        except MissingDependencyError as e:
            assert isinstance(e, ImportError) and isinstance(e, kda_tp.KdaTpError)
            print(e)
    """
    lines = _run_without_torch(code).splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "pip install 'kda_tp[torch]'" in line


torch = pytest.importorskip("torch")
kt = pytest.importorskip("kda_tp.torch")


@pytest.fixture(scope="module")
def dtype_file(tmp_path_factory):
    """A safetensors file written by torch (safetensors.torch) with BF16, F16, F32, both F8
    dtypes and an empty tensor, and the tensors written."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 10, generator=g) * 3
    tensors = {
        "bf16": base.to(torch.bfloat16),
        "f16": base.to(torch.float16),
        "f32": base,
        "f8_e4m3": base.to(torch.float8_e4m3fn),
        "f8_e5m2": base.to(torch.float8_e5m2),
        "conv": base.reshape(6, 1, 10).to(torch.bfloat16),
        "empty": torch.empty(0, 4, dtype=torch.bfloat16),
    }
    path = tmp_path_factory.mktemp("dtypes") / "t.safetensors"
    save_file(tensors, str(path))
    return path, tensors


@pytest.mark.parametrize("name,st_dtype", [
    ("bf16", "BF16"), ("f16", "F16"), ("f32", "F32"), ("f8_e4m3", "F8_E4M3"),
    ("f8_e5m2", "F8_E5M2"), ("conv", "BF16"), ("empty", "BF16"),
])
def test_to_torch_matches_torch_bit_for_bit_without_a_copy(dtype_file, name, st_dtype):
    path, tensors = dtype_file
    source = SafetensorsSource(path)
    record = source.get(name)
    assert record.dtype == st_dtype
    got = record.to_torch()
    want = tensors[name]
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    if want.numel():
        assert in_file_copy_on_write(got.data_ptr(), path), "a view of the file, not a copy"


def test_torch_dtype_refuses_what_torch_lacks():
    assert kt.torch_dtype("F8_E4M3") is torch.float8_e4m3fn
    with pytest.raises(kda_tp.DtypeMismatchError, match="F4 has no torch equivalent"):
        kt.torch_dtype("F4")


@pytest.mark.parametrize("fixture", tp_fixtures.FIXTURES.values(), ids=lambda f: f.name)
def test_load_rank_on_cpu_equals_the_adapter_and_views_the_mapping(fixture, tmp_path_factory):
    path = tp_fixtures.checkpoint(fixture, tmp_path_factory.getbasetemp())
    tp_size = fixture.tp_sizes[-1]
    source = SafetensorsSource(path)
    for rank in (0, tp_size - 1):
        loaded = kt.load_rank(source, rank, tp_size, qk_multiple=fixture.qk_multiple)
        plan = KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=fixture.qk_multiple)
        # A hybrid's MLA layers are sliced too where they can be planned, as shard slices them.
        mla = rank_mla_plan(kda_tp.describe(source), rank, tp_size)[0]
        shard = KdaShardedSource(source, plan, mla=mla)
        assert list(loaded) == source.names()
        for name, tensor in loaded.items():
            want = shard[name]
            assert tuple(tensor.shape) == want.shape
            assert tensor.dtype == kt.torch_dtype(want.dtype)
            assert np.array_equal(tensor.view(torch.uint8).reshape(-1).numpy(), want.data)
            in_map = in_file_copy_on_write(tensor.data_ptr(), path)
            entry = shard.plan_entry(name)  # o_proj and its scale grid: column gathers
            is_cols = entry is not None and entry.kind == KdaShard.CHANNEL_COLS
            assert in_map != is_cols, f"{name}: zero copy unless o_proj's column gather"
        kda = kt.load_rank(source, rank, tp_size, include_non_kda=False,
                           qk_multiple=fixture.qk_multiple)
        assert list(kda) == [n for n in source.names() if shard.is_sharded(n)]


@pytest.mark.parametrize("style", ["kimi", "k3", "glm"])
def test_load_rank_slices_the_mla_layers_as_the_oracle(style, tmp_path):
    import json

    from kda_tp.synth import write_small_checkpoint

    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=64, heads=4, head_dim=64,
                                  conv_kernel=4, gate_rank=16, num_layers=3, kda_layers=[0, 2],
                                  style=style, seed=5)
    full = SafetensorsSource(ckpt)
    geometry = oracle.read_mla_geometry(json.loads((ckpt / "config.json").read_text()))
    mla_names = [n for n in full.names() if ".layers.1.self_attn." in n]
    for rank in range(2):
        loaded = kt.load_rank(ckpt, rank, 2)
        plan = oracle.mla_plan(rank, 2, **geometry)
        for name in mla_names:
            entry = plan.get(oracle.plan_name(name.split(".self_attn.", 1)[1]))
            want = oracle.shard_bytes(entry, bytes(full.get(name)))
            got = loaded[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            assert got == want, name
            assert tuple(loaded[name].shape) == oracle.local_shape(entry, full.get(name).shape)
        sliced = kt.load_rank(ckpt, rank, 2, include_non_kda=False)
        assert set(mla_names) <= set(sliced)


def test_load_rank_slices_block_fp8_mla_weights_with_their_scale_grids(tmp_path):
    """K3-style FP8 MLA (ModelOpt FP8_PB_WO): each rank's weights and scale grids are the
    oracle's slices (spec ``mla.md`` section 5), FP8 as torch's float8_e4m3fn, and each
    grid's DTensor placement is its weight's (on the grid's own axis)."""
    import json

    from torch.distributed.tensor import Replicate, Shard

    from kda_tp.synth import write_small_checkpoint

    ckpt = write_small_checkpoint(tmp_path / "ckpt", hidden=256, heads=8, head_dim=128,
                                  conv_kernel=4, gate_rank=128, num_layers=2, kda_layers=[0],
                                  style="k3", fp8=True, seed=5)
    full = SafetensorsSource(ckpt)
    geometry = oracle.read_mla_geometry(json.loads((ckpt / "config.json").read_text()))
    mla_names = [n for n in full.names() if ".layers.1.self_attn." in n]
    for rank in range(2):
        loaded = kt.load_rank(ckpt, rank, 2, include_non_kda=False)
        plan = oracle.mla_plan(rank, 2, **geometry, quant_block=(128, 128))
        for name in mla_names:
            suffix = name.split(".self_attn.", 1)[1].replace(".weight_scale", ".scale")
            entry = plan.get(oracle.plan_name(suffix))
            want = oracle.shard_bytes(entry, bytes(full.get(name)))
            got = loaded[name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
            assert got == want, name
            assert tuple(loaded[name].shape) == oracle.local_shape(entry, full.get(name).shape)
            if name.endswith("_proj.weight") or name.endswith("_mqa.weight"):
                assert loaded[name].dtype == torch.float8_e4m3fn, name
    mla = rank_mla_plan(kda_tp.describe(full), 1, 2)[0]
    assert mla is not None
    placed = {t.scale.name: kt.placement(t.scale) for t in mla.tensors if t.scale is not None}
    assert placed == {"q_a_proj.scale": Replicate(), "q_b_proj.scale": Shard(0),
                      "kv_a_proj_with_mqa.scale": Replicate(), "kv_b_proj.scale": Shard(0),
                      "g_proj.scale": Shard(0), "o_proj.scale": Shard(2)}


def test_placement_of_the_mla_tensors():
    from torch.distributed.tensor import Replicate, Shard

    # K3's MLA layer: q-LoRA, the output gate.
    plan = MlaTpPlan(1, 2, 64, 4, 32, 16, 8, 64, q_lora_rank=48, output_gate=True)
    want = {"q_a_proj": Replicate(), "q_a_layernorm": Replicate(), "q_b_proj": Shard(0),
            "kv_a_proj_with_mqa": Replicate(), "kv_a_layernorm": Replicate(),
            "kv_b_proj": Shard(0), "g_proj": Shard(0), "o_proj": Shard(1)}
    assert {t.name: kt.placement(t) for t in plan.tensors} == want


def test_load_rank_needs_a_rank_or_a_process_group():
    assert not torch.distributed.is_initialized()
    with pytest.raises(kda_tp.PlanError, match="no torch.distributed process group"):
        kt.load_rank(SMALL, tp_rank=0)


def test_placement_follows_the_plan_on_disk_axes():
    from torch.distributed.tensor import Replicate, Shard

    plan = KdaTpPlan(0, 2, 256, 64, 4, 4, 64)
    for entry in plan.tensors:
        got = kt.placement(entry)
        if entry.kind == KdaShard.REPLICATED:
            assert got == Replicate(), entry.name
        elif entry.kind == KdaShard.CHANNEL_COLS:
            assert got == Shard(len(entry.disk_shape) - 1), entry.name
        else:
            assert got == Shard(entry.disk_shape.index(entry.full_rows)), entry.name
    assert kt.placement(plan["A_log"]) == Shard(2)
    assert kt.placement(plan["A_log"], [4]) == Shard(0)
    assert kt.placement(plan["o_proj"]) == Shard(1)
    assert kt.placement(plan["q_conv1d"], [256, 4]) == Shard(0)
    with pytest.raises(kda_tp.ShapeMismatchError):
        kt.placement(plan["q_proj"], [256, 255])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_rank_to_cuda_equals_the_cpu_load():
    cpu = kt.load_rank(SMALL, 1, 2)
    gpu = kt.load_rank(SMALL, 1, 2, device="cuda")
    assert list(gpu) == list(cpu)
    for name, tensor in gpu.items():
        assert tensor.device.type == "cuda"
        assert torch.equal(tensor.cpu().view(torch.uint8), cpu[name].view(torch.uint8)), name


def test_device_copy_path_in_buffer_sized_chunks(monkeypatch):
    """The staging logic of a device load (run on CPU: plain host buffers, synchronous
    copies): tensors smaller and larger than the buffers arrive intact."""
    monkeypatch.setattr(kt, "PINNED_CHUNK_BYTES", 1000)
    source = SafetensorsSource(SMALL)
    shard = KdaShardedSource(source, KdaTpPlan.from_config(source, 1, 2))
    names = source.names()
    got = kt._load_to_device(shard, names, torch.device("cpu"))
    want = kt.load_rank(source, 1, 2)
    sizes = [t.numel() * t.element_size() for t in want.values()]
    assert min(sizes) < 1000 < max(sizes)
    for name in names:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape
        assert torch.equal(got[name].view(torch.uint8), want[name].view(torch.uint8)), name
