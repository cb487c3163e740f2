"""Synthetic checkpoints of every model family: the tensors and ``config.json`` per
dialect (``tensors``) and the values and files (``checkpoints``: :func:`write_checkpoint`,
:data:`GEOMETRIES`).
"""

from . import checkpoints
from .checkpoints import *  # noqa: F403

__all__ = checkpoints.__all__
