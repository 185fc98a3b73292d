"""The multimodal tiny world (many clips per caption, captions true of every clip), its measure (the
distance of a sample to the nearest clip of its caption), and the few-step DMD sampler."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from fv_accel.config import default_recipe, load_config
from fv_accel.sampling import dmd_denoising_timesteps, euler_sample, few_step_sample, table_sigma
from fv_accel.schedulers import FlowMatchTable
from fv_accel.tiny.clips import MOTIONS, multimodal_clip_specs, render_clip
from fv_accel.tiny.motion import shape_centres

FRAMES, SIZE = 9, 32
CAPTION = re.compile(r"a (\w+) (\w+) moving (\w+) on a (\w+) background")


def test_each_caption_has_many_clips_and_says_what_every_one_of_them_shows():
    specs = multimodal_clip_specs(24, 4, seed=0)
    by_caption: dict[str, list] = {}
    for spec in specs:
        by_caption.setdefault(spec.caption, []).append(spec)
    assert len(by_caption) == 4 and all(len(clips) == 6 for clips in by_caption.values())
    for caption, clips in by_caption.items():
        color, shape, motion, background = CAPTION.fullmatch(caption).groups()
        starts = set()
        for spec in clips:
            assert (spec.color, spec.shape, spec.motion, spec.background) == (color, shape, motion, background)
            track = shape_centres(render_clip(spec, num_frames=FRAMES, height=SIZE, width=SIZE))
            step = np.diff(track, axis=0).sum(axis=0)  # the centre's displacement over the clip
            dx, dy = MOTIONS[motion]
            assert step @ np.array([dx, dy]) > 2.0  # it moves the caption's way, by pixels...
            assert abs(step @ np.array([dy, dx])) < 0.5  # ...and not across it
            starts.add(tuple(np.round(track[0], 1)))
        assert len(starts) == len(clips)  # other start positions
        speeds = [np.linalg.norm(np.diff(shape_centres(render_clip(s, num_frames=FRAMES, height=SIZE, width=SIZE)), axis=0).sum(0)) for s in clips]
        assert max(speeds) - min(speeds) > 2.0  # other speeds


def test_the_default_world_is_unchanged_and_keeps_its_cache_folder():
    from fv_accel.tiny.data import tiny_dataset_dir

    data = load_config(default_recipe("finetune")).training.data
    assert data.tiny_world == "default"
    before = tiny_dataset_dir(data, "/cache")
    # The default world's folder name does not depend on the multimodal settings.
    data.tiny_num_captions = 2
    assert tiny_dataset_dir(data, "/cache") == before
    data.tiny_world = "multimodal"
    assert tiny_dataset_dir(data, "/cache") != before


def test_a_bad_world_setting_is_one_line_naming_the_key(tmp_path):
    from fv_accel.config import ConfigError

    with pytest.raises(ConfigError, match="tiny_num_captions"):
        load_config(default_recipe("finetune"), {"training.data.tiny_num_captions": 9})
    with pytest.raises(ConfigError, match="tiny_world"):
        load_config(default_recipe("finetune"), {"training.data.tiny_world": "bimodal"})


@pytest.fixture(scope="module")
def clip_modes(_cache_dir):
    """A small multimodal dataset (2 captions x 3 clips, 9 frames of 32x32), rendered and encoded by
    the preprocessing pipeline, read back by caption."""
    from fv_accel.tiny import tiny_clip_modes

    overrides = {
        "training.data.tiny_world": "multimodal", "training.data.tiny_num_captions": 2,
        "training.data.tiny_num_clips": 6, "training.data.tiny_num_frames": FRAMES,
        "training.data.tiny_height": SIZE, "training.data.tiny_width": SIZE,
    }
    return tiny_clip_modes(load_config(default_recipe("finetune"), overrides).training.data)


@pytest.mark.slow  # builds a multimodal dataset through preprocessing (~10-30 s on 2 shared cores)
def test_a_clip_is_at_distance_zero_from_itself_and_apart_from_the_others_of_its_caption(clip_modes):
    assert len(clip_modes.captions) == 2
    for caption in clip_modes.captions:
        clips = clip_modes.latents[caption]
        assert clips.shape == (3, 16, 3, 4, 4) and clip_modes.tracks[caption].shape == (3, FRAMES, 2)
        near = clip_modes.nearest(clips, caption)
        assert near["latent"].tolist() == [0.0, 0.0, 0.0] and near["latent_clip"].tolist() == [0, 1, 2]
        assert near["track"].tolist() == [0.0, 0.0, 0.0] and near["track_clip"].tolist() == [0, 1, 2]
        latent = clip_modes.latent_distances(clips, caption)
        track = clip_modes.track_distances(clips, caption)
        off = ~torch.eye(3, dtype=torch.bool)
        assert float(latent[off].min()) > 0.05 and float(np.min(track[off.numpy()])) > 1.0
    with pytest.raises(KeyError, match="none of the dataset's"):
        clip_modes.nearest(clips, "a pink triangle")


@pytest.mark.slow
def test_the_mean_of_a_captions_clips_is_far_from_every_one_of_them_in_latent(clip_modes):
    """What a few-step sampler that averages the modes draws. (Its track distance is measured on the
    benchmark's 48x48 world, benchmarks/distill.py: on 3 clips of 32x32 the mean's blob sits too
    close to a clip's path to tell.)"""
    for caption in clip_modes.captions:
        clips = clip_modes.latents[caption]
        near = clip_modes.nearest(clips.mean(0, keepdim=True), caption)
        assert float(near["latent"][0]) > 0.1 and np.isfinite(near["track"][0])


# ---- the samplers ----
def _perfect(x0: torch.Tensor, table: FlowMatchTable, sigmas_seen: list):
    """A velocity that knows the clean clip: v = (x_t - x0) / sigma at the table's sigma for t."""

    def predict_velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        sigma = table_sigma(t[0, 0], table)
        sigmas_seen.append(float(sigma))
        return (x - x0) / sigma

    return predict_velocity


def test_few_step_sample_with_a_perfect_velocity_returns_the_clean_clip():
    table = FlowMatchTable(3.0)
    x0 = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(1))
    seen: list = []
    timesteps = dmd_denoising_timesteps([1000, 750, 500, 250], table, warp=False)
    out = few_step_sample(_perfect(x0, table, seen), noise, timesteps, table, torch.Generator().manual_seed(2))
    torch.testing.assert_close(out, x0, atol=1e-5, rtol=0)
    assert seen == pytest.approx([1.0, 0.75, 0.5, 0.25], abs=2e-3)


def test_one_few_step_is_x_minus_sigma_v_and_the_renoising_is_seeded():
    table = FlowMatchTable(3.0)
    noise = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(3))
    v = torch.randn_like(noise)
    calls = []

    def constant(x, t):
        calls.append(t.clone())
        return v

    out = few_step_sample(constant, noise, [500.0], table, None)
    sigma = float(table_sigma(torch.tensor(500.0), table))
    assert sigma == pytest.approx(0.5, abs=2e-3)
    torch.testing.assert_close(out, noise - sigma * v)
    assert len(calls) == 1 and calls[0].shape == (1, 2) and float(calls[0][0, 0]) == 500.0
    # Two steps: x0 re-noised with the generator's draw; same seed -> same sample, other seed -> other.
    two = [few_step_sample(constant, noise, [1000.0, 500.0], table, torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    torch.testing.assert_close(two[0], two[1])
    assert not torch.allclose(two[0], two[2])
    eps = torch.randn(noise.shape, generator=torch.Generator().manual_seed(5))
    x1 = (1 - sigma) * (noise - v) + sigma * eps
    torch.testing.assert_close(two[0], x1 - sigma * v)


def test_dmd_timesteps_raw_and_warped_through_the_training_table():
    table = FlowMatchTable(3.0)
    assert dmd_denoising_timesteps([1000, 750, 500, 250], table).tolist() == [1000.0, 750.0, 500.0, 250.0]
    warped = dmd_denoising_timesteps([1000, 750, 500, 250], table, warp=True)
    # index N - value of the shift-3 table: 0 -> t 1000, 250 -> 900, 500 -> 750, 750 -> 500
    assert warped.tolist() == pytest.approx([1000.0, 900.0, 750.0, 500.0], abs=0.1)
    with pytest.raises(ValueError, match="descending"):
        dmd_denoising_timesteps([500, 750], table)
    with pytest.raises(ValueError, match=r"in \(0, 1000\]"):
        dmd_denoising_timesteps([1200, 500], table)


def test_euler_sample_with_a_perfect_velocity_returns_the_clean_clip():
    x0 = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(1, 4, 2, 2, 2, generator=torch.Generator().manual_seed(1))
    calls = []

    def velocity(x, t):  # straight flow: v = noise - x0 whatever t
        calls.append(1)
        return noise - x0

    torch.testing.assert_close(euler_sample(velocity, noise, 3), x0, atol=1e-5, rtol=0)
    assert len(calls) == 3


def test_the_dmd2_teacher_recipe_trains_sft_on_the_multimodal_world():
    from fv_accel.config import CONFIG_DIR

    cfg = load_config(str(CONFIG_DIR / "tiny_dmd2_teacher.yaml"))
    data = cfg.training.data
    assert cfg.method.name == "finetune" and cfg.training.checkpoint.output_dir == "outputs/tiny_dmd2_teacher"
    assert (data.data_path, data.tiny_world, data.tiny_num_captions, data.tiny_num_clips) == ("tiny", "multimodal", 4, 32)
    # The validation prompts are the world's captions.
    captions = {s.caption for s in multimodal_clip_specs(data.tiny_num_clips, data.tiny_num_captions, data.seed)}
    assert set(cfg.callbacks.validation.prompts) == captions
