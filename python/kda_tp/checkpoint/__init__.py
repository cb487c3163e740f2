"""Checkpoints on disk: the safetensors reader (:class:`SafetensorsSource`, zero-copy
:class:`Tensor` records), the streaming writer, the names of KDA tensors per model family, which
layers are KDA, and :func:`describe`: a checkpoint read once per opened source.
"""

from . import description, layers, names, reader, writer
from .reader import *  # noqa: F403
from .writer import *  # noqa: F403
from .names import *  # noqa: F403
from .layers import *  # noqa: F403
from .description import *  # noqa: F403

__all__ = reader.__all__ + writer.__all__ + names.__all__ + layers.__all__ + description.__all__
