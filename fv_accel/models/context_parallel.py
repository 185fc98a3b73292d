"""Context parallelism of a diffusers transformer (`training.model.context_parallel`).

The processes form a mesh (data parallel, ring, ulysses): rank = d * (ring * ulysses) + r * ulysses + u. The
`ring x ulysses` processes of one context-parallel (CP) group get the same batch, noise and timesteps;
diffusers' own machinery (`ModelMixin.enable_parallelism` with the transformer's `_cp_plan`) splits
its token sequence among them at the first block, runs attention as Ulysses (an all-to-all turns
[B, L/cp, H, D] into [B, L, H/cp, D], so each process attends over the whole sequence for a share
of the heads) and gathers the output after `proj_out`. Every process then computes the loss on the
whole output.

Gradients: each process's parameter gradient is the part of the loss gradient that flows through
its own tokens (the gather's backward keeps the local slice), so the true gradient of a CP group is
the SUM over its processes. The engine averages over all dp x cp processes; `gradient_scale` (cp)
turns that average into the mean over data-parallel groups of the true gradient.

Block-causal self-attention (fv_accel.models.attention) keeps its rule under Ulysses: its processor
hands diffusers' Ulysses all-to-all an attention function that applies the rotary embedding and the
block-causal rule to the whole sequence (see `CausalSelfAttnProcessor`); the rotary tables are then
left whole (`causal_cp_plan`). Ring attention is refused by the recipe check (fv_accel.config).
"""

from __future__ import annotations

from typing import Any

import torch

from fv_accel.config import ConfigError

KEY = "training.model.context_parallel"


def describe_layout(ulysses: int, ring: int, world_size: int) -> str:
    return f"context parallel: ulysses {ulysses} x ring {ring} | data parallel {world_size // (ulysses * ring)}"


def check_world_size(cp: Any, world_size: int) -> None:
    if world_size % cp.degree:
        raise ConfigError(
            f"{KEY}: ulysses {cp.ulysses} x ring {cp.ring} = {cp.degree} does not divide the {world_size} "
            f"launched process(es): launch a multiple of {cp.degree} processes"
        )


def data_parallel_layout(cp: Any, world_size: int, rank: int) -> tuple[int, int]:
    """(data-parallel size, data-parallel rank): the processes of one CP group share a dp rank."""
    return world_size // cp.degree, rank // cp.degree


def check_transformer(transformer: torch.nn.Module, cp: Any) -> None:
    """One line for a transformer the recipe's context parallelism cannot split."""
    name = type(transformer).__name__
    if getattr(transformer, "_cp_plan", None) is None:
        raise ConfigError(
            f"{KEY}: ulysses {cp.ulysses} x ring {cp.ring}: {name} has no context-parallel plan in diffusers "
            "(`_cp_plan`); remove the key for this family"
        )
    heads = int(transformer.config.get("num_attention_heads", 0) or 0)
    if heads % cp.ulysses:
        raise ConfigError(
            f"{KEY}.ulysses: {cp.ulysses} does not divide the {heads} attention heads of {name}: choose a divisor"
        )


def causal_cp_plan(transformer: torch.nn.Module) -> dict:
    """The transformer's plan without splitting the rotary tables: the block-causal processor applies
    them after the Ulysses all-to-all, on the whole sequence (and reads the token layout they carry)."""
    return {name: part for name, part in transformer._cp_plan.items() if name != "rope"}


def _token_count_check(cp_degree: int):
    """A forward pre-hook: the token sequence must split evenly across the CP group."""

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if hidden is None:
            return
        if hidden.ndim == 5:  # [B, C, F, H, W] latents, patchified by the transformer
            patch = module.config.patch_size
            pt, ph, pw = (patch if isinstance(patch, (list, tuple)) else (1, patch, patch))
            tokens = (hidden.shape[2] // pt) * (hidden.shape[3] // ph) * (hidden.shape[4] // pw)
        else:  # [B, S, C] packed tokens
            tokens = hidden.shape[1]
        if tokens % cp_degree:
            raise ValueError(
                f"{KEY}: {tokens} latent tokens per clip do not split across {cp_degree} processes: "
                f"use clip sizes whose token count is a multiple of {cp_degree}"
            )

    return hook


def _enable_on_cpu(transformer: torch.nn.Module, config: Any, plan: dict) -> None:
    """`ModelMixin.enable_parallelism` for a machine without an accelerator: diffusers picks the
    device as `rank % torch.accelerator.device_count()`, a division by zero there. The same steps,
    with the CPU as device."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ParallelConfig

    parallel = ParallelConfig(context_parallel_config=config)
    parallel.setup(
        torch.distributed.get_rank(), torch.distributed.get_world_size(), torch.device("cpu"), mesh=config.mesh
    )
    transformer._parallel_config = parallel
    for module in transformer.modules():
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            backend = getattr(processor, "_attention_backend", None)
            if backend not in (None, "native"):
                raise ConfigError(f"{KEY}: attention backend {backend!r} runs no context parallelism on CPU")
            processor._parallel_config = parallel
    apply_context_parallel(transformer, config, plan)


def build_mesh(cp: Any, world_size: int):
    """The (dp, ring, ulysses) device mesh; diffusers takes its (ring, ulysses) part."""
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(
        device_type, (world_size // cp.degree, cp.ring, cp.ulysses), mesh_dim_names=("dp", "ring", "ulysses")
    )


def enable_context_parallel(transformers: list[torch.nn.Module], cp: Any, *, causal: bool) -> None:
    """Split each transformer's sequence across the CP groups of the running process group."""
    from diffusers import ContextParallelConfig

    world_size = torch.distributed.get_world_size()
    check_world_size(cp, world_size)
    for transformer in transformers:
        check_transformer(transformer, cp)
    mesh = build_mesh(cp, world_size)
    for transformer in transformers:
        config = ContextParallelConfig(ulysses_degree=cp.ulysses, ring_degree=cp.ring, mesh=mesh["ring", "ulysses"])
        plan = causal_cp_plan(transformer) if causal else dict(transformer._cp_plan)
        if torch.accelerator.device_count() > 0:
            transformer.enable_parallelism(config=config, cp_plan=plan)
        else:
            _enable_on_cpu(transformer, config, plan)
        transformer.register_forward_pre_hook(_token_count_check(cp.degree), with_kwargs=True)
