"""Reading clips with PyAV: frame sampling, resize and centre-crop to the nearest bucket.

A clip yields `num_frames` frames (of the form 4k+1; the longest configured length the clip can
fill), taken every `frame_stride` source frames or at `target_fps`, starting at the head of the
clip or at a start drawn uniformly (seeded by the clip's content, so reruns pick the same frames).
Images are single-frame clips. Anything wrong with a clip raises `ClipError` with a short reason
code, so the caller can report it and carry on.
"""

from __future__ import annotations

import hashlib
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import numpy as np

VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi", ".m4v", ".gif", ".mpg", ".mpeg", ".ts")
IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp")
MEDIA_EXTENSIONS = VIDEO_EXTENSIONS + IMAGE_EXTENSIONS
# The VAE downsamples space by 8 and the transformer patches 2x2: frame sides are multiples of 16.
SIDE_MULTIPLE = 16


class ClipError(Exception):
    """One clip cannot be used; `reason` is a short code for skipped.jsonl, the message says why."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class FrameSampling:
    """How frames are taken from a clip and shaped (part of the preprocessing settings key)."""

    num_frames: tuple[int, ...] = (81,)
    frame_stride: int = 1
    target_fps: Optional[float] = None
    start: str = "head"  # "head" or "uniform"
    buckets: tuple[tuple[int, int], ...] = ((480, 832),)  # (height, width)
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.num_frames:
            raise ValueError("num_frames: give at least one frame count")
        for n in self.num_frames:
            if int(n) < 1 or (int(n) - 1) % 4:
                raise ValueError(f"num_frames: expected frame counts of the form 4k+1 (1, 5, 9, ..., 81), got {n}")
        if self.frame_stride < 1:
            raise ValueError(f"frame_stride: expected an integer >= 1, got {self.frame_stride}")
        if self.target_fps is not None and not self.target_fps > 0:
            raise ValueError(f"target_fps: expected a number > 0, got {self.target_fps}")
        if self.start not in ("head", "uniform"):
            raise ValueError(f"start: expected 'head' or 'uniform', got {self.start!r}")
        if not self.buckets:
            raise ValueError("buckets: give at least one HEIGHTxWIDTH")
        for h, w in self.buckets:
            if h < SIDE_MULTIPLE or w < SIDE_MULTIPLE or h % SIDE_MULTIPLE or w % SIDE_MULTIPLE:
                raise ValueError(
                    f"buckets: {h}x{w}: height and width must be positive multiples of {SIDE_MULTIPLE} "
                    "(the VAE downsamples by 8 and the transformer patches 2x2)"
                )

    def to_dict(self) -> dict:
        return {
            "num_frames": sorted(int(n) for n in self.num_frames),
            "frame_stride": int(self.frame_stride),
            "target_fps": None if self.target_fps is None else float(self.target_fps),
            "start": self.start,
            "buckets": [[int(h), int(w)] for h, w in self.buckets],
            "seed": int(self.seed),
        }


def parse_buckets(text: str) -> tuple[tuple[int, int], ...]:
    """'480x832,832x480' -> ((480, 832), (832, 480))."""
    out = []
    for part in text.replace(" ", "").split(","):
        if not part:
            continue
        try:
            h, w = (int(v) for v in part.lower().split("x"))
        except ValueError:
            raise ValueError(f"buckets: expected HEIGHTxWIDTH[,HEIGHTxWIDTH...], got {part!r} in {text!r}") from None
        out.append((h, w))
    if not out:
        raise ValueError(f"buckets: expected HEIGHTxWIDTH[,HEIGHTxWIDTH...], got {text!r}")
    return tuple(out)


def nearest_bucket(height: int, width: int, buckets: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The bucket closest in aspect ratio (then in area), so the crop throws away the least."""
    aspect = math.log(width / height)
    area = math.log(width * height)
    return min(buckets, key=lambda b: (round(abs(math.log(b[1] / b[0]) - aspect), 9), abs(math.log(b[0] * b[1]) - area)))


def is_image(name: str) -> bool:
    return Path(name).suffix.lower() in IMAGE_EXTENSIONS


@dataclass
class ClipFrames:
    frames: np.ndarray  # uint8 [F, H, W, 3]
    fps: float  # of the sampled frames
    source_frames: int
    source_size: tuple[int, int]  # (height, width) as shown (display rotation applied)
    start: int


def _open(source: Union[str, Path, bytes]):
    import av

    try:
        return av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source), mode="r")
    except av.error.FFmpegError as err:
        raise ClipError("unreadable", f"cannot open the file ({err.__class__.__name__}: {err})") from None


def _count_frames(container, stream) -> int:
    if stream.frames and stream.frames > 0:
        return int(stream.frames)
    # Some containers (webm, gif) do not record the count: count the packets instead (no decoding).
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


def sample_indices(count: int, src_fps: float, sampling: FrameSampling, content_seed: int, image: bool) -> tuple[list[int], float, int]:
    """Source frame indices for a clip of `count` frames, the fps of the result and the start frame."""
    if image:
        return [0], 0.0, 0
    step = src_fps / sampling.target_fps if sampling.target_fps else float(sampling.frame_stride)
    fitting = [n for n in sorted(sampling.num_frames) if math.floor((n - 1) * step + 1e-9) + 1 <= count]
    if not fitting:
        need = min(sampling.num_frames)
        span = math.floor((need - 1) * step + 1e-9) + 1
        how = f"at {sampling.target_fps:g} fps" if sampling.target_fps else f"with stride {sampling.frame_stride}"
        raise ClipError("too_short", f"{count} frame(s); {need} frames {how} need {span} source frames")
    n = fitting[-1]
    span = math.floor((n - 1) * step + 1e-9) + 1
    start = 0
    if sampling.start == "uniform" and count > span:
        start = int(np.random.default_rng([sampling.seed, content_seed]).integers(0, count - span + 1))
    indices = [start + math.floor(i * step + 1e-9) for i in range(n)]
    return indices, src_fps / step, start


def display_quarter_turns(frame, stream) -> int:
    """Counter-clockwise quarter turns (0-3) that show a decoded frame upright: from the display
    matrix side data (`VideoFrame.rotation`, counter-clockwise degrees), else from the stream's
    `rotate` tag that older FFmpeg builds set (clockwise degrees)."""
    degrees = float(getattr(frame, "rotation", 0) or 0)
    if not degrees:
        try:
            degrees = -float((stream.metadata or {}).get("rotate", 0) or 0)
        except (TypeError, ValueError):
            degrees = 0.0
    return int(round(degrees / 90.0)) % 4


def read_clip(source: Union[str, Path, bytes], name: str, sampling: FrameSampling, content_hash: str) -> ClipFrames:
    """Decode the frames a clip contributes, resized and centre-cropped to its nearest bucket."""
    import av

    container = _open(source)
    try:
        if not container.streams.video:
            raise ClipError("unreadable", "no video stream in the file")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        image = is_image(name)
        src_h, src_w = int(stream.codec_context.height), int(stream.codec_context.width)
        if src_h <= 0 or src_w <= 0:
            raise ClipError("unreadable", f"the video stream reports a {src_w}x{src_h} frame size")
        rate = stream.average_rate or stream.base_rate or stream.guessed_rate
        src_fps = float(rate) if rate else 0.0
        if not image and src_fps <= 0 and sampling.target_fps:
            raise ClipError("unreadable", "the video stream has no frame rate; cannot sample at target_fps")
        count = 1 if image else _count_frames(container, stream)
        if count < 1:
            raise ClipError("unreadable", "the video stream holds no frames")
        indices, fps, start = sample_indices(count, src_fps or 1.0, sampling, int(content_hash[:15], 16), image)
        wanted: dict[int, list[int]] = {}
        for pos, idx in enumerate(indices):
            wanted.setdefault(idx, []).append(pos)
        out: Optional[np.ndarray] = None
        filled = 0
        last = max(indices)
        decoded = 0
        try:
            for i, frame in enumerate(container.decode(stream)):
                decoded = i + 1
                if out is None:
                    # The bucket is chosen for the picture as it is shown: a phone clip stored
                    # landscape with a display rotation of -90 degrees is portrait.
                    turns = display_quarter_turns(frame, stream)
                    shown_h, shown_w = (src_w, src_h) if turns % 2 else (src_h, src_w)
                    bucket_h, bucket_w = nearest_bucket(shown_h, shown_w, sampling.buckets)
                    scale = max(bucket_h / shown_h, bucket_w / shown_w)
                    resized_h = max(bucket_h, round(shown_h * scale))
                    resized_w = max(bucket_w, round(shown_w * scale))
                    interpolation = "AREA" if scale < 1 else "BICUBIC"
                    top, left = (resized_h - bucket_h) // 2, (resized_w - bucket_w) // 2
                    stored_w, stored_h = (resized_h, resized_w) if turns % 2 else (resized_w, resized_h)
                    out = np.empty((len(indices), bucket_h, bucket_w, 3), dtype=np.uint8)
                if i in wanted:
                    rgb = frame.reformat(width=stored_w, height=stored_h, format="rgb24", interpolation=interpolation)
                    shown = np.rot90(rgb.to_ndarray(), k=turns) if turns else rgb.to_ndarray()
                    crop = shown[top : top + bucket_h, left : left + bucket_w]
                    for pos in wanted[i]:
                        out[pos] = crop
                        filled += 1
                if i >= last:
                    break
        except av.error.FFmpegError as err:
            raise ClipError(
                "truncated", f"decoding failed after {decoded} of {count} frame(s) ({err.__class__.__name__}: {err})"
            ) from None
        if out is None or filled < len(indices):
            raise ClipError(
                "truncated", f"the file ends after {decoded} decodable frame(s); its header announces {count}"
            )
        return ClipFrames(frames=out, fps=fps, source_frames=count, source_size=(shown_h, shown_w), start=start)
    finally:
        container.close()


def content_hash(source: Union[str, Path, bytes]) -> str:
    """blake2b of the file's bytes (hex): a clip is known by its content, wherever it lives."""
    h = hashlib.blake2b(digest_size=16)
    if isinstance(source, (bytes, bytearray)):
        h.update(source)
    else:
        with open(source, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def available_video_codec() -> str:
    """libx264 where this PyAV build has it, else mpeg4 (both ship with PyAV's wheels)."""
    import av

    for name in ("libx264", "mpeg4"):
        try:
            av.codec.Codec(name, "w")
            return name
        except Exception:  # noqa: BLE001 - a missing encoder raises different errors per build
            continue
    raise RuntimeError("this PyAV build has neither the libx264 nor the mpeg4 encoder")


def write_video(path: Union[str, Path], frames: np.ndarray, fps: float = 8.0, *, codec: Optional[str] = None, faststart: bool = False) -> Path:
    """Write uint8 frames [F, H, W, 3] as an mp4 (through a temporary name, so a crash leaves none)."""
    import av

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    codec = codec or available_video_codec()
    options = {"movflags": "faststart"} if faststart else {}
    with av.open(str(tmp), mode="w", format="mp4", options=options) as container:
        stream = container.add_stream(codec, rate=int(round(fps)))
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            # High quality and single-threaded: the same frames give the same file on every machine.
            stream.options = {"crf": "12", "threads": "1"}
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    tmp.replace(path)
    return path
