"""The tiny Wan VAE's closed-form weights (fv_accel.tiny.vae): it encodes each 8x8 cell's mean
colour and decodes it back, so it reconstructs the tiny clips; the sample grid and the distance of
samples to the training clips (fv_accel.validation)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fv_accel.tiny.clips import clip_batch
from fv_accel.tiny.model import TINY_VAE_CONFIG, build_tiny_vae
from fv_accel.tiny.vae import latent_mixing, set_reconstructing_weights

# The seed of the VAE in the tiny models written with seed 0 (write_tiny_variant draws it from seed + 2).
VAE_SEED = 2


@torch.no_grad()
def test_latents_are_the_mixed_cell_colours_and_decode_back():
    vae = build_tiny_vae(VAE_SEED)
    video = clip_batch(4, 4242, num_frames=9, height=32, width=32)  # 9 frames: latent frames of frames [0], [1-4], [5-8]
    posterior = vae.encode(video).latent_dist
    z = posterior.mode()
    assert z.shape == (4, 16, 3, 4, 4)
    # Each latent frame is the mixing of the mean colour of each 8x8 cell over the frames it covers.
    chunks = [video[:, :, :1], video[:, :, 1:5], video[:, :, 5:9]]
    cell = torch.stack([torch.nn.functional.avg_pool2d(c.mean(2), 8) for c in chunks], dim=2)  # [B, 3, T, 4, 4]
    expected = torch.einsum("jc,bcthw->bjthw", latent_mixing(VAE_SEED), cell)
    assert torch.allclose(z, expected, atol=2e-3), float((z - expected).abs().max())
    assert torch.allclose(posterior.sample(generator=torch.Generator().manual_seed(0)), z, atol=1e-5)
    recon = vae.decode(z).sample
    mse = float(((recon - video) ** 2).mean())
    flat = float(((video.mean(dim=(2, 3, 4), keepdim=True) - video) ** 2).mean())
    assert mse < 0.5 * flat, (mse, flat)
    # A random tiny VAE of the same config draws much the same picture whatever it encodes.
    from diffusers import AutoencoderKLWan

    torch.manual_seed(VAE_SEED)
    random_vae = AutoencoderKLWan(**TINY_VAE_CONFIG).eval()
    random_mse = float(((random_vae.decode(random_vae.encode(video).latent_dist.mode()).sample - video) ** 2).mean())
    assert random_mse > 2 * mse, (random_mse, mse)


def test_weights_are_seeded():
    a, b, c = build_tiny_vae(VAE_SEED).state_dict(), build_tiny_vae(VAE_SEED).state_dict(), build_tiny_vae(VAE_SEED + 1).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["encoder.conv_out.weight"], c["encoder.conv_out.weight"])
    assert torch.equal(a["encoder.conv_in.weight"], c["encoder.conv_in.weight"])  # only the mixing differs


def test_a_layout_it_cannot_carry_is_refused():
    from diffusers import AutoencoderKLWan

    vae = AutoencoderKLWan(**{**TINY_VAE_CONFIG, "dim_mult": [1, 2, 2, 2]})
    with pytest.raises(ValueError, match=r"dim_mult \[1, 2, 2, 2\]"):
        set_reconstructing_weights(vae, VAE_SEED)


def test_sample_grid_layout_and_distance():
    from fv_accel.validation import _GRID_GAP, _GRID_HEADER, clip_distance, grid_cell, sample_grid

    rng = np.random.default_rng(0)
    a = rng.integers(0, 256, (9, 16, 16, 3), dtype=np.uint8)
    b = rng.integers(0, 256, (5, 16, 32, 3), dtype=np.uint8)
    strip = grid_cell(a)
    assert strip.shape == (16, 5 * 17 - 1, 3)
    for k, f in enumerate([0, 2, 4, 6, 8]):  # 5 frames evenly spaced, first to last
        assert np.array_equal(strip[:, k * 17 : k * 17 + 16], a[f])
    grid = sample_grid([(0, [a, b]), (100, [a[::-1], b])])
    cell_w = [5 * 17 - 1, 5 * 33 - 1]
    assert grid.shape == (_GRID_HEADER + 2 * 16 + 2 * _GRID_GAP, 2 * max(cell_w) + 3 * _GRID_GAP, 3)
    x1 = 2 * _GRID_GAP + max(cell_w)  # column 2 (step 100), row 1 (prompt a, reversed)
    assert np.array_equal(grid[_GRID_HEADER : _GRID_HEADER + 16, x1 : x1 + 16], a[8])
    y2 = _GRID_HEADER + 16 + _GRID_GAP  # row 2 (prompt b)
    assert np.array_equal(grid[y2 : y2 + 16, _GRID_GAP : _GRID_GAP + cell_w[1]], grid_cell(b))
    # The distance: pixel MSE in [-1, 1] to the nearest reference of the same shape.
    assert clip_distance(a, [a[::-1], a, b]) == 0.0
    assert clip_distance(a, [b]) is None
    far = np.zeros_like(a)
    assert clip_distance(a, [far]) == pytest.approx(float(np.mean((a / 127.5 - 1.0 + 1.0) ** 2)), rel=1e-5)
