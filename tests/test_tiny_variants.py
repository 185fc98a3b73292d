"""Tiny models of every Wan variant: the stock diffusers pipeline of each real repo loads the folder
and generates a video; each mirrors its repo's layout (channels, VAE, experts, model_index keys);
the command line lists and writes them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from fv_accel.tiny.model import TINY_MODELS, write_tiny_variant
from fv_accel.tiny_model import main

FRAMES, SIDE = 17, 64


def _image():
    from PIL import Image

    yy, xx = np.mgrid[0:SIDE, 0:SIDE]
    return Image.fromarray(np.stack([xx * 4, yy * 4, (xx + yy) * 2], axis=-1).astype(np.uint8))


def _generate(pipe, **extra):
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt="a red ball moving left",
        num_inference_steps=2,
        num_frames=FRAMES,
        height=SIDE,
        width=SIDE,
        output_type="np",
        guidance_scale=1.0,  # no classifier-free guidance: one transformer call per step
        generator=torch.Generator().manual_seed(0),
        **extra,
    ).frames


def _count_calls(module) -> list:
    calls = []
    module.register_forward_hook(lambda *_: calls.append(1))
    return calls


@pytest.mark.parametrize("name", list(TINY_MODELS))
def test_stock_pipeline_loads_and_generates(name, tiny_variant_dir):
    from diffusers import DiffusionPipeline, WanImageToVideoPipeline

    variant = TINY_MODELS[name]
    folder = tiny_variant_dir(name)
    pipe = DiffusionPipeline.from_pretrained(folder)
    assert type(pipe).__name__ == variant.pipeline
    index = json.loads((folder / "model_index.json").read_text())
    assert index["_class_name"] == variant.pipeline
    calls = _count_calls(pipe.transformer)
    calls_2 = _count_calls(pipe.transformer_2) if getattr(pipe, "transformer_2", None) is not None else []
    extra = {"image": _image()} if isinstance(pipe, WanImageToVideoPipeline) else {}
    frames = _generate(pipe, **extra)
    assert frames.shape == (1, FRAMES, SIDE, SIDE, 3)
    assert np.isfinite(frames).all()
    cfg = pipe.transformer.config
    assert (cfg.in_channels, cfg.out_channels) == (variant.in_channels, variant.out_channels)
    if variant.two_transformers:
        # 2 steps at shift 3: t = 999 (>= the boundary: `transformer`), then t = 750 (< 875 and 900: `transformer_2`).
        assert pipe.config.boundary_ratio == variant.boundary_ratio == index["boundary_ratio"]
        assert pipe.transformer_2.config.in_channels == variant.in_channels
        assert len(calls) == 1 and len(calls_2) == 1
        w1 = pipe.transformer.patch_embedding.weight
        assert not torch.equal(w1, pipe.transformer_2.patch_embedding.weight)  # two experts, seeded apart
    else:
        assert index.get("transformer_2", [None, None]) == [None, None] and len(calls) == 2


def test_wan21_i2v_mirrors_wan2_1_i2v_14b(tiny_variant_dir):
    from diffusers import WanImageToVideoPipeline
    from transformers import CLIPVisionModel

    pipe = WanImageToVideoPipeline.from_pretrained(tiny_variant_dir("wan21_i2v"))
    cfg = pipe.transformer.config
    # Wan2.1-I2V-14B: in 36 = 16 noisy + 4 mask + 16 condition; image_dim 1280 (CLIP width),
    # added_kv_proj_dim 5120 (the transformer's width).
    assert (cfg.in_channels, cfg.out_channels, cfg.image_dim) == (36, 16, 16)
    assert cfg.added_kv_proj_dim == cfg.num_attention_heads * cfg.attention_head_dim == 96
    assert isinstance(pipe.image_encoder, CLIPVisionModel)
    assert pipe.encode_image(_image(), device="cpu").shape == (1, 17, 16)  # 257 x 1280 for the real one
    assert pipe.config.boundary_ratio is None and not pipe.config.expand_timesteps


def test_wan22_ti2v_mirrors_wan2_2_ti2v_5b(tiny_variant_dir):
    from diffusers import WanImageToVideoPipeline

    folder = tiny_variant_dir("wan22_ti2v")
    assert json.loads((folder / "model_index.json").read_text())["expand_timesteps"] is True
    pipe = WanImageToVideoPipeline.from_pretrained(folder)  # its image-to-video face
    vae = pipe.vae.config
    assert (vae.z_dim, vae.is_residual, vae.patch_size, vae.scale_factor_spatial, vae.scale_factor_temporal) == (48, True, 2, 16, 4)
    assert (vae.in_channels, vae.out_channels) == (12, 12)
    assert len(vae.latents_mean) == len(vae.latents_std) == 48 and min(vae.latents_std) > 0
    assert (pipe.transformer.config.in_channels, pipe.transformer.config.out_channels) == (48, 48)
    assert pipe.image_encoder is None and pipe.transformer_2 is None
    frames = _generate(pipe, image=_image())
    assert frames.shape == (1, FRAMES, SIDE, SIDE, 3)


def test_default_tiny_model_keeps_its_weights(tiny_model_dir, tiny_variant_dir):
    """write_tiny_model(seed=0) and the wan21_t2v variant: pinned weights (cached datasets and other
    tests depend on them; the tiny dataset's cache key changes with them)."""
    from safetensors.torch import load_file

    for folder in (tiny_model_dir, tiny_variant_dir("wan21_t2v")):
        transformer = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
        vae = load_file(folder / "vae" / "diffusion_pytorch_model.safetensors")
        assert sum(float(v.double().abs().sum()) for v in transformer.values()) == pytest.approx(16967.6499, abs=1e-3)
        assert sum(float(v.double().abs().sum()) for v in vae.values()) == pytest.approx(1314.7541, abs=1e-3)
        stats = json.loads((folder / "vae" / "config.json").read_text())
        assert stats["latents_mean"][:3] == [-0.362128, 0.480734, 0.688952]


def test_command_line_lists_and_writes(tmp_path, capsys, tiny_variant_dir):
    main(["--list"])
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split()[0] for line in lines][: len(TINY_MODELS)] == list(TINY_MODELS)
    assert lines[2].split(None, 1)[1].startswith("Wan2.2-TI2V-5B layout: WanPipeline with expand_timesteps")

    # `--class skyreels_v2` is the older spelling of `--model skyreels_v2`; the same seed, the same bytes.
    main([str(tmp_path / "sky"), "--class", "skyreels_v2"])
    assert capsys.readouterr().out.strip() == (
        f"wrote the tiny skyreels_v2 model (Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers layout) to {tmp_path / 'sky'}"
    )
    weights = "transformer/diffusion_pytorch_model.safetensors"
    assert (tmp_path / "sky" / weights).read_bytes() == (tiny_variant_dir("skyreels_v2") / weights).read_bytes()

    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--model", "wan3"])
    assert "invalid choice: 'wan3'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path / "x"), "--class", "wan", "--model", "wan21_i2v"])
    assert "--class wan and --model wan21_i2v name different models" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([])
    assert "DIR) is required unless --list" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown tiny model 'wan3'; known: wan21_t2v, wan21_i2v, wan22_ti2v"):
        write_tiny_variant(tmp_path / "y", "wan3")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_an_interrupted_write_leaves_the_folder_as_it_was(tmp_path, monkeypatch, tiny_variant_dir):
    """The folder is written beside its place and moved in, model_index.json last."""
    import shutil

    from diffusers import AutoencoderKLWan

    folder = tmp_path / "model"
    shutil.copytree(tiny_variant_dir("wan21_t2v"), folder)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}

    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(AutoencoderKLWan, "save_pretrained", fail)
    with pytest.raises(OSError, match="disk full"):
        write_tiny_variant(folder, "wan22_t2v_a14b")
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
