"""The Cosmos-Predict2 family (`cosmos2`): `CosmosTransformer3DModel` of nvidia/Cosmos-Predict2-*-Video2World.

Conventions, read from diffusers' Cosmos2VideoToWorldPipeline (0.42):
- The pipeline runs EDM (variance-exploding) latents `x = x0 + sigma * eps`, sigma from 80 to
  0.002 on Karras steps, and feeds the transformer `c_in * x = x / (1 + sigma)` at timestep
  `s = sigma / (1 + sigma)` (a float in [0, 1]); then `x0_hat = c_skip * x + c_out * out` with
  `c_skip = 1 - s`, `c_out = -s`. In rectified-flow terms the transformer sees
  `x_s = (1 - s) x0 + s eps` at `s` and `x0_hat = x_s - s * out`: its output is the flow velocity
  `eps - x0` of REFERENCE.md, at sigma = s. So `forward` passes `x_t` as is, the timestep as
  `t / 1000`, and returns the output unchanged (no sign flip, no rescaling).
- Latents are normalised as `(x - latents_mean) / latents_std * sigma_data` (sigma_data 1.0).
- Video2World conditions on leading latent frames by frame replacement: they enter clean, with
  `condition_mask` 1 (a 17th input channel) and the timestep `sigma_conditioning /
  (sigma_conditioning + 1)` (sigma_conditioning 1e-4), and their output is replaced by the
  condition. Here they are the contract's `Conditioning.clean_frames` (1: the pipeline's
  `image=` input): the method gives them t = 0, `forward` turns that into the pipeline's values.
- `padding_mask` is all zeros (the pipeline's); `fps` the pipeline's default (16).
- The transformer takes its timestep as [B, 1, T, 1, 1], one per latent frame (AdaLN per frame),
  which is how the pipeline calls it: per-frame timesteps work (diffusion forcing).
- Training noise: Cosmos-Predict2 draws `log sigma ~ N(0, 1)` and scales video sigmas by
  sqrt(latent frames); in flow terms, the table of shift sqrt(T) (`video_noise_shift`, the
  default `training_shift`) drawn logit-normally (the recipes' `training.model.weighting_scheme`).
  The repo's scheduler config (shift 1, Karras sigmas) describes its sampler only. Its loss weighs
  the x0 error by (sigma^2 + 1) / sigma^2, which is the velocity error weighted by
  (1 - s)^2 + s^2 (between 0.5 and 1); fv_accel's methods weigh it 1 (the loss is the method's).
"""

from __future__ import annotations

import inspect
import math
import types
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from diffusers import CosmosTransformer3DModel

from fv_accel.models.base import Capabilities, Conditioning, register_family
from fv_accel.models.encoders import TEXT, TEXT_MAX_LENGTH, EncodingSpec, FamilyEncoder
from fv_accel.models.student import DiffusersStudent


def _pipeline_default(name: str) -> Any:
    from diffusers import Cosmos2VideoToWorldPipeline

    return inspect.signature(Cosmos2VideoToWorldPipeline.__call__).parameters[name].default


def _default_negative_prompt() -> str:
    from diffusers.pipelines.cosmos.pipeline_cosmos2_video2world import DEFAULT_NEGATIVE_PROMPT

    return DEFAULT_NEGATIVE_PROMPT


# The pipeline's call defaults: the frame rate it gives the RoPE and the noise level of the
# condition frames.
PIPELINE_FPS: int = _pipeline_default("fps")
SIGMA_CONDITIONING: float = _pipeline_default("sigma_conditioning")
# The condition frames' timestep, as the pipeline computes it (t = sigma / (sigma + 1)).
CONDITION_TIMESTEP: float = SIGMA_CONDITIONING / (SIGMA_CONDITIONING + 1.0)
NUM_TRAIN_TIMESTEPS = 1000


def install_padding_mask_resize() -> bool:
    """Let `CosmosTransformer3DModel` run without torchvision; returns True where it was needed.

    With `concat_padding_mask` (every Cosmos-Predict2 model) diffusers' transformer resizes the
    padding mask to the latent size with `torchvision.transforms.functional.resize(...,
    InterpolationMode.NEAREST)`, through a module-level `transforms` bound only when torchvision
    is installed (this project does not depend on it). Without it, this binds a `transforms`
    whose `functional.resize` is `torch.nn.functional.interpolate(mode="nearest")`, what
    torchvision's tensor resize runs for NEAREST. The masks fv_accel and the pipeline pass are all
    zeros, so the resized mask is zeros either way.
    """
    from diffusers.models.transformers import transformer_cosmos

    if hasattr(transformer_cosmos, "transforms"):
        return False

    def resize(img: torch.Tensor, size: list[int], interpolation: str = "nearest", **_: Any) -> torch.Tensor:
        if interpolation != "nearest":
            raise ValueError(f"only nearest resizing is provided without torchvision, not {interpolation!r}")
        return F.interpolate(img, size=list(size), mode="nearest")

    transformer_cosmos.transforms = types.SimpleNamespace(
        functional=types.SimpleNamespace(resize=resize),
        InterpolationMode=types.SimpleNamespace(NEAREST="nearest"),
    )
    return True


install_padding_mask_resize()


class PassThroughSafetyChecker:
    """A stand-in for cosmos_guardrail's `CosmosSafetyChecker` (not installable here) that checks
    nothing: every prompt passes, every video is returned unchanged.

    Cosmos2VideoToWorldPipeline refuses to run without a safety checker and builds the guardrail
    itself when given None. fv_accel's sample videos call the pipeline with precomputed prompt
    embeddings and `output_type="latent"`, a path on which the pipeline never consults the checker
    (no prompt text to screen, no decoded video); tests load the stock pipeline with this
    stand-in, so their decoded videos are not screened either.
    """

    def to(self, *args: Any, **kwargs: Any) -> "PassThroughSafetyChecker":
        return self

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, frames: Any) -> Any:
        return frames


def transformer_timestep(t: torch.Tensor, num_frames: int, clean_frames: int) -> torch.Tensor:
    """fv_accel timesteps (t = sigma * 1000, [B] or per frame [B, T]) -> the transformer's
    [B, 1, T, 1, 1] in [0, 1]; the `clean_frames` leading (condition) frames get the pipeline's
    condition timestep."""
    t = (t if t.is_floating_point() else t.float()) / NUM_TRAIN_TIMESTEPS
    if t.ndim == 1:
        t = t[:, None].expand(-1, num_frames)
    if t.ndim != 2 or t.shape[1] != num_frames:
        raise ValueError(f"timesteps must be [B] or [B, {num_frames}], got {tuple(t.shape)}")
    if clean_frames:
        t = t.clone()
        t[:, :clean_frames] = CONDITION_TIMESTEP
    return t[:, None, :, None, None]


def condition_mask(x_t: torch.Tensor, clean_frames: int) -> torch.Tensor:
    """[B, 1, T, H, W]: 1 on the condition frames, 0 elsewhere (the pipeline's `cond_mask`)."""
    b, _, frames, h, w = x_t.shape
    mask = x_t.new_zeros(b, 1, frames, h, w)
    mask[:, :, :clean_frames] = 1.0
    return mask


def transformer_inputs(
    x_t: torch.Tensor, t: torch.Tensor, text: torch.Tensor, clean_frames: int, dtype: torch.dtype
) -> dict[str, Any]:
    """The keyword arguments of `CosmosTransformer3DModel.forward` for normalised latents x_t
    [B, C, T, H, W] at fv_accel timesteps t, as the Video2World pipeline builds them."""
    b, _, frames, h, w = x_t.shape
    return dict(
        hidden_states=x_t.to(dtype),
        timestep=transformer_timestep(t, frames, clean_frames).to(dtype),
        encoder_hidden_states=text.to(dtype),
        fps=PIPELINE_FPS,
        condition_mask=condition_mask(x_t, clean_frames).to(dtype),
        padding_mask=x_t.new_zeros(1, 1, h, w, dtype=dtype),
        return_dict=False,
    )


def edm_sigma(s: torch.Tensor | float) -> torch.Tensor | float:
    """Flow sigma s in [0, 1) -> the pipeline's EDM sigma (s = sigma / (1 + sigma))."""
    return s / (1 - s)


def video_noise_shift(latent_frames: int) -> float:
    """Cosmos-Predict2's training noise in flow terms.

    Its training draws `log sigma0 ~ N(0, 1)` and scales the EDM sigma of video batches by
    `sqrt(state_t)` (`adjust_video_noise`; state_t, the latent frames of its training clips).
    With s = sigma / (1 + sigma), sigma = k * sigma0 maps u = sigma0 / (1 + sigma0) to
    `k u / (1 + (k - 1) u)`: the shifted flow table with shift k = sqrt(latent frames), sampled
    logit-normally (logit u ~ N(0, 1))."""
    return math.sqrt(max(1, int(latent_frames)))


# ---- the family ----
# What a cosmos2 dataset stores besides the caption: the clip's first frame as `pil_image` (uint8
# [H, W, 3]), the image the pipeline starts sample videos from. The condition latent itself is the
# clip's own first latent frame (the Wan VAE is causal in time: frame 0's latent is the image's).
FIRST_FRAME_IMAGE = "first_frame_image"
# diffusers module name -> NVIDIA's original Cosmos-Predict2 name (the checkpoints' `net.` keys),
# which ComfyUI's Cosmos-Predict2 model keeps; its LoRA loader reads `diffusion_model.<name>`.
COSMOS2_BLOCK_MODULES = {
    "attn1.to_q": "self_attn.q_proj",
    "attn1.to_k": "self_attn.k_proj",
    "attn1.to_v": "self_attn.v_proj",
    "attn1.to_out.0": "self_attn.output_proj",
    "attn2.to_q": "cross_attn.q_proj",
    "attn2.to_k": "cross_attn.k_proj",
    "attn2.to_v": "cross_attn.v_proj",
    "attn2.to_out.0": "cross_attn.output_proj",
    "ff.net.0.proj": "mlp.layer1",
    "ff.net.2": "mlp.layer2",
    "norm1.linear_1": "adaln_modulation_self_attn.1",
    "norm1.linear_2": "adaln_modulation_self_attn.2",
    "norm2.linear_1": "adaln_modulation_cross_attn.1",
    "norm2.linear_2": "adaln_modulation_cross_attn.2",
    "norm3.linear_1": "adaln_modulation_mlp.1",
    "norm3.linear_2": "adaln_modulation_mlp.2",
}
COSMOS2_TOP_MODULES = {
    "patch_embed.proj": "x_embedder.proj.1",
    "time_embed.t_embedder.linear_1": "t_embedder.1.linear_1",
    "time_embed.t_embedder.linear_2": "t_embedder.1.linear_2",
    "norm_out.linear_1": "final_layer.adaln_modulation.1",
    "norm_out.linear_2": "final_layer.adaln_modulation.2",
    "proj_out": "final_layer.linear",
}


def cosmos2_original_module_name(module: str) -> str:
    """diffusers module name -> the original Cosmos-Predict2 name (ComfyUI's layout)."""
    from fv_accel.models.lora import original_module_name

    return original_module_name(
        module,
        blocks="transformer_blocks",
        original_blocks="blocks",
        block_modules=COSMOS2_BLOCK_MODULES,
        top_modules=COSMOS2_TOP_MODULES,
        naming="original Cosmos-Predict2 (ComfyUI)",
        supported="the attention projections, the MLP, the AdaLN modulation layers, the patch and time embedders and the final layer",
    )


class Cosmos2Encoder(FamilyEncoder):
    """The Wan 2.1 VAE and T5 encoder of a Cosmos-Predict2 repo, in eval mode, no grad."""

    text_max_length = TEXT_MAX_LENGTH  # the pipeline's max_sequence_length

    def __init__(self, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None):
        from transformers import T5EncoderModel

        from fv_accel.models.loading import load_text_encoder, load_vae

        self.device = device or torch.device("cpu")
        self.spec = spec or Cosmos2Student.encoding_spec(model, revision)
        self.statistics = Cosmos2Student.latent_statistics(model, revision)
        self.vae = load_vae(model, revision=revision, torch_dtype=dtype).to(self.device).eval().requires_grad_(False)
        self.tokenizer, self.text_encoder = load_text_encoder(model, revision=revision, torch_dtype=dtype, encoder_class=T5EncoderModel)
        self.text_encoder.to(self.device).eval().requires_grad_(False)
        if vae_tiling and hasattr(self.vae, "enable_tiling"):
            self.vae.enable_tiling()
        self.dtype = dtype

    @torch.no_grad()
    def encode_video(self, frames: Any) -> torch.Tensor:
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(3, 0, 1, 2)[None]
        video = video.to(self.device, torch.float32) / 127.5 - 1.0
        return self.vae.encode(video.to(self.dtype)).latent_dist.mode()[0].float().cpu()

    @torch.no_grad()
    def encode_caption(self, caption: str) -> dict[str, torch.Tensor]:
        """The T5 hidden states of the caption's real tokens, as the pipeline's `_get_t5_prompt_embeds`
        computes them (512-token padding, attention mask; the padded rows, zeros there, are the loader's)."""
        tok = self.tokenizer(
            [caption], padding="max_length", max_length=TEXT_MAX_LENGTH, truncation=True, return_tensors="pt"
        )
        ids, mask = tok.input_ids.to(self.device), tok.attention_mask.to(self.device)
        hidden = self.text_encoder(ids, attention_mask=mask).last_hidden_state
        return {"text_embedding": hidden[0, : int(mask.sum())].float().cpu()}

    def encode_frames_conditioning(self, frames: Any) -> dict[str, torch.Tensor]:
        return {"pil_image": torch.from_numpy(np.array(frames[0], dtype=np.uint8))}

    def latent_statistics(self) -> Optional[tuple[list[float], list[float]]]:
        return self.statistics


@register_family
class Cosmos2Student(DiffusersStudent):
    """Cosmos-Predict2 Video2World (`Cosmos2VideoToWorldPipeline`): image-to-video by frame
    replacement, one clean condition frame (module docstring: conventions)."""

    family = "cosmos2"
    vae_class_names = ("AutoencoderKLWan",)
    transformer_classes = {"cosmos2": CosmosTransformer3DModel}
    pipeline_class_names = ("Cosmos2VideoToWorldPipeline",)
    capabilities = Capabilities(per_frame_timesteps=True, causal_attention=False, image_conditioning=True)
    # Cosmos-Predict2's own LoRA targets (q/k/v/output_proj, mlp.layer1/2) by diffusers' names; the
    # cosmos2 recipes list them in models.student.lora.target_modules.
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0", "ff.net.0.proj", "ff.net.2")
    comfyui_lora = True
    latent_statistics_source = "vae/config.json and scheduler/scheduler_config.json (sigma_data)"
    # The leading latent frames given clean: the pipeline's `image=` input (one latent frame).
    condition_frames = 1
    # Without a negative prompt the pipeline's unconditional branch encodes its DEFAULT_NEGATIVE_PROMPT.
    unconditional_prompt = _default_negative_prompt()

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        # Cosmos2VideoToWorldPipeline has no LoRA loader; diffusers' Cosmos LoRA format (keys
        # `transformer.<module>.lora_A/B.weight`) is CosmosLoraLoaderMixin's, which this pipeline
        # carries. The stock Video2World pipeline loads the file with
        # `pipe.transformer.load_lora_adapter(dir, weight_name="pytorch_lora_weights.safetensors", prefix="transformer")`.
        from diffusers.pipelines.cosmos.pipeline_cosmos2_5_predict import Cosmos2_5_PredictBasePipeline

        return Cosmos2_5_PredictBasePipeline

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        return cosmos2_original_module_name(module)

    # ---- preprocessing and validation ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> EncodingSpec:
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=True)
        transformer = fetch_config(model, "transformer", revision=revision, required=True)
        temporal = vae.get("temperal_downsample") or [False, True, True]
        return EncodingSpec(
            conditioning=(TEXT, FIRST_FRAME_IMAGE),
            z_dim=int(vae.get("z_dim", 16)),
            # As the pipeline computes them from the Wan 2.1 VAE's config.
            scale_factor_spatial=2 ** len(temporal),
            scale_factor_temporal=2 ** sum(bool(x) for x in temporal),
            patch_size=tuple(int(p) for p in transformer.get("patch_size") or (1, 2, 2)),  # type: ignore[arg-type]
        )

    @classmethod
    def make_encoder(cls, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None) -> Cosmos2Encoder:
        return Cosmos2Encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> Optional[tuple[list[float], list[float]]]:
        """The pipeline's `(x - latents_mean) / latents_std * sigma_data` as (mean, std / sigma_data)."""
        from fv_accel.models.loading import fetch_config

        vae = fetch_config(model, "vae", revision=revision, required=False)
        if vae is None or vae.get("latents_mean") is None or vae.get("latents_std") is None:
            return None
        scheduler = fetch_config(model, "scheduler", revision=revision, required=False, filename="scheduler_config.json") or {}
        sigma_data = float(scheduler.get("sigma_data", 1.0))
        return list(vae["latents_mean"]), [float(s) / sigma_data for s in vae["latents_std"]]

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32) -> Any:
        from fv_accel.models.loading import load_vae

        return load_vae(model, revision=revision, torch_dtype=torch_dtype)

    # ---- construction ----
    def configure(self, config: Any) -> None:
        st = self.student_config
        if int(config.in_channels) != self.in_channels + 1:
            raise ValueError(
                f"{st.init_from or 'models.student.transformer_config'}: a Cosmos-Predict2 Video2World transformer "
                f"takes the latent channels + 1 condition-mask channel, this one {config.in_channels} for "
                f"{self.in_channels} (text-to-image and Cosmos 1.0/2.5 transformers are not supported)"
            )
        if st.task == "t2v":
            raise ValueError(
                "models.student.task: t2v: Cosmos-Predict2 Video2World always starts from a clean first frame "
                "(set auto or i2v)"
            )

    def input_dtype_of(self, module: torch.nn.Module) -> torch.dtype:
        return module.patch_embed.proj.weight.dtype

    def training_shift(self, latent_shape: torch.Size) -> float:
        """`models.student.flow_shift`, else Cosmos-Predict2's video noise scaling in flow terms:
        sqrt(latent frames) (`video_noise_shift`). The repo's scheduler config (shift 1, Karras
        sigmas from 80 to 0.002) describes the sampler, not the training noise."""
        st = self.student_config
        if st.flow_shift is not None:
            return float(st.flow_shift)
        return video_noise_shift(int(latent_shape[2]))

    def describe_training_shift(self) -> Any:
        st = self.student_config
        return float(st.flow_shift) if st.flow_shift is not None else "sqrt(latent frames) (Cosmos-Predict2 video noise)"

    # ---- per step ----
    def build_conditioning(self, batch: dict) -> Conditioning:
        cond = super().build_conditioning(batch)
        cond.clean_frames = self.condition_frames
        return cond

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The flow velocity for x_t [B, C, T, H, W] at t ([B] or [B, T], sigma * 1000): the
        transformer's output as is (module docstring)."""
        kwargs = transformer_inputs(x_t, t, cond.text, cond.clean_frames, self.input_dtype)
        return self.transformer(**kwargs)[0]

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
        first_frame: Optional[Any] = None,
    ) -> Optional[torch.Tensor]:
        """A sample through Cosmos2VideoToWorldPipeline around the live transformer, from
        `first_frame` (uint8 [H, W, 3]), stepping with `scheduler` (by default the repo's: Karras EDM
        sigmas); returns the normalised latents. Its safety checker is the pass-through stand-in,
        never consulted on this path (precomputed prompt embeddings, latents out)."""
        from diffusers import Cosmos2VideoToWorldPipeline
        from PIL import Image

        from fv_accel.sampling import pipeline_latents

        if first_frame is None:
            raise ValueError("a Cosmos-Predict2 Video2World sample needs a first frame")
        pipe = Cosmos2VideoToWorldPipeline(
            text_encoder=None,
            tokenizer=None,
            transformer=self.transformer,
            vae=vae,
            scheduler=scheduler,
            safety_checker=PassThroughSafetyChecker(),
        )
        return pipeline_latents(
            pipe,
            cond.text.to(self.input_dtype),
            None if negative is None else negative.text.to(self.input_dtype),
            height=height,
            width=width,
            num_frames=num_frames,
            num_inference_steps=num_inference_steps,
            guidance_scale=guidance_scale,
            generator=generator,
            image=Image.fromarray(np.asarray(first_frame, dtype=np.uint8)),
        )

    @classmethod
    def default_scheduler_config(cls) -> dict:
        """The scheduler diffusers' Cosmos-Predict2 conversion writes (Karras EDM sigmas), for a
        model folder without one."""
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "use_karras_sigmas": True}
