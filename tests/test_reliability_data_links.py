"""Issue 31 (reliability, round 4), data side: clips mirrored by their display matrix, clips in
linked folders, dangling links and link loops, a container that under-reports its frames, an output
folder that cannot be written, and a prompt file that is not UTF-8 or is a folder. Each test writes
real (tiny) files and checks the right frames, the skipped.jsonl entry or the one error line."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fv_accel.data.video import ClipError, FrameSampling, available_video_codec, content_hash, read_clip

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from fv_accel.models.encoders import TextVideoEncoder

    return TextVideoEncoder(str(tiny_model_dir), device=CPU)


def _encode(path: Path, frames: list[np.ndarray], fmt: str = "mp4", codec: str | None = None, matrix=None) -> Path:
    """Write rgb frames (lossless where libx264 is there), with an optional display matrix."""
    import av

    codec = codec or available_video_codec()
    with av.open(str(path), mode="w", format=fmt) as container:
        stream = container.add_stream(codec, rate=8)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "0", "threads": "1"}
        if matrix is not None:
            stream.set_display_rotation(matrix[0], hflip=matrix[1], vflip=matrix[2])
        for f in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


# --------------------------------------------------------------------------------------------
# 4. The display matrix: rotations and mirrors
# --------------------------------------------------------------------------------------------


def _as_the_matrix_says(picture: np.ndarray, m: tuple[int, ...]) -> np.ndarray:
    """The picture as the 3x3 display matrix maps it, from the matrix's definition alone: source
    pixel (x, y) goes to (a*x + c*y, b*x + d*y), shifted back into the frame (FFmpeg's layout:
    a b u / c d v / x y w). Only for the eight matrices of quarter turns and mirrors."""
    a, b, c, d = (int(np.sign(v)) for v in (m[0], m[1], m[3], m[4]))
    ys, xs = np.mgrid[0 : picture.shape[0], 0 : picture.shape[1]]
    x2, y2 = a * xs + c * ys, b * xs + d * ys
    x2, y2 = x2 - x2.min(), y2 - y2.min()
    out = np.zeros((y2.max() + 1, x2.max() + 1, 3), dtype=picture.dtype)
    out[y2, x2] = picture
    return out


# (counter-clockwise degrees, hflip, vflip) as PyAV writes the matrix -> FFmpeg's autorotation steps.
ORIENTATIONS = [
    ((0, True, False), ("hflip",)),  # PyAV reads its rotation as -180
    ((0, False, True), ("vflip",)),
    ((90, False, False), ("cclock",)),
    ((180, False, False), ("hflip", "vflip")),
    ((270, False, False), ("clock",)),
    ((90, True, False), ("clock_flip",)),
    ((90, False, True), ("cclock_flip",)),
    ((180, True, False), ("vflip",)),
    ((270, True, False), ("cclock_flip",)),
]


def _side_data_matrix(frame) -> tuple[int, ...]:
    (data,) = [d for d in frame.side_data if d.type.name == "DISPLAYMATRIX"]
    return struct.unpack("=9i", bytes(data)[:36])


def test_display_matrix_mirrors_and_turns_clips_as_ffmpeg_autorotates(tmp_path, caplog):
    import av

    # 4x8 blocks of distinct colours: each of the eight orientations looks different.
    blocks = np.random.default_rng(0).integers(0, 256, size=(4, 8, 3), dtype=np.uint8)
    picture = np.repeat(np.repeat(blocks, 8, axis=0), 8, axis=1)  # 32 high, 64 wide
    sampling = FrameSampling(num_frames=(5,), buckets=((32, 64), (64, 32)))  # no resize, no crop
    caplog.set_level(logging.INFO, logger="fv_accel.data.video")
    for k, (written, steps) in enumerate(ORIENTATIONS):
        path = _encode(tmp_path / f"clip{k}.mp4", [picture] * 5, matrix=written)
        with av.open(str(path)) as container:
            first = next(container.decode(video=0))
            expected = _as_the_matrix_says(first.to_ndarray(format="rgb24"), _side_data_matrix(first))
        caplog.clear()
        got = read_clip(path, path.name, sampling, content_hash(path))
        assert got.frames.shape[1:3] == expected.shape[:2] == got.source_size
        diff = float(np.abs(got.frames.astype(np.int16) - expected.astype(np.int16)).mean())
        assert diff < 1.0, (written, steps, diff)
        assert got.orientation == steps, written
        # One log line per clip, saying what was applied.
        lines = [r.getMessage() for r in caplog.records if path.name in r.getMessage()]
        assert len(lines) == 1 and "+".join(steps) in lines[0], lines
    # A clip without a display matrix is read as stored, without a log line.
    plain = _encode(tmp_path / "plain.mp4", [picture] * 5)
    caplog.clear()
    got = read_clip(plain, plain.name, sampling, content_hash(plain))
    assert got.orientation == () and not caplog.records
    with av.open(str(plain)) as container:
        decoded = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert float(np.abs(got.frames[0].astype(np.int16) - decoded.astype(np.int16)).mean()) < 1.0


def test_rotate_tag_and_odd_angles():
    from types import SimpleNamespace

    from fv_accel.data.video import display_matrix, display_orientation

    # The 'rotate' tag of older FFmpeg builds (clockwise degrees), when the frame has no matrix.
    no_side_data = SimpleNamespace(side_data=())
    assert display_orientation(display_matrix(no_side_data, SimpleNamespace(metadata={"rotate": "90"}))) == ("clock",)
    assert display_orientation(display_matrix(no_side_data, SimpleNamespace(metadata={"rotate": "270"}))) == ("cclock",)
    assert display_matrix(no_side_data, SimpleNamespace(metadata={})) is None
    # A singular matrix has no angle: FFmpeg applies only its vertical flip.
    assert display_orientation((0, 0, 0, 0, -65536, 0, 0, 0, 1 << 30)) == ("vflip",)
    assert display_orientation((65536, 0, 0, 0, 0, 0, 0, 0, 1 << 30)) == ()
    # An angle that is not a quarter turn is not guessed at: the clip is skipped, saying why.
    c, s = round(np.cos(np.radians(72)) * 65536), round(np.sin(np.radians(72)) * 65536)
    with pytest.raises(ClipError, match="turns the picture 72 degrees clockwise") as err:
        display_orientation((c, s, 0, -s, c, 0, 0, 0, 1 << 30))  # as av_display_rotation_set(72) writes it
    assert err.value.reason == "unsupported_rotation"


# --------------------------------------------------------------------------------------------
# 5. Links: followed into folders, dangling ones and loops reported
# --------------------------------------------------------------------------------------------


def _tiny_clip(path: Path, caption: str) -> None:
    from fv_accel.data.video import write_video
    from fv_accel.tiny.clips import render_clip, tiny_clip_specs

    write_video(path, render_clip(tiny_clip_specs(1, seed=len(caption))[0], num_frames=5, height=32, width=32))
    path.with_suffix(".txt").write_text(caption)


def test_clips_in_linked_folders_are_found_and_bad_links_are_reported(tmp_path, encoder):
    from fv_accel.preprocess import list_inputs, preprocess

    clips, elsewhere = tmp_path / "clips", tmp_path / "elsewhere"
    (clips / "real").mkdir(parents=True)
    (elsewhere / "deeper").mkdir(parents=True)
    _tiny_clip(clips / "real" / "a.mp4", "a clip in a real folder")
    _tiny_clip(elsewhere / "deeper" / "b.mp4", "a clip in a linked folder")
    (clips / "linked").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "back").symlink_to(clips, target_is_directory=True)  # a loop through the link
    (clips / "real" / "again").symlink_to(clips / "real", target_is_directory=True)  # a loop
    (clips / "twice").symlink_to(clips / "real", target_is_directory=True)  # the same folder again
    (clips / "gone.mp4").symlink_to(tmp_path / "deleted.mp4")
    found, form = list_inputs(str(clips))
    assert form == "folder of clips"
    listed = {c.name: c.problem[0] if c.problem else None for c in found}
    assert listed == {
        "gone.mp4": "dangling_link",
        "linked/back": "link_loop",
        "linked/deeper/b.mp4": None,
        "real/a.mp4": None,
        "real/again": "link_loop",
        "twice": "link_to_listed_folder",
    }
    # Preprocessed (without the real folder's clip: one clip to encode is enough here), the clip
    # in the linked folder is encoded and each bad link has its entry, the summary counting them.
    (clips / "real" / "a.mp4").unlink()
    out = tmp_path / "out"
    sampling = FrameSampling(num_frames=(5,), buckets=((32, 32),))
    result = preprocess("tiny", str(clips), out, sampling, encoder=encoder, device=CPU)
    assert (result.encoded, result.skipped) == (1, 4) and result.summary == "encoded 1, skipped 4 (see skipped.jsonl)"
    import pyarrow.parquet as pq

    assert [r["file_name"] for f in out.glob("data-*.parquet") for r in pq.read_table(f).to_pylist()] == ["linked/deeper/b.mp4"]
    skipped = {r["path"]: r for r in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert skipped["gone.mp4"] == {
        "path": "gone.mp4",
        "reason": "dangling_link",
        "detail": f"a symbolic link to '{tmp_path / 'deleted.mp4'}' that cannot be followed (No such file or directory)",
    }
    assert skipped["real/again"]["detail"] == "a link to the folder 'real' that holds it: not followed (a loop)"
    assert skipped["linked/back"]["detail"] == "a link to the folder '.' that holds it: not followed (a loop)"
    assert skipped["twice"]["detail"] == "a link to the folder 'real', listed already: not followed"
    # A metadata file naming a dangling link says so too.
    meta = tmp_path / "meta.csv"
    meta.write_text("video,caption\nclips/gone.mp4,x\nclips/linked/deeper/b.mp4,y\n")
    rows, _ = list_inputs(str(meta))
    assert [r.problem[0] if r.problem else None for r in rows] == ["dangling_link", None]


# --------------------------------------------------------------------------------------------
# Weak cases
# --------------------------------------------------------------------------------------------


def _avi_announcing(path: Path, real: int, announced: int) -> Path:
    """An AVI of `real` frames whose stream header (strh dwLength) announces `announced`."""
    frames = [np.full((32, 32, 3), 10 * i, dtype=np.uint8) for i in range(real)]
    _encode(path, frames, fmt="avi", codec="mpeg4")
    data = bytearray(path.read_bytes())
    at = data.index(b"strh") + 40  # 'strh', its size, then fccType ... dwStart: 32 bytes
    assert struct.unpack_from("<I", data, at)[0] == real
    struct.pack_into("<I", data, at, announced)
    path.write_bytes(bytes(data))
    return path


def test_container_that_under_reports_its_frames_keeps_its_clip(tmp_path, caplog):
    import av

    path = _avi_announcing(tmp_path / "short_header.avi", real=20, announced=5)
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 5  # the header under-reports
    caplog.set_level(logging.INFO, logger="fv_accel.data.video")
    for lengths in ((17,), (5, 17)):
        got = read_clip(path, path.name, FrameSampling(num_frames=lengths, buckets=((32, 32),)), content_hash(path))
        assert got.frames.shape == (17, 32, 32, 3) and got.source_frames == 20
        # Frame i is grey level 10*i: the first 17 frames, in order.
        levels = got.frames.reshape(17, -1).mean(axis=1)
        assert np.abs(levels - 10 * np.arange(17)).max() < 4, levels
    assert "the header announces 5 frame(s), the stream holds 20" in caplog.text
    # A clip really too short is still skipped as too short.
    with pytest.raises(ClipError, match="20 frame"):
        read_clip(path, path.name, FrameSampling(num_frames=(21,), buckets=((32, 32),)), content_hash(path))


def _read_only(folder: Path):
    """Make `folder` unwritable (chmod; for root, which ignores modes, the immutable attribute);
    returns an undo function, or skips the test where neither works here."""
    folder.mkdir(parents=True, exist_ok=True)
    folder.chmod(0o555)
    undo = [lambda: folder.chmod(0o755)]
    if os.geteuid() == 0 and shutil.which("chattr"):
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
            undo.insert(0, lambda: subprocess.run(["chattr", "-i", str(folder)], check=True))
    try:
        (folder / "probe").write_text("")
    except OSError:
        return lambda: [u() for u in undo]
    (folder / "probe").unlink()
    for u in undo:
        u()
    pytest.skip("cannot make a folder read-only here")


def test_preprocess_into_a_read_only_output_is_one_line(tmp_path, tiny_model_dir, capsys):
    from fv_accel.preprocess import main

    clips = tmp_path / "clips"
    clips.mkdir()
    _tiny_clip(clips / "a.mp4", "a clip")
    locked = tmp_path / "locked"
    undo = _read_only(locked)
    try:
        for out in (locked, locked / "out"):
            rc = main(["--model", str(tiny_model_dir), "--input", str(clips), "--output", str(out), "--num_frames", "5",
                       "--buckets", "32x32"])
            err = capsys.readouterr().err.strip().splitlines()
            # Permission denied (a mode) or Operation not permitted (the immutable attribute).
            assert rc == 2 and len(err) == 1, err
            assert re.fullmatch(rf"error: --output {re.escape(str(out))}: cannot write there \((Permission denied|Operation not permitted)\)", err[0])
    finally:
        undo()
    assert sorted(p.name for p in locked.iterdir()) == []
    (tmp_path / "a_file").write_text("x")
    assert main(["--model", str(tiny_model_dir), "--input", str(clips), "--output", str(tmp_path / "a_file"),
                 "--num_frames", "5", "--buckets", "32x32"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --output {tmp_path / 'a_file'}: a file is there, not a folder"


def test_prompt_file_not_utf8_or_a_folder_is_one_line_naming_it(tmp_path):
    from fv_accel.validation import read_prompt_file

    latin1 = tmp_path / "prompts.txt"
    latin1.write_bytes("a red circle\nun café crème\n".encode("latin-1"))
    with pytest.raises(ValueError) as err:
        read_prompt_file(latin1)
    assert str(err.value) == (
        f"callbacks.validation.prompt_file: '{latin1}' is not UTF-8 (byte e9 at offset 19, line 2); save it as UTF-8"
    )
    folder = tmp_path / "prompts"
    folder.mkdir()
    with pytest.raises(ValueError) as err:
        read_prompt_file(folder)
    assert str(err.value) == (
        f"callbacks.validation.prompt_file: '{folder}' is a folder; expected a .txt, .jsonl or .json file of prompts"
    )
    # UTF-8 with a byte-order mark reads as UTF-8.
    latin1.write_bytes("\ufeffun café crème\n".encode("utf-8"))
    assert read_prompt_file(latin1) == ["un café crème"]
