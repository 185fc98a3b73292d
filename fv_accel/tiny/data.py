"""The built-in tiny dataset: procedural clips of moving shapes with captions that describe them.

Clips are rendered, written as real mp4 files with a caption beside each, and encoded by the
preprocessing pipeline with the tiny VAE and text encoder of `fv_accel.tiny.model` (seeded) into
FastVideo's Parquet schema: the tiny default recipe exercises decoding, encoding and training end
to end without the network.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from fv_accel.tiny.clips import COLORS, MOTIONS, ClipSpec, render_clip, tiny_clip_specs, world_clip_specs  # noqa: F401 (re-exported)

logger = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """Where the tiny datasets are cached: `$FV_ACCEL_CACHE`, else `$XDG_CACHE_HOME/fv_accel`, else
    `~/.cache/fv_accel`."""
    root = os.environ.get("FV_ACCEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "fv_accel"
    )
    return Path(root)


# The multimodal world's rendering, in its cached folders' names: a change to its clips changes it.
MULTIMODAL_VERSION = 1
# The clips of a dataset encoded by a student's own model (sizes fitted, a tone per clip for a model
# with sound), in its cached folders' names.
MODEL_ENCODED_VERSION = 1


@dataclass(frozen=True)
class EncodingModel:
    """The model a tiny dataset is encoded with when it is not the tiny Wan: a student's own
    `init_from` (its VAE and text encoder), with the clip size its VAE takes (`fitted_size`)."""

    path: str
    revision: Optional[str]
    family: str

    def identity(self) -> dict:
        """What the cache key holds of the model: its path and the contents of its configs."""
        from fv_accel.models.loading import fetch_config

        local = Path(self.path)
        configs = {
            name: fetch_config(self.path, sub, revision=self.revision, required=False, filename=file) or {}
            for name, sub, file in (
                ("index", None, "model_index.json"), ("vae", "vae", "config.json"),
                ("transformer", "transformer", "config.json"), ("text_encoder", "text_encoder", "config.json"),
            )
        }
        digest = hashlib.sha1(json.dumps(configs, sort_keys=True, default=str).encode()).hexdigest()
        return {
            "model": str(local.resolve()) if local.is_dir() else self.path,
            "revision": self.revision,
            "model_configs": digest,
        }

    def fitted_size(self, num_frames: int, height: int, width: int) -> tuple[int, int, int]:
        """The nearest clip size the model's VAE encodes, never smaller: the frame count rounded up
        to the VAE's rule (tk+1 for a temporal compression t) and each side up to its multiple
        (`EncodingSpec.side_multiple`); one log line names both sizes."""
        from fv_accel.models import family_of_repo

        spec = family_of_repo(self.path, self.revision).encoding_spec(self.path, self.revision)
        t = int(spec.scale_factor_temporal)
        mh, mw = spec.side_multiple
        size = (
            (num_frames - 1 + t - 1) // t * t + 1,
            -(-height // mh) * mh,
            -(-width // mw) * mw,
        )
        logger.info(
            "tiny dataset for the %s model '%s': %d frames at %dx%d -> %d frames at %dx%d (its VAE encodes "
            "%dk+1 frames, sides multiples of %dx%d)", self.family, self.path, num_frames, height, width, *size, t, mh, mw,
        )
        return size


def student_encoding_model(cfg) -> Optional[EncodingModel]:
    """The model a run's `data_path: tiny` is encoded with: None (the tiny Wan) for a Wan-family
    student (built inline or loaded: the tiny Wan's latents and text embeddings are its kind), else
    the student's own `init_from`, which must hold a VAE (a one-line ConfigError otherwise)."""
    from fv_accel.config import ConfigError
    from fv_accel.models import family_of
    from fv_accel.models.loading import fetch_config

    st = cfg.models.student
    if st.init_from is None:
        return None
    family = family_of(cfg).family
    # A family on the Wan's latents and text encoder (its `role_families` name wan: AnyFlow) takes them too.
    if family == "wan" or "wan" in getattr(family_of(cfg), "role_families", ()):
        return None
    if not fetch_config(st.init_from, "vae", revision=st.revision, required=False):
        raise ConfigError(
            f"training.data.data_path: tiny: the {family} student's tiny clips are encoded with its own model, but "
            f"models.student.init_from '{st.init_from}' has no vae/config.json; give a dataset preprocessed with "
            "the student's model (python -m fv_accel.preprocess --model ...)"
        )
    return EncodingModel(str(st.init_from), st.revision, family)


def tiny_dataset_dir(data_cfg, cache_dir: Optional[str] = None, model: Optional[EncodingModel] = None) -> Path:
    settings = {
        "n": data_cfg.tiny_num_clips,
        "frames": data_cfg.tiny_num_frames,
        "h": data_cfg.tiny_height,
        "w": data_cfg.tiny_width,
        "seed": data_cfg.seed,
        # 4: the tiny Wan model ships the real repo's UniPC scheduler (fv_accel.tiny.model);
        # 5: unconditional_text.safetensors beside the shards
        "v": 5,
    }
    if data_cfg.tiny_world != "default":  # the default world's folders keep their names
        settings.update(world=data_cfg.tiny_world, captions=data_cfg.tiny_num_captions, world_v=MULTIMODAL_VERSION)
    if model is not None:  # the tiny Wan's folders keep their names
        settings.update(model.identity(), model_v=MODEL_ENCODED_VERSION)
    key = hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir or data_cfg.tiny_cache_dir or default_cache_dir())
    return root / f"tiny-data-{key}"


TINY_FPS = 8.0


def ensure_tiny_dataset(data_cfg, cache_dir: Optional[str] = None, model: Optional[EncodingModel] = None) -> Path:
    """Build the tiny dataset once (idempotent); returns the folder holding its Parquet shards.

    The clips are rendered, written as real mp4 files with a same-named .txt caption beside each
    (`videos/`), then encoded by the preprocessing pipeline (the code behind `python -m
    fv_accel.preprocess`) with the tiny model (`tiny-model/`) into `latents/`; with `model`, by that
    model instead, at the nearest size its VAE takes (`EncodingModel.fitted_size`).
    """
    from fv_accel.data.schema import DATASET_INFO

    frames, height, width = data_cfg.tiny_num_frames, data_cfg.tiny_height, data_cfg.tiny_width
    if model is not None:
        frames, height, width = model.fitted_size(frames, height, width)
    out = tiny_dataset_dir(data_cfg, cache_dir, model)
    if (out / "latents" / DATASET_INFO).is_file():  # written last: its presence means done
        return out / "latents"
    build_tiny_dataset(
        out,
        num_clips=data_cfg.tiny_num_clips,
        num_frames=frames,
        height=height,
        width=width,
        seed=data_cfg.seed,
        world=data_cfg.tiny_world,
        num_captions=data_cfg.tiny_num_captions,
        model=model,
    )
    return out / "latents"


TONE_RATE = 44100


def clip_tone(k: int, num_frames: int) -> tuple:
    """The sound of tiny clip k: a stereo sine of its own pitch (220 Hz times 1 + k mod 8) lasting
    as long as its picture, at 44.1 kHz: (waveform [2, samples] in [-1, 1], sample rate)."""
    import numpy as np

    t = np.arange(int(round(TONE_RATE * num_frames / TINY_FPS))) / TONE_RATE
    tone = (0.5 * np.sin(2 * np.pi * 220.0 * (1 + k % 8) * t)).astype(np.float32)
    return np.stack([tone, tone]), TONE_RATE


def write_tiny_videos(
    folder: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int,
    world: str = "default", num_captions: int = 4, sound: bool = False,
) -> list[Path]:
    """Render the procedural clips of a tiny world (`world_clip_specs`) into `folder` as mp4 files
    with their captions (skips existing ones); with `sound`, each carries its tone (`clip_tone`)."""
    from fv_accel.data.video import write_video

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, spec in enumerate(world_clip_specs(world, num_clips, seed, num_captions)):
        video = folder / f"tiny-{k:04d}.mp4"
        caption = video.with_suffix(".txt")
        if not caption.is_file():
            caption.write_text(spec.caption + "\n", encoding="utf-8")
        if not video.is_file():
            frames = render_clip(spec, num_frames=num_frames, height=height, width=width)
            write_video(video, frames, fps=TINY_FPS, audio=clip_tone(k, num_frames) if sound else None)
        paths.append(video)
    return paths


def build_tiny_dataset(
    out: Path, *, num_clips: int, num_frames: int, height: int, width: int, seed: int,
    world: str = "default", num_captions: int = 4, model: Optional[EncodingModel] = None,
) -> Path:
    """Videos, tiny model (or `model`), then latents via the preprocessing pipeline; returns the
    latents folder."""
    from fv_accel.data.video import FrameSampling
    from fv_accel.models.encoders import AUDIO
    from fv_accel.preprocess import preprocess
    from fv_accel.tiny.model import write_tiny_model

    sound = False
    if model is None:
        model_dir = out / "tiny-model"
        if not (model_dir / "model_index.json").is_file():
            write_tiny_model(model_dir, seed=0)
        encoder, revision = str(model_dir), None
    else:
        from fv_accel.models import family_of_repo

        encoder, revision = model.path, model.revision
        sound = AUDIO in family_of_repo(encoder, revision).encoding_spec(encoder, revision).conditioning
    write_tiny_videos(
        out / "videos", num_clips=num_clips, num_frames=num_frames, height=height, width=width, seed=seed,
        world=world, num_captions=num_captions, sound=sound,
    )
    sampling = FrameSampling(num_frames=(num_frames,), buckets=((height, width),), seed=seed)
    # CPU and fp32 whatever the machine, so the cached dataset is the same everywhere.
    result = preprocess(
        encoder, str(out / "videos"), out / "latents", sampling, revision=revision,
        device=torch.device("cpu"), dtype=torch.float32,
    )
    if result.encoded != num_clips:
        raise RuntimeError(f"tiny dataset: {result.summary} in {out / 'latents'}; expected all {num_clips} clips")
    return out / "latents"
