"""Exponential moving average of the trainable weights (`callbacks.ema`).

    ema <- decay * ema + (1 - decay) * weight        after every optimizer step

The shadow is fp32 whatever the training dtype, on the weights' device or on the CPU
(`callbacks.ema.device: cpu`, which saves accelerator memory at the cost of a copy per step).
Under FSDP2 each rank keeps the EMA of its own shard. The shadow is saved per rank in the
training-state checkpoints (so a resumed run continues it exactly), used for validation samples
(`callbacks.validation.use_ema`) and exported beside the raw weights at the end of the run
(`<output_dir>/ema/`, written by the student as its own final weights are).

diffusers' `EMAModel` caps the decay with a warm-up `(1 + n) / (10 + n)` and keeps the shadow
on the weights' device and dtype; this class keeps the plain formula, an fp32 shadow and an
optional CPU placement.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence

import torch

from fv_accel.trainer import TrainerCallback

logger = logging.getLogger(__name__)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor shard under FSDP2; the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


class EmaWeights:
    """An fp32 shadow of `params`, updated in place."""

    def __init__(self, params: Sequence[torch.nn.Parameter], decay: float, device: Optional[torch.device] = None):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"callbacks.ema.decay must be in (0, 1), got {decay}")
        self.params = list(params)
        self.decay = float(decay)
        self.shadow = [
            _local(p.detach()).to(device=device or _local(p).device, dtype=torch.float32, copy=True)
            for p in self.params
        ]
        self.num_updates = 0

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.decay
        for s, p in zip(self.shadow, self.params):
            # lerp: s + (1 - decay) * (p - s) = decay * s + (1 - decay) * p
            s.lerp_(_local(p.detach()).to(device=s.device, dtype=torch.float32), weight)
        self.num_updates += 1

    @contextlib.contextmanager
    @torch.no_grad()
    def applied(self) -> Iterator[None]:
        """Swap the EMA into the parameters for the duration of the block; the trained weights
        are restored bit for bit afterwards (from a copy, not by inverting anything)."""
        backup = [_local(p.detach()).clone() for p in self.params]
        try:
            for s, p in zip(self.shadow, self.params):
                _local(p.detach()).copy_(s)
            yield
        finally:
            for b, p in zip(backup, self.params):
                _local(p.detach()).copy_(b)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"shadow.{i}": s.detach().cpu().contiguous() for i, s in enumerate(self.shadow)}
        out["num_updates"] = torch.tensor([self.num_updates], dtype=torch.int64)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        count = sum(1 for k in tensors if k.startswith("shadow."))
        if count != len(self.shadow):
            raise ValueError(
                f"the checkpoint's EMA holds {count} tensors but the student has {len(self.shadow)} trainable "
                "parameters (was it saved with a different model or LoRA setting?)"
            )
        for i, s in enumerate(self.shadow):
            saved = tensors[f"shadow.{i}"]
            if tuple(saved.shape) != tuple(s.shape):
                raise ValueError(f"EMA tensor {i}: checkpoint shape {tuple(saved.shape)} != parameter shape {tuple(s.shape)}")
            s.copy_(saved.to(device=s.device, dtype=torch.float32))
        self.num_updates = int(tensors["num_updates"].reshape(-1)[0]) if "num_updates" in tensors else 0


class EmaCallback(TrainerCallback):
    """Keeps an `EmaWeights` of the student's trainable parameters for the trainer."""

    def __init__(self, decay: float, device: str = "same", export: bool = True):
        self.decay = float(decay)
        self.device = device
        self.export = export
        self.ema: Optional[EmaWeights] = None
        self._pending: Optional[dict[str, torch.Tensor]] = None
        self._skipped_seen = 0

    @classmethod
    def from_config(cls, cfg) -> "EmaCallback":
        return cls(cfg.callbacks.ema.decay, cfg.callbacks.ema.device, export=cfg.training.checkpoint.save_final)

    def _build(self, trainer) -> EmaWeights:
        params = trainer.method.student.trainable_parameters()
        if any(hasattr(p, "ds_tensor") for p in params):
            # ZeRO-3 keeps each parameter's shard outside `p.data`: there is nothing here to average.
            raise ValueError(
                "callbacks.ema is not supported under DeepSpeed ZeRO-3 (partitioned parameters); use "
                "FSDP2 (accelerate_configs/fsdp2.yaml), where each rank averages its own shard, or ZeRO-2"
            )
        device = torch.device("cpu") if self.device == "cpu" else None
        ema = EmaWeights(params, self.decay, device=device)
        if self._pending is not None:
            ema.load_state_tensors(self._pending)
            self._pending = None
        return ema

    def on_train_start(self, trainer) -> None:
        if self.ema is None:
            self.ema = self._build(trainer)
        self._skipped_seen = int(getattr(trainer, "skipped_steps", 0))
        if trainer.accelerator.is_main_process:
            logger.info(
                "EMA of %d trainable tensors, decay %g, on %s (callbacks.ema)",
                len(self.ema.shadow),
                self.decay,
                self.ema.shadow[0].device if self.ema.shadow else "-",
            )

    def on_step_end(self, trainer, step: int, logs: dict) -> None:
        # A step skipped for a non-finite loss (training.loop.nan_policy) made no optimizer update:
        # nothing to average. The trainer counts skipped steps; a rise means this one was skipped.
        skipped = int(getattr(trainer, "skipped_steps", 0))
        if skipped != self._skipped_seen:
            self._skipped_seen = skipped
            return
        self.ema.update()

    def on_train_end(self, trainer) -> None:
        if not self.export or self.ema is None:
            return
        out = Path(trainer.output_dir) / "ema"
        with self.ema.applied():
            trainer.method.student.save_final(trainer.accelerator, out)
        if trainer.accelerator.is_main_process:
            logger.info("EMA weights written to %s", out)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {} if self.ema is None else self.ema.state_tensors()

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if not tensors:
            logger.warning("the checkpoint holds no EMA state: the EMA restarts from the resumed weights")
            return
        if self.ema is not None:
            self.ema.load_state_tensors(tensors)
        else:
            self._pending = dict(tensors)  # applied when the trainer starts and the shadow is built

    def applied(self):
        """Context manager: the EMA weights in the student for the duration (no-op if not built)."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()
