"""The audit's model dtype is the engine's, through vLLM 0.33.0's and SGLang 0.5.23's
own KDA layer classes and model ``load_weights`` on CPU.

The engine fixture checkpoints in the releases' dtypes (BF16 projections; F32 convs, ``A_log``,
``dt_bias`` and ``o_norm``; config ``torch_dtype: bfloat16``: ``tp_fixtures.release_dtypes``)
are loaded into a BF16 model, each engine's default for that config, as the fixtures' recipe
does (tests/data/engine_ranks/make: the tensor-parallel rank faked, a stand-in model holding
``model.layers.0.self_attn``). What each engine then holds passes ``kda_tp.audit`` with no
``model_dtype``, equals ``kda-tp dump`` with no ``--dtype`` byte for byte (K3's F32 ``o_norm``
is held in BF16), and fails when the engine is said to run in F32. Each engine run is its own
process (the faked group is global).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import kda_tp
from paths import TESTS
from tp_fixtures import CKPT, release_dtypes

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")
pytest.importorskip("sglang")

# vLLM's layouts and SGLang's, per family.
LAYOUTS = {("vllm", "k3"): "vllm-0.33-k3", ("vllm", "kimi_linear"): "vllm-0.33-kimi-linear",
           ("vllm", "glm"): "vllm-0.33-glm-5.3", ("sglang", "k3"): "sglang-0.5.23-k3",
           ("sglang", "kimi_linear"): "sglang-0.5.23-kimi-linear",
           ("sglang", "glm"): "sglang-0.5.23-glm-5.3"}
T, R = 4, 1
H, D, HIDDEN, K = 12, 128, 64, 4  # the fixture checkpoints' geometry

# Runs in its own interpreter: argv = engine, kind, checkpoint, T, R, tests/, output file.
# Saves what the engine's layer holds after its model's load_weights, in a BF16 model.
LOAD = r"""
import os, sys, types, warnings
warnings.simplefilter("ignore")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
from safetensors.torch import load_file, save_file

engine, kind, ckpt, T, R, tests, out = sys.argv[1:]
T, R = int(T), int(R)
sys.path.insert(0, tests)
H, D, HIDDEN, K = 12, 128, 64, 4
PREFIX = "model.layers.0.self_attn"
weights = load_file(os.path.join(ckpt, "model.safetensors"))
torch.set_default_dtype(torch.bfloat16)  # the engines build a model in its model dtype
if engine == "vllm":
    import vllm.distributed.parallel_state as ps
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm_layers import fake_group, kda_classes, stand_in

    ps._TP = fake_group(T, R)
    vc = VllmConfig()
    vc.model_config = types.SimpleNamespace(dtype=torch.bfloat16, hf_config=None)
    with set_current_vllm_config(vc):
        cfg, Layer, Model = kda_classes(kind, heads=H, head_dim=D, kernel=K, hidden=HIDDEN)
        layer = Layer(cfg, vc, prefix=PREFIX)
        Model.load_weights(stand_in(cfg, layer),
                           iter([(n.replace("model.", "", 1), w) for n, w in weights.items()]))
else:
    from sglang.srt.runtime_context import get_parallel

    from sglang_layers import kda_classes, stand_in

    extra = {"enable_cp_tp_group_sharing": False} if kind == "glm" else {}
    with get_parallel().override(tp_size=T, tp_rank=R, attn_tp_size=T, attn_tp_rank=R, **extra):
        cfg, Layer, Model = kda_classes(kind, heads=H, head_dim=D, kernel=K, hidden=HIDDEN)
        layer = Layer(layer_idx=0, hidden_size=HIDDEN, config=cfg, quant_config=None,
                      prefix=PREFIX)
        Model.load_weights(stand_in(cfg, layer), iter(weights.items()))
save_file({f"{PREFIX}.{n}": p.data.contiguous() for n, p in layer.named_parameters()}, out,
          metadata={"tp_size": str(T), "tp_rank": str(R)})
"""


@pytest.mark.parametrize(("engine", "kind"), sorted(LAYOUTS), ids=lambda x: str(x))
def test_a_release_dtype_checkpoint_in_a_bf16_engine_passes_with_no_dtype(engine, kind,
                                                                          tmp_path):
    import torch
    from safetensors.torch import load_file

    from kda_tp.audit import audit_path

    ckpt = release_dtypes(CKPT[kind], tmp_path / "ckpt")
    held_file = tmp_path / f"model-rank-{R}-part-0.safetensors"
    proc = subprocess.run([sys.executable, "-c", LOAD, engine, kind, str(ckpt), str(T), str(R),
                           str(TESTS), str(held_file)],
                          capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    held = load_file(str(held_file))
    report = kda_tp.audit.audit(held, ckpt, tp_rank=R, tp_size=T)
    assert report.passed and report.engine == LAYOUTS[engine, kind], report.format()
    assert audit_path(ckpt, held_file).passed  # world size and rank from its metadata
    # the default dump holds the same bytes (o_norm: F32 on disk, BF16 in the engine)
    dump = kda_tp.audit.write_engine_dump(ckpt, tmp_path / "dump", engine=LAYOUTS[engine, kind],
                                          tp_size=T, ranks=[R])
    expected = load_file(str(dump.files[0]))
    assert sorted(expected) == sorted(held)
    for name, tensor in held.items():
        assert expected[name].dtype == tensor.dtype and torch.equal(expected[name], tensor), name
    o_norm = next(n for n in held if n.endswith("o_norm.weight"))
    assert str(held[o_norm].dtype) == "torch.bfloat16"
    # said to run in F32, the engine would hold F32 projections: this one does not
    failures = kda_tp.audit.audit(held, ckpt, tp_rank=R, tp_size=T, model_dtype="F32").failures
    assert failures and all(p.problem.startswith("dtype BF16, expected F32") for p in failures)
