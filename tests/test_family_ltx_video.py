"""The LTX-Video family on its tiny model: the stock LTXPipeline loads it; one step of the repo's own
scheduler with the true velocity lands on the clean latent; per-frame timesteps reach the
transformer per token; preprocessing with its own VAE and T5; FineTune (full, LoRA) and DFSFT, with
the results loaded by the stock pipeline."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from fv_accel.build import build_from_config
from fv_accel.config import default_recipe, load_config
from fv_accel.methods import METHODS
from fv_accel.models import build_student
from fv_accel.models.ltx_video import LTXVideoStudent, pack_latents, token_timesteps
from fv_accel.trainer import Trainer
from family_helpers import preprocess_tiny_clips, run_overrides

CPU = torch.device("cpu")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ltx(tmp_path_factory, tiny_model_of):
    """(tiny LTX-Video folder, its preprocessed dataset of 2 clips of 17 frames at 64x64)."""
    model = tiny_model_of("ltx_video")
    return model, preprocess_tiny_clips(model, tmp_path_factory.mktemp("ltx"))


def stock_pipeline(model: Path):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(model))


def student_and_method(model: Path, recipe: str = "finetune", **extra):
    over = {"models.student.init_from": str(model), "callbacks.validation.enable": False, **extra}
    cfg = load_config(default_recipe(recipe), over)
    torch.manual_seed(0)
    student = build_student(cfg)
    return student, METHODS[cfg.method.name](cfg=cfg, role_models={"student": student})


def one_batch(data: Path) -> dict:
    from fv_accel.data.loader import LatentDataset

    item = LatentDataset(str(data))[(0, 0, 0)]
    return {k: (v[None] if isinstance(v, torch.Tensor) else v) for k, v in item.items()} | {
        "sample_index": torch.tensor([0]),
        "epoch": torch.tensor([0]),
    }


def video_frames(pipe, **kwargs) -> tuple:
    out = pipe(
        num_frames=17, height=64, width=64, num_inference_steps=2, output_type="np",
        generator=torch.Generator().manual_seed(0), **kwargs,
    )
    return tuple(out.frames.shape)


# ---- the tiny model and the stock pipeline ----


def test_the_stock_pipeline_loads_the_tiny_model_and_makes_17_frames(ltx):
    from diffusers import LTXPipeline

    model, _ = ltx
    pipe = stock_pipeline(model)
    assert type(pipe) is LTXPipeline
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert pipe.scheduler.config.use_dynamic_shifting and pipe.scheduler.config.shift_terminal == 0.1
    assert video_frames(pipe, prompt="a red ball moving left") == (1, 17, 64, 64, 3)


def test_latent_statistics_are_the_vae_buffers_as_the_pipeline_normalises(ltx):
    from diffusers import AutoencoderKLLTXVideo, LTXPipeline

    model, _ = ltx
    mean, std = LTXVideoStudent.latent_statistics(str(model))
    vae = AutoencoderKLLTXVideo.from_pretrained(str(model), subfolder="vae")
    assert not torch.equal(vae.latents_mean, torch.zeros_like(vae.latents_mean))  # measured, not the defaults
    x = torch.randn(1, len(mean), 2, 2, 2)
    ours = (x - torch.tensor(mean).view(1, -1, 1, 1, 1)) / torch.tensor(std).view(1, -1, 1, 1, 1)
    theirs = LTXPipeline._normalize_latents(x, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def test_encoder_text_embedding_is_the_pipelines_prompt_embedding(ltx):
    model, _ = ltx
    encoder = LTXVideoStudent.make_encoder(str(model), device=CPU)
    caption = "a blue square moving up on a dark background"
    ours = encoder.encode_caption(caption)["text_embedding"]
    pipe = stock_pipeline(model)
    embeds, mask, _, _ = pipe.encode_prompt(caption, do_classifier_free_guidance=False, device=CPU)
    length = int(mask.sum())
    assert ours.shape == (length, embeds.shape[-1]) and length == len(caption.split()) + 1  # + </s>
    torch.testing.assert_close(ours, embeds[0, :length].float())
    spec = LTXVideoStudent.encoding_spec(str(model))
    assert (spec.z_dim, spec.scale_factor_spatial, spec.scale_factor_temporal, spec.patch_size) == (16, 32, 8, (1, 1, 1))


# ---- flow-matching conventions ----


def test_one_step_of_the_repos_scheduler_with_the_true_velocity_returns_the_clean_latent(ltx):
    """x_t = (1 - sigma) x0 + sigma eps with v = eps - x0 (the family's convention) and timesteps
    sigma * 1000: every Euler step of LTX-Video's own scheduler (dynamic shift at the tiny latent's
    token count, terminal stretch) lands on the noised latent of the next sigma, the last on x0."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    model, _ = ltx
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(model), subfolder="scheduler")
    c = scheduler.config
    tokens = 3 * 2 * 2  # 17 frames at 64x64: 3 x 2 x 2 latent tokens
    mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
    steps = 4
    scheduler.set_timesteps(sigmas=[1.0 - i / steps for i in range(steps)], mu=mu)
    torch.manual_seed(0)
    x0, eps = torch.randn(1, 12, 16), torch.randn(1, 12, 16)
    v = eps - x0
    sigmas = scheduler.sigmas
    assert float(sigmas[-2]) == pytest.approx(c.shift_terminal) and float(sigmas[-1]) == 0.0
    torch.testing.assert_close(scheduler.timesteps, sigmas[:-1] * 1000)
    worst = 0.0
    for i, t in enumerate(scheduler.timesteps):
        x_t = (1 - sigmas[i]) * x0 + sigmas[i] * eps
        out = scheduler.step(v, t, x_t, return_dict=False)[0]
        expected = (1 - sigmas[i + 1]) * x0 + sigmas[i + 1] * eps
        worst = max(worst, float((out - expected).abs().max()))
    assert worst < 1e-5
    torch.testing.assert_close(out, x0, rtol=0, atol=1e-5)


def test_training_shift_is_the_pipelines_resolution_shift(ltx):
    """The training table at the family's shift gives the sigmas the repo's scheduler gives at the
    pipeline's mu for the same latent size (before the sampling-only terminal stretch)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift

    model, _ = ltx
    student, _ = student_and_method(model)
    c = FlowMatchEulerDiscreteScheduler.from_pretrained(str(model), subfolder="scheduler").config
    for shape, tokens in (((1, 16, 3, 2, 2), 12), ((1, 16, 16, 16, 24), 6144)):
        shift = student.training_shift(torch.Size(shape))
        mu = calculate_shift(tokens, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)
        assert shift == pytest.approx(math.exp(mu), rel=1e-9)
        u = torch.linspace(0.001, 1.0, 50, dtype=torch.float64)
        dynamic = math.exp(mu) / (math.exp(mu) + (1 / u - 1))
        static = shift * u / (1 + (shift - 1) * u)
        torch.testing.assert_close(static, dynamic)
    override, _ = student_and_method(model, **{"models.student.flow_shift": 2.5})
    assert override.training_shift(torch.Size((1, 16, 3, 2, 2))) == 2.5


# ---- per-frame timesteps ----


def test_per_frame_timesteps_become_frame_major_per_token_timesteps():
    t = torch.tensor([[100.0, 500.0, 900.0]])
    grid = (3, 2, 2)
    tokens = token_timesteps(t, grid, 1)
    volume = t[:, None, :, None, None].expand(1, 1, *grid)  # each frame's value over its H x W
    assert torch.equal(tokens, pack_latents(volume, 1, 1)[..., 0])
    assert tokens.tolist() == [[100.0] * 4 + [500.0] * 4 + [900.0] * 4]
    with pytest.raises(ValueError, match="share a timestep"):
        token_timesteps(torch.tensor([[1.0, 2.0, 3.0, 3.0]]), (2, 1, 1), 2)


def test_per_frame_timesteps_reach_each_frames_tokens_and_only_them(ltx):
    model, data = ltx
    student, _ = student_and_method(model, "dfsft", **{"method.chunk_size": 1})
    batch = one_batch(data)
    cond = student.build_conditioning(batch)
    x0 = student.clean_latents(batch)
    assert tuple(x0.shape) == (1, 16, 3, 2, 2)
    x_t = torch.randn_like(x0)
    modulation = []
    hook = student.transformer.time_embed.register_forward_hook(lambda m, a, out: modulation.append(out[0].detach()))
    with torch.no_grad():
        same = torch.full((1, 3), 600.0)
        per_sample = student.forward(x_t, same[:, 0], cond)
        per_frame = student.forward(x_t, same, cond)
        changed = same.clone()
        changed[0, 2] = 50.0  # the last chunk (frame 2, tokens 8..11) only
        moved = student.forward(x_t, changed, cond)
    hook.remove()
    # one timestep per frame, all equal, is the per-sample call
    torch.testing.assert_close(per_frame, per_sample, rtol=1e-5, atol=1e-6)
    # the modulation (AdaLN input, one row per token) changes exactly on frame 2's tokens
    before, after = modulation[1].view(12, -1), modulation[2].view(12, -1)
    rows_changed = [(before[i] - after[i]).abs().max().item() > 0 for i in range(12)]
    assert rows_changed == [False] * 8 + [True] * 4
    # bidirectional attention: frame 2's output moves most; the others move through attention
    delta = (moved - per_frame).abs().amax(dim=(0, 1, 3, 4))
    assert float(delta[2]) > 0 and float(delta[2]) >= float(delta[:2].max())


# ---- training end to end ----


def test_lora_finetune_writes_files_the_stock_pipeline_loads_and_that_change_its_weights(tmp_path, ltx):
    model, data = ltx
    run = build_from_config(default_recipe("finetune"), run_overrides(tmp_path, model, data, **{"models.student.lora.enable": True}))
    Trainer(run).run()
    out = tmp_path / "out"
    assert (out / "pytorch_lora_weights.safetensors").is_file()
    from safetensors.torch import load_file

    comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
    assert "diffusion_model.transformer_blocks.0.attn1.to_q.lora_down.weight" in comfy
    assert "diffusion_model.transformer_blocks.1.attn2.to_out.0.alpha" in comfy
    pipe = stock_pipeline(model)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(out), adapter_name="trained")
    pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
    pipe.unload_lora_weights()
    after = pipe.transformer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert changed and all(k.rsplit(".", 2)[-2] in ("to_q", "to_k", "to_v", "0") for k in changed)
    assert video_frames(pipe, prompt="a red ball moving left") == (1, 17, 64, 64, 3)


def test_full_finetune_saves_a_transformer_the_stock_pipeline_runs(tmp_path, ltx):
    from diffusers import LTXVideoTransformer3DModel

    model, data = ltx
    Trainer(build_from_config(default_recipe("finetune"), run_overrides(tmp_path, model, data))).run()
    saved = LTXVideoTransformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder="transformer")
    base = LTXVideoTransformer3DModel.from_pretrained(str(model), subfolder="transformer")
    assert any(not torch.equal(a, b) for a, b in zip(saved.state_dict().values(), base.state_dict().values()))
    pipe = stock_pipeline(model)
    pipe.transformer = saved
    assert video_frames(pipe, prompt="a green circle moving right") == (1, 17, 64, 64, 3)


def test_dfsft_trains_with_per_chunk_timesteps(tmp_path, ltx):
    model, data = ltx
    student, method = student_and_method(model, "dfsft", **{"method.chunk_size": 1})
    loss_map, outputs, _ = method.single_train_step(one_batch(data), 0)
    tb = outputs["training_batch"]
    assert tb.timesteps.shape == (1, 3) and len(set(tb.timesteps[0].tolist())) > 1
    assert math.isfinite(float(loss_map["total_loss"]))
    Trainer(build_from_config(default_recipe("dfsft"), run_overrides(tmp_path, model, data, **{"method.chunk_size": 1}))).run()
    assert (tmp_path / "out" / "transformer" / "config.json").is_file()


def test_sample_latents_run_the_stock_pipeline_around_the_live_transformer(ltx):
    from diffusers import FlowMatchEulerDiscreteScheduler

    model, data = ltx
    student, _ = student_and_method(model)
    cond = student.build_conditioning(one_batch(data))
    vae = LTXVideoStudent.load_vae(str(model))
    latents = student.sample_latents(
        vae, cond, cond.unconditional(), height=64, width=64, num_frames=17, num_inference_steps=2,
        guidance_scale=3.0, scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(model, subfolder="scheduler"),
        generator=torch.Generator().manual_seed(0),
    )
    assert tuple(latents.shape) == (1, 16, 3, 2, 2)
    raw = latents * student.latents_std + student.latents_mean
    video = LTXVideoStudent.decode(vae, raw)
    assert tuple(video.shape) == (1, 3, 17, 64, 64)


# ---- LoRA key maps ----


def test_comfyui_names_are_the_original_ltx_names():
    name = LTXVideoStudent.comfyui_module_name
    assert name("transformer_blocks.3.attn1.to_q") == "transformer_blocks.3.attn1.to_q"
    assert name("transformer_blocks.0.ff.net.0.proj") == "transformer_blocks.0.ff.net.0.proj"
    assert name("proj_in") == "patchify_proj"
    assert name("time_embed.linear") == "adaln_single.linear"
    assert name("time_embed.emb.timestep_embedder.linear_1") == "adaln_single.emb.timestep_embedder.linear_1"
    assert name("transformer_blocks.0.attn2.norm_k") == "transformer_blocks.0.attn2.k_norm"
    assert name("caption_projection.linear_1") == "caption_projection.linear_1"


# ---- recipes ----

LTX_RECIPES = {
    "ltx_video_lora": ("Lightricks/LTX-Video", "finetune", True),
    "ltx_video_0_9_5_lora": ("Lightricks/LTX-Video-0.9.5", "finetune", True),
    "ltx_video_0_9_5_dfsft": ("Lightricks/LTX-Video-0.9.5", "dfsft", False),
}


@pytest.mark.parametrize("name", sorted(LTX_RECIPES))
def test_ltx_recipes_resolve(name):
    repo, method, lora = LTX_RECIPES[name]
    cfg = load_config(ROOT / "configs" / f"{name}.yaml")
    st = cfg.models.student
    assert (st.init_from, cfg.method.name, st.lora.enable, st.flow_shift) == (repo, method, lora, None)
    assert (cfg.training.data.num_frames - 1) % 8 == 0
    assert cfg.training.checkpoint.output_dir == f"outputs/{name}"


# ---- block-causal attention ----


def test_block_causal_ltx_student_hides_later_blocks_and_matches_full_attention_at_one_block(ltx):
    model, data = ltx
    full_student, _ = student_and_method(model, "dfsft", **{"method.chunk_size": 2})
    cond = full_student.build_conditioning(one_batch(data))
    torch.manual_seed(0)
    x = torch.randn(1, 16, 4, 2, 2)
    t = torch.tensor([[300.0, 300.0, 700.0, 700.0]])
    later = x.clone()
    later[:, :, 2:] += 1.0  # only block 1 (frames 2, 3) differs

    def causal(block: int, backend: str):
        student, _ = student_and_method(
            model, "dfsft",
            **{"models.student.causal": True, "method.chunk_size": block, "models.student.causal_attention_backend": backend},
        )
        assert student.causal_block_size == block and student.causal_spec().block_size == block
        with torch.no_grad():
            return student.forward(x, t, cond), student.forward(later, t, cond)

    with torch.no_grad():
        full = full_student.forward(x, t, cond)
    one_block, _ = causal(4, "chunked")  # one block spanning the clip: full attention
    torch.testing.assert_close(one_block, full, rtol=1e-5, atol=1e-6)
    out, moved = causal(2, "chunked")
    assert torch.equal(out[:, :, :2], moved[:, :, :2])  # block 0 cannot see block 1
    assert float((out[:, :, 2:] - moved[:, :, 2:]).abs().max()) > 1e-3
    assert float((out[:, :, :2] - full[:, :, :2]).abs().max()) > 1e-4  # with full attention it did
    flex, _ = causal(2, "flex")  # FlexAttention's BlockMask (forward only on the CPU)
    torch.testing.assert_close(flex, out, rtol=1e-5, atol=1e-6)


def test_ltx_dfsft_recipe_dry_run_resolves():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "train_dfsft.py", "--config", "configs/ltx_video_0_9_5_dfsft.yaml", "--dry-run"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "Lightricks/LTX-Video-0.9.5" in out.stdout and "chunk_size: 4" in out.stdout


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("models.student.guidance", 6.0, "models.student.guidance: 6.0: the ltx_video family's LTXVideoTransformer3DModel has no guidance embedding"),
        ("models.student.expert", "low_noise", "models.student.expert is 'low_noise' but model '.*' \\(ltx_video family\\) has one transformer"),
        ("models.student.task", "i2v", "models.student.task is i2v but model '.*' \\(ltx_video family\\) takes no image condition"),
    ],
)
def test_keys_of_other_families_are_refused_not_ignored(ltx, key, value, message):
    """The generic student refuses a recipe key its family has no use for, naming the key and value."""
    model, _ = ltx
    with pytest.raises(ValueError, match=message):
        student_and_method(model, **{key: value})


def test_a_lora_checkpoint_exports_merged_into_an_ltx_transformer(tmp_path, ltx):
    """A checkpoint records the recipe's `model_class: auto`; the export finds the family from the
    base model and merges the adapter into an LTXVideoTransformer3DModel."""
    from diffusers import LTXVideoTransformer3DModel

    from fv_accel.export import export_merged, find_source

    model, data = ltx
    over = run_overrides(tmp_path, model, data, **{
        "models.student.lora.enable": True, "training.checkpoint.training_state_checkpointing_steps": 1,
        "training.optimizer.lr_warmup_steps": 0,  # the first step trains (warm-up starts at LR 0)
    })
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    written = export_merged(find_source(tmp_path / "out" / "checkpoint-1"), tmp_path / "merged")
    merged = LTXVideoTransformer3DModel.from_pretrained(str(written[0]))
    base = LTXVideoTransformer3DModel.from_pretrained(str(model), subfolder="transformer")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, merged.state_dict()[k])]
    assert changed and all("attn" in k for k in changed)


def test_self_forcing_distils_a_block_causal_ltx_student(tmp_path, ltx):
    """Self-Forcing beyond Wan: an LTX-Video teacher and critic, the student the same model made
    block-causal (chunks of 1 latent frame: 3 chunks), rolled out over its KV cache."""
    model, data = ltx
    over = run_overrides(tmp_path, model, data, **{
        "models.student.init_from": str(model), "models.student.causal": True, "models.teacher.init_from": str(model),
        "method.chunk_size": 1, "method.generator_update_interval": 1,
    })
    run = build_from_config(str(ROOT / "configs" / "tiny_self_forcing.yaml"), over)
    assert type(run.method.student).__name__ == "LTXVideoStudent" and run.method.student.causal_attention is not None
    summary = Trainer(run).run()
    assert summary["steps"] == 2 and summary["skipped_steps"] == 0
    assert (tmp_path / "out" / "transformer" / "config.json").is_file() and (tmp_path / "out" / "critic").is_dir()
