"""Sample videos are what the pipeline makes: validation steps with the model repo's own scheduler
class at its own shift (`callbacks.validation.scheduler`, `sampling_flow_shift`;
docs/validation-sampling.md), and says what it steps with."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from test_validation import build, callback_of, validation_overrides

def sampled(run, caplog):
    """(trainer, video callback, latents of its first prompt) after the callback's start."""
    from fv_accel.trainer import Trainer
    from fv_accel.validation import VideoSamplingCallback, evaluation_mode

    trainer = Trainer(run)
    cb = callback_of(run, VideoSamplingCallback)
    with caplog.at_level(logging.INFO, logger="fv_accel.validation"):
        cb.on_train_start(trainer)  # at_start is off: loads the VAE, encodes the prompts, logs
    with evaluation_mode(trainer) as student:
        latents = cb._sample_latents(trainer, student, cb.prompts[0])
    return trainer, cb, latents


def stock_wan_pipeline(trainer, cb):
    """The stock WanPipeline loaded from the model folder (its own scheduler) around the student's
    transformer."""
    from diffusers import WanPipeline

    transformer = trainer.accelerator.unwrap_model(trainer.method.student.transformer).eval()
    pipe = WanPipeline.from_pretrained(cb.model_source, transformer=transformer)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def stock_latents(pipe, cb):
    """The pipeline's latents for the callback's first prompt: its embeddings, size, steps, seed."""
    p = cb.prompts[0]
    with torch.no_grad():
        out = pipe(
            prompt_embeds=cb.embeddings[p.prompt]["text_embedding"],
            negative_prompt_embeds=cb.embeddings[p.negative_prompt]["text_embedding"],
            height=p.height, width=p.width, num_frames=p.num_frames, num_inference_steps=p.sampling_steps,
            guidance_scale=p.guidance_scale, generator=torch.Generator().manual_seed(p.seed), output_type="latent",
            return_dict=False,
        )[0]
    return out.float()


def test_samples_are_the_stock_pipeline_with_the_repo_unipc_scheduler_and_euler_is_the_old_sampler(tmp_path, caplog):
    import dataclasses

    from fv_accel.models import WanStudent
    from fv_accel.sampling import sample_with_scheduler, sampling_scheduler
    from fv_accel.validation import evaluation_mode, repo_sampling_schedule

    over = validation_overrides(tmp_path, **{"callbacks.validation.heldout_fraction": 0.0})
    trainer, cb, latents = sampled(build("finetune", over), caplog)
    assert "sample videos: whole clips through the wan family's diffusers pipeline" in caplog.text
    assert "UniPCMultistepScheduler at flow_shift 3 (the repo's scheduler config" in caplog.text
    assert "training shift 3.0 (models.student.flow_shift" in caplog.text
    pipe = stock_wan_pipeline(trainer, cb)
    assert type(pipe.scheduler).__name__ == "UniPCMultistepScheduler"  # the real Wan repos' scheduler
    stock = stock_latents(pipe, cb)
    assert (latents - stock).abs().max() <= 1e-5

    # The whole-clip loop over the student (SkyReels-V2 and Wan 2.1 I2V students sample with it) is
    # the same pipeline step for step.
    p = cb.prompts[0]
    student = trainer.method.student
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(p.seed))
    text, negative = (student.build_conditioning(cb.embeddings[k]) for k in (p.prompt, p.negative_prompt))
    with torch.no_grad():
        looped = sample_with_scheduler(
            student.forward, noise, text, cb.schedule.build(),
            num_inference_steps=p.sampling_steps, guidance_scale=p.guidance_scale, negative_text=negative,
        )
    assert (looped - stock).abs().max() <= 1e-5

    # `scheduler: euler` is the sampler validation had before: FlowMatchEulerDiscreteScheduler at shift 3.
    cb.schedule = repo_sampling_schedule(cb.model_source, dataclasses.replace(cb.val, scheduler="euler"), WanStudent)
    assert cb.schedule.describe().startswith("FlowMatchEulerDiscreteScheduler at shift 3 (Euler in place of UniPC")
    with evaluation_mode(trainer) as live:
        euler = cb._sample_latents(trainer, live, p)
    pipe.scheduler = sampling_scheduler(3.0)
    assert (euler - stock_latents(pipe, cb)).abs().max() <= 1e-5
    # The two schedulers' samples differ by far more than the tolerance (the issue's gap).
    assert (euler - latents).abs().max() > 1e-2


@pytest.mark.parametrize(
    "name, shift", [("wan21_t2v", 3.0), ("wan21_i2v", 3.0), ("wan22_ti2v", 5.0), ("wan22_t2v_a14b", 3.0),
                    ("wan22_i2v_a14b", 3.0), ("skyreels_v2", 8.0)],
)
def test_a_null_sampling_shift_is_the_tiny_wan_repos_unipc_shift(name, shift):
    """The tiny Wan models ship the real repos' scheduler (UniPC with flow sigmas, diffusers' Wan
    conversion script's flow_shift); `sampling_flow_shift: null` takes it, a number overrides it."""
    from fv_accel.sampling import resolve_sampling_schedule
    from fv_accel.tiny.model import build_scheduler, tiny_variant

    config = json.loads(build_scheduler(tiny_variant(name)).to_json_string())  # scheduler_config.json as written
    assert config["_class_name"] == "UniPCMultistepScheduler"
    assert (config["prediction_type"], config["use_flow_sigmas"]) == ("flow_prediction", True)
    repo = resolve_sampling_schedule(config)
    assert (repo.class_name, repo.config["flow_shift"], repo.euler_shift(0)) == ("UniPCMultistepScheduler", shift, shift)
    euler = resolve_sampling_schedule(config, scheduler="euler")
    assert (euler.class_name, euler.config["shift"]) == ("FlowMatchEulerDiscreteScheduler", shift)
    assert resolve_sampling_schedule(config, shift=7.5).build().config.flow_shift == 7.5


def test_resolution_dependent_and_karras_repos_keep_their_rule_and_a_number_overrides_it():
    from fv_accel.sampling import resolve_sampling_schedule
    from fv_accel.tiny.ltx_video import LTX_SCHEDULER_CONFIG

    ltx = {"_class_name": "FlowMatchEulerDiscreteScheduler", **LTX_SCHEDULER_CONFIG}
    schedule = resolve_sampling_schedule(ltx)
    assert schedule.dynamic and schedule.build().config.shift_terminal == LTX_SCHEDULER_CONFIG["shift_terminal"]
    assert resolve_sampling_schedule(ltx, scheduler="euler") == schedule  # already the Euler class
    fixed = resolve_sampling_schedule(ltx, shift=4.0)
    assert not fixed.dynamic and fixed.euler_shift(10_000) == 4.0
    karras = resolve_sampling_schedule(None, fallback_config={"_class_name": "FlowMatchEulerDiscreteScheduler",
                                                               "use_karras_sigmas": True})
    assert karras.config["use_karras_sigmas"] and "has no scheduler config" in karras.origin
    with pytest.raises(ValueError, match="'NotAScheduler' is not a diffusers scheduler"):
        resolve_sampling_schedule({"_class_name": "NotAScheduler"}, origin="m/scheduler/scheduler_config.json")


def test_the_diffusion_forcing_sampler_says_it_steps_with_euler_at_the_repo_shift(tmp_path, tiny_data_path):
    """What the log at start says (`describe_sampler`) for a DFSFT student of the tiny Wan model."""
    from types import SimpleNamespace

    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import WanStudent
    from fv_accel.validation import VideoSamplingCallback, repo_sampling_schedule

    cfg = load_config(default_recipe("dfsft"), validation_overrides(tmp_path))
    cb = VideoSamplingCallback(cfg, tiny_data_path)
    cb.schedule = repo_sampling_schedule(cb.model_source, cb.val, WanStudent)
    trainer = SimpleNamespace(method=SimpleNamespace(chunk_size=3, student=SimpleNamespace(family="wan")))
    text = cb.describe_sampler(trainer)
    assert text.startswith(
        "the diffusion-forcing sampler (fv_accel.sampling; chunks of 3 latent frames, ar_step None) steps each chunk "
        "with Euler on FlowMatchEulerDiscreteScheduler's sigmas at shift 3, the shift of UniPCMultistepScheduler"
    )
    assert text.endswith("UniPCMultistepScheduler itself is not used for chunk-by-chunk sampling")


def test_a_bad_sampling_shift_is_one_line_naming_the_key():
    from fv_accel.config import default_recipe, load_config

    with pytest.raises(ValueError, match="callbacks.validation.sampling_flow_shift"):
        load_config(default_recipe("finetune"), {"callbacks.validation.sampling_flow_shift": 0})
    with pytest.raises(ValueError, match="callbacks.validation.scheduler"):
        load_config(default_recipe("finetune"), {"callbacks.validation.scheduler": "unipc"})
