"""Shared by the checkpoint, fault and bad-input tests: a small latent dataset written in FastVideo's
schema, a one-block transformer recipe, and running a build in-process more than once per test."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from fv_accel.config import default_recipe

# One block, 2 heads of 8: a step takes milliseconds on CPU, and the math is the real Wan's.
SMALL_TRANSFORMER = {
    "patch_size": [1, 2, 2],
    "num_attention_heads": 2,
    "attention_head_dim": 8,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 16,
    "ffn_dim": 32,
    "num_layers": 1,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "rope_max_seq_len": 32,
}


def write_latent_dataset(
    folder: Path,
    *,
    num_clips: int = 6,
    channels: int = 16,
    frames: int = 3,
    height: int = 4,
    width: int = 4,
    text_dim: int = 32,
    seed: int = 0,
) -> str:
    """Random latents [C, T, H, W] and text embeddings as one Parquet shard; returns the folder.
    Its fv_dataset.json records latent statistics 0 and 1 (the latents are drawn normalised)."""
    from fv_accel.data.schema import make_row, write_dataset_info, write_rows

    g = torch.Generator().manual_seed(seed)
    rows = [
        make_row(
            sample_id=f"clip-{i}",
            latent=torch.randn(channels, frames, height, width, generator=g),
            text_embedding=torch.randn(7, text_dim, generator=g),
            caption=f"clip {i}",
        )
        for i in range(num_clips)
    ]
    write_rows(rows, Path(folder) / "data.parquet")
    write_dataset_info(folder, model=None, latent_stats=([0.0] * channels, [1.0] * channels))
    return str(folder)


def small_overrides(out_dir: Path, data_path: str, **extra) -> dict:
    overrides = {
        "models.student.transformer_config": dict(SMALL_TRANSFORMER),
        "training.data.data_path": data_path,
        "training.data.train_batch_size": 1,
        "training.loop.gradient_accumulation_steps": 2,
        "training.loop.max_train_steps": 10,
        # Warm-up across the resume point: the LR schedule state must come back too.
        "training.optimizer.lr_warmup_steps": 7,
        "training.checkpoint.output_dir": str(out_dir),
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "training.checkpoint.checkpoints_total_limit": 0,
        "training.checkpoint.save_final": False,
        "training.tracker.trackers": ["none"],
        # EMA on, so its state goes through the checkpoints too; no sampling (needs a VAE).
        "callbacks.ema.enable": True,
        "callbacks.ema.decay": 0.9,
        "callbacks.validation.enable": False,
    }
    overrides.update(extra)
    return overrides


def reset_accelerate() -> None:
    """A second Accelerator in the same process needs Accelerate's singletons cleared."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def build(method: str, overrides: dict, callbacks: Optional[list] = None):
    from fv_accel.build import build_from_config

    reset_accelerate()
    return build_from_config(default_recipe(method), overrides, callbacks=callbacks)


def weights(run) -> dict[str, torch.Tensor]:
    model = run.accelerator.unwrap_model(run.method.student.transformer)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def ema_shadow(run) -> list[torch.Tensor]:
    """The EMA callback's fp32 shadow tensors (empty when EMA is off)."""
    for cb in run.callbacks:
        ema = getattr(cb, "ema", None)
        if ema is not None:
            return [s.detach().clone() for s in ema.shadow]
    return []


def output_files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*")) if folder.exists() else []


def build_fails(method: str, overrides: dict, exc_type, message: str) -> str:
    """The build fails with `exc_type`, one line holding `message`, and leaves the output folder as it was."""
    import pytest

    out = Path(overrides["training.checkpoint.output_dir"])
    before = output_files(out)
    with pytest.raises(exc_type) as err:
        build(method, overrides)
    text = str(err.value)
    assert message in text, text
    assert "\n" not in text
    assert output_files(out) == before, "a failed build must leave the output folder as it was"
    return text
