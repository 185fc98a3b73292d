"""The Kandinsky 5 family on its tiny models (fv_accel/tiny/kandinsky5.py), against the stock diffusers
Kandinsky5T2VPipeline / Kandinsky5I2VPipeline, offline."""

from __future__ import annotations

import json

import pytest
import torch
from family_helpers import CPU, preprocess_tiny_clips, run_overrides

CAPTION = "a red ball moving left"


@pytest.fixture(scope="module")
def k5_dir(tiny_model_of):
    return tiny_model_of("kandinsky5")


@pytest.fixture(scope="module")
def k5_pipe(k5_dir):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(k5_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def k5_data(k5_dir, tmp_path_factory):
    """The tiny Kandinsky 5 model's dataset: 2 clips of 17 frames at 64x64."""
    return preprocess_tiny_clips(k5_dir, tmp_path_factory.mktemp("k5_data"))


@pytest.fixture(scope="module")
def k5_i2v_data(tiny_model_of, tmp_path_factory):
    """The tiny image-to-video model and its dataset (2 clips of 17 frames at 64x64, their first frames stored)."""
    model = tiny_model_of("kandinsky5_i2v")
    return model, preprocess_tiny_clips(model, tmp_path_factory.mktemp("k5_i2v_data"))


def k5_student(model, data, tmp_path, **extra):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), run_overrides(tmp_path, model, data, **extra))
    torch.manual_seed(0)
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student


def generate(pipe, **call):
    return pipe(
        prompt=CAPTION, height=64, width=64, num_frames=call.pop("num_frames", 17), num_inference_steps=2,
        output_type="np", generator=torch.Generator().manual_seed(0), **call,
    ).frames


def test_tiny_model_has_the_real_repo_layout_and_the_stock_pipeline_makes_17_frames(k5_dir, k5_pipe):
    from diffusers import Kandinsky5T2VPipeline

    index = json.loads((k5_dir / "model_index.json").read_text())
    assert index["_class_name"] == "Kandinsky5T2VPipeline"
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    assert index["text_encoder_2"] == ["transformers", "CLIPTextModel"]
    assert index["tokenizer_2"] == ["transformers", "CLIPTokenizer"]
    assert index["vae"] == ["diffusers", "AutoencoderKLHunyuanVideo"]
    assert json.loads((k5_dir / "scheduler" / "scheduler_config.json").read_text())["shift"] == 5.0
    config = k5_pipe.transformer.config
    assert config.visual_cond and config.attention_type == "regular" and tuple(config.patch_size) == (1, 2, 2)
    assert config.in_visual_dim == config.out_visual_dim == 16
    assert isinstance(k5_pipe, Kandinsky5T2VPipeline)
    # The template before the caption is the pipeline's 128 cropped tokens: the caption's tokens remain.
    tok = k5_pipe.tokenizer
    assert len(tok(k5_pipe.prompt_template.split("{}")[0]).input_ids) == k5_pipe.prompt_template_encode_start_idx == 128
    ids = tok(k5_pipe.prompt_template.format(CAPTION)).input_ids
    assert tok.convert_ids_to_tokens(ids[128:]) == ["a", " red", " ball", " moving", " left", "<|im_end|>"]
    frames = generate(k5_pipe)
    assert frames.shape == (1, 17, 64, 64, 3) and float(frames.std()) > 0.0


def test_the_i2v_tiny_model_runs_in_the_stock_image_to_video_pipeline(tiny_model_of):
    from diffusers import DiffusionPipeline, Kandinsky5I2VPipeline
    from PIL import Image

    pipe = DiffusionPipeline.from_pretrained(tiny_model_of("kandinsky5_i2v"))
    pipe.set_progress_bar_config(disable=True)
    assert isinstance(pipe, Kandinsky5I2VPipeline)
    image = Image.new("RGB", (64, 64), (200, 30, 30))
    # 17 frames: the pipeline's first-frame normalisation reads latent frames 4 and on (NaN with fewer).
    frames = generate(pipe, image=image)
    assert frames.shape == (1, 17, 64, 64, 3) and float(frames.std()) > 0.0


def test_preprocessing_stores_both_text_encoders_as_the_pipeline_computes_them(k5_pipe, k5_data):
    import pyarrow.parquet as pq

    from fv_accel.data.schema import read_dataset_info, read_tensor_column

    rows = [r for f in sorted(k5_data.glob("data-*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 2
    scaling = k5_pipe.vae.config.scaling_factor
    info = read_dataset_info(k5_data)
    assert info["latents_mean"] == [0.0] * 16 and info["latents_std"] == pytest.approx([1 / scaling] * 16)
    for row in rows:
        assert tuple(read_tensor_column(row, "vae_latent").shape) == (16, 5, 8, 8)  # (17 - 1) / 4 + 1, 64 / 8
        text = read_tensor_column(row, "text_embedding")
        embeds, pooled, cu_seqlens = k5_pipe.encode_prompt(prompt=row["caption"], device=CPU)
        n = int(cu_seqlens[1])
        assert text.shape == (n, 32) and n == len(k5_pipe.tokenizer(row["caption"]).input_ids) + 1  # + <|im_end|>
        torch.testing.assert_close(text, embeds[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(read_tensor_column(row, "pooled_text_embedding"), pooled[0], rtol=0, atol=1e-6)


def test_family_forward_is_the_pipelines_call_per_prompt_and_one_timestep_per_sample(k5_dir, k5_pipe, k5_data, tmp_path):
    """Two prompts of different lengths in one batch give each the output of its own single-prompt
    pipeline call (no padding reaches the transformer, which takes no text mask)."""
    from fv_accel.models.kandinsky5 import Kandinsky5Student

    student = k5_student(k5_dir, k5_data, tmp_path)
    assert isinstance(student, Kandinsky5Student) and student.task == "t2v" and student.in_channels == 16
    assert student.training_shift(torch.Size([1, 16, 5, 8, 8])) == 5.0  # the repo's scheduler shift
    torch.testing.assert_close(student.latents_std.flatten(), torch.full((16,), 1 / k5_pipe.vae.config.scaling_factor))
    g = torch.Generator().manual_seed(1)
    x_t = torch.randn(2, 16, 5, 8, 8, generator=g)
    t = torch.tensor([900.0, 250.0])
    prompts = ["a red ball", "the blue square moving slowly left"]
    encoded = [k5_pipe.encode_prompt(prompt=p, device=CPU) for p in prompts]
    text, text_mask = torch.zeros(2, 512, 32), torch.zeros(2, 512, dtype=torch.long)  # as the loader pads
    for i, (embeds, _, _) in enumerate(encoded):
        text[i, : embeds.shape[1]], text_mask[i, : embeds.shape[1]] = embeds[0], 1
    pooled_batch = torch.cat([e[1] for e in encoded])
    batch = {"text_embedding": text, "text_attention_mask": text_mask, "pooled_text_embedding": pooled_batch}
    cond = student.build_conditioning(batch)
    student.transformer.eval()
    with torch.no_grad():
        out = student.forward(x_t, t, cond)
        for i, (embeds, pooled, _) in enumerate(encoded):
            hidden = torch.cat([x_t[i : i + 1].permute(0, 2, 3, 4, 1), torch.zeros(1, 5, 8, 8, 17)], dim=-1)
            ref = k5_pipe.transformer(
                hidden_states=hidden, encoder_hidden_states=embeds, pooled_projections=pooled, timestep=t[i : i + 1],
                visual_rope_pos=[torch.arange(5), torch.arange(4), torch.arange(4)],
                text_rope_pos=torch.arange(embeds.shape[1]),
                scale_factor=(1, 3.16, 3.16), sparse_params=None,
            ).sample
            torch.testing.assert_close(out[i : i + 1], ref.permute(0, 4, 1, 2, 3), rtol=0, atol=1e-6)
        uncond = student.forward(x_t, t, cond.unconditional())
        assert (uncond - out).abs().max() > 1e-3  # the text reaches the output
        torch.testing.assert_close(student.forward(x_t, t[:, None].expand(2, 5), cond), out)  # constant per frame
    with pytest.raises(ValueError, match="one timestep per sample"):
        student.forward(x_t, torch.tensor([[900.0] * 4 + [100.0]] * 2), cond)


def test_nabla_attention_another_task_and_dfsft_are_refused_in_one_line(k5_dir, k5_data, tmp_path):
    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe

    student = k5_student(k5_dir, k5_data, tmp_path)
    with pytest.raises(ValueError, match=r"attention_type 'nabla' .* not supported by the kandinsky5 family") as err:
        student.configure({"attention_type": "nabla", "visual_cond": True})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"task is i2v but model '.*' is a t2v repo \(Kandinsky5T2VPipeline") as err:
        k5_student(k5_dir, k5_data, tmp_path, **{"models.student.task": "i2v"})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError) as err:
        build_from_config(default_recipe("dfsft"), run_overrides(tmp_path, k5_dir, k5_data, **{"method.chunk_size": 2}))
    assert "\n" not in str(err.value) and "kandinsky5" in str(err.value) and "one timestep per sample" in str(err.value)


@pytest.mark.parametrize("task", ["t2v", "i2v"])
def test_lora_training_writes_what_the_stock_pipeline_loads_and_the_merged_export(
    k5_dir, k5_data, k5_i2v_data, tmp_path, task
):
    """3 LoRA steps (image-to-video: the first latent frame clean): the stock pipeline's
    `load_lora_weights` takes the file and its video changes; `fv_accel.export --to merged` writes the
    same weights folded into the base transformer."""
    from diffusers import DiffusionPipeline, Kandinsky5Transformer3DModel
    from PIL import Image

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.export import export_merged, find_source
    from fv_accel.trainer import Trainer

    model, data = (k5_dir, k5_data) if task == "t2v" else k5_i2v_data
    run = build_from_config(default_recipe("finetune"), run_overrides(tmp_path, model, data, **{
        "models.student.lora.enable": True, "training.loop.max_train_steps": 3, "training.optimizer.lr_warmup_steps": 0,
    }))
    assert run.method.student.task == task
    if task == "i2v":  # the clips keep their first frame, the image sample videos start from
        import pyarrow.parquet as pq

        assert "pil_image_bytes" in pq.read_schema(next(data.glob("data-*.parquet"))).names
    assert Trainer(run).run()["steps"] == 3
    out = tmp_path / "out"
    pipe = DiffusionPipeline.from_pretrained(model)
    pipe.set_progress_bar_config(disable=True)
    call = {"image": Image.new("RGB", (64, 64), (200, 30, 30))} if task == "i2v" else {"num_frames": 5}
    before = generate(pipe, **dict(call))
    base = {k: v.clone() for k, v in pipe.transformer.state_dict().items()}
    pipe.load_lora_weights(str(out), adapter_name="trained")
    after = generate(pipe, **dict(call))
    assert float(abs(after.astype("float64") - before).max()) > 1e-4
    pipe.fuse_lora(components=["transformer"], lora_scale=1.0)
    pipe.unload_lora_weights()
    fused = pipe.transformer.state_dict()
    changed = {k for k in base if not torch.equal(base[k], fused[k])}
    assert any("visual_transformer_blocks.0.self_attention.to_query" in k for k in changed)
    assert any("cross_attention.out_layer" in k for k in changed)
    assert all(k.endswith(("to_query.weight", "to_key.weight", "to_value.weight", "out_layer.weight")) for k in changed)
    (written,) = export_merged(find_source(out), tmp_path / "merged")
    merged = Kandinsky5Transformer3DModel.from_pretrained(str(written)).state_dict()
    for k in base:
        torch.testing.assert_close(merged[k], fused[k], rtol=0, atol=1e-5)


def test_dmd2_distils_a_kandinsky5_teacher(k5_dir, k5_data, tmp_path):
    """DMD2 with Kandinsky 5 roles (teacher guidance 4.5 against the stored negative prompt): one step
    of simulated rollout moves the student and the critic."""
    from dmd2_helpers import DMD2_RECIPE, dmd2_overrides

    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer

    run = build_from_config(DMD2_RECIPE, dmd2_overrides(tmp_path, **{
        "models.teacher.init_from": str(k5_dir), "models.teacher.transformer_config": None,
        "training.data.data_path": str(k5_data), "training.data.train_batch_size": 1, "training.data.text_max_length": 512,
        "method.generator_update_interval": 1, "method.real_score_guidance_scale": 4.5, "training.loop.max_train_steps": 1,
        "training.optimizer.learning_rate": 1e-2, "method.fake_score_learning_rate": 1e-2,
        "training.checkpoint.save_final": False,
    }))
    assert {type(getattr(run.method, r)).__name__ for r in ("student", "teacher", "critic")} == {"Kandinsky5Student"}
    before = {
        r: {k: v.clone() for k, v in getattr(run.method, r).transformer.state_dict().items()} for r in ("student", "critic")
    }
    assert Trainer(run).run()["skipped_steps"] == 0
    for role, weights in before.items():
        after = getattr(run.method, role).transformer.state_dict()
        assert max(float((after[k] - v).abs().max()) for k, v in weights.items()) > 0, role


RECIPES = [
    ("kandinsky5_t2v_lite_lora", "finetune"), ("kandinsky5_t2v_lite_sft", "finetune"), ("kandinsky5_t2v_lite_dmd2", "dmd2"),
]


@pytest.mark.parametrize("recipe,method", RECIPES)
def test_the_recipes_resolve_and_dry_run_with_a_memory_estimate(recipe, method, capsys, monkeypatch):
    from pathlib import Path

    import yaml

    from fv_accel.cli import main

    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(method, ["--config", f"configs/{recipe}.yaml", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "# memory estimate per process" in out  # offline: the repo's published architecture
    printed = yaml.safe_load(out)
    role = printed["models"]["teacher" if method == "dmd2" else "student"]
    data, optimizer = printed["training"]["data"], printed["training"]["optimizer"]
    assert role["init_from"] == "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers" and role["flow_shift"] == 5.0
    assert (data["num_height"], data["num_width"], data["num_frames"], data["num_latent_t"]) == (512, 768, 121, 31)
    if method == "dmd2":
        m = printed["method"]
        steps = (m["dmd_denoising_steps"], m["generator_update_interval"], m["real_score_guidance_scale"])
        assert steps == ([1000, 750, 500, 250], 5, 4.5)
        rates = (m["fake_score_learning_rate"], optimizer["learning_rate"], optimizer["betas"])
        assert rates == (8.0e-6, 2.0e-6, [0.0, 0.999])
        return
    lora = printed["models"]["student"]["lora"]["enable"]
    assert lora is recipe.endswith("_lora")
    assert data["training_cfg_rate"] == 0.1 and optimizer["weight_decay"] == 1.0e-4
    assert optimizer["learning_rate"] == (1.0e-4 if lora else 5.0e-5)
