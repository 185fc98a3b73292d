"""Overrides for tiny causal consistency distillation runs in tests: configs/tiny_causal_cd.yaml with
the tests' inline random-weight teacher (dmd2_helpers.TINY_TEACHER), block-causal with chunks of 3
latent frames, whose weights the student and the EMA inherit; small sizes, everything inside tmp_path."""

from __future__ import annotations

from pathlib import Path

from dmd2_helpers import dmd2_overrides

CD_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_causal_cd.yaml")


def causal_cd_overrides(tmp_path, data_path: str, **extra) -> dict:
    """`data_path`: the tests' tiny dataset (6 latent frames: two chunks of 3). The DMD2 tests'
    overrides (the inline teacher, batch 2, 16-token text, 4 steps) and CD's own keys."""
    return dmd2_overrides(tmp_path, **{
        "training.data.data_path": data_path,
        "method.discrete_cd_N": 8,
        "method.ema_start_step": 2,
        **extra,
    })
