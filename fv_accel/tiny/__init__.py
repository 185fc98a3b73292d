"""The built-in tiny world: seeded tiny models in the Hub layout and the tiny clip dataset.

It sits above preprocessing (the tiny dataset is made by the real preprocessing pipeline) and
below `build` and validation, which use it for the `tiny` data path.

This module is the tiny world's one door: code outside fv_accel/tiny/ uses it only through the
names in `__all__` (tests/test_layering.py checks), each importing what it needs when called:

- the `data_path: tiny` source: `tiny_dataset` (its folder of Parquet shards, built on first use,
  encoded by the tiny Wan or by a student of another family's own model)
  and `tiny_caption_words` (the words of the captions its clips carry);
- the tiny model builder: `tiny_models` (every tiny model by name) and `tiny_model_defaults`;
- the multimodal world's measure: `tiny_clip_modes` (each sample's distance to the nearest clip
  of its caption);
- where a clip's shape is: `tiny_shape_centres` (the tiny demo's reward, fv_accel/rewards/tiny_left.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

__all__ = [
    "tiny_dataset", "tiny_caption_words", "tiny_models", "tiny_model_defaults", "tiny_clip_modes", "tiny_shape_centres",
]


def tiny_dataset(data_cfg: Any, cache_dir: Optional[str] = None, run_cfg: Any = None) -> Path:
    """The `data_path: tiny` source: the folder holding the tiny dataset's Parquet shards for these
    `training.data` settings, rendered and encoded once, then cached (fv_accel/tiny/data.py). With
    `run_cfg` (the run's config), the clips follow its student: encoded by the tiny Wan for a Wan
    student, else by the student's own model at the nearest size its VAE takes, with a tone per clip
    for a model with sound (`student_encoding_model`)."""
    from fv_accel.tiny.data import ensure_tiny_dataset, student_encoding_model

    model = student_encoding_model(run_cfg) if run_cfg is not None else None
    return ensure_tiny_dataset(data_cfg, cache_dir, model)


def tiny_caption_words() -> dict[str, tuple]:
    """The words of the tiny clips' captions, "a <color> <shape> moving <motion> on a <background>
    background": {"colors", "shapes", "motions", "backgrounds"} (fv_accel/tiny/clips.py)."""
    from fv_accel.tiny.clips import BACKGROUNDS, COLORS, MOTIONS, SHAPES

    return {"colors": tuple(COLORS), "shapes": tuple(SHAPES), "motions": tuple(MOTIONS), "backgrounds": tuple(BACKGROUNDS)}


def tiny_models() -> dict:
    """The tiny model builder: name -> TinyModel (`.write(folder, seed)`, `.layout`, `.summary`),
    the Wan variants first (fv_accel/tiny/registry.py)."""
    from fv_accel.tiny.registry import all_tiny_models

    return all_tiny_models()


def tiny_model_defaults() -> tuple[str, dict[str, str]]:
    """(the tiny model written when none is named, the older `--class` names -> model names)."""
    from fv_accel.tiny.model import DEFAULT_TINY_MODEL, MODEL_CLASS_ALIASES

    return DEFAULT_TINY_MODEL, dict(MODEL_CLASS_ALIASES)


def tiny_clip_modes(data_cfg: Any, cache_dir: Optional[str] = None) -> Any:
    """The clips of the tiny dataset of these `training.data` settings (built on first use) by
    caption, with their latents, tracks and VAE: a `ClipModes` whose `.nearest(latents, caption)`
    scores samples against the nearest clip of their caption (fv_accel/tiny/modes.py)."""
    from fv_accel.tiny.data import ensure_tiny_dataset
    from fv_accel.tiny.modes import ClipModes

    return ClipModes.load(ensure_tiny_dataset(data_cfg, cache_dir).parent)


def tiny_shape_centres(frames: Any) -> Any:
    """(x, y) in pixels of the shape in each frame of uint8 frames [F, H, W, 3], as a float [F, 2]
    array, NaN for a frame that shows no shape (fv_accel/tiny/motion.py)."""
    from fv_accel.tiny.motion import shape_centres

    return shape_centres(frames)
