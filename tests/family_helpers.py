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


def write_sound_clips(folder: Path, *, fps: float = 8.0, num_frames: int = 17, size: int = 64) -> dict[str, Path]:
    """Three procedural clips written with PyAV, each with a caption: `tone.mp4` (a stereo 440 Hz
    tone at 44.1 kHz as long as the picture, AAC), `silent.mp4` (no audio track) and `short.mp4`
    (a mono tone lasting the first second only)."""
    import numpy as np

    from fv_accel.data.video import write_video
    from fv_accel.tiny.clips import render_clip, tiny_clip_specs

    folder.mkdir(parents=True, exist_ok=True)
    rate = 44100
    t = np.arange(int(rate * num_frames / fps)) / rate
    tone = (0.5 * np.sin(2 * np.pi * 440.0 * t)).astype(np.float32)
    sounds = {"tone": np.stack([tone, tone]), "silent": None, "short": tone[None, :rate]}
    paths = {}
    for (name, sound), spec in zip(sounds.items(), tiny_clip_specs(3, seed=0)):
        frames = render_clip(spec, num_frames=num_frames, height=size, width=size)
        paths[name] = write_video(folder / f"{name}.mp4", frames, fps=fps, audio=None if sound is None else (sound, rate))
        (folder / f"{name}.txt").write_text(spec.caption + "\n", encoding="utf-8")
    return paths


def preprocess_sound_clips(model: Path, root: Path, **kwargs):
    """`write_sound_clips` under `root/clips`, preprocessed at 17 frames, 64x64 with `model` (a model
    with sound: LTX-2) into `root/data`; returns the preprocessing result."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess

    write_sound_clips(root / "clips")
    sampling = FrameSampling(num_frames=(17,), buckets=((64, 64),), seed=0)
    return preprocess(str(model), str(root / "clips"), root / "data", sampling, device=CPU, dtype=torch.float32, **kwargs)
