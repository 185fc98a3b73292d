"""Distillation methods: a teacher's distribution matched by a few-step student (roles student,
teacher, critic); Self-Forcing's student is block-causal and rolls out chunk by chunk."""

from fv_accel.methods.distribution_matching.dmd2 import DMD2Method
from fv_accel.methods.distribution_matching.self_forcing import SelfForcingMethod

__all__ = ["DMD2Method", "SelfForcingMethod"]
