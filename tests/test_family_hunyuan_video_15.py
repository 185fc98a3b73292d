"""The HunyuanVideo 1.5 family against the stock diffusers HunyuanVideo15Pipeline, on its tiny model."""

from __future__ import annotations

import pytest
import torch

CAPTION = "a red circle moving left on a dark background"


@pytest.fixture(scope="module")
def hv15_dir(tmp_path_factory):
    from fv_accel.tiny.hunyuan_video_15 import write_tiny_hunyuan_video_15

    return write_tiny_hunyuan_video_15(tmp_path_factory.mktemp("hv15") / "tiny-hv15", seed=0)


@pytest.fixture(scope="module")
def stock_pipe(hv15_dir):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(hv15_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_tiny_model_is_the_stock_pipeline_with_the_real_layout(stock_pipe):
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, HunyuanVideo15Pipeline

    assert type(stock_pipe) is HunyuanVideo15Pipeline
    assert type(stock_pipe.scheduler) is FlowMatchEulerDiscreteScheduler
    assert stock_pipe.scheduler.config.shift == 5.0  # the 480p t2v repo's
    assert type(stock_pipe.guider) is ClassifierFreeGuidance and stock_pipe.guider.guidance_scale == 6.0
    assert stock_pipe.transformer.config.in_channels == 2 * stock_pipe.vae.config.latent_channels + 1 == 65
    assert (stock_pipe.vae_scale_factor_spatial, stock_pipe.vae_scale_factor_temporal) == (16, 4)


def test_prompt_crop_keeps_exactly_the_caption_tokens(stock_pipe):
    """The pipeline drops the first 108 tokens (the system turn); what remains is the caption and
    the closing of the chat turn, with no unknown token."""
    tok = stock_pipe.tokenizer
    embeds, mask, embeds_2, mask_2 = stock_pipe.encode_prompt(prompt=CAPTION, device="cpu", dtype=torch.float32)
    assert embeds.shape == (1, 1000, 32) and embeds_2.shape == (1, 256, 16)
    n_caption = len(CAPTION.split())
    assert int(mask.sum()) == n_caption + 5  # + <|im_end|> \n <|im_start|> assistant \n
    ids = tok.apply_chat_template(
        [[{"role": "system", "content": stock_pipe.system_message}, {"role": "user", "content": CAPTION}]],
        add_generation_prompt=True, tokenize=True, return_dict=True,
    )["input_ids"][0]
    assert tok.convert_ids_to_tokens(ids[108:108 + n_caption]) == [CAPTION.split()[0]] + [" " + w for w in CAPTION.split()[1:]]
    assert tok.unk_token_id not in ids
    # No quoted text: the glyph (ByT5) sequence is fully masked.
    assert int(mask_2.sum()) == 0
    _, _, _, mask_2 = stock_pipe.encode_prompt(prompt='a sign that says "hi"', device="cpu", dtype=torch.float32)
    assert int(mask_2.sum()) == len('Text "hi". ') + 1  # the glyph text in bytes + </s>


def test_tiny_model_makes_a_video_of_the_right_frame_count(stock_pipe):
    out = stock_pipe(
        prompt=CAPTION, num_frames=17, height=64, width=64, num_inference_steps=2,
        generator=torch.Generator().manual_seed(0), output_type="np",
    ).frames
    assert out.shape == (1, 17, 64, 64, 3)
    assert bool(torch.isfinite(torch.as_tensor(out)).all())
    assert float(out.std()) > 0.0


@pytest.mark.parametrize("u", [1.0, 0.75, 0.3, 0.05])
def test_scheduler_round_trip(hv15_dir, u):
    """One step of the repo's own scheduler from x_t with the true velocity eps - x0 lands on x0;
    the scheduler's shifted sigma is the training table's at the same index, and the timestep it
    hands the transformer is sigma * 1000 (the table's t)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fv_accel.schedulers import FlowMatchTable

    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(hv15_dir, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=[u], device="cpu")  # the pipeline's call: unshifted u, shifted inside
    sigma, t = float(scheduler.sigmas[0]), scheduler.timesteps[0]
    table = FlowMatchTable(scheduler.config.shift)
    index = round((1.0 - u) * 1000)
    assert abs(sigma - float(table.sigmas[index])) < 1e-6
    assert abs(float(t) - float(table.timesteps[index])) < 1e-3
    g = torch.Generator().manual_seed(1)
    x0, eps = torch.randn(1, 32, 5, 4, 4, generator=g), torch.randn(1, 32, 5, 4, 4, generator=g)
    x_t = table.add_noise(x0, eps, torch.tensor([sigma]))
    x_prev = scheduler.step(eps - x0, t, x_t, return_dict=False)[0]
    assert torch.allclose(x_prev, x0, atol=1e-5)
    assert not torch.allclose(x_t, x0, atol=1e-2)


def test_stock_transformer_takes_one_timestep_per_sample(stock_pipe):
    """The finding behind the DFSFT refusal: per-frame [B, T] and per-token [B, S] timesteps do not
    reach the stock transformer at all (its time embedding takes a 1-D timestep)."""
    tr = stock_pipe.transformer
    x = torch.zeros(1, 65, 2, 2, 2)
    kwargs = dict(
        hidden_states=x, encoder_hidden_states=torch.randn(1, 3, 32), encoder_attention_mask=torch.ones(1, 3),
        encoder_hidden_states_2=torch.zeros(1, 1, 16), encoder_attention_mask_2=torch.zeros(1, 1),
        image_embeds=torch.zeros(1, 1, 16), return_dict=False,
    )
    with torch.no_grad():
        assert tr(timestep=torch.tensor([500.0]), **kwargs)[0].shape == (1, 32, 2, 2, 2)
        for t in (torch.full((1, 2), 500.0), torch.full((1, 8), 500.0)):
            with pytest.raises(AssertionError, match="1d"):
                tr(timestep=t, **kwargs)
