"""The HunyuanVideo 1.5 family against the stock diffusers HunyuanVideo15Pipeline, on its tiny model."""

from __future__ import annotations

import pytest
import torch
from family_helpers import preprocess_tiny_clips, run_overrides

CAPTION = "a red circle moving left on a dark background"


@pytest.fixture(scope="module")
def hv15_dir(tiny_model_of):
    return tiny_model_of("hunyuan_video_15")


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


# ---------------------------------------------------------------------------------------------
# The family (fv_accel/models/hunyuan_video_15.py) against the stock pipeline, end to end
# ---------------------------------------------------------------------------------------------

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hv15_data(hv15_dir, tmp_path_factory):
    """The tiny model's dataset: 2 procedural clips of 17 frames at 64x64, preprocessed with its own
    VAE and both text encoders."""
    return preprocess_tiny_clips(hv15_dir, tmp_path_factory.mktemp("hv15-data"))



def student_of(model, **extra):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), {"models.student.init_from": str(model), "callbacks.validation.enable": False, **extra})
    torch.manual_seed(0)
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student


def one_batch(data):
    from fv_accel.data.loader import LatentDataset

    item = LatentDataset(str(data))[(0, 0, 0)]
    return {k: (v[None] if isinstance(v, torch.Tensor) else v) for k, v in item.items()}


def test_family_is_found_and_reads_the_repo(hv15_dir):
    from fv_accel.models import FAMILIES
    from fv_accel.models.hunyuan_video_15 import HunyuanVideo15Student

    student = student_of(hv15_dir)
    assert type(student) is HunyuanVideo15Student is FAMILIES["hunyuan_video_15"]
    assert student.in_channels == 32
    assert student.training_shift(torch.Size([1, 32, 5, 4, 4])) == 5.0  # the repo's scheduler shift
    scale = HunyuanVideo15Student.latent_statistics(str(hv15_dir))
    from diffusers import AutoencoderKLHunyuanVideo15

    vae_scale = AutoencoderKLHunyuanVideo15.load_config(str(hv15_dir), subfolder="vae")["scaling_factor"]
    assert scale == ([0.0] * 32, [1.0 / vae_scale] * 32)
    spec = HunyuanVideo15Student.encoding_spec(str(hv15_dir))
    assert (spec.z_dim, spec.scale_factor_spatial, spec.scale_factor_temporal, spec.patch_size) == (32, 16, 4, (1, 1, 1))
    assert spec.bucket_problem([(64, 64)]) is None and spec.bucket_problem([(64, 72)]) is not None
    from fv_accel.tiny.registry import all_tiny_models

    assert all_tiny_models()["hunyuan_video_15"].layout == "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
    with pytest.raises(ValueError, match="models.student.guidance"):
        student_of(hv15_dir, **{"models.student.guidance": 6.0})


def test_image_to_video_repos_are_refused(hv15_dir, tmp_path):
    """The i2v repos need SigLIP image embeddings and a first-frame condition latent: refused at
    preprocessing and at training, naming the model."""
    import json
    import shutil

    from fv_accel.models.hunyuan_video_15 import HunyuanVideo15Student

    i2v = tmp_path / "i2v"
    shutil.copytree(hv15_dir, i2v, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((i2v / "transformer" / "config.json").read_text())
    (i2v / "transformer" / "config.json").write_text(json.dumps({**config, "task_type": "i2v"}))
    with pytest.raises(ValueError, match="image-to-video model"):
        HunyuanVideo15Student.encoding_spec(str(i2v))
    assert HunyuanVideo15Student.encoding_spec(str(hv15_dir)).conditioning == ("text",)
    (i2v / "transformer" / "diffusion_pytorch_model.safetensors").symlink_to(hv15_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    with pytest.raises(ValueError, match="image-to-video model"):
        student_of(i2v)


def test_encoder_stores_what_the_pipeline_computes(hv15_dir, stock_pipe):
    """encode_caption = the real tokens of the pipeline's own prompt embeddings (both encoders);
    the latent is the VAE's posterior mode."""
    from fv_accel.models.hunyuan_video_15 import HunyuanVideo15Student

    encoder = HunyuanVideo15Student.make_encoder(str(hv15_dir), device=CPU, dtype=torch.float32)
    caption = 'a sign that says "hi" on a red box'
    cols = encoder.encode_caption(caption)
    with torch.no_grad():
        text, mask, text_2, mask_2 = stock_pipe.encode_prompt(prompt=caption, device="cpu", dtype=torch.float32)
    assert torch.allclose(cols["text_embedding"], text[0, : int(mask.sum())], atol=1e-6)
    assert torch.allclose(cols["text_embedding_2"], text_2[0, : int(mask_2.sum())], atol=1e-6)
    assert cols["text_embedding_2"].shape == (12, 16)
    assert encoder.encode_caption(CAPTION)["text_embedding_2"].shape == (0, 16)  # no quoted text
    frames = (torch.rand(17, 64, 64, 3) * 255).to(torch.uint8).numpy()
    latent = encoder.encode_video(frames)
    assert latent.shape == (32, 5, 4, 4)
    video = torch.from_numpy(frames).permute(3, 0, 1, 2)[None].float() / 127.5 - 1.0
    with torch.no_grad():
        assert torch.allclose(latent, stock_pipe.vae.encode(video).latent_dist.mode()[0], atol=1e-6)


def repad(text, mask, length):
    out = torch.zeros(text.shape[0], length, text.shape[2])
    out_mask = torch.zeros(text.shape[0], length)
    for i in range(text.shape[0]):
        real = text[i][mask[i].bool()]
        out[i, : len(real)] = real
        out_mask[i, : len(real)] = 1
    return out, out_mask


def test_forward_is_the_pipelines_transformer_call(hv15_dir, hv15_data, stock_pipe):
    """The family's forward on a loader batch (text padded to 512, one masked image token) gives
    the stock transformer's output on the pipeline's own inputs (text padded to 1000 / 256, the
    729 zero image tokens, zero condition latent and mask)."""
    student = student_of(hv15_dir)
    batch = one_batch(hv15_data)
    cond = student.build_conditioning(batch)
    assert cond.text.shape == (1, 512, 32) and int(cond.text_mask.sum()) == len(batch["caption"].split()) + 5
    assert cond.text_2.shape[-1] == 16 and int(cond.text_2_mask.sum()) == 0  # tiny captions quote nothing
    x0 = student.clean_latents(batch)
    g = torch.Generator().manual_seed(0)
    x_t = torch.randn(x0.shape, generator=g)
    t = torch.tensor([640.0])
    with torch.no_grad():
        ours = student.forward(x_t, t, cond)
        # The pipeline's layout: real tokens first, padded to 1000 (Qwen) and 256 (ByT5).
        text, mask = repad(cond.text, cond.text_mask, 1000)
        text_2, mask_2 = repad(cond.text_2, cond.text_2_mask, 256)
        ref = stock_pipe.transformer(
            hidden_states=torch.cat([x_t, torch.zeros(1, 33, *x_t.shape[2:])], dim=1),
            timestep=t, encoder_hidden_states=text, encoder_attention_mask=mask,
            encoder_hidden_states_2=text_2, encoder_attention_mask_2=mask_2,
            image_embeds=torch.zeros(1, 729, 16), return_dict=False,
        )[0]
    assert ours.shape == x_t.shape
    assert torch.allclose(ours, ref, atol=1e-5), float((ours - ref).abs().max())
    with pytest.raises(ValueError, match="one timestep per sample"):
        student.forward(x_t, torch.full((1, 5), 640.0), cond)


def test_sample_latents_are_the_stock_pipelines(hv15_dir, hv15_data, stock_pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler

    from fv_accel.models.hunyuan_video_15 import HunyuanVideo15Student

    student = student_of(hv15_dir)
    cond = student.build_conditioning(one_batch(hv15_data))
    vae = HunyuanVideo15Student.load_vae(str(hv15_dir))
    kw = dict(height=64, width=64, num_frames=17, num_inference_steps=2)
    with torch.no_grad():
        scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(hv15_dir, subfolder="scheduler")
        ours = student.sample_latents(
            vae, cond, None, guidance_scale=6.0, scheduler=scheduler, generator=torch.Generator().manual_seed(3), **kw
        )
        neg = cond.unconditional()
        ref = stock_pipe(
            prompt_embeds=cond.text, prompt_embeds_mask=cond.text_mask, prompt_embeds_2=cond.text_2,
            prompt_embeds_mask_2=cond.text_2_mask, negative_prompt_embeds=neg.text,
            negative_prompt_embeds_mask=neg.text_mask, negative_prompt_embeds_2=neg.text_2,
            negative_prompt_embeds_mask_2=neg.text_2_mask, generator=torch.Generator().manual_seed(3),
            output_type="latent", return_dict=False, **kw,
        )[0]
    assert ours.shape == (1, 32, 5, 4, 4)
    assert torch.allclose(ours, ref.float(), atol=1e-5)
    video = HunyuanVideo15Student.decode(vae, ours / vae.config.scaling_factor)
    assert video.shape == (1, 3, 17, 64, 64)


def test_full_finetune_saves_a_transformer_the_stock_pipeline_runs(tmp_path, hv15_dir, hv15_data, stock_pipe):
    from diffusers import HunyuanVideo15Transformer3DModel

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    Trainer(build_from_config(default_recipe("finetune"), run_overrides(tmp_path, hv15_dir, hv15_data))).run()
    saved = HunyuanVideo15Transformer3DModel.from_pretrained(str(tmp_path / "out"), subfolder="transformer")
    base = HunyuanVideo15Transformer3DModel.from_pretrained(str(hv15_dir), subfolder="transformer")
    changed = [k for k, v in base.state_dict().items() if not torch.equal(v, saved.state_dict()[k])]
    assert changed and any(k.startswith("transformer_blocks.") for k in changed)
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(hv15_dir), transformer=saved)
    pipe.set_progress_bar_config(disable=True)
    frames = pipe(prompt=CAPTION, num_frames=17, height=64, width=64, num_inference_steps=1,
                  generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (1, 17, 64, 64, 3)


def test_lora_finetune_loads_into_the_stock_pipelines_transformer(tmp_path, hv15_dir, hv15_data):
    from diffusers import DiffusionPipeline

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    from fv_accel.models.hunyuan_video_15 import HunyuanVideo15Student

    # The family's targets: both streams of the joint attention (as the real recipe).
    targets = list(HunyuanVideo15Student.lora_target_modules)
    over = run_overrides(tmp_path, hv15_dir, hv15_data, **{"models.student.lora.enable": True, "models.student.lora.target_modules": targets})
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    lora_file = tmp_path / "out" / "pytorch_lora_weights.safetensors"
    assert lora_file.is_file()
    pipe = DiffusionPipeline.from_pretrained(str(hv15_dir))
    pipe.set_progress_bar_config(disable=True)
    before = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.transformer.load_lora_adapter(str(tmp_path / "out"), weight_name=lora_file.name, prefix="transformer", adapter_name="trained")
    pipe.transformer.fuse_lora(lora_scale=1.0, adapter_names=["trained"])
    pipe.transformer.unload_lora()
    after = pipe.transformer.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert any("transformer_blocks.0.attn.to_q" in k for k in changed), changed[:5]
    assert any("add_k_proj" in k for k in changed)
    frames = pipe(prompt=CAPTION, num_frames=17, height=64, width=64, num_inference_steps=1,
                  generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (1, 17, 64, 64, 3)


def test_dfsft_is_refused_with_one_line(tmp_path, hv15_dir, hv15_data):
    from resume_helpers import build_fails

    text = build_fails("dfsft", run_overrides(tmp_path, hv15_dir, hv15_data), ValueError, "the hunyuan_video_15 family cannot take a timestep per latent frame")
    assert "HunyuanVideo15Transformer3DModel takes one timestep per sample" in text


@pytest.mark.parametrize("name", ["hunyuan_video_15_480p_t2v_lora", "hunyuan_video_15_480p_t2v_sft"])
def test_recipe_dry_run(name):
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "train_finetune.py", "--config", f"configs/{name}.yaml", "--dry-run"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    st = yaml.safe_load(out.stdout)["models"]["student"]
    assert st["init_from"] == "hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v"
    assert st["flow_shift"] is None  # the repo's scheduler shift (5.0) trains
    assert st["lora"]["enable"] is name.endswith("_lora")
