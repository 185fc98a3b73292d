"""The HunyuanVideo family on its tiny model (fv_accel/tiny/hunyuan_video.py), against the stock
diffusers HunyuanVideoPipeline, offline."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.fixture(scope="module")
def hv_dir(tmp_path_factory):
    from fv_accel.tiny.hunyuan_video import write_tiny_hunyuan_video

    return write_tiny_hunyuan_video(tmp_path_factory.mktemp("tiny_hv") / "hunyuan_video", seed=0)


@pytest.fixture(scope="module")
def hv_pipe(hv_dir):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(hv_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def transformer_inputs(pipe, batch=1, frames=5, side=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    cfg = pipe.transformer.config
    return dict(
        hidden_states=torch.randn(batch, cfg.in_channels, frames, side, side, generator=g),
        timestep=torch.full((batch,), 700.0),
        encoder_hidden_states=torch.randn(batch, 7, cfg.text_embed_dim, generator=g),
        encoder_attention_mask=torch.ones(batch, 7),
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        guidance=torch.full((batch,), 6000.0),
        return_dict=False,
    )


def test_tiny_model_has_the_real_repo_layout_and_the_stock_pipeline_makes_17_frames(hv_dir, hv_pipe):
    from diffusers import HunyuanVideoPipeline

    index = json.loads((hv_dir / "model_index.json").read_text())
    assert index["_class_name"] == "HunyuanVideoPipeline"
    assert index["tokenizer"] == ["transformers", "LlamaTokenizerFast"]
    assert index["tokenizer_2"] == ["transformers", "CLIPTokenizer"]
    assert index["text_encoder"] == ["transformers", "LlamaModel"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo"]
    assert json.loads((hv_dir / "scheduler" / "scheduler_config.json").read_text())["shift"] == 7.0
    assert not list(hv_dir.rglob("*.bin")) and list(hv_dir.rglob("*.safetensors"))
    assert isinstance(hv_pipe, HunyuanVideoPipeline) and hv_pipe.transformer.config.guidance_embeds
    frames = hv_pipe(
        prompt="a red ball moving slowly left",
        height=64,
        width=64,
        num_frames=17,
        num_inference_steps=2,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 17, 64, 64, 3)
    assert float(frames.std()) > 0.0


def test_the_template_prefix_is_crop_start_tokens_so_the_crop_leaves_the_caption(hv_pipe):
    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    tok = hv_pipe.tokenizer
    assert tok.padding_side == "right"
    crop = DEFAULT_PROMPT_TEMPLATE["crop_start"]
    caption = "a red ball moving slowly left"
    ids = tok(DEFAULT_PROMPT_TEMPLATE["template"].format(caption)).input_ids
    assert ids[0] == tok.bos_token_id
    kept = tok.convert_ids_to_tokens(ids[crop:])
    assert kept == ["a", "▁red", "▁ball", "▁moving", "▁slowly", "▁left", "<|eot_id|>"]
    # The pipeline's own embeddings: 256 positions after the crop, the caption's 7 real tokens first.
    embeds, pooled, mask = hv_pipe.encode_prompt(prompt=caption, device=torch.device("cpu"))
    assert embeds.shape == (1, 256, 32) and pooled.shape == (1, 24)
    assert mask[0].tolist() == [1] * 7 + [0] * 249


def test_one_step_of_the_family_scheduler_with_the_true_velocity_returns_the_clean_latent(hv_dir):
    """x_t = (1 - s) x0 + s eps, v = eps - x0: the repo's FlowMatchEulerDiscreteScheduler (shift 7),
    stepped from sigma to 0 with v, gives x0 (the family needs no sign or scale conversion)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(hv_dir, subfolder="scheduler")
    assert scheduler.config.shift == 7.0 and not scheduler.config.use_dynamic_shifting
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 16, 3, 4, 4, generator=g)
    eps = torch.randn(x0.shape, generator=g)
    # As HunyuanVideoPipeline sets them: linspace(1, 0) shifted by the scheduler, one step to 0.
    scheduler.set_timesteps(sigmas=[0.6], device="cpu")
    sigma = float(scheduler.sigmas[0])
    assert sigma == pytest.approx(7.0 * 0.6 / (1 + 6.0 * 0.6), rel=1e-6)  # shift * s / (1 + (shift - 1) s)
    t = scheduler.timesteps[0]
    assert float(t) == pytest.approx(sigma * 1000.0, rel=1e-5)  # the timestep the transformer sees
    x_t = (1 - sigma) * x0 + sigma * eps
    x_prev = scheduler.step(eps - x0, t, x_t, return_dict=False)[0]
    torch.testing.assert_close(x_prev, x0, rtol=0, atol=1e-5)
    wrong = scheduler.__class__.from_config(scheduler.config)
    wrong.set_timesteps(sigmas=[0.6], device="cpu")
    assert (wrong.step(x0 - eps, t, x_t, return_dict=False)[0] - x0).abs().max() > 0.5


def test_the_stock_transformer_uses_guidance_and_takes_one_timestep_per_sample(hv_pipe):
    transformer = hv_pipe.transformer.eval()
    inputs = transformer_inputs(hv_pipe, batch=2)
    with torch.no_grad():
        out = transformer(**inputs)[0]
        other = transformer(**{**inputs, "guidance": torch.full((2,), 1000.0)})[0]
    assert out.shape == inputs["hidden_states"].shape
    assert (out - other).abs().max() > 1e-4
    # per-frame [B, T] and per-token timesteps are refused by the time embedding (1-D only)
    with pytest.raises(AssertionError, match="1d-array"):
        with torch.no_grad():
            transformer(**{**inputs, "timestep": torch.full((2, 5), 700.0)})


def test_trailing_text_padding_does_not_change_the_output(hv_pipe):
    """What the family relies on to store real tokens only and trim the loader's padding."""
    transformer = hv_pipe.transformer.eval()
    inputs = transformer_inputs(hv_pipe, batch=1)
    text = inputs["encoder_hidden_states"]
    padded = torch.cat([text, torch.randn(1, 30, text.shape[2])], dim=1)
    mask = torch.cat([torch.ones(1, 7), torch.zeros(1, 30)], dim=1)
    with torch.no_grad():
        out = transformer(**inputs)[0]
        out_padded = transformer(**{**inputs, "encoder_hidden_states": padded, "encoder_attention_mask": mask})[0]
    torch.testing.assert_close(out_padded, out, rtol=1e-4, atol=1e-5)
