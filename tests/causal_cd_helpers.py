"""Overrides for tiny causal consistency distillation runs in tests: configs/tiny_causal_cd.yaml with
the tests' inline random-weight teacher (dmd2_helpers.TINY_TEACHER), block-causal with chunks of 3
latent frames, whose weights the student and the EMA inherit; small sizes, everything inside tmp_path."""

from __future__ import annotations

from pathlib import Path

from conftest import tiny_overrides
from dmd2_helpers import TINY_TEACHER

CD_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_causal_cd.yaml")


def causal_cd_overrides(tmp_path, data_path: str, **extra) -> dict:
    """`data_path`: the tests' tiny dataset (6 latent frames: two chunks of 3)."""
    out = tiny_overrides(tmp_path)
    for key in [k for k in out if k.startswith("models.student.transformer_config")]:
        del out[key]
    out.update({
        "models.teacher.init_from": None,
        "models.teacher.transformer_config": dict(TINY_TEACHER),
        "training.data.data_path": data_path,
        "training.data.train_batch_size": 2,
        "training.data.text_max_length": 16,
        "training.loop.max_train_steps": 4,
        "method.discrete_cd_N": 8,
        "method.ema_start_step": 2,
    })
    out.update(extra)
    return out
