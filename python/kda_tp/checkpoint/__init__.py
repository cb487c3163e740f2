"""Checkpoints on disk: the safetensors reader (:class:`SafetensorsSource`, zero-copy
:class:`Tensor` records), :func:`describe` (a checkpoint read once per opened source), the names
of KDA tensors per model family, ``--layers`` lists, and the streaming writer.

The face lists what a user may touch; the modules' other names are the package's own plumbing
(``files``: atomic writes and the open-files limit; ``values``: the equality of values).
"""

from .description import CheckpointDescription, LayerFacts, describe, open_checkpoint
from .layers import check_layers
from .names import checkpoint_suffix, kda_tensor_name
from .reader import (
    BACKENDS,
    BACKEND_ENV,
    INDEX_NAME,
    SafetensorsSource,
    Tensor,
    TensorSource,
    shard_bytes,
)
from .writer import FileRange, TensorSpec, write_index, write_safetensors

__all__ = [
    "SafetensorsSource",
    "Tensor",
    "TensorSource",
    "shard_bytes",
    "BACKENDS",
    "BACKEND_ENV",
    "INDEX_NAME",
    "describe",
    "open_checkpoint",
    "CheckpointDescription",
    "LayerFacts",
    "kda_tensor_name",
    "checkpoint_suffix",
    "check_layers",
    "write_safetensors",
    "write_index",
    "TensorSpec",
    "FileRange",
]

