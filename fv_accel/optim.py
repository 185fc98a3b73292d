"""Optimizer and LR schedule of a run (built by `fv_accel.build` from the recipe's `training.optimizer`)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.optimization import get_scheduler


def build_optimizer(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (REFERENCE.md section 6)."""
    opt = cfg.training.optimizer
    if not params:
        raise ValueError("the student has no trainable parameters")
    return torch.optim.AdamW(
        params, lr=opt.learning_rate, betas=tuple(opt.betas), eps=opt.eps, weight_decay=opt.weight_decay
    )


def build_lr_scheduler(cfg: Any, optimizer: torch.optim.Optimizer) -> Any:
    """diffusers' `get_scheduler` with the recipe's schedule, counted in optimizer steps."""
    opt = cfg.training.optimizer
    kwargs: dict[str, Any] = {}
    if opt.lr_scheduler == "cosine_with_restarts":
        kwargs["num_cycles"] = opt.lr_num_cycles
    if opt.lr_scheduler == "polynomial":
        kwargs["power"] = opt.lr_power
        kwargs["lr_end"] = opt.learning_rate * opt.min_lr_ratio if opt.min_lr_ratio > 0 else 1e-7
    if opt.lr_scheduler == "piecewise_constant":
        kwargs["step_rules"] = opt.step_rules
    return get_scheduler(
        opt.lr_scheduler,
        optimizer=optimizer,
        num_warmup_steps=opt.lr_warmup_steps,
        num_training_steps=cfg.training.loop.max_train_steps,
        **kwargs,
    )
