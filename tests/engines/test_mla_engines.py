"""The MLA tables of the engine layouts (``EngineLayout.mla``, ``MLA_DERIVED``) against what
vLLM 0.33.0's and SGLang 0.5.23's own MLA classes hold after their models' ``load_weights``
on CPU, for Kimi K3, Kimi-Linear and GLM-5.3-Flash at TP 1, 2 and 4 (every rank).

A consistent hybrid of each family (``kda_tp.synth``: layer 0 KDA, layer 1 MLA, 4 MLA heads, so
TP 4 keeps one head a rank; each row of a tensor distinct) is loaded by the engine
(tests/mla_engine_child.py, one process per engine and family). Every parameter the engine's
MLA layer holds is in the table with its name, shape and dtype, and its bytes are what
``build_mla_param`` places from the rank's view (each part in its region: a part loaded into
another's rows, or another rank's slice, would differ); the derived copies (vLLM's
``W_UK_T``/``W_UV`` after ``process_weights_after_loading``, SGLang's ``w_kc``/``w_vc`` after
``post_load_weights``) equal the table's derivation of the local ``kv_b_proj``; vLLM's own
weight checksums of the layer after post-processing are what ``kda-tp digests`` says.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kda_tp
from kda_tp.audit import engine_digests
from kda_tp.engines import LAYOUTS
from kda_tp.engines.build import build_mla_param
from kda_tp.engines.derived import MLA_DERIVED
from kda_tp.synth import write_small_checkpoint
from paths import TESTS

pytestmark = pytest.mark.engines
pytest.importorskip("vllm")
pytest.importorskip("sglang")

STYLES = {"k3": "k3", "kimi_linear": "kimi", "glm": "glm"}
LAYOUT = {("vllm", "k3"): "vllm-0.33-k3", ("vllm", "kimi_linear"): "vllm-0.33-kimi-linear",
          ("vllm", "glm"): "vllm-0.33-glm-5.3", ("sglang", "k3"): "sglang-0.5.23-k3",
          ("sglang", "kimi_linear"): "sglang-0.5.23-kimi-linear",
          ("sglang", "glm"): "sglang-0.5.23-glm-5.3"}
MLA_LAYER = 1
SIZES = (1, 2, 4)


def hybrid(root: Path, kind: str) -> Path:
    """A two-layer hybrid of ``kind``: KDA layer 0, MLA layer 1 (4 heads, bf16)."""
    return write_small_checkpoint(root / kind, 64, 4, 16, 4, 16, 2, [0], style=STYLES[kind])


@pytest.mark.parametrize(("engine", "kind"), sorted(LAYOUT), ids=lambda x: str(x))
def test_the_mla_table_is_what_the_engine_loads(engine, kind, tmp_path):
    import torch
    from safetensors.torch import load_file

    ckpt = hybrid(tmp_path, kind)
    out = tmp_path / "held"
    out.mkdir()
    proc = subprocess.run(
        [sys.executable, str(TESTS / "mla_engine_child.py"), engine, kind, str(ckpt),
         str(MLA_LAYER), str(out), ",".join(map(str, SIZES))],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    layout = LAYOUTS[LAYOUT[engine, kind]]
    derived = MLA_DERIVED[layout.name]
    for t in SIZES:
        for r in range(t):
            engine_held = load_file(str(out / f"tp{t}_r{r}.safetensors"))
            view = kda_tp.open_rank(ckpt, tp_rank=r, tp_size=t, qk_multiple=1, mla=True)
            assert view.mla_layers == (MLA_LAYER,)
            params = {p.suffix for p in layout.mla_params_for(view.mla)}
            loaded = {n for n in engine_held if not n.startswith("derived.")}
            assert loaded == params, (t, r)
            built = {}
            for suffix in sorted(params):
                want = engine_held[suffix]
                got = torch.from_numpy(
                    build_mla_param(view, layout, suffix, MLA_LAYER, model_dtype="BF16")
                    .view(np.uint16).copy()).view(torch.bfloat16)
                assert tuple(got.shape) == tuple(want.shape), (t, r, suffix)
                assert want.dtype == torch.bfloat16, (t, r, suffix)
                assert torch.equal(got, want), (t, r, suffix)
                built[suffix] = got
            assert {f"derived.{n}" for n in derived} == set(engine_held) - loaded, (t, r)
            kv_b = built["kv_b_proj.weight"].float().numpy()
            for name, copy in derived.items():
                want = engine_held[f"derived.{name}"].float().numpy()
                got = copy.derive(kv_b, view.mla)
                assert got.shape == want.shape and np.array_equal(got, want), (t, r, name)
            if engine == "vllm":  # kda-tp digests = vLLM's own checksums, W_UK_T/W_UV included
                checksums = json.loads((out / f"tp{t}_r{r}.json").read_text())
                base = f"{layout.state_dict_prefix(view.prefix)}{MLA_LAYER}.self_attn."
                digests = engine_digests(ckpt, engine=layout.name, tp_size=t, ranks=[r])
                assert {k.split(base, 1)[1]: v for k, v in digests.items() if base in k} == (
                    checksums), (t, r)
