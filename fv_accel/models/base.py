"""The model contract. A *family* (one file under fv_accel/models/) is a `ModelBase` subclass that
registers itself with `@register_family`: the diffusers classes it loads, the Hub layout it reads, its
latent statistics, the conditioning it builds from a batch, one `forward(x_t, t, cond)` returning the
flow velocity, its capabilities, LoRA targets and ComfyUI key map, the pipeline for sample videos and
the encoders preprocessing needs.

A family knows its transformer, never the loss: noise, timesteps, noising and losses belong to the
methods (fv_accel/methods/), the flow-matching table to the scheduler adapter (fv_accel/schedulers.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Optional, Sequence

import torch


def state_dict_sha256(module: torch.nn.Module) -> str:
    """sha256 over the module's state dict in key order: each tensor's name, dtype, shape and the
    sha256 of its bytes (hashed in threads: hashlib releases the GIL). Whole tensors only, so it is
    taken before an engine shards them, and then does not depend on the process count."""
    from concurrent.futures import ThreadPoolExecutor

    state = module.state_dict()
    names = sorted(state)

    def tensor_sha256(name: str) -> str:
        flat = state[name].detach().to("cpu").contiguous().reshape(-1)
        return hashlib.sha256(flat.view(torch.uint8).numpy()).hexdigest()

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        digests = list(pool.map(tensor_sha256, names))
    whole = hashlib.sha256()
    for name, digest in zip(names, digests):
        tensor = state[name]
        whole.update(f"{name}\t{str(tensor.dtype).replace('torch.', '')}\t{list(tensor.shape)}\t{digest}\n".encode())
    return whole.hexdigest()


def reshard_fsdp_units(module: torch.nn.Module) -> None:
    """Every FSDP2 unit of `module` back to its shards (nothing for a module FSDP2 does not wrap).
    FSDP2 keeps a root's parameters gathered from its forward to its backward (and every unit's
    with reshard_after_forward false): after a forward that no backward follows, a frozen role's,
    they stay gathered until this. A backward that does pass through gathers them again (FSDP2's
    pre-backward hook)."""
    from torch.distributed.fsdp import FSDPModule

    for part in module.modules():
        if isinstance(part, FSDPModule):
            part.reshard()


def reshard_after_forward(module: torch.nn.Module, args: tuple, output: Any) -> None:
    """A forward hook for a frozen role's FSDP2 root: `reshard_fsdp_units` after each forward."""
    reshard_fsdp_units(module)


@dataclass(frozen=True)
class Capabilities:
    """What a family's transformer can do; methods check these at build time."""

    per_frame_timesteps: bool = False  # `forward` takes t as [B, T] (diffusion forcing needs it)
    causal_attention: bool = False  # block-causal self-attention can be installed
    image_conditioning: bool = False  # a first-frame (image-to-video) condition exists
    # `training.model.context_parallel` splits its sequences (fv_accel/models/context_parallel.py).
    context_parallel: bool = False


@dataclass
class Conditioning:
    """What the transformer is conditioned on besides x_t and t (built by the family from a batch).

    `clean_frames` leading latent frames are the clean condition itself (image-to-video by frame
    replacement): the method keeps them un-noised, gives them timestep 0 and no loss.
    """

    text: Optional[torch.Tensor] = None  # [B, L, D]
    text_mask: Optional[torch.Tensor] = None  # [B, L]
    image: Optional[torch.Tensor] = None  # image-encoder features [B, L_img, D_img]
    condition_latent: Optional[torch.Tensor] = None  # normalised, [B, C, T, H, W] (channel-concat I2V)
    clean_frames: int = 0
    pooled_text: Optional[torch.Tensor] = None  # [B, D_pooled] (e.g. HunyuanVideo's CLIP pooled output)
    text_2: Optional[torch.Tensor] = None  # a second text encoder's sequence [B, L2, D2]
    text_2_mask: Optional[torch.Tensor] = None  # [B, L2]
    extras: dict = field(default_factory=dict)  # family-specific tensors, [B, ...] each

    # The text-derived fields: what `unconditional` zeros.
    TEXT_FIELDS = ("text", "pooled_text", "text_2")

    def unconditional(self) -> "Conditioning":
        """The text zeroed; image conditions stay (they are not what guidance removes). Caption
        dropout trains the pipeline's own unconditional text instead (the encoding of the family's
        `unconditional_prompt`, stored by preprocessing; fv_accel/data/loader.py)."""
        return replace(
            self, **{name: torch.zeros_like(getattr(self, name)) for name in self.TEXT_FIELDS if getattr(self, name) is not None}
        )

    # The per-sample tensor fields ([B, ...] each), besides `extras`.
    SAMPLE_FIELDS = ("text", "text_mask", "image", "condition_latent", "pooled_text", "text_2", "text_2_mask")

    def map_samples(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> "Conditioning":
        """This conditioning with `fn` applied to each per-sample tensor (the fields and `extras`)."""
        pick = {name: fn(getattr(self, name)) for name in self.SAMPLE_FIELDS if getattr(self, name) is not None}
        return replace(self, extras={k: fn(v) for k, v in self.extras.items()}, **pick)

    def select(self, index: torch.Tensor) -> "Conditioning":
        """The conditioning of the samples at `index` (a [K] long tensor)."""
        return self.map_samples(lambda v: v[index])

    @classmethod
    def concat(cls, conds: Sequence["Conditioning"]) -> "Conditioning":
        """One conditioning of the samples of several, in order (the first's other fields)."""
        first = conds[0]
        pick = {name: torch.cat([getattr(c, name) for c in conds]) for name in cls.SAMPLE_FIELDS if getattr(first, name) is not None}
        return replace(first, extras={k: torch.cat([c.extras[k] for c in conds]) for k in first.extras}, **pick)


@dataclass
class TrainingBatch:
    """What a method prepares for one step. Latent tensors are [B, C, T, H, W] (diffusers layout)."""

    latents: Optional[torch.Tensor] = None  # clean, normalised x0
    noise: Optional[torch.Tensor] = None  # eps ~ N(0, I)
    noisy_model_input: Optional[torch.Tensor] = None  # x_t
    # Table indices, [B] or [B, T]; -1 marks a clean condition frame (not in the table).
    timestep_indices: Optional[torch.Tensor] = None
    sigmas: Optional[torch.Tensor] = None  # [B] or [B, T]
    timesteps: Optional[torch.Tensor] = None  # float timesteps the transformer sees, [B] or [B, T]
    conditioning: Optional[Conditioning] = None
    # The seed's names for the text condition (kept in step with `conditioning`).
    encoder_hidden_states: Optional[torch.Tensor] = None  # [B, L, D]
    encoder_attention_mask: Optional[torch.Tensor] = None  # [B, L]
    attn_metadata: Any = None
    attn_metadata_vsa: Any = None
    extras: dict = field(default_factory=dict)
    # The unconditional branch's conditioning where a method sets one (else the text zeroed).
    unconditional: Optional[Conditioning] = None

    def __post_init__(self) -> None:
        if self.conditioning is None and self.encoder_hidden_states is not None:
            self.conditioning = Conditioning(text=self.encoder_hidden_states, text_mask=self.encoder_attention_mask)
        elif self.conditioning is not None and self.encoder_hidden_states is None:
            self.encoder_hidden_states = self.conditioning.text
            self.encoder_attention_mask = self.conditioning.text_mask


FAMILIES: dict[str, type["ModelBase"]] = {}


def register_family(cls: type["ModelBase"]) -> type["ModelBase"]:
    """Class decorator: make a family findable by name and by its transformer classes' names."""
    if cls.family in FAMILIES:
        raise ValueError(f"model family {cls.family!r} registered twice")
    FAMILIES[cls.family] = cls
    return cls


def family_for_class_name(class_name: str) -> Optional[type["ModelBase"]]:
    for cls in FAMILIES.values():
        if class_name in cls.transformer_class_names():
            return cls
    return None


class ModelBase:
    """A role in training (student; later teacher/critic) and the contract of a model family."""

    # ---- what a family declares ----
    family: ClassVar[str] = ""
    # model_class name (recipe `models.student.model_class`) -> diffusers transformer class
    transformer_classes: ClassVar[dict[str, type]] = {}
    # The `_class_name`s of the family's pipelines in a repo's model_index.json.
    pipeline_class_names: ClassVar[tuple[str, ...]] = ()
    # The `_class_name`s of the VAEs whose latents the family's transformers take (vae/config.json):
    # a dataset encoded by another VAE is refused (fv_accel.build.check_dataset_family).
    vae_class_names: ClassVar[tuple[str, ...]] = ()
    capabilities: ClassVar[Capabilities] = Capabilities()
    lora_target_modules: ClassVar[tuple[str, ...]] = ()
    # Why the family's transformer cannot take one timestep per latent frame (diffusion forcing
    # refuses it with this line); unused where `capabilities.per_frame_timesteps` holds.
    per_frame_refusal: ClassVar[str] = "its transformer takes one timestep per sample"
    # Whether ComfyUI has a LoRA key layout for the family (`comfyui_module_name` maps to it).
    comfyui_lora: ClassVar[bool] = False
    # The prompt whose encoding the family's pipeline feeds its unconditional (classifier-free
    # guidance) branch by default: what caption dropout (`training_cfg_rate`) trains on.
    unconditional_prompt: ClassVar[str] = ""

    transformer: torch.nn.Module
    _trainable: bool = True
    # The role this model plays in training: student, teacher or critic.
    role: str = "student"
    # Whether the student trains a sound branch beside the picture (LTX-2 with train_audio): the
    # methods add its loss (fv_accel/methods/base.py `audio_loss`).
    trains_audio: bool = False
    # Whether the family's transformer has an audio branch (models.student.train_audio is refused otherwise).
    has_audio: ClassVar[bool] = False
    # The VSA controllers of the transformers (`training.vsa`; fv_accel.vsa), empty when dense.
    vsa_controllers: tuple = ()
    # Causal attention block size in latent frames, or None for bidirectional attention.
    causal_block_size: Optional[int] = None

    def __init__(self) -> None:
        self.accelerator = None
        self.latents_mean: Optional[torch.Tensor] = None
        self.latents_std: Optional[torch.Tensor] = None
        self.in_channels: int = 0  # latent channels of x_t (the data's C)

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        """The diffusers pipeline whose `save_lora_weights` writes this family's LoRA files."""
        raise NotImplementedError(f"the {cls.family} family declares no LoRA pipeline")

    @classmethod
    def comfyui_module_name(cls, module: str) -> str:
        """diffusers module name -> the name ComfyUI's LoRA files use for this family."""
        raise ValueError(f"the {cls.family} family has no ComfyUI LoRA layout (module {module!r})")

    @classmethod
    def comfyui_lora_state(
        cls, state: dict[str, torch.Tensor], metadata: Optional[dict], transformer_config: Callable[[], dict]
    ) -> Optional[dict[str, torch.Tensor]]:
        """A diffusers-keyed LoRA (`state`, adapter `metadata`) in ComfyUI's layout, or None where
        ComfyUI has none for the family. `transformer_config()` reads the base transformer's
        config, for a family whose layout needs it."""
        if not cls.comfyui_lora:
            return None
        from fv_accel.models.lora import to_comfyui

        return to_comfyui(state, metadata, cls.comfyui_module_name)

    @classmethod
    def pipeline_prompt(cls, caption: str) -> str:
        """The text the family's pipeline encodes for a prompt: its text cleaning (none by default).
        The family's encoder applies the same rule (`FamilyEncoder.pipeline_prompt`)."""
        return caption

    @classmethod
    def transformer_class_names(cls) -> list[str]:
        return [c.__name__ for c in cls.transformer_classes.values()]

    # ---- preprocessing, validation and tiny models (no transformer loaded) ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> Any:
        """What preprocessing stores for `model` and at which geometry (an `EncodingSpec`)."""
        raise NotImplementedError(f"the {cls.family} family declares no encoders")

    @classmethod
    def make_encoder(
        cls,
        model: str,
        *,
        device: Optional[torch.device] = None,
        dtype: torch.dtype = torch.float32,
        revision: Optional[str] = None,
        vae_tiling: bool = False,
        spec: Any = None,
    ) -> Any:
        """The family's `FamilyEncoder` (VAE, text encoder(s), image conditioning) of `model`."""
        raise NotImplementedError(f"the {cls.family} family declares no encoders")

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> Optional[tuple[list[float], list[float]]]:
        """Per-channel (mean, std) of the repo's latent space, `x_norm = (x_raw - mean) / std`, as the
        family's pipeline normalises latents; None where the repo does not say."""
        return None

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32) -> Any:
        raise NotImplementedError(f"the {cls.family} family declares no VAE")

    @classmethod
    def decode(cls, vae: Any, raw_latents: torch.Tensor) -> torch.Tensor:
        """Raw (un-normalised) latents [B, C, T, h, w] -> video [B, 3, F, H, W] in [-1, 1]."""
        return vae.decode(raw_latents, return_dict=False)[0]

    @classmethod
    def stream_decoder(cls, vae: Any) -> Any:
        """A decoder of consecutive pieces of one video's raw latents whose outputs, put together,
        equal `decode` of the whole (`.decode(raw [B, C, n, h, w]) -> [B, 3, F, H, W]`), or None
        where the family's VAE cannot decode in pieces."""
        return None

    # seed attribute name
    @property
    def supports_per_frame_timesteps(self) -> bool:
        return self.capabilities.per_frame_timesteps

    # ---- set-up ----
    def init_preprocessors(self, training_config: Any) -> None:
        """Read what preparing a batch needs (latent statistics). Called by the method."""

    # Multiplies the loss before backward: under context parallelism each process's gradient is
    # its tokens' share of the true one (fv_accel/models/context_parallel.py).
    gradient_scale: float = 1.0

    def attach_accelerator(self, accelerator: Any) -> None:
        self.accelerator = accelerator

    def after_prepare(self) -> None:
        """Called once the engine (`accelerator.prepare`) has wrapped `transformer`."""

    def weights_sha256(self) -> str:
        """The sha256 of the transformer's weights (`state_dict_sha256`); read before the engine shards them."""
        return state_dict_sha256(self.transformer)

    def reshard_after_each_forward(self) -> None:
        """A frozen role under FSDP2: its parameters go back to their shards after each forward."""
        self.transformer.register_forward_hook(reshard_after_forward)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    @property
    def device(self) -> torch.device:
        if self.accelerator is not None:
            return self.accelerator.device
        return next(self.transformer.parameters()).device

    def set_latent_statistics(self, mean: Optional[list], std: Optional[list], where: str) -> None:
        if mean is None:
            return
        if len(mean) != self.in_channels or len(std) != self.in_channels:
            raise ValueError(
                f"{where}: latents_mean/latents_std have {len(mean)}/{len(std)} values for a transformer "
                f"with {self.in_channels} latent channels"
            )
        self.latents_mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
        self.latents_std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.latents_mean is None:
            return latents
        return (latents - self.latents_mean.to(latents.device)) / self.latents_std.to(latents.device)

    # ---- video sparse attention ----
    def set_vsa_sparsity(self, sparsity: float) -> None:
        for controller in self.vsa_controllers:
            controller.set_sparsity(sparsity)

    def vsa_view(self, dense: bool) -> contextlib.ExitStack:
        """Forwards inside run dense (sparsity 0 on the same weights, FastVideo's dense view) when
        `dense`, else at the current sparsity."""
        stack = contextlib.ExitStack()
        for controller in self.vsa_controllers if dense else ():
            stack.enter_context(controller.dense())
        return stack

    # ---- per step ----
    def clean_latents(self, batch: dict) -> torch.Tensor:
        """The batch's latents, checked and normalised: x0 as [B, C, T, H, W] fp32 on the device."""
        latents = batch["vae_latent"].to(device=self.device, dtype=torch.float32)
        if latents.ndim != 5:
            raise ValueError(f"batch['vae_latent'] must be [B, C, T, H, W], got {tuple(latents.shape)}")
        if latents.shape[1] != self.in_channels:
            raise ValueError(
                f"latents have {latents.shape[1]} channels but the transformer expects {self.in_channels}"
            )
        return self.normalize_latents(latents)

    def build_conditioning(self, batch: dict) -> Conditioning:
        """The text condition(s) of a batch (every family); families with more extend it.

        Columns: `text_embedding` [B, L, D] with `text_attention_mask`, and where the family's
        preprocessing wrote them `pooled_text_embedding` [B, D] and `text_embedding_2` [B, L2, D2]
        with `text_attention_mask_2`."""

        def tensor(name: str, dtype: torch.dtype = torch.float32) -> Optional[torch.Tensor]:
            value = batch.get(name)
            return None if value is None else value.to(device=self.device, dtype=dtype)

        return Conditioning(
            text=tensor("text_embedding"),
            text_mask=tensor("text_attention_mask", torch.long),
            pooled_text=tensor("pooled_text_embedding"),
            text_2=tensor("text_embedding_2"),
            text_2_mask=tensor("text_attention_mask_2", torch.long),
        )

    def prepare_batch(self, batch: dict, *, generator: Any = None, latents_source: str = "data") -> TrainingBatch:
        """The seed's door: clean latents and conditioning. Noise and timesteps are the method's
        (`generator` is accepted for the seed's signature; the method draws from it)."""
        del generator
        if latents_source != "data":
            raise ValueError(f"latents_source={latents_source!r}: only 'data' is supported")
        return TrainingBatch(latents=self.clean_latents(batch), conditioning=self.build_conditioning(batch))

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The flow velocity for x_t [B, C, T, H, W] at t ([B], or per latent frame [B, T])."""
        raise NotImplementedError

    def branch_conditioning(self, training_batch: TrainingBatch, *, conditional: bool, attn_kind: str) -> Conditioning:
        """The conditioning a forward of `training_batch` runs with: the batch's own, or for the
        unconditional branch its `unconditional` where the method set one, else the text zeroed. With
        `attn_kind` "vsa" the batch's `attn_metadata_vsa` sets the sparsity the forward runs at."""
        meta = training_batch.attn_metadata_vsa
        if attn_kind == "vsa" and meta is not None:
            self.set_vsa_sparsity(meta.sparsity)
        cond = training_batch.conditioning
        if cond is None:
            raise ValueError("training_batch.conditioning is not set")
        if not conditional:
            cond = training_batch.unconditional if training_batch.unconditional is not None else cond.unconditional()
        return cond

    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
        cfg_uncond: Optional[dict] = None,
        attn_kind: str = "dense",
    ) -> torch.Tensor:
        """The seed's name for `forward`. The attention is the installed processors'; with
        `attn_kind` "vsa" the batch's `attn_metadata_vsa` gives the sparsity it runs at. The
        unconditional branch is the batch's `unconditional` conditioning where the method set one
        (distillation: the pipeline's negative prompt), else the text zeroed; `cfg_uncond` is the
        method's policy, already applied there."""
        del cfg_uncond
        cond = self.branch_conditioning(training_batch, conditional=conditional, attn_kind=attn_kind)
        if not timesteps.is_floating_point():
            timesteps = timesteps.float()  # a step list's integer values
        if timesteps.ndim == 1 and timesteps.shape[0] != noisy_latents.shape[0]:
            timesteps = timesteps.expand(noisy_latents.shape[0])  # one value for the whole batch ([1])
        return self.forward(noisy_latents, timesteps, cond)

    def predict_x0(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
        cfg_uncond: Optional[dict] = None,
        attn_kind: str = "dense",
    ) -> torch.Tensor:
        """The clean sample this role predicts: x_t - sigma * v with v from `predict_noise` (the one
        transformer call) and sigma from this role's own training table at the entry nearest to
        `timesteps` (a value that need not lie on the table)."""
        velocity = self.predict_noise(
            noisy_latents, timesteps, training_batch, conditional=conditional, cfg_uncond=cfg_uncond, attn_kind=attn_kind
        )
        return self.training_table(noisy_latents.shape).x0_from_velocity(noisy_latents, velocity, timesteps)

    def add_noise(self, clean: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        """x_t of `clean` at the training-table entry nearest to `timesteps` ([1] or [B])."""
        return self.training_table(clean.shape).add_noise_at(clean, noise, timesteps)

    def sample_latents(self, vae: Any, cond: Conditioning, negative: Optional[Conditioning], **kwargs: Any) -> Any:
        """Normalised latents of a sample through the family's own diffusers pipeline, or None when
        the family samples with fv_accel's Euler sampler over `forward` (validation then does)."""
        return None

    @classmethod
    def default_lora_targets(cls, config: Any, student_config: Any) -> tuple[str, ...]:
        """The LoRA targets of a recipe that names none, for a transformer of `config`."""
        return cls.lora_target_modules

    def clean_audio(self, batch: dict, num_latent_frames: int) -> Any:
        """The batch's clean sound for families that make sound with the picture (LTX-2's
        `AudioLatents`), else None."""
        return None

    def audio_sigmas(self, video_sigmas: torch.Tensor) -> torch.Tensor:
        """The sigma the audio is noised at beside video sigmas [B]: the same level (LTX-2); a family
        whose two schedules differ (MiniMax-H3) maps it."""
        return video_sigmas

    def sample_sound(self) -> Any:
        """The sound of the last `sample_latents` sample, (float waveform [channels, samples], sample
        rate), for families that make sound with the picture; None otherwise."""
        return None

    def training_shift(self, latent_shape: torch.Size) -> float:
        """The shift of the training table for latents of `latent_shape` [B, C, T, H, W]."""
        raise NotImplementedError

    def describe_training_shift(self) -> Any:
        """The training shift as recorded with checkpoints (a number, or a rule)."""
        raise NotImplementedError

    def training_table(self, latent_shape: torch.Size) -> Any:
        """The flow-matching table for latents of this shape, built once per shift."""
        from fv_accel.schedulers import FlowMatchTable

        shift = self.training_shift(latent_shape)
        tables = self.__dict__.setdefault("_training_tables", {})
        if shift not in tables:
            tables[shift] = FlowMatchTable(shift)
        return tables[shift]

    def timestep_bounds(self) -> Optional[tuple[float, float]]:
        """The half-open range [lo, hi) of timestep values this student may be trained on (None: all)."""
        return None

    def describe_timestep_bounds(self) -> str:
        return "the student's range"

    def backward(self, loss: torch.Tensor, ctx: Any, *, grad_accum_rounds: int = 1) -> None:
        """Backpropagate `loss / grad_accum_rounds` through the (possibly wrapped) transformer.

        Accelerate's `backward` already divides by its own `gradient_accumulation_steps` (and must
        be used: DeepSpeed and fp16 scaling live there), so only the difference is applied here.
        """
        del ctx  # the diffusers student recomputes checkpointed activations without extra context
        grad_accum_rounds = max(1, int(grad_accum_rounds))
        if self.gradient_scale != 1:
            loss = loss * self.gradient_scale
        if self.accelerator is None:
            (loss / grad_accum_rounds).backward()
            return
        accel_rounds = max(1, int(self.accelerator.gradient_accumulation_steps))
        if accel_rounds != grad_accum_rounds:
            loss = loss * (accel_rounds / grad_accum_rounds)
        self.accelerator.backward(loss)
