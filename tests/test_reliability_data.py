"""Issue 14 (reliability, round 2), data side: each test feeds the input the issue's filer used and
asserts the new behaviour: one line naming the file, row, key or value, with nothing written to the
output folder; or the right result (a rotated clip upright, a caption decoded, a sample named)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fv_accel.cli import main as cli_main
from fv_accel.config import ConfigError, default_recipe, load_config, parse_cli
from fv_accel.data.schema import IncompleteDatasetError, make_row, write_dataset_info, write_rows
from tests.resume_helpers import build, build_fails, output_files, small_overrides, write_latent_dataset

CPU = torch.device("cpu")




def _cli_error(tmp_path: Path, overrides: dict, capsys) -> str:
    """What `train_finetune.py --config <recipe>` prints for these overrides: one line, exit 2."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(load_config(default_recipe("finetune"), overrides).to_yaml())
    capsys.readouterr()
    assert cli_main("finetune", ["--config", str(recipe)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert not Path(overrides["training.checkpoint.output_dir"]).exists()
    return lines[0]


def _rows(n: int, *, shape=(16, 3, 4, 4), text=(7, 32), seed: int = 0, start: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        make_row(
            sample_id=f"clip-{start + i}",
            latent=torch.randn(*shape, generator=g),
            text_embedding=torch.randn(*text, generator=g),
            caption=f"user clip {start + i}",
        )
        for i in range(n)
    ]


def _dataset(folder: Path, rows: list[dict], name: str = "data.parquet", stats: bool = True) -> str:
    write_rows(rows, folder / name)
    if stats:
        write_dataset_info(folder, model=None, latent_stats=([0.0] * 16, [1.0] * 16))
    return str(folder)


@pytest.fixture(scope="module")
def encoder(tiny_model_dir):
    from fv_accel.models.encoders import TextVideoEncoder

    return TextVideoEncoder(str(tiny_model_dir), device=CPU)


def _write_clips(folder: Path, captions: list[str], frames: int = 9) -> Path:
    from fv_accel.data.video import write_video
    from fv_accel.tiny.clips import render_clip, tiny_clip_specs

    specs = tiny_clip_specs(len(captions), seed=11)
    for k, caption in enumerate(captions):
        write_video(folder / f"clip{k}.mp4", render_clip(specs[k], num_frames=frames, height=32, width=32))
        (folder / f"clip{k}.txt").write_text(caption + "\n", encoding="utf-8")
    return folder


# --------------------------------------------------------------------------------------------
# 3. A partly preprocessed dataset
# --------------------------------------------------------------------------------------------


def test_two_of_six_shards_without_fv_dataset_json_is_refused(tmp_path, capsys):
    data = tmp_path / "latents"
    _dataset(data, _rows(2), "data-00000-of-00006.parquet", stats=False)
    _dataset(data, _rows(2, start=2), "data-00001-of-00006.parquet", stats=False)
    message = (
        f"{data}: the dataset is incomplete: shard(s) 00002, 00003, 00004, 00005 of data-*-of-00006 are missing "
        f"(2 of 6 present) and fv_dataset.json, which preprocessing writes last, is missing; finish it by rerunning "
        f"the same `python -m fv_accel.preprocess ... --output {data}` command (it resumes where it stopped)"
    )
    build_fails("finetune", small_overrides(tmp_path / "out", str(data)), IncompleteDatasetError, message)
    assert _cli_error(tmp_path, small_overrides(tmp_path / "out", str(data)), capsys) == f"error: {message}"


def test_interrupted_preprocessing_is_refused_naming_its_command_then_resumes(tmp_path, encoder):
    from fv_accel.data.loader import LatentDataset
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess

    class StopAfter:  # dies while encoding clip number limit + 1, like a killed process
        def __init__(self, limit: int):
            self.limit, self.calls, self.vae = limit, 0, encoder.vae

        def encode_video(self, frames):
            self.calls += 1
            if self.calls > self.limit:
                raise KeyboardInterrupt("killed")
            return encoder.encode_video(frames)

        def encode_caption(self, caption):
            return encoder.encode_caption(caption)

    clips = _write_clips(tmp_path / "clips", [f"a clip number {k}" for k in range(5)])
    out = tmp_path / "latents"
    sampling = FrameSampling(num_frames=(9,), buckets=((32, 32),))
    command = f"python -m fv_accel.preprocess --model tiny --input {clips} --output {out} --num_frames 9 --buckets 32x32"
    with pytest.raises(KeyboardInterrupt):
        preprocess("tiny", str(clips), out, sampling, shard_size=2, encoder=StopAfter(3), device=CPU, command=command)
    with pytest.raises(IncompleteDatasetError) as err:
        LatentDataset(str(out))
    assert str(err.value) == (
        f"{out}: the dataset is incomplete: preprocessing has not finished (.fv_pending/ is still there, 1 encoded "
        "clip(s) not yet in a shard, and fv_dataset.json is missing); finish it by rerunning the same command (it "
        f"resumes where it stopped): {command}"
    )
    # Rerunning the command finishes it: all five rows, and the command marker is gone with the pending rows.
    done = preprocess("tiny", str(clips), out, sampling, shard_size=2, encoder=encoder, device=CPU, command=command)
    assert (done.encoded, done.reused, done.newly_encoded) == (5, 3, 2)
    assert len(LatentDataset(str(out))) == 5 and not (out / ".fv_pending").exists()
    # A shard lost afterwards (a partial copy): fv_dataset.json's row count catches it.
    (out / "data-00001-of-00003.parquet").unlink()
    with pytest.raises(ValueError, match=r"fv_dataset\.json records 5 rows but its Parquet files hold 3: shards were"):
        LatentDataset(str(out))


def test_no_latent_statistics_is_an_error_naming_the_keys(tmp_path, tiny_model_dir):
    fastvideo = _dataset(tmp_path / "fastvideo", _rows(4), stats=False)  # FastVideo writes no fv_dataset.json
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", fastvideo),
        ConfigError,
        f"no latent statistics to normalise the latents with: training.data.data_path '{fastvideo}' has no "
        "fv_dataset.json recording them (preprocessing writes it), and models.student.latents_mean / latents_std "
        "are not set; set those two keys to the per-channel mean and std of the VAE that encoded the data",
    )
    # From the recipe ...
    mean, std = [0.5] * 16, [2.0] * 16
    run = build("finetune", small_overrides(
        tmp_path / "out", fastvideo, **{"models.student.latents_mean": mean, "models.student.latents_std": std}
    ))
    assert run.method.student.latents_mean.flatten().tolist() == mean
    # ... or from the model's own VAE config.
    run = build("finetune", small_overrides(
        tmp_path / "out2", fastvideo, **{"models.student.init_from": str(tiny_model_dir), "models.student.transformer_config": None}
    ))
    vae = json.loads((tiny_model_dir / "vae" / "config.json").read_text())
    assert torch.allclose(run.method.student.latents_mean.flatten(), torch.tensor(vae["latents_mean"]))


# --------------------------------------------------------------------------------------------
# 5. Phone videos and captions
# --------------------------------------------------------------------------------------------


def _phone_clip(path: Path, degrees: int, frames: int = 5) -> Path:
    """A 64x32 (width x height) clip, left half white, stored with a display rotation like a phone's."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=8)
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(degrees)
        picture = np.zeros((32, 64, 3), dtype=np.uint8)
        picture[:, :32] = 255
        for _ in range(frames):
            for packet in stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path


def test_rotated_phone_clip_is_turned_upright_before_bucketing(tmp_path, encoder):
    from fv_accel.data.video import FrameSampling, content_hash, read_clip
    from fv_accel.preprocess import preprocess

    sampling = FrameSampling(num_frames=(5,), buckets=((64, 32), (32, 64)))  # portrait and landscape
    for degrees, bright in ((-90, "top"), (90, "bottom")):
        path = _phone_clip(tmp_path / f"phone{degrees}.mp4", degrees)
        got = read_clip(path, path.name, sampling, content_hash(path))
        # Shown upright it is 32 wide and 64 high: the portrait bucket, the white half on top (-90:
        # turned clockwise) or at the bottom (+90).
        assert got.source_size == (64, 32) and got.frames.shape == (5, 64, 32, 3)
        top, bottom = got.frames[:, :28].mean(), got.frames[:, 36:].mean()
        assert (top > 200 and bottom < 50) if bright == "top" else (bottom > 200 and top < 50), (degrees, top, bottom)
    # (The 'rotate' tag of older FFmpeg builds and mirrored clips: tests/test_reliability_data_links.py.)

    clips = tmp_path / "clips"
    clips.mkdir()
    (clips / "phone.mp4").write_bytes((tmp_path / "phone-90.mp4").read_bytes())
    (clips / "phone.txt").write_text("a portrait clip")
    preprocess("tiny", str(clips), tmp_path / "out", sampling, encoder=encoder, device=CPU)
    import pyarrow.parquet as pq

    (row,) = pq.read_table(next((tmp_path / "out").glob("data-*.parquet"))).to_pylist()
    assert (row["height"], row["width"], row["vae_latent_shape"]) == (64, 32, [16, 2, 8, 4])


def test_latin1_caption_is_skipped_as_not_utf8_or_decoded_when_asked(tmp_path, tiny_model_dir, encoder, capsys):
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import InputError, main, preprocess

    clips = _write_clips(tmp_path / "clips", ["a plain caption", "x"])
    (clips / "clip1.txt").write_bytes("café crème\n".encode("latin-1"))
    sampling = FrameSampling(num_frames=(9,), buckets=((32, 32),))
    out = tmp_path / "out"
    result = preprocess("tiny", str(clips), out, sampling, encoder=encoder, device=CPU)
    assert (result.encoded, result.skipped) == (1, 1)
    assert [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()] == [{
        "path": "clip1.mp4",
        "reason": "caption_not_utf8",
        "detail": "clip1.txt is not valid utf-8 (byte e9 at offset 3); pass --caption_encoding with the file's "
        "encoding (e.g. latin-1), or save it as UTF-8",
    }]
    # The command line with --caption_encoding latin-1 decodes it.
    out2 = tmp_path / "out2"
    rc = main(["--model", str(tiny_model_dir), "--input", str(clips), "--output", str(out2), "--num_frames", "9",
               "--buckets", "32x32", "--caption_encoding", "latin-1"])
    assert rc == 0 and capsys.readouterr().out.strip().splitlines()[-1] == "encoded 2, skipped 0 (see skipped.jsonl)"
    import pyarrow.parquet as pq

    captions = sorted(r["caption"] for f in out2.glob("data-*.parquet") for r in pq.read_table(f).to_pylist())
    assert captions == ["a plain caption", "café crème"]
    assert main(["--model", "tiny", "--input", str(clips), "--output", str(out2), "--caption_encoding", "nope"]) == 2
    assert capsys.readouterr().err.strip() == "error: --caption_encoding: unknown encoding 'nope'"
    # A Latin-1 metadata file is one clear error naming the line.
    (tmp_path / "meta.csv").write_bytes("video,caption\nclips/clip0.mp4,ok\nclips/clip1.mp4,café\n".encode("latin-1"))
    with pytest.raises(InputError, match=r"meta\.csv line 3: not valid utf-8 \(byte e9\); pass --caption_encoding"):
        preprocess("tiny", str(tmp_path / "meta.csv"), tmp_path / "out3", sampling, encoder=encoder, device=CPU)


# --------------------------------------------------------------------------------------------
# 8. Data checks at build time
# --------------------------------------------------------------------------------------------


def test_row_whose_bytes_do_not_match_its_shape(tmp_path):
    rows = _rows(4)
    rows[2]["vae_latent_bytes"] = rows[2]["vae_latent_bytes"][:-8]
    data = _dataset(tmp_path / "d", rows)
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data),
        ValueError,
        f"{data}/data.parquet row 2 (id 'clip-2'): vae_latent_bytes: 3064 bytes stored for shape [16, 3, 4, 4] "
        "of float32 (3072 bytes expected)",
    )


def test_empty_text_embedding(tmp_path):
    rows = _rows(3) + _rows(1, text=(0, 32), start=3)
    data = _dataset(tmp_path / "d", rows)
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data),
        ValueError,
        f"{data}/data.parquet row 3 (id 'clip-3'): text_embedding_shape [0, 32]: the text embedding is empty (it "
        "would train on zeros); encode the caption again (rerun preprocessing)",
    )


def test_text_width_the_model_cannot_take(tmp_path):
    data = _dataset(tmp_path / "d", _rows(4, text=(7, 48)))
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data),
        ConfigError,
        f"{data}/data.parquet row 0 (id 'clip-0'): text embeddings are 48 wide (text_embedding_shape [7, 48]) but "
        "the student transformer takes 32 (text_dim); encode the captions with the model's own text encoder",
    )


def test_odd_latent_height(tmp_path):
    data = _dataset(tmp_path / "d", _rows(4) + _rows(2, shape=(16, 3, 5, 4), start=4))
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data),
        ConfigError,
        f"{data}/data.parquet row 4 (id 'clip-4'): latent height 5 (vae_latent_shape [16, 3, 5, 4]) is not divisible "
        "by the student transformer's patch size [1, 2, 2]; preprocess with frame sides that are multiples of 16 pixels",
    )


@pytest.mark.parametrize(
    "content,detail",
    [(b"", "Parquet file size is 0 bytes"), (b"not parquet at all " * 8, "Parquet magic bytes not found in footer")],
    ids=["zero_bytes", "garbage"],
)
def test_unreadable_parquet_file_is_named(tmp_path, content, detail):
    data = _dataset(tmp_path / "d", _rows(4), "data-00000-of-00002.parquet")
    bad = tmp_path / "d" / "data-00001-of-00002.parquet"
    bad.write_bytes(content)
    build_fails("finetune", small_overrides(tmp_path / "out", data), ValueError, f"{bad}: not a readable Parquet file ({detail}")


def test_mix_weight_that_is_not_a_number(tmp_path, capsys):
    recipe = yaml.safe_load(default_recipe("finetune").read_text())
    recipe["training"]["data"]["mix"] = [{"data_path": "other", "weight": "abc"}]
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert cli_main("finetune", ["--config", str(path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {path}: key 'training.data.mix[0].weight': expected a number > 0, got 'abc'"
    ]
    for weight in (None, True, "-1", float("nan")):
        with pytest.raises(ConfigError, match=r"key 'training\.data\.mix\[0\]\.weight': expected a number > 0"):
            load_config(default_recipe("finetune"), {"training.data.mix": [{"data_path": "x", "weight": weight}]})
    assert load_config(default_recipe("finetune"), {"training.data.mix": [{"data_path": "x", "weight": "1e-1"}]}) \
        .training.data.mix[0]["weight"] == 0.1


def test_nan_row_is_named_in_the_skip_warning(tmp_path, caplog):
    from fv_accel.trainer import Trainer

    rows = _rows(2)
    rows[1] = make_row(
        sample_id="clip-1", latent=torch.full((16, 3, 4, 4), float("nan")), text_embedding=torch.zeros(7, 32), caption="x"
    )
    data = _dataset(tmp_path / "d", rows)
    over = small_overrides(tmp_path / "out", data, **{
        "training.data.train_batch_size": 2,
        "training.loop.gradient_accumulation_steps": 1,
        "training.loop.max_train_steps": 1,
        "callbacks.ema.enable": False,
    })
    with caplog.at_level(logging.WARNING, logger="fv_accel.trainer"):
        summary = Trainer(build("finetune", over)).run()
    assert summary["skipped_steps"] == 1
    (warning,) = [r.getMessage() for r in caplog.records if "skipped step" in r.getMessage()]
    assert warning.startswith("skipped step 1 (1 skipped in all): non-finite loss at step 1: loss=nan")
    assert warning.endswith(f"samples: {data}/data.parquet row 1 (id 'clip-1') [NaN/inf in its data], set aside for the rest of the run")


def test_samples_no_step_can_take_are_counted_at_start(tmp_path, caplog):
    data = _dataset(tmp_path / "d", _rows(4) + _rows(1, shape=(16, 3, 4, 6), start=4))
    over = small_overrides(tmp_path / "out", data, **{"training.data.train_batch_size": 2, "training.loop.gradient_accumulation_steps": 1})
    with caplog.at_level(logging.WARNING, logger="fv_accel.data.loader"):
        build("finetune", over)
    messages = [r.getMessage() for r in caplog.records if r.name == "fv_accel.data.loader"]
    assert messages == [
        "1 sample(s) will never be trained: their bucket holds fewer samples than one step takes (2 = batch 2 x 1 "
        "processes x 1 accumulation): 1 of latent (T, H, W) (3, 4, 6); lower training.data.train_batch_size or "
        "preprocess them to a shape that has more samples"
    ]


# --------------------------------------------------------------------------------------------
# 9. Keys that were accepted and ignored
# --------------------------------------------------------------------------------------------


def test_num_latent_t_height_width_filter_the_rows(tmp_path):
    from fv_accel.data.loader import build_train_loader

    data = _dataset(tmp_path / "d", _rows(4) + _rows(2, shape=(16, 2, 4, 4), start=4))
    cfg = load_config(default_recipe("finetune"), {
        "training.data.data_path": data, "training.data.num_latent_t": 3, "training.data.num_height": 32,
        "training.data.train_batch_size": 1,
    })
    loader = build_train_loader(cfg, world_size=1, rank=0)
    seen = {int(i) for batch, _ in zip(loader, range(8)) for i in batch["sample_index"]}
    assert loader.off_shape_indices == [4, 5] and seen == {0, 1, 2, 3}
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out", data, **{"training.data.num_frames": 13}),
        ValueError,
        f"{data}: no row has the shape that training.data.num_frames 13 asks for: its latents are 4 x [16, 3, 4, 4] "
        "(9 frames, 32x32), 2 x [16, 2, 4, 4] (5 frames, 32x32); set these keys to the data's sizes, or to null",
    )
    # Frames and latent frames must agree for the data's own VAE (this one compresses time by 4).
    build_fails(
        "finetune",
        small_overrides(tmp_path / "out2", data, **{"training.data.num_frames": 81, "training.data.num_latent_t": 20}),
        ValueError,
        "training.data.num_latent_t 20 contradicts training.data.num_frames 81: this data's VAE makes "
        "(frames - 1) / 4 + 1 = 21 latent frames",
    )


def test_trust_remote_code_true_is_refused():
    with pytest.raises(ConfigError, match=r"key 'models\.student\.trust_remote_code': expected false: fv_accel never runs"):
        load_config(default_recipe("finetune"), {"models.student.trust_remote_code": True})
    assert load_config(default_recipe("finetune"), {"models.student.trust_remote_code": False}).models.student.trust_remote_code is False


def test_run_name_reaches_the_trackers(tmp_path, monkeypatch):
    from accelerate import Accelerator

    seen = {}
    real = Accelerator.init_trackers

    def spy(self, project_name, config=None, init_kwargs=None):
        seen["init_kwargs"] = init_kwargs
        return real(self, project_name, config=config, init_kwargs=init_kwargs)

    monkeypatch.setattr(Accelerator, "init_trackers", spy)
    data = write_latent_dataset(tmp_path / "d", num_clips=2)
    build("finetune", small_overrides(
        tmp_path / "out", data, **{"training.tracker.trackers": ["tensorboard"], "training.tracker.run_name": "sweep 7/a"}
    ))
    assert seen["init_kwargs"] == {"wandb": {"name": "sweep 7/a"}, "tensorboard": {"filename_suffix": ".sweep_7_a"}}
    events = [p.name for p in (tmp_path / "out" / "logs" / "fv_accel").glob("events.out.tfevents*")]
    assert len(events) == 1 and events[0].endswith(".sweep_7_a")


def test_cli_value_for_a_string_key_stays_a_string():
    cfg, _ = parse_cli(["--output_dir", "2024", "--training.tracker.run_name", "007",
                        "--training.loop.mixed_precision", "no", "--callbacks.validation.model_from", "null",
                        "--max_train_steps", "3"], "finetune")
    assert cfg.training.checkpoint.output_dir == "2024" and cfg.training.tracker.run_name == "007"
    assert cfg.training.loop.mixed_precision == "no" and cfg.callbacks.validation.model_from is None
    assert cfg.training.loop.max_train_steps == 3


# --------------------------------------------------------------------------------------------
# 10. Tiny recipes with a user's data
# --------------------------------------------------------------------------------------------


def test_tiny_recipe_validation_follows_the_users_data(tmp_path, tiny_model_dir, encoder, caplog):
    from fv_accel.build import build_from_config
    from fv_accel.data.video import FrameSampling
    from fv_accel.preprocess import preprocess
    from fv_accel.validation import HeldoutLossCallback, VideoSamplingCallback, heldout_split

    from conftest import tiny_overrides

    captions = [f"my holiday clip number {k}" for k in range(12)]
    clips = _write_clips(tmp_path / "clips", captions)
    data = tmp_path / "latents"
    preprocess(str(tiny_model_dir), str(clips), data, FrameSampling(num_frames=(9,), buckets=((32, 32),)), encoder=encoder, device=CPU)
    over = tiny_overrides(tmp_path, **{"training.data.data_path": str(data), "callbacks.validation.enable": True})
    with caplog.at_level(logging.WARNING, logger="fv_accel.user_data"):
        run = build_from_config(str(default_recipe("finetune")), over)
    val = run.config.callbacks.validation
    held = heldout_split(12, 1 / 12, 0)
    assert (val.heldout_data_path, val.heldout_fraction, len(held)) == (None, 1 / 12, 1)
    (heldout,) = [cb for cb in run.callbacks if isinstance(cb, HeldoutLossCallback)]
    assert heldout.rows == held and set(held) <= run.dataloader.sampler.exclude_indices
    (video,) = [cb for cb in run.callbacks if isinstance(cb, VideoSamplingCallback)]
    prompts = [p.prompt for p in video.prompts]
    # The held-out clip's caption first (as the tiny recipe's second prompt is a held-out clip's).
    assert len(prompts) == 2 and prompts[0] == run.dataloader.dataset[held[0]]["caption"]
    assert prompts[1] in captions and prompts[1] != prompts[0]
    messages = [r.getMessage() for r in caplog.records if r.name == "fv_accel.user_data"]
    assert messages[0] == (
        "callbacks.validation.heldout_data_path is 'tiny' (the built-in clips) but the training data is "
        f"{data}: the held-out loss uses 1 of its 12 rows instead, never trained on (callbacks.validation."
        "heldout_fraction 0.08333); set callbacks.validation.heldout_data_path to a dataset (or null) to choose otherwise"
    )
    assert messages[1].startswith(
        "callbacks.validation.prompts ['a white square moving up on a light background', 'a cyan square moving right "
        f"on a black background'] describe the built-in tiny clips but the training data is {data}: sampling with"
    )
