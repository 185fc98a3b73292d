"""Exponential moving average of the trainable weights (`callbacks.ema`).

    ema <- decay * ema + (1 - decay) * weight        after every optimizer step

The shadow is fp32 whatever the training dtype, on the weights' device or on the CPU
(`callbacks.ema.device: cpu`, which saves accelerator memory at the cost of a copy per step).
Under FSDP2 each rank keeps the EMA of its own shard. Checkpoints hold one copy of the whole
average, `ema.safetensors` (full tensors, written by the main process; FSDP2 shards are gathered
first), so a resumed run continues it exactly on any number of processes: each rank takes its
shard of the full tensors back. It is also used for validation samples
(`callbacks.validation.use_ema`) and exported beside the raw weights at the end of the run
(`<output_dir>/ema/`, written by the student as its own final weights are). DeepSpeed ZeRO-3 keeps
parameters outside the modules: the EMA is refused there when the recipe is checked.

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
from safetensors import safe_open
from safetensors.torch import save_file

from fv_accel.config import ConfigError
from fv_accel.trainer import TrainerCallback

logger = logging.getLogger(__name__)

# The EMA's file in a checkpoint folder: full fp32 tensors `shadow.<i>` (i: the trainable
# parameter's position), with `num_updates` in the file's metadata.
EMA_FILE = "ema.safetensors"


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a parameter (a DTensor shard under FSDP2; the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _full_tensor(shard: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The whole tensor of which `shard` is this rank's part, laid out like `param` (an all-gather
    over the device mesh for a DTensor parameter: every rank must call it)."""
    if not hasattr(param, "to_local"):
        return shard
    from torch.distributed.tensor import DTensor

    local = shard.to(device=param.to_local().device)
    whole = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride())
    return whole.full_tensor()


def _shard_of(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This rank's part of `full`, laid out like `param` (sliced locally, no communication)."""
    if not hasattr(param, "to_local"):
        return full
    from torch.distributed.tensor import distribute_tensor

    device = param.to_local().device
    return distribute_tensor(full.to(device), param.device_mesh, param.placements, src_data_rank=None).to_local()


def check_ema_supported(cfg, accelerator) -> None:
    """Refuse `callbacks.ema` under DeepSpeed ZeRO-3 before the engine is built: ZeRO-3 partitions
    every parameter outside the module (`ds_tensor`), so there is no weight here to average."""
    from accelerate.utils import DistributedType

    if not cfg.callbacks.ema.enable or accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds_config = getattr(accelerator.state.deepspeed_plugin, "deepspeed_config", None) or {}
    stage = int((ds_config.get("zero_optimization") or {}).get("stage", 0))
    if stage == 3:
        raise ConfigError(
            "callbacks.ema.enable: the EMA is not supported under DeepSpeed ZeRO-3 (zero_optimization.stage 3 "
            "in the launch config: parameters are partitioned outside the model); use FSDP2 "
            "(accelerate_configs/fsdp2.yaml) or ZeRO-2, or set callbacks.ema.enable: false"
        )


# Elements per group of an EMA update (256 MiB in fp32): a bf16 model's update holds at most this
# much of an fp32 copy of its weights, not all of it.
UPDATE_GROUP_NUMEL = 1 << 26


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
        # Consecutive tensors of at most UPDATE_GROUP_NUMEL elements in all (a single larger tensor
        # forms its own group): an update converts one group to fp32 at a time.
        self.groups: list[list[int]] = []
        total = 0
        for i, s in enumerate(self.shadow):
            if not self.groups or total + s.numel() > UPDATE_GROUP_NUMEL:
                self.groups.append([])
                total = 0
            self.groups[-1].append(i)
            total += s.numel()

    @torch.no_grad()
    def update(self) -> None:
        weight = 1.0 - self.decay
        for group in self.groups:
            shadow = [self.shadow[i] for i in group]
            sources = [_local(self.params[i].detach()).to(device=s.device, dtype=torch.float32) for i, s in zip(group, shadow)]
            # lerp: s + (1 - decay) * (p - s) = decay * s + (1 - decay) * p, over a group of tensors
            # at once (one kernel launch per group on an accelerator; the same values as per tensor).
            torch._foreach_lerp_(shadow, sources, weight)
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

    def write_file(self, path: Path, *, is_main_process: bool) -> None:
        """One file of full fp32 tensors, written by the main process (every rank must call this:
        sharded parameters are gathered)."""
        tensors = {}
        for i, (s, p) in enumerate(zip(self.shadow, self.params)):
            full = _full_tensor(s.detach(), p)
            if is_main_process:
                tensors[f"shadow.{i}"] = full.to(device="cpu", dtype=torch.float32).contiguous()
        if is_main_process:
            save_file(tensors, str(path), metadata={"num_updates": str(self.num_updates)})

    def load_file(self, path: Path) -> None:
        """Take this rank's part of each full tensor of a `write_file` file (any process count)."""
        with safe_open(str(path), framework="pt", device="cpu") as fh:
            count = sum(1 for k in fh.keys() if k.startswith("shadow."))
            if count != len(self.shadow):
                raise ValueError(
                    f"{path}: holds {count} EMA tensors but the student has {len(self.shadow)} trainable "
                    "parameters (was it saved with a different model or LoRA setting?)"
                )
            for i, (s, p) in enumerate(zip(self.shadow, self.params)):
                full = fh.get_tensor(f"shadow.{i}")
                if tuple(full.shape) != tuple(p.shape):
                    raise ValueError(f"{path}: EMA tensor {i} has shape {tuple(full.shape)}, the parameter {tuple(p.shape)}")
                s.copy_(_shard_of(full, p).to(device=s.device, dtype=torch.float32))
            self.num_updates = int((fh.metadata() or {}).get("num_updates", 0))

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

    def __init__(self, decay: float, device: str = "same", export: bool = True, update_after_step: int = 0):
        self.decay = float(decay)
        self.update_after_step = int(update_after_step)
        self.device = device
        self.export = export
        self.ema: Optional[EmaWeights] = None
        self._pending: Optional[dict[str, torch.Tensor]] = None
        self._skipped_seen = 0

    @classmethod
    def from_config(cls, cfg) -> "EmaCallback":
        ema = cfg.callbacks.ema
        return cls(ema.decay, ema.device, export=cfg.training.checkpoint.save_final, update_after_step=ema.update_after_step)

    def _build(self, trainer) -> EmaWeights:
        params = trainer.method.student.trainable_parameters()
        if any(hasattr(p, "ds_tensor") for p in params):
            # check_ema_supported refuses this recipe earlier; a caller-built run may still get here.
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
        if step <= self.update_after_step:
            return  # callbacks.ema.update_after_step: the average still holds the starting weights
        self.ema.update()

    def on_train_end(self, trainer) -> None:
        if not self.export or self.ema is None:
            return
        out = Path(trainer.output_dir) / "ema"
        with self.ema.applied():
            trainer.method.student.save_final(trainer.accelerator, out)
        if trainer.accelerator.is_main_process:
            logger.info("EMA weights written to %s", out)

    # ---- checkpoints: one file of full tensors (older checkpoints: per-rank tensors) ----
    def write_checkpoint_files(self, trainer, folder: Path) -> None:
        if self.ema is not None:
            self.ema.write_file(Path(folder) / EMA_FILE, is_main_process=trainer.accelerator.is_main_process)

    def read_checkpoint_files(self, trainer, folder: Path) -> None:
        path = Path(folder) / EMA_FILE
        legacy = self._pending is not None  # per-rank tensors from a checkpoint before format 2
        if not path.is_file() and not legacy:
            logger.warning("%s holds no EMA state: the EMA restarts from the resumed weights", folder)
            return
        if self.ema is None:
            self.ema = self._build(trainer)  # takes any per-rank tensors
        if path.is_file():
            self.ema.load_file(path)

    def checkpoint_bytes(self) -> int:
        return 0 if self.ema is None else sum(4 * p.numel() for p in self.ema.params)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}  # the EMA is in its own file (write_checkpoint_files)

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        # Checkpoints before format 2 kept each rank's shadow in its rank file.
        if not tensors:
            return
        if self.ema is not None:
            self.ema.load_state_tensors(tensors)
        else:
            self._pending = dict(tensors)  # applied when the shadow is built

    def applied(self):
        """Context manager: the EMA weights in the student for the duration (no-op if not built)."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()
