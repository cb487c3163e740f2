"""Synthetic checkpoints of every model family: the tensors and ``config.json`` per
dialect (``_tensors``) and the values and files (``checkpoints``: :func:`write_checkpoint`,
:data:`GEOMETRIES`, and a geometry's ``config.json`` alone: :func:`model_config`).
"""

from .checkpoints import GEOMETRIES, model_config, write_checkpoint, write_small_checkpoint

__all__ = ["GEOMETRIES", "model_config", "write_checkpoint", "write_small_checkpoint"]
