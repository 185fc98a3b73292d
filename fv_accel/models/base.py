"""ModelBase: one role (student; later teacher/critic). It knows its transformer, never the loss."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from fv_accel.schedulers import FlowMatchTable, GeneratorLike


@dataclass
class TrainingBatch:
    """What a role prepares for a method. Latent tensors are [B, C, T, H, W] (diffusers layout)."""

    latents: Optional[torch.Tensor] = None  # clean, normalised x0
    noise: Optional[torch.Tensor] = None  # eps ~ N(0, I)
    noisy_model_input: Optional[torch.Tensor] = None  # x_t
    timestep_indices: Optional[torch.Tensor] = None  # table indices, [B] or [B, T]
    sigmas: Optional[torch.Tensor] = None  # [B] or [B, T]
    timesteps: Optional[torch.Tensor] = None  # float timesteps the transformer sees, [B] or [B, T]
    encoder_hidden_states: Optional[torch.Tensor] = None  # [B, L, D]
    encoder_attention_mask: Optional[torch.Tensor] = None  # [B, L]
    attn_metadata: Any = None
    attn_metadata_vsa: Any = None
    extras: dict = field(default_factory=dict)


class ModelBase:
    """A role in training. Subclasses own a `transformer` (the nn.Module Accelerate prepares)."""

    transformer: torch.nn.Module
    _trainable: bool = True

    # Whether the transformer accepts per-frame timesteps [B, T] (DFSFT needs it).
    supports_per_frame_timesteps: bool = False
    # Causal attention block size in latent frames, or None for bidirectional attention.
    causal_block_size: Optional[int] = None

    def __init__(self) -> None:
        self.accelerator = None
        self.table: Optional[FlowMatchTable] = None

    # ---- set-up ----
    def init_preprocessors(self, training_config: Any) -> None:
        """Build what prepare_batch needs (the flow-matching table, latent statistics)."""
        raise NotImplementedError

    def attach_accelerator(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    # ---- per step ----
    def prepare_batch(
        self, batch: dict, *, generator: GeneratorLike, latents_source: str = "data"
    ) -> TrainingBatch:
        raise NotImplementedError

    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
        attn_kind: str = "dense",
    ) -> torch.Tensor:
        raise NotImplementedError

    def backward(self, loss: torch.Tensor, ctx: Any, *, grad_accum_rounds: int = 1) -> None:
        """Backpropagate `loss / grad_accum_rounds` through the (possibly wrapped) transformer.

        Accelerate's `backward` already divides by its own `gradient_accumulation_steps` (and must
        be used: DeepSpeed and fp16 scaling live there), so only the difference is applied here.
        """
        del ctx  # the diffusers student recomputes checkpointed activations without extra context
        grad_accum_rounds = max(1, int(grad_accum_rounds))
        if self.accelerator is None:
            (loss / grad_accum_rounds).backward()
            return
        accel_rounds = max(1, int(self.accelerator.gradient_accumulation_steps))
        if accel_rounds != grad_accum_rounds:
            loss = loss * (accel_rounds / grad_accum_rounds)
        self.accelerator.backward(loss)
