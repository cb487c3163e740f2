"""Helpers of the engine-audit tests (tests/audit/): the engine_ranks fixture dumps,
`kda-tp audit` in this process, a rank's parameters built with the engines' build API, an edited
dump audited, and a save_sharded_state directory made from a fixture dump."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

import kda_tp
from kda_tp import KdaShardedSource, KdaTpPlan, SafetensorsSource
from kda_tp.cli import main
from kda_tp.engines import build_param, get_layout

from paths import ENGINE_RANKS as DATA
from tp_fixtures import CKPT, PRE, load  # the engine_ranks fixtures


def fixture(stem: str) -> tuple[dict[str, str], dict[str, np.ndarray], Path]:
    """The engine_ranks dump ``stem``: its metadata, its tensors, and its checkpoint's folder."""
    meta, tensors = load(DATA / f"{stem}.safetensors")
    return meta, tensors, CKPT[meta["model"]]


def run(capsys, *args: object) -> tuple[int, str, str]:
    """``kda-tp ARGS`` in this process: exit status, stdout, stderr."""
    status = main([str(a) for a in args])
    out = capsys.readouterr()
    return status, out.out, out.err


def rank_params(checkpoint: Path, layout: str, rank: int, tp_size: int,
                prefix: str = PRE) -> dict[str, np.ndarray]:
    """Every KDA parameter of layer 0 of ``rank`` as ``layout`` holds it, built by the engines'
    build API (what the engine's loader leaves in them)."""
    source = SafetensorsSource(checkpoint)
    shard = KdaShardedSource(source, KdaTpPlan.from_config(source, rank, tp_size, qk_multiple=1))
    lay = get_layout(layout)
    return {prefix + p.suffix: build_param(shard, lay, p.suffix, 0)
            for p in lay.params_for(shard.plan)}


def audit_file(tmp_path, capsys, stem: str, tensors: dict[str, np.ndarray], *extra: object
               ) -> tuple[int, str, dict]:
    """Save an edited dump as rank file and run `kda-tp audit` on it (text, then --json)."""
    meta, _, ckpt = fixture(stem)
    path = tmp_path / f"model-rank-{meta['tp_rank']}-part-0.safetensors"
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, path)
    status, out, _ = run(capsys, "audit", ckpt, path, "--tp-size", meta["tp_size"], *extra,
                         "--dtype", "F32")
    json_status, json_out, _ = run(capsys, "audit", ckpt, path, "--tp-size", meta["tp_size"],
                                   "--json", "--quiet", "--dtype", "F32")
    assert json_status == status
    return status, out, json.loads(json_out)


def only_failure(document: dict) -> dict:
    """The one parameter of an audit's JSON document that is not exact."""
    [failure] = [p for p in document["params"] if p["status"] != "exact"]
    return failure

def sharded_state(tmp_path: Path, stem: str, pattern: str = "model-rank-{r}-part-{p}",
                  parts: int = 1) -> tuple[Path, Path, int]:
    """A save_sharded_state directory: the fixture's rank as the engine loaded it, the other
    ranks built with the engines' build API, each rank split into ``parts`` files."""
    meta, tensors, ckpt = fixture(stem)
    tp_size, layout = int(meta["tp_size"]), kda_tp.audit.audit(
        tensors, ckpt, tp_rank=int(meta["tp_rank"]), tp_size=int(meta["tp_size"]),
        model_dtype="F32").engine
    out = tmp_path / "dump"
    out.mkdir()
    (out / "config.json").write_text((ckpt / "config.json").read_text())
    for r in range(tp_size):
        state = tensors if r == int(meta["tp_rank"]) else rank_params(ckpt, layout, r, tp_size)
        state = {**state, "model.embed_tokens.weight": np.zeros((16, 64), np.float32)}
        names = sorted(state)
        for p in range(parts):
            chunk = {n: np.ascontiguousarray(state[n]) for n in names[p::parts]}
            save_file(chunk, out / (pattern.format(r=r, p=p) + ".safetensors"))
    return out, ckpt, tp_size
