"""Roles (ModelBase) and the diffusers video-transformer students."""

from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.models.wan import WanStudent

__all__ = ["ModelBase", "TrainingBatch", "WanStudent", "build_student"]


def build_student(cfg) -> ModelBase:
    """The student role for a recipe (the model registry: one entry per architecture family)."""
    return WanStudent(cfg)
