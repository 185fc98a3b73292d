"""What training feeds the transformer is what the stock diffusers pipeline feeds it, family by family.

For each family's tiny model: the stock pipeline (loaded with its own text encoders) runs a prompt
with awkward text (a double space, a newline, `&amp;`, a quoted phrase), with classifier-free
guidance on so that its unconditional branch runs too, and an image where the task has one; a
forward hook records every transformer call (the run stops after the calls wanted). The training
side encodes the same prompt with the family's encoder (preprocessing's and validation's), stores it
in a one-row dataset with the unconditional text preprocessing writes, reads it back through the
loader (kept, and dropped by caption dropout at rate 1), builds the conditioning and runs the
family's training forward on the pipeline's own latents and timestep. Every input the pipeline passes
(text over its real tokens and mask, timesteps, positions, fps, image features, condition latents)
and the output must agree to TOL; the measured differences are in docs/pipeline-consistency.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest
import torch

CPU = torch.device("cpu")
AWKWARD = 'a red  ball\nmoving "left" &amp; the blue box'
TOL = 1e-5
# The Wan pipelines pad text to 512 tokens; test_wan21_t2v runs at that default, the other Wan
# variants at this length on both sides (the pipeline's max_sequence_length and the loader's
# training.data.text_max_length), which keeps their umT5 runs cheap.
SHORT_TEXT = 64
# Inputs that are all zeros on both sides, of a size the transformer does not depend on: HunyuanVideo
# 1.5's text-to-video image embeddings (masked out) and Cosmos' padding mask (resized to the latent's).
ZERO_INPUTS = ("image_embeds", "padding_mask")
# Text inputs, compared over the pipeline's real tokens, and their masks.
TEXT_MASKS = {
    "encoder_hidden_states": "encoder_attention_mask",
    "encoder_hidden_states_2": "encoder_attention_mask_2",
    "audio_encoder_hidden_states": "audio_encoder_attention_mask",  # LTX-2's audio branch
}


class _Stop(Exception):
    """Raised by the recorder once it has the calls it wants: the pipeline run ends there."""


def record_pipeline(pipe, modules: dict[str, torch.nn.Module], calls: int, **call) -> list[tuple[str, dict, torch.Tensor]]:
    """(module name, kwargs, output) of the first `calls` transformer calls of `pipe(**call)`."""
    seen: list = []

    def hook(name):
        def record(module, args, kwargs, output):
            assert not args, "the pipeline passes its transformer inputs by keyword"
            seen.append((name, dict(kwargs), output[0] if isinstance(output, tuple) else output.sample))
            if len(seen) == calls:
                raise _Stop

        return record

    handles = [m.register_forward_hook(hook(n), with_kwargs=True) for n, m in modules.items()]
    pipe.set_progress_bar_config(disable=True)
    try:
        with pytest.raises(_Stop):
            pipe(generator=torch.Generator().manual_seed(0), output_type="latent", **call)
    finally:
        for h in handles:
            h.remove()
    return seen


def record_forward(student, x_t: torch.Tensor, t: torch.Tensor, cond) -> tuple[list[dict], torch.Tensor]:
    """The kwargs of every transformer call of the family's training forward, and its output."""
    seen: list = []
    handles = [
        m.register_forward_pre_hook(lambda module, args, kwargs: seen.append(dict(kwargs)), with_kwargs=True)
        for m in student.modules
    ]
    try:
        with torch.no_grad():
            out = student.forward(x_t, t, cond)
    finally:
        for h in handles:
            h.remove()
    return seen, out


def student_of(model: Path, **overrides):
    from fv_accel.config import default_recipe, load_config
    from fv_accel.models import build_student

    cfg = load_config(default_recipe("finetune"), {"models.student.init_from": str(model), **overrides})
    student = build_student(cfg)
    student.init_preprocessors(cfg.training)
    return student


def loader_batches(
    tmp: Path, model: Path, frames: Optional[np.ndarray] = None, text_max_length: int = 512
) -> tuple[dict, dict, Any]:
    """(kept, dropped) batches of a one-row dataset of AWKWARD encoded by the family's encoder (with
    the clip `frames` where the task has an image), read by the loader without and with caption
    dropout, text padded to `text_max_length`; and the encoder."""
    from fv_accel.data.loader import LatentDataset, collate
    from fv_accel.data.schema import make_row, tensor_columns, write_rows
    from fv_accel.models import family_of_repo
    from fv_accel.models.encoders import TEXT_MAX_LENGTH, TextVideoEncoder
    from fv_accel.preprocess import ensure_unconditional_text

    family = family_of_repo(str(model))
    encoder = family.make_encoder(str(model), device=CPU, dtype=torch.float32)
    if text_max_length != TEXT_MAX_LENGTH:
        # The Wan encoder's padding length: its real tokens do not depend on it (umT5 masks padding).
        assert isinstance(encoder, TextVideoEncoder)
        encoder.text_max_length = text_max_length
    columns = dict(encoder.encode_caption(AWKWARD))
    text = columns.pop("text_embedding")
    latent = torch.zeros(encoder.spec.z_dim, 2, 2, 2)
    if frames is not None:
        latent = encoder.encode_video(frames)
        columns.update(encoder.encode_frames_conditioning(frames))
    extra = {k: v for name, value in columns.items() for k, v in tensor_columns(name, value).items()}
    write_rows([make_row(sample_id="s0", latent=latent, text_embedding=text, caption=AWKWARD, **extra)], tmp / "data.parquet")
    ensure_unconditional_text(tmp, family.unconditional_prompt, "", lambda: encoder)
    kept, dropped = (
        collate([LatentDataset(str(tmp), cfg_rate=rate, text_max_length=text_max_length)[(0, 0, 0)]]) for rate in (0.0, 1.0)
    )
    return kept, dropped, encoder


def input_differences(theirs: dict, ours: dict, row: Optional[int] = None, ours_only: tuple = ()) -> dict[str, float]:
    """Max |difference| of each input the pipeline passed (its batch row `row` when it batches the
    branches) against the training forward's; raises on an input training lacks or one that differs
    in kind. Text is compared over the pipeline's real tokens; beyond them training's is masked or zero."""
    diffs: dict[str, float] = {}

    def pick(value):
        return value[row : row + 1] if row is not None and torch.is_tensor(value) and value.ndim else value

    extra = set(ours) - set(theirs) - set(ours_only)
    assert not extra, f"training passes inputs the pipeline does not: {sorted(extra)}"
    for key, value in theirs.items():
        if value is None or key in ("return_dict", "attention_kwargs"):
            continue
        assert key in ours, f"training passes no {key!r}"
        value, mine = pick(value), ours[key]
        if key in TEXT_MASKS:
            mask_key = TEXT_MASKS[key]
            if mask_key in theirs:
                length = int(pick(theirs[mask_key]).sum())
                assert int(ours[mask_key].sum()) == length, f"{mask_key}: {int(ours[mask_key].sum())} real tokens, not {length}"
            else:  # zero-padded text without a mask (Wan)
                nonzero = value[0].abs().sum(-1).nonzero()
                length = int(nonzero.max()) + 1 if len(nonzero) else 0
                assert not mine[:, length:].abs().sum(), f"{key}: training's padding is not zero"
            diffs[key] = float((value[:, :length].float() - mine[:, :length].float()).abs().max()) if length else 0.0
        elif key in TEXT_MASKS.values():
            continue  # compared with its text
        elif torch.is_tensor(value):
            a, b = value.float().reshape(value.shape[0], -1), mine.float().reshape(mine.shape[0], -1)
            if key in ZERO_INPUTS and not a.abs().sum() and not b.abs().sum():
                diffs[key] = 0.0  # all zeros on both sides; their size is free (module docstring of ZERO_INPUTS)
                continue
            if a.shape != b.shape and 1 in (a.shape[1], b.shape[1]):  # one timestep per sample vs per token
                a, b = torch.broadcast_tensors(a, b)
            assert a.shape == b.shape, f"{key}: {tuple(value.shape)} vs {tuple(mine.shape)}"
            diffs[key] = float((a - b).abs().max())
        elif isinstance(value, (tuple, list)) and value and isinstance(value[0], float):
            diffs[key] = max(abs(float(x) - float(y)) for x, y in zip(value, mine))
        elif isinstance(value, (tuple, list)) and value and torch.is_tensor(value[0]):  # per-axis positions (Kandinsky 5)
            assert [tuple(v.shape) for v in value] == [tuple(m.shape) for m in mine], f"{key}: {value} vs {mine}"
            diffs[key] = max(float((v.float() - m.float()).abs().max()) for v, m in zip(value, mine))
        else:
            assert value == mine, f"{key}: {value!r} vs {mine!r}"
    return diffs


def check_call(student, pipeline_call, x_t, t, cond, *, row=None, ours_only=(), expect_calls=1) -> dict[str, float]:
    """Run the training forward on the pipeline's latents and timestep; every input and the output
    within TOL (returns the differences, `output` included)."""
    _, theirs, output = pipeline_call
    calls, out = record_forward(student, x_t, t, cond)
    assert len(calls) == expect_calls
    diffs = input_differences(theirs, calls[-1], row, ours_only)
    expected = output if row is None else output[row : row + 1]
    diffs["output"] = float((out.float() - student_output(student, expected).float()).abs().max())
    bad = {k: v for k, v in diffs.items() if v > TOL}
    assert not bad, f"training differs from the pipeline: {bad}"
    print(f"{student.family} {diffs}")
    return diffs


def student_output(student, output: torch.Tensor) -> torch.Tensor:
    """The pipeline transformer's output in the layout the family's forward returns."""
    if student.family == "ltx_video":
        return unpack_ltx(student, output)
    if student.family == "kandinsky5":  # channels last
        return output.permute(0, 4, 1, 2, 3)
    return output


def unpack_ltx(student, tokens: torch.Tensor, grid=(2, 2, 2)) -> torch.Tensor:
    from fv_accel.models.ltx_video import unpack_latents

    return unpack_latents(tokens, grid, *student._patch())


def stock_pipeline(model: Path, **components):
    from diffusers import DiffusionPipeline

    return DiffusionPipeline.from_pretrained(str(model), **components)


def clip_frames(count: int, side: int) -> np.ndarray:
    """uint8 [count, side, side, 3]: one smooth image repeated (the pipeline gets frame 0)."""
    yy, xx = np.mgrid[0:side, 0:side]
    image = np.stack([xx * 255 // side, yy * 255 // side, (xx + yy) * 127 // side], axis=-1).astype(np.uint8)
    return np.repeat(image[None], count, axis=0)


# ---- Wan 2.1 / 2.2, SkyReels-V2 ----


def test_wan21_t2v(tmp_path, tiny_model_of):
    model = tiny_model_of("wan21_t2v")
    pipe = stock_pipeline(model)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, prompt=AWKWARD, height=32, width=32, num_frames=5,
        num_inference_steps=2, guidance_scale=2.0,
    )
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model)
    x_t, t = cond_call[1]["hidden_states"], cond_call[1]["timestep"]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


def test_wan21_i2v(tmp_path, tiny_model_of):
    """Channel-concat image-to-video with CLIP image features: the condition latent and the features
    come from the data columns preprocessing writes for the clip whose first frame is the image."""
    from PIL import Image

    model = tiny_model_of("wan21_i2v")
    pipe = stock_pipeline(model)
    frames = clip_frames(5, 32)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, image=Image.fromarray(frames[0]), prompt=AWKWARD, height=32,
        width=32, num_frames=5, num_inference_steps=2, guidance_scale=2.0, max_sequence_length=SHORT_TEXT,
    )
    kept, dropped, _ = loader_batches(tmp_path, model, frames, SHORT_TEXT)
    student = student_of(model)
    x_t, t = cond_call[1]["hidden_states"][:, : student.in_channels], cond_call[1]["timestep"]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


def test_wan22_ti2v_text_to_video(tmp_path, tiny_model_of):
    """expand_timesteps: the pipeline passes one timestep per token, training one per sample (the
    transformer broadcasts it): the values and the output agree."""
    model = tiny_model_of("wan22_ti2v")
    pipe = stock_pipeline(model)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, prompt=AWKWARD, height=64, width=64, num_frames=5,
        num_inference_steps=2, guidance_scale=2.0, max_sequence_length=SHORT_TEXT,
    )
    kept, dropped, _ = loader_batches(tmp_path, model, text_max_length=SHORT_TEXT)
    student = student_of(model, **{"models.student.task": "t2v"})
    x_t, t = cond_call[1]["hidden_states"], cond_call[1]["timestep"][:, 0]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


def test_wan22_ti2v_image_to_video(tmp_path, tiny_model_of):
    """The first latent frame is the image's clean latent at timestep 0: the pipeline's condition
    frame is the data's first latent frame, normalised as training normalises it."""
    from PIL import Image

    from diffusers import WanImageToVideoPipeline

    model = tiny_model_of("wan22_ti2v")
    # The repo's model_index names WanPipeline: its image-to-video pipeline takes the same components.
    pipe = WanImageToVideoPipeline.from_pretrained(str(model), image_encoder=None, image_processor=None)
    frames = clip_frames(5, 64)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, image=Image.fromarray(frames[0]), prompt=AWKWARD, height=64,
        width=64, num_frames=5, num_inference_steps=2, guidance_scale=2.0, max_sequence_length=SHORT_TEXT,
    )
    kept, dropped, _ = loader_batches(tmp_path, model, frames, SHORT_TEXT)
    student = student_of(model, **{"models.student.task": "i2v"})
    cond = student.build_conditioning(kept)
    assert cond.clean_frames == 1
    hidden = cond_call[1]["hidden_states"]
    clean = student.clean_latents(kept)[:, :, :1]
    condition_difference = float((hidden[:, :, :1] - clean).abs().max())
    print(f"wan22_ti2v condition latent: pipeline - data {condition_difference:.3g}")
    assert condition_difference < TOL, condition_difference
    # Training's input: the clean first frame (the data's), the pipeline's noisy latents after it.
    x_t = torch.cat([clean, hidden[:, :, 1:]], dim=2)
    frames_t = cond_call[1]["timestep"].reshape(1, x_t.shape[2], -1)[:, :, 0]  # per token -> per frame
    assert float(frames_t[0, 0]) == 0.0 and float(frames_t[0, 1]) > 0
    check_call(student, cond_call, x_t, frames_t, cond)
    check_call(student, uncond_call, x_t, frames_t, student.build_conditioning(dropped))


def test_wan22_a14b_experts(tmp_path, tiny_model_of):
    """Both experts: the high-noise one for the first step (t >= boundary), the low-noise one after."""
    model = tiny_model_of("wan22_t2v_a14b")
    pipe = stock_pipeline(model)
    calls = record_pipeline(
        pipe, {"transformer": pipe.transformer, "transformer_2": pipe.transformer_2}, 4, prompt=AWKWARD, height=32,
        width=32, num_frames=5, num_inference_steps=2, guidance_scale=2.0, guidance_scale_2=2.0,
        max_sequence_length=SHORT_TEXT,
    )
    assert [name for name, _, _ in calls] == ["transformer", "transformer", "transformer_2", "transformer_2"]
    kept, dropped, _ = loader_batches(tmp_path, model, text_max_length=SHORT_TEXT)
    student = student_of(model, **{"models.student.expert": "both"})
    for k, call in enumerate(calls):
        batch = kept if k % 2 == 0 else dropped
        check_call(student, call, call[1]["hidden_states"], call[1]["timestep"], student.build_conditioning(batch))


def test_skyreels_v2_df_with_sample_info(tmp_path, tiny_model_of):
    """SkyReels-V2-DF-1.3B's fps embedding (`inject_sample_info`, set by diffusers' conversion): the
    pipeline's fps index at its default 24 fps, with per-frame timesteps (diffusion forcing) and
    with one per sample (fine-tuning), which give the same output."""
    model = tiny_model_of("skyreels_v2")
    pipe = stock_pipeline(model)
    assert pipe.transformer.config.inject_sample_info
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, prompt=AWKWARD, height=32, width=32, num_frames=9,
        num_inference_steps=2, guidance_scale=2.0, max_sequence_length=SHORT_TEXT,
    )
    assert cond_call[1]["fps"] == [1] and cond_call[1]["enable_diffusion_forcing"]
    kept, dropped, _ = loader_batches(tmp_path, model, text_max_length=SHORT_TEXT)
    student = student_of(model)
    x_t, t = cond_call[1]["hidden_states"], cond_call[1]["timestep"]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))
    _, out = record_forward(student, x_t, t[:, 0], student.build_conditioning(kept))
    per_sample = float((out - cond_call[2]).abs().max())
    print(f"skyreels_v2 one timestep per sample (fine-tuning): output {per_sample:.3g}")
    assert per_sample < TOL


# ---- LTX-Video ----


@pytest.mark.parametrize("name", ["ltx_video", "ltx_video_condition"])
def test_ltx_video(tmp_path, tiny_model_of, name):
    """LTXPipeline (rope_interpolation_scale, 128-token T5 run without its mask) and
    LTXConditionPipeline (video_coords, 256-token T5 run with its mask), each as its repo names it.
    Both pipelines batch [unconditional, conditional] in one call."""
    model = tiny_model_of(name)
    pipe = stock_pipeline(model)
    ((_, theirs, _),) = call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 1, prompt=AWKWARD, height=64, width=64, num_frames=9,
        num_inference_steps=2, guidance_scale=2.0,
    )
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model)
    assert student.pipeline == type(pipe).__name__
    x_t = unpack_ltx(student, theirs["hidden_states"][1:])
    t = theirs["timestep"][1:].reshape(1, -1)[:, 0]
    # Under LTXConditionPipeline the grid is passed too; the coordinates set the positions.
    grid = ("num_frames", "height", "width") if "video_coords" in theirs else ()
    check_call(student, call[0], x_t, t, student.build_conditioning(kept), row=1, ours_only=grid)
    check_call(student, call[0], x_t, t, student.build_conditioning(dropped), row=0, ours_only=grid)


# ---- HunyuanVideo, HunyuanVideo 1.5, Cosmos-Predict2 ----


def test_hunyuan_video(tmp_path, tiny_model_of):
    """Guidance-distilled: the unconditional branch runs with a negative prompt and true_cfg_scale > 1;
    the empty negative prompt is what caption dropout trains."""
    model = tiny_model_of("hunyuan_video")
    pipe = stock_pipeline(model)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, prompt=AWKWARD, negative_prompt="", true_cfg_scale=2.0,
        height=32, width=32, num_frames=5, num_inference_steps=2,
    )
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model)
    x_t, t = cond_call[1]["hidden_states"], cond_call[1]["timestep"]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


def test_hunyuan_video_15(tmp_path, tiny_model_of):
    """Two text encoders (the quoted phrase is ByT5's glyph text); the unconditional branch encodes
    the empty prompt."""
    from diffusers import ClassifierFreeGuidance

    model = tiny_model_of("hunyuan_video_15")
    pipe = stock_pipeline(model, guider=ClassifierFreeGuidance(guidance_scale=2.0))
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, prompt=AWKWARD, height=64, width=64, num_frames=5,
        num_inference_steps=2,
    )
    assert int(cond_call[1]["encoder_attention_mask_2"].sum()) > 0  # the quoted phrase reached ByT5
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model)
    channels = student.in_channels
    x_t, t = cond_call[1]["hidden_states"][:, :channels], cond_call[1]["timestep"]
    check_call(student, cond_call, x_t, t, student.build_conditioning(kept))
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


def test_cosmos2_video2world(tmp_path, tiny_model_of):
    """Video2World from an image; the unconditional branch encodes the pipeline's default negative
    prompt. The pipeline draws its condition latent from the VAE posterior (a sample), preprocessing
    stores the posterior's mode: training's input frame 0 is the pipeline's here, and the two
    latents' difference is reported."""
    from PIL import Image

    from fv_accel.models.cosmos2 import PassThroughSafetyChecker

    model = tiny_model_of("cosmos2")
    pipe = stock_pipeline(model, safety_checker=PassThroughSafetyChecker())
    frames = clip_frames(5, 32)
    cond_call, uncond_call = record_pipeline(
        pipe, {"transformer": pipe.transformer}, 2, image=Image.fromarray(frames[0]), prompt=AWKWARD, height=32,
        width=32, num_frames=5, num_inference_steps=2, guidance_scale=2.0,
    )
    kept, dropped, _ = loader_batches(tmp_path, model, frames)
    student = student_of(model)
    cond = student.build_conditioning(kept)
    hidden = cond_call[1]["hidden_states"]
    sampled = float((hidden[:, :, :1] - student.clean_latents(kept)[:, :, :1]).abs().max())
    print(f"cosmos2 condition latent: posterior sample - mode {sampled:.3g}")
    frames_t = cond_call[1]["timestep"].reshape(1, -1) * 1000.0  # [B, 1, T, 1, 1] in [0, 1]
    frames_t[:, :1] = 0.0  # a clean condition frame (the family gives it the pipeline's value)
    check_call(student, cond_call, hidden, frames_t, cond)
    check_call(student, uncond_call, hidden, frames_t, student.build_conditioning(dropped))


# ---- LTX-2 (video and audio) ----


def ltx2_check(student, call, cond, row: int, audio_present: bool = True) -> dict[str, float]:
    """The LTX-2 training forward on the pipeline's video and audio latents of batch row `row`: every
    input within TOL, the video output and the audio output (left in the conditioning) too."""
    _, theirs, output = call
    pick = slice(row, row + 1)
    x_t = unpack_ltx(student, theirs["hidden_states"][pick], (theirs["num_frames"], theirs["height"], theirs["width"]))
    timestep = theirs["timestep"][pick]
    t = timestep.reshape(1, -1)[:, 0] if timestep.ndim == 1 else timestep.reshape(1, theirs["num_frames"], -1)[:, :, 0]
    cond.extras["audio_noisy"] = theirs["audio_hidden_states"][pick].float()
    sample = theirs.get("audio_timestep", theirs["timestep"])[pick].reshape(-1)[:1]
    cond.extras["audio_sigmas"] = sample.float() / 1000.0
    calls, out = record_forward(student, x_t, t, cond)
    (ours,) = calls
    # Training names the audio timestep and sigma the pipeline leaves to their defaults (equal values).
    diffs = input_differences(theirs, ours, row, ours_only=("audio_timestep", "audio_sigma"))
    for key in ("audio_timestep", "audio_sigma"):
        if key not in theirs:
            diffs[key] = float((ours[key].float() - sample.float()).abs().max())
    diffs["output"] = float((out.float() - unpack_ltx(student, output[pick], x_t.shape[2:]).float()).abs().max())
    bad = {k: v for k, v in diffs.items() if v > TOL}
    assert not bad, f"training differs from the pipeline: {bad}"
    print(f"ltx2 row {row} {diffs}")
    return diffs


@pytest.mark.parametrize("name,task", [("ltx2", "t2v"), ("ltx2", "i2v"), ("ltx2_3", "t2v"), ("ltx2_3", "i2v"), ("ltx2_5", "t2v")])
def test_ltx2(tmp_path, tiny_model_of, name, task):
    """LTX2Pipeline (text-to-video+audio: one timestep per sample for both branches) and
    LTX2ImageToVideoPipeline (first latent frame clean at timestep 0 per token, audio at the step's t):
    Gemma 3 states through the repo's connectors (video and audio sequences, registers filling the
    padding), video_coords at its frame rate and fps, audio_coords, both branches' inputs and outputs.
    Both pipelines batch [unconditional, conditional] in one call; both rows are checked. LTX-2.3
    (gated attention, prompt modulation read from `sigma`, per-modality connector projections) and
    LTX-2.5 (Gemma 4 states, no video feed-forward bias, keyframe embedding) through the same pipeline."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image

    model = tiny_model_of(name)
    pipe = stock_pipeline(model)
    call_kwargs = dict(prompt=AWKWARD, height=64, width=64, num_frames=9, num_inference_steps=2, guidance_scale=2.0,
                       max_sequence_length=64)
    if task == "i2v":
        pipe = LTX2ImageToVideoPipeline.from_pipe(pipe)
        call_kwargs["image"] = Image.fromarray(clip_frames(1, 64)[0])
    modules = {"transformer": pipe.transformer}
    audio_out: list = []
    handle = pipe.transformer.register_forward_hook(lambda m, a, o: audio_out.append(o[1]))
    try:
        (call,) = record_pipeline(pipe, modules, 1, **call_kwargs)
    finally:
        handle.remove()
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model, **({"models.student.task": "i2v"} if task == "i2v" else {}))
    for row, batch in ((1, kept), (0, dropped)):
        cond = student.build_conditioning(batch)
        assert cond.clean_frames == (1 if task == "i2v" else 0)
        ltx2_check(student, call, cond, row)
        audio = float((cond.extras["audio_prediction"].float() - audio_out[0][row : row + 1].float()).abs().max())
        print(f"ltx2 {task} row {row} audio output {audio:.3g}")
        assert audio <= TOL


# ---- Kandinsky 5 ----


@pytest.mark.parametrize("name", ["kandinsky5", "kandinsky5_i2v"])
def test_kandinsky5(tmp_path, tiny_model_of, name):
    """Kandinsky5T2VPipeline and Kandinsky5I2VPipeline: Qwen2.5-VL states unpadded (no text mask) with
    text_rope_pos over them, CLIP's pooled output, channels-last latents with the zero condition latent
    and the first-frame mask, visual RoPE positions and the resolution's scale factor; the
    unconditional branch runs the pipeline's default negative prompt, which caption dropout trains.
    Under the I2V pipeline the first latent frame is the image's clean latent at the step's timestep;
    the pipeline samples the VAE posterior, preprocessing stores its mode: training's input frame 0 is
    the pipeline's, and the two latents' difference is reported."""
    from PIL import Image

    model = tiny_model_of(name)
    pipe = stock_pipeline(model)
    call = dict(prompt=AWKWARD, height=64, width=64, num_frames=17, num_inference_steps=2, guidance_scale=2.0)
    frames = clip_frames(17, 64) if name.endswith("_i2v") else None
    if frames is not None:
        call["image"] = Image.fromarray(frames[0])
    cond_call, uncond_call = record_pipeline(pipe, {"transformer": pipe.transformer}, 2, **call)
    kept, dropped, _ = loader_batches(tmp_path, model, frames)
    student = student_of(model)
    cond = student.build_conditioning(kept)
    x_t = cond_call[1]["hidden_states"][..., : student.in_channels].permute(0, 4, 1, 2, 3)
    t = cond_call[1]["timestep"]
    if frames is not None:
        assert cond.clean_frames == 1 and bool(cond_call[1]["hidden_states"][:, 0, ..., -1].eq(1).all())
        sampled = float((x_t[:, :, :1] - student.clean_latents(kept)[:, :, :1]).abs().max())
        print(f"kandinsky5 condition latent: posterior sample - mode {sampled:.3g}")
        # As the method gives it: per frame, the clean condition frame at 0.
        t = torch.cat([t.new_zeros(1, 1), t[:, None].expand(1, x_t.shape[2] - 1)], dim=1)
    check_call(student, cond_call, x_t, t, cond)
    check_call(student, uncond_call, x_t, t, student.build_conditioning(dropped))


# ---- MiniMax-H3 (video with its sound) ----


def test_minimax_h3(tmp_path, tiny_model_of):
    """MiniMaxH3ModularPipeline (t2va): the Qwen3-VL prompt states unpadded, the packed layout
    (position_ids in float64, token tags, video / audio / text row indices), the patchified video
    rows, the channel-major audio rows, and the two modalities' timesteps at a step inside the loop
    (video shift 12, audio shift 3: training's audio sigma, mapped from the video's, is the
    pipeline's); the video and audio outputs (training's eps - x0 is minus the pipeline's velocity)."""
    from diffusers import ModularPipeline

    from fv_accel.models.minimax_h3 import TextTokenTypes, unpatchify

    model = tiny_model_of("minimax_h3")
    pipe = ModularPipeline.from_pretrained(str(model))
    pipe.load_components(names=[n for n in pipe.pretrained_component_names if n != "processor"])
    pipe.update_components(processor=TextTokenTypes())  # the tiny repo's (transformers needs torchvision for it)
    seen: list = []
    # Cloned: the scheduler step writes the latents in place, under the views the pipeline passed.
    hook = pipe.transformer.register_forward_hook(
        lambda m, a, k, o: seen.append(({n: v.clone() if torch.is_tensor(v) else v for n, v in k.items()}, o)),
        with_kwargs=True,
    )
    try:
        pipe(prompt=AWKWARD, height=32, width=32, num_frames=124, num_inference_steps=4, generator=torch.Generator().manual_seed(0))
    finally:
        hook.remove()
    assert len(seen) == 3
    kept, dropped, _ = loader_batches(tmp_path, model)
    student = student_of(model, **{"callbacks.validation.enable": False})  # the family makes no sample videos
    cond = student.build_conditioning(kept)
    for theirs, (video_out, audio_out) in seen[1:]:
        video_t = theirs["timestep"][theirs["timestep_indices"][theirs["video_indices"][0]]]
        audio_t = theirs["timestep"][theirs["timestep_indices"][theirs["audio_indices"][0]]]
        assert 0.0 < float(video_t) < float(audio_t) < 1.0  # in step, the audio ahead (its shift is smaller)
        sigma = (1.0 - video_t).reshape(1)
        frames, side = 37, 8  # 124 frames -> 5 * 7 + 2 latent frames; 32 px / 4
        x_t = unpatchify(theirs["hidden_states"], 24, frames, side, side, (1, 2, 2))
        cond.extras["audio_noisy"] = theirs["audio_hidden_states"]
        cond.extras["audio_sigmas"] = student.audio_sigmas(sigma)
        calls, out = record_forward(student, x_t, sigma * 1000.0, cond)
        (ours,) = calls
        diffs = input_differences(theirs, ours)
        diffs["audio_timestep"] = float((1.0 - cond.extras["audio_sigmas"][0] - audio_t).abs())
        diffs["output"] = float((out + unpatchify(video_out, 24, frames, side, side, (1, 2, 2))).abs().max())
        diffs["audio_output"] = float((cond.extras["audio_prediction"] + audio_out).abs().max())
        print(f"minimax_h3 {diffs}")
        assert max(diffs.values()) <= 1e-6, diffs
        assert ours["position_ids"].dtype == torch.float64 and int(ours["text_indices"].numel()) == int(kept["text_attention_mask"].sum())
