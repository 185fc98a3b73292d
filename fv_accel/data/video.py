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
import logging
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

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
    source_size: tuple[int, int]  # (height, width) as shown (display matrix applied)
    start: int
    orientation: tuple[str, ...] = ()  # the steps that showed it as its display matrix asks
    source_fps: float = 0.0  # of the video stream (the start frame's time is start / source_fps)


def _open(source: Union[str, Path, bytes]):
    import av

    try:
        return av.open(io.BytesIO(source) if isinstance(source, (bytes, bytearray)) else str(source), mode="r")
    except av.error.FFmpegError as err:
        raise ClipError("unreadable", f"cannot open the file ({err.__class__.__name__}: {err})") from None


def _count_packets(container, stream) -> int:
    """Frames of the stream counted by its packets (read to the end, not decoded), then back to the start."""
    count = sum(1 for packet in container.demux(stream) if packet.size)
    container.seek(0)
    return count


def _sample_clip(container, stream, name: str, sampling: FrameSampling, src_fps: float, seed: int) -> tuple[int, list[int], float, int]:
    """(frame count, source indices, fps of the result, start) of a video clip. The count is the
    header's where it records one; a header count too short for the longest frame count asked for
    is checked against the stream's packets, so a container that under-reports its frames loses
    no frames it holds."""
    header = int(stream.frames) if stream.frames and stream.frames > 0 else 0
    # Some containers (webm, gif) do not record the count: count the packets instead (no decoding).
    count = header or _count_packets(container, stream)
    if header and header < source_span(max(sampling.num_frames), src_fps, sampling):
        counted = _count_packets(container, stream)
        if counted > header:
            logger.info("%s: the header announces %d frame(s), the stream holds %d: reading %d", name, header, counted, counted)
            count = counted
    if count < 1:
        raise ClipError("unreadable", "the video stream holds no frames")
    return (count, *sample_indices(count, src_fps, sampling, seed, False))


def source_span(num_frames: int, src_fps: float, sampling: FrameSampling) -> int:
    """Source frames that `num_frames` sampled frames cover (stride or target_fps)."""
    step = src_fps / sampling.target_fps if sampling.target_fps else float(sampling.frame_stride)
    return math.floor((num_frames - 1) * step + 1e-9) + 1


def sample_indices(count: int, src_fps: float, sampling: FrameSampling, content_seed: int, image: bool) -> tuple[list[int], float, int]:
    """Source frame indices for a clip of `count` frames, the fps of the result and the start frame."""
    if image:
        return [0], 0.0, 0
    step = src_fps / sampling.target_fps if sampling.target_fps else float(sampling.frame_stride)
    fitting = [n for n in sorted(sampling.num_frames) if source_span(n, src_fps, sampling) <= count]
    if not fitting:
        need = min(sampling.num_frames)
        span = source_span(need, src_fps, sampling)
        how = f"at {sampling.target_fps:g} fps" if sampling.target_fps else f"with stride {sampling.frame_stride}"
        raise ClipError("too_short", f"{count} frame(s); {need} frames {how} need {span} source frames")
    n = fitting[-1]
    span = source_span(n, src_fps, sampling)
    start = 0
    if sampling.start == "uniform" and count > span:
        start = int(np.random.default_rng([sampling.seed, content_seed]).integers(0, count - span + 1))
    indices = [start + math.floor(i * step + 1e-9) for i in range(n)]
    return indices, src_fps / step, start


# Display orientation, decided as FFmpeg's autorotation decides it (fftools' input filters): the
# rotation angle read from the display matrix picks a transpose, a 180-degree mirror pair or a
# vertical flip, and the signs of the matrix's entries say which mirror comes with it. The names
# are the FFmpeg filters' (transpose=clock|cclock|clock_flip|cclock_flip, hflip, vflip).
ORIENTATION_STEPS = {
    "clock": "turned 90 degrees clockwise",
    "cclock": "turned 90 degrees counter-clockwise",
    "clock_flip": "turned 90 degrees clockwise and flipped upside down",
    "cclock_flip": "turned 90 degrees counter-clockwise and flipped upside down",
    "hflip": "mirrored left-right",
    "vflip": "flipped upside down",
}
TRANSPOSING_STEPS = ("clock", "cclock", "clock_flip", "cclock_flip")


def _c_round(x: float) -> float:
    """C's round(): halves away from zero (Python's round() takes halves to even)."""
    return math.copysign(math.floor(abs(x) + 0.5), x)


def display_matrix(frame, stream) -> Optional[tuple[int, ...]]:
    """The 3x3 display matrix (9 ints, FFmpeg's layout: a b u / c d v / x y w) of a decoded frame's
    side data, else one made from the stream's `rotate` tag that older FFmpeg builds set (clockwise
    degrees), else None."""
    for data in getattr(frame, "side_data", None) or ():
        if getattr(data.type, "name", "") == "DISPLAYMATRIX" and len(bytes(data)) >= 36:
            return struct.unpack("=9i", bytes(data)[:36])
    try:
        degrees = float((getattr(stream, "metadata", None) or {}).get("rotate", 0) or 0)
    except (TypeError, ValueError):
        return None
    if not degrees:
        return None
    # As av_display_rotation_set does for a clockwise angle (16.16 fixed point).
    radians = -math.radians(degrees)
    cos, sin = round(math.cos(radians) * 65536), round(math.sin(radians) * 65536)
    return (cos, -sin, 0, sin, cos, 0, 0, 0, 1 << 30)


def display_orientation(matrix: Optional[Sequence[int]]) -> tuple[str, ...]:
    """The steps (keys of ORIENTATION_STEPS, in order) that show a frame as its display matrix asks,
    chosen as FFmpeg's autorotation chooses them. A matrix that turns the picture by an angle other
    than a multiple of 90 degrees raises ClipError."""
    if matrix is None:
        return ()
    a, b, c, d = matrix[0], matrix[1], matrix[3], matrix[4]
    scale_x, scale_y = math.hypot(a, c), math.hypot(b, d)
    if not scale_x or not scale_y:  # a singular matrix has no angle: only the vertical flip applies
        return ("vflip",) if d < 0 else ()
    # The clockwise angle: the negated, rounded counter-clockwise angle of av_display_rotation_get,
    # taken into [0, 360) (an angle just under 360 counts as 0).
    theta = _c_round(math.degrees(math.atan2(b / scale_y, a / scale_x)))
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    if abs(theta - 90) < 1:
        return ("cclock_flip",) if c > 0 else ("clock",)
    if abs(theta - 180) < 1:
        return tuple(step for step, mirrored in (("hflip", a < 0), ("vflip", d < 0)) if mirrored)
    if abs(theta - 270) < 1:
        return ("clock_flip",) if c < 0 else ("cclock",)
    if abs(theta) > 1:
        raise ClipError(
            "unsupported_rotation",
            f"the display matrix turns the picture {theta:g} degrees clockwise; only quarter turns and mirrors are applied",
        )
    return ("vflip",) if d < 0 else ()


def orient(picture: np.ndarray, steps: Sequence[str]) -> np.ndarray:
    """Apply orientation steps to an [H, W, C] picture (the pixel permutations FFmpeg's filters make)."""
    for step in steps:
        if step == "clock":
            picture = np.rot90(picture, k=-1)
        elif step == "cclock":
            picture = np.rot90(picture, k=1)
        elif step == "cclock_flip":  # the transpose proper: column j becomes row j
            picture = picture.transpose(1, 0, 2)
        elif step == "clock_flip":  # the transpose about the other diagonal
            picture = np.rot90(picture, k=2).transpose(1, 0, 2)
        elif step == "hflip":
            picture = picture[:, ::-1]
        elif step == "vflip":
            picture = picture[::-1]
        else:
            raise ValueError(f"unknown orientation step {step!r}")
    return picture


def describe_orientation(steps: Sequence[str]) -> str:
    """In words: 'mirrored left-right', 'turned 180 degrees', ..."""
    if tuple(steps) == ("hflip", "vflip"):
        return "turned 180 degrees"
    return ", then ".join(ORIENTATION_STEPS[s] for s in steps)


@dataclass(frozen=True)
class _Layout:
    """How a clip's decoded frames become bucket-sized pictures as shown."""

    steps: tuple[str, ...]  # orientation steps (ORIENTATION_STEPS), in order
    shown: tuple[int, int]  # (height, width) as shown
    bucket: tuple[int, int]  # (height, width)
    stored: tuple[int, int]  # (width, height) the decoded frame is resized to, before orientation
    top: int
    left: int
    interpolation: str


def _layout(frame, stream, name: str, src_h: int, src_w: int, buckets: Sequence[tuple[int, int]]) -> _Layout:
    """The layout for a clip from its first decoded frame. The bucket is chosen for the picture as
    it is shown: a phone clip stored landscape with a display rotation of -90 degrees is portrait."""
    steps = display_orientation(display_matrix(frame, stream))
    if steps:
        logger.info("%s: shown as its display matrix asks: %s (%s, as FFmpeg autorotates)", name, describe_orientation(steps), "+".join(steps))
    transposed = sum(step in TRANSPOSING_STEPS for step in steps) % 2 == 1
    shown_h, shown_w = (src_w, src_h) if transposed else (src_h, src_w)
    bucket_h, bucket_w = nearest_bucket(shown_h, shown_w, buckets)
    scale = max(bucket_h / shown_h, bucket_w / shown_w)
    resized_h = max(bucket_h, round(shown_h * scale))
    resized_w = max(bucket_w, round(shown_w * scale))
    return _Layout(
        steps=steps,
        shown=(shown_h, shown_w),
        bucket=(bucket_h, bucket_w),
        stored=(resized_h, resized_w) if transposed else (resized_w, resized_h),
        top=(resized_h - bucket_h) // 2,
        left=(resized_w - bucket_w) // 2,
        interpolation="AREA" if scale < 1 else "BICUBIC",
    )


def read_clip(source: Union[str, Path, bytes], name: str, sampling: FrameSampling, content_hash: str) -> ClipFrames:
    """Decode the frames a clip contributes, shown as its display matrix asks, resized and
    centre-cropped to its nearest bucket."""
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
        if image:
            count, (indices, fps, start) = 1, sample_indices(1, src_fps or 1.0, sampling, 0, True)
        else:
            count, indices, fps, start = _sample_clip(container, stream, name, sampling, src_fps or 1.0, int(content_hash[:15], 16))
        wanted: dict[int, list[int]] = {}
        for pos, idx in enumerate(indices):
            wanted.setdefault(idx, []).append(pos)
        out: Optional[np.ndarray] = None
        layout: Optional[_Layout] = None
        filled = 0
        last = max(indices)
        decoded = 0
        try:
            for i, frame in enumerate(container.decode(stream)):
                decoded = i + 1
                if layout is None:
                    layout = _layout(frame, stream, name, src_h, src_w, sampling.buckets)
                    out = np.empty((len(indices), *layout.bucket, 3), dtype=np.uint8)
                if i in wanted:
                    width, height = layout.stored
                    rgb = frame.reformat(width=width, height=height, format="rgb24", interpolation=layout.interpolation)
                    shown = orient(rgb.to_ndarray(), layout.steps)
                    crop = shown[layout.top : layout.top + layout.bucket[0], layout.left : layout.left + layout.bucket[1]]
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
        return ClipFrames(
            frames=out, fps=fps, source_frames=count, source_size=layout.shown, start=start, orientation=layout.steps,
            source_fps=src_fps,
        )
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


def write_video(
    path: Union[str, Path],
    frames: np.ndarray,
    fps: float = 8.0,
    *,
    codec: Optional[str] = None,
    faststart: bool = False,
    audio: Optional[tuple[np.ndarray, int]] = None,
) -> Path:
    """Write uint8 frames [F, H, W, 3] as an mp4 (through a temporary name, so a crash leaves none),
    with `audio` = (float waveform [channels (1 or 2), samples] in [-1, 1], sample rate) as an AAC
    track where given."""
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
        sound = container.add_stream("aac", rate=int(audio[1]), layout="stereo" if audio[0].shape[0] == 2 else "mono") if audio else None
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
        if sound is not None:
            _encode_audio(container, sound, np.asarray(audio[0], dtype=np.float32), int(audio[1]))
    tmp.replace(path)
    return path


def _encode_audio(container, stream, waveform: np.ndarray, rate: int) -> None:
    """Mux a planar float waveform [channels, samples] through `stream` in the codec's frame size."""
    import av

    layout = "stereo" if waveform.shape[0] == 2 else "mono"
    step = stream.codec_context.frame_size or 1024
    for start in range(0, waveform.shape[1], step):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(waveform[:, start : start + step]), format="fltp", layout=layout)
        frame.sample_rate, frame.pts = rate, start
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)


class StreamingVideoWriter:
    """An mp4 written as its frames come, readable while it grows: `write(frames)` encodes and muxes
    them at once into `<path>.partial` (fragmented mp4, a fragment per frame, each packet flushed to
    the file; libx264 with tune=zerolatency, so the encoder holds no frame back), `close()` finishes
    the file and renames it to `path`, `abort()` removes the partial file."""

    def __init__(self, path: Union[str, Path], fps: float = 16.0, codec: Optional[str] = None):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.fps = fps
        self.codec = codec or available_video_codec()
        self.container: Any = None
        self.stream: Any = None
        self.frames = 0

    def _open(self, height: int, width: int) -> None:
        import av

        self.path.parent.mkdir(parents=True, exist_ok=True)
        options = {"movflags": "frag_every_frame+empty_moov+default_base_moof", "flush_packets": "1"}
        self.container = av.open(str(self.partial), mode="w", format="mp4", options=options)
        self.stream = self.container.add_stream(self.codec, rate=int(round(self.fps)))
        self.stream.width, self.stream.height = width, height
        self.stream.pix_fmt = "yuv420p"
        if self.codec == "libx264":
            self.stream.options = {"crf": "12", "threads": "1", "tune": "zerolatency", "bf": "0"}
        else:
            self.stream.codec_context.max_b_frames = 0

    def write(self, frames: np.ndarray) -> None:
        """uint8 [F, H, W, 3], appended to the file before this returns."""
        import av

        if self.container is None:
            self._open(int(frames.shape[1]), int(frames.shape[2]))
        for f in frames:
            for packet in self.stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                self.container.mux(packet)
        self.frames += len(frames)

    def close(self) -> Path:
        if self.container is None:
            raise ValueError(f"{self.path}: no frames were written")
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
        self.container = None
        self.partial.replace(self.path)
        return self.path

    def abort(self) -> None:
        if self.container is not None:
            try:
                self.container.close()
            except Exception:  # noqa: BLE001 - a half-written file is removed either way
                pass
            self.container = None
        self.partial.unlink(missing_ok=True)
