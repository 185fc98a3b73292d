"""DiffusionForcingSFTMethod: SFT with independent noise per chunk of latent frames (REFERENCE.md 4)."""

from __future__ import annotations

import logging
import math
from typing import Any, Literal

import torch

from fv_accel.config import DEFAULT_CHUNK_SIZE, parse_chunk_size  # noqa: F401 (re-exported)
from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.methods.fine_tuning.finetune import flow_matching_loss
from fv_accel.models.base import ModelBase, TrainingBatch

logger = logging.getLogger(__name__)

def _parse_ratio(raw: Any, key: str) -> float:
    if isinstance(raw, bool):
        raise ValueError(f"method.{key} must be a number in [0, 1], got bool {raw!r}")
    if isinstance(raw, (int, float)):
        value = float(raw)
    elif isinstance(raw, str):
        try:
            value = float(raw.strip())
        except ValueError:
            raise ValueError(f"method.{key} must be a number in [0, 1], got {raw!r}") from None
    else:
        raise ValueError(f"method.{key} must be a number in [0, 1], got {type(raw).__name__} {raw!r}")
    if not (0.0 <= value <= 1.0) or math.isnan(value):
        raise ValueError(f"method.{key} must be in [0, 1], got {raw!r}")
    return value


def parse_timestep_index_range(min_raw: Any, max_raw: Any, num_train_timesteps: int = 1000) -> tuple[int, int]:
    """The half-open index range [lo, hi + 1) for per-chunk sampling. Defaults give [0, N)."""
    lo_ratio = _parse_ratio(0.0 if min_raw is None else min_raw, "min_timestep_ratio")
    hi_ratio = _parse_ratio(1.0 if max_raw is None else max_raw, "max_timestep_ratio")
    if hi_ratio < lo_ratio:
        raise ValueError(
            f"method.max_timestep_ratio ({hi_ratio}) must be >= method.min_timestep_ratio ({lo_ratio})"
        )
    n = num_train_timesteps
    lo = min(max(int(lo_ratio * n), 0), n - 1)
    hi = min(max(int(hi_ratio * n), 0), n - 1)
    if hi <= lo:
        hi = min(n - 1, lo + 1)
    return lo, hi + 1


class DiffusionForcingSFTMethod(TrainingMethod):
    """Diffusion-forcing SFT (DFSFT): train only student with inhomogeneous timesteps."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("DFSFT")
        self._attn_kind: Literal["dense", "vsa"] = self._infer_attn_kind()
        self._chunk_size = parse_chunk_size(self.method_config.get("chunk_size", None))
        self._timestep_index_range = parse_timestep_index_range(
            self.method_config.get("min_timestep_ratio", 0.0), self.method_config.get("max_timestep_ratio", 1.0)
        )
        self._check_student()
        self.student.init_preprocessors(self.training_config)
        self._training_weights = self._build_training_weights()
        self._init_optimizers_and_schedulers()

    def _check_student(self) -> None:
        """Never train 'causal' DFSFT silently bidirectional, nor per-frame on a model that can't."""
        if not getattr(self.student, "supports_per_frame_timesteps", False):
            raise ValueError(
                f"DFSFT needs a student that takes per-frame timesteps; "
                f"{type(self.student.transformer).__name__} does not (use FineTuneMethod)"
            )
        block = getattr(self.student, "causal_block_size", None)
        if block is not None and block != self._chunk_size:
            raise ValueError(
                f"method.chunk_size ({self._chunk_size}) must equal the student's causal block size ({block})"
            )
        if block is None and getattr(self.student, "supports_causal_attention", False) and self.process_index == 0:
            # Diffusion forcing of a full-sequence model is a valid choice, but never a silent one.
            logger.warning(
                "%s trains a bidirectional model: models.student.causal is false, so every frame attends "
                "to every other frame; set models.student.causal: true for a block-causal student "
                "(block size = method.chunk_size = %d)",
                type(self).__name__,
                self._chunk_size,
            )

    def _build_training_weights(self) -> torch.Tensor:
        mode = self.method_config.get("weighting", "index")
        return self.student.table.dfsft_weights(mode).to(self.device)

    def _prepare(self, batch: dict[str, Any], generator: Any = None) -> TrainingBatch:
        """SFT preparation (noise reused, homogeneous t discarded), then per-chunk noise levels."""
        # A subclass passes its generator(s) to keep drawing from the same stream afterwards.
        generator = self.batch_generator(batch) if generator is None else generator
        tb = self.student.prepare_batch(batch, generator=generator, latents_source="data")
        for name in ("latents", "noise"):
            if getattr(tb, name) is None:
                raise RuntimeError(f"prepare_batch() must set TrainingBatch.{name}")
        bsz, _, num_frames = tb.latents.shape[:3]
        if self._chunk_size > num_frames:
            raise ValueError(
                f"method.chunk_size ({self._chunk_size}) is larger than the latent frame count ({num_frames})"
            )
        table = self.student.table
        idx = table.sample_chunk_indices(
            bsz, num_frames, self._chunk_size, self._timestep_index_range, generator, tb.latents.device
        )
        tb.timestep_indices = idx
        tb.sigmas = table.sigmas_at(idx)
        tb.timesteps = table.timesteps_at(idx)
        tb.noisy_model_input = table.add_noise(tb.latents, tb.noise, tb.sigmas)
        return tb

    def compute_loss(self, pred: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        per_frame = flow_matching_loss(
            pred,
            tb.latents,
            tb.noisy_model_input,
            tb.noise,
            tb.sigmas,
            precondition_outputs=bool(self.training_config.model.precondition_outputs),
            reduce_dims=(1, 3, 4),
        )  # [B, T]
        weights = self._training_weights.to(per_frame.device)[tb.timestep_indices]
        return (per_frame * weights).mean()

    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        del iteration
        tb = self._prepare(batch)
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
