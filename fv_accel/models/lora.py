"""LoRA on the student's transformer (peft), and the adapter files a run leaves behind.

Training: `apply_lora` injects peft LoRA layers through diffusers' `add_adapter`, freezes the base
and keeps only the adapter trainable, in fp32 (`cast_training_params`), whatever the base dtype.

Files (all safetensors):
- `pytorch_lora_weights.safetensors`: diffusers' format (`transformer.<module>.lora_A/B.weight`)
  written by the family pipeline's `save_lora_weights` (e.g. `WanPipeline`) with the adapter metadata (rank, alpha, targets), so
  `WanPipeline.load_lora_weights(dir)` rebuilds the same scaling when alpha != rank.
- `pytorch_lora_weights_comfyui.safetensors`: the same tensors under the original module names
  (the family's map, e.g. Wan's) with ComfyUI's `diffusion_model.` prefix (`lora_down`/`lora_up` + a scalar `alpha` per
  module); diffusers' own Wan loader reads this layout too.
- `base_model.json`: which base the adapter belongs to (for a merged export later).

PiSSA initialises the adapter from the base's top singular vectors and subtracts them from the
base, so the trained adapter only makes sense on that residual base. The files hold the adapter
converted back to the original base instead (peft's PiSSA-to-LoRA conversion: rank 2r,
`[A; A0]` and `[B, -B0]`, alpha doubled so the scale is unchanged).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from fv_accel.config import LoraConfig

DIFFUSERS_LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
COMFYUI_LORA_FILE = "pytorch_lora_weights_comfyui.safetensors"
BASE_MODEL_FILE = "base_model.json"
ADAPTER_NAME = "default"

# peft's `init_lora_weights` for each recipe value of `models.student.lora.init`.
PEFT_INIT = {"default": True, "gaussian": "gaussian", "pissa": "pissa"}

# --------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------


def peft_lora_config(cfg: LoraConfig):
    from peft import LoraConfig as PeftLoraConfig

    alpha = cfg.alpha
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=int(alpha) if float(alpha).is_integer() else alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        init_lora_weights=PEFT_INIT[cfg.init],
    )


def with_default_targets(cfg: LoraConfig, family_targets: Sequence[str]) -> LoraConfig:
    """`cfg` with the family's LoRA targets (`lora_target_modules`) when the recipe names none
    (`models.student.lora.target_modules` unset or empty)."""
    if cfg.target_modules:
        return cfg
    return dataclasses.replace(cfg, target_modules=list(family_targets))


def apply_lora(transformer: torch.nn.Module, cfg: LoraConfig) -> Optional[dict[str, torch.Tensor]]:
    """Freeze `transformer`, add a trainable fp32 LoRA adapter; returns PiSSA's initial adapter
    (needed to export against the original base) or None for the other inits."""
    from diffusers.training_utils import cast_training_params

    transformer.requires_grad_(False)
    if cfg.init == "pissa" and next(transformer.parameters()).dtype != torch.float32:
        # PiSSA subtracts the adapter from the base: a bf16 residual loses the low bits for good.
        import logging

        logging.getLogger(__name__).warning(
            "models.student.lora.init=pissa on a %s base: the residual base is rounded to that dtype",
            next(transformer.parameters()).dtype,
        )
    try:
        transformer.add_adapter(peft_lora_config(cfg), adapter_name=ADAPTER_NAME)
    except ValueError as err:
        if "Target modules" in str(err) or "not found" in str(err):
            raise ValueError(
                f"models.student.lora.target_modules={cfg.target_modules!r} matches no layer of "
                f"{type(transformer).__name__}: {err}"
            ) from None
        raise
    trainable = [n for n, p in transformer.named_parameters() if p.requires_grad]
    if not trainable or any("lora_" not in n for n in trainable):
        raise RuntimeError(f"LoRA injection left non-adapter parameters trainable: {trainable[:5]}")
    cast_training_params(transformer, dtype=torch.float32)
    if cfg.init == "pissa":
        return {k: v.detach().clone() for k, v in adapter_state_dict(transformer).items()}
    return None


def adapter_state_dict(
    transformer: torch.nn.Module, full_state_dict: Optional[dict[str, torch.Tensor]] = None
) -> dict[str, torch.Tensor]:
    """The adapter alone, keys as diffusers writes them (`blocks.0.attn1.to_q.lora_A.weight`),
    fp32 on CPU. `full_state_dict` is a gathered state dict (FSDP/ZeRO-3) to read from instead."""
    from peft.utils import get_peft_model_state_dict

    state = get_peft_model_state_dict(transformer, state_dict=full_state_dict, adapter_name=ADAPTER_NAME)
    return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}


def set_adapter_state_dict(transformer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter tensors (diffusers keys) into the injected adapter, exactly and strictly."""
    from peft.utils import set_peft_model_state_dict

    expected = set(adapter_state_dict(transformer))
    if set(state) != expected:
        missing, extra = sorted(expected - set(state)), sorted(set(state) - expected)
        raise ValueError(
            f"adapter tensors do not match the model's LoRA layers (missing {missing[:4]}, unexpected "
            f"{extra[:4]}): was the checkpoint written with the same models.student.lora settings?"
        )
    result = set_peft_model_state_dict(transformer, state, adapter_name=ADAPTER_NAME)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"unexpected adapter keys: {result.unexpected_keys[:4]}")


def adapter_metadata(transformer: torch.nn.Module) -> dict[str, Any]:
    """The peft config of the adapter as JSON-ready data (what diffusers stores in the file)."""
    meta = transformer.peft_config[ADAPTER_NAME].to_dict()
    return {k: (sorted(v) if isinstance(v, set) else v) for k, v in meta.items()}


def deployable_lora(
    state: dict[str, torch.Tensor],
    metadata: dict[str, Any],
    pissa_init: Optional[dict[str, torch.Tensor]] = None,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The adapter as a LoRA on the original base: unchanged for default/gaussian inits; for
    PiSSA, `s*(B A - B0 A0) = s * [B, -B0] @ [A; A0]` at rank 2r with alpha 2*alpha."""
    metadata = dict(metadata)
    # The loader must not re-run a data-driven init (PiSSA would rewrite the base on load).
    metadata["init_lora_weights"] = True
    if pissa_init is None:
        return state, metadata
    out = {}
    for key, value in state.items():
        init = pissa_init[key]
        if ".lora_A." in key:
            out[key] = torch.cat([value, init], dim=0)
        elif ".lora_B." in key:
            out[key] = torch.cat([value, -init], dim=1)
        else:
            raise ValueError(f"unexpected PiSSA adapter tensor {key}")
    metadata["r"] = 2 * int(metadata["r"])
    metadata["lora_alpha"] = 2 * metadata["lora_alpha"]
    metadata["rank_pattern"] = {k: 2 * v for k, v in (metadata.get("rank_pattern") or {}).items()}
    metadata["alpha_pattern"] = {k: 2 * v for k, v in (metadata.get("alpha_pattern") or {}).items()}
    return out, metadata


def trained_part_of_deployable(
    state: dict[str, torch.Tensor], metadata: dict[str, Any], lora: LoraConfig
) -> dict[str, torch.Tensor]:
    """Inverse of `deployable_lora` for resuming: the adapter the training model holds."""
    if lora.init != "pissa":
        return state
    r = int(metadata["r"]) // 2
    return {k: (v[:r] if ".lora_A." in k else v[:, :r]).contiguous() for k, v in state.items()}


# --------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------


def save_diffusers_lora(
    out_dir: str | Path,
    state: dict[str, torch.Tensor],
    metadata: dict[str, Any],
    *,
    pipeline_cls: type,
    weight_name: str = DIFFUSERS_LORA_FILE,
) -> Path:
    """Write `pytorch_lora_weights.safetensors` with diffusers' own writer (keys + metadata) of the
    family's pipeline class (`ModelBase.lora_pipeline_class`)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    pipeline_cls.save_lora_weights(
        out_dir,
        transformer_lora_layers=state,
        transformer_lora_adapter_metadata=metadata,
        weight_name=weight_name,
        safe_serialization=True,
    )
    return out_dir / weight_name


def read_lora_file(path: str | Path) -> tuple[dict[str, torch.Tensor], Optional[dict[str, Any]]]:
    """A diffusers-format LoRA file -> (state with the `transformer.` prefix removed, adapter metadata)."""
    from diffusers.loaders.lora_base import LORA_ADAPTER_METADATA_KEY

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no LoRA file at {path}")
    state = {}
    with safe_open(str(path), framework="pt") as fh:
        raw_meta = (fh.metadata() or {}).get(LORA_ADAPTER_METADATA_KEY)
        for key in fh.keys():
            if not key.startswith("transformer."):
                raise ValueError(f"{path}: key {key!r} is not a diffusers transformer LoRA key")
            state[key[len("transformer."):]] = fh.get_tensor(key)
    metadata = None
    if raw_meta:
        metadata = json.loads(raw_meta)
        # diffusers stores the metadata of several components prefixed by the component name.
        if any(k.startswith("transformer.") for k in metadata):
            metadata = {k[len("transformer."):]: v for k, v in metadata.items() if k.startswith("transformer.")}
    return state, metadata


def alpha_by_module(state: dict[str, torch.Tensor], metadata: dict[str, Any]) -> dict[str, float]:
    """alpha per adapted module (diffusers module name), honouring peft's alpha_pattern."""
    import re

    alpha = float(metadata["lora_alpha"])
    patterns = metadata.get("alpha_pattern") or {}
    out = {}
    for key in state:
        if ".lora_A." not in key:
            continue
        module = key.split(".lora_A.")[0]
        value = alpha
        for pattern, a in patterns.items():
            if re.search(rf"(^|\.){pattern.lstrip('^')}$", module):
                value = float(a)
        out[module] = value
    return out


def original_module_name(
    module: str,
    *,
    blocks: str,
    original_blocks: str,
    block_modules: dict[str, str],
    top_modules: dict[str, str],
    naming: str,
    supported: str,
) -> str:
    """diffusers module name -> a model's original name (ComfyUI's layout), by table: a module
    `<blocks>.<i>.<inner>` is `<original_blocks>.<i>.<block_modules[inner]>`, others are looked up
    in `top_modules`. An unmapped module is an error naming it, the `naming` and what is `supported`."""
    parts = module.split(".")
    if parts[0] == blocks and len(parts) > 2:
        inner = ".".join(parts[2:])
        if inner in block_modules:
            return f"{original_blocks}.{parts[1]}.{block_modules[inner]}"
    elif module in top_modules:
        return top_modules[module]
    raise ValueError(f"LoRA on module '{module}' has no {naming} name; supported: {supported}")


def to_comfyui(
    state: dict[str, torch.Tensor], metadata: dict[str, Any], module_name: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """diffusers keys -> `diffusion_model.<original name>.lora_down/lora_up.weight` + `.alpha`
    (ComfyUI scales by alpha / rank, rank read from lora_down's rows); `module_name` is the
    family's map (`ModelBase.comfyui_module_name`)."""
    if metadata is None:
        raise ValueError("the LoRA file has no adapter metadata: its alpha is unknown, cannot write alpha keys")
    if metadata.get("use_rslora") or metadata.get("use_dora"):
        raise ValueError("rsLoRA/DoRA adapters have no ComfyUI LoRA layout here")
    from fv_accel.vsa import split_gates

    # VSA gates (a LoRA run with training.vsa) have no ComfyUI layout: ComfyUI has no VSA.
    state = split_gates(state)[1]
    alphas = alpha_by_module(state, metadata)
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        for part, new in ((".lora_A.weight", ".lora_down.weight"), (".lora_B.weight", ".lora_up.weight")):
            if key.endswith(part):
                module = key[: -len(part)]
                out[f"diffusion_model.{module_name(module)}{new}"] = value.contiguous()
                break
        else:
            raise ValueError(f"unexpected LoRA tensor {key} (only lora_A/lora_B weights are exported)")
    for module, alpha in alphas.items():
        out[f"diffusion_model.{module_name(module)}.alpha"] = torch.tensor(alpha, dtype=torch.float32)
    return out


def save_comfyui_file(path: str | Path, comfy_state: dict[str, torch.Tensor]) -> Path:
    """Write a LoRA already in ComfyUI's layout (see `to_comfyui`) to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # No diffusers adapter metadata here: the alpha lives in the `.alpha` keys (a loader that
    # also applied metadata would scale twice).
    save_file(comfy_state, str(path), metadata={"format": "pt"})
    return path


def save_comfyui_lora(
    path: str | Path, state: dict[str, torch.Tensor], metadata: dict[str, Any], module_name: Callable[[str], str]
) -> Path:
    return save_comfyui_file(path, to_comfyui(state, metadata, module_name))


def save_lora_outputs(
    out_dir: str | Path,
    state: dict[str, torch.Tensor],
    metadata: dict[str, Any],
    *,
    family: Any,
    kind: str,
    base: Optional[dict[str, Any]] = None,
    suffix: str = "",
) -> list[Path]:
    """The LoRA files (diffusers, and ComfyUI's where the family has a layout for it; +
    `base_model.json` when given) into `out_dir`; `family` is the student's family class (its
    pipeline's LoRA writer for `kind`, its ComfyUI key map). `suffix` goes before
    `.safetensors` (a second expert's files)."""
    out_dir = Path(out_dir)
    name = DIFFUSERS_LORA_FILE.replace(".safetensors", f"{suffix}.safetensors")
    written = [save_diffusers_lora(out_dir, state, metadata, pipeline_cls=family.lora_pipeline_class(kind), weight_name=name)]
    if family.comfyui_lora:
        comfy = COMFYUI_LORA_FILE.replace(".safetensors", f"{suffix}.safetensors")
        written.append(save_comfyui_lora(out_dir / comfy, state, metadata, family.comfyui_module_name))
    if base is not None:
        (out_dir / BASE_MODEL_FILE).write_text(json.dumps(base, indent=2) + "\n")
        written.append(out_dir / BASE_MODEL_FILE)
    return written


def merge_lora(
    transformer: torch.nn.Module, state: dict[str, torch.Tensor], metadata: Optional[dict[str, Any]], vsa_sparsity: float = 0.0
) -> torch.nn.Module:
    """Fold the LoRA into `transformer`'s weights (diffusers' load_lora_adapter + fuse + unload).
    VSA gates in the file (a LoRA run with training.vsa) go into the transformer as they are,
    with VSA enabled on it at `vsa_sparsity` (the run's)."""
    from fv_accel.vsa import enable_vsa, load_vsa_gates, split_gates

    if metadata is None:
        raise ValueError("the LoRA file has no adapter metadata (alpha unknown); cannot merge it faithfully")
    gates, adapter = split_gates(state)
    transformer.load_lora_adapter(adapter, prefix=None, metadata=dict(metadata), adapter_name="merge")
    transformer.fuse_lora(lora_scale=1.0, adapter_names=["merge"])
    transformer.unload_lora()
    if gates:
        enable_vsa(transformer, vsa_sparsity)
        load_vsa_gates(transformer, gates)
    return transformer


def count_parameters(module: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    trainable = sum(p.numel() for p in module.parameters() if p.requires_grad)
    total = sum(p.numel() for p in module.parameters())
    return trainable, total


# --------------------------------------------------------------------------------------------
# Checkpoints: only the adapter (Accelerate's optimizer/scheduler/RNG files stay as they are)
# --------------------------------------------------------------------------------------------


def register_adapter_checkpointing(
    accelerator: Any,
    transformer_ref: Callable[[], torch.nn.Module],
    get_files_state: Callable[[], tuple[dict[str, torch.Tensor], dict[str, Any]]],
    set_files_state: Callable[[dict[str, torch.Tensor], Optional[dict[str, Any]]], None],
    *,
    pipeline_cls: type,
    subfolder: str = "",
) -> None:
    """Make `accelerator.save_state` write the adapter (as `pytorch_lora_weights.safetensors`,
    directly loadable by diffusers) instead of the whole transformer, and `load_state` read it.
    A role other than the student keeps its adapter in the checkpoint's `subfolder` (its role name).

    Under DDP / one process Accelerate hands the hooks the model state dicts it is about to save;
    removing the transformer's keeps the frozen base out of the checkpoint. FSDP and DeepSpeed
    save through their own engines (the full model); the adapter file is written there too.
    """

    def is_ours(model: torch.nn.Module) -> bool:
        return accelerator.unwrap_model(model) is accelerator.unwrap_model(transformer_ref())

    def save_hook(models: list, weights: list, output_dir: str) -> None:
        for i, model in enumerate(models):
            if is_ours(model) and i < len(weights):
                weights.pop(i)  # never `models`: that is the accelerator's own list
                break
        state, metadata = get_files_state()
        if accelerator.is_main_process:
            save_diffusers_lora(Path(output_dir) / subfolder, state, metadata, pipeline_cls=pipeline_cls)

    def load_hook(models: list, input_dir: str) -> None:
        for i, model in enumerate(models):
            if is_ours(model):
                models.pop(i)  # a local list of `load_state`: Accelerate skips the model
                path = Path(input_dir) / subfolder / DIFFUSERS_LORA_FILE
                if not path.is_file():
                    raise FileNotFoundError(
                        f"checkpoint {input_dir} has no {DIFFUSERS_LORA_FILE}: it was not written by a LoRA "
                        f"run (models.student.lora.enable)"
                    )
                state, metadata = read_lora_file(path)
                set_files_state(state, metadata)
                break

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)


def file_size_mib(path: str | Path) -> float:
    path = Path(path)
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / 2**20
    return path.stat().st_size / 2**20


__all__ = [
    "BASE_MODEL_FILE",
    "COMFYUI_LORA_FILE",
    "DIFFUSERS_LORA_FILE",
    "adapter_metadata",
    "adapter_pairs",
    "adapter_state_dict",
    "adapter_view",
    "add_frozen_adapter",
    "apply_lora",
    "count_parameters",
    "deployable_lora",
    "merge_lora",
    "read_lora_file",
    "register_adapter_checkpointing",
    "save_comfyui_file",
    "save_comfyui_lora",
    "save_diffusers_lora",
    "save_lora_outputs",
    "set_adapter_state_dict",
    "to_comfyui",
    "trained_part_of_deployable",
]


def add_frozen_adapter(transformer: torch.nn.Module, name: str) -> None:
    """A second adapter `name` beside the trained one, a frozen copy of it (no gradient; the trained
    adapter stays the active, trainable one), over the same base."""
    import copy
    import warnings

    config = transformer.peft_config[ADAPTER_NAME]
    with warnings.catch_warnings():  # peft's notice that a model now holds two adapters: the point here
        warnings.filterwarnings("ignore", message="Already found a `peft_config` attribute")
        transformer.add_adapter(copy.deepcopy(config), adapter_name=name)
    transformer.set_adapter(ADAPTER_NAME)  # back to the trained adapter (peft sets requires_grad)
    for trained, other in adapter_pairs(transformer, name):
        other.data = trained.detach().clone()
        other.requires_grad_(False)


def adapter_pairs(transformer: torch.nn.Module, name: str) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """(trained adapter's parameter, adapter `name`'s same parameter), in the transformer's order."""
    named = dict(transformer.named_parameters())
    return [(p, named[key.replace(f".{ADAPTER_NAME}.", f".{name}.")]) for key, p in named.items() if f".{ADAPTER_NAME}." in key]


@contextlib.contextmanager
def adapter_view(transformer: torch.nn.Module, name: Optional[str]) -> Iterator[None]:
    """Inside the block the transformer computes through adapter `name` alone, or through none (the
    frozen base) with None; the trained adapter's requires_grad is untouched (peft's own switches
    set it), and the layers' state comes back after the block."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in transformer.modules() if isinstance(m, BaseTunerLayer)]
    saved = [(m._active_adapter, m._disable_adapters) for m in layers]
    try:
        for m in layers:
            if name is None:
                m._disable_adapters = True
            else:
                m._active_adapter = [name]
        yield
    finally:
        for m, (active, disabled) in zip(layers, saved):
            m._active_adapter, m._disable_adapters = active, disabled
