"""Build a run from a recipe: Accelerator, student, method, loader, resume. Used by the entry
scripts and usable from Python or a notebook:

    from fv_accel import build_from_config, Trainer
    run = build_from_config("configs/tiny_dfsft.yaml", {"method.chunk_size": 1, "training.loop.max_train_steps": 200})
    method, dataloader, start_step = run
    Trainer(run).run()
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Union

import torch

from fv_accel.config import DISTILLATION_METHODS, REWARD_METHODS, ConfigError, RunConfig, load_config, micro_batches_per_step

logger = logging.getLogger(__name__)


@dataclass
class BuiltRun:
    method: Any
    dataloader: Any
    start_step: int
    accelerator: Any
    config: RunConfig
    callbacks: list
    # The resumed trainer's counters (skipped steps), from the checkpoint's metadata.json.
    trainer_state: dict = field(default_factory=dict)
    # The output folder's lock (fv_accel.output_dir), held by the main process until the run ends.
    output_lock: Any = None

    def __iter__(self) -> Iterator[Any]:
        # `method, dataloader, start_step = build_from_config(...)`
        return iter((self.method, self.dataloader, self.start_step))


def build_accelerator(cfg: RunConfig):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    out = Path(cfg.training.checkpoint.output_dir)
    mp = cfg.training.loop.mixed_precision
    if mp == "auto":
        # fp32 on a machine without an accelerator (a launch config's bf16 is meant for GPUs);
        # elsewhere the launch config's choice, or else bf16 on CUDA.
        if no_device_backend():
            mp = "no"
        else:
            mp = None if os.environ.get("ACCELERATE_MIXED_PRECISION") else ("bf16" if torch.cuda.is_available() else "no")
    trackers = [t for t in cfg.training.tracker.trackers if t != "none"]
    from fv_accel.trainer import stop_signals_blocked_in_new_threads

    check_engine_takes_method(cfg, requested_engine())
    cpu, group_kwargs = cpu_process_group(requested_engine())
    with stop_signals_blocked_in_new_threads():  # the process group's threads never take SIGTERM
        acc = Accelerator(
            gradient_accumulation_steps=micro_batches_per_step(cfg),
            mixed_precision=mp,
            cpu=cpu,
            log_with=trackers or None,
            project_config=ProjectConfiguration(project_dir=str(out), logging_dir=str(out / "logs")),
            # The LR schedule counts optimizer steps, whatever the number of processes.
            step_scheduler_with_optimizer=False,
            kwargs_handlers=ddp_kwargs(cfg) + group_kwargs,
        )
    fsdp2_on_cpu(acc)
    check_engine_matches_launch(acc)
    check_gradient_accumulation(acc, cfg)
    return acc


def env_flag(name: str, env: Optional[Mapping[str, str]] = None) -> bool:
    return (os.environ if env is None else env).get(name, "false").strip().lower() in ("1", "true", "yes")


def requested_engine(env: Optional[Mapping[str, str]] = None) -> str:
    """The engine the launch asked for: DEEPSPEED, FSDP, DDP or NO (one process). `accelerate
    launch` exports ACCELERATE_USE_DEEPSPEED / ACCELERATE_USE_FSDP from the config's
    distributed_type, and its launcher (torchrun) WORLD_SIZE (`env`: these variables; default the
    process's own)."""
    env = os.environ if env is None else env
    if env_flag("ACCELERATE_USE_DEEPSPEED", env):
        return "DEEPSPEED"
    if env_flag("ACCELERATE_USE_FSDP", env):
        return "FSDP"
    return "DDP" if int(env.get("WORLD_SIZE", "1") or 1) > 1 else "NO"


def engine_that_runs(acc) -> str:
    """The engine an Accelerator runs, in `requested_engine`'s words (another type by its name)."""
    from accelerate.utils import DistributedType

    ran = acc.distributed_type
    if ran in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        return ran.value
    if ran == DistributedType.NO or acc.num_processes == 1:
        return "NO"
    return "DDP" if ran.value.startswith("MULTI_") else ran.value


def no_device_backend() -> bool:
    """No accelerator with a distributed backend of its own (a CPU machine): Accelerate then
    chooses no process-group backend unless told (`accelerate.state.PartialState._prepare_backend`)."""
    from accelerate.utils.imports import get_distributed_backend, get_torch_accelerator_backend

    device_type, _ = get_torch_accelerator_backend()
    return device_type is None or get_distributed_backend(device_type) is None


def cpu_process_group(engine: str) -> tuple[bool, list]:
    """`(cpu, kwargs_handlers)` for the Accelerator of a launched process (LOCAL_RANK set) on a
    machine without an accelerator: the processes connect over gloo (Accelerate sets no backend
    there, and each process would run alone). DeepSpeed must not be given `cpu` (Accelerate then
    runs DDP instead); it gets gloo and runs on DeepSpeed's CPU accelerator. The other engines run
    as Accelerate's MULTI_CPU (DDP over gloo), FSDP switched over by `fsdp2_on_cpu`."""
    if int(os.environ.get("LOCAL_RANK", "-1")) == -1 or not no_device_backend():
        return False, []
    from accelerate.utils import InitProcessGroupKwargs

    if engine == "DEEPSPEED":
        skip_deepspeed_shm_comm()
    return engine != "DEEPSPEED", [InitProcessGroupKwargs(backend="gloo")]


def skip_deepspeed_shm_comm() -> None:
    """DeepSpeed's CPU accelerator compiles a shared-memory extension (deepspeed_shm_comm: minutes
    of C++, g++ and ninja needed) when its communication backend starts, for its inference
    all-reduce only; training's collectives go through torch.distributed (gloo) either way.
    Marking it incompatible in `deepspeed.ops.__compatible_ops__` (a dict DeepSpeed keeps, edits
    included, for the process) skips that build."""
    try:
        import deepspeed.ops
    except ImportError:
        return  # Accelerate says that DeepSpeed is missing
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def fsdp2_on_cpu(acc) -> None:
    """An FSDP launch on CPU: Accelerate builds MULTI_CPU (DDP) and leaves the FSDP plugin of the
    launch environment unused. Switch the run to FSDP with that plugin, so that Accelerate's own
    FSDP2 path (torch `fully_shard`, sharded checkpoints with torch.distributed.checkpoint) runs
    over gloo. (FSDP1 is refused by `configure_engine`.)"""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    if acc.distributed_type != DistributedType.MULTI_CPU or requested_engine() != "FSDP":
        return
    plugin = FullyShardedDataParallelPlugin()  # reads the FSDP_* settings `accelerate launch` exports
    if acc.mixed_precision != "no":
        plugin.set_mixed_precision(acc.mixed_precision)  # as AcceleratorState does for FSDP
    # AcceleratorState re-reads PartialState's shared dict on every instantiation: switch both.
    PartialState().distributed_type = DistributedType.FSDP
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin


ENGINE_NAMES = {"DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "DDP": "DDP", "NO": "a single process"}
CONFIG_NAMES = {"DEEPSPEED": "DEEPSPEED", "FSDP": "FSDP", "DDP": "MULTI_GPU/MULTI_CPU", "NO": "NO"}


def check_engine_matches_launch(acc) -> None:
    """A launch runs the engine its config names, or nothing: under ACCELERATE_USE_CPU=1
    Accelerate trains DDP whatever a DeepSpeed config says, and processes that did not connect
    would each train a model of their own."""
    asked, runs = requested_engine(), engine_that_runs(acc)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if (asked == runs or {asked, runs} <= {"DDP", "NO"}) and world == acc.num_processes:
        return
    if asked == "DEEPSPEED" and env_flag("ACCELERATE_USE_CPU"):
        why = "ACCELERATE_USE_CPU=1 makes Accelerate skip DeepSpeed; unset it (DeepSpeed runs on CPU over gloo without it)"
    elif world != acc.num_processes:
        why = f"{world} processes were launched (WORLD_SIZE) but this one sees {acc.num_processes}: they did not connect"
    else:
        why = f"Accelerate chose distributed_type {acc.distributed_type.value} on this machine"
    raise ValueError(
        f"the launch configuration names {ENGINE_NAMES[asked]} (distributed_type {CONFIG_NAMES[asked]}) but "
        f"{ENGINE_NAMES.get(runs, runs)} ({acc.distributed_type.value}) would run with {acc.num_processes} process(es): {why}"
    )


def ddp_kwargs(cfg: RunConfig) -> list:
    """Both Wan 2.2 experts in one run: a step may use only one of them, which DDP must be told."""
    if cfg.models.student.expert != "both":
        return []
    from accelerate.utils import DistributedDataParallelKwargs

    return [DistributedDataParallelKwargs(find_unused_parameters=True)]


def check_engine_takes_method(cfg: RunConfig, engine: str) -> None:
    """Reward training moves its old policy toward the student's weights between optimizer steps,
    which DeepSpeed's engine (its optimizer, partitioned parameters and step inside backward) does
    not expose: refused in one line before anything is built."""
    if engine == "DEEPSPEED" and cfg.method.name in REWARD_METHODS:
        raise ConfigError(
            f"method.name {cfg.method.name}: not under DeepSpeed (the old policy follows the student's weights "
            "between optimizer steps, which DeepSpeed's engine keeps to itself): launch with "
            "accelerate_configs/ddp.yaml or fsdp2.yaml"
        )


def check_gradient_accumulation(acc, cfg: RunConfig) -> None:
    """The recipe's accumulation is the one truth: the loader cuts each step into
    `batch * processes * accumulation` samples, so an engine counting differently would desync.
    (`accelerate launch --gradient_accumulation_steps` or a DeepSpeed config value overrides the
    Accelerator's through ACCELERATE_GRADIENT_ACCUMULATION_STEPS.)"""
    k = micro_batches_per_step(cfg)
    if acc.gradient_accumulation_steps != k:
        recipe = (f"training.loop.gradient_accumulation_steps is {k}" if cfg.method.name not in REWARD_METHODS else
                  f"method.name {cfg.method.name}: an optimizer step accumulates {k} micro-batches "
                  "(training.loop.gradient_accumulation_steps x the trained timesteps)")
        raise ValueError(
            f"{recipe} but the launch configuration sets "
            f"{acc.gradient_accumulation_steps} (ACCELERATE_GRADIENT_ACCUMULATION_STEPS / "
            f"deepspeed_config.gradient_accumulation_steps / --gradient_accumulation_steps): remove it "
            f"there (or set it to auto); the recipe decides"
        )


# DeepSpeed config keys the recipe decides, with the recipe key each one comes from.
DEEPSPEED_RECIPE_KEYS = {
    "train_micro_batch_size_per_gpu": "training.data.train_batch_size",
    "gradient_accumulation_steps": "training.loop.gradient_accumulation_steps",
    "gradient_clipping": "callbacks.grad_clip.max_grad_norm",
}


def configure_deepspeed(ds_config: dict, cfg: RunConfig) -> dict:
    """Fill the DeepSpeed config (in place) from the recipe before `prepare`.

    DeepSpeed clips and accumulates inside its engine (`accelerator.backward` runs `engine.step`),
    so the recipe's values must reach its config; the micro-batch size must too, because our loader
    is not a DataLoader that Accelerate could read it from. A value the DeepSpeed config already
    sets differently is an error naming both places, not a silent override.
    """
    wanted = {
        "train_micro_batch_size_per_gpu": cfg.training.data.train_batch_size,
        "gradient_accumulation_steps": cfg.training.loop.gradient_accumulation_steps,
        "gradient_clipping": float(cfg.callbacks.grad_clip.max_grad_norm),
    }
    for key, value in wanted.items():
        current = ds_config.get(key, "auto")
        if current in ("auto", None):
            ds_config[key] = value
        elif float(current) != float(value):
            raise ValueError(
                f"the DeepSpeed config sets {key}={current!r} but the recipe's {DEEPSPEED_RECIPE_KEYS[key]} "
                f"is {value!r}: set it to auto (or remove it) in the DeepSpeed config; the recipe decides"
            )
    for section, recipe_key in (("optimizer", "training.optimizer"), ("scheduler", "training.optimizer.lr_scheduler")):
        if section in ds_config:
            raise ValueError(
                f"the DeepSpeed config has an '{section}' section, but the optimizer and LR schedule come "
                f"from the recipe ({recipe_key}) and are handed to DeepSpeed by Accelerate: remove it"
            )
    zero = ds_config.setdefault("zero_optimization", {})
    if int(zero.get("stage", 0)) == 3 and cfg.training.checkpoint.save_final:
        if zero.get("stage3_gather_16bit_weights_on_model_save") is not True:
            # Without it ZeRO-3 cannot hand over a full state dict for the final diffusers folder.
            zero["stage3_gather_16bit_weights_on_model_save"] = True
            logger.info("ZeRO-3: gathering 16-bit weights for the final save (stage3_gather_16bit_weights_on_model_save)")
    return ds_config


def output_of_its_own(module: torch.nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook for the FSDP2 root: each view tensor of its output replaced by a copy, while
    gradients are recorded. FSDP2 hooks the root's output tensors to start its backward; diffusers'
    transformers return the unpatchified latents as a reshaped view, on which an in-place op would
    drop that hook (FSDP2 warns of wrong gradients). The copy is the size of the latents."""
    if not torch.is_grad_enabled():
        return None

    def own(value: Any) -> Any:
        return value.clone() if isinstance(value, torch.Tensor) and value._base is not None else value

    if isinstance(output, torch.Tensor):
        return own(output)
    if isinstance(output, tuple):
        return tuple(own(value) for value in output)
    return None


def fit_fsdp2_wrap_classes(plugin, model) -> None:
    """Each role is sharded block by block over its own blocks: Accelerate keeps the block class names
    it found in the first model it prepared on the plugin, which a role of another family (the Wan
    teacher and critic of an AnyFlow student) does not have; such a role gets its own
    `_no_split_modules` instead (names configured in the launch config stay where the model has them)."""
    present = {type(module).__name__ for module in model.modules()}
    names = plugin.transformer_cls_names_to_wrap
    if names and all(name in present for name in names):
        return
    own = [name for name in getattr(model, "_no_split_modules", None) or [] if name in present]
    if names and own:
        plugin.transformer_cls_names_to_wrap = own


def configure_fsdp2(plugin, mixed_precision: str, student) -> None:
    """FSDP2 settings that follow from the run: low-precision compute with fp32 gradient
    reduction, and one activation-checkpointing mechanism, not two."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fv_accel.models.loading import LOW_PRECISION

    low = LOW_PRECISION.get(mixed_precision)
    policy = plugin.mixed_precision_policy
    if low is not None and (policy is None or getattr(policy, "reduce_dtype", None) in (None, low)):
        # Accelerate's default reduces gradients in bf16 too; sums over many ranks want fp32. And
        # it casts every float input to bf16, the timesteps too (t = 999.2 becomes 1000): the
        # student casts latents and text itself instead and the timesteps stay fp32, as under DDP.
        plugin.mixed_precision_policy = MixedPrecisionPolicy(
            param_dtype=low, reduce_dtype=torch.float32, cast_forward_inputs=False
        )
    policy = plugin.mixed_precision_policy
    if policy is not None and policy.param_dtype is not None and not policy.cast_forward_inputs:
        student.input_dtype = policy.param_dtype
    model = student.transformer
    fit_fsdp2_wrap_classes(plugin, model)
    # Registered before `fully_shard` adds its own hook, so FSDP2 sees the copies.
    model.register_forward_hook(output_of_its_own)
    if plugin.activation_checkpointing and not plugin.activation_checkpointing_offload:
        # `fsdp_activation_checkpointing` is served by diffusers' own per-block checkpointing
        # (torch.utils.checkpoint, non-reentrant): the same recompute of each transformer block,
        # without Accelerate's checkpoint wrapper, which renames every block's modules
        # (`blocks.0._checkpoint_wrapped_module.attn1...`) and so hides the LoRA layers from peft.
        plugin.activation_checkpointing = False
        model.enable_gradient_checkpointing()
        logger.info("FSDP activation checkpointing: diffusers' per-block gradient checkpointing")
    elif plugin.activation_checkpointing:
        # Offloading the checkpointed activations needs Accelerate's wrapper.
        if getattr(student, "lora_enabled", False):
            raise ValueError(
                "fsdp_activation_checkpointing_offload does not work with models.student.lora (its "
                "checkpoint wrapper hides the LoRA layers): set fsdp_activation_checkpointing_offload: false"
            )
        if getattr(model, "gradient_checkpointing", False):
            model.disable_gradient_checkpointing()  # never recompute twice


def configure_engine(acc, cfg: RunConfig, student) -> None:
    """Fit the engine `accelerate launch` chose to the recipe, before `prepare` (DDP needs nothing)."""
    from accelerate.utils import DistributedType

    from fv_accel.models.loading import LOW_PRECISION
    from fv_accel.optim import check_optimizer_engine

    check_gradient_accumulation(acc, cfg)  # also for an Accelerator the caller built
    if acc.distributed_type == DistributedType.DEEPSPEED:
        check_optimizer_engine(cfg, "deepspeed")
        ds_config = configure_deepspeed(acc.state.deepspeed_plugin.deepspeed_config, cfg)
        # DeepSpeed casts the model to bf16/fp16 but not its inputs: the student must.
        for name, dtype in LOW_PRECISION.items():
            if str((ds_config.get(name) or {}).get("enabled", False)).lower() == "true":
                student.input_dtype = dtype
    elif acc.distributed_type == DistributedType.FSDP:
        if not acc.is_fsdp2:
            raise ValueError(
                "FSDP1 is not supported: set fsdp_config.fsdp_version: 2 in the accelerate config "
                "(see accelerate_configs/fsdp2.yaml)"
            )
        check_optimizer_engine(cfg, "fsdp2")
        configure_fsdp2(acc.state.fsdp_plugin, acc.mixed_precision, student)


def describe_engine(acc, model) -> str:
    """The engine that runs, its process group and how much of the parameters this process holds
    (less than all under ZeRO-3 and FSDP2, which partition them)."""
    from accelerate.utils import DistributedType

    kind = acc.distributed_type
    full = local = 0
    for p in model.parameters():
        if hasattr(p, "ds_numel"):  # DeepSpeed ZeRO-3: the full size, and this rank's partition
            full, local = full + p.ds_numel, local + p.ds_tensor.numel()
        elif hasattr(p, "to_local"):  # FSDP2's DTensor: the global size, and this rank's shard
            full, local = full + p.numel(), local + p.to_local().numel()
        else:
            full, local = full + p.numel(), local + p.numel()
    if kind == DistributedType.DEEPSPEED:
        stage = int(acc.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {}).get("stage", 0))
        name = f"DeepSpeed ZeRO-{stage}"
    elif kind == DistributedType.FSDP:
        name = "FSDP2" if acc.is_fsdp2 else "FSDP"
    elif kind == DistributedType.NO or acc.num_processes == 1:
        name = "one process"
    else:
        name = "DDP"
    backend = getattr(acc.state, "backend", None) or "none"
    return (
        f"engine {name} (distributed_type {kind.value}, backend {backend}) | {acc.num_processes} processes | "
        f"process {acc.process_index} holds {local} of {full} parameter elements"
    )


def _flat_hparams(cfg: RunConfig) -> dict:
    flat: dict[str, Any] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        elif isinstance(node, (int, float, str, bool)):
            flat[prefix] = node
        else:
            flat[prefix] = str(node)

    walk(cfg.to_dict(), "")
    return flat


def resolve_data_path(cfg: RunConfig, accelerator) -> str:
    path = cfg.training.data.data_path
    if path != "tiny":
        from fv_accel.data.schema import local_dataset_path

        return local_dataset_path(path)  # hf://<repo>: its snapshot in the local Hugging Face cache
    from fv_accel.tiny import tiny_dataset

    with accelerator.main_process_first():
        return str(tiny_dataset(cfg.training.data, run_cfg=cfg))


def _latent_stats_from_dataset(cfg: RunConfig, data_path: str) -> None:
    """Latents are normalised with the recipe's statistics, else those of the student's own repo
    (its family's `latent_statistics`, read by the student), else those recorded by preprocessing in
    the dataset's fv_dataset.json (when they have one value per latent channel of the student).
    `check_latent_stats` refuses a student left without any."""
    from fv_accel.data.schema import read_dataset_info
    from fv_accel.models.loading import load_component_config

    st = cfg.models.student
    if st.latents_mean is not None:
        return
    channels = (st.transformer_config or {}).get("in_channels")
    if st.init_from is not None:
        from fv_accel.models import family_of

        if family_of(cfg).latent_statistics(st.init_from, st.revision) is not None:
            return
        config = load_component_config(st, st.subfolder or None) or {}
        channels = config.get("out_channels") or config.get("in_channels")
    info = read_dataset_info(data_path)
    mean, std = info.get("latents_mean"), info.get("latents_std")
    if mean and std and (channels is None or len(mean) == len(std) == int(channels)):
        st.latents_mean, st.latents_std = list(mean), list(std)


def check_latent_stats(student: Any, cfg: RunConfig, data_path: str) -> None:
    """Never train on latents that are not normalised without saying so: a student without latent
    statistics is an error naming the keys that give them (not for a text-only dataset: it holds no
    latents to normalise)."""
    from fv_accel.data.schema import DATASET_INFO, dataset_is_text_only, read_dataset_info

    if getattr(student, "latents_mean", False) is not None or dataset_is_text_only(data_path):
        return
    st = cfg.models.student
    source = getattr(student, "latent_statistics_source", "vae")
    model = f"models.student.init_from '{st.init_from}' has no latent statistics ({source}), " if st.init_from else ""
    recorded = read_dataset_info(data_path).get("latents_mean")
    if recorded:
        data = (
            f"the {DATASET_INFO} of training.data.data_path '{data_path}' records {len(recorded)} values, not one per "
            f"latent channel of the student ({getattr(student, 'in_channels', '?')}),"
        )
    else:
        data = f"training.data.data_path '{data_path}' has no {DATASET_INFO} recording them (preprocessing writes it),"
    raise ConfigError(
        f"no latent statistics to normalise the latents with: {model}{data} and models.student.latents_mean / "
        "latents_std are not set; set those two keys to the per-channel mean and std of the VAE that encoded "
        "the data (all 0.0 and 1.0 if the latents are stored normalised)"
    )


def check_data_fits_model(dataset: Any, student: Any, method: Any) -> None:
    """Latents and text embeddings the transformer cannot take (channels, text width, sizes its
    patch does not divide, a DFSFT chunk longer than the clip): caught here, before outputs are
    started, rather than at the first step (fv_accel/data/checks.py)."""
    from fv_accel.data.checks import check_fits_model

    config = getattr(getattr(student, "transformer", None), "config", None)
    text_dim = getattr(config, "text_dim", None) if config is not None else None
    check_fits_model(
        dataset,
        in_channels=getattr(student, "in_channels", None),
        text_dim=None if text_dim is None else int(text_dim),
        patch_size=getattr(student, "patch_size", None),
        chunk_size=method.math_signature().get("method.chunk_size"),
    )


def tracker_init_kwargs(cfg: RunConfig) -> dict:
    """`training.tracker.run_name` for each tracker: W&B's run name; TensorBoard's event-file suffix."""
    import re

    name = cfg.training.tracker.run_name
    return {"wandb": {"name": name}, "tensorboard": {"filename_suffix": "." + re.sub(r"[^\w.-]+", "_", name)}}


def build_callbacks(cfg: RunConfig, data_path: str, accelerator: Any = None) -> list:
    """EMA, held-out loss and sample videos, as the recipe's `callbacks` section asks."""
    from fv_accel.ema import EmaCallback
    from fv_accel.validation import build_validation_callbacks

    out: list = []
    ema = None
    if cfg.callbacks.ema.enable:
        ema = EmaCallback.from_config(cfg)
        out.append(ema)
    if cfg.method.name in REWARD_METHODS and cfg.method.validation.every_steps:
        from fv_accel.reward_validation import RewardValidationCallback

        out.append(RewardValidationCallback(cfg, ema=ema))
    return out + build_validation_callbacks(cfg, data_path, ema=ema, accelerator=accelerator)


def build_from_config(
    path_or_dict: Union[str, os.PathLike, dict, RunConfig],
    overrides: Optional[dict[str, Any]] = None,
    *,
    accelerator: Any = None,
    callbacks: Optional[list] = None,
) -> BuiltRun:
    """Build the method (with its student, optimizer, LR schedule), the loader and the start step,
    in the recipe's order: the checkpoint section (resume), the engine, the data, the student and
    method, the optimizer, the loader, the engine's prepare, then the output folder's lock,
    callbacks, resumed state and trackers."""
    from fv_accel.process import quiet_libraries

    quiet_libraries()  # before the engine (DeepSpeed) and the models' libraries are imported
    cfg = path_or_dict if isinstance(path_or_dict, RunConfig) else load_config(path_or_dict, overrides)
    # Everything that can be wrong with the recipe, the data or the output folder is checked before
    # anything is written to the output folder.
    check_no_lora_run_roles(cfg)  # before any role's model is read
    resume, resume_meta = _resume_point(cfg)
    acc = accelerator or build_accelerator(cfg)
    _check_engine(cfg, acc, resume, resume_meta)
    from fv_accel.config import check_role_runs

    check_role_runs(cfg)  # a chain's missing start run: the command that makes it, before the data's checks read a model
    data_path = _prepare_data_source(cfg, acc)
    student, method = _build_student_and_method(cfg, acc)
    heldout_rows, loader = _build_loader(cfg, acc, data_path, student, method)
    from fv_accel.checkpoint import check_resume_compatible, check_resume_data

    changes = (
        check_resume_compatible(resume_meta, method, cfg, resume) + check_resume_data(resume_meta, loader.dataset, cfg, resume)
        if resume_meta is not None else []
    )
    _log_run_plan(cfg, acc, student)
    _prepare_for_engine(cfg, acc, student, method)
    from fv_accel.output_dir import claim_output_dir

    # Nothing is written to the output folder before this: its lock, and under it the last checks.
    lock = claim_output_dir(acc, cfg, resume)
    try:
        if heldout_rows and acc.is_main_process:
            logger.info("%d training row(s) held out for validation (callbacks.validation.heldout_fraction)", len(heldout_rows))
        # Built-in callbacks first: checkpoints key callback state by position.
        all_callbacks = build_callbacks(cfg, data_path, acc) + list(callbacks or [])
        run = BuiltRun(
            method=method, dataloader=loader, start_step=0, accelerator=acc, config=cfg, callbacks=all_callbacks,
            output_lock=lock,
        )
        if resume is not None:
            _resume_run(run, resume, resume_meta, changes)
        acc.init_trackers(cfg.training.tracker.project_name, config=_flat_hparams(cfg), init_kwargs=tracker_init_kwargs(cfg))
    except BaseException:
        for tracker in acc.trackers:
            tracker.finish()
        lock.release(remove_created_dir=True)
        raise
    return run


def _resume_point(cfg: RunConfig) -> tuple[Optional[Path], Optional[dict]]:
    """training.checkpoint: the checkpoint to resume from (and its metadata), after checking that
    the output folder may be used."""
    from fv_accel.checkpoint import read_metadata, resolve_resume
    from fv_accel.output_dir import check_output_dir

    ck = cfg.training.checkpoint
    resume = resolve_resume(ck.output_dir, ck.resume_from_checkpoint)
    latest = ck.resume_from_checkpoint == "latest"
    check_output_dir(ck.output_dir, resume, overwrite=ck.overwrite_output_dir, latest=latest, warn=False)
    resume_meta = read_metadata(resume) if resume is not None else None
    return resume, resume_meta


def _check_engine(cfg: RunConfig, acc: Any, resume: Optional[Path], resume_meta: Optional[dict]) -> None:
    """A checkpoint of another engine, the log level per process and what the engine refuses (EMA,
    nan_policy), before any work."""
    from fv_accel.checkpoint import check_resume_engine, verify_resume_checkpoint
    from fv_accel.ema import check_ema_supported

    if resume_meta is not None:
        check_resume_engine(acc, cfg, resume, resume_meta)  # another engine's layout: one line, before any load
    logging.basicConfig(level=logging.INFO if acc.is_main_process else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    check_ema_supported(cfg, acc)
    from fv_accel.trainer import engine_steps_in_backward, resolve_nan_policy

    resolve_nan_policy(cfg, engine_steps_in_backward(acc), log=acc.is_main_process)  # nan_policy skip is refused under DeepSpeed
    from fv_accel.cpu_threads import use_cpu_cores

    use_cpu_cores(acc)
    if resume is not None:
        verify_resume_checkpoint(acc, resume, resume_meta)


def _prepare_data_source(cfg: RunConfig, acc: Any) -> str:
    """training.data: the dataset's folder (the tiny one generated on a first run), the user's
    data followed, the latent statistics it records."""
    data_path = resolve_data_path(cfg, acc)
    from fv_accel.user_data import follow_user_data

    follow_user_data(cfg, data_path, log=acc.is_main_process)
    check_method_takes_data(cfg, data_path)
    from fv_accel.validation import check_validation_data

    check_validation_data(cfg, data_path)  # (before the student is built)
    check_dataset_family(cfg, data_path)
    _latent_stats_from_dataset(cfg, data_path)
    return data_path


# Methods that noise the data's own latents: a text-only dataset (prompts alone) cannot feed them.
METHODS_NEEDING_LATENTS = ("finetune", "dfsft", "tfsft", "anyflow_pretrain")


def check_method_takes_data(cfg: RunConfig, data_path: str) -> None:
    """A method that trains on video latents (METHODS_NEEDING_LATENTS, a distillation rolled out
    from the data's latents) refuses a text-only dataset in one line, before the student is built."""
    from fv_accel.data.loader import check_rollout_data
    from fv_accel.data.schema import dataset_is_text_only

    if cfg.method.name in DISTILLATION_METHODS:
        check_rollout_data(cfg.method.rollout_mode, data_path)  # data_latent needs video latents
    if cfg.method.name in METHODS_NEEDING_LATENTS and dataset_is_text_only(data_path):
        raise ConfigError(
            f"training.data.data_path '{cfg.training.data.data_path}' is a text-only dataset (prompts without video "
            f"latents): method {cfg.method.name} trains on video latents; preprocess clips (python -m fv_accel.preprocess "
            "--input ...) or use a method that rolls the student out from noise"
        )


def dataset_latent_space(data_path: str) -> tuple[Optional[str], Optional[str], str]:
    """(family, VAE class, model) of the latents of a dataset, as its fv_dataset.json records them;
    for a dataset written before they were recorded, read from the encoding model's own configs
    when that model is a local folder or in the Hugging Face cache (nothing is downloaded)."""
    from fv_accel.data.schema import read_dataset_info

    info = read_dataset_info(data_path)
    model = str(info.get("model") or "")
    family, vae_class = info.get("family"), info.get("vae_class")
    if model and (family is None or vae_class is None):
        vae_config = _cached_config(model, "vae/config.json") or {}
        vae_class = vae_class or vae_config.get("_class_name")
        if family is None and Path(model).is_dir():
            from fv_accel.models import family_of_repo

            try:
                family = family_of_repo(model).family
            except (OSError, ValueError):
                family = None
    return family, vae_class, model


def _cached_config(model: str, filename: str) -> Optional[dict]:
    """A config file of a local model folder, or of a Hub id in the local Hugging Face cache; None otherwise."""
    import json

    path: Any = Path(model) / filename
    if not Path(model).is_dir():
        try:
            from huggingface_hub import try_to_load_from_cache

            path = try_to_load_from_cache(model, filename)
        except Exception:  # noqa: BLE001 - not a Hub id
            return None
        if not isinstance(path, str):
            return None
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def check_dataset_family(cfg: RunConfig, data_path: str) -> None:
    """The datasets (training.data.data_path and the mix) hold latents of a VAE the student's family
    takes: one encoded by another family's VAE (Wan latents for an LTX student) is refused, naming
    both families. Models of one family share their latent space (Wan 1.3B and 14B), so ids are not
    compared; a dataset that records no encoding model, or a VAE no family names, is not checked. A
    text-only dataset is checked by its family (check_text_only_family)."""
    from fv_accel.data.schema import DATASET_INFO, dataset_is_text_only, local_dataset_path
    from fv_accel.models import FAMILIES, family_of

    student = family_of(cfg)
    known_vaes = {name for f in FAMILIES.values() for name in f.vae_class_names}
    paths = [data_path] + [local_dataset_path(entry["data_path"]) for entry in cfg.training.data.mix]
    for path in paths:
        family, vae_class, model = dataset_latent_space(path)
        if dataset_is_text_only(path):
            check_text_only_family(path, family, model, student.family)
            continue
        if not student.vae_class_names:
            continue
        if vae_class in known_vaes:
            fits = vae_class in student.vae_class_names
        elif family in FAMILIES:
            fits = bool(set(FAMILIES[family].vae_class_names) & set(student.vae_class_names))
        else:
            continue
        if fits:
            continue
        folder = Path(path) if Path(path).is_dir() else Path(path).parent
        what = ", ".join(x for x in (f"{family} family" if family else "", f"VAE {vae_class}" if vae_class else "") if x)
        raise ConfigError(
            f"{folder / DATASET_INFO}: the dataset was encoded by '{model}' ({what}), but the student is of the "
            f"{student.family} family (VAE {' or '.join(student.vae_class_names)}): its latents are not the "
            "student's; preprocess the clips with the student's model (python -m fv_accel.preprocess --model ...) "
            "or train a student of the dataset's family"
        )


def check_text_only_family(path: str, family: Optional[str], model: str, student_family: str) -> None:
    """A text-only dataset holds text embeddings of its family's text encoder(s), which no other
    family's transformer takes (two families may share a VAE, as Cosmos 2 and Wan do, but not their
    text encoders): one of another family is refused, naming both; one that records none is not checked."""
    from fv_accel.data.schema import DATASET_INFO

    if family is None or family == student_family:
        return
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    raise ConfigError(
        f"{folder / DATASET_INFO}: the text-only dataset was encoded by '{model}' ({family} family), but the student "
        f"is of the {student_family} family: its text embeddings are not of the student's text encoder; preprocess "
        "the prompts with the student's model (python -m fv_accel.preprocess --prompts ... --model ...)"
    )


def _build_student_and_method(cfg: RunConfig, acc: Any) -> tuple[Any, Any]:
    """models.student, method and training.optimizer: the student, its method, the optimizer and LR schedule."""
    from accelerate.utils import set_seed

    from fv_accel.methods import METHODS
    from fv_accel.models import build_student
    from fv_accel.optim import build_lr_scheduler, build_optimizer

    # Identical initial weights on every rank for inline (random-init) students. Seeded here, after
    # the data: building the tiny dataset on a first run reseeds the global RNG.
    set_seed(cfg.training.data.seed)
    student = build_student(cfg)
    student.attach_accelerator(acc)
    roles = {"student": student, **build_other_roles(cfg, acc, student)}
    method = METHODS[cfg.method.name](cfg=cfg, role_models=roles)
    if method.optimizer is None:  # a method that does not build its own: the student's, from the recipe
        method.optimizer = build_optimizer(cfg, student.trainable_parameters())
        method.lr_scheduler = build_lr_scheduler(cfg, method.optimizer)
    return student, method


# A role's `trainable` when the recipe leaves it null.
ROLE_TRAINABLE = {"teacher": False, "critic": True, "ema": False, "old": False, "reference": False}


def check_no_lora_run_roles(cfg: RunConfig) -> None:
    """A role's `init_from` that is a LoRA run's folder (an adapter beside base_model.json, no
    transformer): a ConfigError giving the export command that merges it into its base."""
    from fv_accel.models.lora import DIFFUSERS_LORA_FILE

    for role in ("student", *ROLE_TRAINABLE):
        section = getattr(cfg.models, role)
        folder = Path(section.init_from) if section is not None and section.init_from else None
        if folder is None or not (folder / DIFFUSERS_LORA_FILE).is_file():
            continue
        if (folder / (section.subfolder or "") / "config.json").is_file():
            continue
        from fv_accel.export import default_export_dir, find_source

        source = find_source(folder)
        base = source.base.get("init_from")
        adapter = f"an adapter over '{base}'" if base else "an adapter"
        raise ConfigError(
            f"models.{role}.init_from '{folder}' is a LoRA run ({adapter}), not a model: merge it into its base first "
            f"(python -m fv_accel.export {folder} --to merged) and give "
            f"models.{role}.init_from the folder that writes ({default_export_dir(source, 'merged')})"
        )


# The transformer config keys of a family's text width (the text embeddings it takes).
TEXT_WIDTH_KEYS = ("text_dim", "caption_channels", "text_embed_dim")


def text_width(model: Any) -> Optional[tuple[str, int]]:
    """(key, value) of the text width in a role's transformer config; None where it names none."""
    config = model.modules[0].config
    return next(((key, int(config[key])) for key in TEXT_WIDTH_KEYS if config.get(key) is not None), None)


def check_role_fits_student(name: str, role: Any, student: Any, where: str) -> None:
    """A role works on the student's noisy latents and text embeddings: one of another family, other
    latent channels or another text width is refused in one line naming models.<role> and both values."""
    fix = f"give models.{name} a model of the student's family, latent space and text encoder"
    # A family whose teacher and critic may be of another family on the same latents and text
    # encoder names them in `role_families` (an AnyFlow student distilled from a Wan teacher).
    if role.family != student.family and role.family not in getattr(student, "role_families", ()):
        raise ConfigError(
            f"models.{name}: '{where}' is of the {role.family} family, the student of the {student.family} family: "
            f"the {name} works on the student's latents and text embeddings; {fix}"
        )
    if role.in_channels != student.in_channels:
        raise ConfigError(
            f"models.{name}: '{where}' takes {role.in_channels} latent channels, the student {student.in_channels}; {fix}"
        )
    mine, theirs = text_width(role), text_width(student)
    if mine is not None and theirs is not None and mine[1] != theirs[1]:
        raise ConfigError(
            f"models.{name}: '{where}' takes text embeddings {mine[1]} wide ({mine[0]}), the student's are "
            f"{theirs[1]} wide; {fix}"
        )


def build_other_roles(cfg: RunConfig, acc: Any, student: Any = None) -> dict[str, Any]:
    """The roles beside the student that the recipe declares (models.teacher, models.critic), each a
    model of its family, checked against the `student` (`check_role_fits_student`) as it is built; a
    frozen role is put in eval mode, without gradients, on the device."""
    from accelerate.utils import set_seed

    from fv_accel.config import role_config
    from fv_accel.models import family_of

    roles: dict[str, Any] = {}
    for name in ROLE_TRAINABLE:
        section = getattr(cfg.models, name)
        if section is None:
            continue
        trainable = ROLE_TRAINABLE[name] if section.trainable is None else bool(section.trainable)
        if name in ("old", "reference") and trainable:
            raise ConfigError(f"models.{name}.trainable: the {name} policy is never trained; remove the key")
        if name == "teacher" and section.lora.enable:
            raise ConfigError("models.teacher.lora.enable: the teacher is frozen; remove the teacher's LoRA section")
        role_cfg = role_config(cfg, name)
        # Seeded as the student was: roles built from one inline config start from the same weights.
        set_seed(cfg.training.data.seed)
        family = family_of(role_cfg)
        where = section.init_from or f"models.{name}.transformer_config"
        if student is not None and family.family != student.family and family.family not in getattr(student, "role_families", ()):
            check_role_fits_student(name, family, student, where)  # before its weights are loaded
        model = family(role_cfg, trainable=trainable)
        if student is not None:
            check_role_fits_student(name, model, student, where)
        model.role = name
        model.attach_accelerator(acc)
        if not trainable:
            model.transformer.eval()
            model.transformer.to(acc.device)
        roles[name] = model
    return roles


def _build_loader(cfg: RunConfig, acc: Any, data_path: str, student: Any, method: Any) -> tuple[Any, Any]:
    """The held-out rows (callbacks.validation) and the training loader over the rest, checked
    against the student."""
    from fv_accel.data.loader import build_train_loader
    from fv_accel.models.context_parallel import data_parallel_layout
    from fv_accel.validation import training_exclusions

    heldout_rows = training_exclusions(cfg, data_path)
    # Data parallel ranks shard the data; the processes of one context-parallel group share a batch.
    dp_size, dp_rank = data_parallel_layout(cfg.training.model.context_parallel, acc.num_processes, acc.process_index)
    loader = build_train_loader(
        rows_only(cfg), world_size=dp_size, rank=dp_rank, data_path=data_path, exclude_indices=heldout_rows
    )
    method.check_data(loader)
    from fv_accel.validation import sampling_model_source

    method.model_source = sampling_model_source(cfg, data_path)
    # Where a student that saves a whole pipeline folder (AnyFlow) takes its VAE and text encoder from.
    student.model_source = method.model_source
    check_data_fits_model(loader.dataset, student, method)
    check_latent_stats(student, cfg, data_path)
    return heldout_rows, loader


def rows_only(cfg: RunConfig) -> RunConfig:
    """Reward training picks its prompt rows itself (the K-repeat sampler): its loader serves rows
    one at a time, so a dataset of a few prompts is enough whatever the batch and accumulation."""
    if cfg.method.name not in REWARD_METHODS:
        return cfg
    data = dataclasses.replace(cfg.training.data, train_batch_size=1)
    loop = dataclasses.replace(cfg.training.loop, gradient_accumulation_steps=1)
    return dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, data=data, loop=loop))


def _log_run_plan(cfg: RunConfig, acc: Any, student: Any) -> None:
    if acc.is_main_process:
        logger.info(
            "method %s | student %s (%s family) | training shift %s (models.student.flow_shift, else the family's) | sampling shift "
            "%s (callbacks.validation.sampling_flow_shift) | %d processes | mixed precision %s",
            cfg.method.name,
            type(student.transformer).__name__,
            student.family,
            student.describe_training_shift(),
            cfg.callbacks.validation.sampling_flow_shift or "the repo scheduler's",
            acc.num_processes,
            acc.mixed_precision,
        )


def _prepare_for_engine(cfg: RunConfig, acc: Any, student: Any, method: Any) -> None:
    """The engine's settings, then Accelerate's prepare of the transformer, optimizer and schedule."""
    configure_engine(acc, cfg, student)
    roles = method.trainable_roles()
    check_roles_engine(acc, cfg, roles)
    for name, role in roles.items():
        if role is not student:
            configure_engine(acc, cfg, role)
        # One call per role: FSDP2 swaps the optimizer's parameters for the sharded ones, and
        # DeepSpeed takes the optimizer (and runs its step inside `accelerator.backward`).
        role.transformer, optimizer, lr_scheduler = acc.prepare(
            role.transformer, method.optimizer_dict[name], method.lr_scheduler_dict[name]
        )
        method.set_optimizer(name, optimizer, lr_scheduler)
        role.after_prepare()
    shard_frozen_roles(acc, cfg, method)
    if acc.is_main_process:
        logger.info("%s", describe_engine(acc, student.transformer))


def shard_frozen_roles(acc: Any, cfg: RunConfig, method: Any) -> None:
    """Each frozen role (a distillation teacher, reward training's reference) is recorded by its
    source and the sha256 of its weights as built (`frozen_record`, main process, before any
    sharding): checkpoints hold that record instead of its weights, and a resume rebuilds the role
    from its source and refuses one whose weights changed (fv_accel/checkpoint.py). Under FSDP2 it
    is sharded like the trained roles by Accelerate's prepare, so no process holds a whole copy,
    then taken off Accelerate's model list (what `save_state` writes and `load_state` reads, by
    position: the trained roles come first and keep theirs), and resharded after each forward;
    elsewhere it stays whole on the device (DDP wraps only what has gradients to synchronise)."""
    from accelerate.utils import DistributedType

    trained = set(map(id, method.trainable_roles().values()))
    for name, role in method.role_models.items():
        if id(role) in trained:
            continue
        role.frozen_record = {
            "source": describe_role_source(cfg, name),
            "sha256": role.weights_sha256() if acc.is_main_process else None,
        }
        if acc.distributed_type != DistributedType.FSDP:
            continue
        configure_engine(acc, cfg, role)
        role.transformer = acc.prepare(role.transformer)
        acc._models = [model for model in acc._models if model is not role.transformer]
        role.transformer.eval()
        role.reshard_after_each_forward()


def describe_role_source(cfg: RunConfig, name: str) -> str:
    """Where a role's weights come from, as its recipe section says: `init_from` (a Hub id or a
    folder) with its revision, subfolder, variant and dtype, or an inline `transformer_config`."""
    section = getattr(cfg.models, name, None)
    if section is None:
        return f"models.{name}"
    if section.init_from is None:
        return f"models.{name}.transformer_config (inline, seed {cfg.training.data.seed}, {section.torch_dtype})"
    parts = [f"revision {section.revision}"] if section.revision else []
    parts += [f"subfolder {section.subfolder}"] if section.subfolder else []
    parts += [f"variant {section.variant}"] if section.variant else []
    return f"models.{name}.init_from {section.init_from} ({', '.join([*parts, section.torch_dtype])})"


def check_roles_engine(acc: Any, cfg: RunConfig, roles: dict) -> None:
    """Several trained roles (distillation) run under one process, DDP or FSDP2; DeepSpeed's engine
    takes one model and optimizer per config: refused in one line."""
    from accelerate.utils import DistributedType

    if len(roles) > 1 and acc.distributed_type == DistributedType.DEEPSPEED:
        raise ConfigError(
            f"method.name {cfg.method.name}: DeepSpeed runs one trained model per engine, and this method trains "
            f"{len(roles)} ({', '.join(roles)}): launch with accelerate_configs/ddp.yaml or fsdp2.yaml"
        )


def _resume_run(run: BuiltRun, resume: Path, resume_meta: Optional[dict], changes: list) -> None:
    """The checkpoint's state loaded into the run (its start step, the trainer's counters)."""
    from fv_accel.checkpoint import load_checkpoint, resumed_trainer_state
    from fv_accel.trainer import Trainer

    run.start_step = load_checkpoint(Trainer(run), resume)
    run.trainer_state = resumed_trainer_state(resume_meta, changes)
    if run.accelerator.is_main_process:
        logger.info("resumed from %s at step %d", resume, run.start_step)
