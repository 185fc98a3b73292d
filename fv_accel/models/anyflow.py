"""The AnyFlow family: flow-map students (diffusers' `AnyFlowTransformer3DModel`) that learn the average
velocity u(x_t, t, r) from t to r, so that one checkpoint samples at any step count, and that stock
diffusers (`AnyFlowPipeline` with `FlowMapEulerDiscreteScheduler`) samples with no code of ours.

The flow-map contract (what the AnyFlow methods, fv_accel/methods/distribution_matching/anyflow*.py,
call on the student):

    student.predict_velocity_with_r(noisy_latents, timesteps, r_timesteps, training_batch, *,
                                    conditional=True, cfg_uncond=None, attn_kind="dense") -> torch.Tensor

returns u(x_t, t, r), [B, C, T, H, W] like `noisy_latents` (normalised latents, diffusers layout), in the
transformer's dtype as `predict_noise` returns its velocity. `timesteps` (t) and `r_timesteps` (r) are on
the 0..1000 scale as FastVideo passes them, each [B], [1] (one value for the batch) or per latent frame
[B, T]; integer tensors are taken as floats. r = t gives the instantaneous velocity (the flow-matching
velocity eps - x0): `predict_noise(x, t, batch)` is `predict_velocity_with_r(x, t, t, batch)`. One step
of the flow map is x_r = x_t - (t - r) / 1000 * u, as `FlowMapEulerDiscreteScheduler.step` takes it.
Conditioning, the unconditional branch (`conditional=False`: the batch's `unconditional`, else the text
zeroed) and `attn_kind` are those of `ModelBase.predict_noise`. Everything else (prepare_batch,
training_table, add_noise, LoRA, outputs) is the generic student's.

The student is loaded from an AnyFlow checkpoint (Hub id or folder in the layout of
nvidia/AnyFlow-Wan2.1-T2V-1.3B-Diffusers: `AnyFlowPipeline`, UMT5, `AutoencoderKLWan`,
`FlowMapEulerDiscreteScheduler`), or made from a Wan 2.1 text-to-video transformer
(`models.student.anyflow_from_wan: true`; `anyflow_from_wan`). Its training forward builds the
transformer's inputs as `AnyFlowPipeline` does: latents as [B, T, C, H, W], t and r per latent frame
[B, T], the text embeddings as the Wan pipelines pad them.

A finished full run writes beside `transformer/` what `AnyFlowPipeline.from_pretrained(run_dir)` needs:
`model_index.json`, `scheduler/` (`FlowMapEulerDiscreteScheduler` at the student's training shift) and
the VAE, text encoder and tokenizer of the model the data was encoded with (`write_pipeline_parts`).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from diffusers import AnyFlowFARTransformer3DModel, AnyFlowTransformer3DModel

from fv_accel.config import StudentConfig
from fv_accel.models.base import Capabilities, Conditioning, TrainingBatch, register_family
from fv_accel.models.student import DiffusersStudent, build_family_transformer

logger = logging.getLogger(__name__)

# The values diffusers' AnyFlow transformers default to, which the released checkpoints set.
DEFAULT_GATE_VALUE = 0.25
DEFAULT_DELTATIME_TYPE = "r"
# WanTransformer3DModel config keys that AnyFlowTransformer3DModel takes as they are.
SHARED_CONFIG_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                      "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps", "rope_max_seq_len")
# The pipeline parts a run folder gets from the model its data was encoded with.
COPIED_PARTS = ("vae", "text_encoder", "tokenizer")


def frame_timesteps(t: torch.Tensor, batch: int, frames: int, name: str) -> torch.Tensor:
    """t as the AnyFlow transformers take it: float [B, T] (one value per latent frame)."""
    t = t.float() if not t.is_floating_point() else t
    if t.ndim == 0:
        t = t.reshape(1)
    if t.ndim == 1:
        if t.shape[0] not in (1, batch):
            raise ValueError(f"{name} has {t.shape[0]} values for a batch of {batch}")
        return t.reshape(-1, 1).expand(batch, frames)
    if t.ndim != 2 or t.shape[1] != frames or t.shape[0] not in (1, batch):
        raise ValueError(f"{name} must be [B], [1] or [B, T={frames}], got {tuple(t.shape)}")
    return t.expand(batch, frames)


def anyflow_from_wan(
    wan: torch.nn.Module, gate_value: float, deltatime_type: str, where: str, far: bool = False
) -> torch.nn.Module:
    """An `AnyFlowTransformer3DModel` (`far`: `AnyFlowFARTransformer3DModel`, diffusers' FAR defaults)
    holding the weights of the Wan 2.1 transformer `wan`, carried over by name; its delta embedder starts
    as a copy of the time embedder (FastVideo's initialisation), so that at r = t (deltatime r) the flow
    map is the Wan model's velocity. FAR's compressed patch embedding starts as diffusers' own warm start
    of it: the patch embedding resampled trilinearly to the compressed patch size."""
    config = dict(wan.config)
    refusals = {
        "qk_norm": (config.get("qk_norm") != "rms_norm_across_heads", "AnyFlow normalises q and k across heads"),
        "image_dim": (config.get("image_dim") is not None, "AnyFlowPipeline is text-to-video (no image cross-attention)"),
        "added_kv_proj_dim": (config.get("added_kv_proj_dim") is not None, "AnyFlow has no image key/value projections"),
        "pos_embed_seq_len": (config.get("pos_embed_seq_len") is not None, "AnyFlow has no learned position embedding"),
        "in_channels": (config.get("in_channels") != config.get("out_channels"), "AnyFlow takes the latent alone (no image-to-video channels)"),
    }
    for key, (refused, why) in refusals.items():
        if refused:
            raise ValueError(
                f"models.student.anyflow_from_wan: model '{where}' has {key}={config.get(key)!r}, which "
                f"AnyFlowTransformer3DModel cannot hold ({why}): make the AnyFlow student from a Wan 2.1 text-to-video transformer"
            )
    cls = AnyFlowFARTransformer3DModel if far else AnyFlowTransformer3DModel
    model = cls(**anyflow_config_of_wan(config, gate_value, deltatime_type))
    model.to(next(wan.parameters()).dtype)
    missing, unexpected = model.load_state_dict(wan.state_dict(), strict=False)
    new = ("condition_embedder.delta_embedder.", "far_patch_embedding.") if far else ("condition_embedder.delta_embedder.",)
    if unexpected or any(not key.startswith(new) for key in missing):
        odd = unexpected or [k for k in missing if not k.startswith(new)]
        raise ValueError(
            f"models.student.anyflow_from_wan: model '{where}': the Wan weights do not map onto AnyFlowTransformer3DModel "
            f"by name ({len(odd)} keys, e.g. {odd[0]!r}): use a Wan 2.1 text-to-video transformer"
        )
    embedder = model.condition_embedder
    embedder.delta_embedder.load_state_dict(embedder.time_embedder.state_dict())
    if far:
        full, compressed = model.patch_embedding, model.far_patch_embedding
        weight = full.weight.data.float().reshape(-1, 1, *full.kernel_size)
        resampled = torch.nn.functional.interpolate(weight, size=compressed.kernel_size, mode="trilinear", align_corners=False)
        with torch.no_grad():
            compressed.weight.copy_(resampled.reshape(compressed.weight.shape))
            compressed.bias.copy_(full.bias)
    return model


def anyflow_config_of_wan(config: Any, gate_value: float, deltatime_type: str) -> dict:
    """The AnyFlow transformer config of a Wan 2.1 transformer config (its shared keys, the r embedding's)."""
    return {**{k: config[k] for k in SHARED_CONFIG_KEYS if k in config}, "gate_value": float(gate_value),
            "deltatime_type": deltatime_type}


def transformer_class_of_wan(wan_config: dict, st: StudentConfig) -> tuple[type, dict]:
    """(class, config) of the AnyFlow (FAR with `causal`) transformer a recipe makes from the Wan
    transformer of `wan_config` (`anyflow_from_wan`), without building it: what exports rebuild."""
    gate = DEFAULT_GATE_VALUE if st.r_embedder_gate_value is None else st.r_embedder_gate_value
    config = anyflow_config_of_wan(wan_config, gate, st.r_embedder_deltatime_type or DEFAULT_DELTATIME_TYPE)
    return (AnyFlowFARTransformer3DModel if st.causal else AnyFlowTransformer3DModel), config


def flow_map_scheduler_config(shift: float) -> dict:
    """The `FlowMapEulerDiscreteScheduler` config that steps the student at `shift`: at N steps the
    timesteps shift(linspace(1, 0, N + 1))[:N] * 1000 with r the next one (0 after the last), FastVideo's
    flow-map schedule without its final 0."""
    return {"_class_name": "FlowMapEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": float(shift)}


def pipeline_timesteps(timesteps: list[float], shift: float, num_train_timesteps: int = 1000) -> list[float]:
    """What to pass as `timesteps=` to a stock AnyFlow pipeline for it to step exactly `timesteps`
    (FastVideo's list, already shifted, with or without its final 0): the pipeline's scheduler shifts
    custom timesteps again, so they are un-shifted here (sigma -> sigma / (shift - (shift - 1) sigma))."""
    values = [float(t) for t in timesteps]
    if values and values[-1] == 0.0:
        values = values[:-1]
    out = []
    for t in values:
        sigma = t / num_train_timesteps
        out.append(num_train_timesteps * sigma / (shift - (shift - 1.0) * sigma))
    return out


@register_family
class AnyFlowStudent(DiffusersStudent):
    """AnyFlow (bidirectional): a Wan 2.1 backbone whose time embedding also takes the target time r."""

    family = "anyflow"
    vae_class_names = ("AutoencoderKLWan",)
    transformer_classes = {"anyflow": AnyFlowTransformer3DModel}
    pipeline_class_names = ("AnyFlowPipeline",)
    pipeline_class_name = "AnyFlowPipeline"
    capabilities = Capabilities(per_frame_timesteps=True)
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    # FastVideo's Wan training shift (the student samples at its training shift).
    default_flow_shift = 3.0
    # Teachers and critics of another family on the same latents and text encoder
    # (fv_accel.build.check_role_fits_student): AnyFlow students are distilled from Wan models.
    role_families = ("wan", "anyflow")
    latent_statistics_source = "vae/config.json"

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import AnyFlowPipeline

        return AnyFlowPipeline

    @classmethod
    def pipeline_prompt(cls, caption: str) -> str:
        """AnyFlowPipeline's `prompt_clean` is the Wan pipelines' (fv_accel.models.encoders.wan_prompt_clean)."""
        from fv_accel.models.encoders import wan_prompt_clean

        return wan_prompt_clean(caption)

    @classmethod
    def default_scheduler_config(cls) -> dict:
        return flow_map_scheduler_config(cls.default_flow_shift)

    # ---- preprocessing and validation: the Wan 2.1 encoders (UMT5, AutoencoderKLWan) ----
    @classmethod
    def encoding_spec(cls, model: str, revision: Optional[str] = None) -> Any:
        from fv_accel.models.wan import WanStudent

        return WanStudent.encoding_spec(model, revision)

    @classmethod
    def make_encoder(cls, model: str, *, device=None, dtype=torch.float32, revision=None, vae_tiling=False, spec=None) -> Any:
        from fv_accel.models.wan import WanStudent

        return WanStudent.make_encoder(model, device=device, dtype=dtype, revision=revision, vae_tiling=vae_tiling, spec=spec)

    @classmethod
    def latent_statistics(cls, model: str, revision: Optional[str] = None) -> Optional[tuple[list[float], list[float]]]:
        from fv_accel.models.wan import WanStudent

        return WanStudent.latent_statistics(model, revision)

    @classmethod
    def load_vae(cls, model: str, *, revision: Optional[str] = None, torch_dtype: torch.dtype = torch.float32) -> Any:
        from fv_accel.models.wan import WanStudent

        return WanStudent.load_vae(model, revision=revision, torch_dtype=torch_dtype)

    @classmethod
    def stream_decoder(cls, vae: Any) -> Any:
        from fv_accel.models.wan import WanStudent

        return WanStudent.stream_decoder(vae)

    # ---- construction ----
    def build_transformers(self, st: StudentConfig) -> tuple[torch.nn.Module, str, list[torch.nn.Module]]:
        """The AnyFlow transformer of `init_from`, or made from the Wan transformer there
        (`anyflow_from_wan`); the recipe's r-embedder keys checked against what it can hold."""
        where = st.init_from or "models.student.transformer_config"
        if st.r_embedder_fusion == "additive":
            raise ValueError(
                "models.student.r_embedder_fusion: additive (emb(t) + g * emb(r)) is not a form diffusers' AnyFlow "
                "transformers compute (they mix (1 - g) * emb(t) + g * emb(r)): set gated"
            )
        if not st.anyflow_from_wan:
            transformer, kind = build_family_transformer(type(self), st, st.subfolder or None)
            self._check_recipe_matches(transformer.config, st, where)
            return transformer, kind, [transformer]
        from fv_accel.models.wan import WanStudent

        wan, _ = build_family_transformer(WanStudent, _as_wan_config(st), st.subfolder or None)
        gate = DEFAULT_GATE_VALUE if st.r_embedder_gate_value is None else st.r_embedder_gate_value
        delta = st.r_embedder_deltatime_type or DEFAULT_DELTATIME_TYPE
        far = self.family == "anyflow_far"
        transformer = anyflow_from_wan(wan, gate, delta, where, far=far)
        logger.info("AnyFlow%s student made from the Wan transformer of %s (gate %g, deltatime %s)",
                    "-FAR" if far else "", where, gate, delta)
        return transformer, self.family, [transformer]

    @staticmethod
    def _check_recipe_matches(config: Any, st: StudentConfig, where: str) -> None:
        for key, value in (("r_embedder_gate_value", st.r_embedder_gate_value), ("r_embedder_deltatime_type", st.r_embedder_deltatime_type)):
            theirs = config.get("gate_value" if key.endswith("gate_value") else "deltatime_type")
            if value is not None and value != theirs:
                raise ValueError(
                    f"models.student.{key}: {value!r}, but the AnyFlow checkpoint '{where}' was trained with {theirs!r}: "
                    "remove the key (a loaded checkpoint keeps its own)"
                )

    def configure(self, config: Any) -> None:
        where = self.student_config.init_from or "models.student.transformer_config"
        if config.get("image_dim") is not None:
            raise ValueError(
                f"model '{where}': an AnyFlow transformer with image_dim {config.get('image_dim')} (image conditioning) "
                "is not supported: AnyFlowPipeline samples text-to-video"
            )
        self.gate_value = float(config.get("gate_value", DEFAULT_GATE_VALUE))
        self.deltatime_type = str(config.get("deltatime_type", DEFAULT_DELTATIME_TYPE))

    def input_dtype_of(self, module: torch.nn.Module) -> torch.dtype:
        # The patch embedding's dtype, not the first parameter's: diffusers keeps some tables in fp32.
        return module.patch_embedding.weight.dtype

    # ---- per step ----
    def transformer_inputs(self, x_t: torch.Tensor, t: torch.Tensor, r: torch.Tensor, cond: Conditioning) -> dict:
        """The keyword arguments of the transformer call as AnyFlowPipeline builds them."""
        if cond.text is None:
            raise ValueError("AnyFlow conditioning needs the text embedding (the 'text_embedding' column)")
        b, _, frames = x_t.shape[:3]
        dtype = self.input_dtype
        return dict(
            hidden_states=x_t.permute(0, 2, 1, 3, 4).to(dtype),
            timestep=frame_timesteps(t, b, frames, "timesteps").to(x_t.device),
            r_timestep=frame_timesteps(r, b, frames, "r_timesteps").to(x_t.device),
            encoder_hidden_states=cond.text.to(dtype),
            return_dict=False,
        )

    def velocity_with_r(self, x_t: torch.Tensor, t: torch.Tensor, r: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """u(x_t, t, r) [B, C, T, H, W] for x_t [B, C, T, H, W]."""
        out = self.transformer(**self.transformer_inputs(x_t, t, r, cond))[0]
        return out.permute(0, 2, 1, 3, 4)

    def forward(self, x_t: torch.Tensor, t: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The instantaneous velocity: the flow map at r = t."""
        return self.velocity_with_r(x_t, t, t, cond)

    def predict_velocity_with_r(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        r_timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
        cfg_uncond: Optional[dict] = None,
        attn_kind: str = "dense",
    ) -> torch.Tensor:
        """The average velocity u(x_t, t, r): the module docstring's contract."""
        del cfg_uncond
        cond = self.branch_conditioning(training_batch, conditional=conditional, attn_kind=attn_kind)
        return self.velocity_with_r(noisy_latents, timesteps, r_timesteps, cond)

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
        return self.predict_velocity_with_r(
            noisy_latents, timesteps, timesteps, training_batch, conditional=conditional, cfg_uncond=cfg_uncond,
            attn_kind=attn_kind,
        )

    # ---- sample videos ----
    def flow_map_scheduler(self, scheduler: Any = None) -> Any:
        """The FlowMapEulerDiscreteScheduler the student samples with, whatever scheduler the caller
        read from the model repo (a Wan repo's UniPC, an AnyFlow repo's own shift): at
        `callbacks.validation.sampling_flow_shift` where set, else at the training shift, which is
        what the run folder's scheduler/ holds and the AnyFlow methods' rollouts step."""
        from diffusers import FlowMapEulerDiscreteScheduler

        del scheduler
        shift = self.run_config.callbacks.validation.sampling_flow_shift
        if shift is None:
            shift = self.training_shift(torch.Size([1, 1, 1, 1, 1]))
        config = flow_map_scheduler_config(shift)
        return FlowMapEulerDiscreteScheduler.from_config({k: v for k, v in config.items() if k != "_class_name"})

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
        flow_map: Optional[dict] = None,
    ) -> Optional[torch.Tensor]:
        """A sample through diffusers' AnyFlowPipeline around the live transformer, stepping the flow map
        with `flow_map_scheduler(scheduler)` (r = the next timestep); the normalised latents. `flow_map`:
        the pipeline's own step inputs (`timesteps`: a trained step list through `pipeline_timesteps`,
        `use_mean_velocity`), as `python -m fv_accel.generate` samples an on-policy student at its steps."""
        import diffusers

        from fv_accel.sampling import pipeline_latents

        del first_frame
        pipe = getattr(diffusers, self.pipeline_class_name)(
            tokenizer=None, text_encoder=None, vae=vae, scheduler=self.flow_map_scheduler(scheduler),
            transformer=self.transformer,
        )
        return pipeline_latents(
            pipe, cond.text, None if negative is None else negative.text, height=height, width=width,
            num_frames=num_frames, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
            generator=generator, **self.pipeline_call_inputs(vae, num_frames), **(flow_map or {}),
        )

    def pipeline_call_inputs(self, vae: torch.nn.Module, num_frames: int) -> dict:
        """What the pipeline call takes beside the prompt and steps: nothing for the bidirectional student."""
        del vae, num_frames
        return {}

    # ---- outputs ----
    def save_final(self, accelerator: Any, output_dir: Any) -> None:
        """The trained weights (the generic student's), then the rest of an AnyFlow pipeline folder
        (`write_pipeline_parts`) for a full run, and for a LoRA run of a student made from Wan, whose
        base is no AnyFlow repo, with that base as `transformer/` (the adapter loads over it with
        `load_lora_weights(run_dir)`). A LoRA over an AnyFlow repo loads over that repo."""
        super().save_final(accelerator, output_dir)
        if self.role != "student" or (self.lora_enabled and not self.student_config.anyflow_from_wan):
            return
        base = self.lora_base_state(accelerator) if self.lora_enabled else None
        if accelerator.is_main_process:
            if base is not None:
                plain = self.transformer_classes[self.kind].from_config(self.modules[0].config)
                plain.load_state_dict(base, strict=True)
                plain.save_pretrained(Path(output_dir) / "transformer", safe_serialization=True)
            write_pipeline_parts(Path(output_dir), self.pipeline_class_name, self.parts_source(),
                                 self.training_shift(torch.Size([1, 1, 1, 1, 1])))
        accelerator.wait_for_everyone()

    def lora_base_state(self, accelerator: Any) -> dict:
        """The frozen base of a LoRA student, its adapter left out (peft's `base_layer` names undone).
        Collective under FSDP/DeepSpeed (gathers the sharded state dict)."""
        from accelerate.utils import DistributedType

        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        state = accelerator.get_state_dict(self.transformer) if sharded else self._unwrapped(accelerator).state_dict()
        return {k.replace(".base_layer.", "."): v for k, v in state.items() if "lora_" not in k}

    def parts_source(self) -> Optional[str]:
        """The model repo whose VAE, text encoder and tokenizer the run's data was encoded with: the
        run's sampling model (`model_source`, which the build sets from
        `fv_accel.validation.sampling_model_source`: `init_from` where it has a vae/, else the model the
        dataset records, the built-in tiny data's included), else `init_from` with a vae/, else the model
        recorded by a dataset folder."""
        if getattr(self, "model_source", None):
            return self.model_source
        st = self.student_config
        if st.init_from and (not Path(st.init_from).is_dir() or (Path(st.init_from) / "vae").is_dir()):
            return st.init_from
        try:
            from fv_accel.data.schema import read_dataset_info

            data = self.run_config.training.data.data_path
            return read_dataset_info(data).get("model") if data and Path(data).is_dir() else None
        except (OSError, ValueError):
            return None

    def base_model_info(self) -> dict:
        st = self.student_config
        # StudentConfig's names: exports rebuild the transformer from them (fv_accel.export).
        return {**super().base_model_info(), "anyflow_from_wan": st.anyflow_from_wan, "causal": st.causal,
                "r_embedder_gate_value": self.gate_value, "r_embedder_deltatime_type": self.deltatime_type}


def _as_wan_config(st: StudentConfig) -> StudentConfig:
    """The recipe's student read as the Wan model it names (`anyflow_from_wan`)."""
    from dataclasses import replace

    return replace(st, model_class="auto")


def write_pipeline_parts(out: Path, pipeline: str, source: Optional[str], shift: float) -> None:
    """Make the run folder `out` (holding `transformer/`) loadable by `<pipeline>.from_pretrained(out)`:
    `scheduler/scheduler_config.json` (the flow map at the training shift), the VAE, text encoder and
    tokenizer of `source` hard-linked (else copied) in, and `model_index.json` last (written to a temporary name and
    renamed): a folder with model_index.json is complete. Without a source the weights stay alone."""
    from fv_accel.models.loading import fetch_config

    scheduler = out / "scheduler"
    scheduler.mkdir(parents=True, exist_ok=True)
    _write_json(scheduler / "scheduler_config.json", flow_map_scheduler_config(shift))
    if source is None:
        logger.warning("%s: no model the data was encoded with is known: no VAE or text encoder copied, no model_index.json", out)
        return
    index = fetch_config(source, None, required=False, filename="model_index.json") or {}
    folder = _local_folder(source)
    entries = {"transformer": ["diffusers", "AnyFlowFARTransformer3DModel" if pipeline == "AnyFlowFARPipeline" else "AnyFlowTransformer3DModel"],
               "scheduler": ["diffusers", "FlowMapEulerDiscreteScheduler"]}
    for part in COPIED_PARTS:
        target = out / part
        if target.exists():
            shutil.rmtree(target)
        shutil.copytree(folder / part, target, copy_function=_link_or_copy)
        entries[part] = index.get(part) or _default_entry(part)
    _write_json(out / "model_index.json", {"_class_name": pipeline, "_diffusers_version": _diffusers_version(), **entries})


def _link_or_copy(source: str, target: str) -> None:
    """A hard link to the file (a Hub cache entry: its blob), which costs no space (a text encoder
    is gigabytes); a copy where the two are on different file systems."""
    import os

    try:
        os.link(os.path.realpath(source), target)
    except OSError:
        shutil.copy2(source, target)


def _default_entry(part: str) -> list[str]:
    return {"vae": ["diffusers", "AutoencoderKLWan"], "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "PreTrainedTokenizerFast"]}[part]


def _local_folder(source: str) -> Path:
    """The local folder of a model repo (a Hub id: its snapshot, the parts only)."""
    if Path(source).is_dir():
        return Path(source)
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(source, allow_patterns=[f"{p}/*" for p in COPIED_PARTS] + ["model_index.json"]))


def _diffusers_version() -> str:
    import diffusers

    return diffusers.__version__


def _write_json(path: Path, data: dict) -> None:
    import os

    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "w") as handle:
        handle.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        handle.flush()
        os.fsync(handle.fileno())
    partial.replace(path)


def far_chunk_partition(config: Any, frames: int) -> list[int]:
    """The chunk layout (latent frames per chunk) of a FAR clip of `frames` latent frames: the model's
    `chunk_partition` where it sums to `frames` (the released 1 + 3 * 6 + 2 for 21 frames), else its
    layout carried to this length: a first chunk of 1 frame, then chunks of its largest size, the last
    one shorter where the frames run out."""
    partition = [int(n) for n in config.get("chunk_partition") or (1,)]
    if sum(partition) == frames:
        return partition
    size = max(partition)
    out = [1] if frames else []
    while sum(out) < frames:
        out.append(min(size, frames - sum(out)))
    return out


class DenseFARTrainingAttention:
    """The FAR self-attention of the training path (no KV cache) with its block mask made dense and run
    by `scaled_dot_product_attention`: the mask's own `mask_mod` evaluated on every (query, key) pair, so
    the same pairs attend as under FlexAttention, which has no backward on the CPU. The cache paths
    (sampling) go to diffusers' processor. Installed on the CPU only (`AnyFlowFARStudent.after_setup`)."""

    def __init__(self, flex_processor: Any):
        self.flex_processor = flex_processor

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Any = None,
                 attention_mask: Any = None, rotary_emb: Any = None, kv_cache: Any = None, kv_cache_flag: Any = None) -> torch.Tensor:
        if kv_cache is not None or attention_mask is None or not hasattr(attention_mask, "mask_mod"):
            return self.flex_processor(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb,
                                       kv_cache, kv_cache_flag)
        from diffusers.models.transformers.transformer_anyflow_far import apply_rotary_emb
        from torch.nn.attention.flex_attention import create_mask

        dtype = hidden_states.dtype
        heads = [attn.norm_q(attn.to_q(hidden_states)), attn.norm_k(attn.to_k(hidden_states)), attn.to_v(hidden_states)]
        query, key, value = (x.to(dtype).unflatten(2, (attn.heads, -1)).transpose(1, 2) for x in heads)
        if rotary_emb is not None:
            query, key = apply_rotary_emb(query, rotary_emb["query"]), apply_rotary_emb(key, rotary_emb["key"])
        length = query.shape[2]
        padded = attention_mask.seq_lengths
        mask = create_mask(attention_mask.mask_mod, None, None, padded[0], padded[1], device=query.device)
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[..., :length, :length])
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


@register_family
class AnyFlowFARStudent(AnyFlowStudent):
    """AnyFlow-FAR: the flow map with FAR's block-causal layout (chunks of latent frames, the oldest
    beyond `full_chunk_limit` seen through a compressed patch embedding) and its KV cache, as
    `AnyFlowFARPipeline` samples it chunk by chunk.

    The training forward is diffusers' causal training path (the whole clip in one call, its FAR block
    mask) over `far_chunk_partition`; it returns the velocity of every frame while the clip has at most
    `full_chunk_limit` chunks (longer clips are refused: diffusers' path returns the full-resolution
    chunks only). Its attention is FlexAttention, which has no backward on the CPU: a FAR student trains
    on a GPU."""

    family = "anyflow_far"
    transformer_classes = {"anyflow_far": AnyFlowFARTransformer3DModel}
    pipeline_class_names = ("AnyFlowFARPipeline",)
    pipeline_class_name = "AnyFlowFARPipeline"
    capabilities = Capabilities(per_frame_timesteps=True, causal_attention=True)

    @classmethod
    def lora_pipeline_class(cls, kind: str) -> type:
        from diffusers import AnyFlowFARPipeline

        return AnyFlowFARPipeline

    @classmethod
    def default_scheduler_config(cls) -> dict:
        return flow_map_scheduler_config(cls.default_flow_shift)

    def install_causal_attention(self, cfg: Any) -> None:
        """FAR's block-causal attention is the transformer's own (`models.student.causal` adds nothing)."""

    def after_setup(self) -> None:
        """On the CPU the training path's self-attention runs dense (`DenseFARTrainingAttention`)."""
        if next(self.transformer.parameters()).device.type != "cpu":
            return
        for block in self.modules[0].blocks:
            block.attn1.processor = DenseFARTrainingAttention(block.attn1.processor)

    def transformer_inputs(self, x_t: torch.Tensor, t: torch.Tensor, r: torch.Tensor, cond: Conditioning) -> dict:
        inputs = super().transformer_inputs(x_t, t, r, cond)
        config = self.modules[0].config
        partition = far_chunk_partition(config, x_t.shape[2])
        if len(partition) > int(config.full_chunk_limit):
            raise ValueError(
                f"an AnyFlow-FAR training forward over {len(partition)} chunks {partition}: diffusers' causal training "
                f"path returns the last full_chunk_limit ({config.full_chunk_limit}) chunks only; train on clips of at "
                f"most {config.full_chunk_limit} chunks"
            )
        return {**inputs, "chunk_partition": partition}

    def pipeline_call_inputs(self, vae: torch.nn.Module, num_frames: int) -> dict:
        """AnyFlowFARPipeline samples chunk by chunk over its KV cache: the chunk partition of the clip's
        latent frames (the flow map steps each chunk, `callback_on_step_end` sees each chunk's steps)."""
        from fv_accel.sampling import latent_frames

        temporal = int(vae.config.get("scale_factor_temporal") or 4)
        return {"chunk_partition": far_chunk_partition(self.modules[0].config, latent_frames(num_frames, temporal))}
