"""Synthetic checkpoints of every model family: the tensors and ``config.json`` per
dialect (``_tensors``) and the values and files (``checkpoints``: :func:`write_checkpoint`,
:data:`GEOMETRIES`).
"""

from .checkpoints import GEOMETRIES, write_checkpoint, write_small_checkpoint

__all__ = ["GEOMETRIES", "write_checkpoint", "write_small_checkpoint"]
