"""A trainer's tensors as a tensor source: :class:`MemorySource`, what ``kda_tp.open_rank``
wraps when it is given a state dict instead of a checkpoint path.

Nothing is copied or gathered when the source is made: it keeps the caller's arrays and tensors,
answers ``info(name)`` from their dtypes and shapes, and hands out bytes as zero-copy views of
CPU memory. A tensor on another device (CUDA) is sliced there: a rank's row range
(``read_range``) or column block (``read_columns``) is cut on the device and only those bytes
are copied to the host.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import CheckpointError, UsageError
from ..model.config import load_config
from ..model.dtypes import TORCH_NAMES, numpy_dtype
from .reader import Tensor

__all__ = ["MemorySource", "is_tensor_mapping"]


def _is_torch(value: Any) -> bool:
    return any(c.__module__ == "torch" and c.__name__ == "Tensor" for c in type(value).__mro__)


def is_tensor_mapping(value: Any) -> bool:
    """Whether ``value`` is what :class:`MemorySource` takes (a mapping, or a list or tuple of
    ``(name, tensor)`` pairs), rather than a checkpoint path or an open source."""
    if isinstance(value, Mapping):
        return True
    return isinstance(value, (list, tuple)) and all(
        isinstance(pair, tuple) and len(pair) == 2 for pair in value)


def _dtype_name(name: str, value: Any) -> str:
    """The safetensors dtype name of a numpy array's or torch tensor's dtype."""
    if _is_torch(value):
        wanted = str(value.dtype).removeprefix("torch.")
        for st, torch_name in TORCH_NAMES.items():
            if torch_name == wanted:
                return st
        raise CheckpointError(f"{name}: torch dtype {value.dtype} has no safetensors name")
    for st in TORCH_NAMES:
        if np.dtype(value.dtype) == numpy_dtype(st):
            return st
    raise CheckpointError(f"{name}: numpy dtype {value.dtype} has no safetensors name")


class MemorySource:
    """Tensors held in memory (a trainer's state dict) as a tensor source for
    :class:`~kda_tp.KdaShardedSource`: ``kda_tp.open_rank(tensors, config=..., tp_rank=,
    tp_size=)`` builds the same view, plan, refusals and bytes as the checkpoint would give.

    Args:
        tensors: checkpoint-format names (``model.layers.0.self_attn.q_proj.weight``, as in the
            safetensors files; not an engine's fused names) to numpy arrays or ``torch.Tensor``
            (any device, any dtype safetensors has: BF16 as ``torch.bfloat16`` or
            ``ml_dtypes.bfloat16``, FP8 and its block scales included), as a mapping or an
            iterable of ``(name, tensor)`` pairs. Kept as they are: no copy.
        config: the model's ``config.json``: a dict, a path to the file, or a checkpoint
            directory holding it.

    The arrays must not change while a view reads them (as with any custom source).

    Raises:
        UsageError: ``config`` missing or not a dict or path; a name that is not a ``str``; a
            value that is neither a numpy array nor a torch tensor.
        CheckpointError: a name given twice; a dtype safetensors has no name for; a config
            file that cannot be read.
    """

    def __init__(self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], config: Any):
        if config is None:
            raise UsageError(
                "open_rank(tensors, ...): in-memory tensors need config= (the model's "
                "config.json: a dict, or its path)"
            )
        if isinstance(config, (str, os.PathLike)):
            config = load_config(config)
        if not isinstance(config, Mapping):
            raise UsageError(
                f"config= must be a config.json dict or its path, got {type(config).__name__}"
            )
        self._config = dict(config)
        pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
        self._tensors: dict[str, Any] = {}
        self._info: dict[str, tuple[str, tuple[int, ...]]] = {}
        for name, value in pairs:
            if not isinstance(name, str):
                raise UsageError(
                    f"open_rank(tensors, ...): a tensor name is a str, got "
                    f"{type(name).__name__} {name!r}"
                )
            if name in self._tensors:
                raise CheckpointError(f"{name}: given twice")
            if not (isinstance(value, np.ndarray) or _is_torch(value)):
                raise UsageError(
                    f"{name}: a numpy array or torch tensor, got {type(value).__name__}"
                )
            self._tensors[name] = value
            self._info[name] = (_dtype_name(name, value), tuple(int(d) for d in value.shape))

    @property
    def config(self) -> dict[str, Any]:
        """The config (the full model's)."""
        return self._config

    def names(self) -> list[str]:
        """The tensor names, in the order given."""
        return list(self._tensors)

    def info(self, name: str) -> tuple[str, tuple[int, ...]] | None:
        """``(dtype, shape)``, or None when absent."""
        return self._info.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def metadata(self) -> None:
        """A state dict has no safetensors ``__metadata__``."""
        return None

    def get(self, name: str) -> Tensor | None:
        """Tensor ``name`` (its bytes a read-only view of CPU memory: no copy for a contiguous
        CPU array or tensor; a tensor on another device is copied to the host whole), or
        None."""
        return self._tensor(name, 0, None)

    def read_range(self, name: str, start: int, stop: int) -> np.ndarray:
        """Bytes ``[start, stop)`` of tensor ``name``: a view for CPU memory; cut on the device
        and copied to the host alone for another device.

        Raises:
            CheckpointError: no such tensor.
        """
        found = self._tensor(name, start, stop)
        if found is None:
            raise CheckpointError(f"in-memory tensors: no tensor named {name!r}")
        return found.data

    def read_columns(self, name: str, tensor_plan: Any) -> np.ndarray:
        """This rank's column block of a ``CHANNEL_COLS`` tensor (``o_proj``): for a tensor off
        the CPU, gathered on its device and only the block copied to the host; else gathered
        from the CPU bytes (as :func:`~kda_tp.shard_bytes`)."""
        from .reader import shard_bytes  # noqa: PLC0415 - the reader's module, no cycle

        value = self._tensors.get(name)
        if value is None:
            raise CheckpointError(f"in-memory tensors: no tensor named {name!r}")
        if _is_torch(value) and value.device.type != "cpu":
            import torch  # noqa: PLC0415 - a torch tensor was given: torch is there

            rows = tensor_plan.full_rows
            flat = value.detach().contiguous().reshape(-1).view(torch.uint8).reshape(rows, -1)
            lo = tensor_plan.src_col_offset * tensor_plan.elem_bytes
            hi = lo + tensor_plan.local_row_elems * tensor_plan.elem_bytes
            data: np.ndarray = flat[:, lo:hi].contiguous().cpu().numpy().reshape(-1)
            data.flags.writeable = False
            return data
        whole = self._tensor(name, 0, None)
        assert whole is not None  # the name was found above
        return shard_bytes(tensor_plan, whole.data)

    def _tensor(self, name: str, start: int, stop: int | None) -> Tensor | None:
        value = self._tensors.get(name)
        if value is None:
            return None
        dtype, shape = self._info[name]
        if _is_torch(value):
            import torch  # noqa: PLC0415 - a torch tensor was given: torch is there

            flat = value.detach()
            if not flat.is_contiguous():
                flat = flat.contiguous()  # a strided tensor: its bytes in row-major order
            flat = flat.reshape(-1).view(torch.uint8) if flat.numel() else torch.empty(
                0, dtype=torch.uint8, device=flat.device)
            part = flat[start:stop]
            data = part.cpu().numpy() if part.device.type != "cpu" else part.numpy()
        else:
            array = np.ascontiguousarray(value)
            data = array.reshape(-1).view(np.uint8)[start:stop]
        data = data.view()
        data.flags.writeable = False
        return Tensor(name, dtype, shape if start == 0 and stop is None else (data.nbytes,), data)

    def close(self) -> None:
        """Drops the references to the tensors."""
        self._tensors = {}

    def __repr__(self) -> str:
        return f"MemorySource({len(self._info)} tensors)"
