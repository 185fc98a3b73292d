"""The tiny Wan VAE's trained decoder (fv_accel.tiny.vae): trained once per cache and read back
after, once under concurrent first uses, and again over a bad cache file; the sample grid and the
distance of samples to the training clips (fv_accel.validation)."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from fv_accel.tiny import vae as tiny_vae
from fv_accel.tiny.model import TINY_VAE_CONFIG, build_tiny_vae

# The seed of the VAE in the tiny models written with seed 0 (write_tiny_variant draws it from seed + 2).
VAE_SEED = 2
# A recipe small enough to train in a test (what matters here is the caching, not the quality).
SMALL_RECIPE = dict(tiny_vae.DECODER_RECIPE, train_clips=2, num_frames=5, size=16, steps=2, batch_size=1, heldout_clips=1)


def test_trained_once_then_read_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_vae, "DECODER_RECIPE", SMALL_RECIPE)
    random_vae = build_tiny_vae(VAE_SEED)
    state, figures = tiny_vae.trained_decoder_state(build_tiny_vae(VAE_SEED), TINY_VAE_CONFIG, VAE_SEED, tmp_path)
    assert set(figures) == {"heldout_mse", "heldout_mse_random_decoder", "heldout_flat_colour_mse", "train_seconds"}

    def no_training(*args, **kwargs):
        raise AssertionError("the decoder was trained again")

    monkeypatch.setattr(tiny_vae, "train_decoder", no_training)
    again, figures_again = tiny_vae.trained_decoder_state(build_tiny_vae(VAE_SEED), TINY_VAE_CONFIG, VAE_SEED, tmp_path)
    assert again.keys() == state.keys() and all(torch.equal(again[k], state[k]) for k in state)
    assert figures_again == figures
    # Only the decoder changes: the encoder (so every latent) is the random VAE's.
    vae = tiny_vae.with_trained_decoder(build_tiny_vae(VAE_SEED), TINY_VAE_CONFIG, VAE_SEED, tmp_path)
    for name, value in vae.state_dict().items():
        trained_part = name.startswith(tiny_vae.DECODER_PREFIXES)
        assert torch.equal(value, state[name] if trained_part else random_vae.state_dict()[name]), name
    video = tiny_vae.clip_batch(1, seed=4242, num_frames=5, size=16)
    assert not torch.equal(vae.decode(tiny_vae.encode_mode(vae, video)).sample, random_vae.decode(tiny_vae.encode_mode(random_vae, video)).sample)


def test_bad_cache_file_is_trained_again(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(tiny_vae, "DECODER_RECIPE", SMALL_RECIPE)
    vae = build_tiny_vae(VAE_SEED)
    path = tiny_vae.decoder_cache_path(TINY_VAE_CONFIG, VAE_SEED, tmp_path)
    path.write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING, logger="fv_accel.tiny.vae"):
        state, figures = tiny_vae.trained_decoder_state(vae, TINY_VAE_CONFIG, VAE_SEED, tmp_path)
    assert f"tiny VAE decoder cache {path} is unusable" in caplog.text
    reread, _ = tiny_vae.trained_decoder_state(vae, TINY_VAE_CONFIG, VAE_SEED, tmp_path)  # now a good file
    assert reread.keys() == state.keys() and all(torch.equal(reread[k], state[k]) for k in state)
    assert set(state) == {k for k in vae.state_dict() if k.startswith(("decoder.", "post_quant_conv."))}
    assert not any(torch.equal(state[k], vae.state_dict()[k]) for k in ("post_quant_conv.weight", "decoder.conv_out.weight"))


def test_concurrent_first_uses_train_once(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_vae, "DECODER_RECIPE", SMALL_RECIPE)
    real = tiny_vae.train_decoder
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(tiny_vae, "train_decoder", counted)
    results = []

    def use():
        results.append(tiny_vae.trained_decoder_state(build_tiny_vae(VAE_SEED), TINY_VAE_CONFIG, VAE_SEED, tmp_path)[0])

    threads = [threading.Thread(target=use) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(results) == 2
    assert all(torch.equal(results[0][k], results[1][k]) for k in results[0])
    assert [p.name for p in tmp_path.iterdir() if p.suffix == ".safetensors"] == [
        tiny_vae.decoder_cache_path(TINY_VAE_CONFIG, VAE_SEED, tmp_path).name
    ]


def test_cache_name_follows_the_recipe_and_the_seed():
    key = tiny_vae.decoder_cache_key(TINY_VAE_CONFIG, VAE_SEED)
    assert tiny_vae.decoder_cache_key(TINY_VAE_CONFIG, VAE_SEED + 1) != key
    assert tiny_vae.decoder_cache_key(TINY_VAE_CONFIG, VAE_SEED, SMALL_RECIPE) != key
    assert tiny_vae.decoder_cache_key({**TINY_VAE_CONFIG, "base_dim": 16}, VAE_SEED) != key


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
