"""The Cosmos-Predict2 family (`cosmos2`) on its tiny model (fv_accel/tiny/cosmos2.py).

The stock `Cosmos2VideoToWorldPipeline` needs a safety checker: cosmos_guardrail's is not
installable here, so these tests load it with `safety_checker=PassThroughSafetyChecker()`, a
stand-in that checks nothing (every prompt passes, every video is returned unchanged). The videos
the tests decode are therefore not screened by NVIDIA's guardrail.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fv_accel.models import cosmos2 as c2


@pytest.fixture(scope="module")
def cosmos_dir(tmp_path_factory):
    from fv_accel.tiny.cosmos2 import write_tiny_cosmos2

    return write_tiny_cosmos2(tmp_path_factory.mktemp("tiny_cosmos2") / "tiny-cosmos2", seed=0)


def stock_pipeline(path, **components):
    from diffusers import Cosmos2VideoToWorldPipeline

    pipe = Cosmos2VideoToWorldPipeline.from_pretrained(path, safety_checker=c2.PassThroughSafetyChecker(), **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def first_frame(seed: int = 0, size: int = 64):
    from PIL import Image

    return Image.fromarray((np.random.RandomState(seed).rand(size, size, 3) * 255).astype(np.uint8))


# ---- the tiny model ----
def test_tiny_model_layout_and_stock_pipeline_video(cosmos_dir):
    """The stock pipeline loads the tiny folder and makes a 17-frame 64x64 video from an image."""
    import json

    index = json.loads((cosmos_dir / "model_index.json").read_text())
    assert index["_class_name"] == "Cosmos2VideoToWorldPipeline"
    assert index["safety_checker"] == [None, None]
    pipe = stock_pipeline(cosmos_dir)
    assert pipe.transformer.config.in_channels == pipe.vae.config.z_dim + 1 == 17
    assert pipe.scheduler.config.use_karras_sigmas and pipe.scheduler.config.sigma_max == 80.0
    video = pipe(
        image=first_frame(),
        prompt="a red ball moving left",
        height=64,
        width=64,
        num_frames=17,
        num_inference_steps=2,
        guidance_scale=3.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert video.shape == (1, 17, 64, 64, 3)
    assert np.isfinite(video).all() and video.std() > 0


def test_without_a_safety_checker_the_pipeline_needs_cosmos_guardrail(cosmos_dir):
    """What the stand-in is for: the repo stores none, and the pipeline then builds the guardrail."""
    from diffusers import Cosmos2VideoToWorldPipeline

    with pytest.raises(ImportError, match="cosmos_guardrail"):
        Cosmos2VideoToWorldPipeline.from_pretrained(cosmos_dir)


# ---- conventions: the family's velocity against the stock scheduler and pipeline ----
def family_step(scheduler, sigma: float, x0: torch.Tensor, eps: torch.Tensor, step_t, velocity=None) -> torch.Tensor:
    """One step of the stock scheduler from the pipeline's EDM latent x = x0 + sigma * eps, the
    transformer's output being `velocity` (default: the true REFERENCE velocity eps - x0) at the
    family's timestep, converted with the pipeline's preconditioning."""
    x_edm = x0 + sigma * eps
    s = sigma / (1 + sigma)
    x_t = (1 - s) * x0 + s * eps  # REFERENCE noising at flow sigma s
    t = torch.full((1,), s * c2.NUM_TRAIN_TIMESTEPS, dtype=torch.float64)
    kwargs = c2.transformer_inputs(x_t, t, torch.zeros(1, 3, 32), 0, torch.float64)
    current_t = kwargs["timestep"].flatten()[0]  # what the family gives the transformer
    c_in, c_skip, c_out = 1 - current_t, 1 - current_t, -current_t  # the pipeline's, from that timestep
    # The pipeline feeds c_in * x: the same tensor as the family's x_t.
    torch.testing.assert_close(kwargs["hidden_states"], c_in * x_edm)
    velocity = eps - x0 if velocity is None else velocity
    x0_hat = c_skip * x_edm + c_out * velocity
    eps_hat = (x_edm - x0_hat) / sigma
    return scheduler.step(eps_hat, step_t, x_edm, return_dict=False)[0]


def test_one_stock_scheduler_step_with_the_true_velocity_returns_the_clean_latent(cosmos_dir):
    from diffusers import FlowMatchEulerDiscreteScheduler

    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(1, 16, 3, 4, 4, generator=gen, dtype=torch.float64)
    eps = torch.randn(1, 16, 3, 4, 4, generator=gen, dtype=torch.float64)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(cosmos_dir, subfolder="scheduler")

    # One step from the top of the schedule (sigma 80) to 0: the clean latent.
    scheduler.set_timesteps(sigmas=torch.linspace(0, 1, 1, dtype=torch.float64))
    sigma = float(scheduler.sigmas[0])
    assert sigma == pytest.approx(80.0) and float(scheduler.sigmas[1]) == 0.0
    out = family_step(scheduler, sigma, x0, eps, scheduler.timesteps[0])
    # The scheduler steps in float32 (its own upcast): errors of ~1e-7 of |x| <= 80 * 5.
    torch.testing.assert_close(out, x0, atol=1e-4, rtol=0)
    # The opposite sign (x0 - eps, the other common convention) lands far off.
    scheduler.set_timesteps(sigmas=torch.linspace(0, 1, 1, dtype=torch.float64))
    wrong = family_step(scheduler, sigma, x0, eps, scheduler.timesteps[0], velocity=x0 - eps)
    assert (wrong - x0).abs().max() > 1.0

    # Every step of the pipeline's 35-step Karras schedule lands on x0 + sigma_next * eps.
    scheduler.set_timesteps(sigmas=torch.linspace(0, 1, 35, dtype=torch.float64))
    sigmas = scheduler.sigmas.double()
    for i, step_t in enumerate(scheduler.timesteps):
        scheduler._step_index = i
        sigma = float(sigmas[i])
        out = family_step(scheduler, sigma, x0, eps, step_t)
        torch.testing.assert_close(out, x0 + sigmas[i + 1] * eps, atol=1e-4, rtol=0)


def test_stock_pipeline_with_a_true_velocity_transformer_denoises_to_the_clean_latent(cosmos_dir):
    """The whole stock pipeline (Karras steps, c_in/c_skip/c_out, condition frames) around a
    transformer that returns the REFERENCE velocity (x_t - x0) / sigma for its input at its
    timestep: the generated frames come out as x0."""
    pipe = stock_pipeline(cosmos_dir)
    transformer = pipe.transformer
    x0 = torch.randn(1, 16, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    seen = {}

    def true_velocity(hidden_states, timestep, encoder_hidden_states, fps=None, condition_mask=None, padding_mask=None, return_dict=True, **_):
        assert timestep.shape == (1, 1, 5, 1, 1)
        seen["timestep"] = timestep.flatten().clone()
        seen["mask"] = condition_mask[0, 0, :, 0, 0].clone()
        return ((hidden_states.float() - x0) / timestep.float(),)

    transformer.forward = true_velocity
    latents = pipe(
        image=first_frame(),
        prompt="a blue box",
        height=64,
        width=64,
        num_frames=17,
        num_inference_steps=12,
        guidance_scale=1.0,
        output_type="latent",
        generator=torch.Generator().manual_seed(0),
    ).frames
    assert latents.shape == x0.shape
    # The pipeline stops at sigma_min = 0.002 (final_sigmas_type "sigma_min"): x0 + 0.002 * noise.
    torch.testing.assert_close(latents[:, :, 1:].float(), x0[:, :, 1:], atol=0.002 * 6, rtol=0)
    # The condition frame (frame 0) came in masked, at the condition timestep, as the family gives it.
    assert seen["mask"].tolist() == [1, 0, 0, 0, 0]
    assert float(seen["timestep"][0]) == pytest.approx(c2.CONDITION_TIMESTEP, rel=1e-5)
    family = c2.transformer_inputs(x0, torch.full((1,), 2.0), torch.zeros(1, 3, 32), 1, torch.float32)
    assert family["condition_mask"][0, 0, :, 0, 0].tolist() == seen["mask"].tolist()
    assert float(family["timestep"].flatten()[0]) == pytest.approx(c2.CONDITION_TIMESTEP)
    assert float(family["timestep"].flatten()[1]) == pytest.approx(0.002)


def test_video_noise_shift_is_the_shifted_flow_table_of_scaled_edm_sigmas():
    """Cosmos-Predict2 scales EDM sigmas by sqrt(latent frames); in flow terms that is the shifted
    table sigma(u) = k u / (1 + (k - 1) u) with k = sqrt(T)."""
    k = c2.video_noise_shift(24)
    assert k == pytest.approx(24 ** 0.5)
    u = torch.linspace(0.01, 0.99, 50, dtype=torch.float64)
    sigma0 = c2.edm_sigma(u)
    scaled = k * sigma0
    torch.testing.assert_close(scaled / (1 + scaled), k * u / (1 + (k - 1) * u))


# ---- per-frame timesteps reach the transformer ----
def test_per_frame_timesteps_change_only_their_chunk_modulation(cosmos_dir):
    """The transformer takes a timestep per latent frame ([B, 1, T, 1, 1], AdaLN per frame):
    changing one chunk's timestep changes the first block's modulated input on that chunk's
    tokens only (attention then mixes frames: the model is bidirectional)."""
    from diffusers import CosmosTransformer3DModel

    transformer = CosmosTransformer3DModel.from_pretrained(cosmos_dir, subfolder="transformer").eval()
    x = torch.randn(1, 16, 6, 8, 8, generator=torch.Generator().manual_seed(0))
    text = torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(1))
    captured = []
    hook = transformer.transformer_blocks[0].norm1.register_forward_hook(lambda m, a, out: captured.append(out[0]))
    t = torch.tensor([[900.0, 900.0, 500.0, 500.0, 100.0, 100.0]])  # chunks of 2 frames
    t_changed = t.clone()
    t_changed[0, 2:4] = 250.0
    with torch.no_grad():
        out_a = transformer(**c2.transformer_inputs(x, t, text, 0, torch.float32))[0]
        out_b = transformer(**c2.transformer_inputs(x, t_changed, text, 0, torch.float32))[0]
    hook.remove()
    tokens_per_frame = (8 // 2) * (8 // 2)
    diff = (captured[0] - captured[1]).abs().reshape(1, 6, tokens_per_frame, -1).amax(dim=(0, 2, 3))
    assert diff[2:4].min() > 1e-4
    assert diff[[0, 1, 4, 5]].max() == 0.0
    assert (out_a - out_b).abs().max() > 0
