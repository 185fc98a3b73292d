"""The generic diffusers-transformer student: what every family shares.

A family (one file under fv_accel/models/) subclasses `DiffusersStudent` and adds what is its own:
`forward` (conventions, packing, extra inputs), its conditioning, encoders, latent statistics and
sample pipeline. This class loads the transformer (Hub id or local folder, safetensors only, or an
inline config), freezes or trains it, adds LoRA through peft, keeps LoRA checkpoints, writes the
final weights in diffusers' layouts, and builds the training table's shift from the recipe or the
repo's own scheduler config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional

import torch

from fv_accel.config import ConfigError, RunConfig, StudentConfig
from fv_accel.models.base import ModelBase
from fv_accel.models.loading import DTYPES, LOW_PRECISION, fetch_config, load_transformer
from fv_accel.schedulers import scheduler_shift

logger = logging.getLogger(__name__)


def build_family_transformer(
    family: type[ModelBase], cfg: StudentConfig, subfolder: Optional[str] = None
) -> tuple[torch.nn.Module, str]:
    """The transformer of `cfg` as one of `family`'s classes, and its kind (the recipe's model_class).

    Loaded from `cfg.init_from` (class read from its config.json) or built from the inline
    `transformer_config` (seeded by the caller)."""
    classes = family.transformer_classes
    class_to_kind = {cls.__name__: kind for kind, cls in classes.items()}
    if cfg.init_from is None:
        kind = inline_transformer_kind(classes, cfg)
        transformer = classes[kind](**inline_transformer_kwargs(classes[kind], cfg.transformer_config or {}))
        if cfg.torch_dtype != "float32":
            transformer = transformer.to(DTYPES[cfg.torch_dtype])
        return transformer, kind
    transformer = load_transformer(cfg, classes, class_to_kind, subfolder=subfolder)
    return transformer, class_to_kind[type(transformer).__name__]


def inline_transformer_kind(classes: dict[str, type], cfg: StudentConfig) -> str:
    """The kind (model_class) an inline `transformer_config` builds: `model_class`, else the class its
    `_class_name` names (a pasted config.json), else the family's first; a `_class_name` the family
    has no class for is a ConfigError of one line."""
    named = (cfg.transformer_config or {}).get("_class_name")
    by_name = {c.__name__: kind for kind, c in classes.items()}
    kind = cfg.model_class if cfg.model_class != "auto" else by_name.get(named, next(iter(classes)))
    if named is not None and classes[kind].__name__ != named:
        raise ConfigError(
            f"models.student.transformer_config._class_name: {named!r}, but models.student.model_class "
            f"{cfg.model_class!r} builds {classes[kind].__name__}: remove one of the two or make them agree"
        )
    return kind


def inline_transformer_kwargs(cls: type, config: dict) -> dict:
    """An inline `transformer_config` as keyword arguments of `cls`: keys starting with "_" (a
    pasted config.json's `_class_name`, `_diffusers_version`) are dropped, as diffusers' from_config
    does; any other key that `cls.__init__` does not take is a ConfigError naming it and the class."""
    import difflib
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in config.items() if not str(k).startswith("_")}
    known = sorted(name for name in params if name != "self")
    for key in config:
        if not str(key).startswith("_") and key not in params:
            close = difflib.get_close_matches(str(key), known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"models.student.transformer_config: unknown key {key!r} for {cls.__name__}{hint}; its keys: {', '.join(known)}"
            )
    return {k: v for k, v in config.items() if not str(k).startswith("_")}


def vsa_record(cfg: RunConfig) -> Optional[dict]:
    """How the run used video sparse attention (`training.vsa`, for exports and the model card); None when dense."""
    spec = cfg.training.vsa
    if not spec.enabled:
        return None
    return {"sparsity": spec.sparsity, "decay_rate": spec.decay_rate, "decay_interval_steps": spec.decay_interval_steps}


def init_weights_folder(st: StudentConfig, subfolder: Optional[str]) -> Path:
    """The local folder of `init_from`'s weights in `subfolder` (a Hub id: its snapshot in the
    Hugging Face cache, which loading the transformer has filled)."""
    local = Path(st.init_from)
    if local.exists():
        return local / (subfolder or "")
    from huggingface_hub import snapshot_download

    pattern = f"{subfolder}/*.safetensors" if subfolder else "*.safetensors"
    return Path(snapshot_download(st.init_from, revision=st.revision, allow_patterns=[pattern])) / (subfolder or "")


class DiffusersStudent(ModelBase):
    """A student made of one diffusers transformer (families with more override `build_transformers`)."""

    # Recipes for a family without its own scheduler config (an inline transformer_config) train
    # on this shift unless `models.student.flow_shift` says otherwise.
    default_flow_shift: float = 3.0
    # Whether the transformer takes an embedded guidance value (`models.student.guidance`); set by
    # `configure` where a family reads it from the model.
    takes_guidance: bool = False
    # Where `latent_statistics` reads a repo's statistics (named in messages).
    latent_statistics_source: str = "vae"

    def __init__(self, cfg: RunConfig, *, trainable: bool = True):
        super().__init__()
        self.run_config = cfg
        self.student_config = st = cfg.models.student
        self.expert: Optional[str] = None
        self.transformer, self.kind, self.modules = self.build_transformers(st)
        self._trainable = trainable
        config = self.modules[0].config
        self.in_channels = self.latent_channels(config)
        self.patch_size = self.patch_size_of(config)
        self.configure(config)
        where = st.init_from or "models.student.transformer_config"
        if st.expert is not None and self.expert is None:
            raise ValueError(
                f"models.student.expert is {st.expert!r} but model '{where}' ({self.family} family) has one "
                "transformer (experts are Wan 2.2 A14B's): remove the key"
            )
        if st.task == "i2v" and not self.capabilities.image_conditioning:
            raise ValueError(
                f"models.student.task is i2v but model '{where}' ({self.family} family) takes no image condition: "
                "set t2v or auto"
            )
        if st.train_audio and not self.has_audio:
            raise ValueError(
                f"models.student.train_audio is true but model '{where}' ({self.family} family) has no audio branch "
                "(only LTX-2 makes sound): remove the key"
            )
        if st.guidance is not None and not self.takes_guidance:
            raise ValueError(
                f"models.student.guidance: {st.guidance}: the {self.family} family's {type(self.modules[0]).__name__} "
                "has no guidance embedding (only guidance-distilled transformers, e.g. HunyuanVideo, take one); remove the key"
            )
        self.transformer.requires_grad_(trainable)
        self.causal_attention = None
        if st.causal:
            self.install_causal_attention(cfg)
        self._check_saved_attention()
        self.install_vsa(cfg)
        # LoRA (peft): base frozen, adapter trainable in fp32; PiSSA's initial adapter is kept to
        # export against the original base (fv_accel/models/lora.py).
        self.lora_enabled = bool(st.lora.enable and trainable)
        self.pissa_init_adapter: Optional[dict] = None
        if self.lora_enabled:
            from fv_accel.models.lora import apply_lora, with_default_targets

            if len(self.modules) > 1 and st.lora.init == "pissa":
                raise ValueError("models.student.lora.init: pissa is supported for one transformer only")
            lora = with_default_targets(st.lora, self.lora_target_modules)
            for module in self.modules:
                self.pissa_init_adapter = apply_lora(module, lora)
            self.train_vsa_gates()
        self.input_dtype = self.input_dtype_of(self.modules[0])
        self.after_setup()
        if cfg.training.model.enable_gradient_checkpointing_type == "full":
            self.transformer.enable_gradient_checkpointing()
        if cfg.training.model.compile == "blocks":
            self.compile_blocks()
        self._scheduler_config: Any = False  # read on first use

    # ---- video sparse attention (training.vsa) ----
    def install_vsa(self, cfg: RunConfig) -> None:
        """`training.vsa`: VSA on the video self-attention of every transformer, with its gates,
        before LoRA and the engine's wrapping (so the gates are in the state dict and train). The
        gates of `init_from` (ours, or FastWan's `blocks.N.to_gate_compress`) are loaded; a
        checkpoint without them leaves them at zero."""
        from fv_accel import vsa

        self.vsa_controllers: list = []
        spec = cfg.training.vsa
        if not spec.enabled:
            return
        start = vsa.ramp_sparsity(0, spec.sparsity, spec.decay_rate, spec.decay_interval_steps)
        for module in self.modules:
            try:
                vsa.vsa_family(module)
            except ValueError as err:
                raise ConfigError(
                    f"training.vsa.sparsity {spec.sparsity}: the {self.family} family cannot train with it ({err}); "
                    "set training.vsa.sparsity: 0"
                ) from None
            self.vsa_controllers.append(vsa.enable_vsa(module, start, spec.backend))
        self._load_init_gates()

    def weight_subfolders(self) -> list[Optional[str]]:
        """The subfolder of `init_from` each of `self.modules` was loaded from."""
        return [self.student_config.subfolder or None]

    def _load_init_gates(self) -> None:
        from fv_accel import vsa

        st = self.student_config
        if st.init_from is None:
            return
        for module, sub in zip(self.modules, self.weight_subfolders()):
            folder = init_weights_folder(st, sub)
            gates = vsa.read_gate_tensors(folder)
            if gates:
                count = vsa.load_vsa_gates(module, gates)
                logger.info("VSA: %d gate tensors loaded from %s", count, folder)
            else:
                logger.info("VSA: %s holds no gates (to_gate_compress); they start at zero", folder)

    def train_vsa_gates(self) -> None:
        """LoRA with VSA: the gates (new layers, not in the base) train fully beside the adapter, in fp32."""
        from fv_accel.vsa import is_gate_key

        for module in self.modules:
            for name, param in module.named_parameters():
                if is_gate_key(name):
                    param.data = param.data.float()
                    param.requires_grad_(True)

    # ---- memory and speed ----
    def store_base_in(self, storage_dtype: str, mixed_precision: str) -> None:
        """Keep the frozen base's weights in `storage_dtype` (diffusers' layerwise casting), cast
        to the compute dtype one layer at a time in the forward. Applied after LoRA: diffusers'
        default patterns then skip the adapter (peft's `lora_A`/`lora_B`, kept fp32), and with them
        the family's own (`_skip_layerwise_casting_patterns`: norms, embeddings, patch embedding)
        and `_keep_in_fp32_modules`. The compute dtype is the run's bf16/fp16 mixed precision,
        else the dtype the weights were loaded in."""
        compute = LOW_PRECISION.get(mixed_precision, DTYPES[self.student_config.torch_dtype])
        for module in self.modules:
            module.enable_layerwise_casting(storage_dtype=getattr(torch, storage_dtype), compute_dtype=compute)
        if not getattr(self.modules[0], "gradient_checkpointing", False):
            # Backward keeps each layer's compute-dtype copy of its weight from the forward: without
            # recomputation a step holds them all, and the peak saves little.
            logger.warning(
                "models.student.storage_dtype %s without training.model.enable_gradient_checkpointing_type: full "
                "keeps every layer's %s weight copy from the forward to the backward (peak memory barely drops)",
                storage_dtype,
                str(compute).replace("torch.", ""),
            )

    def compile_blocks(self) -> None:
        """`training.model.compile: blocks`: torch.compile each repeated transformer block
        (diffusers' `compile_repeated_blocks`), after LoRA and before the engine wraps the model."""
        for module in self.modules:
            if not getattr(module, "_repeated_blocks", None):
                raise ValueError(
                    f"training.model.compile: blocks: the {self.family} family's {type(module).__name__} lists no "
                    "repeated blocks (_repeated_blocks) to compile; set training.model.compile: none"
                )
            module.compile_repeated_blocks()

    # ---- hooks a family overrides ----
    def build_transformers(self, st: StudentConfig) -> tuple[torch.nn.Module, str, list[torch.nn.Module]]:
        """(the module trained, its kind, the diffusers transformers inside it)."""
        transformer, kind = build_family_transformer(type(self), st, st.subfolder or None)
        return transformer, kind, [transformer]

    def latent_channels(self, config: Any) -> int:
        """Latent channels of x_t (the data's C)."""
        return int(config.get("out_channels") or config.get("in_channels"))

    def patch_size_of(self, config: Any) -> tuple[int, int, int]:
        """(temporal, height, width) patch of the transformer's tokens."""
        patch = config.get("patch_size", 1)
        if isinstance(patch, (list, tuple)):
            if len(patch) == 3:
                return tuple(int(p) for p in patch)  # type: ignore[return-value]
            patch = patch[-1]
        return int(config.get("patch_size_t") or 1), int(patch), int(patch)

    def configure(self, config: Any) -> None:
        """Read the model's variant from its configs (before LoRA is added)."""

    def after_setup(self) -> None:
        """Last step of construction (after LoRA): install hooks on the transformer."""

    def input_dtype_of(self, module: torch.nn.Module) -> torch.dtype:
        """The dtype inputs are cast to: the one the weights were loaded in."""
        return DTYPES[self.student_config.torch_dtype]

    def install_causal_attention(self, cfg: RunConfig) -> None:
        raise ValueError(
            f"models.student.causal: the {self.family} family has no block-causal attention; remove the key "
            "(or use a family that has it: wan)"
        )

    # ---- the training table ----
    @property
    def scheduler_config(self) -> Optional[dict]:
        """The repo's scheduler/scheduler_config.json (None for an inline transformer config)."""
        if self._scheduler_config is False:
            st = self.student_config
            self._scheduler_config = None
            if st.init_from is not None:
                self._scheduler_config = fetch_config(
                    st.init_from, "scheduler", revision=st.revision, required=False, filename="scheduler_config.json"
                )
        return self._scheduler_config

    @classmethod
    def default_scheduler_config(cls) -> dict:
        """The scheduler config sample videos use when the model repo has none: Euler at the
        family's default shift."""
        return {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": cls.default_flow_shift}

    def tokens(self, latent_shape: torch.Size) -> int:
        pt, ph, pw = self.patch_size
        return (int(latent_shape[2]) // pt) * (int(latent_shape[3]) // ph) * (int(latent_shape[4]) // pw)

    def training_shift(self, latent_shape: torch.Size) -> float:
        """`models.student.flow_shift`, else the shift of the repo's scheduler config for this
        many tokens, else `default_flow_shift`."""
        st = self.student_config
        if st.flow_shift is not None:
            return float(st.flow_shift)
        if self.scheduler_config is None:
            return float(self.default_flow_shift)
        return scheduler_shift(self.scheduler_config, self.tokens(latent_shape))

    def describe_training_shift(self) -> Any:
        st = self.student_config
        if st.flow_shift is not None:
            return float(st.flow_shift)
        sc = self.scheduler_config
        if sc is None:
            return float(self.default_flow_shift)
        if sc.get("use_dynamic_shifting"):
            keys = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
            return {"dynamic": {k: sc.get(k) for k in keys}}
        return scheduler_shift(sc, 0)

    # ---- set-up ----
    def init_preprocessors(self, training_config: Any) -> None:
        """Latent statistics: the recipe's, else the repo's (`latent_statistics`)."""
        del training_config
        st = self.student_config
        mean, std = st.latents_mean, st.latents_std
        where = "models.student"
        if mean is None and st.init_from is not None:
            stats = type(self).latent_statistics(st.init_from, st.revision)
            if stats is not None:
                mean, std = stats
                where = f"{st.init_from}/{self.latent_statistics_source}"
        self.set_latent_statistics(mean, std, where)

    def attach_accelerator(self, accelerator: Any) -> None:
        super().attach_accelerator(accelerator)
        cp = self.run_config.training.model.context_parallel
        if cp.degree > 1:
            self.enable_context_parallel(accelerator, cp)
        if self.student_config.storage_dtype is not None and self.lora_enabled:
            from accelerate.utils import DistributedType

            if accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
                raise ValueError(
                    f"models.student.storage_dtype: {self.student_config.storage_dtype} works with one process or "
                    f"DDP, not {accelerator.distributed_type.value} (which gathers and casts the weights itself); remove the key"
                )
        if self.lora_enabled:
            from fv_accel.models.lora import register_adapter_checkpointing

            # Checkpoints of a LoRA run hold the adapter (+ Accelerate's optimizer/scheduler/RNG).
            register_adapter_checkpointing(
                accelerator,
                lambda: self.transformer,
                lambda: self.lora_files_state(accelerator),
                self.load_lora_files_state,
                pipeline_cls=self.lora_pipeline_class(self.kind),
                subfolder="" if self.role == "student" else self.role,
            )

    def enable_context_parallel(self, accelerator: Any, cp: Any) -> None:
        """Split the transformers' sequences across CP groups (fv_accel/models/context_parallel.py)."""
        from accelerate.utils import DistributedType

        from fv_accel.config import ConfigError
        from fv_accel.models.context_parallel import describe_layout, enable_context_parallel

        if not self.capabilities.context_parallel:
            raise ConfigError(
                f"training.model.context_parallel: ulysses {cp.ulysses} x ring {cp.ring}: the {self.family} family "
                f"({type(self.modules[0]).__name__}) does not run under context parallelism (wan does); remove the key"
            )
        kind = accelerator.distributed_type
        if kind == DistributedType.DEEPSPEED:
            raise ConfigError(
                f"training.model.context_parallel: ulysses {cp.ulysses} x ring {cp.ring} runs under DDP or FSDP2, "
                f"not DeepSpeed: launch with accelerate_configs/ddp.yaml or fsdp2.yaml"
            )
        if accelerator.num_processes < 2:
            raise ConfigError(
                f"training.model.context_parallel: ulysses {cp.ulysses} x ring {cp.ring} needs {cp.degree} "
                f"processes (a multiple of it), got 1: launch with accelerate launch --num_processes {cp.degree}"
            )
        enable_context_parallel(self.modules, cp, causal=self.causal_attention is not None)
        self.gradient_scale = float(cp.degree)
        if accelerator.is_main_process:
            logger.info("%s", describe_layout(cp.ulysses, cp.ring, accelerator.num_processes))

    def after_prepare(self) -> None:
        # The base is cast for storage once the engine has wrapped the model: DDP broadcasts every
        # parameter when it wraps, and gloo has no fp8.
        if self.student_config.storage_dtype is not None and self.lora_enabled:
            mixed = self.accelerator.mixed_precision if self.accelerator is not None else "no"
            self.store_base_in(self.student_config.storage_dtype, mixed)

    # ---- LoRA state (checkpoints and final files) ----
    def _unwrapped(self, accelerator: Any = None) -> torch.nn.Module:
        accelerator = accelerator or self.accelerator
        return accelerator.unwrap_model(self.transformer) if accelerator is not None else self.transformer

    def lora_files_state(self, accelerator: Any = None) -> tuple[dict, dict]:
        """The adapter as written to files (diffusers keys, fp32) and its metadata, against the
        original base. Collective under FSDP/DeepSpeed (gathers the sharded state dict)."""
        from accelerate.utils import DistributedType

        from fv_accel.models.lora import adapter_metadata, adapter_state_dict, deployable_lora

        full = None
        if accelerator is not None and accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED):
            full = accelerator.get_state_dict(self.transformer)
        module = self._unwrapped(accelerator)
        state = adapter_state_dict(module, full_state_dict=full)
        state, metadata = deployable_lora(state, adapter_metadata(module), self.pissa_init_adapter)
        return {**state, **self.gate_state(module, full)}, metadata

    def gate_state(self, module: torch.nn.Module, full_state_dict: Optional[dict] = None) -> dict[str, torch.Tensor]:
        """Under VSA, the trained gates of `module` (they train beside a LoRA adapter and are written
        in its file, `transformer.blocks.N.attn1.to_gate_compress.*`); nothing when dense."""
        from fv_accel.vsa import gate_state

        if not self.vsa_controllers:
            return {}
        return gate_state(full_state_dict if full_state_dict is not None else module.state_dict())

    def load_adapter_and_gates(self, module: torch.nn.Module, state: dict, metadata: Optional[dict]) -> None:
        """Restore a LoRA file's adapter (`trained_part_of_deployable`) and, under VSA, its gates."""
        from fv_accel.models.lora import set_adapter_state_dict, trained_part_of_deployable
        from fv_accel.vsa import load_vsa_gates, split_gates

        gates, adapter = split_gates(state)
        if gates and not self.vsa_controllers:
            raise ValueError(
                f"the checkpoint's LoRA file holds VSA gates ({next(iter(gates))}) but training.vsa.sparsity is 0: "
                "resume with the run's training.vsa settings"
            )
        set_adapter_state_dict(module, trained_part_of_deployable(adapter, metadata, self.student_config.lora))
        if self.vsa_controllers:
            load_vsa_gates(module, gates)

    def check_lora_file_rank(self, metadata: Optional[dict]) -> None:
        lora = self.student_config.lora
        # Files of a PiSSA run hold the adapter converted to rank 2r (see deployable_lora).
        expected_rank = 2 * lora.rank if lora.init == "pissa" else lora.rank
        if metadata is None or int(metadata.get("r", -1)) != expected_rank:
            raise ValueError(
                f"the checkpoint's LoRA has rank {None if metadata is None else metadata.get('r')} but "
                f"models.student.lora is rank {lora.rank}, init {lora.init} (expected {expected_rank} in the file)"
            )

    def load_lora_files_state(self, state: dict, metadata: Optional[dict]) -> None:
        """Restore the trained adapter (and VSA gates) from a file written by `lora_files_state` (resume)."""
        self.check_lora_file_rank(metadata)
        self.load_adapter_and_gates(self._unwrapped(), state, metadata)

    def lora_files(self, state: dict) -> dict[str, dict]:
        """File-name suffix -> the part of the adapter state written under it."""
        return {"": state}

    # ---- causal attention records ----
    def causal_spec(self) -> Any:
        return None if self.causal_attention is None else self.causal_attention.spec

    def _check_saved_attention(self) -> None:
        """Warn when the weights were saved causal and this recipe loads them otherwise."""
        from fv_accel.models.attention import SAVED_ATTENTION_KEY, saved_attention_mismatch

        saved = self.modules[0].config.get(SAVED_ATTENTION_KEY)
        where = self.student_config.init_from or "models.student.transformer_config"
        message = saved_attention_mismatch(saved, self.causal_spec(), where)
        if message:
            logger.warning(message)

    def base_model_info(self) -> dict:
        from fv_accel.models.attention import attention_record

        st = self.student_config
        return {
            "attention": attention_record(self.causal_spec()),
            "family": self.family,
            "init_from": st.init_from,
            "revision": st.revision,
            "subfolder": st.subfolder,
            "variant": st.variant,
            "torch_dtype": st.torch_dtype,
            "model_class": self.kind,
            "transformer_config": None if st.init_from is not None else st.transformer_config,
            "vsa": vsa_record(self.run_config),
        }

    # ---- outputs ----
    def save_final(self, accelerator: Any, output_dir: Any) -> None:
        """Write the trained weights: for a LoRA run `pytorch_lora_weights.safetensors` (diffusers,
        with adapter metadata), the ComfyUI-format file where the family has one and
        `base_model.json`; otherwise the transformer as a diffusers folder (`transformer_folders`).

        `get_state_dict` gathers sharded parameters (FSDP2, ZeRO-3) on every rank; only the main
        process writes, safetensors only.
        """
        from accelerate.utils import DistributedType

        if self.lora_enabled:
            from fv_accel.models.lora import save_lora_outputs

            state, metadata = self.lora_files_state(accelerator)
            if accelerator.is_main_process:
                for suffix, part in self.lora_files(state).items():
                    save_lora_outputs(
                        output_dir, part, metadata, family=type(self), kind=self.kind, base=self.base_model_info(),
                        suffix=suffix,
                    )
            accelerator.wait_for_everyone()
            return
        folders = self.transformer_folders(accelerator)
        if len(folders) > 1:  # unsharded by construction (several transformers run under DDP only)
            if accelerator.is_main_process:
                for sub, module in folders.items():
                    module.save_pretrained(Path(output_dir) / sub, safe_serialization=True)
            accelerator.wait_for_everyone()
            return
        ((sub, unwrapped),) = folders.items()
        out = Path(output_dir) / sub
        sharded = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        state_dict = accelerator.get_state_dict(self.transformer) if sharded else None
        if accelerator.is_main_process:
            if state_dict is not None:
                # Rebuild a plain module from the gathered full state dict, then save it. Built
                # empty and filled by assignment: no random init, no second copy of a large model.
                # The class comes from the kind, not type(): FSDP2 swaps in an FSDP<cls> subclass.
                from accelerate import init_empty_weights

                with init_empty_weights():
                    plain = self.transformer_classes[self.kind].from_config(unwrapped.config)
                    if self.vsa_controllers:  # the gates are part of the trained weights
                        from fv_accel.vsa import enable_vsa

                        enable_vsa(plain, self.vsa_controllers[0].sparsity, self.vsa_controllers[0].backend)
                plain.load_state_dict(state_dict, strict=True, assign=True)
                unwrapped = plain
            unwrapped.save_pretrained(out, safe_serialization=True)
            from fv_accel.models.attention import attention_record, mark_saved_attention

            mark_saved_attention(out / "config.json", attention_record(self.causal_spec()))
        accelerator.wait_for_everyone()

    def transformer_folders(self, accelerator: Any) -> dict[str, torch.nn.Module]:
        """Output subfolder -> the (unwrapped) transformer saved there."""
        return {"transformer": accelerator.unwrap_model(self.transformer)}
