"""TrainingMethod: knows the math (what is noised, what the loss is), never the model's internals."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Union

import torch
from accelerate import PartialState
from diffusers.optimization import get_scheduler

from fv_accel.models.base import ModelBase
from fv_accel.seeding import sample_generator_seed

LogScalar = Union[float, int]


class TrainingMethod:
    """Base of the training methods. Owns the random stream, the optimizer and the LR schedule."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        self.cfg = cfg
        self.role_models = role_models
        # The seed's methods read `method_config.get(...)`: keep a plain mapping of the section.
        self.method_config: dict[str, Any] = dataclasses.asdict(cfg.method)
        self.training_config = cfg.training
        state = PartialState()
        self.device = state.device
        self.process_index = state.process_index
        self.seed = int(cfg.training.data.seed)
        self.noise_rng = cfg.training.loop.noise_rng
        # One generator per rank seeded seed + rank (FastVideo's "cuda_generator", on the device).
        self.cuda_generator = torch.Generator(device=self.device).manual_seed(self.seed + self.process_index)
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: Any = None

    @property
    def student(self) -> ModelBase:
        return self.role_models["student"]

    def _step_result(
        self, loss: torch.Tensor, tb: Any, loss_key: str
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
        """The (loss_map, outputs, metrics) every method's single_train_step returns."""
        loss_map = {"total_loss": loss, loss_key: loss}
        outputs: dict[str, Any] = {"_fv_backward": (tb.timesteps, tb.attn_metadata), "training_batch": tb}
        # Tensors, not floats: converting here would sync the device every micro-step.
        metrics: dict[str, Any] = {"mean_sigma": tb.sigmas.detach().float().mean()}
        return loss_map, outputs, metrics

    def _require_trainable_student(self, label: str) -> None:
        if "student" not in self.role_models:
            raise ValueError(f"{label} requires role 'student'")
        if not self.student._trainable:
            raise ValueError(f"{label} requires student to be trainable")

    def _infer_attn_kind(self) -> Literal["dense", "vsa"]:
        # Video sparse attention is a FastVideo kernel with no diffusers counterpart: always dense.
        return "dense"

    def batch_generator(self, batch: dict) -> Union[torch.Generator, list[torch.Generator]]:
        """The generator(s) this micro-batch draws from (see `training.loop.noise_rng`)."""
        if self.noise_rng == "rank":
            return self.cuda_generator
        indices = batch["sample_index"].tolist()
        epochs = batch["epoch"].tolist()
        return [
            torch.Generator(device=self.device).manual_seed(sample_generator_seed(self.seed, e, i))
            for e, i in zip(epochs, indices)
        ]

    def _init_optimizers_and_schedulers(self) -> None:
        opt = self.training_config.optimizer
        params = self.student.trainable_parameters()
        if not params:
            raise ValueError("the student has no trainable parameters")
        self.optimizer = torch.optim.AdamW(
            params,
            lr=opt.learning_rate,
            betas=tuple(opt.betas),
            eps=opt.eps,
            weight_decay=opt.weight_decay,
        )
        kwargs: dict[str, Any] = {}
        if opt.lr_scheduler == "cosine_with_restarts":
            kwargs["num_cycles"] = opt.lr_num_cycles
        if opt.lr_scheduler == "polynomial":
            kwargs["power"] = opt.lr_power
            kwargs["lr_end"] = opt.learning_rate * opt.min_lr_ratio if opt.min_lr_ratio > 0 else 1e-7
        if opt.lr_scheduler == "piecewise_constant":
            kwargs["step_rules"] = opt.step_rules
        self.lr_scheduler = get_scheduler(
            opt.lr_scheduler,
            optimizer=self.optimizer,
            num_warmup_steps=opt.lr_warmup_steps,
            num_training_steps=self.training_config.loop.max_train_steps,
            **kwargs,
        )

    # ---- the public face (seed) ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        raise NotImplementedError

    def backward(
        self, loss_map: dict[str, torch.Tensor], outputs: dict[str, Any], *, grad_accum_rounds: int = 1
    ) -> None:
        grad_accum_rounds = max(1, int(grad_accum_rounds))
        self.student.backward(loss_map["total_loss"], outputs.get("_fv_backward"), grad_accum_rounds=grad_accum_rounds)

    # Which recipe keys change this method's math (checked on resume).
    def math_signature(self) -> dict[str, Any]:
        return {
            "method.name": self.cfg.method.name,
            "models.student.flow_shift": self.cfg.models.student.flow_shift,
            "training.loop.max_train_steps": self.training_config.loop.max_train_steps,
            "training.optimizer.lr_scheduler": self.training_config.optimizer.lr_scheduler,
        }
