"""Preprocessing: real mp4 files (and an image) -> FastVideo-schema latents, for every input form;
bad clips reported; interruption and rerun; processes sharding the clips; the tiny default."""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from fv_accel.tiny.data import render_clip, tiny_clip_specs
from fv_accel.data.video import FrameSampling, write_video
from fv_accel.preprocess import InputError, main, preprocess
from tests.launch_helpers import ANY_FREE_PORT

REPO = Path(__file__).resolve().parent.parent

SAMPLING = FrameSampling(num_frames=(5, 9), buckets=((32, 32), (32, 48)))
CPU = torch.device("cpu")


def _clip(k: int, frames: int, height: int, width: int) -> np.ndarray:
    return render_clip(tiny_clip_specs(k + 1, seed=7)[k], num_frames=frames, height=height, width=width)


def _caption(k: int) -> str:
    return tiny_clip_specs(k + 1, seed=7)[k].caption


def _write_clip(folder: Path, name: str, k: int, frames: int, height: int = 32, width: int = 32, caption=True) -> Path:
    path = write_video(folder / name, _clip(k, frames, height, width))
    if caption:
        path.with_suffix(".txt").write_text(_caption(k) + "\n")
    return path


def _rows(out: Path) -> list[dict]:
    import pyarrow.parquet as pq

    rows = []
    for f in sorted(out.glob("data-*.parquet")):
        rows += pq.read_table(f).to_pylist()
    return rows


def test_frame_sampling_stride_fps_start_and_buckets(tmp_path):
    from fv_accel.data.video import ClipError, content_hash, nearest_bucket, read_clip, sample_indices

    s = FrameSampling(num_frames=(5, 9), frame_stride=2)
    assert sample_indices(20, 16.0, s, 0, False) == ([0, 2, 4, 6, 8, 10, 12, 14, 16], 8.0, 0)
    assert sample_indices(12, 16.0, s, 0, False)[0] == [0, 2, 4, 6, 8]  # 9 frames need 17: takes 5
    fps = FrameSampling(num_frames=(5,), target_fps=10.0)
    assert sample_indices(30, 25.0, fps, 0, False) == ([0, 2, 5, 7, 10], 10.0, 0)
    uni = FrameSampling(num_frames=(5,), start="uniform", seed=1)
    starts = {sample_indices(100, 16.0, uni, c, False)[2] for c in range(20)}
    assert len(starts) > 10 and max(starts) <= 95
    assert sample_indices(100, 16.0, uni, 7, False) == sample_indices(100, 16.0, uni, 7, False)
    with pytest.raises(ClipError, match="4 frame.*5 frames with stride 2 need 9 source frames") as err:
        sample_indices(4, 16.0, FrameSampling(num_frames=(5,), frame_stride=2), 0, False)
    assert err.value.reason == "too_short"
    assert sample_indices(1, 0.0, s, 0, True) == ([0], 0.0, 0)

    buckets = ((480, 832), (832, 480), (512, 512))
    assert nearest_bucket(720, 1280, buckets) == (480, 832)
    assert nearest_bucket(1920, 1080, buckets) == (832, 480)
    assert nearest_bucket(600, 640, buckets) == (512, 512)
    with pytest.raises(ValueError, match="4k\\+1"):
        FrameSampling(num_frames=(8,))
    with pytest.raises(ValueError, match="multiples of 16"):
        FrameSampling(buckets=((480, 830),))

    # A 32x64 clip (aspect 2) goes to the 32x48 bucket (aspect 1.5): the scale that covers it,
    # max(32/32, 48/64) = 1, keeps it 32x64, and the middle 48 columns are kept.
    frames = _clip(0, 9, 32, 64)
    path = write_video(tmp_path / "wide.mp4", frames)
    got = read_clip(path, "wide.mp4", FrameSampling(num_frames=(9,), buckets=((32, 32), (32, 48))), content_hash(path))
    assert got.frames.shape == (9, 32, 48, 3) and got.source_size == (32, 64)
    centre = frames[:, :, 8:56].astype(np.float32)
    assert np.abs(got.frames.astype(np.float32) - centre).mean() < 6  # the middle, up to the codec
    assert np.abs(got.frames.astype(np.float32) - frames[:, :, :48]).mean() > np.abs(got.frames.astype(np.float32) - centre).mean()


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from fv_accel.models.encoders import TextVideoEncoder

    return TextVideoEncoder(str(tiny_model_dir), device=CPU)


@pytest.fixture(scope="module")
def clip_folder(tmp_path_factory):
    """Three mp4 clips of two sizes and lengths (one in a subfolder) and a PNG image, captioned."""
    from PIL import Image

    root = tmp_path_factory.mktemp("clips")
    _write_clip(root, "a.mp4", 0, 9)
    _write_clip(root, "b.mp4", 1, 13, 32, 48)  # 13 frames: takes 9, the longest length it fills
    _write_clip(root, "sub/c.mp4", 2, 7)  # 7 frames: takes 5
    Image.fromarray(_clip(3, 1, 40, 40)[0]).save(root / "d.png")
    (root / "d.txt").write_text(_caption(3))
    return root


EXPECTED = {  # name -> latent shape [C, T, H/8, W/8]
    "a.mp4": [16, 3, 4, 4],
    "b.mp4": [16, 3, 4, 6],
    "sub/c.mp4": [16, 2, 4, 4],
    "d.png": [16, 1, 4, 4],
}


def _by_key(rows: list[dict]) -> dict:
    return {r["fv_key"]: r for r in rows}


def test_input_forms_give_the_same_latents(clip_folder, encoder, tmp_path):
    import datasets

    names = sorted(EXPECTED)
    captions = {n: (clip_folder / n).with_suffix(".txt").read_text().strip() for n in names}
    meta = tmp_path / "meta"
    meta.mkdir()
    with open(meta / "clips.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["video", "caption"])
        for n in names:
            w.writerow([str(clip_folder / n), captions[n]])
    with open(meta / "clips.jsonl", "w") as f:
        for n in names:  # the other column names: file_name + prompt, paths relative to the file
            f.write(json.dumps({"file_name": os.path.relpath(clip_folder / n, meta), "prompt": captions[n]}) + "\n")
    features = datasets.Features({"video": datasets.Video(decode=False), "caption": datasets.Value("string")})
    hf = datasets.Dataset.from_dict(
        {"video": [{"bytes": (clip_folder / n).read_bytes(), "path": n} for n in names], "caption": [captions[n] for n in names]},
        features=features,
    )
    hf.save_to_disk(str(tmp_path / "hf"))

    results = {}
    for form, spec in [
        ("folder", clip_folder),
        ("csv", meta / "clips.csv"),
        ("jsonl", meta / "clips.jsonl"),
        ("hf", tmp_path / "hf"),
    ]:
        res = preprocess("tiny", str(spec), tmp_path / f"out-{form}", SAMPLING, encoder=encoder, device=CPU)
        assert (res.encoded, res.skipped) == (4, 0), form
        results[form] = _by_key(_rows(tmp_path / f"out-{form}"))

    ref = results["folder"]
    assert {r["file_name"]: r["vae_latent_shape"] for r in ref.values()} == EXPECTED
    for form, rows in results.items():
        assert rows.keys() == ref.keys(), form
        for key, row in rows.items():
            assert row["vae_latent_bytes"] == ref[key]["vae_latent_bytes"], form
            assert row["text_embedding_bytes"] == ref[key]["text_embedding_bytes"], form
            assert row["caption"] == ref[key]["caption"]
    a = next(r for r in ref.values() if r["file_name"] == "a.mp4")
    assert (a["num_frames"], a["height"], a["width"], a["fps"], a["media_type"]) == (9, 32, 32, 8.0, "video")
    assert a["text_embedding_shape"] == [len(a["caption"].split()) + 1, 32]  # words + </s>
    d = next(r for r in ref.values() if r["file_name"] == "d.png")
    assert (d["num_frames"], d["media_type"]) == (1, "image")

    # The decoded mp4 encodes close to the raw render (the codec is lossy, so not equal).
    from fv_accel.data.schema import bytes_to_tensor

    stored = bytes_to_tensor(a["vae_latent_bytes"], a["vae_latent_shape"], a["vae_latent_dtype"])
    raw = encoder.encode_video(_clip(0, 9, 32, 32))
    rel = float((stored - raw).norm() / raw.norm())
    assert 0 < rel < 0.1, rel
    info = json.loads((tmp_path / "out-folder" / "fv_dataset.json").read_text())
    assert info["model"] == "tiny" and len(info["latents_mean"]) == 16 and len(info["latents_std"]) == 16
    assert info["latents_mean"] == encoder.vae.config.latents_mean


def test_bad_clips_are_skipped_with_reasons(tmp_path, capsys, tiny_model_dir):
    src = tmp_path / "clips"
    _write_clip(src, "good1.mp4", 0, 9)
    _write_clip(src, "good2.mp4", 1, 9)
    (src / "corrupt.mp4").write_bytes(b"\x00\x00\x00\x18ftypmp42" + os.urandom(3000))
    (src / "corrupt.txt").write_text("a red circle")
    _write_clip(src, "short.mp4", 2, 3)  # fewer than the 5 frames asked for
    _write_clip(src, "nocaption.mp4", 3, 9, caption=False)
    _write_clip(src, "empty.mp4", 4, 9, caption=False)
    (src / "empty.txt").write_text("  \n")
    full = write_video(tmp_path / "x.mp4", _clip(5, 9, 32, 32), faststart=True).read_bytes()
    (src / "cut.mp4").write_bytes(full[: len(full) // 2])  # header intact, frames missing
    (src / "cut.txt").write_text("a blue square")
    (src / "notes.xyz").write_bytes(b"not a clip")
    out = tmp_path / "out"
    rc = main(["--model", str(tiny_model_dir), "--input", str(src), "--output", str(out),
               "--num_frames", "5,9", "--buckets", "32x32"])
    printed = capsys.readouterr().out
    assert rc == 0
    assert "encoded 2, skipped 6 (see skipped.jsonl)" in printed.splitlines()[-1]
    assert sorted(r["file_name"] for r in _rows(out)) == ["good1.mp4", "good2.mp4"]
    skipped = {r["path"]: r["reason"] for r in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}
    assert skipped == {
        "corrupt.mp4": "unreadable",
        "cut.mp4": "truncated",
        "short.mp4": "too_short",
        "nocaption.mp4": "missing_caption",
        "empty.mp4": "empty_caption",
        "notes.xyz": "unsupported_extension",
    }


def test_wholly_bad_input_is_a_clear_error(tmp_path, tiny_model_dir, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("nothing here")
    with pytest.raises(InputError, match=r"no video or image files \(\.mp4"):
        preprocess("tiny", str(tmp_path / "empty"), tmp_path / "o1", SAMPLING)
    (tmp_path / "wrong.csv").write_text("clip,text\na.mp4,hello\n")
    with pytest.raises(InputError, match=r"wrong\.csv: no video column: expected one of 'video', 'file_name'.*found columns 'clip', 'text'"):
        preprocess("tiny", str(tmp_path / "wrong.csv"), tmp_path / "o2", SAMPLING)
    (tmp_path / "nocap.jsonl").write_text(json.dumps({"video": "a.mp4", "label": "x"}) + "\n")
    with pytest.raises(InputError, match=r"no caption column: expected one of 'caption', 'prompt'"):
        preprocess("tiny", str(tmp_path / "nocap.jsonl"), tmp_path / "o3", SAMPLING)
    rc = main(["--model", str(tiny_model_dir), "--input", str(tmp_path / "missing"), "--output", str(tmp_path / "o4")])
    assert rc == 2 and "does not exist; expected a folder of videos" in capsys.readouterr().err
    rc = main(["--model", str(tiny_model_dir), "--input", str(tmp_path / "empty"), "--output", str(tmp_path / "o5"),
               "--num_frames", "8"])
    assert rc == 2 and "4k+1" in capsys.readouterr().err


class _StopAfter:
    """An encoder that dies (like a killed process) while encoding clip number `limit + 1`."""

    def __init__(self, encoder, limit: int):
        self.encoder, self.limit, self.calls = encoder, limit, 0
        self.vae, self.text_max_length = encoder.vae, encoder.text_max_length

    def caption_tokens(self, caption):
        return self.encoder.caption_tokens(caption)

    def encode_video(self, frames):
        self.calls += 1
        if self.calls > self.limit:
            raise KeyboardInterrupt("killed")
        return self.encoder.encode_video(frames)

    def encode_caption(self, caption):
        return self.encoder.encode_caption(caption)


@pytest.fixture(scope="module")
def five_clips(tmp_path_factory):
    root = tmp_path_factory.mktemp("five")
    for k in range(5):
        _write_clip(root, f"clip{k}.mp4", k, 9)
    return root


def test_interrupted_run_resumes_to_the_same_dataset(five_clips, encoder, tmp_path):
    sampling = FrameSampling(num_frames=(9,), buckets=((32, 32),))
    ref = preprocess("tiny", str(five_clips), tmp_path / "ref", sampling, shard_size=2, encoder=encoder, device=CPU)
    assert (ref.encoded, ref.newly_encoded) == (5, 5)

    out = tmp_path / "resumed"
    with pytest.raises(KeyboardInterrupt):
        preprocess("tiny", str(five_clips), out, sampling, shard_size=2, encoder=_StopAfter(encoder, 3), device=CPU)
    # Shard 0 (clips 0-1) finished; clip 2 waits as a pending row; clip 3 was in flight.
    assert [f.name for f in sorted(out.glob("data-*.parquet"))] == ["data-00000-of-00003.parquet"]
    assert len(list((out / ".fv_pending").glob("*.parquet"))) == 1

    again = preprocess("tiny", str(five_clips), out, sampling, shard_size=2, encoder=encoder, device=CPU)
    assert (again.encoded, again.reused, again.newly_encoded) == (5, 3, 2)
    assert [f.name for f in sorted(out.iterdir())] == [f.name for f in sorted((tmp_path / "ref").iterdir())]
    assert _rows(out) == _rows(tmp_path / "ref")
    for name in ("fv_dataset.json", "skipped.jsonl"):
        assert (out / name).read_text() == (tmp_path / "ref" / name).read_text()

    # Nothing left to do; a changed caption re-encodes that clip alone.
    assert preprocess("tiny", str(five_clips), out, sampling, shard_size=2, encoder=encoder, device=CPU).newly_encoded == 0
    work = tmp_path / "work"
    work.mkdir()
    for f in five_clips.iterdir():
        (work / f.name).write_bytes(f.read_bytes())
    (work / "clip4.txt").write_text("a white square moving up on a dark background")
    changed = preprocess("tiny", str(work), out, sampling, shard_size=2, encoder=encoder, device=CPU)
    assert (changed.encoded, changed.newly_encoded, changed.reused) == (5, 1, 4)
    assert _rows(out)[-1]["caption"] == "a white square moving up on a dark background"
    # Captions are the text the Wan pipeline encodes (its prompt_clean): a caption that cleans to the
    # same text is the same row; the unconditional text (the empty prompt's) is stored beside the shards.
    (work / "clip4.txt").write_text("a white  square moving up\non a dark background &amp;")
    cleaned = preprocess("tiny", str(work), out, sampling, shard_size=2, encoder=encoder, device=CPU)
    assert cleaned.newly_encoded == 1 and _rows(out)[-1]["caption"] == "a white square moving up on a dark background &"
    (work / "clip4.txt").write_text("a white square   moving up on a dark background &amp;amp;\n")
    assert preprocess("tiny", str(work), out, sampling, shard_size=2, encoder=encoder, device=CPU).newly_encoded == 0
    from fv_accel.data.schema import read_unconditional_text

    assert torch.equal(read_unconditional_text(out)["text_embedding"], encoder.encode_caption("")["text_embedding"])


def test_preprocessed_folder_trains_with_both_methods(five_clips, encoder, tmp_path):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    from conftest import tiny_overrides

    data = tmp_path / "latents"
    preprocess("tiny", str(five_clips), data, FrameSampling(num_frames=(9,), buckets=((32, 32),)), encoder=encoder, device=CPU)
    for method in ("finetune", "dfsft"):
        over = tiny_overrides(tmp_path / method, **{
            "training.data.data_path": str(data),
            "training.loop.max_train_steps": 2,
            "training.checkpoint.save_final": False,
        })
        run = build_from_config(str(default_recipe(method)), over)
        # The student takes the VAE statistics recorded by preprocessing.
        assert run.config.models.student.latents_mean == encoder.vae.config.latents_mean
        summary = Trainer(run).run()
        assert summary["steps"] == 2 and np.isfinite(summary["last_loss"]), method


def test_tiny_default_starts_from_mp4_files(tiny_data_path):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.tiny.data import ensure_tiny_dataset

    latents = Path(tiny_data_path)
    videos = sorted((latents.parent / "videos").glob("*.mp4"))
    assert len(videos) == 8 and all(v.with_suffix(".txt").is_file() for v in videos)
    import av

    with av.open(str(videos[0])) as c:
        s = c.streams.video[0]
        assert (s.frames, s.codec_context.width, s.codec_context.height) == (21, 48, 48)
    rows = _rows(latents)
    assert len(rows) == 8 and all(r["vae_latent_shape"] == [16, 6, 6, 6] for r in rows)
    assert rows[0]["caption"] == videos[0].with_suffix(".txt").read_text().strip()
    assert json.loads((latents / "fv_dataset.json").read_text())["model"] == str(latents.parent / "tiny-model")
    shard = next(latents.glob("data-*.parquet"))
    before = shard.stat().st_mtime_ns
    cfg = load_config(default_recipe("finetune"))
    assert ensure_tiny_dataset(cfg.training.data) == latents and shard.stat().st_mtime_ns == before


@pytest.mark.multiproc
def test_two_processes_shard_the_clips_into_one_dataset(five_clips, tiny_model_dir, encoder, tmp_path):
    sampling = FrameSampling(num_frames=(9,), buckets=((32, 32),))
    preprocess(str(tiny_model_dir), str(five_clips), tmp_path / "one", sampling, shard_size=1, encoder=encoder, device=CPU)
    env = dict(os.environ, ACCELERATE_USE_CPU="1", HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    cmd = [
        str(REPO / ".venv" / "bin" / "accelerate") if (REPO / ".venv" / "bin" / "accelerate").exists() else "accelerate",
        "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
        *ANY_FREE_PORT,
        "--dynamo_backend", "no", "-m", "fv_accel.preprocess",
        "--model", str(tiny_model_dir), "--input", str(five_clips), "--output", str(tmp_path / "two"),
        "--num_frames", "9", "--buckets", "32x32", "--shard_size", "1", "--dtype", "float32",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "on 2 process(es)" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1] == "encoded 5, skipped 0 (see skipped.jsonl)"
    assert [f.name for f in sorted((tmp_path / "two").glob("data-*"))] == [f"data-{i:05d}-of-00005.parquet" for i in range(5)]
    assert _rows(tmp_path / "two") == _rows(tmp_path / "one")


def test_preprocessing_shows_a_progress_bar(encoder, tmp_path, capsys):
    for k in range(8):
        _write_clip(tmp_path / "clips", f"{k}.mp4", k, 5)
    res = preprocess("tiny", str(tmp_path / "clips"), tmp_path / "out", FrameSampling(num_frames=(5,)), encoder=encoder, device=CPU)
    assert res.newly_encoded == 8
    # stderr is no terminal here: plain lines (count, share, rate), no carriage return.
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"^preprocess: 8/8 clip \(100%\), [\d.e+]+ clip/s$", err, re.M), err


def test_a_caption_cut_to_the_text_length_is_counted_and_reported(encoder, tmp_path, caplog):
    """Issue 28: a 10,000-character caption is embedded as its first 512 tokens; preprocessing says so
    in its log and in fv_dataset.json (how many, the longest in tokens, the limit)."""
    import logging

    from PIL import Image

    clips = tmp_path / "clips"
    clips.mkdir()
    for name, k in (("long.png", 0), ("short.png", 1)):
        Image.fromarray(_clip(k, 1, 32, 32)[0]).save(clips / name)
    long_caption = " ".join(f"word{i % 97}" for i in range(1400))[:10_000]
    (clips / "long.txt").write_text(long_caption)
    (clips / "short.txt").write_text(_caption(1))
    tokens = len(encoder.tokenizer(long_caption).input_ids)
    assert tokens > 512
    with caplog.at_level(logging.WARNING, logger="fv_accel.preprocess"):
        preprocess("tiny", str(clips), tmp_path / "out", FrameSampling(num_frames=(5,), buckets=((32, 32),)), encoder=encoder, device=CPU)
    assert (
        f"1 of 2 caption(s) are longer than the text encoder's 512 tokens and were cut there (the longest: {tokens} tokens; "
        "first: long.png)"
    ) in caplog.text
    info = json.loads((tmp_path / "out" / "fv_dataset.json").read_text())
    assert info["captions_cut"] == {"captions": 1, "counted": 2, "longest_tokens": tokens, "limit": 512, "first": ["long.png"]}
    rows = {r["id"]: r for r in _rows(tmp_path / "out")}
    assert rows["long.png"]["text_embedding_shape"][0] == 512  # what the encoder kept
    # A rerun reuses both rows without encoding them and reports the same.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fv_accel.preprocess"):
        again = preprocess("tiny", str(clips), tmp_path / "out", FrameSampling(num_frames=(5,), buckets=((32, 32),)), encoder=encoder, device=CPU)
    assert again.reused == 2 and "1 of 2 caption(s) are longer" in caplog.text
    assert json.loads((tmp_path / "out" / "fv_dataset.json").read_text())["captions_cut"] == info["captions_cut"]
