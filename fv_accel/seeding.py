"""Stable per-sample seeds: the bottom of the package (imports nothing of fv_accel)."""

from __future__ import annotations

import hashlib


def derived_seed(*parts: object) -> int:
    """A stable 63-bit seed from the parts (joined with "/"): seeds that differ whenever a part does."""
    digest = hashlib.blake2b("/".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def sample_generator_seed(seed: int, epoch: int, sample_index: int) -> int:
    """A stable 63-bit seed for one sample's draws (`noise_rng: sample`, loader shuffles, held-out noise)."""
    return derived_seed(seed, epoch, sample_index)
