"""The HunyuanVideo family on its tiny model (fv_accel/tiny/hunyuan_video.py), against the stock
diffusers HunyuanVideoPipeline, offline."""

from __future__ import annotations

import json

import pytest
import torch
from family_helpers import preprocess_tiny_clips, run_overrides


@pytest.fixture(scope="module")
def hv_dir(tiny_model_of):
    """The tiny model as `python -m fv_accel.tiny_model DIR --model hunyuan_video` writes it."""
    return tiny_model_of("hunyuan_video")


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


# ---- the family (fv_accel/models/hunyuan_video.py) ----
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hv_data(hv_dir, tmp_path_factory):
    """The tiny HunyuanVideo model's dataset: 2 clips of 17 frames at 64x64."""
    return preprocess_tiny_clips(hv_dir, tmp_path_factory.mktemp("hv_data"))


def hv_student(hv_dir, hv_data, tmp_path, **extra):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), run_overrides(tmp_path, hv_dir, hv_data, **extra))
    torch.manual_seed(0)
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student


def test_preprocessing_stores_both_text_encoders_as_the_pipeline_computes_them(hv_dir, hv_pipe, hv_data):
    import pyarrow.parquet as pq

    from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import DEFAULT_PROMPT_TEMPLATE

    from fv_accel.data.schema import read_dataset_info, read_tensor_column

    template = DEFAULT_PROMPT_TEMPLATE["template"]

    rows = [r for f in sorted(hv_data.glob("data-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 2
    scaling = hv_pipe.vae.config.scaling_factor
    info = read_dataset_info(hv_data)
    assert info["latents_mean"] == [0.0] * 16 and info["latents_std"] == pytest.approx([1 / scaling] * 16)
    for row in rows:
        latent = read_tensor_column(row, "vae_latent")
        assert tuple(latent.shape) == (16, 5, 8, 8)  # (17 - 1) / 4 + 1 frames, 64 / 8
        text = read_tensor_column(row, "text_embedding")
        pooled = read_tensor_column(row, "pooled_text_embedding")
        embeds, pooled_ref, mask = hv_pipe.encode_prompt(prompt=row["caption"], device=CPU)
        n = int(mask.sum())
        # the caption's tokens and <|eot_id|>: the templated prompt's tokens after the crop
        assert text.shape == (n, 32) and n == len(hv_pipe.tokenizer(template.format(row["caption"])).input_ids) - 95
        torch.testing.assert_close(text, embeds[0, :n], rtol=0, atol=1e-6)
        torch.testing.assert_close(pooled, pooled_ref[0], rtol=0, atol=1e-6)


def test_family_forward_matches_the_stock_transformer_call_and_feeds_the_guidance(hv_dir, hv_pipe, hv_data, tmp_path):
    from fv_accel.models.hunyuan_video import PIPELINE_GUIDANCE, HunyuanVideoStudent

    student = hv_student(hv_dir, hv_data, tmp_path)
    assert isinstance(student, HunyuanVideoStudent) and student.guidance == PIPELINE_GUIDANCE == 6.0
    assert student.training_shift(torch.Size([1, 16, 5, 8, 8])) == 7.0  # the repo's scheduler shift
    scaling = hv_pipe.vae.config.scaling_factor
    torch.testing.assert_close(student.latents_std.flatten(), torch.full((16,), 1 / scaling))
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn(2, 16, 5, 8, 8, generator=g)
    t = torch.tensor([900.0, 250.0])
    embeds, pooled, mask = hv_pipe.encode_prompt(prompt=["a red ball", "the blue square moving left"], device=CPU)
    # The batch as the loader gives it: real tokens, zero padding to 512, the mask.
    text = torch.zeros(2, 512, 32)
    text_mask = torch.zeros(2, 512, dtype=torch.long)
    for i in range(2):
        n = int(mask[i].sum())
        text[i, :n], text_mask[i, :n] = embeds[i, :n], 1
    batch = {"text_embedding": text, "text_attention_mask": text_mask, "pooled_text_embedding": pooled}
    cond = student.build_conditioning(batch)
    student.transformer.eval()
    with torch.no_grad():
        out = student.forward(x_t, t, cond)
        ref = hv_pipe.transformer(
            hidden_states=x_t, timestep=t, encoder_hidden_states=embeds, encoder_attention_mask=mask.float(),
            pooled_projections=pooled, guidance=torch.full((2,), 6000.0), return_dict=False,
        )[0]
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)  # 256-padded pipeline input, same output
        student.guidance = 1.0
        other = student.forward(x_t, t, cond)
        uncond = student.forward(x_t, t, cond.unconditional())
    assert (other - out).abs().max() > 1e-4  # the guidance value reaches the transformer
    assert (uncond - out).abs().max() > 1e-4  # the pooled and sequence text both zeroed
    # A per-frame timestep that varies over frames cannot be taken; a constant one is one per sample.
    with pytest.raises(ValueError, match="one timestep per sample"):
        student.forward(x_t, torch.tensor([[900.0] * 4 + [100.0]] * 2), cond)
    with torch.no_grad():
        student.guidance = 6.0
        torch.testing.assert_close(student.forward(x_t, t[:, None].expand(2, 5), cond), out)
    # The recipe's value is the one fed: models.student.guidance 1.0 gives the output of guidance 1.0.
    recipe_student = hv_student(hv_dir, hv_data, tmp_path, **{"models.student.guidance": 1.0})
    assert recipe_student.guidance == 1.0
    recipe_student.transformer.eval()
    with torch.no_grad():
        torch.testing.assert_close(recipe_student.forward(x_t, t, cond), other)
    with pytest.raises(ValueError, match="has no guidance embedding"):
        recipe_student.configure({"guidance_embeds": False})  # a transformer without the input refuses a value
    with pytest.raises(ValueError, match=r"image_condition_type 'latent_concat'\) is not supported"):
        recipe_student.configure({"guidance_embeds": True, "image_condition_type": "latent_concat"})


def test_dfsft_is_refused_at_build_time_with_one_line(hv_dir, hv_data, tmp_path):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe

    with pytest.raises(ValueError) as err:
        build_from_config(default_recipe("dfsft"), run_overrides(tmp_path, hv_dir, hv_data, **{"method.chunk_size": 2}))
    message = str(err.value)
    assert "\n" not in message
    assert "hunyuan_video" in message and "one timestep per sample" in message


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_finetune_saves_what_the_stock_pipeline_loads_and_samples_17_frames(hv_dir, hv_data, tmp_path, lora):
    from diffusers import DiffusionPipeline, HunyuanVideoTransformer3DModel
    from safetensors.torch import load_file

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    over = run_overrides(tmp_path, hv_dir, hv_data, **{"models.student.lora.enable": lora})
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    out = tmp_path / "out"
    pipe = DiffusionPipeline.from_pretrained(hv_dir)
    pipe.set_progress_bar_config(disable=True)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    if lora:
        pipe.load_lora_weights(str(out), adapter_name="trained")
        pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
        pipe.unload_lora_weights()
        after = pipe.transformer.state_dict()
        changed = {k for k in before if not torch.equal(before[k], after[k])}
        assert any("transformer_blocks.0.attn.to_q" in k for k in changed)
        assert any("single_transformer_blocks.0.attn.to_k" in k for k in changed)
        assert all(k.endswith(("to_q.weight", "to_k.weight", "to_v.weight", "to_out.0.weight")) for k in changed)
        assert json.loads((out / "base_model.json").read_text())["guidance"] == 6.0
        comfy = load_file(str(out / "pytorch_lora_weights_comfyui.safetensors"))
        assert "diffusion_model.double_blocks.0.img_attn_qkv.lora_A.weight" in comfy
        assert "diffusion_model.single_blocks.0.linear1.lora_B.weight" in comfy
        # `python -m fv_accel.export RUN --to comfyui` writes the same file as training did.
        from fv_accel.export import main as export_main

        export_main([str(out), "--to", "comfyui", "--out", str(tmp_path / "comfy")])
        exported = load_file(str(tmp_path / "comfy" / "pytorch_lora_weights_comfyui.safetensors"))
        assert exported.keys() == comfy.keys() and all(torch.equal(exported[k], comfy[k]) for k in comfy)
    else:
        pipe.transformer = HunyuanVideoTransformer3DModel.from_pretrained(out / "transformer")
        after = pipe.transformer.state_dict()
        assert any(not torch.equal(before[k], after[k]) for k in before)
    frames = pipe(
        prompt="a red ball moving left", height=64, width=64, num_frames=17, num_inference_steps=2,
        output_type="np", generator=torch.Generator().manual_seed(0),
    ).frames
    assert frames.shape == (1, 17, 64, 64, 3)


def test_sample_latents_runs_the_stock_pipeline_around_the_live_transformer(hv_dir, hv_pipe, hv_data, tmp_path):
    from fv_accel.models.base import Conditioning
    from fv_accel.sampling import sampling_scheduler

    student = hv_student(hv_dir, hv_data, tmp_path)
    embeds, pooled, mask = hv_pipe.encode_prompt(prompt="a red ball", device=CPU)
    cond = Conditioning(text=embeds, text_mask=mask.long(), pooled_text=pooled)
    common = dict(height=64, width=64, num_frames=17, num_inference_steps=2, guidance_scale=6.0)
    latents = student.sample_latents(
        hv_pipe.vae, cond, None, scheduler=sampling_scheduler(7.0), generator=torch.Generator().manual_seed(3), **common
    )
    assert latents.shape == (1, 16, 5, 8, 8)
    hv_pipe.scheduler = sampling_scheduler(7.0)
    ref = hv_pipe(
        prompt_embeds=embeds, pooled_prompt_embeds=pooled, prompt_attention_mask=mask, output_type="latent",
        generator=torch.Generator().manual_seed(3), **common,
    ).frames
    torch.testing.assert_close(latents, ref.float(), rtol=1e-4, atol=1e-5)


def test_comfyui_file_is_the_same_adapter_in_the_original_layout(hv_dir):
    """Fused q/k/v (and the single blocks' q/k/v/mlp) LoRAs, read back by diffusers' own loader of the
    original HunyuanVideo layout, give the same weights as the diffusers file (double blocks: that
    loader's single-block split assumes the real 3072 width); every fused delta is the parts' deltas."""
    from diffusers import HunyuanVideoPipeline, HunyuanVideoTransformer3DModel
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from fv_accel.models.hunyuan_video import hunyuan_comfyui_lora

    def fresh():
        return HunyuanVideoTransformer3DModel.from_pretrained(hv_dir, subfolder="transformer")

    model = fresh()
    targets = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out", "ff.net.2"]
    model.add_adapter(LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian"))
    torch.manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data.normal_()
    state = get_peft_model_state_dict(model)
    alphas = {k.split(".lora_A.")[0]: 8.0 for k in state if ".lora_A." in k}
    comfy = hunyuan_comfyui_lora(state, alphas, mlp_width=64)
    # single block 0: linear1 = [q; k; v; mlp] rows; no proj_mlp LoRA -> zero mlp rows
    linear1 = "diffusion_model.single_blocks.0.linear1"
    fused = comfy[f"{linear1}.lora_B.weight"] @ comfy[f"{linear1}.lora_A.weight"]

    def delta(module: str) -> torch.Tensor:  # alpha / r = 2
        return 2.0 * state[f"{module}.lora_B.weight"] @ state[f"{module}.lora_A.weight"]

    parts = [delta(f"single_transformer_blocks.0.attn.{p}") for p in ("to_q", "to_k", "to_v")]
    torch.testing.assert_close(fused, torch.cat(parts + [torch.zeros(64, 32)]))
    assert not any(k.endswith(".alpha") for k in comfy)

    def merged(sd):
        pipe = HunyuanVideoPipeline(text_encoder=None, tokenizer=None, transformer=fresh(), vae=None, scheduler=None,
                                    text_encoder_2=None, tokenizer_2=None)
        pipe.load_lora_weights(dict(sd), adapter_name="x")
        pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
        pipe.unload_lora_weights()
        return pipe.transformer.state_dict()

    double = {k: v for k, v in state.items() if k.startswith("transformer_blocks.")}
    # diffusers' keys without metadata load at scale 1: fold alpha / r = 2 into lora_B
    ref = merged({"transformer." + k: v * (2.0 if "lora_B" in k else 1.0) for k, v in double.items()})
    got = merged({k: v for k, v in comfy.items() if ".double_blocks." in k})
    base = fresh().state_dict()
    assert sum(not torch.equal(ref[k], base[k]) for k in base) == 9  # q, k, v, add_q/k/v, to_out, to_add_out, ff
    for k in base:
        torch.testing.assert_close(got[k], ref[k], rtol=0, atol=1e-6)


def test_the_lora_recipe_resolves_and_dry_runs():
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "train_finetune.py", "--config", "configs/hunyuan_video_lora.yaml", "--dry-run"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    st = printed["models"]["student"]
    assert st["init_from"] == "hunyuanvideo-community/HunyuanVideo" and st["lora"]["enable"] is True
    assert st["flow_shift"] is None  # the repo's scheduler shift (7.0) trains
    assert st["guidance"] == 6.0 and printed["callbacks"]["validation"]["guidance_scale"] == 6.0
    assert printed["training"]["data"]["num_latent_t"] == (printed["training"]["data"]["num_frames"] - 1) // 4 + 1
