"""The loop: accumulate, backward, clip, step, log, checkpoint, validate.

The trainer knows the loop and Accelerate, never a model's internals or a loss.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Optional

import torch

from fv_accel.data.loader import latent_tokens

logger = logging.getLogger(__name__)


class TrainerCallback:
    """Hooks for validation, EMA and other observers; each gets the trainer."""

    def on_train_start(self, trainer: "Trainer") -> None: ...

    def on_step_end(self, trainer: "Trainer", step: int, logs: dict) -> None: ...

    def on_train_end(self, trainer: "Trainer") -> None: ...

    # Tensors this callback keeps in checkpoints (per rank), e.g. the EMA weights.
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None: ...


class Trainer:
    def __init__(self, run: Any, callbacks: Optional[list[TrainerCallback]] = None):
        self.run_spec = run
        self.accelerator = run.accelerator
        self.config = run.config
        self.method = run.method
        self.dataloader = run.dataloader
        self.start_step = run.start_step
        self.callbacks = list(run.callbacks if callbacks is None else callbacks)
        self.step = run.start_step
        self.history: list[dict] = []
        self.output_dir = Path(self.config.training.checkpoint.output_dir)
        self._metrics_file = None

    # ---- checkpoint hooks for callbacks ----
    def extra_state_tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for i, cb in enumerate(self.callbacks):
            out.update({f"cb{i}/{k}": v for k, v in cb.state_tensors().items()})
        return out

    def load_extra_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        for i, cb in enumerate(self.callbacks):
            prefix = f"cb{i}/"
            cb.load_state_tensors({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})

    # ---- logging ----
    def _log(self, logs: dict, step: int) -> None:
        acc = self.accelerator
        acc.log(logs, step=step)
        if acc.is_main_process:
            if self._metrics_file is None:
                path = self.output_dir / "logs" / "metrics.jsonl"
                path.parent.mkdir(parents=True, exist_ok=True)
                self._metrics_file = open(path, "a", encoding="utf-8")
            self._metrics_file.write(json.dumps({"step": step, **logs}) + "\n")
            self._metrics_file.flush()

    def run(self) -> dict:
        from tqdm.auto import tqdm

        from fv_accel.checkpoint import save_checkpoint

        acc = self.accelerator
        cfg = self.config
        method = self.method
        student = method.student
        model = student.transformer
        k = cfg.training.loop.gradient_accumulation_steps
        max_steps = cfg.training.loop.max_train_steps
        max_norm = cfg.callbacks.grad_clip.max_grad_norm
        ckpt_every = cfg.training.checkpoint.training_state_checkpointing_steps
        log_every = cfg.training.tracker.log_every
        params = student.trainable_parameters()

        for cb in self.callbacks:
            cb.on_train_start(self)
        progress = tqdm(
            total=max_steps, initial=self.step, desc="train", disable=not acc.is_local_main_process, dynamic_ncols=True
        )
        data_iter = iter(self.dataloader)
        t_start = time.perf_counter()
        steps_run = 0
        samples_run = 0
        model.train()
        while self.step < max_steps:
            t0 = time.perf_counter()
            data_wait = 0.0
            loss_sums: dict[str, torch.Tensor] = {}
            metric_sums: dict[str, torch.Tensor] = {}
            samples = 0
            tokens = 0
            grad_norm = None
            for micro in range(k):
                td = time.perf_counter()
                batch = next(data_iter)
                data_wait += time.perf_counter() - td
                with acc.accumulate(model):
                    loss_map, outputs, metrics = method.single_train_step(batch, self.step)
                    method.backward(loss_map, outputs, grad_accum_rounds=k)
                    for name, value in loss_map.items():
                        loss_sums[name] = loss_sums.get(name, 0.0) + value.detach().float() / k
                    for name, value in metrics.items():
                        metric_sums[name] = metric_sums.get(name, 0.0) + torch.as_tensor(value).detach().float() / k
                    samples += batch["vae_latent"].shape[0]
                    tokens += batch["vae_latent"].shape[0] * latent_tokens(batch["vae_latent"].shape[1:])
                    if acc.sync_gradients:
                        if max_norm > 0:
                            grad_norm = acc.clip_grad_norm_(params, max_norm)
                        method.optimizer.step()
                        method.lr_scheduler.step()
                        method.optimizer.zero_grad(set_to_none=True)
            self.dataloader.mark_step_done(batch)
            self.step += 1
            steps_run += 1
            step_time = time.perf_counter() - t0

            # Means over data-parallel ranks (FastVideo logged rank 0's alone).
            reduced = {name: acc.reduce(v.to(acc.device), reduction="mean") for name, v in loss_sums.items()}
            reduced.update({name: acc.reduce(v.to(acc.device), reduction="mean") for name, v in metric_sums.items()})
            global_samples = samples * acc.num_processes
            samples_run += global_samples
            logs = {name: float(v) for name, v in reduced.items()}
            logs["loss"] = logs["total_loss"]
            logs["lr"] = float(method.lr_scheduler.get_last_lr()[0])
            if grad_norm is not None:
                logs["grad_norm"] = float(grad_norm)
            logs["step_time"] = step_time
            logs["data_wait"] = data_wait
            logs["samples_per_s"] = global_samples / step_time
            logs["latent_tokens_per_s"] = tokens * acc.num_processes / step_time
            logs["epoch"] = self.dataloader.epoch
            self.history.append({"step": self.step, **logs})
            if self.step % log_every == 0 or self.step == max_steps:
                self._log(logs, self.step)
            progress.update(1)
            progress.set_postfix(loss=f"{logs['loss']:.4f}", lr=f"{logs['lr']:.2e}")

            for cb in self.callbacks:
                cb.on_step_end(self, self.step, logs)
            if ckpt_every and self.step % ckpt_every == 0 and self.step < max_steps:
                save_checkpoint(self, self.step)
        progress.close()

        wall = time.perf_counter() - t_start
        for cb in self.callbacks:
            cb.on_train_end(self)
        if cfg.training.checkpoint.save_final:
            student.save_final(acc, self.output_dir)
        acc.wait_for_everyone()
        summary = {
            "steps": steps_run,
            "final_step": self.step,
            "wall_time_s": wall,
            "samples_per_s": samples_run / wall if wall > 0 else math.nan,
            "first_loss": self.history[0]["loss"] if self.history else math.nan,
            "last_loss": self.history[-1]["loss"] if self.history else math.nan,
        }
        if acc.is_main_process:
            logger.info("run summary: %s", summary)
            print(
                f"done: {steps_run} steps in {wall:.1f}s, loss {summary['first_loss']:.4f} -> "
                f"{summary['last_loss']:.4f}; outputs in {self.output_dir}"
            )
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        acc.end_training()
        return summary
