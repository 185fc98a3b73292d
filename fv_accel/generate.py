"""Generate a video from a trained student, streaming a causal one chunk by chunk.

    python -m fv_accel.generate RUN_OR_MODEL --prompt "..." --num_frames N --output out.mp4
        [--steps S] [--kv_window W] [--seed 0] [--negative_prompt ""] [--guidance_scale G]
        [--fps F] [--height H --width W] [--device cuda|cpu] [--image IMG]

RUN_OR_MODEL is a run's output folder (its `transformer/`, the run config of its latest
checkpoint, and `scheduler/` for a few-step student) or a diffusers model folder / Hub id (its
`transformer/` may carry fv_accel's causal record). The VAE and text encoder come from where the
run's validation takes them (`fv_accel.validation.sampling_model_source`), or from the model itself.

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

The mp4 is written as `<output>.partial` (fragmented, one fragment per frame, flushed as each chunk
is written, so a reader sees it grow) and renamed to `<output>` when complete; a failed run
removes it. Prints the time to the first chunk and the frames per second of the generation.
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

    cfg: Any  # RunConfig whose models.student loads the trained transformer
    model_source: str  # VAE + text encoder (+ scheduler config for the validation sampler)
    data_path: Optional[str]  # the run's training data (its clip size), when known
    few_step: Any = None  # SamplingSchedule of a few-step student's saved scheduler
    few_steps: int = 0
    is_run: bool = False


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
class FewSteps:
    """A distilled student's own steps (`student_steps.json`)."""

    timesteps: list
    sigmas: list
    sample_type: str  # sde: x0 re-noised with fresh noise between steps; ode: Euler
    context_noise: float  # the timestep finished chunks are written into the KV cache at
    origin: str


def _from_run(run: Path, saved: dict) -> Source:
    from fv_accel.config import load_config
    from fv_accel.models import family_of
    from fv_accel.validation import sampling_model_source

    base = load_config(saved)
    data_path = _run_data_path(base)
    model_source = str(run) if (run / "vae").is_dir() else sampling_model_source(base, data_path)
    if not model_source:
        raise GenerateError(
            f"{run}: no VAE or text encoder known for this run (no vae/, no models.student.init_from, no dataset "
            "model); its run config names none"
        )
    student = {
        "init_from": str(run), "transformer_config": None, "subfolder": "transformer", "revision": None,
        "variant": None, "model_class": "auto", "lora.enable": False, "expert": base.models.student.expert,
    }
    overrides = {f"models.student.{k}": v for k, v in student.items()}
    cfg = load_config(saved, {**overrides, "callbacks.validation.enable": False})
    st = cfg.models.student
    if st.latents_mean is None:
        stats = family_of(cfg).latent_statistics(model_source)
        if stats is not None:
            st.latents_mean, st.latents_std = list(stats[0]), list(stats[1])
    few, steps = _few_step(run, cfg)
    return Source(cfg, model_source, data_path, few, steps, is_run=True)


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


def resolve_source(name: str) -> Source:
    from fv_accel.checkpoint import latest_checkpoint, read_metadata
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE

    path = Path(name)
    if path.is_dir():
        if (path / DIFFUSERS_LORA_FILE).is_file():
            raise GenerateError(
                f"{path}: a LoRA run; merge it into its base first (python -m fv_accel.export {path} --to merged)"
            )
        if not (path / "transformer" / "config.json").is_file():
            raise GenerateError(f"{path}: no transformer/config.json (expected a run's output folder or a diffusers model folder)")
        ckpt = latest_checkpoint(path)
        if ckpt is not None:
            return _from_run(path, read_metadata(ckpt)["config"])
        return _from_model(str(path))
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise GenerateError(f"RUN_OR_MODEL '{name}': no such folder (a run's output folder, a model folder or a Hub id)")
    return _from_model(name)


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


def check_rope(transformer: torch.nn.Module, latent_frames: int, temporal: int, num_frames: int) -> None:
    """Refuse a length the rotary table cannot position (Wan: `rope_max_seq_len` positions per axis)."""
    limit = getattr(transformer.config, "rope_max_seq_len", None)
    p_t = int(transformer.config.patch_size[0])
    if limit is not None and latent_frames // p_t > int(limit):
        most = (int(limit) * p_t - 1) * temporal + 1
        raise GenerateError(
            f"--num_frames {num_frames}: {latent_frames} latent frames exceed the model's rotary table "
            f"(rope_max_seq_len {limit}); at most {most} frames"
        )


def check_request(args: argparse.Namespace, student: Any) -> None:
    causal = getattr(student, "causal_attention", None) is not None
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
    from fv_accel.models import build_student
    from fv_accel.validation import prompt_columns

    cfg = source.cfg
    torch.manual_seed(0)  # the transformer is built then loaded: a fixed seed keeps any unloaded tables fixed
    student = build_student(cfg)
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


def sampler_settings(loaded: Loaded, args: argparse.Namespace, latent_shape: tuple) -> Settings:
    """The run's sampler: a few-step student's saved scheduler (no guidance), else its validation's."""
    from fv_accel.validation import repo_sampling_schedule

    source, student = loaded.source, loaded.student
    val = source.cfg.callbacks.validation
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


def _context(loaded: Loaded, settings: Settings) -> dict:
    """The KV cache's refresh: a distilled student's context timestep (its table's sigma there), else
    the run's validation context_noise (a sigma)."""
    if settings.context is None:
        return {"context_noise": loaded.source.cfg.callbacks.validation.context_noise}
    if settings.context <= 0:
        return {"context_noise": 0.0, "context_timestep": 0.0}
    table = loaded.student.training_table(torch.Size([1, 1, 1, 1, 1]))
    sigma = float(table.nearest_sigmas(torch.tensor([settings.context]), 1)[0])
    return {"context_noise": sigma, "context_timestep": float(settings.context)}


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
    writer.write(_to_pixels(loaded, latents))
    seconds = time.perf_counter() - start
    return Report(writer.frames, seconds, seconds, 1, [], False)


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
    latents = student.sample_latents(
        loaded.vae, loaded.text, loaded.negative, height=args.height, width=args.width, num_frames=args.num_frames,
        scheduler=settings.schedule.build(), generator=generator, first_frame=first_frame, **steps,
    )
    if latents is None:  # no family pipeline for this student: the pipeline's loop, as validation
        noise = torch.randn(latent_shape, generator=generator, dtype=torch.float32).to(student.device)
        per_frame = student.capabilities.per_frame_timesteps

        def predict(x: torch.Tensor, t: torch.Tensor, cond: Any) -> torch.Tensor:
            return student.forward(x, t if per_frame else t[:, 0], cond)

        latents = sample_with_scheduler(
            predict, noise, loaded.text, settings.schedule.build(), negative_text=loaded.negative if guided else None, **steps
        )
    writer.write(_to_pixels(loaded, latents))
    seconds = time.perf_counter() - start
    return Report(writer.frames, seconds, seconds, 1, [], False)


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
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    source = resolve_source(args.run_or_model)
    loaded = load(source, args.prompt, args.negative_prompt, device)
    student = loaded.student
    check_request(args, student)
    height, width, trained = default_size(source, loaded.spatial, loaded.temporal)
    args.height, args.width = args.height or height, args.width or width
    if args.height % loaded.spatial or args.width % loaded.spatial:
        raise GenerateError(f"--height {args.height} / --width {args.width}: must be multiples of {loaded.spatial}")
    latent_frames = latent_count(args.num_frames, loaded.temporal)
    check_rope(student.transformer, latent_frames, loaded.temporal, args.num_frames)
    shape = (1, student.in_channels, latent_frames, args.height // loaded.spatial, args.width // loaded.spatial)
    settings = sampler_settings(loaded, args, shape)
    causal = getattr(student, "causal_attention", None) is not None
    if args.kv_window is not None:
        student.causal_attention.set_window(args.kv_window)
    fps = args.fps or (source.cfg.callbacks.validation.fps if source.is_run else 16)
    kind = f"causal student (chunks of {student.causal_block_size} latent frames)" if causal else "bidirectional student"
    trained_text = f" (trained on {trained})" if trained else ""
    print(f"{args.run_or_model}: {kind}; {args.num_frames} frames{trained_text} at {args.width}x{args.height}, "
          f"{settings.describe}, guidance {settings.guidance_scale:g}, seed {args.seed}")
    writer = StreamingVideoWriter(output, fps=fps)
    try:
        if causal:
            noise = torch.randn(shape, generator=torch.Generator().manual_seed(args.seed), dtype=torch.float32).to(device)
            generator = torch.Generator(device).manual_seed(args.seed + 1)
            report = stream_causal(loaded, settings, noise, writer, generator, on_chunk)
        else:
            report = sample_whole(loaded, settings, args, shape, writer)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    print(f"time to first chunk: {report.first_chunk_seconds:.2f} s")
    print(f"{report.frames} frames in {report.seconds:.2f} s: {report.frames / report.seconds:.2f} frames per second")
    print(f"wrote {output}")
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fv_accel.generate",
        description="Generate a video from a trained student; a causal student streams chunk by chunk.",
        epilog="The mp4 grows as <output>.partial while it is generated (a reader can watch it) and is renamed "
        "to <output> when complete; a failed run removes it.",
    )
    parser.add_argument("run_or_model", metavar="RUN_OR_MODEL", help="a run's output folder, a diffusers model folder or a Hub id")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--num_frames", type=int, required=True, help="video frames (Wan: 4k+1)")
    parser.add_argument("--output", required=True, help="the mp4 to write (grows as <output>.partial meanwhile)")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
