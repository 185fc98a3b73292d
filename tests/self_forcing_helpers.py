"""Overrides for tiny Self-Forcing runs in tests: configs/tiny_self_forcing.yaml with the tests'
inline random-weight teacher (dmd2_helpers) whose weights the critic and the block-causal student
inherit, small sizes, everything inside tmp_path."""

from __future__ import annotations

from pathlib import Path

from dmd2_helpers import dmd2_overrides

SF_RECIPE = str(Path(__file__).resolve().parents[1] / "configs" / "tiny_self_forcing.yaml")


def self_forcing_overrides(tmp_path, **extra) -> dict:
    """The recipe's clips have 6 latent frames: two chunks of 3."""
    out = dmd2_overrides(tmp_path, **{
        "models.student.init_from": None,
        "models.student.causal": True,
        "method.chunk_size": 3,
    })
    out.update(extra)
    return out
