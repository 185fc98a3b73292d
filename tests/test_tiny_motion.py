"""The shape tracks of `python -m fv_accel.tiny.motion`: centres of rendered shapes, and the comparison
of a run's sample videos with the tiny training clips (right motion close, reversed motion far)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fv_accel.data.video import write_video
from fv_accel.tiny.clips import MOTIONS, ClipSpec, render_clip, tiny_clip_specs
from fv_accel.tiny.motion import compare, main, shape_centres, track_distance
from fv_accel.validation import _slug

FRAMES, SIZE = 21, 48


@pytest.mark.parametrize("shape,motion,background", [("square", "right", "light"), ("circle", "up", "black")])
def test_centres_follow_the_rendered_path(shape, motion, background):
    spec = ClipSpec(shape=shape, color="red", background=background, motion=motion, size=0.1)
    track = shape_centres(render_clip(spec, num_frames=FRAMES, height=SIZE, width=SIZE))
    dx, dy = MOTIONS[motion]
    progress = np.arange(FRAMES) / (FRAMES - 1) - 0.5
    # render_clip's centre, in the coordinates of pixel indices (pixel i covers [i - 0.5, i + 0.5]).
    expected = np.stack([SIZE / 2 + dx * progress * SIZE * 0.6, SIZE / 2 + dy * progress * SIZE * 0.6], 1)
    assert np.abs(track - expected).max() < 0.6
    assert track_distance(track, expected) < 0.5
    assert track_distance(track, expected[::-1]) > 10


def test_a_frame_without_a_shape_has_no_centre_and_bad_shapes_are_refused():
    frames = np.full((2, 8, 8, 3), 40, dtype=np.uint8)
    frames[1, 2:4, 5:7] = 250
    track = shape_centres(frames)
    assert np.isnan(track[0]).all()
    assert track[1].tolist() == pytest.approx([5.5, 2.5])
    with pytest.raises(ValueError, match=r"expected frames \[F, H, W, 3\]"):
        shape_centres(frames[..., 0])
    with pytest.raises(ValueError, match="different lengths"):
        track_distance(track, track[:1])


def test_compare_tells_the_training_motion_from_the_reversed_one(tmp_path, tiny_data_path, capsys):
    """Sample videos made from a training clip as rendered, the same clip played backwards and a
    clip under a caption outside the training set, against the tiny dataset decoded by its VAE."""
    green = next(s for s in tiny_clip_specs(8, seed=0) if s.caption == "a green square moving down on a black background")
    frames = render_clip(green, num_frames=FRAMES, height=SIZE, width=SIZE)
    step = tmp_path / "run" / "samples" / "step-30"
    write_video(step / f"00-{_slug(green.caption)}.mp4", frames)
    write_video(step / f"01-{_slug(green.caption)}.mp4", frames[::-1].copy())
    write_video(step / "02-a-cyan-square-moving-right-on-a-black-ba.mp4", frames)
    (tmp_path / "run" / "samples" / "step-4").mkdir()

    data_dir = Path(tiny_data_path).parent
    forward, backward, heldout = compare(tmp_path / "run", data_dir)
    assert forward["step"] == 30  # the last step by default
    assert forward["own"] == backward["own"] == green.caption
    assert forward["own_distance"] < 3.0  # the VAE's frame sharing and blur, the codec
    assert backward["own_distance"] > 8.0
    assert "moving up" in backward["nearest"] and backward["distance"] < 3.0
    assert heldout["own"] is None and heldout["nearest"] is not None

    with pytest.raises(FileNotFoundError, match="step-4: no sample video"):
        compare(tmp_path / "run", data_dir, step=4)
    assert main([str(tmp_path / "nothing")]) == 2
    assert "no step-<n> folder of sample videos" in capsys.readouterr().err
