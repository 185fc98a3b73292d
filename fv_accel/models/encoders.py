"""Encoding clips and captions with a model's own VAE, text encoder and, for image-to-video
models, image conditioning (Hub id or local folder): `FamilyEncoder`, what every family's
encoder provides, and the Wan family's `TextVideoEncoder`.

What a Wan model is conditioned on is read from its configs (`describe_model`):

- every model: the caption (`text`);
- image-to-video models (model_index `_class_name` WanImageToVideoPipeline, or a transformer whose
  input is [noisy latent, mask (4), condition latent], 2 * z_dim + 4 = 36 channels) and
  `expand_timesteps` models (Wan2.2-TI2V-5B, trained on both tasks): the first frame
  (`first_frame`), stored as FastVideo's I2V columns `first_frame_latent` and `pil_image`;
- models whose transformer has image cross-attention (`image_dim`, Wan 2.1 I2V): the CLIP image
  features of the first frame too (`clip_feature`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

logger = logging.getLogger(__name__)

TEXT_MAX_LENGTH = 512
TEXT = "text"
FIRST_FRAME = "first_frame"
CLIP_FEATURE = "clip_feature"
# The clip's sound (LTX-2): preprocessing stores `audio_latent` and `audio_present` beside the video's.
AUDIO = "audio"
IMAGE_TO_VIDEO_PIPELINES = ("WanImageToVideoPipeline",)
# The transformer input of a channel-concatenating image-to-video model: [noisy latent (z_dim),
# mask (4: the first pixel frame repeated over the VAE's 4x time compression), condition (z_dim)].
MASK_CHANNELS = 4


def wan_prompt_clean(text: str) -> str:
    """The text the Wan and SkyReels-V2 pipelines hand their tokenizer for a prompt: diffusers' own
    `prompt_clean` (ftfy's text fixes, HTML unescaped twice, runs of whitespace made one space,
    stripped)."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


@dataclass(frozen=True)
class EncodingSpec:
    """What preprocessing stores for a model and at which geometry, from its configs alone."""

    conditioning: tuple[str, ...]  # TEXT, then FIRST_FRAME, CLIP_FEATURE, AUDIO where the model takes them
    z_dim: int
    scale_factor_spatial: int
    scale_factor_temporal: int
    patch_size: tuple[int, int, int]

    @property
    def side_multiple(self) -> tuple[int, int]:
        """(height, width) multiples a frame needs: the VAE's downsampling times the transformer's patch."""
        return self.scale_factor_spatial * self.patch_size[1], self.scale_factor_spatial * self.patch_size[2]

    def bucket_problem(self, buckets: Sequence[tuple[int, int]], model: str = "the model") -> Optional[str]:
        """Why some buckets cannot be encoded for this model (naming them), or None."""
        mh, mw = self.side_multiple
        bad = [f"{h}x{w}" for h, w in buckets if h % mh or w % mw]
        if not bad:
            return None
        sides = f"height and width must be multiples of {mh}" if mh == mw else f"height must be a multiple of {mh} and width of {mw}"
        return (
            f"{', '.join(bad)}: the VAE of {model} downsamples by {self.scale_factor_spatial} (vae/config.json "
            f"scale_factor_spatial) and its transformer patches {self.patch_size[1]}x{self.patch_size[2]}, so "
            f"{sides} (e.g. {2 * mh}x{2 * mw})"
        )


def describe_model(model: str, *, revision: Optional[str] = None) -> EncodingSpec:
    """The model's conditioning and geometry from model_index.json, vae/ and transformer/ configs."""
    from fv_accel.models.loading import fetch_config

    index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
    vae = fetch_config(model, "vae", revision=revision, required=True)
    transformer = (
        fetch_config(model, "transformer", revision=revision, required=False)
        or fetch_config(model, "transformer_2", revision=revision, required=False)
        or {}
    )
    if not index and not transformer:
        logger.warning(
            "model '%s' has neither model_index.json nor transformer/config.json: it is taken for a "
            "text-to-video model (no first-frame columns)", model
        )
    z_dim = int(vae.get("z_dim", 16))
    concat_input = transformer.get("in_channels") == 2 * z_dim + MASK_CHANNELS
    conditioning = [TEXT]
    if index.get("_class_name") in IMAGE_TO_VIDEO_PIPELINES or concat_input or index.get("expand_timesteps"):
        conditioning.append(FIRST_FRAME)
        if transformer.get("image_dim") is not None:
            conditioning.append(CLIP_FEATURE)
    patch = tuple(int(p) for p in transformer.get("patch_size") or (1, 2, 2))
    return EncodingSpec(
        conditioning=tuple(conditioning),
        z_dim=z_dim,
        scale_factor_spatial=int(vae.get("scale_factor_spatial") or 8),
        scale_factor_temporal=int(vae.get("scale_factor_temporal") or 4),
        patch_size=patch,  # type: ignore[arg-type]
    )


class FamilyEncoder:
    """What preprocessing (and validation, for prompts) needs of a model family's encoders; a
    family's `make_encoder` returns one. Tensors come back as float32 on the CPU."""

    spec: EncodingSpec
    vae: torch.nn.Module
    # The most caption tokens the text encoder takes, longer captions being cut there (None: the
    # family does not count them, as for templated prompts).
    text_max_length: Optional[int] = None

    def caption_tokens(self, caption: str) -> Optional[int]:
        """Tokens of `caption` (as the pipeline encodes it: `pipeline_prompt`) before the cut to
        `text_max_length` (special tokens included), counted with the family's tokenizer
        (`self.tokenizer`); None where the family does not count them."""
        tokenizer = getattr(self, "tokenizer", None)
        if tokenizer is None or self.text_max_length is None:
            return None
        text = self.pipeline_prompt(caption)
        return len(tokenizer(text, add_special_tokens=True, truncation=False, verbose=False).input_ids)

    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> the raw (un-normalised) latent [C, T, h, w], the posterior's mode."""
        raise NotImplementedError

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """The caption's columns: `text_embedding` [L, D] (real tokens only; the loader pads), and
        where the family has them `pooled_text_embedding` [D] and `text_embedding_2` [L2, D2];
        computed from the caption as the family's pipeline computes a prompt's (its text cleaning
        included)."""
        raise NotImplementedError

    def pipeline_prompt(self, caption: str) -> str:
        """The text the family's pipeline encodes for a prompt (its text cleaning; none here)."""
        return caption

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """Image-to-video columns of a clip ({} for a text-to-video model)."""
        return {}

    def latent_statistics(self) -> Optional[tuple[list[float], list[float]]]:
        """Per-channel (mean, std) normalising this VAE's latents, as the family's pipeline does."""
        return None


class TextVideoEncoder(FamilyEncoder):
    """The VAE (`AutoencoderKLWan`), UMT5 text encoder and, for Wan 2.1 I2V, CLIP image encoder of
    one model repo, in eval mode, no grad. `spec` says what the model is conditioned on."""

    def __init__(
        self,
        model: str,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        revision: Optional[str] = None,
        text_max_length: int = TEXT_MAX_LENGTH,
        vae_tiling: bool = False,
        spec: Optional[EncodingSpec] = None,
    ):
        from fv_accel.models.loading import ModelLoadError, load_image_encoder, load_text_encoder, load_vae

        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.text_max_length = text_max_length
        self.spec = spec or describe_model(model, revision=revision)
        # Found like the transformer: Hub id (cache honoured offline) or local folder, clear errors.
        self.vae = load_vae(model, revision=revision, torch_dtype=dtype)
        self.tokenizer, self.text_encoder = load_text_encoder(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        if hasattr(self.vae, "enable_slicing") and self.device.type == "cuda":
            self.vae.enable_slicing()
        # Tiles change the latents slightly (blended seams): only on request, for high resolutions.
        if vae_tiling and hasattr(self.vae, "enable_tiling"):
            self.vae.enable_tiling()
        self.image_processor = self.image_encoder = None
        if CLIP_FEATURE in self.spec.conditioning:
            # fp32 whatever `dtype`, as the pipelines run it (it is small beside the VAE's activations).
            self.image_processor, self.image_encoder = load_image_encoder(model, revision=revision)
            self.image_encoder.to(self.device).eval().requires_grad_(False)
        if FIRST_FRAME in self.spec.conditioning:
            mean, std = self.vae.config.get("latents_mean"), self.vae.config.get("latents_std")
            if not mean or not std:
                raise ModelLoadError(
                    f"model '{model}': vae/config.json has no latents_mean/latents_std, needed to normalise the "
                    "first-frame latent of an image-to-video model"
                )
            shape = (-1, 1, 1, 1)
            self.latents_mean = torch.tensor(mean, dtype=torch.float32).view(shape)
            self.latents_std = torch.tensor(std, dtype=torch.float32).view(shape)

    def _video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> [1, 3, F, H, W] in [-1, 1] on the device."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        return video.to(self.device, torch.float32) / 127.5 - 1.0

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> raw (unnormalised) latent [C, T, H/s, W/s] (s: the VAE's spatial
        factor, 8 or 16), the posterior's mode."""
        latent = self.vae.encode(self._video(frames).to(self.dtype)).latent_dist.mode()
        return latent[0].float().cpu()

    @torch.no_grad()
    def encode_first_frame(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> [C, T, H/s, W/s]: the latent of the clip's first frame followed by F - 1
        zero frames (as WanImageToVideoPipeline.prepare_latents builds `video_condition`), the
        posterior's mode, normalised with the VAE's latents_mean/std as that pipeline and FastVideo's
        I2V preprocessing store it. The VAE is causal in time, so latent frame 0 is also the latent of
        the first frame alone (the condition of `expand_timesteps` models)."""
        video = self._video(frames)
        condition = torch.zeros_like(video)
        condition[:, :, 0] = video[:, :, 0]
        latent = self.vae.encode(condition.to(self.dtype)).latent_dist.mode()[0].float().cpu()
        return (latent - self.latents_mean) / self.latents_std

    @torch.no_grad()
    def encode_image(self, frame: np.ndarray) -> torch.Tensor:
        """uint8 [H, W, 3] -> [L, D] CLIP features: the image encoder's penultimate hidden states, as
        WanImageToVideoPipeline.encode_image computes them ([257, 1280] for Wan 2.1 I2V)."""
        from PIL import Image

        inputs = self.image_processor(images=Image.fromarray(np.ascontiguousarray(frame)), return_tensors="pt")
        pixels = inputs["pixel_values"].to(self.device, self.image_encoder.dtype)
        hidden = self.image_encoder(pixel_values=pixels, output_hidden_states=True).hidden_states[-2]
        return hidden[0].float().cpu()

    def latent_statistics(self) -> Optional[tuple[list[float], list[float]]]:
        mean, std = self.vae.config.get("latents_mean"), self.vae.config.get("latents_std")
        return (list(mean), list(std)) if mean and std else None

    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        return {"text_embedding": self.encode_text(caption)}

    def pipeline_prompt(self, caption: str) -> str:
        return wan_prompt_clean(caption)

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        return self.encode_conditioning(frames)

    def encode_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """The image conditioning of a clip, by FastVideo column name: `first_frame_latent`,
        `pil_image` (the first frame, uint8 [H, W, 3]) and `clip_feature`, where the model takes them."""
        out: dict[str, torch.Tensor] = {}
        if FIRST_FRAME in self.spec.conditioning:
            out["first_frame_latent"] = self.encode_first_frame(frames)
            out["pil_image"] = torch.from_numpy(np.array(frames[0], dtype=np.uint8))
        if CLIP_FEATURE in self.spec.conditioning:
            out["clip_feature"] = self.encode_image(frames[0])
        return out

    @torch.no_grad()
    def encode_text(self, caption: str) -> torch.Tensor:
        """[L, D] embeddings of the caption's real tokens (padding is added by the loader), the caption
        cleaned as the Wan pipelines clean a prompt (`wan_prompt_clean`)."""
        tok = self.tokenizer(
            [self.pipeline_prompt(caption)],
            padding="max_length",
            max_length=self.text_max_length,
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        ids = tok.input_ids.to(self.device)
        mask = tok.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, mask).last_hidden_state
        length = int(mask.sum())
        return hidden[0, :length].float().cpu()
