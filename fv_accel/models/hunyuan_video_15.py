"""The HunyuanVideo 1.5 family (text-to-video): `HunyuanVideo15Transformer3DModel` under diffusers'
`HunyuanVideo15Pipeline` (hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v and -720p_t2v).

What the pipeline does, and so what this family does:
- Text: Qwen2.5-VL's third-to-last hidden state of the chat-formatted prompt with the first 108
  tokens (the system turn) cropped (`text_embedding`, [L, 3584]), and the ByT5 glyph encoder's
  last hidden state of the quoted text in the prompt (`text_embedding_2`, [L2, 1472]; L2 = 0 when
  the prompt quotes nothing: the pipeline then passes an all-zero mask). Both are computed by the
  pipeline's own `encode_prompt`; only the real tokens (mask 1) are stored. The transformer zeroes
  and masks padding tokens itself, so the loader's padding gives the pipeline's inputs.
- Latents: `AutoencoderKLHunyuanVideo15` (32 channels, 16x spatial, 4x temporal); the pipeline
  decodes `latents / scaling_factor`, so normalised latents are raw * scaling_factor (mean 0,
  std 1 / scaling_factor).
- Transformer input: [x_t (32), condition latent (32), mask (1)] along channels; text-to-video
  passes zeros for both, and all-zero image embeddings (the transformer then masks the image
  tokens out). It predicts the flow velocity eps - x0 at t = sigma * 1000, the REFERENCE.md
  convention, so `forward` converts nothing.
- Timesteps: one per sample. `timestep` [B] goes through diffusers' `Timesteps` (1-D only) to one
  [B, D] vector that modulates every block (AdaLayerNormZero) and the text token refiner; there is
  no per-frame or per-token path, so diffusion forcing is refused.
- Training shift: the repo's scheduler config (`shift` 5.0 at 480p, 9.0 at 720p t2v), unless the
  recipe sets `models.student.flow_shift`; sample videos run the stock pipeline with validation's
  scheduler (by default the repo's, at its shift) and guidance scale.
- Text length: the loader keeps up to 512 tokens of each text column; the pipeline allows 1000
  Qwen2.5-VL tokens (longer captions are cut at 512 in training).
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from diffusers import HunyuanVideo15Transformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, register_family
from fv_accel.models.encoders import TEXT, EncodingSpec, FamilyEncoder
from fv_accel.models.loading import explain_load_error, fetch_config
from fv_accel.models.student import DiffusersStudent

logger = logging.getLogger(__name__)

PIPELINE_CLASS = "HunyuanVideo15Pipeline"
IMAGE_TO_VIDEO_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"
# diffusers' AutoencoderKLHunyuanVideo15 default (the real VAE's scaling factor).
DEFAULT_SCALING_FACTOR = 1.03682
PER_FRAME_REFUSAL = (
    "HunyuanVideo15Transformer3DModel takes one timestep per sample (timestep [B]): its time embedding "
    "gives one [B, D] vector that modulates every block and the text refiner, with no per-frame or per-token path"
)


def _image_to_video_refusal(model: str) -> str:
    return (
        f"model '{model}' is a HunyuanVideo 1.5 image-to-video model: the hunyuan_video_15 family trains the "
        f"text-to-video models (e.g. hunyuanvideo-community/HunyuanVideo-1.5-480p_t2v)"
    )


def _check_text_to_video(model: str, revision: Optional[str]) -> None:
    """Only text-to-video repos: the image-to-video ones need a SigLIP image embedding and the first
    frame's condition latent, which this family does not compute."""
    index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
    transformer = fetch_config(model, "transformer", revision=revision, required=False) or {}
    if index.get("_class_name") == IMAGE_TO_VIDEO_PIPELINE or transformer.get("task_type") == "i2v":
        raise ValueError(_image_to_video_refusal(model))


class HunyuanVideo15Encoder(FamilyEncoder):
    """The repo's VAE and both text encoders, eval mode, no grad; captions go through the stock
    pipeline's `encode_prompt` (its chat template, crop, ByT5 glyph extraction and lengths)."""

    def __init__(
        self,
        model: str,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        revision: Optional[str] = None,
        vae_tiling: bool = False,
        spec: Optional[EncodingSpec] = None,
    ):
        from diffusers import HunyuanVideo15Pipeline
        from transformers import AutoTokenizer, ByT5Tokenizer, Qwen2_5_VLTextModel, T5EncoderModel

        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.spec = spec or HunyuanVideo15Student.encoding_spec(model, revision=revision)
        self.vae = HunyuanVideo15Student.load_vae(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        if vae_tiling:
            self.vae.enable_tiling()

        def load(what: str, subfolder: str, fn: Any) -> Any:
            try:
                return fn(model, subfolder=subfolder, revision=revision)
            except (OSError, ValueError) as err:
                raise explain_load_error(model, f"{what} (subfolder '{subfolder}')", err, revision=revision) from None

        text_encoder = load(
            "text encoder", "text_encoder",
            lambda m, **kw: Qwen2_5_VLTextModel.from_pretrained(m, dtype=dtype, use_safetensors=True, **kw),
        )
        # The encoder's config spares AutoTokenizer a lookup of `tokenizer/config.json`, which
        # diffusers-layout repos lack (and which fails offline).
        tokenizer = load(
            "tokenizer", "tokenizer", lambda m, **kw: AutoTokenizer.from_pretrained(m, config=text_encoder.config, **kw)
        )
        text_encoder_2 = load(
            "text encoder 2", "text_encoder_2",
            lambda m, **kw: T5EncoderModel.from_pretrained(m, dtype=dtype, use_safetensors=True, **kw),
        )
        tokenizer_2 = load("tokenizer 2", "tokenizer_2", lambda m, **kw: ByT5Tokenizer.from_pretrained(m, **kw))
        for module in (text_encoder, text_encoder_2):
            module.to(self.device).eval().requires_grad_(False)
        # The stock pipeline around the encoders only (no transformer, scheduler or guider).
        self.pipeline = HunyuanVideo15Pipeline(
            text_encoder=text_encoder,
            tokenizer=tokenizer,
            transformer=None,
            vae=self.vae,
            scheduler=None,
            text_encoder_2=text_encoder_2,
            tokenizer_2=tokenizer_2,
            guider=None,
        )
        self.scaling_factor = float(self.vae.config.get("scaling_factor") or DEFAULT_SCALING_FACTOR)

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> raw latent [32, T, H/16, W/16] (the posterior's mode), fp32 cpu."""
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        video = video.to(self.device, torch.float32) / 127.5 - 1.0
        return self.vae.encode(video.to(self.dtype)).latent_dist.mode()[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, D] Qwen2.5-VL tokens, "text_embedding_2": [L2, D2] ByT5 glyph tokens}
        as `HunyuanVideo15Pipeline.encode_prompt` computes them, real tokens only."""
        text, mask, text_2, mask_2 = self.pipeline.encode_prompt(prompt=caption, device=self.device, dtype=torch.float32)
        return {
            "text_embedding": text[0][mask[0].bool()].float().cpu(),
            "text_embedding_2": text_2[0][mask_2[0].bool()].float().cpu(),
        }

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        return {}

    def latent_statistics(self) -> tuple[list, list]:
        channels = int(self.vae.config.latent_channels)
        return [0.0] * channels, [1.0 / self.scaling_factor] * channels


@register_family
class HunyuanVideo15Student(DiffusersStudent):
    """HunyuanVideo 1.5 text-to-video: FineTune full or LoRA; diffusion forcing refused (one
    timestep per sample)."""

    family = "hunyuan_video_15"
    vae_class_names = ("AutoencoderKLHunyuanVideo15",)
    transformer_classes = {"hunyuan_video_15": HunyuanVideo15Transformer3DModel}
    pipeline_class_names = (PIPELINE_CLASS,)
    capabilities = Capabilities(per_frame_timesteps=False, causal_attention=False, image_conditioning=False)
    # The joint attention of the double-stream blocks, video stream (to_*) and text stream
    # (add_*_proj, to_add_out); `to_q/k/v/out.0` also match the text token refiner's attention.
    lora_target_modules = (
        "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    )
    per_frame_refusal = PER_FRAME_REFUSAL
    latent_statistics_source = "vae/config.json (scaling_factor)"

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        """diffusers has no LoRA loader for HunyuanVideo15Pipeline; HunyuanVideo's writes the same
        `transformer.`-prefixed keys and adapter metadata, which the stock pipeline's transformer
        loads with `pipe.transformer.load_lora_adapter(DIR, prefix="transformer")`."""
        from diffusers.loaders import HunyuanVideoLoraLoaderMixin

        return HunyuanVideoLoraLoaderMixin

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        raise ValueError(
            f"the hunyuan_video_15 family writes no ComfyUI LoRA file: no ComfyUI key layout for HunyuanVideo 1.5 "
            f"LoRAs is verified here (module {module!r}); use the diffusers file"
        )

    # ---- preprocessing / validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> EncodingSpec:
        _check_text_to_video(model, revision)
        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=False) or {}
        patch = int(transformer.get("patch_size", 1))
        return EncodingSpec(
            conditioning=(TEXT,),
            z_dim=int(vae.get("latent_channels", 32)),
            scale_factor_spatial=int(vae.get("spatial_compression_ratio", 16)),
            scale_factor_temporal=int(vae.get("temporal_compression_ratio", 4)),
            patch_size=(int(transformer.get("patch_size_t", 1)), patch, patch),
        )

    @classmethod
    def make_encoder(cls, model: str, *, device: Any, dtype: torch.dtype, revision: Optional[str] = None,
                     vae_tiling: bool = False, spec: Optional[EncodingSpec] = None) -> FamilyEncoder:
        return HunyuanVideo15Encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> Optional[tuple[list, list]]:
        vae = fetch_config(model, "vae", revision=revision, required=False)
        if not vae:
            return None
        scale = float(vae.get("scaling_factor") or DEFAULT_SCALING_FACTOR)
        channels = int(vae.get("latent_channels", 32))
        return [0.0] * channels, [1.0 / scale] * channels

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32) -> torch.nn.Module:
        from diffusers import AutoencoderKLHunyuanVideo15

        fetch_config(model, "vae", revision=revision, required=True)
        try:
            return AutoencoderKLHunyuanVideo15.from_pretrained(
                model, subfolder="vae", revision=revision, torch_dtype=torch_dtype, use_safetensors=True
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "VAE (subfolder 'vae')", err, revision=revision) from None

    @classmethod
    def decode(cls, vae: torch.nn.Module, raw_latents: torch.Tensor) -> torch.Tensor:
        """One sample per call: the VAE's mid-block attention mask (diffusers 0.42.1) only
        broadcasts for a batch of one."""
        return torch.cat([vae.decode(z[None], return_dict=False)[0] for z in raw_latents])

    # ---- training ----
    def configure(self, config: Any) -> None:
        if config.get("task_type") == "i2v":
            raise ValueError(_image_to_video_refusal(self.student_config.init_from or "models.student.transformer_config"))

    def build_conditioning(self, batch: dict) -> Conditioning:
        """Both text sequences with their masks; a batch without `text_embedding_2` gets an empty
        (fully masked) glyph sequence, as the pipeline passes for a prompt without quoted text."""
        cond = super().build_conditioning(batch)
        text_2 = batch.get("text_embedding_2")
        if text_2 is None:
            width = int(self.modules[0].config.text_embed_2_dim)
            text_2 = torch.zeros(cond.text.shape[0], 1, width)
            mask_2 = torch.zeros(cond.text.shape[0], 1, dtype=torch.long)
        else:
            mask_2 = batch.get("text_attention_mask_2")
            if mask_2 is None:
                mask_2 = torch.ones(text_2.shape[:2], dtype=torch.long)
        cond.text_2 = text_2.to(device=self.device, dtype=torch.float32)
        cond.text_2_mask = mask_2.to(self.device)
        if cond.text_mask is None:
            cond.text_mask = torch.ones(cond.text.shape[:2], dtype=torch.long, device=self.device)
        return cond

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The flow velocity for x_t [B, 32, T, H, W] at t [B] (sigma * 1000)."""
        if t.ndim != 1:
            raise ValueError(f"the hunyuan_video_15 family takes timesteps [B], got {tuple(t.shape)}: {PER_FRAME_REFUSAL}")
        config = self.modules[0].config
        dtype = self.input_dtype
        b, c, f, h, w = x_t.shape
        # Text-to-video: the condition latent and its mask are zeros (the pipeline's
        # prepare_cond_latents_and_mask), the image embedding is all zeros (masked out).
        hidden = torch.cat([x_t, x_t.new_zeros(b, c + 1, f, h, w)], dim=1)
        image_embeds = x_t.new_zeros(b, 1, int(config.image_embed_dim))
        return self.transformer(
            hidden_states=hidden.to(dtype),
            timestep=t.to(dtype),
            encoder_hidden_states=cond.text.to(dtype),
            encoder_attention_mask=cond.text_mask.to(dtype),
            encoder_hidden_states_2=cond.text_2.to(dtype),
            encoder_attention_mask_2=cond.text_2_mask.to(dtype),
            image_embeds=image_embeds.to(dtype),
            return_dict=False,
        )[0]

    # ---- sample videos ----
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
        """Normalised latents [1, 32, T, h, w] from the stock HunyuanVideo15Pipeline around the live
        transformer, prompt embeddings precomputed (no text encoders), stepping with `scheduler`, its
        classifier-free guider at `guidance_scale`. `negative` is the encoded negative prompt
        (validation's, the empty prompt by default, as the pipeline's own); without one the guider's
        unconditional branch gets the zeroed text."""
        from diffusers import ClassifierFreeGuidance, HunyuanVideo15Pipeline

        transformer = self._unwrapped()
        guider = ClassifierFreeGuidance(guidance_scale=guidance_scale)
        pipe = HunyuanVideo15Pipeline(
            text_encoder=None,
            tokenizer=None,
            transformer=transformer,
            vae=vae,
            scheduler=scheduler,
            text_encoder_2=None,
            tokenizer_2=None,
            guider=guider,
        )
        pipe.set_progress_bar_config(disable=True)
        call: dict[str, Any] = dict(
            prompt_embeds=cond.text, prompt_embeds_mask=cond.text_mask,
            prompt_embeds_2=cond.text_2, prompt_embeds_mask_2=cond.text_2_mask,
        )
        if guider._enabled and guider.num_conditions > 1:
            negative = negative if negative is not None else cond.unconditional()
            call.update(
                negative_prompt_embeds=negative.text, negative_prompt_embeds_mask=negative.text_mask,
                negative_prompt_embeds_2=negative.text_2, negative_prompt_embeds_mask_2=negative.text_2_mask,
            )
        latents = pipe(
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            generator=generator,
            output_type="latent",
            return_dict=False,
            **call,
        )[0]
        return latents.float()
