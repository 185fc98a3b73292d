"""Overrides for tiny KD runs in tests: configs/tiny_kd.yaml with the tests' inline random-weight
teacher (dmd2_helpers; the block-causal student inherits its weights), small sizes, the cache and
everything else inside tmp_path."""

from __future__ import annotations

from pathlib import Path

from dmd2_helpers import dmd2_overrides

KD_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_kd.yaml")


def kd_overrides(tmp_path, **extra) -> dict:
    """The tiny default dataset (8 clips of 6 latent frames: two chunks of 3), a 4-step teacher."""
    out = dmd2_overrides(tmp_path, **{
        "models.student.init_from": None,
        "models.student.causal": True,
        "method.chunk_size": 3,
        "method.teacher_path_cache": str(tmp_path / "kd_cache"),
        "method.teacher_inference_steps": 4,
        "method.t_list": [1000, 750, 500, 0],
        "method.student_sample_steps": 3,
        "training.data.tiny_world": "default",
        "training.data.tiny_num_clips": 8,
    })
    out.update(extra)
    return out
