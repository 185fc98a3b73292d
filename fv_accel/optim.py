"""Optimizer and LR schedule of a run (built by `fv_accel.build` from the recipe's `training.optimizer`).

`training.optimizer.name` picks the optimizer: torch AdamW (REFERENCE.md section 6), bitsandbytes'
8-bit AdamW, prodigyopt's Prodigy or transformers' Adafactor. `optimizer_state_bytes` says how
much state each keeps per process.
"""

from __future__ import annotations

import copy
import logging
import math
from typing import Any, Optional, Sequence

import torch
from diffusers.optimization import get_scheduler

from fv_accel.config import ConfigError

logger = logging.getLogger(__name__)

# Devices with torch's fused AdamW kernel (torch 2.13: CPU and the accelerators).
FUSED_ADAMW_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")
# Param-group entries that are not settings: the LR schedule's, and Prodigy's running step-size
# estimate. A resume restores them from the checkpoint; every other entry comes from the recipe.
GROUP_STATE_KEYS = frozenset({"params", "lr", "initial_lr", "d", "d_max", "d_numerator", "d_denom", "d_hat", "k"})
# bitsandbytes 0.50.2: tensors under this many elements keep fp32 state; 8-bit state is
# quantised block-wise, one fp32 absmax per block, with one 256-entry fp32 code book per moment.
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCKSIZE = 256
BNB_QMAP_ENTRIES = 256


def adamw_implementation(requested: str, params: Sequence[torch.Tensor]) -> str:
    """The AdamW kernel that runs: `training.optimizer.implementation`, with auto taking fused
    where every parameter is a floating-point tensor on a device that has the kernel. Without it,
    foreach on an accelerator, for_loop on CPU (torch's foreach is slower there)."""
    fused_ok = all(torch.is_floating_point(p) and p.device.type in FUSED_ADAMW_DEVICES for p in params)
    if requested == "auto":
        if fused_ok:
            return "fused"
        return "for_loop" if any(p.device.type == "cpu" for p in params) else "foreach"
    if requested == "fused" and not fused_ok:
        kinds = sorted({f"{p.dtype} on {p.device.type}" for p in params})
        raise ConfigError(
            f"training.optimizer.implementation: fused needs floating-point parameters on "
            f"{', '.join(FUSED_ADAMW_DEVICES)}; this run has {', '.join(kinds)} (use auto)"
        )
    return requested


# torch.optim.AdamW's arguments for each kernel of adamw_implementation.
ADAMW_KERNEL_ARGS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for_loop": dict(foreach=False)}


def build_optimizer(cfg: Any, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The recipe's optimizer over the trainable parameters; one log line says which runs."""
    opt = cfg.training.optimizer
    if not params:
        raise ValueError("the student has no trainable parameters")
    common = dict(lr=opt.learning_rate, eps=opt.eps, weight_decay=opt.weight_decay)
    if opt.name == "adamw":
        impl = adamw_implementation(opt.implementation, params)
        logger.info("optimizer AdamW (%s)", impl)
        return torch.optim.AdamW(params, betas=tuple(opt.betas), **common, **ADAMW_KERNEL_ARGS[impl])
    if opt.name == "adamw_8bit":
        import bitsandbytes as bnb

        logger.info(
            "optimizer AdamW8bit (bitsandbytes %s): 8-bit moments for tensors of >= %d elements, fp32 below",
            bnb.__version__, BNB_MIN_8BIT_SIZE,
        )
        return bnb.optim.AdamW8bit(params, betas=tuple(opt.betas), min_8bit_size=BNB_MIN_8BIT_SIZE, **common)
    if opt.name == "prodigy":
        from prodigyopt import Prodigy

        logger.info(
            "optimizer Prodigy (d_coef %g, safeguard_warmup %s, use_bias_correction %s); its step size is "
            "adapted and training.optimizer.learning_rate (%g) multiplies it",
            opt.prodigy_d_coef, opt.prodigy_safeguard_warmup, opt.prodigy_use_bias_correction, opt.learning_rate,
        )
        if opt.learning_rate < 0.1:
            logger.warning(
                "training.optimizer.learning_rate is %g with name: prodigy; Prodigy's learning rate is usually 1.0",
                opt.learning_rate,
            )
        return Prodigy(
            params,
            betas=tuple(opt.betas),
            decouple=True,
            d_coef=opt.prodigy_d_coef,
            safeguard_warmup=opt.prodigy_safeguard_warmup,
            use_bias_correction=opt.prodigy_use_bias_correction,
            **common,
        )
    if opt.name == "adafactor":
        from transformers.optimization import Adafactor

        logger.info(
            "optimizer Adafactor (transformers; the recipe's learning rate, factored second moment, no first "
            "moment); training.optimizer.betas %s and eps %g are not used by Adafactor",
            list(opt.betas), opt.eps,
        )
        return Adafactor(
            params,
            lr=opt.learning_rate,
            weight_decay=opt.weight_decay,
            relative_step=False,
            scale_parameter=False,
            warmup_init=False,
        )
    raise ConfigError(f"training.optimizer.name: unknown optimizer {opt.name!r}")


def check_optimizer_engine(cfg: Any, engine: str) -> None:
    """Only AdamW runs under the sharding engines: bitsandbytes' kernels and Adafactor's factored
    state do not take FSDP2's DTensor shards, Prodigy's step size would be estimated from each
    rank's shard alone, and DeepSpeed ZeRO flattens the parameters (Adafactor's matrices) and
    accepts only optimizers it has tested."""
    name = cfg.training.optimizer.name
    if engine in ("fsdp2", "deepspeed") and name != "adamw":
        raise ConfigError(
            f"training.optimizer.name: {name} does not run under {'FSDP2' if engine == 'fsdp2' else 'DeepSpeed'}; "
            "use adamw there, or DDP / one process for this optimizer"
        )


def settings_of(optimizer: Any) -> list[dict]:
    """Each param group's settings (every entry but the LR schedule's and the running state)."""
    return [{k: v for k, v in g.items() if k not in GROUP_STATE_KEYS} for g in optimizer.param_groups]


def optimizer_state_bytes(
    name: str,
    shapes: Sequence[Sequence[int]],
    param_dtype: torch.dtype = torch.float32,
    *,
    beta1: float = 0.9,
    all_zero: Optional[Sequence[bool]] = None,
) -> int:
    """Bytes of optimizer state one process holds for trainable tensors of these shapes (under
    FSDP2 / ZeRO: this process's shards), once every tensor has taken a step.

    adamw: two moments in the parameter dtype, and a 4-byte step count per tensor.
    adamw_8bit: two uint8 moments and one fp32 absmax per 256-element block for each tensor of
    >= 4096 elements, two fp32 moments for smaller ones, and two shared 256-entry fp32 code books.
    prodigy: the moments (no first with beta1 0), the running sum `s` and the starting point `p0`,
    each the parameter's size and dtype; `p0` is one element for a tensor that is all zeros at its
    first step (`all_zero`, e.g. LoRA's B matrices). adafactor (no first moment): a row and a column
    mean of the squared gradient for each tensor of two or more dimensions, else a full one, and
    the RMS, in fp32 for half-precision parameters (the parameter dtype otherwise).
    """
    size = torch.empty((), dtype=param_dtype).element_size()
    zero = list(all_zero) if all_zero is not None else [False] * len(shapes)
    total = 0
    any_8bit = False
    for shape, is_zero in zip(shapes, zero):
        n = math.prod(shape)
        if name == "adamw":
            total += 2 * n * size + 4
        elif name == "adamw_8bit":
            if n >= BNB_MIN_8BIT_SIZE:
                any_8bit = True
                total += 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCKSIZE)
            else:
                total += 2 * n * 4
        elif name == "prodigy":
            total += ((2 if beta1 > 0 else 1) * n + n + (1 if is_zero else n)) * size
        elif name == "adafactor":
            state = 4 if param_dtype in (torch.float16, torch.bfloat16) else size
            second = math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else n
            total += (second + 1) * state
        else:
            raise ValueError(f"unknown optimizer {name!r}")
    if any_8bit:
        total += 2 * BNB_QMAP_ENTRIES * 4
    return total


# LR schedules whose shape does not depend on training.loop.max_train_steps (diffusers'
# get_scheduler ignores num_training_steps for them).
LENGTH_FREE_SCHEDULES = ("constant", "constant_with_warmup", "piecewise_constant")


def schedule_length_change(cfg: Any, old_steps: int, step: int) -> str:
    """What a new `training.loop.max_train_steps` does to the LR schedule of a run resumed at `step`
    (it ran `old_steps` so far): nothing for a schedule that ignores the length; otherwise the
    schedule is laid out again over the new length from the next step on (its LR there, and the
    LR the old schedule gave at `step`)."""
    opt = cfg.training.optimizer
    new_steps = cfg.training.loop.max_train_steps
    if opt.lr_scheduler in LENGTH_FREE_SCHEDULES:
        return (
            f"the {opt.lr_scheduler} LR schedule does not depend on the run's length: the run goes on as one straight "
            f"run of {new_steps} steps would"
        )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=opt.learning_rate)
    old_cfg = copy.deepcopy(cfg)
    old_cfg.training.loop.max_train_steps = old_steps
    old_fn = build_lr_scheduler(old_cfg, probe).lr_lambdas[0]
    new_fn = build_lr_scheduler(cfg, probe).lr_lambdas[0]
    return (
        f"the {opt.lr_scheduler} LR schedule depends on the run's length: from step {step + 1} it follows the "
        f"{new_steps}-step schedule (LR {opt.learning_rate * new_fn(step):.3g} there; the {old_steps}-step schedule "
        f"gave {opt.learning_rate * old_fn(max(step - 1, 0)):.3g} at step {step}), "
        f"so the weights differ from those of a straight {new_steps}-step run"
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
