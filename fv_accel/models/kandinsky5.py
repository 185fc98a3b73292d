"""The Kandinsky 5 family: `Kandinsky5Transformer3DModel` of kandinskylab/Kandinsky-5.0-*-Diffusers
(T2V Lite and Pro; I2V Pro), text-to-video and image-to-video.

What the stock pipelines (diffusers 0.42: `Kandinsky5T2VPipeline`, `Kandinsky5I2VPipeline`) do, and
this family with them:

- Text: two encoders, both precomputed by preprocessing with the pipeline's own `encode_prompt`
  (its `prompt_clean` first). `text_embedding` [L, D] is Qwen2.5-VL's last hidden state of the
  caption inside the pipeline's prompt template, the template's first 128 tokens cropped (at most
  512 kept); `pooled_text_embedding` [D2] is CLIP's pooled output (77 tokens). The transformer
  takes no text mask: the pipeline feeds a prompt's tokens unpadded, with `text_rope_pos` =
  arange(length). `forward` does the same for each sample, one transformer call per distinct text
  length in the batch (the loader's padding never reaches the transformer).
- Latents: channels last, [B, T, H, W, C]. x_norm = x_raw * vae.config.scaling_factor (HunyuanVideo's
  VAE): latent statistics mean 0, std 1 / scaling_factor.
- `visual_cond` transformers (every published config) take [latent (16), condition latent (16),
  mask (1)]: the condition latent is zeros in both pipelines; the mask is 1 on the first latent
  frame under the I2V pipeline, whose first frame is the image's clean latent (frame replacement:
  `Conditioning.clean_frames` 1), at the step's timestep like every frame.
- Positions: `visual_rope_pos` = arange over latent frames and token rows / columns; the RoPE
  `scale_factor` is the pipeline's `_get_scale_factor` of the pixel size ((1, 2, 2) when both sides
  are within [480, 854], else (1, 3.16, 3.16)).
- Flow matching: FlowMatchEulerDiscreteScheduler (shift 5 in the repos), timestep = sigma * 1000,
  output the velocity eps - x0: the REFERENCE convention, no conversion.
- Timesteps: one per sample (`timestep` [B] goes through an outer product with the frequencies,
  and one modulation vector drives every token): diffusion forcing is refused.
- Attention: the 5 s checkpoints' dense attention (`attention_type` "regular"). The 10 s
  checkpoints' NABLA sparse attention (`attention_type` "nabla") is refused at build.
- Guidance: classifier-free with the pipeline's default negative prompt (`unconditional_prompt`),
  which caption dropout trains.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from diffusers import Kandinsky5Transformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, register_family
from fv_accel.models.cosmos2 import FIRST_FRAME_IMAGE
from fv_accel.models.hunyuan_video import HunyuanVideoEncoder, HunyuanVideoStudent, latent_statistics_of
from fv_accel.models.student import DiffusersStudent

logger = logging.getLogger(__name__)

# Kandinsky5T2VPipeline.__call__'s negative prompt when guidance_scale > 1 and none is given.
PIPELINE_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards"
)
# Kandinsky5T2VPipeline.__call__'s default max_sequence_length (Qwen tokens kept after the template).
PIPELINE_TEXT_LENGTH = 512
I2V_PIPELINES = ("Kandinsky5I2VPipeline",)


def pipeline_scale_factor(height: int, width: int) -> tuple:
    """The RoPE scale factor the pipelines pass for a video of `height` x `width` pixels (their own
    `_get_scale_factor`, which reads no pipeline state)."""
    from diffusers import Kandinsky5T2VPipeline

    return Kandinsky5T2VPipeline._get_scale_factor(None, height, width)


def visual_input(x_t: torch.Tensor, visual_cond: bool, clean_frames: int) -> torch.Tensor:
    """x_t [B, C, T, H, W] -> the transformer's [B, T, H, W, C'] as the pipelines build it: channels
    last, and for a `visual_cond` transformer a zero condition latent and the first-frame mask."""
    x = x_t.permute(0, 2, 3, 4, 1)
    if not visual_cond:
        return x
    mask = x.new_zeros(*x.shape[:-1], 1)
    mask[:, :clean_frames] = 1.0
    return torch.cat([x, torch.zeros_like(x), mask], dim=-1)


def one_timestep(t: torch.Tensor, clean_frames: int, refusal: str) -> torch.Tensor:
    """[B]: per-frame [B, T] timesteps only where every noisy frame of a sample has the same value
    (the clean condition frames, at 0, take the step's timestep as under the I2V pipeline)."""
    if t.ndim == 1:
        return t
    noisy = t[:, clean_frames:] if t.ndim == 2 else t
    if t.ndim == 2 and noisy.shape[1] and bool((noisy == noisy[:, :1]).all()):
        return noisy[:, 0]
    raise ValueError(f"the kandinsky5 family cannot take a timestep per latent frame: {refusal}")


def text_groups(cond: Conditioning) -> list[tuple[torch.Tensor, int]]:
    """(sample indices, real text length) of each group of samples whose texts have the same length."""
    text = cond.text
    if cond.text_mask is None:
        lengths = torch.full((text.shape[0],), text.shape[1], dtype=torch.long)
    else:
        lengths = cond.text_mask.sum(dim=1).long().cpu()
    return [(torch.nonzero(lengths == n).flatten(), int(n)) for n in torch.unique(lengths).tolist()]


# ---- preprocessing ----
class Kandinsky5Encoder(HunyuanVideoEncoder):
    """HunyuanVideo's VAE and the Qwen2.5-VL and CLIP text encoders of one Kandinsky 5 repo, run by
    the stock pipeline's own `encode_prompt`, in eval mode, no grad."""

    def __init__(self, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        from diffusers import Kandinsky5T2VPipeline
        from transformers import AutoTokenizer

        from fv_accel.models.loading import explain_load_error, fetch_config

        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.spec = spec or Kandinsky5Student.encoding_spec(model, revision=revision)
        self.image_to_video = FIRST_FRAME_IMAGE in self.spec.conditioning
        self.vae = Kandinsky5Student.load_vae(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        if vae_tiling:  # tiles blend seams: only on request, for high resolutions
            self.vae.enable_tiling()
        fetch_config(model, "text_encoder", revision=revision, required=True)
        try:
            # The tokenizer alone (the repo saves a Qwen2VLProcessor, whose video processor needs
            # torchvision; the pipeline calls only its tokenizer).
            tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer", revision=revision)
            self.text_pipeline = Kandinsky5T2VPipeline.from_pretrained(
                model, tokenizer=tokenizer, transformer=None, vae=None, revision=revision, torch_dtype=dtype,
                use_safetensors=True,
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "text encoders and tokenizers", err, revision=revision) from None
        self.tokenizer = tokenizer
        for encoder in (self.text_pipeline.text_encoder, self.text_pipeline.text_encoder_2):
            encoder.to(self.device).eval().requires_grad_(False)

    def pipeline_prompt(self, caption: str) -> str:
        return Kandinsky5Student.pipeline_prompt(caption)

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, D] Qwen states of the caption's tokens and <|im_end|>, "pooled_text_embedding": [D2]}."""
        embeds, pooled, cu_seqlens = self.text_pipeline.encode_prompt(
            prompt=caption, max_sequence_length=PIPELINE_TEXT_LENGTH, device=self.device, dtype=self.dtype
        )
        length = int(cu_seqlens[1])  # one prompt: unpadded
        return {"text_embedding": embeds[0, :length].float().cpu(), "pooled_text_embedding": pooled[0].float().cpu()}

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        """An image-to-video repo: the first frame, uint8 [H, W, 3] (`pil_image`); training takes the
        condition from the clip's own first latent frame (causal VAE)."""
        if not self.image_to_video:
            return {}
        return {"pil_image": torch.from_numpy(np.array(frames[0], dtype=np.uint8))}


@register_family
class Kandinsky5Student(DiffusersStudent):
    """Kandinsky 5 (text-to-video; image-to-video by a clean first frame): fine-tuning, full or LoRA."""

    family = "kandinsky5"
    vae_class_names = ("AutoencoderKLHunyuanVideo",)
    transformer_classes = {"kandinsky5": Kandinsky5Transformer3DModel}
    pipeline_class_names = ("Kandinsky5T2VPipeline",) + I2V_PIPELINES
    capabilities = Capabilities(per_frame_timesteps=False, causal_attention=False, image_conditioning=True)
    # The query, key, value and output projections of every self- and cross-attention.
    lora_target_modules = ("to_query", "to_key", "to_value", "self_attention.out_layer", "cross_attention.out_layer")
    per_frame_refusal = (
        "Kandinsky5Transformer3DModel takes one timestep per sample (timestep [B]: its time embedding is an outer "
        "product over a 1-D tensor and one modulation vector drives all tokens)"
    )
    unconditional_prompt = PIPELINE_NEGATIVE_PROMPT
    default_flow_shift = 5.0  # the repos' scheduler shift (FastVideo's flow_shift)

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import Kandinsky5T2VPipeline

        return Kandinsky5T2VPipeline

    @classmethod
    def pipeline_prompt(cls, caption: str) -> str:
        from diffusers.pipelines.kandinsky5.pipeline_kandinsky import prompt_clean

        return prompt_clean(caption)

    @classmethod
    def repo_task(cls, model: str, revision: Optional[str] = None) -> str:
        """"i2v" for a repo whose model_index.json names the image-to-video pipeline, else "t2v"."""
        from fv_accel.models.loading import fetch_config

        index = fetch_config(model, None, revision=revision, required=False, filename="model_index.json") or {}
        return "i2v" if index.get("_class_name") in I2V_PIPELINES else "t2v"

    # ---- preprocessing / validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.encoders import TEXT, EncodingSpec
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=True)
        pt, ph, pw = (int(p) for p in transformer.get("patch_size", (1, 2, 2)))
        # An image-to-video repo's clips keep their first frame (`pil_image`), the image sample videos start from.
        return EncodingSpec(
            conditioning=(TEXT, FIRST_FRAME_IMAGE) if cls.repo_task(model, revision) == "i2v" else (TEXT,),
            z_dim=int(vae.get("latent_channels", 16)),
            scale_factor_spatial=int(vae.get("spatial_compression_ratio", 8)),
            scale_factor_temporal=int(vae.get("temporal_compression_ratio", 4)),
            patch_size=(pt, ph, pw),
        )

    @classmethod
    def make_encoder(cls, model, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        return Kandinsky5Encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.loading import fetch_config

        return latent_statistics_of(fetch_config(model, "vae", revision=revision, required=True))

    @classmethod
    def load_vae(cls, model, *, revision=None, torch_dtype=torch.float32):
        return HunyuanVideoStudent.load_vae(model, revision=revision, torch_dtype=torch_dtype)

    # ---- set-up ----
    def latent_channels(self, config: Any) -> int:
        return int(config.get("out_visual_dim") or config.get("in_visual_dim"))

    def configure(self, config: Any) -> None:
        """The variant from the transformer's config and the repo: NABLA attention refused, the task
        (the repo pipeline's; a recipe's `task` must agree), and the VAE's spatial factor (for the RoPE scale)."""
        st = self.student_config
        where = st.init_from or "models.student.transformer_config"
        if config.get("attention_type") == "nabla":
            raise ValueError(
                f"model '{where}': attention_type 'nabla' (NABLA sparse attention, the 10 s checkpoints) is not supported "
                "by the kandinsky5 family: train a 5 s checkpoint (attention_type regular)"
            )
        self.visual_cond = bool(config.get("visual_cond", False))
        self.capabilities = Capabilities(image_conditioning=self.visual_cond)
        if st.init_from is None:
            self.task = "i2v" if st.task == "i2v" else "t2v"
        else:
            self.task = self.repo_task(st.init_from, st.revision)
            if st.task not in ("auto", self.task):
                pipeline = "Kandinsky5I2VPipeline" if self.task == "i2v" else "Kandinsky5T2VPipeline"
                raise ValueError(
                    f"models.student.task is {st.task} but model '{where}' is a {self.task} repo ({pipeline}, whose "
                    "inputs training keeps): remove the key, or train a repo of that task"
                )
        self.vae_spatial = 8
        if st.init_from is not None:
            from fv_accel.models.loading import fetch_config

            vae = fetch_config(st.init_from, "vae", revision=st.revision, required=False) or {}
            self.vae_spatial = int(vae.get("spatial_compression_ratio", 8))

    # ---- training ----
    def build_conditioning(self, batch: dict) -> Conditioning:
        cond = super().build_conditioning(batch)
        if cond.pooled_text is None:
            raise ValueError(
                "a Kandinsky 5 student needs the 'pooled_text_embedding' column (CLIP's pooled output): "
                "preprocess the clips with this model (python -m fv_accel.preprocess --model ...)"
            )
        cond.clean_frames = 1 if self.task == "i2v" else 0
        return cond

    def transformer_inputs(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> dict[str, Any]:
        """The keyword arguments of the transformer call for the samples of x_t (their texts all of one
        real length), as the pipelines build them."""
        dtype = self.input_dtype
        _, _, frames, height, width = x_t.shape
        _, ph, pw = self.patch_size
        length = int(cond.text_mask[0].sum()) if cond.text_mask is not None else cond.text.shape[1]
        device = x_t.device
        return dict(
            hidden_states=visual_input(x_t, self.visual_cond, cond.clean_frames).to(dtype),
            encoder_hidden_states=cond.text[:, :length].to(dtype),
            pooled_projections=cond.pooled_text.to(dtype),
            timestep=one_timestep(t, cond.clean_frames, self.per_frame_refusal).to(device=device, dtype=dtype),
            visual_rope_pos=[
                torch.arange(frames, device=device),
                torch.arange(height // ph, device=device),
                torch.arange(width // pw, device=device),
            ],
            text_rope_pos=torch.arange(length, device=device),
            scale_factor=pipeline_scale_factor(height * self.vae_spatial, width * self.vae_spatial),
            sparse_params=None,
            return_dict=True,
        )

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity eps - x0 [B, 16, T, H, W] for x_t at t ([B] = sigma * 1000, the pipeline's own
        convention; [B, T] where every noisy frame has one value): one transformer call per distinct
        text length, each sample's text unpadded as the pipeline feeds a prompt's."""
        if cond.pooled_text is None:
            raise ValueError("Kandinsky 5 conditioning needs pooled_text (the 'pooled_text_embedding' column)")
        groups = text_groups(cond)
        if len(groups) == 1:
            return self.transformer(**self.transformer_inputs(x_t, t, cond)).sample.permute(0, 4, 1, 2, 3)
        out = x_t.new_empty(x_t.shape)
        for index, _ in groups:
            index = index.to(x_t.device)
            part = self.transformer(**self.transformer_inputs(x_t[index], t[index], cond.select(index))).sample
            out[index] = part.permute(0, 4, 1, 2, 3).to(out.dtype)
        return out

    def base_model_info(self) -> dict:
        return {**super().base_model_info(), "task": self.task}
