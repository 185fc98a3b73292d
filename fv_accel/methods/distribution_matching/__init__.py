"""Distillation methods: a teacher's distribution matched by a few-step student (roles student,
teacher, critic)."""

from fv_accel.methods.distribution_matching.dmd2 import DMD2Method

__all__ = ["DMD2Method"]
