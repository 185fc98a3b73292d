"""The diffusers video-transformer student: Wan 2.1/2.2 and SkyReels-V2 (same state-dict keys).

How per-frame timesteps reach the transformer (REFERENCE.md section 5):
- `WanTransformer3DModel` takes [B] or per token [B, F'*H'*W']; tokens are frame-major, so a
  per-frame [B, T] becomes per-token with `repeat_interleave(H' * W', dim=1)`.
- `SkyReelsV2Transformer3DModel` takes [B, T] with `enable_diffusion_forcing=True`.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel

from fv_accel.config import RunConfig, StudentConfig
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.models.loading import DTYPES, load_component_config, load_transformer
from fv_accel.schedulers import FlowMatchTable, GeneratorLike, randn

logger = logging.getLogger(__name__)

TRANSFORMER_CLASSES = {
    "wan": WanTransformer3DModel,
    "skyreels_v2": SkyReelsV2Transformer3DModel,
}
CLASS_NAME_TO_KIND = {cls.__name__: kind for kind, cls in TRANSFORMER_CLASSES.items()}


def build_transformer(cfg: StudentConfig) -> tuple[torch.nn.Module, str]:
    """Load from a Hub id / local folder, or build from the inline config (seeded by the caller)."""
    if cfg.init_from is None:
        kind = "wan" if cfg.model_class == "auto" else cfg.model_class
        transformer = TRANSFORMER_CLASSES[kind](**dict(cfg.transformer_config or {}))
        if cfg.torch_dtype != "float32":
            transformer = transformer.to(DTYPES[cfg.torch_dtype])
        return transformer, kind
    transformer = load_transformer(cfg, TRANSFORMER_CLASSES, CLASS_NAME_TO_KIND)
    return transformer, CLASS_NAME_TO_KIND[type(transformer).__name__]


MODULATED_BLOCK_PARTS = ("scale_shift_table", "norm1", "attn1", "norm2", "attn2", "norm3", "ffn")


class PerFrameTimeEmbedding:
    """Per-frame timesteps stay per frame inside a `WanTransformer3DModel`.

    Diffusers' Wan takes per-frame timesteps only per token. It then runs its time MLP (sinusoid ->
    linear -> SiLU -> linear -> 6x projection) on every token, tokens-per-frame times the same
    numbers (+11% of the training FLOPs of configs/bench_small.yaml's 4-block, width-512 model;
    about 1% at the 1.3B architecture), and every block adds its modulation table to a per-token
    [B, S, 6, D] fp32 copy of the frame's projection (at the 1.3B architecture with 21 latent
    frames of 480x832, 1.2 GB per block, read and written again by each of the 30 blocks).

    While `tokens_per_frame` is set (by `WanStudent.predict_noise`, whose per-token timesteps are
    per-frame ones repeated):
    - hooks on the condition embedder feed it one timestep per frame; its time embedding (used once,
      by the output norm) is repeated over the frame's tokens, its 6-way block projection is not;
    - each block, given a per-frame projection [B, T, 6, D], applies shift/scale/gate broadcast over
      the frame's tokens (a [B, T, H'W', D] view of its [B, S, D] activations) instead of per token.
    The values are those of diffusers' per-token path (tests/test_step_cost.py: outputs equal,
    gradients to fp32 summation order), with the module tree and state dict unchanged. A block
    called with per-token or per-sample modulation (a pipeline, SkyReels-V2) runs diffusers' own
    forward; a transformer whose blocks lack those parts gets the embedder part only.
    """

    def __init__(self, transformer: torch.nn.Module):
        self.tokens_per_frame: Optional[int] = None
        self._repeat: Optional[int] = None
        embedder = transformer.condition_embedder
        embedder.register_forward_pre_hook(self._to_frames, with_kwargs=True)
        embedder.register_forward_hook(self._to_tokens, with_kwargs=True)
        blocks = list(getattr(transformer, "blocks", []))
        self.modulate_per_frame = bool(blocks) and all(
            all(hasattr(block, part) for part in MODULATED_BLOCK_PARTS) for block in blocks
        )
        if self.modulate_per_frame:
            for block in blocks:
                block.forward = _PerFrameBlockForward(block, block.forward)

    def _to_frames(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        self._repeat = None
        k, seq_len = self.tokens_per_frame, kwargs.get("timestep_seq_len")
        if not k or not seq_len or seq_len % k or not args:
            return None
        frames = seq_len // k
        per_frame = args[0].reshape(-1, frames, k)[:, :, 0].reshape(-1)  # [B * S] -> [B * T]
        self._repeat = k
        return (per_frame, *args[1:]), {**kwargs, "timestep_seq_len": frames}

    def _to_tokens(self, module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        k, self._repeat = self._repeat, None
        if not k:
            return None
        temb, timestep_proj, *rest = output  # [B, T, D], [B, T, 6D]; tokens are frame-major
        if not self.modulate_per_frame:
            timestep_proj = timestep_proj.repeat_interleave(k, dim=1)
        return (temb.repeat_interleave(k, dim=1), timestep_proj, *rest)


class _PerFrameBlockForward:
    """A Wan block's forward that takes its modulation per frame ([B, T, 6, D]) as well as diffusers'
    per-token ([B, S, 6, D]) and per-sample ([B, 6, D]) forms; the last two go to the original."""

    def __init__(self, block: torch.nn.Module, original: Any):
        self.block = block
        self.original = original

    def __call__(self, hidden_states, encoder_hidden_states, temb, rotary_emb):
        if temb.ndim != 4 or temb.shape[1] == hidden_states.shape[1]:
            return self.original(hidden_states, encoder_hidden_states, temb, rotary_emb)
        block = self.block
        b, s, d = hidden_states.shape
        frames = temb.shape[1]
        if s % frames:
            raise ValueError(f"{s} tokens do not split into {frames} frames of equal size")

        def framed(x: torch.Tensor) -> torch.Tensor:  # [B, S, D] -> [B, T, H'W', D]
            return x.reshape(b, frames, s // frames, d)

        def tokens(x: torch.Tensor) -> torch.Tensor:
            return x.reshape(b, s, d)

        # [B, T, 6, D] + [1, 1, 6, D] -> six [B, T, 1, D], broadcast over each frame's tokens.
        mod = (block.scale_shift_table.unsqueeze(0) + temb.float()).unsqueeze(2)
        shift_msa, scale_msa, gate_msa, c_shift_msa, c_scale_msa, c_gate_msa = mod.unbind(3)
        x = hidden_states
        norm = tokens(framed(block.norm1(x.float())) * (1 + scale_msa) + shift_msa).type_as(x)
        attn = block.attn1(norm, None, None, rotary_emb)
        x = tokens(framed(x.float()) + framed(attn) * gate_msa).type_as(x)
        norm = block.norm2(x.float()).type_as(x)
        x = x + block.attn2(norm, encoder_hidden_states, None, None)
        norm = tokens(framed(block.norm3(x.float())) * (1 + c_scale_msa) + c_shift_msa).type_as(x)
        ff = block.ffn(norm)
        return tokens(framed(x.float()) + framed(ff.float()) * c_gate_msa).type_as(x)


class WanStudent(ModelBase):
    """A trainable Wan-family transformer (WanTransformer3DModel or SkyReelsV2Transformer3DModel)."""

    def __init__(self, cfg: RunConfig, *, trainable: bool = True):
        super().__init__()
        self.run_config = cfg
        self.student_config = cfg.models.student
        self.transformer, self.kind = build_transformer(self.student_config)
        self._trainable = trainable
        self.supports_per_frame_timesteps = self.kind in ("wan", "skyreels_v2")
        self.patch_size = tuple(self.transformer.config.patch_size)
        self.in_channels = int(self.transformer.config.in_channels)
        self.transformer.requires_grad_(trainable)
        # Block-causal self-attention (fv_accel/models/attention.py), block size = method.chunk_size.
        self.supports_causal_attention = True
        self.causal_attention = None
        if self.student_config.causal:
            from fv_accel.config import parse_chunk_size
            from fv_accel.models.attention import CausalSpec, install_causal_attention

            self.causal_block_size = parse_chunk_size(cfg.method.chunk_size)
            spec = CausalSpec(
                self.causal_block_size, self.student_config.local_attn_size, self.student_config.sink_size
            )
            self.causal_attention = install_causal_attention(
                self.transformer, spec, self.student_config.causal_attention_backend
            )
        self._check_saved_attention()
        # LoRA (peft): base frozen, adapter trainable in fp32; PiSSA's initial adapter is kept to
        # export against the original base (fv_accel/models/lora.py).
        self.lora_enabled = bool(self.student_config.lora.enable and trainable)
        self.pissa_init_adapter: Optional[dict] = None
        if self.lora_enabled:
            from fv_accel.models.lora import apply_lora

            self.pissa_init_adapter = apply_lora(self.transformer, self.student_config.lora)
        self.input_dtype = self.transformer.patch_embedding.weight.dtype
        self.per_frame_time_embedding = (
            PerFrameTimeEmbedding(self.transformer) if self.kind == "wan" else None
        )
        if cfg.training.model.enable_gradient_checkpointing_type == "full":
            self.transformer.enable_gradient_checkpointing()
        self.latents_mean: Optional[torch.Tensor] = None
        self.latents_std: Optional[torch.Tensor] = None

    # ---- set-up ----
    def init_preprocessors(self, training_config: Any) -> None:
        self.table = FlowMatchTable(self.student_config.flow_shift)
        self.training_model_config = training_config.model
        mean, std = self.student_config.latents_mean, self.student_config.latents_std
        if mean is None and self.student_config.init_from is not None:
            vae_config = load_component_config(self.student_config, "vae")
            if vae_config is not None and vae_config.get("latents_mean") is not None:
                mean, std = vae_config["latents_mean"], vae_config["latents_std"]
        if mean is not None:
            if len(mean) != self.in_channels or len(std) != self.in_channels:
                raise ValueError(
                    f"models.student.latents_mean/latents_std: {len(mean)}/{len(std)} values for a "
                    f"transformer with {self.in_channels} latent channels"
                )
            self.latents_mean = torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1, 1)
            self.latents_std = torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1, 1)

    @property
    def device(self) -> torch.device:
        return next(self.transformer.parameters()).device

    def normalize_latents(self, latents: torch.Tensor) -> torch.Tensor:
        if self.latents_mean is None:
            return latents
        return (latents - self.latents_mean.to(latents.device)) / self.latents_std.to(latents.device)

    # ---- per step ----
    def prepare_batch(
        self, batch: dict, *, generator: GeneratorLike, latents_source: str = "data"
    ) -> TrainingBatch:
        """Normalise latents, draw noise then homogeneous timesteps, noise the latents.

        Draw order on the generator: noise [B, C, T, H, W], then u [B] (REFERENCE.md section 2).
        """
        if latents_source != "data":
            raise ValueError(f"latents_source={latents_source!r}: only 'data' is supported")
        if self.table is None:
            raise RuntimeError("init_preprocessors() must run before prepare_batch()")
        device = self.accelerator.device if self.accelerator is not None else self.device
        latents = batch["vae_latent"].to(device=device, dtype=torch.float32)
        if latents.ndim != 5:
            raise ValueError(f"batch['vae_latent'] must be [B, C, T, H, W], got {tuple(latents.shape)}")
        if latents.shape[1] != self.in_channels:
            raise ValueError(
                f"latents have {latents.shape[1]} channels but the transformer expects {self.in_channels}"
            )
        latents = self.normalize_latents(latents)
        bsz = latents.shape[0]
        noise = randn(latents.shape, generator, device)
        tm = self.training_model_config
        idx = self.table.sample_homogeneous_indices(
            bsz,
            generator,
            device,
            weighting_scheme=tm.weighting_scheme,
            logit_mean=tm.logit_mean,
            logit_std=tm.logit_std,
            mode_scale=tm.mode_scale,
        )
        sigmas = self.table.sigmas_at(idx)
        text = batch["text_embedding"].to(device=device, dtype=torch.float32)
        mask = batch.get("text_attention_mask")
        return TrainingBatch(
            latents=latents,
            noise=noise,
            noisy_model_input=self.table.add_noise(latents, noise, sigmas),
            timestep_indices=idx,
            sigmas=sigmas,
            timesteps=self.table.timesteps_at(idx),
            encoder_hidden_states=text,
            encoder_attention_mask=None if mask is None else mask.to(device),
        )

    def timestep_input(self, timesteps: torch.Tensor, latent_shape: torch.Size) -> tuple[torch.Tensor, dict]:
        """The timestep tensor and extra kwargs the transformer needs for [B] or per-frame [B, T]."""
        if timesteps.ndim == 1:
            return timesteps, {}
        if timesteps.ndim != 2 or timesteps.shape[1] != latent_shape[2]:
            raise ValueError(
                f"per-frame timesteps must be [B, T={latent_shape[2]}], got {tuple(timesteps.shape)}"
            )
        if self.kind == "skyreels_v2":
            return timesteps, {"enable_diffusion_forcing": True}
        if self.kind == "wan":
            p_t, p_h, p_w = self.patch_size
            if p_t != 1:
                raise ValueError("per-frame timesteps need a temporal patch size of 1")
            tokens_per_frame = (latent_shape[3] // p_h) * (latent_shape[4] // p_w)
            return timesteps.repeat_interleave(tokens_per_frame, dim=1), {}
        raise ValueError(f"{self.kind} transformer cannot take per-frame timesteps")

    def predict_noise(
        self,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
        attn_kind: str = "dense",
    ) -> torch.Tensor:
        """The transformer's output for x_t, read as a flow velocity; [B, C, T, H, W]."""
        del attn_kind  # attention kind is fixed by the installed attention processor
        text = training_batch.encoder_hidden_states
        if not conditional:
            text = torch.zeros_like(text)
        t, extra = self.timestep_input(timesteps, noisy_latents.shape)
        # The patch embedding's dtype, not the first parameter's: diffusers keeps some tables in fp32.
        dtype = self.input_dtype
        per_frame = self.per_frame_time_embedding if timesteps.ndim == 2 and t.ndim == 2 else None
        if per_frame is not None:
            per_frame.tokens_per_frame = t.shape[1] // timesteps.shape[1]
        try:
            out = self.transformer(
                hidden_states=noisy_latents.to(dtype),
                timestep=t,
                encoder_hidden_states=text.to(dtype),
                return_dict=False,
                **extra,
            )[0]
        finally:
            if per_frame is not None:
                per_frame.tokens_per_frame = None
        return out

    # ---- LoRA state (checkpoints and final files) ----
    def attach_accelerator(self, accelerator: Any) -> None:
        super().attach_accelerator(accelerator)
        if self.lora_enabled:
            from fv_accel.models.lora import register_adapter_checkpointing

            # Checkpoints of a LoRA run hold the adapter (+ Accelerate's optimizer/scheduler/RNG).
            register_adapter_checkpointing(
                accelerator,
                lambda: self.transformer,
                lambda: self.lora_files_state(accelerator),
                self.load_lora_files_state,
                kind=self.kind,
            )

    def lora_files_state(self, accelerator: Any = None) -> tuple[dict, dict]:
        """The adapter as written to files (diffusers keys, fp32) and its metadata, against the
        original base. Collective under FSDP/DeepSpeed (gathers the sharded state dict)."""
        from accelerate.utils import DistributedType

        from fv_accel.models.lora import adapter_metadata, adapter_state_dict, deployable_lora

        full = None
        module = self.transformer
        if accelerator is not None:
            if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
                full = accelerator.get_state_dict(self.transformer)
            module = accelerator.unwrap_model(self.transformer)
        state = adapter_state_dict(module, full_state_dict=full)
        return deployable_lora(state, adapter_metadata(module), self.pissa_init_adapter)

    def load_lora_files_state(self, state: dict, metadata: Optional[dict]) -> None:
        """Restore the trained adapter from a file written by `lora_files_state` (resume)."""
        from fv_accel.models.lora import set_adapter_state_dict, trained_part_of_deployable

        module = self.accelerator.unwrap_model(self.transformer) if self.accelerator is not None else self.transformer
        lora = self.student_config.lora
        # Files of a PiSSA run hold the adapter converted to rank 2r (see deployable_lora).
        expected_rank = 2 * lora.rank if lora.init == "pissa" else lora.rank
        if metadata is None or int(metadata.get("r", -1)) != expected_rank:
            raise ValueError(
                f"the checkpoint's LoRA has rank {None if metadata is None else metadata.get('r')} but "
                f"models.student.lora is rank {lora.rank}, init {lora.init} (expected {expected_rank} in the file)"
            )
        set_adapter_state_dict(module, trained_part_of_deployable(state, metadata, lora))

    def causal_spec(self) -> Any:
        return None if self.causal_attention is None else self.causal_attention.spec

    def _check_saved_attention(self) -> None:
        """Warn when the weights were saved causal and this recipe loads them otherwise."""
        from fv_accel.models.attention import SAVED_ATTENTION_KEY, saved_attention_mismatch

        saved = self.transformer.config.get(SAVED_ATTENTION_KEY)
        where = self.student_config.init_from or "models.student.transformer_config"
        message = saved_attention_mismatch(saved, self.causal_spec(), where)
        if message:
            logger.warning(message)

    def base_model_info(self) -> dict:
        from fv_accel.models.attention import attention_record

        st = self.student_config
        return {
            "attention": attention_record(self.causal_spec()),
            "init_from": st.init_from,
            "revision": st.revision,
            "subfolder": st.subfolder,
            "variant": st.variant,
            "torch_dtype": st.torch_dtype,
            "model_class": self.kind,
            "transformer_config": None if st.init_from is not None else st.transformer_config,
        }

    def predict_noise_teacher_forcing(
        self,
        context_latents: torch.Tensor,
        context_timesteps: torch.Tensor,
        noisy_latents: torch.Tensor,
        timesteps: torch.Tensor,
        training_batch: TrainingBatch,
        *,
        conditional: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One forward over [context | noisy] frames (teacher forcing); returns both halves' outputs.

        Needs block-causal attention: noisy block b sees itself and the context copies of blocks < b.
        """
        if self.causal_attention is None:
            raise ValueError("teacher forcing needs block-causal attention: set models.student.causal: true")
        num_frames = noisy_latents.shape[2]
        with self.causal_attention.teacher_forcing():
            out = self.predict_noise(
                torch.cat([context_latents, noisy_latents], dim=2),
                torch.cat([context_timesteps, timesteps], dim=1),
                training_batch,
                conditional=conditional,
            )
        return out[:, :, :num_frames], out[:, :, num_frames:]

    # ---- outputs ----
    def save_final(self, accelerator: Any, output_dir: Any) -> None:
        """Write the trained weights: for a LoRA run `pytorch_lora_weights.safetensors` (diffusers,
        with adapter metadata), the ComfyUI-format file and `base_model.json`; otherwise the
        transformer as a diffusers folder (`<output_dir>/transformer`).

        `get_state_dict` gathers sharded parameters (FSDP2, ZeRO-3) on every rank; only the main
        process writes, safetensors only.
        """
        from pathlib import Path

        from accelerate.utils import DistributedType

        if self.lora_enabled:
            from fv_accel.models.lora import save_lora_outputs

            state, metadata = self.lora_files_state(accelerator)
            if accelerator.is_main_process:
                save_lora_outputs(output_dir, state, metadata, kind=self.kind, base=self.base_model_info())
            accelerator.wait_for_everyone()
            return
        out = Path(output_dir) / "transformer"
        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        state_dict = accelerator.get_state_dict(self.transformer) if sharded else None
        if accelerator.is_main_process:
            unwrapped = accelerator.unwrap_model(self.transformer)
            if state_dict is not None:
                # Rebuild a plain module from the gathered full state dict, then save it. Built
                # empty and filled by assignment: no random init, no second copy of a large model.
                # The class comes from the kind, not type(): FSDP2 swaps in an FSDP<cls> subclass.
                from accelerate import init_empty_weights

                with init_empty_weights():
                    plain = TRANSFORMER_CLASSES[self.kind].from_config(unwrapped.config)
                plain.load_state_dict(state_dict, strict=True, assign=True)
                unwrapped = plain
            unwrapped.save_pretrained(out, safe_serialization=True)
            from fv_accel.models.attention import attention_record, mark_saved_attention

            mark_saved_attention(out / "config.json", attention_record(self.causal_spec()))
        accelerator.wait_for_everyone()
