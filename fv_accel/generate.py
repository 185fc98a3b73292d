"""Generate a video from a trained student, streaming a causal one chunk by chunk.

    python -m fv_accel.generate RUN_OR_MODEL --prompt "..." --num_frames N --output out.mp4 [--overwrite]
        [--steps S] [--kv_window W] [--seed 0] [--negative_prompt ""] [--guidance_scale G]
        [--fps F] [--height H --width W] [--device cuda|cpu] [--image IMG]

RUN_OR_MODEL is a run's output folder (its `transformer/` or LoRA file, the run config of its latest
checkpoint, and `scheduler/` for a few-step student), a checkpoint holding a LoRA, an export of a
run (`<run>/exports/<final or checkpoint-N>_<to>`, with that run's config), or a diffusers model
folder / Hub id (its `transformer/` may carry fv_accel's causal record). A run's student is built
from its recipe as training built it (its base, at the run's seed) and its trained weights loaded
into it: the transformer folder(s), or the LoRA adapter on the base. The VAE and text encoder come
from where the run's validation takes them (`fv_accel.validation.sampling_model_source`), or from
the model itself. A run without final weights yet is refused, naming the export of its latest
checkpoint to generate from.

- A block-causal student generates chunk by chunk (a chunk = its causal block of latent frames) with
  the KV-cached rollout (`fv_accel.rollout.iter_kv_cached_rollout`), at its run's sampler: the few
  steps of the scheduler saved beside it (a DMD2 / Self-Forcing run), else its validation settings
  (`callbacks.validation.sampling_steps`, Euler at the sampling shift). Each chunk is decoded as soon
  as it is done, keeping the VAE's causal cache between chunks (the pieces equal the whole video
  decoded at once), and appended to the mp4. `--kv_window W` keeps only the last W latent frames
  (counted from each chunk's end, the chunk included; plus the student's sink frames) visible and
  cached, so it can run past the trained length; the rotary table still bounds the length.
- A bidirectional student samples the whole clip with its run's sampler (the family's diffusers
  pipeline, as validation does) and writes the mp4 at the end.
- An AnyFlow student steps its flow map (`FlowMapEulerDiscreteScheduler` at the run's shift): at
  `--steps N` for any N; without it, an on-policy run at its own trained timesteps (student_steps.json),
  another at its validation steps. An AnyFlow-FAR student streams: `AnyFlowFARPipeline` samples chunk by
  chunk over its KV cache and each finished chunk is decoded and appended as for causal students.

The mp4 is written as `<output>.partial` (fragmented, one fragment per frame, flushed as each chunk
is written, so a reader sees it grow) and renamed to `<output>` when complete; a failed or
interrupted run removes it (Ctrl-C: one line, exit status 130), and an existing `<output>` is
refused unless `--overwrite`. A family that makes sound with the picture (LTX-2) gets its mp4
written whole, with the sound. Prints the time to the first chunk and the frames per second.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

DEFAULT_SIZE = (480, 832)  # a model folder's default (height, width): Wan's 480p


class GenerateError(ValueError):
    pass


@dataclass
class Source:
    """What generation loads: the student's recipe, where its VAE and text encoder come from, and
    the sampler of its run."""

    cfg: Any  # RunConfig whose models.student builds the student as its run did (its base, its LoRA)
    model_source: str  # VAE + text encoder (+ scheduler config for the validation sampler)
    data_path: Optional[str]  # the run's training data (its clip size), when known
    few_step: Any = None  # SamplingSchedule of a few-step student's saved scheduler
    few_steps: int = 0
    is_run: bool = False
    weights: Optional[Path] = None  # a run's trained weights: the folder of its transformer/ or its LoRA file


# --------------------------------------------------------------------------------------------
# The source: a run folder or a model
# --------------------------------------------------------------------------------------------


def _run_data_path(cfg: Any) -> Optional[str]:
    from fv_accel.build import resolve_data_path

    class _OneProcess:
        def main_process_first(self):
            import contextlib

            return contextlib.nullcontext()

    try:
        return resolve_data_path(cfg, _OneProcess())
    except Exception:  # a dataset of another machine: only needed for defaults
        return None


def _few_step(run: Path, cfg: Any) -> tuple[Any, int]:
    """A DMD2 / Self-Forcing run's few steps: its `student_steps.json` (timesteps and sigmas of the
    student's steps, how it steps between them, its context noise), else its saved scheduler and
    the step count of method.dmd_denoising_steps."""
    import json

    from fv_accel.methods.distribution_matching.dmd2 import STUDENT_STEPS_FILE
    from fv_accel.sampling import SamplingSchedule

    steps_file = run / STUDENT_STEPS_FILE
    path = run / "scheduler" / "scheduler_config.json"
    flow_map = _flow_map_steps(steps_file)
    if flow_map is not None:  # an on-policy AnyFlow student: the flow map at its trained steps
        return flow_map, len(flow_map.timesteps) - 1
    # A bidirectional student with a stock scheduler samples through its family's pipeline with it.
    if steps_file.is_file() and (cfg.models.student.causal or not path.is_file()):
        try:
            record = json.loads(steps_file.read_text())
            few = FewSteps(
                [float(t) for t in record["timesteps"]], [float(s) for s in record["sigmas"]],
                str(record.get("student_sample_type", "sde")), float(record.get("context_noise", 0.0)), str(steps_file),
            )
        except (ValueError, KeyError, TypeError) as err:
            raise GenerateError(f"{steps_file}: not a student steps record ({err})") from None
        return few, len(few.timesteps)
    if not path.is_file() or not cfg.method.dmd_denoising_steps:
        return None, 0
    config = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    name = json.loads(path.read_text()).get("_class_name")
    return SamplingSchedule(name, config, f"{path}"), len(cfg.method.dmd_denoising_steps)


@dataclass
class FlowMapSteps:
    """An on-policy AnyFlow student's own steps (`student_steps.json` of student_sample_type flow_map):
    its rollout's timesteps, the final 0 included, and whether r is the next timestep (the flow map)
    or t (`method.use_mean_velocity`)."""

    timesteps: list
    use_mean_velocity: bool
    origin: str


def _flow_map_steps(steps_file: Path) -> Optional[FlowMapSteps]:
    """The flow-map steps `steps_file` records, or None (no file, or another student's steps)."""
    import json

    if not steps_file.is_file():
        return None
    try:
        record = json.loads(steps_file.read_text())
        if record.get("student_sample_type") != "flow_map":
            return None
        timesteps = [float(t) for t in record["timesteps"]]
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise GenerateError(f"{steps_file}: not a student steps record ({err})") from None
    if len(timesteps) < 2 or timesteps[-1] != 0.0:
        raise GenerateError(f"{steps_file}: flow-map timesteps {timesteps} must end at 0 after at least one step")
    return FlowMapSteps(timesteps, bool(record.get("use_mean_velocity", True)), str(steps_file))


@dataclass
class FewSteps:
    """A distilled student's own steps (`student_steps.json`)."""

    timesteps: list
    sigmas: list
    sample_type: str  # sde: x0 re-noised with fresh noise between steps; ode: Euler
    context_noise: float  # the timestep finished chunks are written into the KV cache at
    origin: str


def _from_run(folder: Path, ckpt: Path) -> Source:
    """The trained weights in `folder` (a run's output folder, a checkpoint, or an export of the
    run) with the recipe of the checkpoint `ckpt`: the student is built as its run built it (its
    base, the VAE and text encoder the run used; a LoRA's settings) and the weights are loaded
    into it (`load_trained_weights`)."""
    from fv_accel.checkpoint import read_metadata
    from fv_accel.config import load_config
    from fv_accel.methods.distribution_matching.dmd2 import STUDENT_STEPS_FILE
    from fv_accel.models import family_of
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE
    from fv_accel.validation import sampling_model_source

    lora = (folder / DIFFUSERS_LORA_FILE).is_file()
    saved = read_metadata(ckpt)["config"]
    if not lora:  # a whole transformer (a full run's, or a LoRA run's merged export): no adapter on it
        student = {k: v for k, v in saved["models"]["student"].items() if k != "lora"}
        saved = {**saved, "models": {**saved["models"], "student": student}}
    cfg = load_config(saved, {"callbacks.validation.enable": False})
    st = cfg.models.student
    if lora and st.init_from is None and not st.transformer_config:
        raise GenerateError(f"{folder}: the LoRA's base is unknown (its recipe names no models.student.init_from)")
    data_path = _run_data_path(cfg)
    model_source = str(folder) if (folder / "vae").is_dir() else sampling_model_source(cfg, data_path)
    if not model_source:
        raise GenerateError(
            f"{folder}: no VAE or text encoder known for this run (no vae/, no models.student.init_from, no dataset "
            "model); its run config names none"
        )
    if st.latents_mean is None:
        stats = family_of(cfg).latent_statistics(model_source)
        if stats is not None:
            st.latents_mean, st.latents_std = list(stats[0]), list(stats[1])
    # The few-step sampler saved beside the weights (an export of a full run copies scheduler/), else the run's.
    beside = [folder / "scheduler", folder / STUDENT_STEPS_FILE]
    few, steps = _few_step(folder if any(p.exists() for p in beside) else ckpt.parent, cfg)
    return Source(cfg, model_source, data_path, few, steps, is_run=True, weights=folder)


def _from_model(model: str) -> Source:
    """A diffusers model folder or Hub id; a causal record in its transformer config makes it causal."""
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models.attention import SAVED_ATTENTION_KEY
    from fv_accel.models.loading import ModelLoadError, fetch_config

    try:
        record = fetch_config(model, "transformer").get(SAVED_ATTENTION_KEY) or {}
    except ModelLoadError as err:
        raise GenerateError(str(err)) from None
    overrides: dict[str, Any] = {"models.student.init_from": model, "models.student.transformer_config": None,
                                 "callbacks.validation.enable": False, "callbacks.validation.guidance_scale": 1.0}
    recipe = default_recipe("finetune")
    if record.get("causal"):
        recipe = default_recipe("dfsft")
        overrides.update({
            "models.student.causal": True, "method.chunk_size": int(record["block_size"]),
            "models.student.local_attn_size": int(record.get("local_attn_size", -1)),
            "models.student.sink_size": int(record.get("sink_size", 0)),
        })
    return Source(load_config(recipe, overrides), model, None)


def recipe_checkpoint(folder: Path) -> Optional[Path]:
    """The checkpoint whose metadata holds the recipe the weights in `folder` were trained with:
    `folder` itself (a checkpoint), the latest of the run `folder` is, or, for an export of a run
    (`<run>/exports/<checkpoint-N or final>_<to>`), the checkpoint it names, else the run's latest."""
    from fv_accel.checkpoint import METADATA_NAME, checkpoint_step, latest_checkpoint

    def complete(path: Path) -> bool:
        return checkpoint_step(path) is not None and (path / METADATA_NAME).is_file()

    if complete(folder):
        return folder
    found = latest_checkpoint(folder)
    if found is not None or folder.parent.name != "exports":
        return found
    named = folder.parent.parent / folder.name.split("_")[0]
    return named if complete(named) else latest_checkpoint(folder.parent.parent)


def _no_final_weights(folder: Path, ckpt: Path) -> GenerateError:
    """A run still training (or stopped before its end): the export of its latest checkpoint to generate from."""
    from fv_accel.export import default_export_dir, find_source

    out = default_export_dir(find_source(ckpt), "diffusers")
    what = "a checkpoint (training state)" if folder == ckpt else (
        "no final weights yet (the run is still training or stopped before its end); its latest checkpoint")
    return GenerateError(
        f"{folder}: {what}: export it with `python -m fv_accel.export {ckpt} --to diffusers` and generate from {out}"
    )


def resolve_source(name: str) -> Source:
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE

    path = Path(name)
    if not path.is_dir():
        if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
            raise GenerateError(f"RUN_OR_MODEL '{name}': no such folder (a run's output folder, a model folder or a Hub id)")
        return _from_model(name)
    lora = (path / DIFFUSERS_LORA_FILE).is_file()
    transformer = (path / "transformer" / "config.json").is_file()
    ckpt = recipe_checkpoint(path)
    if ckpt is not None:
        if lora or transformer:
            return _from_run(path, ckpt)
        raise _no_final_weights(path, ckpt)
    if lora:
        raise GenerateError(
            f"{path}: a LoRA without the recipe it was trained with (no checkpoint-<step>/ in or above this folder "
            "holds it): generate from the run's output folder"
        )
    if not transformer:
        raise GenerateError(f"{path}: no transformer/config.json (expected a run's output folder or a diffusers model folder)")
    if not (path / "vae").is_dir() and not (path / "model_index.json").is_file():
        raise GenerateError(
            f"{path}: a transformer without its pipeline (no vae/, no model_index.json) and without a run's recipe: "
            "generate from the run's output folder it was trained in, or from a diffusers model folder"
        )
    return _from_model(str(path))


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def latent_count(num_frames: int, temporal: int) -> int:
    """Latent frames of `num_frames` video frames ((N - 1) / temporal + 1); a count the VAE cannot
    make is a GenerateError naming the nearest valid counts."""
    if num_frames < 1 or (num_frames - 1) % temporal:
        low = max(1, (num_frames - 1) // temporal * temporal + 1)
        high = low + temporal if num_frames > low else low
        raise GenerateError(
            f"--num_frames {num_frames}: the VAE makes {temporal}k+1 frames; nearest valid counts: "
            f"{', '.join(str(n) for n in sorted({low, high}))}"
        )
    return (num_frames - 1) // temporal + 1


def check_rope(transformer: torch.nn.Module, temporal: int, num_frames: int, spatial: int = 0, height: int = 0,
               width: int = 0, size_given: bool = True) -> None:
    """Refuse a length or a frame size the rotary table cannot position (Wan: `rope_max_seq_len`
    positions per axis), naming the most frames, or the largest height and width, it can (checked
    before the VAE's frame rule, so that the nearest counts it names are within the table)."""
    limit = getattr(transformer.config, "rope_max_seq_len", None)
    if limit is None:
        return
    p_t, p_h, p_w = (int(p) for p in transformer.config.patch_size)
    most = (int(limit) * p_t - 1) * temporal + 1
    if num_frames > most:
        raise GenerateError(
            f"--num_frames {num_frames}: past the model's rotary table (rope_max_seq_len {limit}: "
            f"{int(limit) * p_t} latent frames); at most {most} frames"
        )
    most_h, most_w = int(limit) * p_h * spatial, int(limit) * p_w * spatial
    if spatial and (height > most_h or width > most_w):
        given = "" if size_given else " (the 480p default: the source records no size)"
        raise GenerateError(
            f"--height {height} / --width {width}{given}: past the model's rotary table (rope_max_seq_len {limit}: "
            f"{limit} positions per axis); at most {most_h} px high and {most_w} px wide: give --height and --width"
        )


def check_request(args: argparse.Namespace, student: Any) -> None:
    causal = getattr(student, "causal_attention", None) is not None
    if args.kv_window is not None and getattr(student, "family", None) == "anyflow_far":
        raise GenerateError(f"--kv_window {args.kv_window}: an AnyFlow-FAR student keeps its own window (full_chunk_limit); leave it out")
    if args.kv_window is not None:
        if not causal:
            raise GenerateError(f"--kv_window {args.kv_window}: the student is bidirectional (no KV cache); leave it out")
        block = student.causal_block_size
        if args.kv_window < block or args.kv_window % block:
            raise GenerateError(f"--kv_window {args.kv_window}: must be a multiple of the causal block size {block}")
    i2v = getattr(student, "task", "t2v") == "i2v" or student.capabilities.image_conditioning
    if args.image is not None and not i2v:
        raise GenerateError(f"--image {args.image}: this student is text-to-video; leave --image out")
    if args.image is None and i2v:
        raise GenerateError("this student is image-to-video: give the first frame with --image IMG")
    if args.image is not None and not Path(args.image).is_file():
        raise GenerateError(f"--image {args.image}: no such file")
    if args.image is not None and causal:
        raise GenerateError("--image: streaming a causal image-to-video student is not supported yet")


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    source: Source
    student: Any
    vae: Any
    text: Any  # Conditioning of the prompt
    negative: Any  # Conditioning of the negative prompt
    spatial: int
    temporal: int


def load(source: Source, prompt: str, negative_prompt: str, device: torch.device) -> Loaded:
    """The student (eval, no grad, on `device`), the family's VAE, and both prompts encoded."""
    from accelerate.utils import set_seed

    from fv_accel.models import build_student
    from fv_accel.validation import prompt_columns

    cfg = source.cfg
    # The training's seed: an inline (random-init) base is the run's own (a LoRA's base), and any
    # table the weights do not hold is fixed.
    set_seed(cfg.training.data.seed)
    student = build_student(cfg)
    if source.weights is not None:
        load_trained_weights(student, source.weights)
    student.init_preprocessors(cfg.training)
    for module in student.modules:
        module.to(device).eval().requires_grad_(False)
    family = type(student)
    encoder = family.make_encoder(source.model_source, device=device, dtype=torch.float32)
    conds = []
    with torch.no_grad():
        for text in (prompt, negative_prompt):
            columns = {k: v.float().cpu() for k, v in encoder.encode_caption(text).items()}
            conds.append(student.build_conditioning(prompt_columns(columns, cfg.training.data.text_max_length)))
    vae = encoder.vae.float().eval().requires_grad_(False)
    spatial, temporal = int(encoder.spec.scale_factor_spatial), int(encoder.spec.scale_factor_temporal)
    return Loaded(source, student, vae, conds[0], conds[1], spatial, temporal)


def load_trained_weights(student: Any, folder: Path) -> None:
    """A run's trained weights into the student built from its recipe: its LoRA file(s) (the adapter,
    and VSA gates, as a resume restores them), else each transformer folder the run saved."""
    from fv_accel.export import expert_loras, find_source
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE

    if (folder / DIFFUSERS_LORA_FILE).is_file():
        loras = expert_loras(find_source(folder))
        if len(loras) == 1:
            ((_, (state, metadata)),) = loras.items()
        else:  # both Wan 2.2 experts: keys named by expert, as the run's own adapter state
            state = {f"{name}.{k}": v for name, (part, _) in loras.items() for k, v in part.items()}
            metadata = next(iter(loras.values()))[1]
        try:
            student.load_lora_files_state(state, metadata)
        except ValueError as err:
            raise GenerateError(f"{folder / DIFFUSERS_LORA_FILE}: {err}") from None
        return
    import types

    # The folders save_final wrote (a Wan 2.2 expert's in its own), each into its module.
    for sub, module in student.transformer_folders(types.SimpleNamespace(unwrap_model=lambda m: m)).items():
        _copy_weights(module, folder / sub)


def _copy_weights(module: torch.nn.Module, folder: Path) -> None:
    """The safetensors weights of a transformer folder (`save_pretrained`'s, shards included) copied
    into `module`, which must have exactly their names."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise GenerateError(f"{folder}: no safetensors weights")
    expected, seen = set(module.state_dict()), set()
    for path in files:
        part = load_file(str(path))
        unknown = sorted(set(part) - expected)
        if unknown:
            raise GenerateError(f"{path}: weights {unknown[:3]} are not in the {type(module).__name__} its run's recipe builds")
        module.load_state_dict(part, strict=False)
        seen |= set(part)
    missing = sorted(expected - seen)
    if missing:
        raise GenerateError(f"{folder}: missing weights {missing[:3]} of the {type(module).__name__} its run's recipe builds")


def default_size(source: Source, spatial: int, temporal: int) -> tuple[int, int, Optional[int]]:
    """(height, width, trained video frames or None): the run's validation size, else its training
    clips', else DEFAULT_SIZE."""
    from fv_accel.validation import default_video_size

    val = source.cfg.callbacks.validation
    height, width, frames = val.height, val.width, val.num_frames
    if source.data_path is not None:
        try:
            dh, dw, df = default_video_size(source.data_path, spatial, temporal, cfg=source.cfg)
            height, width, frames = height or dh, width or dw, frames or df
        except (OSError, ValueError):
            pass
    return height or DEFAULT_SIZE[0], width or DEFAULT_SIZE[1], frames


# --------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------


@dataclass
class Settings:
    steps: int
    guidance_scale: float
    sigmas: Optional[torch.Tensor] = None  # explicit schedule (a few-step student's)
    renoise: bool = False
    shift: float = 3.0
    schedule: Any = None  # SamplingSchedule of the bidirectional sampler
    describe: str = ""
    timesteps: Optional[torch.Tensor] = None  # the model's timesteps with explicit sigmas (else sigma * N)
    context: Optional[float] = None  # a distilled student's context timestep (else the run's validation context_noise sigma)
    flow_map: Optional[dict] = None  # an AnyFlow student's pipeline step inputs (`_flow_map_settings`)


def sampler_settings(loaded: Loaded, args: argparse.Namespace, latent_shape: tuple) -> Settings:
    """The run's sampler: a few-step student's saved scheduler (no guidance), else its validation's."""
    from fv_accel.validation import repo_sampling_schedule

    source, student = loaded.source, loaded.student
    val = source.cfg.callbacks.validation
    if hasattr(student, "flow_map_scheduler"):
        return _flow_map_settings(loaded, args)
    if isinstance(source.few_step, FewSteps):
        few = source.few_step
        if args.steps is not None and args.steps != len(few.timesteps):
            raise GenerateError(f"--steps {args.steps}: this student samples at its own {len(few.timesteps)} steps ({few.origin})")
        guidance = 1.0 if args.guidance_scale is None else args.guidance_scale
        text = f"its {len(few.timesteps)} steps {few.timesteps} ({few.sample_type}, saved with the run in {few.origin})"
        return Settings(len(few.timesteps), guidance, torch.tensor(few.sigmas + [0.0]), few.sample_type == "sde",
                        describe=text, timesteps=torch.tensor(few.timesteps), context=few.context_noise)
    if source.few_step is not None:
        steps = args.steps or source.few_steps
        guidance = 1.0 if args.guidance_scale is None else args.guidance_scale
        scheduler = source.few_step.build()
        scheduler.set_timesteps(steps, device="cpu")
        sigmas = scheduler.sigmas.to(torch.float32).clone()
        renoise = source.few_step.class_name == "FlowMatchLCMScheduler"
        text = f"{steps} steps of {source.few_step.class_name} (saved with the run)"
        return Settings(steps, guidance, sigmas, renoise, schedule=source.few_step, describe=text)
    steps = args.steps or val.sampling_steps
    guidance = val.guidance_scale if args.guidance_scale is None else args.guidance_scale
    schedule = repo_sampling_schedule(source.model_source, val, type(student))
    shift = schedule.euler_shift(student.tokens(torch.Size(latent_shape)))
    if getattr(student, "causal_attention", None) is not None:
        text = f"{steps} Euler steps at shift {shift:g} per chunk (the run's validation settings)"
    else:
        text = f"{steps} steps of {schedule.describe()}"
    return Settings(steps, guidance, shift=shift, schedule=schedule, describe=text)


def _flow_map_settings(loaded: Loaded, args: argparse.Namespace) -> Settings:
    """An AnyFlow student steps its flow map (FlowMapEulerDiscreteScheduler at the run's shift, r the
    next timestep: what `AnyFlowPipeline.from_pretrained(run)` steps): at `--steps N` for any N; without
    it, an on-policy student at its own trained timesteps (student_steps.json, given to the pipeline
    as custom timesteps, no guidance), any other at its run's validation steps and guidance."""
    from fv_accel.models.anyflow import pipeline_timesteps
    from fv_accel.sampling import SamplingSchedule

    source, student = loaded.source, loaded.student
    val = source.cfg.callbacks.validation
    scheduler = student.flow_map_scheduler()
    shift = float(scheduler.config.shift)
    config = {"num_train_timesteps": int(scheduler.config.num_train_timesteps), "shift": shift}
    schedule = SamplingSchedule("FlowMapEulerDiscreteScheduler", config, "the student's flow map")
    own = source.few_step if isinstance(source.few_step, FlowMapSteps) else None
    if own is not None and args.steps in (None, source.few_steps):
        guidance = 1.0 if args.guidance_scale is None else args.guidance_scale
        call = {"timesteps": pipeline_timesteps(own.timesteps, shift), "use_mean_velocity": own.use_mean_velocity}
        r = "the next timestep" if own.use_mean_velocity else "r = t"
        text = f"its {source.few_steps} trained flow-map steps {own.timesteps[:-1]} ({r}; {own.origin})"
        return Settings(source.few_steps, guidance, schedule=schedule, describe=text, flow_map=call)
    steps = args.steps or val.sampling_steps
    default_guidance = 1.0 if own is not None else val.guidance_scale
    guidance = default_guidance if args.guidance_scale is None else args.guidance_scale
    text = f"{steps} flow-map steps of FlowMapEulerDiscreteScheduler at shift {shift:g}"
    return Settings(steps, guidance, schedule=schedule, describe=text, flow_map={})


def _to_pixels(loaded: Loaded, latents: torch.Tensor, decode: Any = None) -> np.ndarray:
    from fv_accel.sampling import decode_latents

    student = loaded.student
    decode = decode or type(student).decode
    return decode_latents(loaded.vae, latents, student.latents_mean, student.latents_std, decode=decode)[0]


@dataclass
class Report:
    frames: int
    seconds: float
    first_chunk_seconds: float
    chunks: int
    cached_frames: list  # latent frames in the KV cache after each chunk (causal)
    streamed: bool
    sound: bool = False  # the mp4 has the sound the family made with the picture (written whole)


def _context(loaded: Loaded, settings: Settings) -> dict:
    """The KV cache's refresh: a distilled student's context timestep (its table's sigma there), else
    the run's validation context_noise (a sigma)."""
    if settings.context is None:
        return {"context_noise": loaded.source.cfg.callbacks.validation.context_noise}
    if settings.context <= 0:
        return {"context_noise": 0.0, "context_timestep": 0.0}
    table = loaded.student.training_table(torch.Size([1, 1, 1, 1, 1]))
    sigma = float(table.nearest_sigmas(torch.tensor([settings.context]), 1)[0])
    # The transformer is given the whole-number timestep, as in training (FastVideo's `timestep.long()`).
    return {"context_noise": sigma, "context_timestep": float(int(settings.context))}


def stream_causal(
    loaded: Loaded, settings: Settings, noise: torch.Tensor, writer: Any, generator: torch.Generator,
    on_chunk: Optional[Callable[[int, Any], None]] = None,
) -> Report:
    """Chunk by chunk: denoise with the KV cache, decode with the VAE's kept cache, append to the mp4."""
    from fv_accel.process import progress_bar
    from fv_accel.rollout import iter_kv_cached_rollout
    from fv_accel.sampling import chunk_bounds

    student = loaded.student
    guided = settings.guidance_scale > 1.0
    decoder = type(student).stream_decoder(loaded.vae)
    if decoder is None:
        print(f"the {student.family} family's VAE cannot decode in pieces: the video is decoded and written at the end")
    num_chunks = len(chunk_bounds(noise.shape[2], student.causal_block_size))
    bar = progress_bar(num_chunks, "chunks", unit="chunk")
    start, first, cached, pending = time.perf_counter(), None, [], []
    chunks = iter_kv_cached_rollout(
        student, noise, loaded.text.text, num_steps=settings.steps, shift=settings.shift,
        guidance_scale=settings.guidance_scale, negative_text=loaded.negative.text if guided else None,
        generator=generator, sigmas=settings.sigmas, renoise=settings.renoise, timesteps=settings.timesteps,
        **_context(loaded, settings),
    )
    try:
        for index, chunk in enumerate(chunks):
            if decoder is not None:
                writer.write(_to_pixels(loaded, chunk.latents, lambda _vae, z: decoder.decode(z)))
            else:
                pending.append(chunk.latents)
            first = time.perf_counter() - start if first is None else first
            cached.append(chunk.cached_frames)
            bar.update(1)
            if on_chunk is not None:
                on_chunk(index, chunk)
        if decoder is None:
            writer.write(_to_pixels(loaded, torch.cat(pending, dim=2)))
    finally:
        bar.close()
        if decoder is not None:
            decoder.close()
    seconds = time.perf_counter() - start
    return Report(writer.frames, seconds, first, num_chunks, cached, decoder is not None)


def stream_far(
    loaded: Loaded, settings: Settings, args: argparse.Namespace, writer: Any,
    on_chunk: Optional[Callable[[int, Any], None]] = None,
) -> Report:
    """An AnyFlow-FAR student: AnyFlowFARPipeline samples chunk by chunk over its KV cache (the model's
    chunk layout, `far_chunk_partition`); each chunk is decoded (the VAE's causal cache kept) and
    appended to the mp4 as soon as its last flow-map step is done, seen through the pipeline's
    `callback_on_step_end`, which is given every chunk's latents at every step."""
    from fv_accel.models.anyflow import far_chunk_partition
    from fv_accel.process import progress_bar
    from fv_accel.rollout import RolloutChunk

    student = loaded.student
    partition = far_chunk_partition(student.modules[0].config, latent_count(args.num_frames, loaded.temporal))
    decoder = type(student).stream_decoder(loaded.vae)
    if decoder is None:
        print(f"the {student.family} family's VAE cannot decode in pieces: the video is decoded and written at the end")
    bar = progress_bar(len(partition), "chunks", unit="chunk")
    start, times, cached, pending = time.perf_counter(), [], [], []

    def chunk_done(pipe: Any, step: int, timestep: Any, tensors: dict) -> dict:
        if step != len(pipe.scheduler.timesteps) - 1:
            return {}
        index = len(times)
        latents = tensors["latents"].permute(0, 2, 1, 3, 4).float()  # the pipeline's [B, T, C, H, W]
        if decoder is not None:
            writer.write(_to_pixels(loaded, latents, lambda _vae, z: decoder.decode(z)))
        else:
            pending.append(latents)
        times.append(time.perf_counter() - start)
        end = sum(partition[: index + 1])
        cached.append(end)
        bar.update(1)
        if on_chunk is not None:
            on_chunk(index, RolloutChunk(end - partition[index], end, latents, end))
        return {}

    call = {**(settings.flow_map or {}), "callback_on_step_end": chunk_done, "callback_on_step_end_tensor_inputs": ["latents"]}
    try:
        with torch.no_grad():
            student.sample_latents(
                loaded.vae, loaded.text, loaded.negative, height=args.height, width=args.width, num_frames=args.num_frames,
                num_inference_steps=settings.steps, guidance_scale=settings.guidance_scale,
                scheduler=settings.schedule.build(), generator=torch.Generator().manual_seed(args.seed), flow_map=call,
            )
        if len(times) != len(partition):
            raise GenerateError(f"the FAR pipeline finished {len(times)} of its {len(partition)} chunks {partition}")
        if decoder is None:
            writer.write(_to_pixels(loaded, torch.cat(pending, dim=2)))
    finally:
        bar.close()
        if decoder is not None:
            decoder.close()
    return Report(writer.frames, time.perf_counter() - start, times[0], len(partition), cached, decoder is not None)


def _sample_few_steps(loaded: Loaded, latent_shape: tuple, generator: torch.Generator, writer: Any, start: float) -> Report:
    """A bidirectional distilled student without a stock scheduler: its own steps (x0, then re-noised
    with fresh noise), `fv_accel.sampling.few_step_sample`."""
    from fv_accel.sampling import few_step_sample

    if loaded.text.clean_frames:
        raise GenerateError("an image-to-video student with its own step list (no scheduler/ saved) samples only during training")
    student = loaded.student
    noise = torch.randn(latent_shape, generator=generator, dtype=torch.float32).to(student.device)
    per_frame = student.capabilities.per_frame_timesteps
    latents = few_step_sample(
        lambda x, t: student.forward(x, t if per_frame else t[:, 0], loaded.text), noise, loaded.source.few_step.timesteps,
        student.training_table(torch.Size(latent_shape)), generator,
    )
    return _write_whole(loaded, latents, writer, start)


def _write_whole(loaded: Loaded, latents: torch.Tensor, writer: Any, start: float) -> Report:
    """The whole clip into the mp4, with the sound a family makes with the picture (LTX-2) as its
    audio track: then written at once (through a temporary name), as a streamed mp4 has no sound."""
    from fv_accel.data.video import write_video

    frames = _to_pixels(loaded, latents)
    sound = loaded.student.sample_sound()
    if sound is None:
        writer.write(frames)
    else:
        write_video(writer.path, frames, fps=writer.fps, audio=sound)
    seconds = time.perf_counter() - start
    return Report(len(frames), seconds, seconds, 1, [], False, sound=sound is not None)


def sample_whole(loaded: Loaded, settings: Settings, args: argparse.Namespace, latent_shape: tuple, writer: Any) -> Report:
    """A bidirectional student: the whole clip with the run's sampler (validation's), then the mp4."""
    from fv_accel.sampling import sample_with_scheduler

    student, guided = loaded.student, settings.guidance_scale > 1.0
    start = time.perf_counter()
    generator = torch.Generator().manual_seed(args.seed)
    if loaded.source.few_step is not None:
        torch.manual_seed(args.seed + 1)  # the pipeline's re-noising draws from the global generator
    first_frame = None if args.image is None else _read_image(args.image, args.height, args.width)
    if isinstance(loaded.source.few_step, FewSteps):
        return _sample_few_steps(loaded, latent_shape, generator, writer, start)
    steps = dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance_scale)
    flow_map = {} if settings.flow_map is None else {"flow_map": settings.flow_map}
    latents = student.sample_latents(
        loaded.vae, loaded.text, loaded.negative, height=args.height, width=args.width, num_frames=args.num_frames,
        scheduler=settings.schedule.build(), generator=generator, first_frame=first_frame, **steps, **flow_map,
    )
    if latents is None:  # no family pipeline for this student: the pipeline's loop, as validation
        noise = torch.randn(latent_shape, generator=generator, dtype=torch.float32).to(student.device)
        per_frame = student.capabilities.per_frame_timesteps

        def predict(x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
            return student.forward(x, t if per_frame else t[:, 0], cond)

        latents = sample_with_scheduler(
            predict, noise, loaded.text, settings.schedule.build(), negative_text=loaded.negative if guided else None, **steps
        )
    return _write_whole(loaded, latents, writer, start)


def _read_image(path: str, height: int, width: int) -> np.ndarray:
    from PIL import Image

    try:
        image = Image.open(path).convert("RGB")
    except OSError as err:
        raise GenerateError(f"--image {path}: not a readable image ({err})") from None
    return np.asarray(image.resize((width, height), Image.BICUBIC), dtype=np.uint8)


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def generate(args: argparse.Namespace, on_chunk: Optional[Callable[[int, Any], None]] = None) -> Report:
    """Generate `args.output` (see the module docstring); `on_chunk(index, RolloutChunk)` is called
    after each causal chunk is written to `<output>.partial`."""
    from fv_accel.data.video import StreamingVideoWriter

    output = Path(args.output)
    if output.suffix.lower() != ".mp4":
        raise GenerateError(f"--output {args.output}: must end in .mp4")
    if (output.exists() or output.is_symlink()) and not getattr(args, "overwrite", False):
        raise GenerateError(f"--output {args.output}: the file exists; give another path, or add --overwrite to replace it")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = resolve_source(args.run_or_model)
    loaded = load(source, args.prompt, args.negative_prompt, device)
    student = loaded.student
    check_request(args, student)
    height, width, trained = default_size(source, loaded.spatial, loaded.temporal)
    size_given = bool(args.height and args.width)
    args.height, args.width = args.height or height, args.width or width
    if args.height % loaded.spatial or args.width % loaded.spatial:
        raise GenerateError(f"--height {args.height} / --width {args.width}: must be multiples of {loaded.spatial}")
    check_rope(student.transformer, loaded.temporal, args.num_frames, loaded.spatial, args.height, args.width, size_given)
    latent_frames = latent_count(args.num_frames, loaded.temporal)
    shape = (1, student.in_channels, latent_frames, args.height // loaded.spatial, args.width // loaded.spatial)
    settings = sampler_settings(loaded, args, shape)
    causal = getattr(student, "causal_attention", None) is not None
    far = getattr(student, "family", None) == "anyflow_far"  # streamed by its own pipeline (stream_far)
    if args.kv_window is not None:
        student.causal_attention.set_window(args.kv_window)
    # A family that makes sound with the picture (LTX-2) at the frame rate it was made for.
    fps = args.fps or (student.frame_rate if student.has_audio else source.cfg.callbacks.validation.fps if source.is_run else 16)
    kind = f"causal student (chunks of {student.causal_block_size} latent frames)" if causal else "bidirectional student"
    if far:
        from fv_accel.models.anyflow import far_chunk_partition

        kind = f"AnyFlow-FAR student (chunks of {far_chunk_partition(student.modules[0].config, latent_frames)} latent frames)"
    trained_text = f" (trained on {trained})" if trained else ""
    print(f"{args.run_or_model}: {kind}; {args.num_frames} frames{trained_text} at {args.width}x{args.height}, "
          f"{settings.describe}, guidance {settings.guidance_scale:g}, seed {args.seed}")
    writer = StreamingVideoWriter(output, fps=fps)
    try:
        if causal:
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed), dtype=torch.float32).to(device)
            generator = torch.Generator(device).manual_seed(args.seed + 1)
            report = stream_causal(loaded, settings, noise, writer, generator, on_chunk)
        elif far:
            report = stream_far(loaded, settings, args, writer, on_chunk)
        else:
            report = sample_whole(loaded, settings, args, shape, writer)
        if not report.sound:
            writer.close()
    except BaseException:
        writer.abort()
        raise
    print(f"time to first chunk: {report.first_chunk_seconds:.2f} s")
    print(f"{report.frames} frames in {report.seconds:.2f} s: {report.frames / report.seconds:.2f} frames per second")
    print(f"wrote {output}" + (" (with sound)" if report.sound else ""))
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.generate",
        description="Generate a video from a trained student; a causal student streams chunk by chunk.",
        epilog="The mp4 grows as <output>.partial while it is generated (a reader can watch it) and is renamed "
        "to <output> when complete; a failed or interrupted run removes it.",
    )
    parser.add_argument("run_or_model", metavar="RUN_OR_MODEL",
                        help="a run's output folder (full or LoRA), an export of it, a diffusers model folder or a Hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--num_frames", type=int, required=True, help="video frames (Wan: 4k+1)")
    parser.add_argument("--output", required=True, help="the mp4 to write (grows as <output>.partial meanwhile); "
                        "an existing file is refused unless --overwrite")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file (once the new one is complete)")
    parser.add_argument("--image", default=None, help="the first frame, for an image-to-video student")
    parser.add_argument("--steps", type=int, default=None, help="sampling steps (default: the run's sampler)")
    parser.add_argument("--kv_window", type=int, default=None, metavar="W",
                        help="causal only: attend to and cache only the last W latent frames (a multiple of the block size), "
                        "plus sink frames, to go past the trained length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--negative_prompt", default="")
    parser.add_argument("--guidance_scale", type=float, default=None,
                        help="default: the run's validation setting (1.0 for a few-step student or a model folder)")
    parser.add_argument("--fps", type=float, default=None, help="default: the run's validation fps, else 16")
    parser.add_argument("--height", type=int, default=None, help="default: the run's sample / training size")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    from fv_accel.config import ConfigError
    from fv_accel.process import report_error

    args = build_parser().parse_args(argv)
    if args.steps is not None and args.steps < 1:
        print(f"error: --steps {args.steps}: must be >= 1", file=sys.stderr)
        return 2
    try:
        generate(args)
    except (GenerateError, ConfigError, OSError, ValueError) as err:
        report_error(err)
        return 2
    except KeyboardInterrupt:  # the partial file is removed; an earlier --output file stays as it was
        state = "left unchanged" if Path(args.output).exists() else "not written"
        print(f"interrupted: {args.output} {state}", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
