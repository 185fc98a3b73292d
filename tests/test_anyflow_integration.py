"""The AnyFlow chain as the docs run it, on tiny models: a flow-map student made from a teacher's run
folder (a transformer/ without vae/, as outputs/tiny_dmd2_teacher is) and trained on the built-in tiny
data, pretrained, then distilled on-policy. Each output folder is an AnyFlowPipeline folder that stock
diffusers samples (in a subprocess without fv_accel) as our validation sampler does, and
`python -m fv_accel.generate` samples the on-policy run at its trained steps and at any --steps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_overrides
from dmd2_helpers import DMD2_RECIPE, TINY_TEACHER, dmd2_overrides
from test_family_anyflow import STOCK_SAMPLER

REPO = Path(__file__).resolve().parents[1]
PRETRAIN_RECIPE = str(REPO / "configs" / "tiny_finetune.yaml")
T_LIST = [1000.0, 900.0, 750.0, 500.0, 0.0]  # FlowMapEulerDiscreteScheduler's 4 steps at shift 3
PROMPT = "a red circle moving left on a black background"
TEXT_LENGTH = 16
STEPS, SIZE, FRAMES, SEED = [1, 2, 4], 32, 17, 3


def build(recipe, overrides):
    from fv_accel import build_from_config

    run = build_from_config(recipe, overrides)
    if run.output_lock is not None:
        run.output_lock.release()
    return run


def teacher_run_folder(folder: Path) -> Path:
    """A teacher's run folder as a finetune run leaves it: transformer/ only (no vae/, no model_index.json)."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    WanTransformer3DModel(**TINY_TEACHER).save_pretrained(folder / "transformer")
    return folder


def without_inline_student(overrides: dict) -> dict:
    return {k: v for k, v in overrides.items() if not k.startswith("models.student.transformer_config")}


@pytest.fixture(scope="module")
def chain(tmp_path_factory, _cache_dir):
    """(pretrain run, on-policy run): 1 pretraining step of a student made from the teacher's run
    folder, then 2 on-policy steps of it (the student updated at both) against that teacher."""
    from fv_accel import Trainer

    root = tmp_path_factory.mktemp("anyflow_chain")
    teacher = teacher_run_folder(root / "teacher")
    common = {"training.data.text_max_length": TEXT_LENGTH, "models.student.flow_shift": 3.0}
    pre = build(PRETRAIN_RECIPE, without_inline_student(tiny_overrides(root / "pre", **{
        **common, "method.name": "anyflow_pretrain", "models.student.init_from": str(teacher),
        "models.student.anyflow_from_wan": True, "training.loop.max_train_steps": 1,
        "training.checkpoint.training_state_checkpointing_steps": 1})))
    Trainer(pre).run()
    on = build(DMD2_RECIPE, dmd2_overrides(root / "on", **{
        **common, "method.name": "anyflow", "method.dmd_denoising_steps": None, "method.t_list_override": T_LIST,
        "method.generator_update_interval": 1, "models.student.init_from": str(root / "pre" / "out"),
        "models.teacher.init_from": str(teacher), "models.teacher.transformer_config": None,
        "training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 2}))
    Trainer(on).run()
    return pre, on


def data_path_of(cfg) -> str:
    from fv_accel.tiny import tiny_dataset

    return str(tiny_dataset(cfg.training.data, run_cfg=cfg))


def validation_latents(run) -> dict[int, torch.Tensor]:
    """Our validation sampler (VideoSamplingCallback._sample_latents) on the run's student, seed SEED."""
    import dataclasses
    import types

    from fv_accel.validation import SamplePrompt, VideoSamplingCallback

    callback = VideoSamplingCallback(run.config, data_path_of(run.config))
    method = types.SimpleNamespace(chunk_size=None, student=run.method.student)
    trainer = types.SimpleNamespace(accelerator=types.SimpleNamespace(device=torch.device("cpu")), method=method)
    callback.prompts = [SamplePrompt(prompt=PROMPT, negative_prompt="", height=SIZE, width=SIZE, num_frames=FRAMES,
                                     sampling_steps=1, guidance_scale=1.0, seed=SEED, name="p")]
    callback._load(trainer)
    with torch.no_grad():
        return {n: callback._sample_latents(trainer, run.method.student, dataclasses.replace(callback.prompts[0], sampling_steps=n))
                for n in STEPS}


def stock_latents(jobs: dict) -> dict[str, torch.Tensor]:
    proc = subprocess.run(
        [sys.executable, "-c", STOCK_SAMPLER, json.dumps(jobs), json.dumps(STEPS), str(SIZE), str(FRAMES),
         str(TEXT_LENGTH), PROMPT],
        capture_output=True, text=True, timeout=300, env={"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "PATH": ""},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    marker, payload = proc.stdout.strip().splitlines()[-2:]
    assert marker == "FV_ACCEL_ABSENT"
    return {k: torch.tensor(v) for k, v in json.loads(payload).items()}


def generated_latents(run_dir: Path, tmp_path: Path, monkeypatch, *extra: str) -> torch.Tensor:
    """The latents `python -m fv_accel.generate RUN` decodes into its mp4 (seed SEED, SIZE, FRAMES)."""
    import fv_accel.generate as generate

    seen = []
    original = generate._write_whole

    def keep(loaded, latents, writer, start):
        seen.append(latents.detach().clone())
        return original(loaded, latents, writer, start)

    monkeypatch.setattr(generate, "_write_whole", keep)
    out = tmp_path / f"gen{len(list(tmp_path.glob('*.mp4')))}.mp4"
    argv = [str(run_dir), "--prompt", PROMPT, "--num_frames", str(FRAMES), "--height", str(SIZE), "--width", str(SIZE),
            "--seed", str(SEED), "--output", str(out), "--device", "cpu", *extra]
    assert generate.main(argv) == 0
    assert out.is_file() and len(seen) == 1
    return seen[0]


@pytest.mark.slow
def test_the_documented_chain_from_a_teacher_run_folder_loads_in_the_stock_pipeline(chain, tmp_path, monkeypatch, capsys):
    """Both stages' folders (student made from a run folder without vae/, tiny data) are complete
    AnyFlowPipeline folders: model_index.json, the tiny data's VAE, text encoder and tokenizer, the
    flow-map scheduler at the training shift. Stock diffusers gives our validation sampler's latents at
    1, 2 and 4 steps (1e-4); generate gives the stock pipeline's at --steps 2 and, without --steps, at
    the on-policy student's 4 trained steps."""
    pre, on = chain
    pre_out, on_out = Path(pre.config.training.checkpoint.output_dir), Path(on.config.training.checkpoint.output_dir)
    data_model = json.loads((Path(data_path_of(pre.config)) / "fv_dataset.json").read_text())["model"]
    for out in (pre_out, on_out):
        index = json.loads((out / "model_index.json").read_text())
        assert index["_class_name"] == "AnyFlowPipeline" and index["transformer"][1] == "AnyFlowTransformer3DModel"
        for part in ("vae", "text_encoder", "tokenizer"):
            theirs = sorted(p.name for p in (Path(data_model) / part).iterdir())
            assert sorted(p.name for p in (out / part).iterdir()) == theirs, (out, part)
        scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
        assert scheduler["_class_name"] == "FlowMapEulerDiscreteScheduler" and scheduler["shift"] == 3.0
    ours = {"pre": validation_latents(pre), "on": validation_latents(on)}
    theirs = stock_latents({"pre": [str(pre_out), None], "on": [str(on_out), None]})
    for name in ("pre", "on"):
        for n in STEPS:
            stock = theirs[f"{name}/{n}"].reshape(ours[name][n].shape)
            assert float((stock - ours[name][n]).abs().max()) <= 1e-4, (name, n)
        assert float((ours[name][1] - ours[name][4]).abs().max()) > 1e-3  # the step count matters
    assert float((ours["pre"][2] - ours["on"][2]).abs().max()) > 1e-6  # the on-policy steps moved the student
    own = generated_latents(on_out, tmp_path, monkeypatch)
    assert "its 4 trained flow-map steps [1000.0, 900.0, 750.0, 500.0]" in capsys.readouterr().out
    two = generated_latents(on_out, tmp_path, monkeypatch, "--steps", "2")
    assert "2 flow-map steps of FlowMapEulerDiscreteScheduler at shift 3" in capsys.readouterr().out
    assert float((own - theirs["on/4"].reshape(own.shape)).abs().max()) <= 1e-4
    assert float((two - theirs["on/2"].reshape(two.shape)).abs().max()) <= 1e-4


def test_generate_samples_an_on_policy_student_at_its_own_timesteps(tmp_path):
    """student_steps.json of an on-policy AnyFlow run is read as the flow map's steps (even beside the
    run's scheduler/): its timesteps are given to the pipeline as custom timesteps, which the stock
    scheduler (shifting custom timesteps again) then steps exactly; another record is refused in one line."""
    from diffusers import FlowMapEulerDiscreteScheduler

    from fv_accel.generate import FlowMapSteps, GenerateError, _flow_map_steps
    from fv_accel.models.anyflow import pipeline_timesteps

    record = {"method": "anyflow", "timesteps": [999.0, 937.0, 833.0, 624.0, 0.0], "sigmas": [0.999, 0.937, 0.833, 0.624],
              "student_sample_type": "flow_map", "use_mean_velocity": False}
    path = tmp_path / "student_steps.json"
    path.write_text(json.dumps(record))
    steps = _flow_map_steps(path)
    assert steps == FlowMapSteps(record["timesteps"], False, str(path))
    scheduler = FlowMapEulerDiscreteScheduler(shift=5.0)
    scheduler.set_timesteps(4, timesteps=pipeline_timesteps(steps.timesteps, 5.0))
    torch.testing.assert_close(scheduler.sigmas * 1000, torch.tensor(record["timesteps"], dtype=torch.float64))
    path.write_text(json.dumps({**record, "student_sample_type": "sde"}))
    assert _flow_map_steps(path) is None  # a DMD2 student's steps: generate's FewSteps
    path.write_text(json.dumps({**record, "timesteps": [999.0, 500.0]}))
    with pytest.raises(GenerateError, match="student_steps.json: flow-map timesteps .* must end at 0"):
        _flow_map_steps(path)


def test_generate_streams_a_far_student_chunk_by_chunk(tiny_model_of, tmp_path):
    """An AnyFlow-FAR model: generate writes each chunk of its layout (17 frames: 1, 2 and 2 latent
    frames) into the growing <output>.partial as soon as AnyFlowFARPipeline has finished it, and the
    chunks are the stock pipeline's latents for the same seed, prompt and steps (1e-5)."""
    from diffusers import AnyFlowFARPipeline

    from fv_accel.config import default_recipe, load_config
    from fv_accel.generate import build_parser, generate

    far_dir = tiny_model_of("anyflow_far")
    out, partial = tmp_path / "far.mp4", tmp_path / "far.mp4.partial"
    sizes, chunks = [], []

    def on_chunk(index, chunk):
        sizes.append(partial.stat().st_size)
        chunks.append(chunk)

    args = build_parser().parse_args([str(far_dir), "--prompt", PROMPT, "--num_frames", str(FRAMES), "--height", str(SIZE),
                                      "--width", str(SIZE), "--steps", "2", "--seed", str(SEED), "--output", str(out),
                                      "--device", "cpu"])
    report = generate(args, on_chunk)
    assert report.chunks == 3 and report.streamed and [(c.start, c.end) for c in chunks] == [(0, 1), (1, 3), (3, 5)]
    assert 0 < sizes[0] < sizes[1] < sizes[2]  # the file grew after each chunk
    assert out.is_file() and not partial.exists() and report.frames == FRAMES
    pipe = AnyFlowFARPipeline.from_pretrained(str(far_dir))
    pipe.set_progress_bar_config(disable=True)
    length = load_config(default_recipe("finetune")).training.data.text_max_length
    stock = pipe(prompt=PROMPT, height=SIZE, width=SIZE, num_frames=FRAMES, num_inference_steps=2, max_sequence_length=length,
                 output_type="latent", generator=torch.Generator().manual_seed(SEED)).frames
    streamed = torch.cat([c.latents for c in chunks], dim=2)
    assert streamed.shape == stock.shape and float((streamed - stock).abs().max()) <= 1e-5


# ---- 2 processes == 1, FSDP2 (tests/dist_driver.py, as tests/test_distributed.py runs it) ----

DIST_STEPS = 3


def onpolicy_dist_run(out_dir: Path, **extra) -> dict:
    """A tiny on-policy AnyFlow run (the student made from the inline tiny Wan teacher, its 4-step
    rollout) at batch 1 per process with per-sample generators: 3 steps, the student updated at step 2."""
    base = dmd2_overrides(out_dir.parent, **{
        "method.name": "anyflow", "method.dmd_denoising_steps": None, "method.t_list_override": T_LIST,
        "models.student.flow_shift": 3.0, "models.student.init_from": None,
        "models.student.transformer_config": dict(TINY_TEACHER), "models.student.anyflow_from_wan": True,
        "training.checkpoint.output_dir": str(out_dir), "training.loop.noise_rng": "sample",
        "training.loop.max_train_steps": DIST_STEPS, "training.optimizer.eps": 1e-5,
        "training.optimizer.lr_warmup_steps": 0, "training.data.train_batch_size": 1,
        "method.generator_update_interval": 2,
    })
    base.update(extra)
    return base


def pretrain_dist_run(out_dir: Path) -> dict:
    """A tiny AnyFlow pretraining run (the student made from the inline tiny Wan), batch 1 per process."""
    base = without_inline_student(tiny_overrides(out_dir.parent, **{
        "method.name": "anyflow_pretrain", "training.data.text_max_length": TEXT_LENGTH,
        "models.student.anyflow_from_wan": True, "training.checkpoint.output_dir": str(out_dir),
        "training.loop.max_train_steps": 2, "training.data.train_batch_size": 1}))
    return {**base, "models.student.transformer_config": dict(TINY_TEACHER)}


@pytest.mark.multiproc
def test_onpolicy_two_processes_equal_one_and_fsdp2_trains_both_stages(tmp_path, tiny_data_path):
    """The on-policy method (DMD2 with the flow-map rollout) on 2 processes x batch 1 (DDP) ends where 1
    process x batch 1 x 2 accumulation steps ends, student and critic (per-sample generators); under
    FSDP2 every role is sharded and the saved student and critic equal the DDP run's. Pretraining runs
    under FSDP2 to its end and saves an AnyFlow transformer (it cannot equal 1 process: FastVideo splits
    the diffusion / consistency / mean-velocity branches over each process's batch)."""
    from safetensors.torch import load_file
    from test_distributed import WEIGHT_TOL, _driver, launch, max_diff

    for sub in ("ddp", "fsdp"):
        (tmp_path / sub).mkdir()
    ddp = launch("accelerate_configs/cpu_2proc.yaml", [
        {"name": "anyflow_2proc", "recipe": DMD2_RECIPE, "engine": "launch", "overrides": onpolicy_dist_run(tmp_path / "ddp" / "out")},
    ], tmp_path / "ddp")
    fsdp = launch("accelerate_configs/fsdp2.yaml", [
        {"name": "anyflow_fsdp2", "recipe": DMD2_RECIPE, "engine": "fsdp2", "overrides": onpolicy_dist_run(tmp_path / "fsdp" / "on")},
        {"name": "pretrain_fsdp2", "recipe": PRETRAIN_RECIPE, "engine": "fsdp2", "overrides": pretrain_dist_run(tmp_path / "fsdp" / "pre")},
    ], tmp_path / "fsdp", "--mixed_precision", "no")
    driver = _driver()
    driver.reset_accelerate()
    one = driver.run_one({"name": "anyflow_accum2", "recipe": DMD2_RECIPE, "engine": "launch",
                          "overrides": onpolicy_dist_run(tmp_path / "one" / "out", **{"training.loop.gradient_accumulation_steps": 2})},
                         tmp_path / "one" / "records")
    assert one["world_size"] == 1
    folder = tmp_path / "ddp" / "records" / "anyflow_2proc"
    for prefix in ("", "critic_"):
        w0, w1 = (load_file(str(folder / f"{prefix}rank{r}.safetensors")) for r in (0, 1))
        assert max_diff(w0, w1) == 0.0
        w_one = load_file(str(tmp_path / "one" / "records" / "anyflow_accum2" / f"{prefix}rank0.safetensors"))
        assert max_diff(w0, w_one) < WEIGHT_TOL, prefix
    assert max_diff(load_file(str(folder / "rank0.safetensors")), load_file(str(folder / "init.safetensors"))) > 1e-4
    ranks = ddp["anyflow_2proc"]
    for step in range(DIST_STEPS):
        mean_of_ranks = (ranks[0]["steps"][step]["local_loss"] + ranks[1]["steps"][step]["local_loss"]) / 2
        assert one["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)
    for rec in fsdp["anyflow_fsdp2"] + fsdp["pretrain_fsdp2"]:
        assert rec["is_fsdp2"] and rec["param_type"] == "DTensor"
    assert all(rec["teacher_param_type"] == "DTensor" for rec in fsdp["anyflow_fsdp2"])
    out = tmp_path / "fsdp" / "on"
    student = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    critic = load_file(str(out / "critic" / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert max_diff(student, load_file(str(folder / "rank0.safetensors"))) < WEIGHT_TOL
    assert max_diff(critic, load_file(str(folder / "critic_rank0.safetensors"))) < WEIGHT_TOL
    pre = tmp_path / "fsdp" / "pre"
    assert [len(rec["steps"]) for rec in fsdp["pretrain_fsdp2"]] == [2, 2]
    config = json.loads((pre / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "AnyFlowTransformer3DModel"
    weights = load_file(str(pre / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert any("delta_embedder" in k for k in weights) and all(torch.isfinite(v).all() for v in weights.values())


def test_each_fsdp2_role_is_wrapped_by_its_own_blocks():
    """Accelerate keeps on the FSDP2 plugin the block class names of the first model it prepared (the
    AnyFlow student's): a Wan teacher or critic gets its own `_no_split_modules` instead, while names a
    model has (the launch config's, or the first role's for a role of its family) stay."""
    import types

    from diffusers import AnyFlowTransformer3DModel, WanTransformer3DModel

    from fv_accel.build import fit_fsdp2_wrap_classes
    from fv_accel.models.anyflow import anyflow_config_of_wan

    wan = WanTransformer3DModel(**TINY_TEACHER)
    anyflow = AnyFlowTransformer3DModel(**anyflow_config_of_wan(TINY_TEACHER, 0.25, "r"))
    plugin = types.SimpleNamespace(transformer_cls_names_to_wrap=["AnyFlowTransformerBlock"])
    fit_fsdp2_wrap_classes(plugin, anyflow)
    assert plugin.transformer_cls_names_to_wrap == ["AnyFlowTransformerBlock"]
    fit_fsdp2_wrap_classes(plugin, wan)
    assert plugin.transformer_cls_names_to_wrap == ["WanTransformerBlock"]
    plugin = types.SimpleNamespace(transformer_cls_names_to_wrap=None)  # no names yet: Accelerate's own choice
    fit_fsdp2_wrap_classes(plugin, wan)
    assert plugin.transformer_cls_names_to_wrap is None
