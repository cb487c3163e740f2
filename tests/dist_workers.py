"""Worker functions of test_distributed.py, run in spawned gloo processes (importable by name)."""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist

from kda_tp import KdaTpPlan, SafetensorsSource
from kda_tp.model import dequantize
from kda_tp.model import parse_config
from kda_tp.reference import kda_layer_forward
from kda_tp.checkpoint import describe, kda_tensor_name


def _layer(weights, prefix, layer, plan):
    """Plan name -> float32 numpy array of one KDA layer's tensors in ``weights`` (torch tensors
    or kda_tp Tensors), FP8 block-quantized weights dequantized with their scale grids."""

    def array(name):
        tensor = weights[name]
        return tensor.float().numpy() if hasattr(tensor, "float") else tensor.array

    out = {}
    for entry in plan.tensors:
        name = kda_tensor_name(prefix, layer, entry.name)
        out[entry.name] = array(name)
        if entry.scale is not None:
            scale = next(f"{name}_{s}" for s in ("scale", "scale_inv") if f"{name}_{s}" in weights)
            out[entry.name] = dequantize(out[entry.name], array(scale), entry.block)
    return out


def load_rank_allreduce_and_dtensors(rank, world, store, checkpoint, qk_multiple):
    """load_rank + reference forward + all_reduce == the full output; load_dtensors rejoins."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    import kda_tp.torch as kt
    from kda_tp.shard.distributed import check_tp_equivalence_distributed

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        source = SafetensorsSource(checkpoint)
        config = parse_config(source.config)
        eps, bound = config.rms_norm_eps, config.gate_lower_bound
        local_plan = KdaTpPlan.from_config(source, rank, world, qk_multiple=qk_multiple)
        full_plan = KdaTpPlan.from_config(source, 0, 1, qk_multiple=qk_multiple)
        prefix = describe(source).prefix
        local = kt.load_rank(checkpoint, qk_multiple=qk_multiple)  # rank, size from the group
        head_dim = parse_config(source.config).head_dim
        x = np.random.default_rng(3).standard_normal((1, 8, parse_config(source.config).hidden))
        x = x.astype(np.float32)
        for layer in describe(source).kda_layers():
            y_r = kda_layer_forward(_layer(local, prefix, layer, local_plan), x,
                                    head_dim=head_dim, rms_norm_eps=eps, gate_lower_bound=bound)
            y_sum = torch.from_numpy(y_r)
            dist.all_reduce(y_sum, op=dist.ReduceOp.SUM)
            full = {n: source.get(n) for n in source.names()}
            y = kda_layer_forward(_layer(full, prefix, layer, full_plan), x,
                                  head_dim=head_dim, rms_norm_eps=eps, gate_lower_bound=bound)
            err = float(np.max(np.abs(y_sum.numpy() - y)))
            assert err <= 1e-5, f"layer {layer}: all-reduced partials off by {err}"

        mesh = init_device_mesh("cpu", (world,))
        # No collective at load: rank 0 loads while the others wait in a barrier (a collective
        # inside load_dtensors would be paired with that barrier and fail or time out).
        if rank == 0:
            dtensors = kt.load_dtensors(checkpoint, mesh, qk_multiple=qk_multiple)
        dist.barrier()
        if rank != 0:
            dtensors = kt.load_dtensors(checkpoint, mesh, qk_multiple=qk_multiple)
        assert dtensors, "no KDA tensor"
        for name, dt in dtensors.items():
            if dt.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                # gloo cannot all-gather float8: rejoin the same local shards viewed as bytes.
                dt = DTensor.from_local(dt.to_local().view(torch.uint8), mesh, dt.placements,
                                        run_check=False, shape=dt.shape, stride=dt.stride())
            whole = dt.full_tensor()
            want = source.get(name).to_torch()
            if want.numel() != whole.numel():  # a padded tensor rejoins to its real entries
                want = want.reshape(-1)[: whole.numel()].reshape(whole.shape)
            assert whole.shape == want.shape, name
            assert torch.equal(whole.view(torch.uint8), want.view(torch.uint8)), name

        report = check_tp_equivalence_distributed(checkpoint, world, qk_multiple=qk_multiple)
        assert report.passed, report.format()
    finally:
        dist.destroy_process_group()
