"""Reading a clip's sound with PyAV: the audio track over the time its sampled picture spans,
resampled (libswresample) to the rate a model's audio encoder takes.

The window starts at the first sampled frame (seconds after the video stream's first frame) and
lasts as long as the model's audio latents for the picture. Where the track does not reach (it
starts late or ends early) the window is filled with silence and the shortfall is reported
(`padded_seconds`); sound past the end of the picture is never encoded and is reported as cut
(`cut_seconds`). Shortfalls and overhangs within `slack_seconds` (one frame of the picture, by
default: the container's AAC frames and encoder delay) are not counted as padding or cutting.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fv_accel.data.video import ClipError, _open


@dataclass
class ClipAudio:
    """The sound of a clip's window: float32 [channels, samples] at `sample_rate` (silence where
    the track does not reach, all of it for a clip without sound)."""

    waveform: np.ndarray
    sample_rate: int
    present: bool  # the file has an audio track
    track_seconds: float = 0.0  # how long the track is
    padded_seconds: float = 0.0  # of the window, not covered by the track (silence)
    cut_seconds: float = 0.0  # of the track past the end of the picture (not encoded)


def _decode_track(container, stream, sample_rate: int, channels: int) -> tuple[np.ndarray, float]:
    """The whole track resampled to `sample_rate`, float32 [channels, samples], and the time of its
    first sample in seconds (the stream's clock)."""
    import av

    layout = "stereo" if channels == 2 else "mono"
    resampler = av.AudioResampler(format="fltp", layout=layout, rate=sample_rate)
    parts: list[np.ndarray] = []
    first: Optional[float] = None
    try:
        for frame in container.decode(stream):
            if first is None and frame.pts is not None and frame.time_base is not None:
                first = float(frame.pts * frame.time_base)
            parts += [f.to_ndarray() for f in resampler.resample(frame)]
        parts += [f.to_ndarray() for f in resampler.resample(None)]
    except av.error.FFmpegError as err:
        raise ClipError("truncated", f"decoding the audio track failed ({err.__class__.__name__}: {err})") from None
    track = np.concatenate(parts, axis=1).astype(np.float32) if parts else np.zeros((channels, 0), np.float32)
    return track.reshape(channels, -1), first or 0.0


def read_audio(
    source: Union[str, Path, bytes],
    *,
    start_seconds: float,
    num_samples: int,
    sample_rate: int,
    picture_seconds: float,
    channels: int = 2,
    slack_seconds: float = 0.0,
) -> ClipAudio:
    """`num_samples` of the clip's first audio track from `start_seconds` after its first video
    frame, resampled to `sample_rate` with `channels` (1 or 2; a mono track is copied to both
    channels, more channels are mixed down as FFmpeg mixes them). `picture_seconds`: how long the
    video stream lasts (the track beyond it is reported as cut)."""
    if channels not in (1, 2):
        raise ValueError(f"channels: 1 or 2, got {channels}")
    container = _open(source)
    try:
        silence = np.zeros((channels, num_samples), np.float32)
        if not container.streams.audio:
            return ClipAudio(silence, sample_rate, present=False)
        stream = container.streams.audio[0]
        mix = 2 if channels == 2 and (stream.codec_context.channels or 1) >= 2 else 1
        track, first = _decode_track(container, stream, sample_rate, mix)
        if mix == 1 and channels == 2:
            track = np.repeat(track, 2, axis=0)
        video = container.streams.video[0] if container.streams.video else None
        video_start = float(video.start_time * video.time_base) if video is not None and video.start_time is not None else 0.0
    finally:
        container.close()
    # The track's first sample, in seconds after the first video frame.
    offset = first - video_start
    begin = int(round((start_seconds - offset) * sample_rate))
    lo, hi = max(begin, 0), min(begin + num_samples, track.shape[1])
    window = silence
    if hi > lo:
        window[:, lo - begin : hi - begin] = track[:, lo:hi]
    covered = max(hi - lo, 0)
    track_seconds = track.shape[1] / sample_rate
    padded = (num_samples - covered) / sample_rate
    cut = offset + track_seconds - picture_seconds
    return ClipAudio(
        window,
        sample_rate,
        present=True,
        track_seconds=track_seconds,
        padded_seconds=padded if padded > slack_seconds else 0.0,
        cut_seconds=cut if cut > slack_seconds else 0.0,
    )


# --------------------------------------------------------------------------------------------
# Preprocessing: the sound columns of a row, and the report of the dataset's sound
# --------------------------------------------------------------------------------------------

# What preprocessing does with a clip that has no audio track (`--audio_missing`): keep it with
# silent latents marked absent (the video is trained, the audio loss skips it), or skip it.
AUDIO_MISSING = ("train_video_only", "skip")
AUDIO_NOTES_PENDING = "audio-r"
AUDIO_NOTES_FILE = "audio.jsonl"


def encode_clip_audio(encoder, source, frames, audio_missing: str) -> tuple[dict, dict]:
    """The row's `audio_latent` [C, L, M] and `audio_present` (1 or 0) for a clip whose sampled
    picture is `frames` (`fv_accel.data.video.ClipFrames`), and its note for the report: whether it
    has sound, the seconds padded and cut. `encoder`: a family encoder with `audio_sample_rate`,
    `audio_window`, `encode_audio` and `silent_audio`. A clip without sound raises ClipError
    ('no_audio') under `audio_missing` 'skip'."""
    import torch

    if audio_missing not in AUDIO_MISSING:
        raise ValueError(f"audio_missing: one of {', '.join(AUDIO_MISSING)}, got {audio_missing!r}")
    n = int(frames.frames.shape[0])
    fps = float(frames.fps or 0.0)
    latent_frames, samples = encoder.audio_window(n, fps if fps > 0 else float(encoder.frame_rate))
    src_fps = float(frames.source_fps or 0.0)
    start = frames.start / src_fps if src_fps > 0 else 0.0
    picture = frames.source_frames / src_fps if src_fps > 0 else 0.0
    rate = int(encoder.audio_sample_rate)
    got = read_audio(
        source, start_seconds=start, num_samples=samples, sample_rate=rate, picture_seconds=picture,
        slack_seconds=1.0 / fps if fps > 0 else 0.0,
    )
    note = {"present": got.present, "padded_seconds": round(got.padded_seconds, 4), "cut_seconds": round(got.cut_seconds, 4)}
    if not got.present:
        if audio_missing == "skip":
            raise ClipError("no_audio", "the file has no audio track (--audio_missing skip)")
        latent = encoder.silent_audio(latent_frames)
    else:
        latent = encoder.encode_audio(got.waveform)
    present = torch.tensor(1.0 if got.present else 0.0)
    return {"audio_latent": latent, "audio_present": present}, note


def note_clip_audio(path: Path, key: str, note: dict) -> None:
    """Append a clip's sound note (by row key) to this process's pending notes."""
    import json

    with open(path, "a", encoding="utf-8") as fh:
        fh.write(json.dumps({"key": key, **note}) + "\n")


def _read_notes(paths) -> dict[str, dict]:
    import json

    found: dict[str, dict] = {}
    for path in paths:
        if path.is_file():
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    entry = json.loads(line)
                    found[entry.pop("key")] = entry
                except (ValueError, KeyError, TypeError, AttributeError):
                    continue  # a line cut short by a kill
    return found


def audio_report(output: Path, pending: Path, shards: list[Path], skipped: list) -> dict:
    """The sound of the rows of the dataset's `shards`: written to AUDIO_NOTES_FILE (one note a
    row, kept for reruns, which reuse rows without decoding them), logged, and returned as
    fv_dataset.json's `audio`: how many rows have sound, the names of those without (trained
    video-only), padded and cut, and of the clips skipped for having none. {} where no row was noted."""
    import json
    import logging

    import pyarrow.parquet as pq

    rows = [r for f in shards for r in pq.read_table(f, columns=["id", "fv_key"]).to_pylist()]
    notes = _read_notes([output / AUDIO_NOTES_FILE, *sorted(pending.glob(f"{AUDIO_NOTES_PENDING}*.jsonl"))])
    noted = [(r["id"], r["fv_key"], notes[r["fv_key"]]) for r in rows if r["fv_key"] in notes]
    tmp = output / f".{AUDIO_NOTES_FILE}.tmp"
    tmp.write_text("".join(json.dumps({"key": k, "id": name, **n}) + "\n" for name, k, n in noted), encoding="utf-8")
    tmp.replace(output / AUDIO_NOTES_FILE)
    skipped_names = [s[1] for s in skipped if s[2] == "no_audio"]
    if not noted and not skipped_names:
        (output / AUDIO_NOTES_FILE).unlink()
        return {}
    report = {
        "with_sound": sum(1 for _, _, n in noted if n.get("present")),
        "without_sound": [name for name, _, n in noted if not n.get("present")],
        "padded": [name for name, _, n in noted if n.get("padded_seconds", 0) > 0],
        "cut": [name for name, _, n in noted if n.get("cut_seconds", 0) > 0],
        "skipped_without_sound": skipped_names,
        "frame_rates": _frame_rates(shards, {k for _, k, _ in noted}),
    }
    log = logging.getLogger("fv_accel.preprocess")
    if len(report["frame_rates"]) > 1:
        log.warning(
            "clips at %d frame rates (%s): the same frame count spans another time at each, so their sound latents "
            "differ in length and training batches each length apart; --target_fps samples every clip at one rate",
            len(report["frame_rates"]),
            "; ".join(f"{rate} fps: {len(names)} clip(s), {', '.join(names[:3])}" for rate, names in report["frame_rates"].items()),
        )
    if report["without_sound"]:
        log.warning("%d clip(s) have no audio track: kept, trained video-only: %s", len(report["without_sound"]), ", ".join(report["without_sound"][:5]))
    if report["padded"]:
        log.warning("%d clip(s) have sound shorter than their picture: padded with silence: %s", len(report["padded"]), ", ".join(report["padded"][:5]))
    if report["cut"]:
        log.info("%d clip(s) have sound longer than their picture: cut at its end: %s", len(report["cut"]), ", ".join(report["cut"][:5]))
    return {"audio": report}


def _frame_rates(shards: list[Path], keys: set) -> dict[str, list[str]]:
    """The names of the rows of `keys` by the frame rate of their sampled picture ('8', '12.5'),
    slowest first."""
    import pyarrow.parquet as pq

    by_rate: dict[float, list[str]] = {}
    for f in shards:
        for row in pq.read_table(f, columns=["id", "fv_key", "fps"]).to_pylist():
            if row["fv_key"] in keys:
                by_rate.setdefault(round(float(row["fps"] or 0.0), 3), []).append(row["id"])
    return {f"{rate:g}": names for rate, names in sorted(by_rate.items())}


def audio_summary(report: dict) -> str:
    """One line of the preprocess summary: '; audio: 3 with sound, 1 without (trained video-only), ...'."""
    if not report:
        return ""
    parts = [f"{report['with_sound']} with sound", f"{len(report['without_sound'])} without (trained video-only)"]
    if report["skipped_without_sound"]:
        parts.append(f"{len(report['skipped_without_sound'])} skipped without sound")
    parts += [f"{len(report['padded'])} padded (sound shorter than the picture)", f"{len(report['cut'])} cut (sound longer)"]
    return f"; audio: {', '.join(parts)} (see {AUDIO_NOTES_FILE})"
