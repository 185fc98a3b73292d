"""Typed run recipe: dataclasses, YAML loading, dotted CLI overrides, strict validation.

Key names follow FastVideo's YAML schema (REFERENCE.md section 9) so its recipes carry over.
Every default lives in exactly one dataclass field. Unknown keys, wrong types and out-of-range
values are errors that name the key and the file they came from.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union

import yaml


class ConfigError(ValueError):
    """A recipe problem; the message names the source file and the dotted key."""


class Invalid(Exception):
    """A section's `check` found a bad value. `key` is dotted from the section (`validate` adds the
    section's path and the source file); the message is "expected <expected>, got <value>", or
    `says` as given. `quoted`: the key is written `key '<key>':` (else `<key>:`)."""

    def __init__(self, key: str, value: Any = None, expected: str = "", *, says: str = "", quoted: bool = True):
        super().__init__(key)
        self.key, self.value, self.expected, self.says, self.quoted = key, value, expected, says, quoted


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


@dataclass
class LoraConfig:
    enable: bool = False
    rank: int = 16
    alpha: float = 16.0
    dropout: float = 0.0
    # None: the student family's own list (`lora_target_modules`; Wan: to_q, to_k, to_v, to_out.0).
    target_modules: Optional[list[str]] = None
    init: Literal["default", "gaussian", "pissa"] = "default"

    def check(self) -> None:
        if self.rank < 1:
            raise Invalid("rank", self.rank, "an integer >= 1")
        if self.alpha <= 0:
            raise Invalid("alpha", self.alpha, "a number > 0")
        if not 0.0 <= self.dropout < 1.0:
            raise Invalid("dropout", self.dropout, "a number in [0, 1)")


@dataclass
class StudentConfig:
    # Hub id or local folder (diffusers layout); None builds from `transformer_config` (tiny default).
    init_from: Optional[str] = None
    # Architecture: a kind of a registered model family ("wan", "skyreels_v2", "ltx_video", ...;
    # fv_accel.models.FAMILIES). "auto" reads `_class_name` from the transformer's config.json
    # (and builds a Wan transformer from an inline `transformer_config`).
    model_class: str = "auto"
    transformer_config: Optional[dict] = None
    revision: Optional[str] = None
    subfolder: str = "transformer"
    variant: Optional[str] = None
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    # Training shift of the flow-matching table (FastVideo's model-level `flow_shift`). None: the
    # family's own (Wan: 3.0, REFERENCE.md; other families: their repo's scheduler config, with
    # resolution-dependent shifting where it has it).
    flow_shift: Optional[float] = None
    # The embedded guidance a guidance-distilled transformer is fed in training (HunyuanVideo's
    # `guidance`); None: the family's pipeline default. Families without the input refuse a value.
    guidance: Optional[float] = None
    # Per-channel VAE latent statistics; None reads them from `<init_from>/vae/config.json`,
    # and with neither the latents are used as stored (already normalised).
    latents_mean: Optional[list[float]] = None
    latents_std: Optional[list[float]] = None
    lora: LoraConfig = field(default_factory=LoraConfig)
    # Block-causal self-attention (block size = method.chunk_size).
    causal: bool = False
    causal_attention_backend: Literal["auto", "flex", "chunked"] = "auto"
    local_attn_size: int = -1
    sink_size: int = 0
    # Wan 2.2 A14B (two experts split at the repo's boundary_ratio): the one this run trains.
    expert: Optional[Literal["high_noise", "low_noise", "both"]] = None
    # What the student is trained for: t2v, i2v (first-frame condition), auto (i2v for
    # image-to-video models, t2v otherwise; Wan2.2-TI2V-5B does both, t2v unless set).
    task: Literal["auto", "t2v", "i2v"] = "auto"
    # Storage dtype of a LoRA run's frozen base (diffusers' layerwise casting): its linear and conv
    # weights are kept in this dtype and cast to the compute dtype layer by layer in the forward.
    # Norms, embeddings, the patch embedding and the LoRA adapter stay as they are. null: off.
    storage_dtype: Optional[Literal["float8_e4m3fn", "float8_e5m2", "bfloat16"]] = None
    # Whether the role trains (FastVideo's key): null is the role's own default (the student and a
    # distillation critic train; a teacher is frozen).
    trainable: Optional[bool] = None
    # Audio-and-video families (LTX-2; FastVideo's name): false trains the video branch only (the
    # audio branch and the cross-modal layers frozen), true trains picture and sound together.
    train_audio: bool = False
    # ---- AnyFlow (FastVideo's arch-config key names; read by AnyFlowStudent, fv_accel/models/anyflow.py) ----
    # Make the AnyFlow flow-map student from the Wan 2.1 transformer of init_from / transformer_config:
    # its weights carried over by name, the delta (r) embedder a copy of the time embedder.
    anyflow_from_wan: bool = False
    # How the r embedding joins the t embedding: "gated", (1 - g) * emb(t) + g * emb(r or t - r), the
    # only form diffusers' AnyFlow transformers compute ("additive", FastVideo's other, is refused).
    # null: the loaded AnyFlow checkpoint's own values; from Wan, gated / 0.25 / r (the released checkpoints').
    r_embedder_fusion: Optional[Literal["gated", "additive"]] = None
    r_embedder_gate_value: Optional[float] = None
    r_embedder_deltatime_type: Optional[Literal["r", "t-r"]] = None

    def check(self) -> None:
        if self.storage_dtype is not None and not self.lora.enable:
            raise Invalid("storage_dtype", says=(
                f"{self.storage_dtype!r} stores a frozen base in low "
                "precision, so it needs models.student.lora.enable: true (a fully trained model keeps its weights "
                "in torch_dtype); remove the key or enable LoRA"
            ))
        if self.flow_shift is not None and self.flow_shift <= 0:
            raise Invalid("flow_shift", self.flow_shift, "a number > 0")
        if self.trust_remote_code:
            raise Invalid(
                "trust_remote_code",
                self.trust_remote_code,
                "false: fv_accel never runs a model repository's own code (it loads diffusers' classes from "
                "safetensors weights)",
            )
        if self.init_from is None and self.transformer_config is None:
            raise Invalid("init_from", None, "a Hub id or folder, or models.student.transformer_config")
        if self.local_attn_size != -1 and self.local_attn_size < 1:
            raise Invalid("local_attn_size", self.local_attn_size, "-1 (no window) or a frame count >= 1")
        if self.sink_size < 0:
            raise Invalid("sink_size", self.sink_size, "an integer >= 0")
        if (self.latents_mean is None) != (self.latents_std is None):
            raise Invalid("latents_std", self.latents_std, "set together with latents_mean")
        if self.latents_std is not None and any(s <= 0 for s in self.latents_std):
            raise Invalid("latents_std", self.latents_std, "positive numbers")


@dataclass
class ModelsConfig:
    student: StudentConfig = field(default_factory=StudentConfig)
    # Distillation (method.name dmd2): the frozen teacher and the trained critic (fake score), each
    # a model like the student (same keys). A student or critic that names neither `init_from` nor
    # `transformer_config` starts from the teacher's weights.
    teacher: Optional[StudentConfig] = None
    critic: Optional[StudentConfig] = None
    # Reward training (method.name diffusion_nft): the sampling policy `old` (moved toward the student
    # after each outer step) and the frozen `reference` of the KL term. A role that names no model of
    # its own (neither `init_from` nor `transformer_config`) is the student's model; with a LoRA
    # student both are adapters over the student's one frozen base (no section of their own).
    old: Optional[StudentConfig] = None
    reference: Optional[StudentConfig] = None
    # Causal consistency distillation (method.name causal_cd): the frozen EMA of the student, the
    # target's model (FastVideo's role `ema`); with no model of its own, the teacher's.
    ema: Optional[StudentConfig] = None


# The methods that distil a teacher into the student with a trained critic (roles student, teacher, critic).
DISTILLATION_METHODS = ("dmd2", "self_forcing", "anyflow")
# The roles beside the student each teacher-led method takes: the teacher first (required), then
# roles that start from the teacher's model when they name none of their own.
TEACHER_ROLES = {
    **{name: ("teacher", "critic") for name in DISTILLATION_METHODS},
    "kd": ("teacher",),
    "kd_causal": ("teacher",),
    "causal_cd": ("teacher", "ema"),
}
# The reward-training methods (roles student, old, reference).
REWARD_METHODS = ("diffusion_nft",)
# What a role inherits from the teacher when it names no model of its own.
INHERITED_MODEL_KEYS = ("init_from", "model_class", "transformer_config", "revision", "subfolder", "variant",
                        "torch_dtype", "latents_mean", "latents_std")


@dataclass
class MethodConfig:
    name: Literal["finetune", "dfsft", "tfsft", "dmd2", "self_forcing", "diffusion_nft", "kd", "kd_causal", "causal_cd",
                  "anyflow_pretrain", "anyflow"] = "finetune"
    chunk_size: Any = None  # parsed by DiffusionForcingSFTMethod (REFERENCE.md section 4)
    min_timestep_ratio: Any = 0.0
    max_timestep_ratio: Any = 1.0
    # DFSFT bell weights over the table index (default) or over the timestep value (Causal-Forcing).
    weighting: Literal["index", "timestep"] = "index"
    # Teacher forcing: timestep of the clean context tokens (0 = clean).
    context_timestep: float = 0.0
    # ---- DMD2 (FastVideo's key names; read by DMD2Method) ----
    # simulate: the student rolls out from pure noise (prompts suffice); data_latent: from noised data latents.
    rollout_mode: Optional[Literal["simulate", "data_latent"]] = None
    # The student's few timesteps, e.g. [1000, 750, 500, 250]; with warp_denoising_step each is
    # read through the student's training table (t = table[1000 - step]).
    dmd_denoising_steps: Optional[list[int]] = None
    warp_denoising_step: bool = False
    # The student is updated at steps that are multiples of this (1-based); the critic every step.
    generator_update_interval: int = 1
    # Classifier-free guidance of the teacher's score: uncond + s * (cond - uncond).
    real_score_guidance_scale: float = 1.0
    # The critic's optimizer: all three required for dmd2 (no silent fallback to the student's).
    fake_score_learning_rate: Optional[float] = None
    fake_score_betas: Optional[list[float]] = None
    fake_score_lr_scheduler: Optional[str] = None
    # The unconditional branch per condition channel (FastVideo's cfg_uncond): {text: negative_prompt |
    # zero | keep, on_missing: error | ignore}; null: the pipeline's negative prompt (the dataset's
    # stored unconditional text), else zeros.
    cfg_uncond: Optional[dict] = None
    # ---- Self-Forcing (FastVideo's key names; read by SelfForcingMethod, with the DMD2 keys above;
    # chunk_size is the causal student's block size) ----
    # Between a chunk's steps its x0 goes to the next step re-noised with fresh noise (sde) or along
    # its current noise (ode).
    student_sample_type: str = "sde"
    # The timestep (0..N) a finished chunk is re-noised to before it is written into the KV cache; 0: clean.
    context_noise: float = 0.0
    # One exit step for all chunks (else one per chunk); always the last step.
    same_step_across_blocks: bool = False
    last_step_only: bool = False
    # Gradient through the exit step of each chunk starting at or after start_gradient_frame.
    enable_gradient_in_rollout: bool = True
    start_gradient_frame: int = 0
    # ---- DiffusionNFT (FastVideo's key names and defaults; read by DiffusionNFTMethod) ----
    # The rewards: {name: weight} (FastVideo's form) or [{name, weight, options...}]; a name
    # `module:function` is the user's own (fv_accel/rewards/).
    reward_fn: Any = None
    sampling: "NFTSamplingConfig" = field(default_factory=lambda: NFTSamplingConfig())
    # Prompts per sampling batch on each process (FastVideo: the loader's batch size when unset).
    sample_train_batch_size: Optional[int] = None
    # Samples per training micro-batch (FastVideo: sample_train_batch_size when unset).
    train_batch_size: Optional[int] = None
    num_batches_per_epoch: int = 48
    num_inner_epochs: int = 1
    # Videos per prompt: the group whose rewards are compared (spread over the processes).
    num_video_per_prompt: int = 24
    adv_clip_max: float = 5.0
    adv_mode: Literal["all", "positive_only", "negative_only", "one_only", "binary"] = "all"
    # The share of the sampling schedule's timesteps trained on (int(len * fraction), at least 1).
    timestep_fraction: float = 0.99
    kl_beta: float = 0.0001
    beta: float = 0.1
    # How the old policy follows the student after each outer step (DiffusionNFT's return_decay).
    decay_type: Literal[0, 1, 2] = 1
    ema: "NFTEmaConfig" = field(default_factory=lambda: NFTEmaConfig())
    validation: "NFTValidationConfig" = field(default_factory=lambda: NFTValidationConfig())
    # ---- Causal consistency distillation (FastVideo's key names; read by CausalConsistencyDistillationMethod) ----
    # The teacher's classifier-free guidance in its one Euler step: uncond + s * (cond - uncond).
    guidance_scale: float = 3.0
    # Steps of the consistency schedule (FastVideo's SelfForcingFlowMatchScheduler at the student's
    # flow_shift, else 5); each step trains one pair of neighbouring steps of it.
    discrete_cd_N: int = 48
    # The EMA target: ema <- ema_decay * ema + (1 - ema_decay) * student after each optimizer step
    # numbered >= ema_start_step (1-based); before that the EMA stays the run's starting weights.
    ema_decay: float = 0.99
    ema_start_step: int = 200
    # ---- AnyFlow (FastVideo's key names; read by AnyFlowPretrainMethod and AnyFlowMethod) ----
    # Pretraining: the batch's first diffusion_ratio share trains r = t, the next consistency_ratio
    # share r = 0, the rest free (t, r) pairs; a 0 is honoured (FastVideo reads 0 as its default).
    diffusion_ratio: float = 0.5
    consistency_ratio: float = 0.25
    # The central difference's step in absolute timesteps (an integer, as FastVideo parses it).
    epsilon: int = 5
    # The per-sample loss weight over t / N, rescaled to sum to N over the batch.
    weight_type: Literal["uniform", "gaussian", "beta08"] = "beta08"
    # Classifier-free guidance fused into the trained prediction (1.0: none; the sample then needs none).
    fuse_guidance_scale: float = 1.0
    # On-policy: the rollout's steps at most, its timesteps (absolute, descending, ending at 0;
    # null: dmd_denoising_steps and a final 0), and r = the next timestep (mean velocity) or r = t.
    # null: 4 for AnyFlow, len(t_list) - 1 for KD.
    student_sample_steps: Optional[int] = None
    t_list_override: Optional[list[float]] = None
    use_mean_velocity: bool = True
    # The r at which teacher and critic score the student's sample: their x0 is the jump to r = 0,
    # so only 0 (or null) is accepted (FastVideo parses the key and never reads it).
    dmd_score_r_value: Optional[float] = None
    # ---- KD (FastVideo's key names; read by KDMethod and KDCausalMethod, with student_sample_steps above:
    # len(t_list) - 1) ----
    # The student's timesteps (integers, descending); every entry but the last must be one of the
    # teacher's cached ODE timesteps (48 steps at shift 5: [995, 937, 833, 625, 0]).
    t_list: Optional[list[int]] = None
    # The folder of the teacher's trajectories (fv_accel/methods/knowledge_distillation/cache.py),
    # written on first use or by `python -m fv_accel.kd_cache RECIPE`.
    teacher_path_cache: Optional[str] = None
    # The teacher's ODE: its Euler steps and its classifier-free guidance, uncond + s * (cond - uncond).
    teacher_inference_steps: int = 48
    teacher_guidance_scale: float = 1.0
    # Which teacher states a sample file keeps: all, or only the t_list ones (what training reads).
    kd_cache_keep: Literal["all", "t_list"] = "all"
    # kd_causal: latent frames per block sharing a step index (null: the student's block size, method.chunk_size).
    num_frames_per_block: Optional[int] = None

    def check(self) -> None:
        check_descending("dmd_denoising_steps", self.dmd_denoising_steps, "e.g. [1000, 750, 500, 250]")
        check_descending("t_list", self.t_list, "e.g. [1000, 937, 833, 624, 0]")


def check_descending(key: str, values: Any, example: str) -> None:
    """A step list (timesteps or sigmas) runs from the noisiest entry down: a list of numbers that
    is not strictly descending is refused (other values are left to the method's own parsing)."""
    if not isinstance(values, list) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return
    if any(later >= earlier for earlier, later in zip(values, values[1:])):
        raise Invalid(key, values, f"strictly descending values, the noisiest first ({example})")


@dataclass
class NFTSamplingConfig:
    """method.sampling: how the old policy samples (FastVideo's rl/common SamplingConfig)."""

    num_steps: int = 25
    # model_default: the student's training table's scheduler; flow_match_euler: a fresh one at `flow_shift`.
    scheduler: Literal["model_default", "flow_match_euler"] = "model_default"
    trajectory: Literal["ode", "sde_reflow"] = "ode"
    flow_shift: Optional[float] = None
    timesteps: Optional[list[float]] = None
    sigmas: Optional[list[float]] = None

    def check(self) -> None:
        if self.num_steps < 1:
            raise Invalid("num_steps", self.num_steps, "an integer >= 1")
        for key in ("timesteps", "sigmas"):
            value = getattr(self, key)
            if value is not None and not value:
                raise Invalid(key, value, "a non-empty list of numbers, or null")
        check_descending("timesteps", self.timesteps, "e.g. [1000, 750, 500, 250]")
        check_descending("sigmas", self.sigmas, "e.g. [1.0, 0.75, 0.5, 0.25]")
        if self.timesteps is not None and self.sigmas is not None and len(self.timesteps) != len(self.sigmas):
            raise Invalid("sigmas", self.sigmas, f"as many values as timesteps ({len(self.timesteps)})")
        if self.flow_shift is not None and not (self.flow_shift > 0 and math.isfinite(self.flow_shift)):
            raise Invalid("flow_shift", self.flow_shift, "a positive number, or null (the model's)")

    def schedule_length(self) -> int:
        if self.timesteps is not None:
            return len(self.timesteps)
        if self.sigmas is not None:
            return len(self.sigmas)
        return self.num_steps


@dataclass
class NFTEmaConfig:
    """method.ema: an EMA of the student, updated after each optimizer step, used for validation."""

    enabled: bool = True
    decay: float = 0.9
    update_after_step: int = 0
    validation: bool = True

    def check(self) -> None:
        if not 0.0 <= self.decay <= 1.0:
            raise Invalid("decay", self.decay, "a number in [0, 1]")
        if self.update_after_step < 0:
            raise Invalid("update_after_step", self.update_after_step, "an integer >= 0")


@dataclass
class NFTValidationConfig:
    """method.validation: the reward on held-out prompts, never trained on."""

    every_steps: int = 0  # optimizer steps; 0: off (the last step is validated too when on)
    num_steps: int = 40
    # The held-out prompts: rows of the training data whose caption is one of them are never
    # trained on. Else the first `num_prompts` rows of `data_path` (a dataset of its own).
    prompts: list[str] = field(default_factory=list)
    data_path: Optional[str] = None
    num_prompts: int = 16
    # Samples per prompt, each from its own seed (seed, prompt, sample): the seed-to-seed spread is logged.
    videos_per_prompt: int = 1
    batch_size: int = 16
    seed: int = 42
    # Sample videos of the first sample of each prompt, under <output_dir>/samples/.
    log_samples: bool = True

    def check(self) -> None:
        for key in ("num_steps", "num_prompts", "batch_size", "videos_per_prompt"):
            if getattr(self, key) < 1:
                raise Invalid(key, getattr(self, key), "an integer >= 1")
        if self.every_steps < 0:
            raise Invalid("every_steps", self.every_steps, "an integer >= 0 (0: off)")


@dataclass
class DataConfig:
    # Parquet folder/file of precomputed latents, or "tiny" for the built-in generated dataset.
    data_path: str = "tiny"
    train_batch_size: int = 1
    dataloader_num_workers: int = 0
    training_cfg_rate: float = 0.0
    seed: int = 0
    num_latent_t: Optional[int] = None
    num_height: Optional[int] = None
    num_width: Optional[int] = None
    num_frames: Optional[int] = None
    # Text embeddings are zero-padded (or cut) to this many tokens in training, in the sample videos
    # and in the held-out loss. A pipeline that loads the result takes the same number as its
    # `max_sequence_length` (512 is the default of Wan's and SkyReels-V2's pipelines).
    text_max_length: int = 512
    # Decoded rows kept in memory, per process, up to this many GiB of tensors (0: none), so that later
    # epochs do not read and decode them again (fv_accel/data/loader.py ItemCache). Rows past the
    # budget are read from their files each time.
    cache_gb: float = 1.0
    # Extra datasets mixed in with weights: [{data_path: ..., weight: ...}].
    mix: list[dict] = field(default_factory=list)
    # Tiny built-in dataset (data_path: tiny).
    tiny_num_clips: int = 8
    tiny_num_frames: int = 9
    tiny_height: int = 32
    tiny_width: int = 32
    tiny_cache_dir: Optional[str] = None
    # Which tiny world (fv_accel/tiny/clips.py): "default", each clip its own caption; "multimodal",
    # tiny_num_captions captions shared round-robin by the tiny_num_clips clips, each caption's clips
    # the same shape moving its way from other start positions at other speeds.
    tiny_world: Literal["default", "multimodal"] = "default"
    tiny_num_captions: int = 4

    def check(self) -> None:
        if self.train_batch_size < 1:
            raise Invalid("train_batch_size", self.train_batch_size, "an integer >= 1")
        if self.text_max_length < 1:
            raise Invalid("text_max_length", self.text_max_length, "an integer >= 1")
        if not (
            isinstance(self.cache_gb, (int, float)) and not isinstance(self.cache_gb, bool) and 0 <= self.cache_gb < float("inf")
        ):
            raise Invalid("cache_gb", self.cache_gb, "a finite number of GiB >= 0 (0: no data cache)")
        if self.dataloader_num_workers < 0:
            raise Invalid("dataloader_num_workers", self.dataloader_num_workers, "an integer >= 0")
        if not 0.0 <= self.training_cfg_rate <= 1.0:
            raise Invalid("training_cfg_rate", self.training_cfg_rate, "a number in [0, 1]")
        if self.num_frames is not None and (self.num_frames - 1) % 4 != 0:
            raise Invalid("num_frames", self.num_frames, "a frame count of the form 4k+1")
        if self.tiny_num_frames < 1 or (self.tiny_num_frames - 1) % 4 != 0:
            raise Invalid("tiny_num_frames", self.tiny_num_frames, "a frame count of the form 4k+1")
        if not 1 <= self.tiny_num_captions <= 8:
            raise Invalid("tiny_num_captions", self.tiny_num_captions, "an integer in [1, 8] (one colour each)")
        for i, entry in enumerate(self.mix):
            entry["weight"] = _mix_weight(entry, f"mix[{i}]")
        for key in ("num_latent_t", "num_frames"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise Invalid(key, getattr(self, key), "an integer >= 1 (or null)")
        for key in ("num_height", "num_width"):
            side = getattr(self, key)
            if side is not None and (side <= 0 or side % 8):
                raise Invalid(key, side, "a positive multiple of 8 pixels (or null)")


def _mix_weight(entry: Any, key: str) -> float:
    """A `training.data.mix` entry's weight (1.0 when absent), after checking the entry."""
    if set(entry) - {"data_path", "weight"} or "data_path" not in entry:
        raise Invalid(key, entry, "a mapping with data_path and optional weight")
    if not isinstance(entry["data_path"], str) or not entry["data_path"]:
        raise Invalid(f"{key}.data_path", entry["data_path"], "a Parquet folder or file")
    weight = entry.get("weight", 1.0)
    if isinstance(weight, str):  # YAML reads "1e-1" (no dot) as a string
        try:
            weight = float(weight)
        except ValueError:
            pass
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or weight == float("inf"):
        raise Invalid(f"{key}.weight", entry.get("weight"), "a number > 0")
    return float(weight)


# Optimizers that live in an optional library: name -> (module, pinned install).
OPTIMIZER_LIBRARIES = {"adamw_8bit": ("bitsandbytes", "bitsandbytes==0.50.2"), "prodigy": ("prodigyopt", "prodigyopt==1.1.2")}


@dataclass
class OptimizerConfig:
    # adamw: torch AdamW; adamw_8bit: bitsandbytes AdamW8bit; prodigy: prodigyopt Prodigy (its
    # learning_rate scales the step it adapts, usually 1.0); adafactor: transformers' Adafactor
    # with the recipe's learning rate (fv_accel/optim.py).
    name: Literal["adamw", "adamw_8bit", "prodigy", "adafactor"] = "adamw"
    # AdamW's kernel: auto takes fused where the parameters' device has it (CPU and CUDA do).
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = "auto"
    # Prodigy only (its own defaults).
    prodigy_d_coef: float = 1.0
    prodigy_safeguard_warmup: bool = False
    prodigy_use_bias_correction: bool = False
    learning_rate: float = 1e-6
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    lr_scheduler: Literal[
        "constant",
        "constant_with_warmup",
        "linear",
        "cosine",
        "cosine_with_restarts",
        "polynomial",
        "piecewise_constant",
    ] = "constant"
    lr_warmup_steps: int = 0
    lr_num_cycles: int = 1
    lr_power: float = 1.0
    min_lr_ratio: float = 0.0
    step_rules: Optional[str] = None  # piecewise_constant rules, diffusers' syntax

    def check(self) -> None:
        if not self.learning_rate > 0:
            raise Invalid("learning_rate", self.learning_rate, "a number > 0")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise Invalid("betas", self.betas, "two numbers in [0, 1)")
        if self.eps <= 0:
            raise Invalid("eps", self.eps, "a number > 0")
        if self.weight_decay < 0:
            raise Invalid("weight_decay", self.weight_decay, "a number >= 0")
        if self.implementation != "auto" and self.name != "adamw":
            raise Invalid("implementation", self.implementation, f"auto with name {self.name!r} (it chooses AdamW's kernel)")
        defaults = OptimizerConfig()
        for key in ("prodigy_d_coef", "prodigy_safeguard_warmup", "prodigy_use_bias_correction"):
            if self.name != "prodigy" and getattr(self, key) != getattr(defaults, key):
                raise Invalid(key, getattr(self, key), f"its default with name {self.name!r} (it applies to prodigy only)")
        if not self.prodigy_d_coef > 0:
            raise Invalid("prodigy_d_coef", self.prodigy_d_coef, "a number > 0")
        if self.name in OPTIMIZER_LIBRARIES:
            module, install = OPTIMIZER_LIBRARIES[self.name]
            if importlib.util.find_spec(module) is None:
                raise Invalid("name", says=f"{self.name} needs {module} (pip install {install})", quoted=False)
        if self.lr_warmup_steps < 0:
            raise Invalid("lr_warmup_steps", self.lr_warmup_steps, "an integer >= 0")


@dataclass
class LoopConfig:
    max_train_steps: int = 100
    gradient_accumulation_steps: int = 1
    # "auto": bf16 on an accelerator, fp32 on CPU.
    mixed_precision: Literal["auto", "no", "bf16", "fp16"] = "auto"
    # "rank": one generator per rank seeded seed+rank (FastVideo's);
    # "sample": noise/timesteps keyed by (seed, epoch, sample index), independent of process count.
    noise_rng: Literal["rank", "sample"] = "rank"
    # Non-finite loss / grad norm: skip the step (counted) or stop with a checkpoint. "auto": skip,
    # except under DeepSpeed, whose engine steps inside backward: stop (fv_accel.trainer.resolve_nan_policy).
    nan_policy: Literal["auto", "skip", "stop"] = "auto"
    max_consecutive_skips: int = 5

    def check(self) -> None:
        if self.max_train_steps < 1:
            raise Invalid("max_train_steps", self.max_train_steps, "an integer >= 1")
        if self.gradient_accumulation_steps < 1:
            raise Invalid("gradient_accumulation_steps", self.gradient_accumulation_steps, "an integer >= 1")
        if self.max_consecutive_skips < 0:
            raise Invalid("max_consecutive_skips", self.max_consecutive_skips, "an integer >= 0")


@dataclass
class CheckpointConfig:
    output_dir: str = "outputs/run"
    resume_from_checkpoint: str = ""
    training_state_checkpointing_steps: int = 0
    checkpoints_total_limit: int = 0
    # Write the trained weights (transformer folder / LoRA files) at the end of the run.
    save_final: bool = True
    # Resuming with a recipe that changes the math (method, chunk size, shift) is refused unless set.
    allow_recipe_change: bool = False
    # A fresh run into a folder holding another run's outputs is refused unless set; then those
    # outputs (checkpoints, weights, logs, samples, plots) are deleted first.
    overwrite_output_dir: bool = False

    def check(self) -> None:
        if self.training_state_checkpointing_steps < 0:
            raise Invalid(
                "training_state_checkpointing_steps", self.training_state_checkpointing_steps, "an integer >= 0 (0 = off)"
            )
        if self.checkpoints_total_limit < 0:
            raise Invalid("checkpoints_total_limit", self.checkpoints_total_limit, "an integer >= 0")
        if not self.output_dir:
            raise Invalid("output_dir", self.output_dir, "a folder path")


@dataclass
class TrackerConfig:
    trackers: list[str] = field(default_factory=lambda: ["tensorboard"])
    project_name: str = "fv_accel"
    run_name: str = "run"
    log_every: int = 1
    # Draw loss / held-out / throughput PNGs into <output_dir>/plots at the end (fv_accel/plot.py).
    write_plots: bool = True
    # Peak accelerator TFLOP/s for the MFU estimate; None looks the device up (fv_accel/telemetry.py).
    peak_tflops: Optional[float] = None

    def check(self) -> None:
        if self.log_every < 1:
            raise Invalid("log_every", self.log_every, "an integer >= 1")
        for name in self.trackers:
            if name not in ("tensorboard", "wandb", "none"):
                raise Invalid("trackers", name, "'tensorboard', 'wandb' or 'none'")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise Invalid("peak_tflops", self.peak_tflops, "a number > 0")


@dataclass
class HubConfig:
    # Upload the output folder (weights, model card, samples, logs, plots; not the checkpoints) to
    # the Hugging Face Hub at the end of the run (fv_accel/hub.py); repo_id is then required.
    push_to_hub: bool = False
    repo_id: Optional[str] = None
    private: bool = False
    # A branch of the repo (created if absent); None: main.
    revision: Optional[str] = None

    def check(self) -> None:
        if self.push_to_hub and not self.repo_id:
            raise Invalid("repo_id", self.repo_id, "a Hub repo id (user/name) when training.hub.push_to_hub is true")
        if self.repo_id is not None and re.fullmatch(r"[\w.-]+/[\w.-]+|[\w.-]+", self.repo_id) is None:
            raise Invalid("repo_id", self.repo_id, "a Hub repo id (user/name)")


@dataclass
class ContextParallel:
    """Context parallelism through diffusers (`ModelMixin.enable_parallelism`): each sequence is
    split across `ulysses * ring` processes, which see the same batch; the world size is data
    parallel x ulysses x ring (fv_accel/models/context_parallel.py). 1 x 1: off."""

    ulysses: int = 1
    ring: int = 1

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring

    def check(self) -> None:
        for name in ("ulysses", "ring"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise Invalid(name, value, "an integer >= 1")
        if self.ring > 1:
            # diffusers' ring attention merges partial results by their log-sum-exp, which its native
            # SDPA backend (the one that runs on CPU and the one fv_accel's processors use) cannot return.
            raise Invalid("ring", says=(
                f"{self.ring}: ring attention is not supported "
                "(diffusers' native attention backend returns no log-sum-exp); use ulysses"
            ))


@dataclass
class TrainingModelConfig:
    weighting_scheme: Literal["uniform", "logit_normal", "mode"] = "uniform"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.0
    precondition_outputs: bool = False
    enable_gradient_checkpointing_type: Optional[Literal["full"]] = None
    context_parallel: ContextParallel = field(default_factory=ContextParallel)
    # torch.compile of the transformer: none, or blocks (diffusers' regional compilation: each
    # block class the transformer lists in `_repeated_blocks` is compiled once and reused).
    compile: Literal["none", "blocks"] = "none"

    def check(self) -> None:
        if self.logit_std < 0:
            raise Invalid("logit_std", self.logit_std, "a number >= 0")


@dataclass
class VSAConfig:
    """Video sparse attention in training (fv_accel/vsa.py, docs/sparse-attention.md); FastVideo's
    key names. `sparsity` 0 is off (dense attention). With `decay_rate` > 0 the sparsity of step s
    (1-based) is min(sparsity, decay_rate * floor(s / decay_interval_steps)) (`fv_accel.vsa.ramp_sparsity`)."""

    sparsity: float = 0.0
    decay_rate: float = 0.0
    decay_interval_steps: int = 0
    backend: Literal["auto", "kernel", "flex", "gathered", "reference"] = "auto"

    @property
    def enabled(self) -> bool:
        return self.sparsity > 0

    def check(self) -> None:
        for key in ("sparsity", "decay_rate"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise Invalid(key, value, "a number in [0, 1)")
        if self.decay_interval_steps < 0:
            raise Invalid("decay_interval_steps", self.decay_interval_steps, "an integer >= 0")
        if self.decay_rate > 0 and self.decay_interval_steps < 1:
            raise Invalid(
                "decay_interval_steps", self.decay_interval_steps, f"an integer >= 1 with decay_rate {self.decay_rate}"
            )
        if self.decay_rate > 0 and not self.enabled:
            raise Invalid("decay_rate", self.decay_rate, "0 with sparsity 0 (VSA off), or set training.vsa.sparsity")


@dataclass
class AudioConfig:
    # Joint audio-and-video training (models.student.train_audio): loss = video + loss_weight * audio.
    loss_weight: float = 1.0

    def check(self) -> None:
        if not self.loss_weight >= 0:
            raise Invalid("loss_weight", self.loss_weight, "a number >= 0")


@dataclass
class TrainingConfig:
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    tracker: TrackerConfig = field(default_factory=TrackerConfig)
    model: TrainingModelConfig = field(default_factory=TrainingModelConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    vsa: VSAConfig = field(default_factory=VSAConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)


@dataclass
class GradClipConfig:
    max_grad_norm: float = 1.0

    def check(self) -> None:
        if self.max_grad_norm < 0:
            raise Invalid("max_grad_norm", self.max_grad_norm, "a number >= 0")


@dataclass
class EmaConfig:
    enable: bool = False
    decay: float = 0.9999
    device: Literal["same", "cpu"] = "same"
    # Optimizer steps before the average starts to move (it holds the weights of the start until then).
    update_after_step: int = 0

    def check(self) -> None:
        if not 0.0 < self.decay < 1.0:
            raise Invalid("decay", self.decay, "a number in (0, 1)")
        if self.update_after_step < 0:
            raise Invalid("update_after_step", self.update_after_step, "an integer >= 0")


@dataclass
class ValidationConfig:
    enable: bool = False
    every_steps: int = 100
    at_start: bool = False
    # Prompt file (JSON/JSONL/TXT), used with `prompts` (strings or objects with per-prompt
    # height, width, frames, steps, guidance, seed, negative_prompt, name; fv_accel/validation.py).
    prompt_file: Optional[str] = None
    prompts: list[Union[str, dict]] = field(default_factory=list)
    negative_prompt: str = ""
    sampling_steps: int = 50
    guidance_scale: float = 5.0
    # The scheduler sample videos step with: "repo", the class and config of the model repo's
    # scheduler/scheduler_config.json (the repo the VAE comes from; Wan: UniPCMultistepScheduler),
    # or "euler", FlowMatchEulerDiscreteScheduler at the same shift. The diffusion-forcing sampler
    # (DFSFT students) steps each chunk with Euler either way (docs/validation-sampling.md).
    scheduler: Literal["repo", "euler"] = "repo"
    # Sampling shift (FastVideo's pipeline.flow_shift), distinct from the training shift
    # (models.student.flow_shift). None: the repo scheduler's own; a number overrides it.
    sampling_flow_shift: Optional[float] = None
    # None: the size of the first training clip.
    height: Optional[int] = None
    width: Optional[int] = None
    num_frames: Optional[int] = None
    seed: int = 1234
    fps: int = 8
    # Model folder / Hub id whose VAE and text encoder sample; None: the student's init_from, else
    # the model that encoded the dataset (its fv_dataset.json).
    model_from: Optional[str] = None
    # DFSFT sampler: chunk k starts `ar_step` denoising steps after chunk k-1 (0: all together;
    # None: when chunk k-1 is clean, chunk by chunk); clean context re-noised to `context_noise`.
    ar_step: Optional[int] = None
    context_noise: float = 0.0
    use_ema: bool = True
    # Distance of each sample to the training data: its pixel MSE to the nearest of the first
    # `distance_clips` training clips of its size, decoded by the same VAE (samples/distance), and
    # its latents' MSE to theirs (samples/latent_distance); 0: not measured (those clips are
    # decoded once, at the first validation).
    distance_clips: int = 0
    # Held-out loss by noise level. A fraction of the training rows is never trained on (even with
    # validation off, so enabling validation never changes training).
    heldout_fraction: float = 0.0
    # A Parquet dataset, or "tiny": heldout_max_samples new tiny clips (data seed + 1).
    heldout_data_path: Optional[str] = None
    heldout_sigma_buckets: list[float] = field(default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9])
    heldout_max_samples: int = 8
    # DFSFT only: per-chunk noise patterns (ramp_up, ramp_down, clean_context, or per-chunk sigmas).
    heldout_chunk_patterns: list[Union[str, list[float]]] = field(default_factory=lambda: ["ramp_up", "ramp_down"])
    # Distillation: the student's samples' temporal variation and colour spread are compared with the
    # teacher's on the same prompts and seeds (sampled once, at the start); below `collapse_ratio`
    # times the teacher's, a warning names the step, and with `stop_on_collapse` the run stops with
    # a checkpoint.
    collapse_ratio: float = 0.5
    stop_on_collapse: bool = False

    def check(self) -> None:
        if self.every_steps < 1:
            raise Invalid("every_steps", self.every_steps, "an integer >= 1")
        if self.sampling_steps < 1:
            raise Invalid("sampling_steps", self.sampling_steps, "an integer >= 1")
        if not 0.0 <= self.heldout_fraction < 1.0:
            raise Invalid("heldout_fraction", self.heldout_fraction, "a number in [0, 1)")
        for key in ("height", "width"):
            side = getattr(self, key)
            if side is not None and (side <= 0 or side % 16):
                raise Invalid(key, side, "a positive multiple of 16")
        if self.num_frames is not None and (self.num_frames < 1 or (self.num_frames - 1) % 4):
            raise Invalid("num_frames", self.num_frames, "a frame count of the form 4k+1")
        if self.guidance_scale < 0:
            raise Invalid("guidance_scale", self.guidance_scale, "a number >= 0")
        if self.sampling_flow_shift is not None and self.sampling_flow_shift <= 0:
            raise Invalid("sampling_flow_shift", self.sampling_flow_shift, "a number > 0, or null (the repo scheduler's own)")
        if self.fps < 1:
            raise Invalid("fps", self.fps, "an integer >= 1")
        if self.distance_clips < 0:
            raise Invalid("distance_clips", self.distance_clips, "an integer >= 0 (0: off)")
        if self.ar_step is not None and self.ar_step < 0:
            raise Invalid("ar_step", self.ar_step, "an integer >= 0, or null (chunk by chunk)")
        if not 0.0 <= self.context_noise < 1.0:
            raise Invalid("context_noise", self.context_noise, "a sigma in [0, 1)")
        if not 0.0 < self.collapse_ratio < 1.0:
            raise Invalid("collapse_ratio", self.collapse_ratio, "a number in (0, 1)")
        self._check_heldout()

    def _check_heldout(self) -> None:
        if self.heldout_fraction > 0 and self.heldout_data_path:
            raise Invalid(
                "heldout_fraction",
                self.heldout_fraction,
                f"0 when callbacks.validation.heldout_data_path is set ({self.heldout_data_path!r}): one held-out set",
            )
        if self.heldout_max_samples < 1:
            raise Invalid("heldout_max_samples", self.heldout_max_samples, "an integer >= 1")
        if not self.heldout_sigma_buckets or not all(0.0 < s <= 1.0 for s in self.heldout_sigma_buckets):
            raise Invalid("heldout_sigma_buckets", self.heldout_sigma_buckets, "sigmas in (0, 1]")
        for i, pattern in enumerate(self.heldout_chunk_patterns):
            ok = pattern in ("ramp_up", "ramp_down", "clean_context") if isinstance(pattern, str) else (
                bool(pattern) and all(0.0 <= s <= 1.0 for s in pattern)
            )
            if not ok:
                raise Invalid(
                    f"heldout_chunk_patterns[{i}]", pattern, "ramp_up, ramp_down, clean_context or a list of sigmas in [0, 1]"
                )


@dataclass
class CallbacksConfig:
    grad_clip: GradClipConfig = field(default_factory=GradClipConfig)
    ema: EmaConfig = field(default_factory=EmaConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)


@dataclass
class RunConfig:
    models: ModelsConfig = field(default_factory=ModelsConfig)
    method: MethodConfig = field(default_factory=MethodConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    callbacks: CallbacksConfig = field(default_factory=CallbacksConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def check(self) -> None:
        """The checks across sections (keys dotted from the root)."""
        st, tm = self.models.student, self.training.model
        self._check_vsa()
        if st.storage_dtype is not None and tm.compile != "none":
            raise Invalid("training.model.compile", says=(
                f"{tm.compile!r} with models.student.storage_dtype "
                f"{st.storage_dtype!r}: the compiled blocks cannot replay the per-layer weight casts (gradient "
                "checkpointing's recompute sees the storage dtype); use one of the two"
            ))
        cp, val = tm.context_parallel, self.callbacks.validation
        if cp.degree > 1 and val.enable and st.causal and (val.prompts or val.prompt_file):
            # A causal student samples block by block over a KV cache, which the Ulysses split does not serve.
            raise Invalid("callbacks.validation.prompts", says=(
                "sample videos of a causal student do not run under "
                f"training.model.context_parallel (ulysses {cp.ulysses}); remove the prompts (the held-out loss runs)"
            ))

    def _check_vsa(self) -> None:
        """VSA replaces the self-attention processors: not with block-causal attention (its
        processors hold the causal rule) nor under context parallelism (sequences split)."""
        vsa, st, cp = self.training.vsa, self.models.student, self.training.model.context_parallel
        if not vsa.enabled:
            return
        if st.causal:
            raise Invalid("training.vsa.sparsity", says=(
                f"{vsa.sparsity}: video sparse attention does not combine with a block-causal student "
                "(models.student.causal: true); set training.vsa.sparsity: 0 or models.student.causal: false"
            ))
        if st.storage_dtype is not None:
            raise Invalid("training.vsa.sparsity", says=(
                f"{vsa.sparsity} with models.student.storage_dtype {st.storage_dtype!r}: the trained gates would be "
                "stored in that dtype too; remove one of the two"
            ))
        if cp.degree > 1:
            raise Invalid("training.vsa.sparsity", says=(
                f"{vsa.sparsity}: video sparse attention does not run under training.model.context_parallel "
                f"(ulysses {cp.ulysses}); set training.vsa.sparsity: 0 or remove the context parallelism"
            ))


# --------------------------------------------------------------------------------------------
# Strict conversion of plain data into the dataclasses
# --------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is list:
        return "list"
    if origin is dict:
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def _convert(value: Any, tp: Any, key: str, source: str) -> Any:
    def fail(expected: str) -> ConfigError:
        return ConfigError(f"{source}: key '{key}': expected {expected}, got {value!r}")

    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, key, source)
            except ConfigError as err:
                errors.append(err)
        raise errors[0] if len(errors) == 1 else fail(_type_name(tp))
    if origin is Literal:
        if value in typing.get_args(tp) and not isinstance(value, bool):
            return value
        raise fail(_type_name(tp))
    if origin is list:
        if isinstance(value, tuple):
            value = list(value)
        if not isinstance(value, list):
            raise fail("a list")
        (item_tp,) = typing.get_args(tp) or (Any,)
        return [_convert(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise fail("a mapping")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise fail("a mapping")
        return _build_dataclass(tp, value, key, source)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise fail("true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise fail("an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise fail("a number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise fail("a string")
    raise TypeError(f"unsupported config type {tp!r} for {key}")


def _build_dataclass(cls: type, data: dict, prefix: str, source: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for raw_key, value in data.items():
        key = f"{prefix}.{raw_key}" if prefix else str(raw_key)
        if raw_key not in names:
            close = [n for n in names if n.lower().startswith(str(raw_key)[:3].lower())]
            hint = f" (did you mean {', '.join(repr(c) for c in sorted(close))}?)" if close else ""
            raise ConfigError(
                f"{source}: unknown key '{key}'{hint}; known keys here: {', '.join(sorted(names))}"
            )
        kwargs[raw_key] = _convert(value, hints[raw_key], key, source)
    return cls(**kwargs)


# --------------------------------------------------------------------------------------------
# Validation: each section checks its own fields (its `check`); one walker names the file and key
# --------------------------------------------------------------------------------------------


def validate(cfg: RunConfig, source: str) -> None:
    """Every section's own `check`, then the checks across sections (`RunConfig.check`); the first
    problem is a ConfigError naming the source file, the dotted key and the value."""
    sections = [found for name in CHECK_ORDER for found in _sections(getattr(cfg, name), name)]
    for path, section in [*sections, ("", cfg)]:
        check = getattr(section, "check", None)
        if check is None:
            continue
        try:
            check()
        except Invalid as err:
            key = f"{path}.{err.key}" if path else err.key
            what = err.says or f"expected {err.expected}, got {err.value!r}"
            raise ConfigError(f"{source}: key '{key}': {what}" if err.quoted else f"{source}: {key}: {what}") from None


# The order in which the sections are checked (the first problem is reported).
CHECK_ORDER = ("training", "models", "method", "callbacks")


def _sections(section: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(dotted path, section) for `section` and the sections inside it, depth first."""
    yield path, section
    for f in dataclasses.fields(section):
        child = getattr(section, f.name)
        if dataclasses.is_dataclass(child):
            yield from _sections(child, f"{path}.{f.name}")


# The one parser of `method.chunk_size`: DFSFT's chunks and a causal student's block size.
DEFAULT_CHUNK_SIZE = 3


def parse_chunk_size(raw: Any) -> int:
    """`method.chunk_size`: None -> 3; otherwise a positive integer (no bool, no fractional float)."""
    if raw is None:
        return DEFAULT_CHUNK_SIZE
    if isinstance(raw, bool):
        raise ValueError(f"method.chunk_size must be a positive integer, got bool {raw!r}")
    if isinstance(raw, int):
        value = raw
    elif isinstance(raw, float):
        if not raw.is_integer():
            raise ValueError(f"method.chunk_size must be a positive integer, got {raw!r}")
        value = int(raw)
    elif isinstance(raw, str):
        text = raw.strip()
        if not text:
            raise ValueError("method.chunk_size must be a positive integer, got an empty string")
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"method.chunk_size must be a positive integer, got {raw!r}") from None
    else:
        raise ValueError(f"method.chunk_size must be a positive integer, got {type(raw).__name__} {raw!r}")
    if value <= 0:
        raise ValueError(f"method.chunk_size must be a positive integer, got {raw!r}")
    return value


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"


def default_recipe(method: str) -> Path:
    """The built-in tiny recipe for a method (configs/tiny_<method>.yaml; DiffusionNFT's tiny_nft.yaml)."""
    return CONFIG_DIR / f"tiny_{ {'diffusion_nft': 'nft'}.get(method, method) }.yaml"


def _parse_override_value(text: str, dotted: str = "") -> Any:
    # YAML scalars: numbers, booleans, null, lists ("[1, 2]"); anything else stays a string. A key
    # that takes a string keeps the text as typed (`--output_dir 2024`, `--training.loop.mixed_precision no`).
    takes_text, optional = _takes_text(dotted)
    if takes_text:
        return None if optional and text.strip() in ("null", "Null", "NULL", "~", "") else text
    try:
        return load_recipe_yaml(text, f"command line --{dotted}" if dotted else "command line")
    except yaml.YAMLError:
        return text


def _takes_text(dotted: str) -> tuple[bool, bool]:
    """(whether the recipe key `dotted` is a string or a choice of strings, whether it may be null)."""
    tp: Any = RunConfig
    for part in dotted.split(".") if dotted else ():
        if not dataclasses.is_dataclass(tp):
            return False, False
        hints = typing.get_type_hints(tp)
        if part not in hints:
            return False, False
        tp = hints[part]
    if dataclasses.is_dataclass(tp) or tp is RunConfig:
        return False, False
    args = typing.get_args(tp) if typing.get_origin(tp) in (Union, types.UnionType) else (tp,)
    optional = type(None) in args
    scalars = [a for a in args if a is not type(None)]

    def is_text(a: Any) -> bool:
        if a is str:
            return True
        return typing.get_origin(a) is Literal and all(isinstance(v, str) for v in typing.get_args(a))

    return bool(scalars) and all(is_text(a) for a in scalars), optional


def _set_dotted(data: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override '{dotted}': '{part}' is not a section")
        node = child
    node[parts[-1]] = value


def load_config(
    path_or_dict: Union[str, os.PathLike, dict, None],
    overrides: Optional[dict[str, Any]] = None,
) -> RunConfig:
    """Load a recipe (YAML path or dict) and apply dotted overrides; validate strictly."""
    if path_or_dict is None:
        data, source = {}, "<defaults>"
    elif isinstance(path_or_dict, dict):
        data, source = _deep_copy(path_or_dict), "<dict>"
    else:
        path = Path(path_or_dict)
        source = str(path)
        data = _read_yaml(path)
    for dotted, value in (overrides or {}).items():
        if isinstance(value, str):
            value = _parse_override_value(value, dotted)
        _set_dotted(data, dotted, value)
    if overrides:
        source = f"{source} (with overrides {', '.join(overrides)})"
    cfg = _build_dataclass(RunConfig, data, "", source)
    resolve_roles(cfg, data, source)
    validate(cfg, source)
    check_lora_keys_enabled(cfg, data, source)
    cfg._source = source  # type: ignore[attr-defined]
    return cfg


def resolve_roles(cfg: RunConfig, data: dict, source: str) -> None:
    """The roles of a distillation method: a teacher is required; a student or critic that names no
    model of its own (neither `init_from` nor `transformer_config`) starts from the teacher's, and
    a missing critic section is the teacher's model. Roles of a method that has none are refused."""
    models = cfg.models
    reward_roles = [r for r in ("old", "reference") if getattr(models, r) is not None]
    if cfg.method.name in REWARD_METHODS:
        resolve_reward_roles(cfg, data, source)
        resolve_reward_ema(cfg, data, source)
    elif reward_roles:
        raise ConfigError(
            f"{source}: key 'models.{reward_roles[0]}' is set but method.name {cfg.method.name!r} has no such role "
            f"(roles old and reference belong to {', '.join(REWARD_METHODS)}): remove the section"
        )
    roles = TEACHER_ROLES.get(cfg.method.name, ())
    extra = [r for r in ("teacher", "critic", "ema") if r not in roles and getattr(models, r) is not None]
    if extra:
        owners = sorted(name for name, taken in TEACHER_ROLES.items() if extra[0] in taken)
        raise ConfigError(
            f"{source}: key 'models.{extra[0]}' is set but method.name {cfg.method.name!r} has no such role "
            f"(role {extra[0]} belongs to {', '.join(owners)}): remove the section"
        )
    if not roles:
        return
    if models.teacher is None:
        raise ConfigError(
            f"{source}: key 'models.teacher': method.name {cfg.method.name!r} distils a teacher: set "
            "models.teacher.init_from (a Hub id, a model folder or a run folder)"
        )
    given = data.get("models") or {}
    for role in roles[1:]:
        if getattr(models, role) is None:
            setattr(models, role, StudentConfig())
    for role in ("student", *roles[1:]):
        inherit_model(getattr(models, role), given.get(role) or {}, models.teacher, INHERITED_MODEL_KEYS)


def inherit_model(target: StudentConfig, raw: dict, source: StudentConfig, keys: tuple[str, ...]) -> None:
    """A role that names no model of its own (neither `init_from` nor `transformer_config` in its
    recipe section `raw`) takes `source`'s values of `keys` that the section leaves unset."""
    if raw.get("init_from") is None and raw.get("transformer_config") is None:
        for key in keys:
            if key not in raw:
                setattr(target, key, _deep_copy(getattr(source, key)))


def resolve_reward_roles(cfg: RunConfig, data: dict, source: str) -> None:
    """The roles of reward training: `old` and `reference` that name no model of their own are the
    student's model (frozen); with a LoRA student they are adapters over its base and take no section."""
    models, given = cfg.models, data.get("models") or {}
    for role in ("old", "reference"):
        raw = given.get(role) or {}
        if models.student.lora.enable and getattr(models, role) is not None:
            raise ConfigError(
                f"{source}: key 'models.{role}': with a LoRA student (models.student.lora.enable) the {role} policy is "
                "an adapter over the student's own base: remove the section"
            )
        if models.student.lora.enable:
            continue
        if getattr(models, role) is None:
            setattr(models, role, StudentConfig())
        target = getattr(models, role)
        inherit_model(target, raw, models.student, INHERITED_MODEL_KEYS + ("flow_shift",))
        if target.lora.enable:
            raise ConfigError(f"{source}: key 'models.{role}.lora.enable': the {role} policy is frozen; remove its LoRA section")


def resolve_reward_ema(cfg: RunConfig, data: dict, source: str) -> None:
    """FastVideo's `method.ema` block of reward training is the trainer's EMA (`callbacks.ema`, used
    for validation and exported): a recipe that sets both sections differently is refused."""
    method_ema = ((data.get("method") or {}).get("ema")) is not None
    callbacks_ema = ((data.get("callbacks") or {}).get("ema")) is not None
    me, ce = cfg.method.ema, cfg.callbacks.ema
    if callbacks_ema and not method_ema:
        return
    same = ce.enable == me.enabled and (not me.enabled or (ce.decay, ce.update_after_step) == (me.decay, me.update_after_step))
    if callbacks_ema and not same:
        raise ConfigError(
            f"{source}: key 'method.ema' {dict(enabled=me.enabled, decay=me.decay, update_after_step=me.update_after_step)} "
            f"disagrees with callbacks.ema {dict(enable=ce.enable, decay=ce.decay, update_after_step=ce.update_after_step)}: "
            "set one of the two (method.ema is FastVideo's name for the same average)"
        )
    if me.enabled and not 0.0 < me.decay < 1.0:
        raise ConfigError(f"{source}: key 'method.ema.decay': expected a number in (0, 1) for an enabled average, got {me.decay!r}")
    ce.enable, ce.update_after_step = me.enabled, me.update_after_step
    if me.enabled:
        ce.decay = me.decay


def micro_batches_per_step(cfg: RunConfig) -> int:
    """Micro-batches of one optimizer step: training.loop.gradient_accumulation_steps, times (reward
    training) the timesteps each sample trains at (DiffusionNFT accumulates over every timestep)."""
    k = cfg.training.loop.gradient_accumulation_steps
    if cfg.method.name not in REWARD_METHODS:
        return k
    return k * nft_train_timesteps(cfg.method)


def nft_train_timesteps(method: "MethodConfig") -> int:
    """int(schedule length * method.timestep_fraction), at least 1 and at most the schedule's length."""
    length = method.sampling.schedule_length()
    return max(1, min(length, int(length * float(method.timestep_fraction))))


def check_role_runs(cfg: RunConfig) -> None:
    """A role's `init_from` that names the output folder of one of the built-in recipes, before that
    run exists (the tiny teacher of configs/tiny_dmd2.yaml): a ConfigError giving the command that
    makes it, instead of a Hub lookup of a folder name."""
    for role in ("student", "teacher", "critic", "ema", "old", "reference"):
        section = getattr(cfg.models, role)
        if section is None or not section.init_from or Path(section.init_from).exists():
            continue
        maker = recipe_writing(section.init_from)
        if maker is not None:
            recipe, method = maker
            script = {"tfsft": "dfsft", "kd_causal": "kd"}.get(method, method)
            raise ConfigError(
                f"models.{role}.init_from '{section.init_from}' does not exist yet: it is the output of "
                f"configs/{recipe.name}; make it first with `accelerate launch train_{script}.py --config configs/{recipe.name}`"
            )


def recipe_writing(folder: str) -> Optional[tuple[Path, str]]:
    """(recipe, method name) of the built-in recipe whose training.checkpoint.output_dir is `folder`, if any."""
    wanted = os.path.normpath(folder)
    for recipe in sorted(CONFIG_DIR.glob("*.yaml")):
        try:
            data = _read_yaml(recipe)
        except (ConfigError, OSError):
            continue
        out = ((data.get("training") or {}).get("checkpoint") or {}).get("output_dir")
        if isinstance(out, str) and os.path.normpath(out) == wanted:
            return recipe, str((data.get("method") or {}).get("name") or "finetune")
    return None


def role_config(cfg: RunConfig, role: str) -> RunConfig:
    """The recipe as a role's model reads it: `models.<role>` in the student's place, and dense
    attention for a teacher or critic (`training.vsa` applies to the student alone)."""
    models = dataclasses.replace(cfg.models, student=getattr(cfg.models, role))
    training = dataclasses.replace(cfg.training, vsa=VSAConfig())
    return dataclasses.replace(cfg, models=models, training=training)


def check_lora_keys_enabled(cfg: RunConfig, data: dict, source: str) -> None:
    """LoRA settings the recipe or command line gives (other than their defaults) while
    models.student.lora.enable is false would be ignored, and the run would train every weight:
    a ConfigError naming them. A printed recipe (`--dry-run`) holds every key at its default and passes."""
    given = ((data.get("models") or {}).get("student") or {}).get("lora") or {}
    lora = cfg.models.student.lora
    if lora.enable or not isinstance(given, dict):
        return
    defaults = LoraConfig()
    keys = [f"models.student.lora.{k}" for k in given if k != "enable" and getattr(lora, k) != getattr(defaults, k)]
    if keys:
        raise ConfigError(
            f"{source}: {', '.join(keys)} set but models.student.lora.enable is false, so the run would train every "
            "weight and ignore them: set models.student.lora.enable true (or remove those keys)"
        )


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: recipe file not found")
    with open(path, encoding="utf-8") as fh:
        try:
            data = load_recipe_yaml(fh, str(path)) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the recipe must be a mapping of sections")
    return data


# Anchors and aliases stay allowed in recipes (a block shared by two sections, `<<: *defaults`),
# but what they add when expanded is bounded: a recipe is a few hundred nodes, and an alias bomb
# (9 aliases of 9 aliases of ...) is billions. Counted on PyYAML's node graph, where an alias is
# the anchored node itself, before anything is constructed.
MAX_ALIAS_EXPANSION = 10_000
YAML_MERGE_TAG = "tag:yaml.org,2002:merge"


class _RecipeLoader(yaml.SafeLoader):
    """PyYAML's safe loader that keeps the document's anchors (name -> node) after composing it,
    so that a refused alias can be named."""

    def compose_document(self) -> Any:
        self.get_event()  # the document start
        node = self.compose_node(None, None)
        self.get_event()  # the document end
        self.recipe_anchors = dict(self.anchors)
        self.anchors = {}
        return node


def load_recipe_yaml(stream: Any, source: str) -> Any:
    """`yaml.safe_load` for recipes: a key repeated in one mapping and aliases that expand beyond
    MAX_ALIAS_EXPANSION nodes are a ConfigError naming `source` and the line, raised on the
    composed node graph, before any alias is expanded."""
    loader = _RecipeLoader(stream)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_yaml_nodes(node, source, getattr(loader, "recipe_anchors", {}))
        return loader.construct_document(node)
    finally:
        loader.dispose()


def check_yaml_nodes(root: yaml.Node, source: str, anchors: dict[str, yaml.Node]) -> None:
    _check_alias_expansion(root, source, anchors)
    _check_duplicate_keys(root, source)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def _check_alias_expansion(root: yaml.Node, source: str, anchors: dict[str, yaml.Node]) -> None:
    """Count the nodes of the expanded document with one visit per distinct node (sizes memoised
    by node identity); refuse a recursive alias or an expansion beyond MAX_ALIAS_EXPANSION."""
    sizes: dict[int, int] = {}
    visiting: set[int] = set()
    names = {id(node): name for name, node in anchors.items()}

    def where(node: yaml.Node) -> str:
        name = names.get(id(node))
        return f"the anchor &{name} at line {node.start_mark.line + 1}" if name else f"line {node.start_mark.line + 1}"

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in visiting:
            raise ConfigError(f"{source}: {where(node)} refers to itself through an alias (a recursive structure); recipes cannot hold one")
        visiting.add(key)
        total = 1 + sum(size(child) for child in _children(node))  # as deep as PyYAML's own composer went
        visiting.discard(key)
        sizes[key] = total
        return total

    expanded = size(root)
    added = expanded - len(sizes)
    if added > MAX_ALIAS_EXPANSION:
        biggest = max((n for n in anchors.values() if id(n) in sizes), key=lambda n: sizes[id(n)], default=root)
        raise ConfigError(
            f"{source}: its aliases expand the recipe to {expanded:,} YAML nodes ({added:,} added by aliases, more than "
            f"the {MAX_ALIAS_EXPANSION:,} allowed; the largest is {where(biggest)}, {sizes[id(biggest)]:,} nodes); "
            "refused before expanding it: write the values out or share fewer of them"
        )


def _check_duplicate_keys(root: yaml.Node, source: str) -> None:
    """A key given twice in one mapping (a second `training:` section, a repeated leaf key), which
    YAML loaders resolve by silently keeping the last one. Merge keys (`<<`) are not duplicates."""
    seen_nodes: set[int] = set()
    todo: list[tuple[yaml.Node, str]] = [(root, "")]
    while todo:
        node, path = todo.pop()
        if id(node) in seen_nodes:
            continue
        seen_nodes.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            todo += [(child, f"{path}[{i}]") for i, child in enumerate(node.value)]
            continue
        if not isinstance(node, yaml.MappingNode):
            continue
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != YAML_MERGE_TAG:
                key = (key_node.tag, key_node.value)
                dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
                line = key_node.start_mark.line + 1
                if key in first_line:
                    raise ConfigError(
                        f"{source}: line {line}: key '{dotted}' is given a second time (first at line {first_line[key]}); "
                        "YAML would keep only the last one: merge the two into one"
                    )
                first_line[key] = line
                todo.append((value_node, dotted))
            else:
                todo.append((value_node, path))


def _deep_copy(data: Any) -> Any:
    if isinstance(data, dict):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data


def parse_cli(argv: list[str], method: str) -> tuple[RunConfig, dict]:
    """Parse `--config PATH`, `--dry-run`, `--output_dir DIR`, `--resume_from_checkpoint X` and
    dotted overrides (`--training.optimizer.learning_rate 2e-6` or `--key=value`).

    Returns the config and the flags (`dry_run`).
    """
    config_path: Optional[str] = None
    overrides: dict[str, Any] = {}
    flags = {"dry_run": False}
    shorthands = {
        "output_dir": "training.checkpoint.output_dir",
        "resume_from_checkpoint": "training.checkpoint.resume_from_checkpoint",
        "max_train_steps": "training.loop.max_train_steps",
        "seed": "training.data.seed",
    }
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            print(help_text(method), end="")
            raise SystemExit(0)
        if not arg.startswith("--"):
            raise ConfigError(f"command line: unexpected argument {arg!r} (options start with --)")
        name, eq, inline = arg[2:].partition("=")
        name_norm = name.replace("-", "_") if "." not in name else name
        if name_norm == "dry_run":
            flags["dry_run"] = True
            i += 1
            continue
        if eq:
            value = inline
            i += 1
        else:
            if i + 1 >= len(argv):
                raise ConfigError(f"command line: option --{name} needs a value")
            value = argv[i + 1]
            i += 2
        if name_norm == "config":
            config_path = value
        elif name_norm in shorthands:
            overrides[shorthands[name_norm]] = value
        elif "." in name:
            overrides[name] = value
        else:
            raise ConfigError(
                f"command line: unknown option --{name}; use --config, --dry-run, "
                f"{', '.join('--' + s for s in shorthands)} or a dotted recipe key"
            )
    if config_path is None:
        config_path = str(default_recipe(method))
    # The entry script decides the method family; a recipe may name it (or TFSFT, a DFSFT variant).
    allowed = {"finetune": ("finetune",), "dfsft": ("dfsft", "tfsft"), "dmd2": ("dmd2",), "self_forcing": ("self_forcing",),
               "diffusion_nft": ("diffusion_nft",), "kd": ("kd", "kd_causal"), "causal_cd": ("causal_cd",),
               "anyflow_pretrain": ("anyflow_pretrain",), "anyflow": ("anyflow",)}[method]
    named = overrides.get("method.name") or (_read_yaml(Path(config_path)).get("method") or {}).get("name")
    if named is None:
        overrides["method.name"] = method
    elif named not in allowed:
        raise ConfigError(
            f"{config_path}: key 'method.name' is {named!r}, but train_{method}.py runs "
            f"{' or '.join(allowed)}; use the matching entry script"
        )
    cfg = load_config(config_path, overrides)
    return cfg, flags


def help_text(method: str) -> str:
    """train_<method>.py --help: the options, each with its default (the built-in tiny recipe's value)."""
    recipe = default_recipe(method)
    cfg = load_config(recipe, {"method.name": method})
    ck, loop = cfg.training.checkpoint, cfg.training.loop
    rel = f"configs/{recipe.name}"
    rows = [
        ("--config RECIPE.yaml", f"the recipe (default: {rel}, the built-in tiny one)"),
        ("--dry-run", "print the resolved recipe and a memory estimate per process, then exit"),
        ("--output_dir DIR", f"training.checkpoint.output_dir (default: {ck.output_dir})"),
        ("--resume_from_checkpoint X", "latest, or a checkpoint-<step> folder (default: none, a fresh run)"),
        ("--max_train_steps N", f"training.loop.max_train_steps (default: {loop.max_train_steps})"),
        ("--seed N", f"training.data.seed (default: {cfg.training.data.seed})"),
        ("--section.key VALUE", "any recipe key by its dotted name, e.g. --training.optimizer.learning_rate 2e-6 "
         f"(default: {cfg.training.optimizer.learning_rate:g} for that one)"),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [
        f"usage: accelerate launch train_{method}.py [--config RECIPE.yaml] [--dry-run]",
        "       [--output_dir DIR] [--resume_from_checkpoint latest|PATH] [--section.key VALUE ...]",
        "",
        f"options (defaults: the values of {rel}; those of another recipe: --config RECIPE.yaml --dry-run):",
        *(f"  {name:<{width}}  {text}" for name, text in rows),
        "",
        "Every recipe key with its meaning and default: docs/recipes-and-keys.md.",
    ]
    return "\n".join(lines) + "\n"
