"""DiffusionForcingSFTMethod: SFT with independent noise per chunk of latent frames (REFERENCE.md 4)."""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from fv_accel.config import DEFAULT_CHUNK_SIZE, parse_chunk_size  # noqa: F401 (re-exported)
from fv_accel.methods.base import LogScalar, TrainingMethod, parse_timestep_index_range  # noqa: F401
from fv_accel.models.base import ModelBase, TrainingBatch

logger = logging.getLogger(__name__)

class DiffusionForcingSFTMethod(TrainingMethod):
    """Diffusion-forcing SFT (DFSFT): train only student with inhomogeneous timesteps."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("DFSFT")
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self._chunk_size = parse_chunk_size(self.method_config.get("chunk_size", None))
        self._check_student()
        self._init_student()
        self._training_weights = self._build_training_weights()

    @property
    def chunk_size(self) -> int:  # type: ignore[override]
        return self._chunk_size

    def _check_student(self) -> None:
        """Never train 'causal' DFSFT silently bidirectional, nor per-frame on a model that can't."""
        if not self.student.capabilities.per_frame_timesteps:
            raise ValueError(
                f"{type(self).__name__}: the {self.student.family} family cannot take a timestep per latent frame: "
                f"{self.student.per_frame_refusal} (use method.name: finetune)"
            )
        block = getattr(self.student, "causal_block_size", None)
        if block is not None and block != self._chunk_size:
            raise ValueError(
                f"method.chunk_size ({self._chunk_size}) must equal the student's causal block size ({block})"
            )
        if block is None and self.student.capabilities.causal_attention and self.process_index == 0:
            # Diffusion forcing of a full-sequence model is a valid choice, but never a silent one.
            logger.warning(
                "%s trains a bidirectional model: models.student.causal is false, so every frame attends "
                "to every other frame; set models.student.causal: true for a block-causal student "
                "(block size = method.chunk_size = %d)",
                type(self).__name__,
                self._chunk_size,
            )

    def _build_training_weights(self) -> torch.Tensor:
        """The bell weights of the initial table (the seed's attribute); `training_weights` gives
        those of each batch's table (they depend on its timesteps in 'timestep' mode)."""
        self._weighting = self.method_config.get("weighting", "index")
        weights = self.table.dfsft_weights(self._weighting).to(self.device)
        self._weights_per_table = {(self.table.shift, self.table.num_train_timesteps): weights}
        return weights

    def training_weights(self) -> torch.Tensor:
        key = (self.table.shift, self.table.num_train_timesteps)
        if key not in self._weights_per_table:
            self._weights_per_table[key] = self.table.dfsft_weights(self._weighting).to(self.device)
        return self._weights_per_table[key]

    def _prepare(self, batch: dict[str, Any], generator: Any = None) -> TrainingBatch:
        """SFT preparation (noise reused, homogeneous index discarded), then per-chunk noise levels.

        Clean condition frames (image-to-video) stay clean; the chunks are drawn for the rest."""
        # A subclass passes its generator(s) to keep drawing from the same stream afterwards.
        generator = self.batch_generator(batch) if generator is None else generator
        tb = self.prepare(batch, generator, in_range=False)
        bsz, _, num_frames = tb.latents.shape[:3]
        k = tb.conditioning.clean_frames
        if self._chunk_size > num_frames - k:
            raise ValueError(
                f"method.chunk_size ({self._chunk_size}) is larger than the latent frame count ({num_frames - k})"
            )
        idx = self.table.sample_chunk_indices(
            bsz, num_frames - k, self._chunk_size, self._timestep_index_range, generator, tb.latents.device
        )
        if k:
            idx = torch.cat([idx.new_full((bsz, k), -1), idx], dim=1)
        return self.noise_to(tb, idx)

    def compute_loss(self, pred: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        """Mean over (sample, frame) of the per-frame loss times the bell weight of its index;
        clean condition frames carry none."""
        per_frame = self.per_frame_loss(pred, tb)  # [B, T]
        k = tb.conditioning.clean_frames if tb.conditioning is not None else 0
        weights = self.training_weights().to(per_frame.device)[tb.timestep_indices[:, k:]]
        return (per_frame[:, k:] * weights).mean()

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        del iteration
        tb = self.attach_vsa_metadata(self._prepare(batch))
        pred = self.student.predict_noise(
            tb.noisy_model_input, tb.timesteps, tb, conditional=True, attn_kind=self._attn_kind
        )
        loss = self.compute_loss(pred, tb)
        return self._step_result(loss, tb, "dfsft_loss")

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig["method.chunk_size"] = self._chunk_size
        sig["method.timestep_index_range"] = list(self._timestep_index_range)
        sig["method.weighting"] = self.method_config.get("weighting", "index")
        return sig
