"""An independent, standard-library-only oracle for the KDA tensor-parallel shard plan.

This package restates the shard plan of one KDA (Kimi Delta Attention) block from the written
spec (``tests/data/spec/tp.rs.txt`` for the plan, ``tests/data/spec/tp_bind.rs.txt`` for
applying it), without calling the Rust core, so the two can be compared. It also carries a verifier
that checks a sharded checkpoint directory against its source checkpoint, usable in a user's own CI
with nothing but a Python interpreter:

```sh
python -m kda_tp.oracle verify CHECKPOINT OUT
```

The plan, in short: rank ``r`` of ``tp_size`` owns the contiguous head range
``[r * H/T, (r+1) * H/T)``. Channel ``c = h * head_dim + d``, so that head range is the
contiguous channel range ``[r * C/T, (r+1) * C/T)`` with ``C = heads * head_dim``.

* column-parallel by output channel (rows of the on-disk ``[out, in]`` tensor):
  ``q/k/v_proj``, ``q/k/v_conv1d``, ``f_b_proj``, ``g_b_proj``, ``dt_bias``;
* by head: ``b_proj``, ``A_log``;
* replicated: ``f_a_proj``, ``g_a_proj`` (low-rank down-projections) and ``o_norm``
  (``[head_dim]``, shared by every head);
* row-parallel: ``o_proj`` ``[hidden, C]``, sliced on its input (last) axis; every rank's output
  is a partial sum, and one all-reduce follows it when ``tp_size > 1``.

Kimi K3 (docs/models.md, "Kimi K3") changes two things. Its output gate is one full-rank
``g_proj`` ``[C, hidden]``, column-parallel like ``q_proj``, in place of ``g_a_proj`` and
``g_b_proj`` (14 tensors). Its ``A_log`` is stored 1-D with more entries than heads (128 for 96),
the first ``H`` the heads and the rest zero: rank ``r`` keeps entries ``[r * H/T, (r+1) * H/T)``
of it, never an even split of the stored length, and the padding must be zero.

Block-quantized FP8 projections (docs/quantized.md) carry a scale grid of
``ceil(out/bo) x ceil(in/bi)`` (ModelOpt stores it ``[ob, 1, ib, 1]``). A rank whose weight range
on the sharded axis is ``[a, e)`` keeps grid rows (columns for ``o_proj``) ``[a // b, ceil(e / b))``
and a replicated weight keeps the whole grid. That only dequantizes if every rank's range starts
on a block boundary or stays inside one block; otherwise the plan is refused.

The MLA layers beside the KDA layers of the hybrids (spec ``tests/data/spec/mla.md``) have
their own plan, :func:`mla_plan`, in the same vocabulary: rank ``r`` keeps its heads' rows of
``q_proj``/``q_b_proj``, ``kv_b_proj`` and K3's output gate ``g_proj`` (CHANNEL_ROWS, one head
being ``P+Pr``, ``P+V`` or ``V`` rows), its heads' columns of ``o_proj`` (CHANNEL_COLS), and the
whole of the latent projections ``q_a_proj``/``kv_a_proj_with_mqa``, their norms and GLM-5.3's
DSA ``indexer.*`` (REPLICATED). The head count is ``num_attention_heads``.

Sizes are in elements unless a name says bytes.

Its private modules, each importing only the ones before it (and ``kda_tp.errors``):
``_shard_plan`` (the plan, spec ``tp.rs.txt``), ``_mla_plan`` (an MLA layer's plan, spec
``mla.md``), ``_bind`` (a rank's bytes, shapes and plan
names, spec ``tp_bind.rs.txt``), ``_config`` (its own reading of ``config.json``),
``_checkpoint`` (safetensors headers and raw bytes), ``_verifier`` (a sharded directory against
its source) and ``_cli``. The names below are its API, importable from ``kda_tp.oracle``.
"""

from __future__ import annotations

from ._bind import local_shape, plan_name, shard_bytes
from ._cli import main
from ._config import KdaConfig, read_kda_config
from ._mla_plan import INDEXER_TENSOR_NAMES, OracleMlaPlan, mla_plan, read_mla_geometry
from ._shard_plan import (
    ELEM_BYTES,
    FP8_ELEM_BYTES,
    FULL_RANK_GATE_TENSOR_NAMES,
    MAX_BYTES,
    TENSOR_NAMES,
    OraclePlan,
    OracleTensor,
    plan,
)
from ._verifier import verify

__all__ = [
    "TENSOR_NAMES",
    "FULL_RANK_GATE_TENSOR_NAMES",
    "ELEM_BYTES",
    "FP8_ELEM_BYTES",
    "MAX_BYTES",
    "OracleTensor",
    "OraclePlan",
    "KdaConfig",
    "plan",
    "INDEXER_TENSOR_NAMES",
    "OracleMlaPlan",
    "mla_plan",
    "read_mla_geometry",
    "shard_bytes",
    "local_shape",
    "plan_name",
    "read_kda_config",
    "verify",
    "main",
]
