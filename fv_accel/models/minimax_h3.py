"""The MiniMax-H3 family: `MiniMaxH3Transformer3DModel` of MiniMaxAI/MiniMax-H3 (text to video with
its sound, `t2va`), as diffusers 0.42's `MiniMaxH3ModularPipeline` runs it.

What the modular pipeline does (`MiniMaxH3CoreDenoiseStep`), and this family with it:

- One packed sequence per sample, `[text | target audio | target video]`, built by the pipeline's
  own `MiniMaxH3PrepareLayoutStep.build_packed_sequence` (float64 `(t, h, w)` rotary grid, modality
  tags text 1 / audio 2 / video 0, the three row-index tensors). The batch axis of the transformer is
  a replication axis over one layout, so `forward` makes one transformer call per sample.
- Text: the prompt's Qwen3-VL `hidden_states[50]`, unpadded (no chat template, no special tokens):
  the `text_embedding` column's real rows (its mask).
- Video: normalised latents ((raw - vae.latents_mean) / vae.latents_std) patchified by the pipeline's
  `patchify_video_latents` (frame-major rows of C * pt * ph * pw).
- Audio: the mono audio VAE's latents of the two stereo channels, [2, 32, L] raw, normalised per
  feature with audio_vae.latents_mean / latents_std and packed channel-major into rows [2 * L, 32]
  (the `AudioLatents` this family hands the methods are these rows, [B, 2L, 32]).
- Timesteps: `t = 1 - sigma` in [0, 1] (1 = clean), one per modality, reduced to the transformer's
  `(timestep, timestep_indices)` by the pipeline's `MiniMaxH3SetTimestepsStep.build_row_timesteps`.
  The two schedules (scheduler/ shift 12, audio_scheduler/ shift 3) move in step: at every step both
  are the same base level u pushed through their own shift. Training does the same (FastVideo's
  minimax_h3 plugin): the method draws the video sigma from the table (the repo's video shift), and
  `audio_sigmas` maps it back to u and through the audio shift.
- Output: the velocity towards the data (x0 = x_t + sigma * v); `forward` returns its negative, the
  methods' eps - x0, for video and (in `cond.extras["audio_prediction"]`) for audio.

`models.student.train_audio` (FastVideo's name, as for LTX-2): false (the default) freezes the only
audio-specific weights, `audio_proj_in` and `audio_proj_out` (no gradient, no LoRA on them: a video-only
LoRA file has no audio key); the audio rows are still in the sequence (the video attends to them),
noised at their own level. True trains both, the audio loss weighted by `training.audio.loss_weight`,
and the LoRA reaches the two audio projections too.

Refused in one line: per-frame timesteps (DFSFT: one timestep per modality), image or reference
conditioning (`task: i2v`; the pipeline's `fl2va` / `ref2va`), sample videos during training
(`callbacks.validation.enable`: run the modular pipeline on the LoRA file instead).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import torch
from diffusers import MiniMaxH3Transformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, TrainingBatch, register_family
from fv_accel.models.encoders import FamilyEncoder
from fv_accel.models.ltx2 import AudioLatents, LTX2Student
from fv_accel.models.student import DiffusersStudent

# The released schedulers' shifts (scheduler/ and audio_scheduler/ of the repo), the defaults of a
# student built without a repo.
VIDEO_SHIFT = 12.0
AUDIO_SHIFT = 3.0
MODULAR_PIPELINE = "MiniMaxH3ModularPipeline"
# The transformer's only audio-specific weights (everything else is shared by the modalities).
AUDIO_MODULES = ("audio_proj_in", "audio_proj_out")
ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """MiniMaxH3Scheduler's exponential shift of a unit noise level: s * u / (1 + (s - 1) * u)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def unshift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """The inverse of `shift_sigma`: the base level u a shifted sigma came from."""
    return sigma / (shift - (shift - 1.0) * sigma)


def audio_sigma_in_step(video_sigma: torch.Tensor, video_shift: float, audio_shift: float) -> torch.Tensor:
    """The audio sigma at the step of `video_sigma` (both schedules are one base level through their
    own shift), computed in float64."""
    base = unshift_sigma(video_sigma.double(), video_shift)
    return shift_sigma(base, audio_shift).to(video_sigma.dtype)


def layout_of(num_text: int, frames: int, height: int, width: int, num_audio_latents: int, patch: tuple) -> tuple:
    """The t2va packed layout (`MiniMaxH3PrepareLayoutStep.build_packed_sequence`): position_ids,
    token_tags, video_indices, audio_indices, text_indices."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
    )

    tags = torch.full((num_text,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    out = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, frames, height, width, num_audio_latents, tuple(patch), MINIMAX_H3_AUDIO_CHANNELS,
        MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG, (),
    )
    return out[:5]


def row_timesteps(layout: tuple, video_t: float, audio_t: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(distinct timesteps, per-row index) for a layout at video / audio timesteps `t = 1 - sigma`
    (`MiniMaxH3SetTimestepsStep.build_row_timesteps`, no conditioning rows)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3SetTimestepsStep

    _, _, video_indices, audio_indices, text_indices = layout
    return MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_indices, audio_indices, 0, 0, text_indices.numel(), video_t, audio_t, video_t, 1.0
    )


def unpatchify(rows: torch.Tensor, channels: int, frames: int, height: int, width: int, patch: tuple) -> torch.Tensor:
    """Video rows [1, N, C * pt * ph * pw] -> [1, C, T, H, W] (the pipeline's after-denoise step)."""
    pt, ph, pw = patch
    x = rows.reshape(-1, frames // pt, height // ph, width // pw, channels, pt, ph, pw)
    return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(-1, channels, frames, height, width)


def pack_audio_rows(raw: torch.Tensor, mean: Optional[torch.Tensor], std: Optional[torch.Tensor]) -> torch.Tensor:
    """Raw audio latents [B, 2, D, L] -> normalised channel-major rows [B, 2 * L, D]."""
    x = raw.float()
    if mean is not None:
        x = (x - mean.view(1, 1, -1, 1).to(x.device)) / std.view(1, 1, -1, 1).to(x.device)
    return x.permute(0, 1, 3, 2).reshape(x.shape[0], -1, x.shape[2])


def audio_latents_for(num_latent_frames: int) -> int:
    """The pipeline's audio length (latents per channel) for a video of `num_latent_frames` latent frames."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

    num_frames = (num_latent_frames - 2) // 5 * 17 + 5  # the inverse of video_latent_num_frames (17 n + 5 -> 5 n + 2)
    return audio_latent_num_frames(num_frames)


class TextTokenTypes:
    """The `create_mm_token_type_ids` of the repo's Qwen3VLProcessor for a text-only prompt: 0 (text)
    for every token (the processor marks only its image / video pad tokens, which t2va never
    places). Stands in for the processor, which transformers builds only with torchvision."""

    def create_mm_token_type_ids(self, input_ids: list) -> list:
        return [[0] * len(ids) for ids in input_ids]


# ---- preprocessing ----
class MiniMaxH3Encoder(FamilyEncoder):
    """MiniMax-H3's video VAE, audio VAE and Qwen3-VL conditioner, eval mode, no grad."""

    frame_rate = 24.0  # MINIMAX_H3_FPS: everything the model takes is resampled onto it

    def __init__(self, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        from diffusers import AutoencoderKLMiniMaxH3Audio
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

        from fv_accel.models.loading import explain_load_error

        self.device, self.dtype = device or torch.device("cpu"), dtype
        self.spec = spec or MiniMaxH3Student.encoding_spec(model, revision)
        try:
            self.vae = MiniMaxH3Student.load_vae(model, revision=revision, torch_dtype=dtype)
            self.audio_vae = AutoencoderKLMiniMaxH3Audio.from_pretrained(model, subfolder="audio_vae", revision=revision, torch_dtype=dtype)
            self.tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer", revision=revision)
            self.text_encoder = Qwen3VLForConditionalGeneration.from_pretrained(
                model, subfolder="text_encoder", revision=revision, torch_dtype=dtype
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "VAEs and Qwen3-VL text encoder", err, revision=revision) from None
        for part in (self.vae, self.audio_vae, self.text_encoder):
            part.to(self.device).eval().requires_grad_(False)
        if vae_tiling:
            self.vae.enable_tiling()

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] (F = 17 n + 5) -> raw latent [24, 5 n + 2, h, w]: the pipeline's pixels
        (ImageNet-normalised [0, 1]), the posterior's mode."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P

        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None].to(self.device, torch.float32) / 255.0
        mean = torch.tensor(P.pixel_mean.fget(None), device=self.device).view(1, 3, 1, 1, 1)
        std = torch.tensor(P.pixel_std.fget(None), device=self.device).view(1, 3, 1, 1, 1)
        return self.vae.encode(((video - mean) / std).to(self.dtype)).latent_dist.mode()[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, D]}: the prompt's Qwen3-VL hidden_states[50] (MiniMaxH3TextEncoderStep)."""
        from diffusers.modular_pipelines.minimax_h3.encoders import get_qwen3vl_prompt_embeds
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline as P

        token_ids = self.tokenizer(caption, add_special_tokens=False)["input_ids"]
        if not token_ids:
            return {"text_embedding": torch.zeros(0, int(self.text_encoder.config.text_config.hidden_size))}
        embeds = get_qwen3vl_prompt_embeds(
            self.text_encoder, TextTokenTypes(), token_ids, {}, text_encoder_layer=P.text_encoder_layer.fget(None),
            device=self.device, dtype=torch.float32,
        )
        return {"text_embedding": embeds[0].cpu()}

    def latent_statistics(self) -> tuple[list, list]:
        return list(self.vae.config.latents_mean), list(self.vae.config.latents_std)

    # ---- sound (fv_accel.data.audio.encode_clip_audio) ----
    @property
    def audio_sample_rate(self) -> int:
        return int(self.audio_vae.config.sampling_rate)

    def audio_window(self, num_frames: int, frame_rate: float) -> tuple[int, int]:
        """(audio latents, waveform samples) for `num_frames` frames at `frame_rate`: the pipeline's
        audio length (40 latents per second) and the samples they span."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import audio_latent_num_frames

        latents = audio_latent_num_frames(num_frames, fps=frame_rate)
        return latents, latents * self.audio_sample_rate // 40

    @torch.no_grad()
    def encode_audio(self, waveform: np.ndarray) -> torch.Tensor:
        """Stereo waveform [2, S] -> raw latents [2, 32, L] (the mono VAE over the two channels, the
        posterior's mode), cut to the window's length."""
        wave = torch.as_tensor(np.asarray(waveform), dtype=torch.float32, device=self.device)[:, None]
        latents = self.audio_vae.encode(wave.to(self.dtype)).latent_dist.mode().float().cpu()
        return latents[..., : wave.shape[-1] * 40 // self.audio_sample_rate]

    def silent_audio(self, latent_frames: int) -> torch.Tensor:
        """The stored audio latent of a clip kept without sound: zeros [2, 32, L] (never trained on)."""
        return torch.zeros(2, int(self.audio_vae.config.latent_channels), latent_frames)


@register_family
class MiniMaxH3Student(DiffusersStudent):
    """MiniMax-H3 text-to-video+audio: fine-tuning (video only, or joint with `train_audio`), full or LoRA."""

    family = "minimax_h3"
    vae_class_names = ("AutoencoderKLMiniMaxH3",)
    transformer_classes = {"minimax_h3": MiniMaxH3Transformer3DModel}
    pipeline_class_names = (MODULAR_PIPELINE,)
    capabilities = Capabilities(per_frame_timesteps=False, causal_attention=False, image_conditioning=False)
    lora_target_modules = ATTENTION_PROJECTIONS
    per_frame_refusal = (
        "MiniMaxH3Transformer3DModel takes one timestep per modality of the packed sequence (timestep [num_levels] "
        "with a per-row index), not one per latent frame"
    )
    has_audio = True
    default_flow_shift = VIDEO_SHIFT
    # train_audio false: no gradient, no LoRA on these (LTX2Student.after_setup's rule: names with "audio").
    after_setup = LTX2Student.after_setup
    clean_audio = LTX2Student.clean_audio

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import MiniMaxH3ModularPipeline

        return MiniMaxH3ModularPipeline

    @classmethod
    def default_lora_targets(cls, config: Any, student_config: Any) -> tuple[str, ...]:
        """The attention projections of every block and refiner block; with train_audio the two
        audio projections too."""
        return ATTENTION_PROJECTIONS + (AUDIO_MODULES if student_config.train_audio else ())

    # ---- set-up ----
    def configure(self, config: Any) -> None:
        """train_audio (joint training with the finetune method only), its LoRA targets, the two
        schedules' shifts (the repo's scheduler/ and audio_scheduler/)."""
        st = self.student_config
        if st.task == "i2v":
            raise ValueError(
                "models.student.task is i2v but the minimax_h3 family trains text-to-video+audio (t2va) only: "
                "set t2v or auto"
            )
        self.trains_audio = bool(st.train_audio)
        if self.trains_audio and self.run_config.method.name != "finetune":
            from fv_accel.config import ConfigError

            raise ConfigError(
                f"models.student.train_audio: true trains with method.name finetune; {self.run_config.method.name} "
                "trains the MiniMax-H3 video only: set models.student.train_audio: false"
            )
        if self.run_config.callbacks.validation.enable:
            from fv_accel.config import ConfigError

            raise ConfigError(
                "callbacks.validation.enable: the minimax_h3 family makes no sample videos during training (its video "
                "and sound denoise together in MiniMaxH3ModularPipeline): set it false and run the pipeline on the LoRA file"
            )
        self.lora_target_modules = self.default_lora_targets(config, st)
        self.video_shift, self.audio_shift = VIDEO_SHIFT, AUDIO_SHIFT
        self.audio_mean = self.audio_std = None
        if st.init_from is not None:
            from fv_accel.models.loading import fetch_config

            def shift(subfolder: str, default: float) -> float:
                sc = fetch_config(st.init_from, subfolder, revision=st.revision, required=False, filename="scheduler_config.json")
                return float((sc or {}).get("shift", default))

            self.video_shift, self.audio_shift = shift("scheduler", VIDEO_SHIFT), shift("audio_scheduler", AUDIO_SHIFT)
        if st.flow_shift is not None:  # the shift the video's training table uses (training_shift)
            self.video_shift = float(st.flow_shift)

    def init_preprocessors(self, training_config: Any) -> None:
        """The video latents' statistics (vae/config.json) and the audio VAE's (audio_vae/config.json)."""
        super().init_preprocessors(training_config)
        st = self.student_config
        if st.init_from is not None:
            from fv_accel.models.loading import fetch_config

            audio = fetch_config(st.init_from, "audio_vae", revision=st.revision, required=False) or {}
            if audio.get("latents_mean") is not None:
                self.audio_mean = torch.tensor(audio["latents_mean"], dtype=torch.float32)
                self.audio_std = torch.tensor(audio["latents_std"], dtype=torch.float32)

    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.encoders import AUDIO, TEXT, EncodingSpec
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=False) or {}
        spatial = int(np.prod(vae.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1))))
        temporal = int(np.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1))))
        return EncodingSpec(
            conditioning=(TEXT, AUDIO),
            z_dim=int(vae.get("latent_channels", 24)),
            scale_factor_spatial=spatial,
            scale_factor_temporal=temporal,
            patch_size=tuple(int(p) for p in transformer.get("patch_size", (1, 2, 2))),
        )

    @classmethod
    def make_encoder(cls, model, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        return MiniMaxH3Encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        return list(vae["latents_mean"]), list(vae["latents_std"])

    @classmethod
    def load_vae(cls, model, *, revision=None, torch_dtype=torch.float32):
        from diffusers import AutoencoderKLMiniMaxH3

        return AutoencoderKLMiniMaxH3.from_pretrained(model, subfolder="vae", revision=revision, torch_dtype=torch_dtype)

    # ---- audio ----
    def audio_sigmas(self, video_sigmas: torch.Tensor) -> torch.Tensor:
        """The audio's sigma at the step of each video sigma (the methods noise the audio at it)."""
        return audio_sigma_in_step(video_sigmas, self.video_shift, self.audio_shift)

    def normalize_audio(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored audio latents [B, 2, 32, L] -> normalised rows [B, 2L, 32] (the pipeline's layout)."""
        return pack_audio_rows(raw, self.audio_mean, self.audio_std)

    def silent_audio(self, batch_size: int, num_latent_frames: int) -> AudioLatents:
        """Zeros of the pipeline's audio length for `num_latent_frames` video latent frames, marked absent."""
        from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MINIMAX_H3_AUDIO_CHANNELS

        rows = audio_latents_for(num_latent_frames) * MINIMAX_H3_AUDIO_CHANNELS
        width = int(self.modules[0].config.audio_in_channels)
        packed = torch.zeros(batch_size, rows, width, device=self.device)
        return AudioLatents(packed, torch.zeros(batch_size, dtype=torch.bool, device=self.device))

    def prepare_batch(self, batch: dict, *, generator: Any = None, latents_source: str = "data") -> TrainingBatch:
        """Clean video latents, conditioning and the clean audio rows (`extras["audio"]`)."""
        tb = super().prepare_batch(batch, generator=generator, latents_source=latents_source)
        tb.extras["audio"] = self.clean_audio(batch, tb.latents.shape[2])
        return tb

    # ---- the transformer ----
    def transformer_inputs(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning, index: int) -> dict[str, Any]:
        """The keyword arguments of the transformer call for sample `index` of x_t [B, C, T, H, W] at
        t [B] (sigma * 1000), as MiniMaxH3LoopDenoiser builds them."""
        from diffusers.modular_pipelines.minimax_h3.before_denoise import patchify_video_latents

        if t.ndim != 1:
            raise ValueError(f"the minimax_h3 family cannot take a timestep per latent frame: {self.per_frame_refusal}")
        audio, audio_sigma = cond.extras.get("audio_noisy"), cond.extras.get("audio_sigmas")
        if audio is None or audio_sigma is None:
            raise ValueError("the MiniMax-H3 forward needs the noisy audio (cond.extras['audio_noisy'], set by the method)")
        _, _, frames, height, width = x_t.shape
        length = int(cond.text_mask[index].sum()) if cond.text_mask is not None else cond.text.shape[1]
        layout = layout_of(length, frames, height, width, audio.shape[1] // 2, self.patch_size)
        video_t = 1.0 - float(t[index]) / 1000.0
        timestep, timestep_indices = row_timesteps(layout, video_t, 1.0 - float(audio_sigma[index]))
        device = x_t.device
        position_ids, token_tags, video_indices, audio_indices, text_indices = (v.to(device) for v in layout)
        return dict(
            hidden_states=patchify_video_latents(x_t[index : index + 1].float(), self.patch_size)[None],
            audio_hidden_states=audio[index : index + 1].float(),
            encoder_hidden_states=cond.text[index : index + 1, :length].to(self.input_dtype),
            timestep=timestep.to(device),
            timestep_indices=timestep_indices.to(device),
            token_tags=token_tags,
            position_ids=position_ids,
            video_indices=video_indices,
            audio_indices=audio_indices,
            text_indices=text_indices,
            attention_kwargs=None,
            return_dict=False,
        )

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity eps - x0 [B, C, T, H, W] for x_t at t ([B] = sigma * 1000); the audio rows'
        (the same convention, [B, 2L, 32]) go to `cond.extras["audio_prediction"]`. One transformer
        call per sample (one packed layout per call)."""
        _, channels, frames, height, width = x_t.shape
        videos, audios = [], []
        for index in range(x_t.shape[0]):
            video, audio = self.transformer(**self.transformer_inputs(x_t, t, cond, index))
            videos.append(-unpatchify(video, channels, frames, height, width, self.patch_size))
            audios.append(-audio)
        cond.extras["audio_prediction"] = torch.cat(audios)
        return torch.cat(videos).to(x_t.dtype)


__all__ = ["MiniMaxH3Student", "audio_sigma_in_step", "layout_of", "row_timesteps", "shift_sigma", "unshift_sigma"]
