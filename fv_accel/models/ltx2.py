"""The LTX-2 family: `LTX2VideoTransformer3DModel` (Lightricks/LTX-2, diffusers layout), a video branch
and an audio branch joined by audio-to-video and video-to-audio cross-attention.

Training calls the transformer as `LTX2Pipeline` (text-to-video+audio) and `LTX2ImageToVideoPipeline`
(first frame clean, at timestep 0) do:
- Text: the Gemma 3 hidden states of every layer (`_get_gemma_prompt_embeds`, left padding) through
  the repo's frozen text connectors (`LTX2TextConnectors`), which give the video and the audio branch
  their own sequences and the attention mask. Preprocessing stores both sequences (`text_embedding`,
  `audio_text_embedding`); their length is the pipeline's `max_sequence_length` (1024), or the
  tokenizer's `model_max_length` where smaller (the tiny model's 64).
- Video: normalised latents ((x - latents_mean) * scaling_factor / latents_std) packed into tokens
  (`_pack_latents`), with the pipeline's `video_coords` at its default frame rate (24) and `fps`.
- Audio: the audio VAE's latents [C, L, M] packed to [L, C * M] and normalised per feature with its
  `latents_mean`/`latents_std` buffers, as `prepare_audio_latents` does, with `audio_coords`.
- Timesteps: the video's [B] (or per token, from per latent frame [B, T]); the audio's one per
  sample (`audio_timestep`), `sigma` the sample's timestep, `use_cross_timestep` as the pipeline's
  default. Values are sigma * 1000; the outputs are velocities (eps - x0).

LTX-2.3 and LTX-2.5 (diffusers/LTX-2.3-Diffusers, Lightricks/LTX-2.5-Diffusers) are the same family:
their differences are config flags the checkpoint sets and the stock classes read (`ltx2_version`
names them): the transformer's gated attention and prompt modulation (fed the step's `sigma`, as the
pipelines pass it), split RoPE, no caption projection, 2.5's bias-free video feed-forward and
keyframe embedding (which LTX2Pipeline never feeds: it stays unused); the connectors' per-modality
projections; the 2.3 VAE decoder; the bandwidth-extension vocoder (the class model_index.json names);
LTX-2.5's Gemma 4 text encoder (`LTX2_TEXT_ENCODERS`, the class model_index.json names). A transformer
config key the installed diffusers does not know, or another text encoder, is refused in one line.

`models.student.train_audio` (FastVideo's name): false (the default) freezes the audio branch and the
cross-modal layers (no gradient, not in the optimizer, no LoRA on them); the audio branch is still run
(the video attends to it), fed the clip's audio noised at the sample's level or, for a clip without
sound, pure noise. True trains both, the audio loss weighted by `training.audio.loss_weight`.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
from diffusers import LTX2VideoTransformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, TrainingBatch, register_family
from fv_accel.models.encoders import AUDIO, TEXT, EncodingSpec, FamilyEncoder
from fv_accel.models.student import DiffusersStudent

logger = logging.getLogger(__name__)

LTX2_PIPELINE = "LTX2Pipeline"
LTX2_PIPELINES = (LTX2_PIPELINE, "LTX2ImageToVideoPipeline", "LTX2ConditionPipeline")


def pipeline_default(name: str, pipeline: str = LTX2_PIPELINE) -> Any:
    import inspect

    import diffusers

    return inspect.signature(getattr(diffusers, pipeline).__call__).parameters[name].default


# LTX2Pipeline's defaults: the frame rate its samples' positions use, its prompt length and whether
# the cross-modal modulation reads the other modality's timestep.
LTX2_FRAME_RATE = float(pipeline_default("frame_rate"))
LTX2_MAX_SEQUENCE_LENGTH = int(pipeline_default("max_sequence_length"))
LTX2_USE_CROSS_TIMESTEP = bool(pipeline_default("use_cross_timestep"))

# Parameters of the audio branch and of the layers joining the two branches: what train_audio false
# freezes and keeps LoRA off.
_AUDIO_OR_CROSS_MODAL = re.compile(r"(audio|av_cross_attn|a2v|v2a)")


def is_audio_or_cross_modal(name: str) -> bool:
    """Whether parameter/module `name` of an LTX2VideoTransformer3DModel belongs to the audio branch
    or the cross-modal (audio-to-video, video-to-audio) layers."""
    return bool(_AUDIO_OR_CROSS_MODAL.search(name))


def conditioning_frame_rate(frame_rate: float) -> float:
    """The `fps` LTX2Pipeline conditions positions on at `frame_rate` (default motion speed)."""
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate as rule

    return float(rule(frame_rate, pipeline_default("motion_speed")))


# The text encoders of the LTX-2 checkpoints diffusers publishes (model_index.json's class): Gemma 3
# (LTX-2.0, 2.3), Gemma 4 (LTX-2.5); each gives LTX2Pipeline the hidden states of every layer.
LTX2_TEXT_ENCODERS = ("Gemma3ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")


def ltx2_version(config: dict) -> str:
    """"2.0", "2.3" or "2.5": the LTX-2 release a transformer config's flags are (gated attention and
    prompt modulation from 2.3 on; the keyframe embedding or a bias-free video feed-forward from 2.5)."""
    if config.get("use_keyframes_abs_pos_embedding", False) or not config.get("ff_bias", True):
        return "2.5"
    if config.get("cross_attn_mod", False) or config.get("gated_attn", False):
        return "2.3"
    return "2.0"


def check_transformer_config(config: dict, model: str) -> None:
    """Refuse, in one line, an LTX-2 transformer config.json that sets a key the installed diffusers'
    LTX2VideoTransformer3DModel does not take (a later release's flag, which loading would drop)."""
    import inspect

    import diffusers

    known = set(inspect.signature(LTX2VideoTransformer3DModel.__init__).parameters)
    unknown = sorted(k for k in config if not k.startswith("_") and k not in known)
    if unknown:
        raise ValueError(
            f"{model}: its transformer config sets {', '.join(unknown)}, which diffusers {diffusers.__version__}'s "
            f"LTX2VideoTransformer3DModel does not know (a newer LTX-2 release than LTX-{ltx2_version(config)}): upgrade diffusers"
        )


def text_encoder_class(model: str, revision: Optional[str] = None) -> type:
    """The text encoder class the repo's model_index.json names (Gemma 3, or LTX-2.5's Gemma 4);
    another one is refused in one line."""
    import transformers

    from fv_accel.models.loading import fetch_config

    index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
    name = (index.get("text_encoder") or [None, LTX2_TEXT_ENCODERS[0]])[1]
    if name not in LTX2_TEXT_ENCODERS:
        raise ValueError(f"{model}: text encoder {name} is not one the LTX-2 family runs ({', '.join(LTX2_TEXT_ENCODERS)})")
    return getattr(transformers, name)


def audio_latent_frames(num_frames: int, frame_rate: float, audio_config: dict) -> int:
    """LTX2Pipeline's audio latent length for `num_frames` pixel frames at `frame_rate`."""
    per_second = float(audio_config["sample_rate"]) / float(audio_config["mel_hop_length"]) / 4.0
    return round(num_frames / frame_rate * per_second)


# LTX-2's audio front end (its trainer's and FastVideo's): a 1024-point STFT (Hann window of the same
# length, centred frames, reflect padding), magnitudes through a Slaney-scale, Slaney-normalised mel
# filter bank from 0 Hz to half the sample rate, then the log (floor 1e-5).
LTX2_AUDIO_N_FFT = 1024


def log_mel(waveform: torch.Tensor, sample_rate: int, hop_length: int, mel_bins: int, n_fft: int = LTX2_AUDIO_N_FFT) -> torch.Tensor:
    """[channels, samples] -> log-mel spectrogram [channels, frames, mel_bins], frames = samples // hop + 1."""
    from transformers.audio_utils import mel_filter_bank

    window = torch.hann_window(n_fft, device=waveform.device, dtype=torch.float32)
    spec = torch.stft(
        waveform.float(), n_fft=n_fft, hop_length=hop_length, win_length=n_fft, window=window, center=True,
        pad_mode="reflect", return_complex=True,
    ).abs()  # [channels, n_fft // 2 + 1, frames]
    bank = mel_filter_bank(
        n_fft // 2 + 1, mel_bins, 0.0, sample_rate / 2.0, sample_rate, norm="slaney", mel_scale="slaney"
    )  # [n_fft // 2 + 1, mel_bins]
    mel = torch.einsum("cft,fm->ctm", spec, torch.from_numpy(bank).to(spec))
    return torch.log(torch.clamp(mel, min=1e-5))


def pack_audio(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, L, M] -> [B, L, C * M] (LTX2Pipeline._pack_audio_latents without patches)."""
    from diffusers import LTX2Pipeline

    return LTX2Pipeline._pack_audio_latents(latents)


def unpack_audio(tokens: torch.Tensor, mel_bins: int) -> torch.Tensor:
    from diffusers import LTX2Pipeline

    return LTX2Pipeline._unpack_audio_latents(tokens, tokens.shape[1], mel_bins)


@dataclass
class AudioLatents:
    """A batch's clean audio: normalised packed latents [B, L, C * M] and which samples have sound [B]."""

    latents: torch.Tensor
    present: torch.Tensor


class LTX2Encoder(FamilyEncoder):
    """LTX-2's video VAE, audio VAE, Gemma 3 text encoder and text connectors, eval mode, no grad."""

    frame_rate = LTX2_FRAME_RATE  # of a still image's (silent) audio window

    def __init__(self, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2Pipeline
        from diffusers.pipelines.ltx2 import LTX2TextConnectors

        from fv_accel.models.loading import explain_load_error, load_text_encoder

        self.model, self.revision = model, revision
        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.spec = spec or LTX2Student.encoding_spec(model, revision)
        parts = {}
        for name, cls in (("vae", AutoencoderKLLTX2Video), ("audio_vae", AutoencoderKLLTX2Audio), ("connectors", LTX2TextConnectors)):
            try:
                parts[name] = cls.from_pretrained(model, subfolder=name, revision=revision, torch_dtype=dtype, use_safetensors=True)
            except (OSError, ValueError) as err:
                raise explain_load_error(model, f"{name} (subfolder '{name}')", err, revision=revision) from None
            parts[name].to(self.device).eval().requires_grad_(False)
        self.vae, self.audio_vae, self.connectors = parts["vae"], parts["audio_vae"], parts["connectors"]
        if vae_tiling:
            self.vae.enable_tiling()
        self.tokenizer, self.text_encoder = load_text_encoder(
            model, revision=revision, torch_dtype=dtype, encoder_class=text_encoder_class(model, revision)
        )
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        self.text_pipeline = LTX2Pipeline(
            scheduler=None, vae=None, audio_vae=None, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
            connectors=self.connectors, transformer=None, vocoder=None,
        )
        self.text_max_length = min(LTX2_MAX_SEQUENCE_LENGTH, int(self.tokenizer.model_max_length))

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        video = video.to(self.device, torch.float32) / 127.5 - 1.0
        return self.vae.encode(video.to(self.dtype)).latent_dist.mode()[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, Dv], "audio_text_embedding": [L, Da]}: the connectors' video and
        audio sequences of the caption's Gemma 3 states, as LTX2Pipeline computes a prompt's (its
        connector mask is all ones: the learnable registers fill the padding)."""
        embeds, mask, _, _ = self.text_pipeline.encode_prompt(
            caption, do_classifier_free_guidance=False, max_sequence_length=self.text_max_length, device=self.device
        )
        video, audio, out_mask = self.connectors(embeds, mask, padding_side=self.tokenizer.padding_side)
        if not bool(out_mask.all()):
            # Connectors without registers keep the padding masked: store the real tokens only (the
            # loader pads at the end; cross-attention over text carries no positions).
            keep = out_mask[0].bool()
            return {"text_embedding": video[0, keep].float().cpu(), "audio_text_embedding": audio[0, keep].float().cpu()}
        return {"text_embedding": video[0].float().cpu(), "audio_text_embedding": audio[0].float().cpu()}

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """The first frame, uint8 [H, W, 3] (`pil_image`), for image-to-video sample videos; training
        takes the condition from the clip's own first latent frame (causal VAE)."""
        return {"pil_image": torch.from_numpy(np.array(frames[0], dtype=np.uint8))}

    # ---- sound ----
    @property
    def audio_sample_rate(self) -> int:
        return int(self.audio_vae.config.sample_rate)

    def audio_window(self, num_frames: int, frame_rate: float) -> tuple[int, int]:
        """(latent frames, waveform samples) of the sound of `num_frames` pixel frames at
        `frame_rate`: LTX2Pipeline's audio length, and the samples its latent frames span."""
        config = self.audio_vae.config
        frames = audio_latent_frames(num_frames, frame_rate, config)
        return frames, frames * int(self.audio_vae.temporal_compression_ratio) * int(config.mel_hop_length)

    @torch.no_grad()
    def encode_audio(self, waveform: np.ndarray) -> torch.Tensor:
        """Raw audio latents [C, L, M] (the posterior's mode, as the video's) of a stereo waveform
        [2, L * 4 * hop] at the audio VAE's rate: its log-mel spectrogram (`log_mel`), the last
        frame (centred past the window's end) dropped, so that 4 mel frames make one latent frame."""
        config = self.audio_vae.config
        wave = torch.from_numpy(np.ascontiguousarray(waveform, dtype=np.float32)).to(self.device)
        mel = log_mel(wave, int(config.sample_rate), int(config.mel_hop_length), int(config.mel_bins))
        keep = wave.shape[-1] // int(config.mel_hop_length)
        mel = mel[None, :, :keep].to(self.dtype)
        return self.audio_vae.encode(mel).latent_dist.mode()[0].float().cpu()

    def silent_audio(self, latent_frames: int) -> torch.Tensor:
        """The stored audio latent of a clip kept without sound: zeros [C, L, M] (never trained on)."""
        config = self.audio_vae.config
        bins = int(config.mel_bins) // int(self.audio_vae.mel_compression_ratio)
        return torch.zeros(int(config.latent_channels), latent_frames, bins)

    def latent_statistics(self) -> tuple[list, list]:
        return LTX2Student.latent_statistics(self.model, self.revision)


@register_family
class LTX2Student(DiffusersStudent):
    """LTX-2 text-to-video+audio and image-to-video: FineTune (video only, or joint with
    `train_audio`), DFSFT on video (per-token timesteps)."""

    family = "ltx2"
    vae_class_names = ("AutoencoderKLLTX2Video",)
    transformer_classes = {"ltx2": LTX2VideoTransformer3DModel}
    pipeline_class_names = LTX2_PIPELINES
    capabilities = Capabilities(per_frame_timesteps=True, causal_attention=False, image_conditioning=True)
    # Video attention projections; with train_audio the audio and cross-modal ones too (`configure`
    # names them module by module).
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    frame_rate = LTX2_FRAME_RATE
    has_audio = True
    AUDIO_ATTENTION = ("audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    VIDEO_ATTENTION = ("attn1", "attn2")

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import LTX2Pipeline

        return LTX2Pipeline

    # ComfyUI's LTX-2 model (LTXAVModel) keeps the original LTX-2 module names: the attention and
    # feed-forward modules of a block are named as in diffusers (attn1, audio_attn1, attn2,
    # audio_attn2, audio_to_video_attn, video_to_audio_attn with to_q/to_k/to_v/to_out.0; ff,
    # audio_ff), the others as diffusers' conversion script (scripts/convert_ltx2_to_diffusers.py)
    # renamed them from the original.
    comfyui_lora = True
    COMFYUI_RENAMES = {
        "proj_in": "patchify_proj",
        "audio_proj_in": "audio_patchify_proj",
        "time_embed": "adaln_single",
        "audio_time_embed": "audio_adaln_single",
        "norm_q": "q_norm",
        "norm_k": "k_norm",
        "av_cross_attn_video_scale_shift": "av_ca_video_scale_shift_adaln_single",
        "av_cross_attn_video_a2v_gate": "av_ca_a2v_gate_adaln_single",
        "av_cross_attn_audio_scale_shift": "av_ca_audio_scale_shift_adaln_single",
        "av_cross_attn_audio_v2a_gate": "av_ca_v2a_gate_adaln_single",
    }

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        """diffusers module name -> ComfyUI's (LoRA keys `diffusion_model.<name>.lora_down.weight`)."""
        return ".".join(cls.COMFYUI_RENAMES.get(part, part) for part in module.split("."))

    # ---- preprocessing ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> EncodingSpec:
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=False) or {}
        p, pt = int(transformer.get("patch_size", 1)), int(transformer.get("patch_size_t", 1))
        return EncodingSpec(
            conditioning=(TEXT, AUDIO),
            z_dim=int(vae.get("latent_channels", 128)),
            scale_factor_spatial=int(vae.get("spatial_compression_ratio", 32)),
            scale_factor_temporal=int(vae.get("temporal_compression_ratio", 8)),
            patch_size=(pt, p, p),
        )

    @classmethod
    def make_encoder(cls, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        return LTX2Encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> tuple[list[float], list[float]]:
        """x_norm = (x - latents_mean) / (latents_std / scaling_factor), the video VAE's buffers."""
        from fv_accel.models.loading import fetch_config

        scaling = float(fetch_config(model, "vae", revision=revision, required=True).get("scaling_factor", 1.0))
        mean, std = _buffers(model, revision, "vae")
        return [float(v) for v in mean], [float(v) / scaling for v in std]

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32):
        from diffusers import AutoencoderKLLTX2Video

        return AutoencoderKLLTX2Video.from_pretrained(model, subfolder="vae", revision=revision, torch_dtype=torch_dtype)

    # ---- set-up ----
    @classmethod
    def default_lora_targets(cls, config: Any, student_config: Any) -> tuple[str, ...]:
        """The attention projections of the video branch, and with train_audio those of the audio
        branch and the cross-modal layers too, named module by module."""
        names = cls.VIDEO_ATTENTION + (cls.AUDIO_ATTENTION if student_config.train_audio else ())
        projections = ("to_q", "to_k", "to_v", "to_out.0")
        layers = int(config["num_layers"] if isinstance(config, dict) else config.num_layers)
        return tuple(f"transformer_blocks.{i}.{a}.{p}" for i in range(layers) for a in names for p in projections)

    def configure(self, config: Any) -> None:
        """train_audio and the LoRA targets it implies, module by module (before LoRA is added)."""
        st = self.student_config
        # Image-to-video (a clean first frame) where the recipe asks for it; text-to-video+audio else.
        self.capabilities = Capabilities(per_frame_timesteps=True, causal_attention=False, image_conditioning=st.task == "i2v")
        self.trains_audio = bool(st.train_audio)
        if self.trains_audio and self.run_config.method.name != "finetune":
            from fv_accel.config import ConfigError

            raise ConfigError(
                f"models.student.train_audio: true trains with method.name finetune; {self.run_config.method.name} "
                "trains the LTX-2 video only: set models.student.train_audio: false"
            )
        self.check_release(st)
        self.lora_target_modules = self.default_lora_targets(config, st)
        self.audio_config = None
        if st.init_from is not None:
            from fv_accel.models.loading import fetch_config

            self.audio_config = fetch_config(st.init_from, "audio_vae", revision=st.revision, required=False)
        self.audio_mean = self.audio_std = None

    def check_release(self, st: Any) -> None:
        """The checkpoint's own transformer config.json (the loaded model's config keeps only the keys
        the installed class takes) holds only keys diffusers knows (`check_transformer_config`)."""
        if st.init_from is None:
            check_transformer_config(dict(st.transformer_config or {}), "models.student.transformer_config")
            return
        from fv_accel.models.loading import fetch_config

        raw = fetch_config(st.init_from, st.subfolder or "transformer", revision=st.revision, required=False) or {}
        check_transformer_config(raw, st.init_from)

    def after_setup(self) -> None:
        """train_audio false: the audio branch and the cross-modal layers get no gradient (so no
        optimizer state); a LoRA on them (recipe targets) is refused in one line."""
        if self.trains_audio:
            return
        for name, param in self.transformer.named_parameters():
            if not is_audio_or_cross_modal(name):
                continue
            if "lora_" in name:
                raise ValueError(
                    f"models.student.lora.target_modules reaches the audio branch ({name}) but models.student.train_audio "
                    "is false: name video modules only (or leave the key unset), or set train_audio: true"
                )
            param.requires_grad_(False)

    def init_preprocessors(self, training_config: Any) -> None:
        super().init_preprocessors(training_config)
        st = self.student_config
        if st.init_from is not None and self.audio_config is not None:
            mean, std = _buffers(st.init_from, st.revision, "audio_vae")
            self.audio_mean, self.audio_std = mean.float(), std.float()
        length = self.run_config.training.data.text_max_length
        if st.init_from is not None:
            from fv_accel.models.loading import fetch_config

            tok = fetch_config(st.init_from, "tokenizer", revision=st.revision, required=False, filename="tokenizer_config.json") or {}
            needed = min(LTX2_MAX_SEQUENCE_LENGTH, int(tok.get("model_max_length") or LTX2_MAX_SEQUENCE_LENGTH))
            if length < needed:
                from fv_accel.config import ConfigError

                raise ConfigError(
                    f"training.data.text_max_length: {length}, but LTX-2's prompts are {needed} tokens (the connectors' "
                    f"output, registers included): set training.data.text_max_length: {needed}"
                )

    # ---- per step ----
    def build_conditioning(self, batch: dict) -> Conditioning:
        cond = super().build_conditioning(batch)
        audio_text = batch.get("audio_text_embedding")
        if audio_text is None:
            raise ValueError("the batch has no audio_text_embedding: preprocess the clips with the LTX-2 model itself")
        audio_text = audio_text.to(device=self.device, dtype=torch.float32)
        if audio_text.shape[1] < cond.text.shape[1]:  # padded at the end as the video's (masked out)
            audio_text = torch.nn.functional.pad(audio_text, (0, 0, 0, cond.text.shape[1] - audio_text.shape[1]))
        cond.extras["audio_text"] = audio_text
        if self.student_config.task == "i2v":
            cond.clean_frames = 1
        return cond

    def normalize_audio(self, raw: torch.Tensor) -> torch.Tensor:
        """Raw audio latents [B, C, L, M] -> packed normalised [B, L, C * M] (prepare_audio_latents)."""
        packed = pack_audio(raw.float())
        if self.audio_mean is None:
            return packed
        return (packed - self.audio_mean.to(packed.device)) / self.audio_std.to(packed.device)

    def prepare_batch(self, batch: dict, *, generator: Any = None, latents_source: str = "data") -> TrainingBatch:
        """Clean video latents, conditioning and the clean audio (`extras["audio"]`): the stored audio
        latents, or for a batch without them zeros of the pipeline's length marked absent."""
        tb = super().prepare_batch(batch, generator=generator, latents_source=latents_source)
        tb.extras["audio"] = self.clean_audio(batch, tb.latents.shape[2])
        return tb

    def clean_audio(self, batch: dict, num_latent_frames: int) -> AudioLatents:
        """The batch's stored audio latents, packed and normalised, or for a batch without them
        zeros of the pipeline's length for `num_latent_frames` video latent frames, marked absent."""
        raw = batch.get("audio_latent")
        if raw is not None:
            b = raw.shape[0]
            packed = self.normalize_audio(raw.to(self.device))
            present = batch.get("audio_present")
            present = torch.ones(b, dtype=torch.bool) if present is None else present.bool().reshape(b)
        else:
            return self.silent_audio(batch["vae_latent"].shape[0], num_latent_frames)
        return AudioLatents(packed, present.to(self.device))

    def silent_audio(self, batch_size: int, num_latent_frames: int) -> AudioLatents:
        """Zeros of the pipeline's audio length for `num_latent_frames` video latent frames, marked
        absent (`noise_audio` feeds them to the audio branch as pure noise, sigma 1)."""
        num_frames = (num_latent_frames - 1) * self._temporal_factor() + 1
        length = audio_latent_frames(num_frames, self.frame_rate, self.audio_config or _DEFAULT_AUDIO)
        packed = torch.zeros(batch_size, length, int(self.transformer_config_value("audio_in_channels")), device=self.device)
        return AudioLatents(packed, torch.zeros(batch_size, dtype=torch.bool, device=self.device))

    def transformer_config_value(self, key: str) -> Any:
        return self.modules[0].config[key]

    def _temporal_factor(self) -> int:
        return int(self.transformer_config_value("vae_scale_factors")[0])

    # ---- the transformer ----
    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The video velocity for x_t [B, C, T, H, W] at t ([B] or per latent frame [B, T]); the audio
        branch runs on `cond.extras["audio_noisy"]` [B, L, D] at `audio_sigmas` [B] (pure noise at
        sigma 1 where absent) and its velocity is left in `cond.extras["audio_prediction"]`."""
        from fv_accel.models.ltx_video import pack_latents, token_timesteps, unpack_latents

        b, _, frames, height, width = x_t.shape
        audio = cond.extras.get("audio_noisy")
        audio_sigma = cond.extras.get("audio_sigmas")
        if audio is None:
            raise ValueError("the LTX-2 forward needs the noisy audio (cond.extras['audio_noisy'], set by the method)")
        dtype = self.input_dtype
        grid = (frames, height, width)
        audio_t = audio_sigma.float() * 1000.0
        # The sample's own level (`sigma`, LTX-2.3's prompt modulation): the pipelines pass their step's t.
        sample_t = t if t.ndim == 1 else t.amax(dim=1)
        mask = cond.text_mask if cond.text_mask is not None else torch.ones(cond.text.shape[:2], device=x_t.device)
        fps = conditioning_frame_rate(self.frame_rate)
        module = self.modules[0]
        video_coords = module.rope.prepare_video_coords(b, frames, height, width, x_t.device, fps=fps)
        audio_coords = module.audio_rope.prepare_audio_coords(b, audio.shape[1], x_t.device)
        video, audio_out = self.transformer(
            hidden_states=pack_latents(x_t, 1, 1).to(dtype),
            audio_hidden_states=audio.to(dtype),
            encoder_hidden_states=cond.text.to(dtype),
            audio_encoder_hidden_states=cond.extras["audio_text"].to(dtype),
            timestep=token_timesteps(t, grid, 1),
            audio_timestep=audio_t,
            sigma=sample_t,
            audio_sigma=audio_t,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames,
            height=height,
            width=width,
            fps=fps,
            audio_num_frames=audio.shape[1],
            video_coords=video_coords,
            audio_coords=audio_coords,
            isolate_modalities=False,
            spatio_temporal_guidance_blocks=None,
            perturbation_mask=None,
            use_cross_timestep=LTX2_USE_CROSS_TIMESTEP,
            return_dict=False,
        )
        cond.extras["audio_prediction"] = audio_out
        return unpack_latents(video, grid, 1, 1)

    # ---- sample videos (with sound) ----
    def sample_latents(
        self,
        vae: torch.nn.Module,
        cond: Conditioning,
        negative: Optional[Conditioning],
        *,
        height: int,
        width: int,
        num_frames: int,
        num_inference_steps: int,
        guidance_scale: float,
        scheduler: Any,
        generator: torch.Generator,
        first_frame: Any = None,
    ) -> torch.Tensor:
        """Normalised video latents [1, C, T, h, w] through LTX2Pipeline (LTX2ImageToVideoPipeline
        from `first_frame`) around the live transformer, at the family's frame rate, the sound guided
        at the picture's scale, the prompts' stored connector outputs handed through
        (`StoredConnectors`); the sample's sound (the repo's
        audio VAE and vocoder on the audio latents) is kept for `sample_sound`."""
        import diffusers
        from PIL import Image


        audio_vae, vocoder = self._sound_parts(cond.text.device)
        name = LTX2_PIPELINE if first_frame is None else "LTX2ImageToVideoPipeline"
        pipe = getattr(diffusers, name)(
            scheduler=scheduler, vae=vae, audio_vae=audio_vae, text_encoder=None, tokenizer=None,
            connectors=StoredConnectors(int(cond.text.shape[-1]), cond.text.device), transformer=self.transformer, vocoder=vocoder,
        )

        def joined(c: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
            mask = c.text_mask if c.text_mask is not None else torch.ones(c.text.shape[:2], device=c.text.device)
            return torch.cat([c.text, c.extras["audio_text"].to(c.text)], dim=-1), mask

        use_negative = negative is not None and guidance_scale > 1.0
        text, mask = joined(cond)
        negative_text, negative_mask = joined(negative) if use_negative else (None, None)
        extra = {} if first_frame is None else {"image": Image.fromarray(np.asarray(first_frame, dtype=np.uint8))}
        pipe.set_progress_bar_config(disable=True)
        video, audio = pipe(
            prompt_embeds=text, prompt_attention_mask=mask, negative_prompt_embeds=negative_text,
            negative_prompt_attention_mask=negative_mask, height=height, width=width, num_frames=num_frames,
            num_inference_steps=num_inference_steps, guidance_scale=guidance_scale, audio_guidance_scale=guidance_scale,
            generator=generator,
            frame_rate=self.frame_rate, output_type="latent", return_dict=False, **extra,
        )
        with torch.no_grad():
            wave = vocoder(audio_vae.decode(audio.to(audio_vae.dtype), return_dict=False)[0])
        self._sound = (wave[0].float().cpu().numpy(), int(vocoder.config.output_sampling_rate))
        return self.normalize_latents(video.float())

    def sample_sound(self) -> Optional[tuple[np.ndarray, int]]:
        """The last sample's sound: (float waveform [2, samples], sample rate)."""
        return getattr(self, "_sound", None)

    def _sound_parts(self, device: torch.device) -> tuple[Any, Any]:
        """The repo's audio VAE and vocoder (the class its model_index.json names), fp32, eval, cached."""
        if getattr(self, "_sound_modules", None) is None:
            import diffusers
            from diffusers.pipelines import ltx2 as ltx2_pipelines

            from fv_accel.models.loading import fetch_config

            st = self.student_config
            if st.init_from is None:
                raise ValueError("LTX-2 sample videos need the repo's audio VAE and vocoder: set models.student.init_from")
            index = fetch_config(st.init_from, None, revision=st.revision, required=False, filename="model_index.json") or {}
            vocoder_class = getattr(ltx2_pipelines, (index.get("vocoder") or [None, "LTX2Vocoder"])[1])
            audio_vae = diffusers.AutoencoderKLLTX2Audio.from_pretrained(st.init_from, subfolder="audio_vae", revision=st.revision)
            vocoder = vocoder_class.from_pretrained(st.init_from, subfolder="vocoder", revision=st.revision)
            self._sound_modules = tuple(m.float().eval().requires_grad_(False) for m in (audio_vae, vocoder))
        return tuple(m.to(device) for m in self._sound_modules)

    def _patch(self) -> tuple[int, int]:
        return 1, 1  # (spatial, temporal), as the LTX-Video family names them

    def patch_size_of(self, config: Any) -> tuple[int, int, int]:
        if int(config.get("patch_size", 1)) != 1 or int(config.get("patch_size_t", 1)) != 1:
            raise ValueError("the LTX-2 family trains transformers of patch size 1 (every LTX-2 checkpoint's)")
        return 1, 1, 1


class StoredConnectors(torch.nn.Module):
    """Stands in for LTX2TextConnectors when sampling from stored prompts: the prompt embeddings are
    the connectors' video and audio sequences joined on the feature axis (video first, `video_dim`
    wide); it hands them back split, with the mask."""

    def __init__(self, video_dim: int, device: torch.device):
        super().__init__()
        self.video_dim = video_dim
        self.register_buffer("anchor", torch.zeros(0, device=device), persistent=False)

    @property
    def device(self) -> torch.device:  # what a pipeline asks each of its modules
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def forward(self, embeds: torch.Tensor, mask: torch.Tensor, padding_side: str = "left") -> tuple:
        return embeds[..., : self.video_dim], embeds[..., self.video_dim :], mask


# The audio VAE's defaults (LTX-2's), for a student built without a repo.
_DEFAULT_AUDIO = {"sample_rate": 16000, "mel_hop_length": 160}


def _buffers(model: str, revision: Optional[str], subfolder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(`latents_mean`, `latents_std`) buffers of the VAE in `subfolder`, read from its weights file."""
    from safetensors import safe_open

    from fv_accel.models.ltx_video import _vae_weights_file

    with safe_open(str(_vae_weights_file(model, revision, subfolder)), framework="pt") as f:
        return f.get_tensor("latents_mean").float(), f.get_tensor("latents_std").float()
