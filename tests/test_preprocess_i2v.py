"""Preprocessing for image-to-video models: FastVideo's I2V columns (first_frame_latent,
clip_feature, pil_image) match what the stock pipelines compute, the Wan 2.2 VAE's 48 channels at
1/16 of the frame, fv_dataset.json says what the rows hold, and the loader batches the columns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fv_accel.data.schema import bytes_to_tensor, make_row, read_tensor_column, tensor_columns, write_rows
from fv_accel.data.video import FrameSampling, write_video
from fv_accel.preprocess import main, settings_fingerprint
from fv_accel.tiny.clips import render_clip, tiny_clip_specs

FRAMES, SIDE = 9, 64
# name -> (conditioning, latent shape [C, T, H, W], CLIP feature shape)
EXPECTED = {
    "wan21_i2v": (["text", "first_frame", "clip_feature"], [16, 3, 8, 8], [17, 16]),
    "wan22_ti2v": (["text", "first_frame"], [48, 3, 4, 4], None),
    "wan22_i2v_a14b": (["text", "first_frame"], [16, 3, 8, 8], None),
    "wan22_t2v_a14b": (["text"], [16, 3, 8, 8], None),
}


@pytest.fixture(scope="module")
def clips(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("i2v_clips")
    for k, spec in enumerate(tiny_clip_specs(2, seed=11)):
        write_video(root / f"clip{k}.mp4", render_clip(spec, num_frames=FRAMES, height=SIDE, width=SIDE))
        (root / f"clip{k}.txt").write_text(spec.caption + "\n")
    return root


@pytest.fixture(scope="module")
def datasets(tiny_variant_dir, clips, tmp_path_factory) -> dict:
    """name -> (model folder, preprocessed dataset), through the command line."""
    out = {}
    for name in EXPECTED:
        model = tiny_variant_dir(name)
        data = tmp_path_factory.mktemp("i2v_data") / name
        args = ["--model", str(model), "--input", str(clips), "--output", str(data), "--num_frames", str(FRAMES), "--buckets", f"{SIDE}x{SIDE}"]
        assert main(args) == 0, name
        out[name] = (model, data)
    return out


def _rows(data: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return [r for f in sorted(data.glob("data-*.parquet")) for r in pq.read_table(f).to_pylist()]


@pytest.mark.parametrize("name", list(EXPECTED))
def test_rows_hold_the_columns_of_the_model(name, datasets):
    from diffusers import AutoencoderKLWan

    model, data = datasets[name]
    conditioning, latent_shape, clip_shape = EXPECTED[name]
    info = json.loads((data / "fv_dataset.json").read_text())
    vae = AutoencoderKLWan.from_pretrained(model, subfolder="vae").eval()
    assert info["conditioning"] == conditioning and info["num_rows"] == 2
    assert (info["z_dim"], info["scale_factor_spatial"], info["scale_factor_temporal"]) == (
        latent_shape[0], SIDE // latent_shape[2], 4,
    )
    assert info["latents_mean"] == list(vae.config.latents_mean) and len(info["latents_std"]) == latent_shape[0]
    rows = _rows(data)
    assert [r["vae_latent_shape"] for r in rows] == [latent_shape, latent_shape]
    if conditioning == ["text"]:
        assert not any(k.startswith(("first_frame_latent", "clip_feature", "pil_image")) for r in rows for k in r)
        assert "first_frame_latent_normalized" not in info
        return
    assert info["first_frame_latent_normalized"] is True
    row = rows[0]  # (the second row is the same computation)
    pil = read_tensor_column(row, "pil_image")
    assert pil.dtype == torch.uint8 and list(pil.shape) == [SIDE, SIDE, 3]
    first = read_tensor_column(row, "first_frame_latent")
    assert list(first.shape) == latent_shape and row["first_frame_latent_dtype"] == "float32"
    # The VAE's latent of [first frame, FRAMES - 1 zero frames], normalised with latents_mean/std.
    video = torch.zeros(1, 3, FRAMES, SIDE, SIDE)
    video[0, :, 0] = pil.permute(2, 0, 1).float() / 127.5 - 1.0
    with torch.no_grad():
        raw = vae.encode(video).latent_dist.mode()[0]
    mean = torch.tensor(vae.config.latents_mean).view(-1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(-1, 1, 1, 1)
    assert (first - (raw - mean) / std).abs().max() < 1e-5
    # The VAE is causal in time: latent frame 0 is the first frame's alone, in the clip's latent too.
    latent = bytes_to_tensor(row["vae_latent_bytes"], row["vae_latent_shape"], row["vae_latent_dtype"])
    assert ((latent[:, 0] - mean[:, 0]) / std[:, 0] - first[:, 0]).abs().max() < 1e-5
    assert (first[:, 1:] - (latent[:, 1:] - mean) / std).abs().max() > 0.1  # the zero frames are not the clip's
    clip = read_tensor_column(row, "clip_feature")
    assert (None if clip is None else list(clip.shape)) == clip_shape


def _first_frame(row) -> "PIL.Image.Image":  # noqa: F821
    from PIL import Image

    return Image.fromarray(read_tensor_column(row, "pil_image").numpy())


def test_columns_equal_what_the_stock_pipelines_compute(datasets):
    """WanImageToVideoPipeline from the same folder: its prepare_latents' condition latent and its
    encode_image features, from the stored first frame, are the stored columns."""
    from diffusers import WanImageToVideoPipeline

    for name in ("wan21_i2v", "wan22_ti2v"):
        model, data = datasets[name]
        pipe = WanImageToVideoPipeline.from_pretrained(model)
        row = _rows(data)[0]
        first = read_tensor_column(row, "first_frame_latent")
        image = pipe.video_processor.preprocess(_first_frame(row), height=SIDE, width=SIDE).float()
        with torch.no_grad():
            out = pipe.prepare_latents(image, 1, pipe.vae.config.z_dim, SIDE, SIDE, FRAMES, torch.float32, torch.device("cpu"), torch.Generator().manual_seed(0))
        if name == "wan22_ti2v":
            # expand_timesteps: the condition is the latent of the first frame alone, [1, 48, 1, H, W];
            # the VAE is causal in time, so it is latent frame 0 of the stored column.
            _, condition, first_frame_mask = out
            assert condition.shape == (1, 48, 1, 4, 4) and first_frame_mask[0, 0, :, 0, 0].tolist() == [0, 1, 1]
            assert (condition[0, :, 0] - first[:, 0]).abs().max() < 1e-4
        else:
            # [mask (4), condition latent] concatenated on channels: 4 + 16 (+ 16 noisy = 36 in).
            _, condition = out
            assert condition.shape == (1, 20, 3, 8, 8)
            assert condition[0, :4, 0].eq(1).all() and condition[0, :4, 1:].eq(0).all()
            assert (condition[0, 4:] - first).abs().max() < 1e-4
            with torch.no_grad():
                features = pipe.encode_image(_first_frame(row), device="cpu")[0]
            assert (features - read_tensor_column(row, "clip_feature")).abs().max() < 1e-5


def test_loader_batches_the_columns(datasets):
    from fv_accel.data.loader import LatentDataset, collate

    i2v = LatentDataset(str(datasets["wan21_i2v"][1]))
    batch = collate([i2v[0], i2v[1]])
    assert batch["first_frame_latent"].shape == (2, 16, 3, 8, 8) and batch["first_frame_latent"].dtype == torch.float32
    assert batch["clip_feature"].shape == (2, 17, 16)
    assert batch["pil_image"].shape == (2, SIDE, SIDE, 3) and batch["pil_image"].dtype == torch.uint8
    ti2v = LatentDataset(str(datasets["wan22_ti2v"][1]))
    batch = collate([ti2v[0], ti2v[1]])
    assert batch["vae_latent"].shape == batch["first_frame_latent"].shape == (2, 48, 3, 4, 4)
    assert "clip_feature" not in batch
    t2v = LatentDataset(str(datasets["wan22_t2v_a14b"][1]))
    assert not any(k in collate([t2v[0], t2v[1]]) for k in ("first_frame_latent", "clip_feature", "pil_image"))
    with pytest.raises(RuntimeError, match=r"a batch mixes samples with first_frame_latent \(samples \[0\]\) and without it \(samples \[1\]\)"):
        collate([i2v[0], t2v[1]])


def test_fastvideo_style_rows_load(tmp_path):
    """FastVideo writes empty bytes for a feature its model lacks, and may keep a batch dimension
    of 1; a first_frame_latent of another shape than the clip's is an error naming the row."""
    from fv_accel.data.loader import LatentDataset

    latent = torch.randn(16, 2, 4, 4)
    base = dict(latent=latent, text_embedding=torch.randn(3, 32), caption="a red ball")
    empty = {"clip_feature_bytes": b"", "clip_feature_shape": [], "clip_feature_dtype": ""}
    rows = [
        make_row(sample_id="a", **base, **tensor_columns("first_frame_latent", latent[None] * 2), **empty,
                 **tensor_columns("pil_image", torch.zeros(32, 32, 3, dtype=torch.uint8))),
        make_row(sample_id="b", **base, **tensor_columns("first_frame_latent", torch.zeros(16, 1, 4, 4)), **empty,
                 **tensor_columns("pil_image", torch.zeros(32, 32, 3, dtype=torch.uint8))),
    ]
    write_rows(rows, tmp_path / "data.parquet")
    ds = LatentDataset(str(tmp_path))
    item = ds[0]
    assert torch.equal(item["first_frame_latent"], latent * 2) and "clip_feature" not in item
    with pytest.raises(ValueError, match=r"row 1 \(id 'b'\): first_frame_latent: shape \[16, 1, 4, 4\] differs from vae_latent's \[16, 2, 4, 4\]"):
        ds[1]


def test_bucket_sizes_follow_the_vae(tiny_variant_dir, clips, tmp_path, capsys):
    """The Wan 2.2 VAE downsamples by 16 and the transformer patches 2x2: 48x48 cannot be encoded."""
    out = tmp_path / "out"
    rc = main(["--model", str(tiny_variant_dir("wan22_ti2v")), "--input", str(clips), "--output", str(out),
               "--num_frames", "9", "--buckets", "48x48,64x64"])
    assert rc == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert err == (
        f"error: --buckets 48x48: the VAE of '{tiny_variant_dir('wan22_ti2v')}' downsamples by 16 (vae/config.json "
        "scale_factor_spatial) and its transformer patches 2x2, so height and width must be multiples of 32 (e.g. 64x64)"
    )


def test_image_to_video_rows_are_not_reused_from_text_to_video_runs():
    sampling = FrameSampling(num_frames=(9,), buckets=((64, 64),))
    text_only = settings_fingerprint("m", None, sampling, torch.float32, 512)
    assert "conditioning" not in json.loads(text_only)  # the key of every text-to-video row is unchanged
    assert settings_fingerprint("m", None, sampling, torch.float32, 512, ("text",)) == text_only
    with_image = settings_fingerprint("m", None, sampling, torch.float32, 512, ("text", "first_frame"))
    assert json.loads(with_image)["conditioning"] == ["text", "first_frame"]


def test_conditioning_is_read_from_the_configs(tmp_path, caplog):
    """model_index `_class_name`, a 2 * z_dim + 4 channel transformer input, or expand_timesteps
    make a model image-to-video; image_dim adds the CLIP features."""
    from fv_accel.models.encoders import describe_model

    def folder(name, index=None, transformer=None, vae=None):
        root = tmp_path / name
        (root / "vae").mkdir(parents=True)
        (root / "vae" / "config.json").write_text(json.dumps(vae or {"z_dim": 16}))
        if index is not None:
            (root / "model_index.json").write_text(json.dumps(index))
        if transformer is not None:
            (root / "transformer").mkdir()
            (root / "transformer" / "config.json").write_text(json.dumps(transformer))
        return str(root)

    assert describe_model(folder("t2v", {"_class_name": "WanPipeline"}, {"in_channels": 16})).conditioning == ("text",)
    assert describe_model(folder("i2v", {"_class_name": "WanImageToVideoPipeline"})).conditioning == ("text", "first_frame")
    assert describe_model(folder("concat", None, {"in_channels": 36})).conditioning == ("text", "first_frame")
    spec = describe_model(folder("clip", None, {"in_channels": 36, "image_dim": 1280, "patch_size": [1, 2, 2]}))
    assert spec.conditioning == ("text", "first_frame", "clip_feature") and spec.side_multiple == (16, 16)
    ti2v = describe_model(folder("ti2v", {"expand_timesteps": True}, {"in_channels": 48},
                                 {"z_dim": 48, "scale_factor_spatial": 16, "scale_factor_temporal": 4}))
    assert ti2v.conditioning == ("text", "first_frame") and (ti2v.z_dim, ti2v.side_multiple) == (48, (32, 32))
    with caplog.at_level("WARNING"):
        assert describe_model(folder("bare")).conditioning == ("text",)
    assert "has neither model_index.json nor transformer/config.json: it is taken for a text-to-video model" in caplog.text
