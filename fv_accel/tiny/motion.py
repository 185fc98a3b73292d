"""Where the shape sits in each frame: the tracks of a tiny run's sample videos against the tracks of
its training clips.

    python -m fv_accel.tiny.motion outputs/tiny_dfsft [--step N] [--config RECIPE]

A tiny clip holds one shape on a plain background, so a frame's shape centre is the mean position of
the pixels that differ from the frame's median colour (the background), weighted by how much they
differ. The training clips are taken as the run saw them: their cached latents decoded by the tiny
VAE, which also makes the samples (the same blur, the same frames shared by a latent frame). For
each sample video the tool prints its centre track and the mean distance in pixels to the track of
the training clip with the sample's caption (where the prompt is a training caption) and to the
nearest training track (any caption: two clips can share a path).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

TRACK_FRAMES = 5  # centres printed per track, spread over the clip


def shape_centres(frames: np.ndarray) -> np.ndarray:
    """(x, y) in pixels of the shape in each frame of uint8 frames [F, H, W, 3], as [F, 2].

    Each pixel weighs its colour distance to the frame's median colour, less a quarter of the
    frame's largest distance (so faint halos and compression noise weigh nothing). A frame with no
    pixel above that floor gives NaN."""
    frames = np.asarray(frames, dtype=np.float32)
    if frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected frames [F, H, W, 3], got shape {tuple(frames.shape)}")
    yy, xx = np.mgrid[0 : frames.shape[1], 0 : frames.shape[2]].astype(np.float32)
    out = np.full((frames.shape[0], 2), np.nan, dtype=np.float64)
    for i, frame in enumerate(frames):
        background = np.median(frame.reshape(-1, 3), axis=0)
        distance = np.linalg.norm(frame - background, axis=-1)
        weight = np.clip(distance - 0.25 * distance.max(), 0.0, None)
        total = float(weight.sum())
        if total > 0:
            out[i] = (float((weight * xx).sum()) / total, float((weight * yy).sum()) / total)
    return out


def track_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Mean Euclidean distance in pixels between two tracks of the same length (NaN frames skipped)."""
    if a.shape != b.shape:
        raise ValueError(f"tracks of different lengths: {a.shape[0]} and {b.shape[0]} frames")
    d = np.linalg.norm(a - b, axis=-1)
    return float(np.nanmean(d)) if np.isfinite(d).any() else float("nan")


def read_frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])


def training_tracks(data_dir: Path) -> list[tuple[str, np.ndarray]]:
    """(caption, centre track) of every clip of a tiny dataset folder, decoded by its tiny VAE."""
    import torch
    from diffusers import AutoencoderKLWan

    from fv_accel.data.loader import LatentDataset

    dataset = LatentDataset(str(data_dir / "latents"))
    vae = AutoencoderKLWan.from_pretrained(str(data_dir / "tiny-model"), subfolder="vae").eval()
    tracks = []
    with torch.no_grad():
        for row in range(len(dataset)):
            item = dataset[(row, 0, 0)]
            video = vae.decode(item["vae_latent"][None].float()).sample[0]
            frames = ((video.clamp(-1, 1) + 1) * 127.5).round().byte().permute(1, 2, 3, 0).numpy()
            tracks.append((item["caption"], shape_centres(frames)))
    return tracks


def latest_step(samples: Path) -> int:
    steps = [int(p.name[len("step-") :]) for p in samples.glob("step-*") if p.name[len("step-") :].isdigit()]
    if not steps:
        raise FileNotFoundError(f"{samples}: no step-<n> folder of sample videos")
    return max(steps)


def _fmt(track: np.ndarray) -> str:
    idx = np.linspace(0, len(track) - 1, TRACK_FRAMES).round().astype(int)
    return " ".join("(%.0f,%.0f)" % tuple(track[i]) if np.isfinite(track[i]).all() else "(-,-)" for i in idx)


def compare(run_dir: Path, data_dir: Path, step: Optional[int] = None) -> list[dict]:
    """One record per sample video of `run_dir/samples/step-<step>` (the last step by default)."""
    samples = run_dir / "samples"
    step = latest_step(samples) if step is None else step
    videos = sorted((samples / f"step-{step}").glob("*.mp4"))
    if not videos:
        raise FileNotFoundError(f"{samples / f'step-{step}'}: no sample video (*.mp4)")
    references = training_tracks(data_dir)
    records = []
    for video in videos:
        track = shape_centres(read_frames(video))
        distances = []
        for caption, ref in references:
            if ref.shape != track.shape:
                raise ValueError(
                    f"{video}: {track.shape[0]} frames, but the training clip {caption!r} has {ref.shape[0]}"
                )
            distances.append(track_distance(track, ref))
        best = int(np.nanargmin(distances))
        # Sample videos are named "<index>-<prompt, lower case, runs of other characters as '-'>".
        slug = video.stem.split("-", 1)[-1]
        own = [i for i, (caption, _) in enumerate(references) if re.sub(r"[^a-z0-9]+", "-", caption.lower()).startswith(slug)]
        records.append(
            dict(video=video.name, step=step, track=track,
                 own=references[own[0]][0] if own else None, own_track=references[own[0]][1] if own else None,
                 own_distance=distances[own[0]] if own else None,
                 nearest=references[best][0], nearest_track=references[best][1], distance=distances[best])
        )
    return records


def main(argv: Optional[Sequence[str]] = None) -> int:
    from fv_accel.process import DefaultsHelpFormatter

    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.tiny.motion", description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter
    )
    parser.add_argument("run_dir", type=Path, help="a tiny run's output folder (holds samples/step-<n>/)")
    parser.add_argument("--step", type=int, default=None, help="the validation step (default: the last)")
    parser.add_argument("--config", default=None, help="the run's recipe, for its tiny dataset (default: the tiny DFSFT recipe)")
    args = parser.parse_args(argv)

    from fv_accel.config import default_recipe, load_config
    from fv_accel.tiny.data import ensure_tiny_dataset, tiny_dataset_dir

    cfg = load_config(args.config or default_recipe("dfsft"))
    if cfg.training.data.data_path != "tiny":
        print(f"error: {args.config}: training.data.data_path is {cfg.training.data.data_path!r}, not the tiny dataset", file=sys.stderr)
        return 2
    ensure_tiny_dataset(cfg.training.data)
    try:
        records = compare(args.run_dir, tiny_dataset_dir(cfg.training.data), args.step)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"shape centres (x, y) in pixels at {TRACK_FRAMES} frames, step {records[0]['step']}:")
    for r in records:
        print(f"{r['video']}\n  sample:              {_fmt(r['track'])}")
        if r["own"] is not None:
            print(f"  its training clip:   {_fmt(r['own_track'])}  mean distance {r['own_distance']:.1f} px")
        else:
            print("  its training clip:   none (the prompt is no training caption)")
        print(f"  nearest training:    {_fmt(r['nearest_track'])}  mean distance {r['distance']:.1f} px ({r['nearest']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
