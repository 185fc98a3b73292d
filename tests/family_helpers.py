"""What the family tests share: a tiny family model's preprocessed clips, and the overrides of a
short training run on them."""

from __future__ import annotations

from pathlib import Path

import torch
from conftest import tiny_overrides

CPU = torch.device("cpu")


def preprocess_tiny_clips(model: Path, root: Path) -> Path:
    """2 procedural clips of 17 frames at 64x64 under `root/clips`, preprocessed with `model`'s own
    encoders into `root/data` (returned)."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess
    from fv_accel.tiny.data import write_tiny_videos

    write_tiny_videos(root / "clips", num_clips=2, num_frames=17, height=64, width=64, seed=0)
    sampling = FrameSampling(num_frames=(17,), buckets=((64, 64),), seed=0)
    result = preprocess(str(model), str(root / "clips"), root / "data", sampling, device=CPU, dtype=torch.float32)
    assert result.encoded == 2, result.summary
    return root / "data"


def run_overrides(tmp: Path, model: Path, data: Path, **extra) -> dict:
    """A 2-step run of `model` on `data` into `tmp/out`: tiny_overrides (no checkpoints, trackers,
    samples, EMA or plots), batch size 1."""
    return tiny_overrides(
        tmp,
        **{
            "models.student.init_from": str(model),
            "training.data.data_path": str(data),
            "training.data.train_batch_size": 1,
            "training.loop.max_train_steps": 2,
            **extra,
        },
    )
