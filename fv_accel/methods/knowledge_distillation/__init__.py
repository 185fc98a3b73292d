"""Knowledge distillation (ODE initialisation): KDMethod (`kd`) and KDCausalMethod (`kd_causal`)."""

from fv_accel.methods.knowledge_distillation.kd import KDCausalMethod, KDMethod

__all__ = ["KDMethod", "KDCausalMethod"]
