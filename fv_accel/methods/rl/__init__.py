"""Reward post-training: DiffusionNFT (diffusion_nft.py) and what it samples with (sampling.py)."""

from fv_accel.methods.rl.diffusion_nft import DiffusionNFTMethod

__all__ = ["DiffusionNFTMethod"]
