"""Distillation methods: a teacher's distribution matched by a few-step student (roles student,
teacher, critic); Self-Forcing's student is block-causal and rolls out chunk by chunk. AnyFlow's
student is a flow map u(x_t, t, r): pretrained from data (no teacher), then distilled on-policy."""

from fv_accel.methods.distribution_matching.anyflow import AnyFlowMethod
from fv_accel.methods.distribution_matching.anyflow_pretrain import AnyFlowPretrainMethod
from fv_accel.methods.distribution_matching.dmd2 import DMD2Method
from fv_accel.methods.distribution_matching.self_forcing import SelfForcingMethod

__all__ = ["AnyFlowMethod", "AnyFlowPretrainMethod", "DMD2Method", "SelfForcingMethod"]
