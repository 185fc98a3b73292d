"""The Cosmos-Predict2 family (`cosmos2`) on its tiny model (fv_accel/tiny/cosmos2.py).

The stock `Cosmos2VideoToWorldPipeline` needs a safety checker: cosmos_guardrail's is not
installable here, so these tests load it with `safety_checker=PassThroughSafetyChecker()`, a
stand-in that checks nothing (every prompt passes, every video is returned unchanged). The videos
the tests decode are therefore not screened by NVIDIA's guardrail.

Without torchvision (not installed here) diffusers' Cosmos transformer cannot resize its padding
mask; importing fv_accel.models.cosmos2 binds a torch-only nearest resize in its place
(`install_padding_mask_resize`), so the stock pipeline below runs with it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fv_accel.models import cosmos2 as c2
from family_helpers import preprocess_tiny_clips, run_overrides


@pytest.fixture(scope="module")
def cosmos_dir(tiny_model_of):
    return tiny_model_of("cosmos2")


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


def test_comfyui_names_are_the_original_cosmos_modules():
    name = c2.cosmos2_original_module_name
    assert name("transformer_blocks.3.attn2.to_out.0") == "blocks.3.cross_attn.output_proj"
    assert name("transformer_blocks.0.norm1.linear_1") == "blocks.0.adaln_modulation_self_attn.1"
    assert name("proj_out") == "final_layer.linear"
    with pytest.raises(ValueError, match="no original Cosmos-Predict2"):
        name("transformer_blocks.0.attn1.norm_q")


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


# ---- the family end to end: preprocess -> train -> save -> the stock pipeline ----


@pytest.fixture(scope="module")
def cosmos_data(tmp_path_factory, cosmos_dir):
    """The tiny model's dataset: 2 clips of 17 frames at 64x64 preprocessed with its own VAE and T5."""
    return preprocess_tiny_clips(cosmos_dir, tmp_path_factory.mktemp("cosmos2_data"))


def overrides(tmp, model, data, **extra):
    return run_overrides(tmp, model, data, **{"training.optimizer.learning_rate": 1.0e-2, **extra})


# LoRA on the recipe's (and the family's default) targets: attention projections and the FFN.
LORA = {"models.student.lora.enable": True, "models.student.lora.target_modules": list(c2.Cosmos2Student.lora_target_modules)}


def one_batch(data):
    from fv_accel.data.loader import LatentDataset

    item = LatentDataset(str(data))[(0, 0, 0)]
    return {k: (v[None] if isinstance(v, torch.Tensor) else v) for k, v in item.items()} | {
        "sample_index": torch.tensor([0]),
        "epoch": torch.tensor([0]),
    }


def cosmos_student(model, recipe: str = "finetune", **extra):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.methods import METHODS
    from fv_accel.models import build_student

    cfg = load_config(default_recipe(recipe), {"models.student.init_from": str(model), "callbacks.validation.enable": False, **extra})
    torch.manual_seed(0)
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student, METHODS[cfg.method.name](cfg=cfg, role_models={"student": student})


def stock_video(pipe, seed: int = 0) -> np.ndarray:
    return pipe(
        image=first_frame(seed),
        prompt="a red ball moving left",
        height=64,
        width=64,
        num_frames=17,
        num_inference_steps=2,
        guidance_scale=3.0,
        output_type="np",
        generator=torch.Generator().manual_seed(0),
    ).frames


def test_preprocessed_rows_statistics_shift_and_condition(cosmos_dir, cosmos_data):
    """The family's data: raw latents [16, 5, 8, 8], T5 caption embeddings, the first frame; latent
    statistics as the pipeline normalises; the training shift sqrt(5); one clean condition frame."""
    from diffusers import AutoencoderKLWan

    batch = one_batch(cosmos_data)
    assert tuple(batch["vae_latent"].shape) == (1, 16, 5, 8, 8)
    assert batch["text_embedding"].shape[-1] == 32
    assert tuple(batch["pil_image"].shape) == (1, 64, 64, 3) and batch["pil_image"].dtype == torch.uint8
    student, _ = cosmos_student(cosmos_dir)
    vae = AutoencoderKLWan.from_pretrained(cosmos_dir, subfolder="vae")
    torch.testing.assert_close(student.latents_mean.flatten(), torch.tensor(vae.config.latents_mean))
    torch.testing.assert_close(student.latents_std.flatten(), torch.tensor(vae.config.latents_std))
    assert student.training_shift(batch["vae_latent"].shape) == pytest.approx(5 ** 0.5)
    cond = student.build_conditioning(batch)
    assert cond.clean_frames == 1
    # The raw latent's frame 0 is the VAE's latent of the first image alone (causal VAE): the condition
    # the pipeline builds from `image=` (mode; the pipeline draws a posterior sample).
    image = torch.from_numpy(np.asarray(batch["pil_image"][0])).permute(2, 0, 1)[None, :, None].float() / 127.5 - 1
    with torch.no_grad():
        alone = vae.encode(image).latent_dist.mode()
    torch.testing.assert_close(alone[:, :, 0], batch["vae_latent"][:, :, 0], atol=1e-4, rtol=1e-4)


def test_student_forward_is_the_reference_velocity(cosmos_dir):
    """`forward` around a transformer returning the true velocity for its input at its timestep
    ((x - x0) / t, the stock pipeline's convention, test above) returns eps - x0 on the noisy
    frames; the condition frame enters clean, masked, at the pipeline's condition timestep."""
    student, _ = cosmos_student(cosmos_dir)
    gen = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(2, 16, 5, 8, 8, generator=gen), torch.randn(2, 16, 5, 8, 8, generator=gen)
    t = torch.tensor([[0.0, 900.0, 600.0, 300.0, 50.0], [0.0, 100.0, 100.0, 700.0, 700.0]])
    sigma = (t / 1000)[:, None, :, None, None]
    x_t = (1 - sigma) * x0 + sigma * eps
    seen = {}

    def true_velocity(hidden_states, timestep, encoder_hidden_states, fps=None, condition_mask=None, padding_mask=None, return_dict=True, **_):
        seen.update(timestep=timestep.flatten(1), mask=condition_mask[:, 0, :, 0, 0], fps=fps)
        return ((hidden_states - x0) / timestep,)

    student.transformer.forward = true_velocity
    cond = Conditioning_(torch.zeros(2, 512, 32), clean_frames=1)
    v = student.forward(x_t, t, cond)
    torch.testing.assert_close(v[:, :, 1:], (eps - x0)[:, :, 1:], atol=1e-4, rtol=1e-4)
    assert seen["mask"].tolist() == [[1, 0, 0, 0, 0]] * 2
    torch.testing.assert_close(seen["timestep"][:, 0], torch.full((2,), c2.CONDITION_TIMESTEP))
    torch.testing.assert_close(seen["timestep"][:, 1:], t[:, 1:] / 1000)
    assert seen["fps"] == c2.PIPELINE_FPS == 16


def Conditioning_(text, clean_frames):
    from fv_accel.models.base import Conditioning

    return Conditioning(text=text, clean_frames=clean_frames)


def test_lora_finetune_loads_into_the_stock_pipeline(tmp_path, cosmos_dir, cosmos_data):
    """FineTune with LoRA -> pytorch_lora_weights.safetensors (diffusers' Cosmos LoRA format) ->
    the stock Video2World pipeline's transformer loads it (weights changed) -> 17-frame video; the
    ComfyUI file names NVIDIA's original modules."""
    from safetensors.torch import load_file

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    Trainer(build_from_config(default_recipe("finetune"), overrides(tmp_path, cosmos_dir, cosmos_data, **LORA))).run()
    out = tmp_path / "out"
    lora = load_file(str(out / "pytorch_lora_weights.safetensors"))
    assert lora and all(k.startswith("transformer.transformer_blocks.") for k in lora)
    assert any(".ff.net.0.proj." in k for k in lora) and any(".attn2.to_k." in k for k in lora)
    comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
    assert "diffusion_model.blocks.0.self_attn.q_proj.lora_down.weight" in comfy
    assert "diffusion_model.blocks.1.mlp.layer2.lora_up.weight" in comfy

    pipe = stock_pipeline(cosmos_dir)
    base_video = stock_video(pipe)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.transformer.load_lora_adapter(str(out), weight_name="pytorch_lora_weights.safetensors", prefix="transformer", adapter_name="trained")
    pipe.transformer.fuse_lora(lora_scale=1.0)
    pipe.transformer.unload_lora()
    after = pipe.transformer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("attn1.to_q" in k for k in changed) and any("ff.net.2" in k for k in changed)
    assert not any("norm" in k for k in changed)
    video = stock_video(pipe)
    assert video.shape == (1, 17, 64, 64, 3)
    assert np.abs(video - base_video).max() > 0


def test_full_finetune_saves_a_transformer_the_stock_pipeline_takes(tmp_path, cosmos_dir, cosmos_data):
    from diffusers import CosmosTransformer3DModel

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    Trainer(build_from_config(default_recipe("finetune"), overrides(tmp_path, cosmos_dir, cosmos_data))).run()
    saved = CosmosTransformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder="transformer")
    base = CosmosTransformer3DModel.from_pretrained(str(cosmos_dir), subfolder="transformer")
    assert saved.config.in_channels == 17
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), base.state_dict().values()))
    video = stock_video(stock_pipeline(cosmos_dir, transformer=saved))
    assert video.shape == (1, 17, 64, 64, 3)


def test_dfsft_trains_with_a_timestep_per_latent_frame(tmp_path, cosmos_dir, cosmos_data):
    """DFSFT builds (the family takes per-frame timesteps), its chunks' timesteps reach the
    transformer per frame (the condition frame at the pipeline's condition timestep), and it trains
    and saves a transformer the stock pipeline takes."""
    from diffusers import CosmosTransformer3DModel

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    student, method = cosmos_student(cosmos_dir, "dfsft", **{"method.chunk_size": 2})
    seen = []
    student.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw["timestep"].flatten(1).clone()), with_kwargs=True)
    torch.manual_seed(0)
    batch = one_batch(cosmos_data)
    loss_map, _, _ = method.single_train_step(batch, 0)
    assert torch.isfinite(loss_map["total_loss"])
    (t,) = seen
    assert t.shape == (1, 5)
    assert float(t[0, 0]) == pytest.approx(c2.CONDITION_TIMESTEP, rel=1e-3)
    assert float(t[0, 1]) == float(t[0, 2]) and float(t[0, 3]) == float(t[0, 4])  # chunks of 2
    assert float(t[0, 1]) != float(t[0, 3])

    Trainer(build_from_config(default_recipe("dfsft"), overrides(tmp_path, cosmos_dir, cosmos_data, **{"method.chunk_size": 2}))).run()
    saved = CosmosTransformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder="transformer")
    assert stock_video(stock_pipeline(cosmos_dir, transformer=saved)).shape == (1, 17, 64, 64, 3)


def test_sample_latents_run_the_stock_pipeline_around_the_student(cosmos_dir, cosmos_data):
    """Validation's sample: Cosmos2VideoToWorldPipeline around the live transformer, from precomputed
    embeddings and a training clip's first frame: normalised latents of the clip's size, the same
    as the stock pipeline loaded from the folder gives for the same inputs."""
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    student, _ = cosmos_student(cosmos_dir)
    batch = one_batch(cosmos_data)
    cond = student.build_conditioning(batch)
    vae = AutoencoderKLWan.from_pretrained(cosmos_dir, subfolder="vae")
    kwargs = dict(height=64, width=64, num_frames=17, num_inference_steps=3, guidance_scale=1.0)
    kwargs["scheduler"] = FlowMatchEulerDiscreteScheduler.from_pretrained(cosmos_dir, subfolder="scheduler")
    frame = batch["pil_image"][0].numpy()
    latents = student.sample_latents(vae, cond, None, generator=torch.Generator().manual_seed(0), first_frame=frame, **kwargs)
    assert latents.shape == (1, 16, 5, 8, 8)
    stock = stock_pipeline(cosmos_dir)(
        image=first_frame_from(frame), prompt_embeds=cond.text, height=64, width=64, num_frames=17,
        num_inference_steps=3, guidance_scale=1.0, output_type="latent", generator=torch.Generator().manual_seed(0),
    ).frames
    torch.testing.assert_close(latents, stock.float())


def first_frame_from(frame):
    from PIL import Image

    return Image.fromarray(np.asarray(frame, dtype=np.uint8))


def test_recipes_resolve_and_dry_run(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from fv_accel.config import load_config

    root = Path(__file__).resolve().parents[1]
    for name, method in (("cosmos2_2b_video2world_lora", "finetune"), ("cosmos2_2b_video2world_dfsft", "dfsft")):
        cfg = load_config(root / "configs" / f"{name}.yaml")
        assert (cfg.models.student.init_from, cfg.method.name) == ("nvidia/Cosmos-Predict2-2B-Video2World", method)
        assert cfg.training.checkpoint.output_dir == f"outputs/{name}"
        assert c2.video_noise_shift(cfg.training.data.num_latent_t) == pytest.approx(4.899, abs=1e-3)
    out = subprocess.run(
        [sys.executable, "train_finetune.py", "--config", "configs/cosmos2_2b_video2world_lora.yaml", "--dry-run"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["models"]["student"]["init_from"] == "nvidia/Cosmos-Predict2-2B-Video2World"
