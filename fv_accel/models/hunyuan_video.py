"""The HunyuanVideo family: `HunyuanVideoTransformer3DModel` (hunyuanvideo-community/HunyuanVideo).

What the stock `HunyuanVideoPipeline` (diffusers 0.42) does, and this family with it:

- Text: two encoders, both precomputed by preprocessing. `text_embedding` [L, D] is the Llama
  hidden state two layers before the last (`hidden_states[-3]`) of the caption inside the
  pipeline's prompt template, with the template's first `crop_start` (95) tokens cropped and at
  most 256 tokens kept; `pooled_text_embedding` [D2] is CLIP's pooled output (77 tokens). Both come
  from the pipeline's own `encode_prompt` (its Llama tokenizer loaded as its tokenizer_config.json
  names it, padding on the right: see HunyuanVideoEncoder); the Llama states are stored for the
  real tokens only (the transformer masks the rest: trailing padding of any length gives the same
  output, and `forward` drops the loader's padding beyond the batch's longest caption).
- Latents: x_norm = x_raw * vae.config.scaling_factor (0.476986), no mean: latent statistics
  mean 0, std 1 / scaling_factor per channel.
- Flow matching: the pipeline's FlowMatchEulerDiscreteScheduler (shift 7 in the repo) steps
  x <- x + (sigma_next - sigma) * v with timestep = sigma * 1000, so the transformer's output is
  the velocity eps - x0 at t = sigma * 1000: the REFERENCE convention, no conversion.
- Guidance: the transformer has a guidance embedding (`guidance_embeds`), fed `guidance * 1000`
  with the pipeline's `guidance_scale` (6.0 by default). Training feeds `models.student.guidance`,
  by default that same 6.0 (`HunyuanVideoStudent.guidance`); sample videos feed the validation's
  `guidance_scale` (HunyuanVideoPipeline's meaning of that argument: the embedded guidance,
  no second classifier-free pass). The pipeline's true classifier-free pass (`true_cfg_scale` > 1
  with a negative prompt) encodes the negative prompt as a caption; caption dropout trains the
  empty one's encoding (the family's `unconditional_prompt`, "").
- Timesteps: one per sample. `timestep` goes through diffusers' `get_timestep_embedding`, which
  takes 1-D timesteps only, and the resulting [B, D] vector (plus guidance and pooled text) drives
  every block's AdaLN modulation and the token refiner for all tokens alike: no per-frame or
  per-token timesteps, so diffusion forcing is refused.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np
import torch
from diffusers import HunyuanVideoTransformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, register_family
from fv_accel.models.encoders import FamilyEncoder
from fv_accel.models.student import DiffusersStudent

logger = logging.getLogger(__name__)

# HunyuanVideoPipeline.__call__'s default `guidance_scale` (fed to the transformer times 1000).
PIPELINE_GUIDANCE = 6.0


# ---- ComfyUI LoRA layout ----
# diffusers module (inside a block) -> the original HunyuanVideo name, under which ComfyUI reads a
# LoRA (`diffusion_model.<name>.lora_A/lora_B.weight`: ComfyUI's comfy/lora.py maps its HunyuanVideo
# modules to these names, the diffusion-pipe / original layout; diffusers'
# `_convert_hunyuan_video_lora_to_diffusers` reads the same names). Names in FUSED_* are one fused
# linear layer in the original model (q, k, v [, mlp] stacked along the output).
DOUBLE_BLOCK_MODULES = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "norm1.linear": "img_mod.linear",
    "norm1_context.linear": "txt_mod.linear",
    "ff.net.0.proj": "img_mlp.fc1",
    "ff.net.2": "img_mlp.fc2",
    "ff_context.net.0.proj": "txt_mlp.fc1",
    "ff_context.net.2": "txt_mlp.fc2",
}
SINGLE_BLOCK_MODULES = {"proj_out": "linear2", "norm.linear": "modulation.linear"}
REFINER_BLOCK_MODULES = {
    "attn.to_out.0": "self_attn_proj",
    "ff.net.0.proj": "mlp.fc1",
    "ff.net.2": "mlp.fc2",
    "norm_out.linear": "adaLN_modulation.1",
}
# fused original name -> its parts in output order (diffusers module names in the block)
FUSED_DOUBLE = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
FUSED_SINGLE = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
FUSED_REFINER = {"self_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v")}
TOP_MODULES = {"proj_out": "final_layer.linear"}
REFINER_PREFIX = "context_embedder.token_refiner.refiner_blocks."

BLOCK_KINDS = (
    ("transformer_blocks.", "double_blocks.", DOUBLE_BLOCK_MODULES, FUSED_DOUBLE),
    ("single_transformer_blocks.", "single_blocks.", SINGLE_BLOCK_MODULES, FUSED_SINGLE),
    (REFINER_PREFIX, "txt_in.individual_token_refiner.blocks.", REFINER_BLOCK_MODULES, FUSED_REFINER),
)


def _split_block(module: str) -> Optional[tuple[str, str, dict, dict, str]]:
    """(diffusers block prefix + index, original block prefix + index, 1:1 map, fused map, inner name)."""
    for prefix, original, plain, fused in BLOCK_KINDS:
        if module.startswith(prefix):
            index, _, inner = module[len(prefix):].partition(".")
            if index.isdigit() and inner:
                return f"{prefix}{index}.", f"{original}{index}.", plain, fused, inner
    return None


def hunyuan_comfyui_module_name(module: str) -> str:
    """diffusers module name -> original HunyuanVideo name, for the modules that are one layer in
    both; the fused q/k/v(/mlp) parts raise (see `hunyuan_comfyui_lora`)."""
    if module in TOP_MODULES:
        return TOP_MODULES[module]
    split = _split_block(module)
    if split is not None:
        _, original, plain, fused, inner = split
        if inner in plain:
            return original + plain[inner]
        for name, parts in fused.items():
            if inner in parts:
                raise ValueError(
                    f"LoRA on module '{module}': the original HunyuanVideo layer is the fused '{original}{name}' "
                    f"({', '.join(parts)}); it has no one-to-one ComfyUI name (hunyuan_comfyui_lora fuses the parts)"
                )
    raise ValueError(
        f"LoRA on module '{module}' has no ComfyUI (original HunyuanVideo) name; supported: the blocks' attention, "
        f"MLP and modulation layers, the token refiner's blocks and proj_out"
    )


def hunyuan_comfyui_lora(
    state: dict[str, torch.Tensor], alphas: dict[str, float], mlp_width: Optional[int] = None
) -> dict[str, torch.Tensor]:
    """A diffusers-keyed LoRA (`<module>.lora_A/B.weight`, `alphas` by module) -> the original
    HunyuanVideo layout, `diffusion_model.<original>.lora_A/lora_B.weight` (diffusion-pipe's), which
    ComfyUI reads (its HunyuanVideo key map) and so does diffusers' HunyuanVideo LoRA loader.

    Each module's scale alpha / r is folded into lora_B and no alpha is written (both loaders then
    scale by 1). A fused original layer W = [W_1; W_2; ...] (q, k, v [, mlp] stacked along the output)
    whose parts carry LoRAs B_i A_i gets one LoRA of rank sum(r_i), exactly: lora_A = [A_1; A_2; ...],
    lora_B = block-diagonal(s_1 B_1, s_2 B_2, ...) over the parts' output rows. A part without a LoRA
    gets zero rows: the single blocks' MLP part (`mlp_width` rows, hidden * mlp_ratio) when
    proj_mlp is not a target.
    """
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        for part in ("lora_A", "lora_B"):
            suffix = f".{part}.weight"
            if key.endswith(suffix):
                modules.setdefault(key[: -len(suffix)], {})[part] = value
                break
        else:
            raise ValueError(f"unexpected LoRA tensor {key} (only lora_A/lora_B weights are exported)")
    out: dict[str, torch.Tensor] = {}
    fused_groups: dict[str, tuple[str, tuple[str, ...]]] = {}  # original name -> (diffusers block prefix, parts)
    for module, ab in modules.items():
        if set(ab) != {"lora_A", "lora_B"}:
            raise ValueError(f"LoRA module {module} lacks lora_A or lora_B")
        split = _split_block(module)
        if split is not None:
            block, original, _, fused, inner = split
            group = next(((name, parts) for name, parts in fused.items() if inner in parts), None)
            if group is not None:
                fused_groups[original + group[0]] = (block, group[1])
                continue
        name = hunyuan_comfyui_module_name(module)
        scale = float(alphas[module]) / ab["lora_A"].shape[0]
        out[f"diffusion_model.{name}.lora_A.weight"] = ab["lora_A"].contiguous()
        out[f"diffusion_model.{name}.lora_B.weight"] = (ab["lora_B"] * scale).contiguous()
    for name, (block, parts) in fused_groups.items():
        present = [p for p in parts if block + p in modules]
        width = modules[block + present[0]]["lora_B"].shape[0]  # q, k and v are hidden wide
        rows = {}
        for p in parts:
            if block + p in modules:
                rows[p] = modules[block + p]["lora_B"].shape[0]
            elif p == "proj_mlp" and mlp_width is not None:
                rows[p] = int(mlp_width)
            elif p != "proj_mlp":
                rows[p] = width
            else:
                raise ValueError(f"the fused layer '{name}' needs the MLP width (mlp_width) for its proj_mlp rows")
        downs = [modules[block + p]["lora_A"] for p in present]
        rank = sum(d.shape[0] for d in downs)
        up = torch.zeros(sum(rows.values()), rank, dtype=downs[0].dtype)
        row = col = 0
        for p in parts:
            if p in present:
                a, b = modules[block + p]["lora_A"], modules[block + p]["lora_B"]
                scale = float(alphas[block + p]) / a.shape[0]
                up[row : row + rows[p], col : col + a.shape[0]] = b.to(up.dtype) * scale
                col += a.shape[0]
            row += rows[p]
        out[f"diffusion_model.{name}.lora_A.weight"] = torch.cat(downs).contiguous()
        out[f"diffusion_model.{name}.lora_B.weight"] = up
    return out


# ---- preprocessing ----
class HunyuanVideoEncoder(FamilyEncoder):
    """The VAE (`AutoencoderKLHunyuanVideo`) and both text encoders of one HunyuanVideo repo, loaded
    by the stock pipeline's own loader, in eval mode, no grad."""

    def __init__(self, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        from diffusers import HunyuanVideoPipeline

        from fv_accel.models.loading import explain_load_error, fetch_config

        self.device = device or torch.device("cpu")
        self.dtype = dtype
        self.spec = spec or HunyuanVideoStudent.encoding_spec(model, revision=revision)
        self.vae = HunyuanVideoStudent.load_vae(model, revision=revision, torch_dtype=dtype)
        self.vae.to(self.device).eval().requires_grad_(False)
        if vae_tiling:  # tiles blend seams: only on request, for high resolutions
            self.vae.enable_tiling()
        fetch_config(model, "text_encoder", revision=revision, required=True)
        try:
            # The Llama tokenizer as its own tokenizer_config.json names it (AutoTokenizer): under
            # transformers 5, `LlamaTokenizerFast.from_pretrained` (the class model_index.json names)
            # rebuilds a byte-level Llama 3 tokenizer.json as a SentencePiece-style BPE, with other
            # tokens. Right padding: the pipeline crops the template from the left and the
            # transformer takes the first mask.sum() tokens as the real ones.
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model, subfolder="tokenizer", revision=revision)
            if tokenizer.padding_side != "right":
                logger.info("%s: the Llama tokenizer pads on the %s; padding on the right", model, tokenizer.padding_side)
                tokenizer.padding_side = "right"
            # The rest with the pipeline's own component classes and its encode_prompt (template,
            # crop_start, hidden layer, lengths).
            self.text_pipeline = HunyuanVideoPipeline.from_pretrained(
                model, tokenizer=tokenizer, transformer=None, vae=None, revision=revision, torch_dtype=dtype,
                use_safetensors=True,
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "text encoders and tokenizers", err, revision=revision) from None
        for encoder in (self.text_pipeline.text_encoder, self.text_pipeline.text_encoder_2):
            encoder.to(self.device).eval().requires_grad_(False)

    def _video(self, frames: np.ndarray) -> torch.Tensor:
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        return video.to(self.device, torch.float32) / 127.5 - 1.0

    @torch.no_grad()
    def encode_video(self, frames: np.ndarray) -> torch.Tensor:
        """uint8 [F, H, W, 3] -> raw latent [16, (F-1)/4+1, H/8, W/8], the posterior's mode."""
        latent = self.vae.encode(self._video(frames).to(self.dtype)).latent_dist.mode()
        return latent[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """{"text_embedding": [L, D] Llama states of the caption's real tokens, "pooled_text_embedding": [D2]}."""
        embeds, pooled, mask = self.text_pipeline.encode_prompt(prompt=caption, device=self.device)
        length = int(mask[0].sum())  # right-padded: the real tokens come first
        return {
            "text_embedding": embeds[0, :length].float().cpu(),
            "pooled_text_embedding": pooled[0].float().cpu(),
        }

    def encode_frames_conditioning(self, frames: np.ndarray) -> dict[str, torch.Tensor]:
        return {}  # text-to-video

    def latent_statistics(self) -> tuple[list[float], list[float]]:
        return latent_statistics_of(self.vae.config)


def real_text(cond: Conditioning) -> tuple[torch.Tensor, torch.Tensor]:
    """(text [B, L, D], mask [B, L]) cut to the batch's longest real text. Trailing padding changes
    no output (the transformer masks it, and its token refiner lets every token see key 0, a real
    token), so the loader's padding to 512 tokens is dropped."""
    text, mask = cond.text, cond.text_mask
    if mask is None:
        mask = torch.ones(text.shape[:2], device=text.device, dtype=torch.long)
    keep = max(int(mask.sum(dim=1).max()), 1)
    return text[:, :keep], mask[:, :keep]


def check_text_to_video(transformer_config: Any, where: str) -> None:
    """The family trains HunyuanVideo text-to-video; HunyuanVideo-I2V's transformer (its
    `image_condition_type`, latent_concat or token_replace) needs image conditioning it lacks."""
    kind = transformer_config.get("image_condition_type")
    if kind is not None:
        raise ValueError(
            f"model '{where}': a HunyuanVideo image-to-video transformer (image_condition_type {kind!r}) is not "
            f"supported by the hunyuan_video family (text-to-video only)"
        )


def latent_statistics_of(vae_config: Any) -> tuple[list[float], list[float]]:
    channels = int(vae_config["latent_channels"])
    scale = float(vae_config["scaling_factor"])
    return [0.0] * channels, [1.0 / scale] * channels


@register_family
class HunyuanVideoStudent(DiffusersStudent):
    """HunyuanVideo (text-to-video, guidance-distilled): fine-tuning, full or LoRA."""

    family = "hunyuan_video"
    vae_class_names = ("AutoencoderKLHunyuanVideo",)
    transformer_classes = {"hunyuan_video": HunyuanVideoTransformer3DModel}
    pipeline_class_names = ("HunyuanVideoPipeline",)
    capabilities = Capabilities(per_frame_timesteps=False, causal_attention=False, image_conditioning=False)
    # The attention projections of the dual-stream, single-stream and token-refiner blocks
    # (the same four names as the Wan family's default).
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    per_frame_refusal = (
        "HunyuanVideoTransformer3DModel takes one timestep per sample (timestep [B]: its time embedding accepts "
        "1-D timesteps only and one AdaLN modulation vector drives all tokens)"
    )
    # The embedded guidance fed during training (`models.student.guidance`, else
    # HunyuanVideoPipeline's default guidance_scale); None for a transformer without the input.
    guidance: Optional[float] = PIPELINE_GUIDANCE

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import HunyuanVideoPipeline

        return HunyuanVideoPipeline

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        return hunyuan_comfyui_module_name(module)

    @classmethod
    def comfyui_lora_state(
        cls, state: dict[str, torch.Tensor], metadata: Optional[dict], transformer_config: Any
    ) -> Optional[dict[str, torch.Tensor]]:
        """The adapter in the original HunyuanVideo layout (`hunyuan_comfyui_lora`); the fused
        single-block layer's MLP width comes from the base transformer's config."""
        from fv_accel.models.lora import alpha_by_module

        if metadata is None or metadata.get("use_rslora") or metadata.get("use_dora"):
            raise ValueError("rsLoRA/DoRA adapters and files without adapter metadata (alpha unknown) have no ComfyUI layout here")
        config = transformer_config()
        mlp_width = int(config["num_attention_heads"] * config["attention_head_dim"] * config["mlp_ratio"])
        return hunyuan_comfyui_lora(state, alpha_by_module(state, metadata), mlp_width=mlp_width)

    # ---- preprocessing / validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.encoders import TEXT, EncodingSpec
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=True)
        check_text_to_video(transformer, model)
        p = int(transformer.get("patch_size", 2))
        return EncodingSpec(
            conditioning=(TEXT,),
            z_dim=int(vae.get("latent_channels", 16)),
            scale_factor_spatial=int(vae.get("spatial_compression_ratio", 8)),
            scale_factor_temporal=int(vae.get("temporal_compression_ratio", 4)),
            patch_size=(int(transformer.get("patch_size_t", 1)), p, p),
        )

    @classmethod
    def make_encoder(cls, model, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        return HunyuanVideoEncoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None):
        from fv_accel.models.loading import fetch_config

        return latent_statistics_of(fetch_config(model, "vae", revision=revision, required=True))

    @classmethod
    def load_vae(cls, model, *, revision=None, torch_dtype=torch.float32):
        from diffusers import AutoencoderKLHunyuanVideo

        from fv_accel.models.loading import explain_load_error, fetch_config

        fetch_config(model, "vae", revision=revision, required=True)
        try:
            return AutoencoderKLHunyuanVideo.from_pretrained(
                model, subfolder="vae", revision=revision, torch_dtype=torch_dtype, use_safetensors=True
            )
        except (OSError, ValueError) as err:
            raise explain_load_error(model, "VAE (subfolder 'vae')", err, revision=revision) from None

    # ---- training ----
    def build_conditioning(self, batch: dict) -> Conditioning:
        cond = super().build_conditioning(batch)
        if cond.pooled_text is None:
            raise ValueError(
                "a HunyuanVideo student needs the 'pooled_text_embedding' column (CLIP's pooled output): "
                "preprocess the clips with this model (python -m fv_accel.preprocess --model ...)"
            )
        return cond

    def configure(self, config: Any) -> None:
        where = self.student_config.init_from or "models.student.transformer_config"
        check_text_to_video(config, where)
        wanted = getattr(self.student_config, "guidance", None)
        if not config.get("guidance_embeds", False):
            if wanted is not None:
                raise ValueError(
                    f"models.student.guidance is {wanted} but the transformer of '{where}' has no guidance embedding "
                    f"(guidance_embeds: false): remove the key"
                )
            self.guidance = None
        else:
            self.guidance = PIPELINE_GUIDANCE if wanted is None else float(wanted)
            self.takes_guidance = True

    def input_dtype_of(self, module: torch.nn.Module) -> torch.dtype:
        """The patch embedding's dtype (the one the pipeline casts its inputs to)."""
        return module.x_embedder.proj.weight.dtype

    def guidance_input(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
        """The transformer's `guidance` input, as the pipeline builds it (guidance * 1000 per sample),
        or None for a transformer without the guidance embedding."""
        if self.guidance is None:
            return None
        return torch.full((batch_size,), float(self.guidance), device=device, dtype=dtype) * 1000.0

    @staticmethod
    def single_timestep(t: torch.Tensor, per_frame_refusal: str) -> torch.Tensor:
        """[B] timesteps: per-frame [B, T] ones only where every frame of a sample has the same value."""
        if t.ndim == 1:
            return t
        if t.ndim == 2 and bool((t == t[:, :1]).all()):
            return t[:, 0]
        raise ValueError(f"the hunyuan_video family cannot take a timestep per latent frame: {per_frame_refusal}")

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The velocity eps - x0 for x_t [B, 16, T, H, W] at t [B] (= sigma * 1000, the pipeline's own
        convention: no conversion)."""
        if cond.pooled_text is None:
            raise ValueError("HunyuanVideo conditioning needs pooled_text (the 'pooled_text_embedding' column)")
        timestep = self.single_timestep(t, self.per_frame_refusal)
        dtype = self.input_dtype
        text, mask = real_text(cond)
        return self.transformer(
            hidden_states=x_t.to(dtype),
            timestep=timestep.to(x_t.device),
            encoder_hidden_states=text.to(dtype),
            encoder_attention_mask=mask.to(dtype),
            pooled_projections=cond.pooled_text.to(dtype),
            guidance=self.guidance_input(x_t.shape[0], x_t.device, dtype),
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
    ) -> Optional[torch.Tensor]:
        """Normalised latents [1, 16, T, h, w] from the stock HunyuanVideoPipeline around the live
        transformer with `scheduler`, prompt embeddings precomputed (no text encoders loaded).
        `guidance_scale` is the pipeline's: the embedded guidance; `negative` is not used (no true
        classifier-free pass)."""
        from diffusers import HunyuanVideoPipeline

        from fv_accel.sampling import pipeline_latents

        del negative, first_frame
        pipe = HunyuanVideoPipeline(
            text_encoder=None,
            tokenizer=None,
            transformer=self._unwrapped(),
            vae=vae,
            scheduler=scheduler,
            text_encoder_2=None,
            tokenizer_2=None,
        )
        text, mask = real_text(cond)
        # No negative prompt: the pipeline's true classifier-free pass stays off.
        return pipeline_latents(
            pipe,
            text,
            None,
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            pooled_prompt_embeds=cond.pooled_text,
            prompt_attention_mask=mask,
        )

    # ---- outputs ----
    def base_model_info(self) -> dict:
        return {**super().base_model_info(), "guidance": self.guidance}

    def save_final(self, accelerator: Any, output_dir: Any) -> None:
        """The generic outputs, and for a LoRA run `pytorch_lora_weights_comfyui.safetensors`: the
        same adapter in the original HunyuanVideo layout (`hunyuan_comfyui_lora`), read back from
        the diffusers file just written (no second gather of a sharded adapter)."""
        super().save_final(accelerator, output_dir)
        if not self.lora_enabled or not accelerator.is_main_process:
            return
        from pathlib import Path

        from fv_accel.models.lora import COMFYUI_LORA_FILE, DIFFUSERS_LORA_FILE, read_lora_file, save_comfyui_file

        state, metadata = read_lora_file(Path(output_dir) / DIFFUSERS_LORA_FILE)
        if metadata is None or metadata.get("use_rslora") or metadata.get("use_dora"):
            logger.warning("no ComfyUI LoRA file: the adapter is rsLoRA/DoRA or has no metadata (alpha unknown)")
            return
        comfy = self.comfyui_lora_state(state, metadata, lambda: dict(self.modules[0].config))
        save_comfyui_file(Path(output_dir) / COMFYUI_LORA_FILE, comfy)
