"""Consistency-model methods: causal consistency distillation (Causal Forcing++)."""

from fv_accel.methods.consistency_model.causal_cd import CausalConsistencyDistillationMethod

__all__ = ["CausalConsistencyDistillationMethod"]
