"""Stable per-sample seeds: the bottom of the package (imports nothing of fv_accel)."""

from __future__ import annotations

import hashlib


def sample_generator_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A stable 63-bit seed for one sample's draws (`noise_rng: sample`, loader shuffles, held-out noise)."""
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)
