"""`kda-tp digests` equals vLLM 0.33.0's own weight checksums, with no
flag for a checkpoint in the releases' dtypes served in BF16.

vLLM's own layer classes load the fixture checkpoints on CPU through their model class's own
``load_weights`` (the recipe of tests/data/engine_ranks/make/vllm_rank.py: the tensor-parallel
group faked, a stand-in model holding ``model.layers.0.self_attn``), then vLLM's own
``Worker.compute_weight_checksums`` (``compute_tensor_digests`` under the
``dp:pp:pcp:tp`` key prefix of ``Worker._weight_checksum_prefix``) hashes them. Nothing is
post-processed here (``process_weights_after_loading`` is not run), so every KDA parameter's
digest must equal kda-tp's. Each engine run is its own process (the faked group is global).

The F32 fixture checkpoints are loaded into an F32 model (``--dtype float32``, as the
fixtures were made; ``kda-tp digests --dtype F32``); the same checkpoints in the releases'
dtypes (BF16 projections, F32 convs, ``A_log``, ``dt_bias`` and ``o_norm``, config
``torch_dtype: bfloat16``) into a BF16 model, the engine's default, and compared with
``kda-tp digests`` without ``--dtype``: the F32 ``o_norm`` is held (and hashed) in BF16; and
an F64 checkpoint, whose values vLLM's loader (torch) rounds to F32, then to BF16
(``tp_fixtures.f64_near_ties``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kda_tp import SafetensorsSource
from kda_tp.cli import main
from kda_tp.model import parse_config

from paths import ENGINE_RANKS as DATA, TESTS
from tp_fixtures import f64_near_ties, release_dtypes

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")

CASES = {  # kind -> (checkpoint, layout, (tp_size, rank) pairs)
    "k3": (DATA / "ckpt_k3", "vllm-0.33-k3", [(2, 0), (4, 1), (4, 3)]),
    "kimi_linear": (DATA / "ckpt_kl", "vllm-0.33-kimi-linear", [(2, 1), (4, 2)]),
    "glm": (DATA / "ckpt_glm", "vllm-0.33-glm-5.3", [(2, 0), (4, 3)]),
}

# Runs in its own interpreter: argv = kind, checkpoint, geometry JSON, "T:R,T:R,...", tests/,
# the model dtype (torch's name).
ENGINE = r"""
import json, os, sys, types
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
import torch
from safetensors.torch import load_file
import vllm.distributed.parallel_state as ps
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.v1.worker import gpu_worker

kind, ckpt, geometry, runs = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
sys.path.insert(0, sys.argv[5])
dtype = getattr(torch, sys.argv[6])
torch.set_default_dtype(dtype)  # vLLM builds a model's parameters in its model dtype
from vllm_layers import fake_group, kda_classes, stand_in
H, D, K, hidden = geometry["heads"], geometry["head_dim"], geometry["kernel"], geometry["hidden"]
weights = [(n.replace("model.", "", 1), w)
           for n, w in load_file(os.path.join(ckpt, "model.safetensors")).items()]
result = {}
for run in runs.split(","):
    T, R = map(int, run.split(":"))
    group = fake_group(T, R)
    ps._TP = group
    vc = VllmConfig()
    vc.model_config = types.SimpleNamespace(dtype=dtype, hf_config=None)
    with set_current_vllm_config(vc):
        cfg, Layer, Model = kda_classes(kind, heads=H, head_dim=D, kernel=K, hidden=hidden)
        layer = Layer(cfg, vc, prefix="model.layers.0.self_attn")
        stack = stand_in(cfg, layer)  # the decoder model, holding only layer 0's attention
        Model.load_weights(stack, iter(weights))
    top = torch.nn.Module()  # ...ForCausalLM: its decoder model is `model`
    top.model = stack
    # vLLM's own worker method and key prefix, on a worker holding just this model.
    for name in ("get_pp_group", "get_pcp_group"):
        setattr(gpu_worker, name, lambda: types.SimpleNamespace(rank_in_group=0))
    gpu_worker.get_tp_group = lambda: group
    worker = types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(data_parallel_index=0),
        model_runner=types.SimpleNamespace(get_model=lambda: top))
    worker._weight_checksum_prefix = lambda: gpu_worker.Worker._weight_checksum_prefix(worker)
    result[run] = gpu_worker.Worker.compute_weight_checksums(worker)
print("DIGESTS " + json.dumps(result))
"""


def vllm_checksums(kind: str, ckpt: Path, dtype: str = "float32") -> dict[str, dict[str, str]]:
    """``{"T:R": vLLM's checksums of that rank}`` for the kind's runs, vLLM's model in
    ``dtype``."""
    _, _, runs = CASES[kind]
    kda = parse_config(SafetensorsSource(ckpt).config)
    geometry = {"heads": kda.heads, "head_dim": kda.head_dim, "kernel": kda.conv_kernel,
                "hidden": kda.hidden}
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE, kind, str(ckpt), json.dumps(geometry),
         ",".join(f"{t}:{r}" for t, r in runs), str(TESTS), dtype],
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    (line,) = [x for x in proc.stdout.splitlines() if x.startswith("DIGESTS ")]
    digests: dict[str, dict[str, str]] = json.loads(line.removeprefix("DIGESTS "))
    return digests


def digests(capsys, ckpt: Path, layout: str, tp_size: int, rank: int, *flags: str
            ) -> dict[str, str]:
    assert main(["digests", str(ckpt), "--engine", layout, "--tp-size", str(tp_size),
                 "--ranks", str(rank), "--json", *flags]) == 0
    found: dict[str, str] = json.loads(capsys.readouterr().out)["checksums"]
    return found


@pytest.mark.parametrize("kind", sorted(CASES))
def test_digests_equal_vllms_own_weight_checksums(kind, capsys):
    ckpt, layout, runs = CASES[kind]
    engine = vllm_checksums(kind, ckpt)
    for tp_size, rank in runs:
        ours = digests(capsys, ckpt, layout, tp_size, rank, "--dtype", "F32")
        theirs = engine[f"{tp_size}:{rank}"]
        # The same keys (every parameter vLLM's layer has is a KDA parameter of the layout;
        # K3's decode copies are buffers, which vLLM does not hash) and the same digests.
        assert sorted(ours) == sorted(theirs) and len(ours) >= 7
        assert all(k.startswith(f"dp0:pp0:pcp0:tp{rank}:model.layers.0.self_attn.") for k in ours)
        assert ours == theirs


@pytest.mark.parametrize("stored", [release_dtypes, f64_near_ties], ids=["release", "f64"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_a_release_dtype_checkpoint_in_a_bf16_engine_needs_no_flag(kind, stored, tmp_path,
                                                                    capsys):
    # The engine's model dtype (BF16, the config's) is kda-tp's default, so
    # `kda-tp digests` without --dtype equals what a correct engine holds, o_norm included; an
    # F64 checkpoint's values are rounded to F32, then to BF16, as vLLM's loader (torch) does
    ckpt = stored(CASES[kind][0], tmp_path / "ckpt")
    _, layout, runs = CASES[kind]
    engine = vllm_checksums(kind, ckpt, "bfloat16")
    for tp_size, rank in runs:
        ours = digests(capsys, ckpt, layout, tp_size, rank)
        assert ours == engine[f"{tp_size}:{rank}"] and len(ours) >= 7
        # and not what the checkpoint's own dtypes would give (the F32 o_norm)
        assert digests(capsys, ckpt, layout, tp_size, rank, "--dtype", "F32") != ours

