"""Memory a training process will need, estimated from the recipe without loading weights
(printed by `--dry-run`).

The transformer is built from its config on the `meta` device (accelerate's `init_empty_weights`),
with LoRA injected by peft the way training injects it, so parameter counts are exact, per tensor:

    parameters   every element x its storage bytes (recipe torch_dtype; a LoRA adapter in fp32;
                 `models.student.storage_dtype` for the frozen layers diffusers' layerwise casting stores)
    gradients    trainable elements x their bytes (DDP adds its gradient buckets: a second copy)
    optimizer    per trainable tensor, by optimizer (fv_accel.optim.optimizer_state_bytes)
    EMA          trainable elements x 4 (an fp32 shadow; `callbacks.ema.device: cpu` puts it in host memory)
    activations  what autograd keeps for the largest bucket the data can produce (wan_activation_bytes)

Sharding follows the launch: `accelerate launch` exports the engine (ACCELERATE_USE_FSDP /
ACCELERATE_USE_DEEPSPEED with ACCELERATE_DEEPSPEED_ZERO_STAGE), the mixed precision and WORLD_SIZE.
One process and DDP hold a full copy; FSDP2 divides parameters, gradients, optimizer state and the
EMA by the processes; DeepSpeed follows the ZeRO paper's accounting (bf16: 2-byte weights and
gradients, the fp32 master copy with the optimizer state; ZeRO-2 partitions gradients and optimizer,
ZeRO-3 the weights too).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from fv_accel.config import RunConfig

MIB = 2**20
GIB = 2**30

class EstimateUnavailable(Exception):
    """The estimate needs something the recipe does not reach (the model's config.json)."""


# --------------------------------------------------------------------------------------------
# Optimizer state
# --------------------------------------------------------------------------------------------


def optimizer_state_bytes(cfg: RunConfig, tensors: list[tuple[tuple[int, ...], int, bool]], itemsize: Optional[int] = None) -> float:
    """Optimizer state of the trainable `tensors` ((shape, element bytes, starts at zero) each) by
    fv_accel.optim.optimizer_state_bytes, the figure its tests check against the optimizers' real
    state; `itemsize` overrides every tensor's element size (DeepSpeed's fp32 master copy)."""
    from fv_accel.optim import optimizer_state_bytes as state_bytes

    opt = cfg.training.optimizer
    dtypes = {4: torch.float32, 2: torch.bfloat16, 1: torch.float8_e4m3fn}
    total = 0.0
    for size in sorted({itemsize or size for _, size, _ in tensors}):
        group = [(shape, zero) for shape, s, zero in tensors if (itemsize or s) == size]
        total += state_bytes(opt.name, [shape for shape, _ in group], dtypes[size], beta1=opt.betas[0], all_zero=[z for _, z in group])
    return total


# --------------------------------------------------------------------------------------------
# Activations of the Wan transformer
# --------------------------------------------------------------------------------------------
# What autograd saves for one Wan block (fv_accel/models/wan.py's per-frame block forward over
# diffusers' WanTransformerBlock: LayerNorm -> modulation -> self-attention with RMS q/k norms,
# RoPE and SDPA -> gated residual -> FP32LayerNorm -> cross-attention -> LayerNorm -> modulation ->
# GELU FFN -> gated residual), counted with torch.autograd.graph.saved_tensors_hooks (distinct
# storages) on CPU, in fp32 and under bf16 autocast, at several widths, FFN sizes and lengths:
#
#   per video token:  12 D x 4   (the fp32 norm / modulation / residual paths: `.float()` in the block)
#                   + 10 D x a   (q, k, v, their normed and rotated copies, attention output and
#                                 projections, cross-attention query path)
#                   +  2 F x a   (FFN hidden before and after GELU)
#                   + (9 + 2 heads) x 4   (norm statistics, attention log-sum-exp)
#   per text token:    D x (8 + 3 a)   (cross-attention keys and values)
#
# where D is the width, F the FFN width, a the activation bytes (4 in fp32; 2 under bf16). The
# transformer outside its blocks keeps the patchified input (tokens x C x patch x a), three [S, D]
# tensors of the output head (2 x 4 + a bytes), RoPE's cos/sin (S x head_dim x 4), and its text
# embedder's input and hidden states (text tokens x (text_dim + 3 D) x a), once.
# Under autocast every matmul also keeps a bf16 copy of a weight stored in another dtype
# (2 bytes a weight element; the autocast cache holds those of trainable weights until the
# forward ends, checkpointing or not). With gradient checkpointing (diffusers' per-block
# torch.utils.checkpoint) a block keeps only its input (S x D x a) and one block is recomputed at a
# time in the backward pass. The backward frees saved tensors as it makes gradients: the measured
# peak of a step (benchmarks/memory.py, CPU RSS) is the saved tensors plus the weight gradients,
# with no further working set (docs/performance.md).


@dataclass
class WanShape:
    width: int
    ffn: int
    heads: int
    head_dim: int
    layers: int
    in_channels: int
    patch: tuple[int, int, int]
    text_dim: int = 4096


def wan_block_bytes(shape: WanShape, tokens: int, text_tokens: int, act_bytes: int) -> float:
    """Bytes autograd saves for one Wan block (the formula above)."""
    d, f, a = shape.width, shape.ffn, act_bytes
    per_token = 12 * d * 4 + 10 * d * a + 2 * f * a + (9 + 2 * shape.heads) * 4
    return tokens * per_token + text_tokens * d * (8 + 3 * a)


def wan_activation_bytes(
    shape: WanShape,
    *,
    tokens: int,
    text_tokens: int,
    act_bytes: int,
    checkpointing: bool,
    weight_copy_bytes: float = 0.0,
    block_weight_copy_bytes: float = 0.0,
) -> dict[str, float]:
    """Activation memory of one forward + backward: the saved tensors at the end of the forward and
    the bf16 weight copies. `weight_copy_bytes`: the autocast copies the whole forward keeps;
    `block_weight_copy_bytes`: those a single block keeps (checkpointing frees the others)."""
    block = wan_block_bytes(shape, tokens, text_tokens, act_bytes)
    pt, ph, pw = shape.patch
    outside = tokens * (shape.in_channels * pt * ph * pw * act_bytes + shape.width * (8 + act_bytes) + shape.head_dim * 4)
    outside += text_tokens * (shape.text_dim + 3 * shape.width) * act_bytes
    if checkpointing:
        saved = shape.layers * tokens * shape.width * act_bytes + block
    else:
        saved = shape.layers * block
    return {
        "saved": saved + outside,
        "weight_copies": weight_copy_bytes,
        "block_weight_copies": block_weight_copy_bytes,
    }


# --------------------------------------------------------------------------------------------
# The launch
# --------------------------------------------------------------------------------------------


@dataclass
class Launch:
    engine: str  # NO, DDP, FSDP, DEEPSPEED
    processes: int
    zero_stage: int = 0
    mixed_precision: str = "no"
    mixed_precision_note: str = ""
    offload_optimizer: bool = False
    offload_params: bool = False
    fsdp_checkpointing: bool = False

    def describe(self) -> str:
        n = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        if self.engine == "DEEPSPEED":
            return f"{n}, DeepSpeed ZeRO-{self.zero_stage}"
        if self.engine == "FSDP":
            return f"{n}, FSDP2"
        return f"{n}, DDP" if self.processes > 1 else n


def launch_from_env(cfg: RunConfig, env: Mapping[str, str]) -> Launch:
    """The engine, processes and mixed precision this process runs with, as `accelerate launch`
    exports them (the engine by fv_accel.build.requested_engine, as the run itself reads it)."""
    from fv_accel.build import env_flag, requested_engine

    processes = int(env.get("WORLD_SIZE", "1") or 1)
    engine = requested_engine(env)
    mp = cfg.training.loop.mixed_precision
    note = ""
    if mp == "auto":
        launched = env.get("ACCELERATE_MIXED_PRECISION")
        if launched:
            mp, note = launched, "auto: the launch's"
        else:
            # The estimate is for the accelerator the run is meant for; a CPU-only run trains in fp32.
            mp, note = "bf16", "auto: bf16 on a GPU; a CPU run is fp32 (training.loop.mixed_precision no)"
    launch = Launch(engine=engine, processes=processes, mixed_precision=mp, mixed_precision_note=note)
    if engine == "DEEPSPEED":
        stage = env.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
        if ds_file and Path(ds_file).is_file():
            try:
                ds = json.loads(Path(ds_file).read_text())
                zero = ds.get("zero_optimization") or {}
                stage = zero.get("stage", stage)
                launch.offload_optimizer = (zero.get("offload_optimizer") or {}).get("device", "none") not in ("none", None)
                launch.offload_params = (zero.get("offload_param") or {}).get("device", "none") not in ("none", None)
            except (OSError, ValueError):
                pass
        launch.zero_stage = int(stage or 0)
        launch.offload_optimizer = launch.offload_optimizer or env.get("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", "none") not in ("none", "")
        launch.offload_params = launch.offload_params or env.get("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", "none") not in ("none", "")
    if engine == "FSDP":
        launch.offload_params = env_flag("FSDP_OFFLOAD_PARAMS", env)
        launch.offload_optimizer = launch.offload_params
        launch.fsdp_checkpointing = env_flag("FSDP_ACTIVATION_CHECKPOINTING", env)
    return launch


# --------------------------------------------------------------------------------------------
# The model, on the meta device
# --------------------------------------------------------------------------------------------


@dataclass
class ParamCensus:
    """Per-tensor facts of the transformer(s) a run trains."""

    total: int = 0
    trainable: int = 0
    param_bytes: float = 0.0  # as stored
    trainable_bytes: float = 0.0  # trainable tensors as stored
    trainable_tensors: list = field(default_factory=list)  # (shape, itemsize, starts at zero)
    matmul_weights_not_bf16: int = 0  # Linear/Conv weight elements stored in another dtype than bf16
    matmul_weights_trainable_not_bf16: int = 0
    matmul_outside_blocks_not_bf16: int = 0  # of those, outside the transformer blocks
    largest_block_params: int = 0
    largest_block_matmul_not_bf16: int = 0
    configs: list = field(default_factory=list)
    class_names: list = field(default_factory=list)
    sources: list = field(default_factory=list)


def _transformer_sources(cfg: RunConfig) -> list[tuple[Optional[dict], Optional[str]]]:
    """(inline config, or None with the subfolder of init_from to read) for each transformer trained."""
    st = cfg.models.student
    if st.init_from is None:
        return [(dict(st.transformer_config or {}), None)]
    if st.expert is not None:
        from fv_accel.models.wan import EXPERT_SUBFOLDERS

        if st.expert == "both":
            return [(None, EXPERT_SUBFOLDERS["high_noise"]), (None, EXPERT_SUBFOLDERS["low_noise"])]
        return [(None, EXPERT_SUBFOLDERS[st.expert])]
    return [(None, st.subfolder or None)]


# The published architectures of the Wan-family repos that the shipped recipes name (width, depth,
# heads, FFN and channels as released by their authors, in diffusers' config keys; VAE compression
# in time and space), for an estimate before anything is downloaded: used only when the repo's own
# config.json is in neither a local folder nor the Hugging Face cache, and the estimate says so.
_WAN_COMMON = dict(
    patch_size=[1, 2, 2], attention_head_dim=128, text_dim=4096, freq_dim=256, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
_WAN_1_3B = dict(_WAN_COMMON, num_attention_heads=12, ffn_dim=8960, num_layers=30, in_channels=16, out_channels=16)
_WAN_14B = dict(_WAN_COMMON, num_attention_heads=40, ffn_dim=13824, num_layers=40, in_channels=16, out_channels=16)
_LTX2_0 = dict(
    _class_name="LTX2VideoTransformer3DModel", in_channels=128, out_channels=128, num_attention_heads=32,
    attention_head_dim=128, cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
    audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048, num_layers=48,
    caption_channels=3840,
)
PUBLISHED_ARCHITECTURES: dict[str, tuple[dict, tuple[int, int]]] = {
    "Wan-AI/Wan2.1-T2V-1.3B-Diffusers": (dict(_WAN_1_3B, _class_name="WanTransformer3DModel"), (4, 8)),
    "Wan-AI/Wan2.1-T2V-14B-Diffusers": (dict(_WAN_14B, _class_name="WanTransformer3DModel"), (4, 8)),
    "Wan-AI/Wan2.1-I2V-14B-480P-Diffusers": (
        dict(_WAN_14B, _class_name="WanTransformer3DModel", in_channels=36, image_dim=1280, added_kv_proj_dim=5120), (4, 8)
    ),
    "Wan-AI/Wan2.2-T2V-A14B-Diffusers": (dict(_WAN_14B, _class_name="WanTransformer3DModel"), (4, 8)),
    "Wan-AI/Wan2.2-I2V-A14B-Diffusers": (dict(_WAN_14B, _class_name="WanTransformer3DModel", in_channels=36), (4, 8)),
    "Wan-AI/Wan2.2-TI2V-5B-Diffusers": (
        dict(_WAN_COMMON, _class_name="WanTransformer3DModel", num_attention_heads=24, ffn_dim=14336, num_layers=30,
             in_channels=48, out_channels=48), (4, 16)
    ),
    "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers": (dict(_WAN_1_3B, _class_name="SkyReelsV2Transformer3DModel"), (4, 8)),
    # LTX-2.0 as diffusers' conversion script (scripts/convert_ltx2_to_diffusers.py, version "2.0")
    # writes it; the other keys are the class defaults that script also sets.
    "Lightricks/LTX-2": (_LTX2_0, (8, 32)),
    # LTX-2.3 as that script (version "2.3") writes it: LTX-2.0's widths, gated attention, prompt
    # modulation, split RoPE, STG's perturbed attention, no caption projection.
    **{
        repo: (
            dict(
                _LTX2_0, gated_attn=True, cross_attn_mod=True, audio_gated_attn=True, audio_cross_attn_mod=True,
                rope_type="split", use_prompt_embeddings=False, perturbed_attn=True,
            ),
            (8, 32),
        )
        for repo in ("diffusers/LTX-2.3-Diffusers", "diffusers/LTX-2.3-Distilled-Diffusers")
    },
    # Kandinsky 5.0 T2V Lite 5 s (transformer/config.json of the diffusers repo; HunyuanVideo's VAE).
    "kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers": (
        dict(
            _class_name="Kandinsky5Transformer3DModel", in_visual_dim=16, out_visual_dim=16, in_text_dim=3584,
            in_text_dim2=768, time_dim=512, patch_size=[1, 2, 2], model_dim=1792, ff_dim=7168, num_text_blocks=2,
            num_visual_blocks=32, axes_dims=[16, 24, 24], visual_cond=True, attention_type="regular",
        ),
        (4, 8),
    ),
    # MiniMax-H3 (33B) as diffusers' conversion script (scripts/convert_minimax_h3_to_diffusers.py) writes its
    # transformer/config.json; its video VAE compresses 16x in space and 17 n + 5 frames to 5 n + 2 (about 4x in time).
    "MiniMaxAI/MiniMax-H3": (
        dict(
            _class_name="MiniMaxH3Transformer3DModel", num_attention_heads=56, attention_head_dim=128, hidden_size=5376,
            num_layers=50, num_refiner_layers=2, ffn_dim=14336, in_channels=24, audio_in_channels=32, patch_size=[1, 2, 2],
            text_dim=5120, freq_dim=256, time_embed_hidden_dim=5376, time_embed_dim=2688, rope_freq_dim=16,
            rope_theta=10000.0, norm_eps=1e-05, qk_norm_eps=1e-05, final_norm_eps=1e-05,
        ),
        (4, 16),
    ),
}


def read_transformer_configs(cfg: RunConfig) -> list[tuple[dict, str]]:
    """(config, where) of each transformer the run trains: inline, or the init_from's config.json
    (a local folder or the Hugging Face cache; HF_HUB_OFFLINE honoured). Raises EstimateUnavailable."""
    st = cfg.models.student
    out = []
    for inline, subfolder in _transformer_sources(cfg):
        if inline is not None:
            out.append((inline, "models.student.transformer_config"))
            continue
        files = f"{subfolder + '/' if subfolder else ''}config.json vae/config.json"
        missing = EstimateUnavailable(
            f"needs the transformer's config.json ({st.init_from}/{subfolder or '.'}/config.json), not in the local "
            f"folder or Hugging Face cache: `hf download {st.init_from} {files}` (a few KB, no weights) and run again"
        )
        published = PUBLISHED_ARCHITECTURES.get(st.init_from)
        fallback = (dict(published[0]), f"the published architecture of {st.init_from} (its config.json could not be read)") if published else None
        if not _config_reachable(st.init_from, subfolder, st.revision):
            if fallback is not None:
                out.append(fallback)
                continue
            raise missing  # said before the model families (diffusers) are imported
        from fv_accel.models.loading import ModelLoadError, fetch_config

        try:
            config = fetch_config(st.init_from, subfolder, revision=st.revision, required=True)
        except ModelLoadError:
            if fallback is not None:
                out.append(fallback)
                continue
            raise missing from None
        out.append((config, f"{st.init_from}/{subfolder or '.'}/config.json"))
    return out


def _config_reachable(model: str, subfolder: Optional[str], revision: Optional[str]) -> bool:
    """Whether `<subfolder>/config.json` of a local folder or Hub id can be read: False only when it is
    certainly not (offline and not in the Hugging Face cache)."""
    if Path(model).exists():
        return True
    from fv_accel.hub_access import offline_unless_hub_answers

    if not offline_unless_hub_answers():
        return True  # fetched (a few KB) by fetch_config
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(model, f"{subfolder}/config.json" if subfolder else "config.json", revision=revision)
    except Exception:
        return True  # not a Hub id: fetch_config says so
    return isinstance(found, str)


def _transformer_class(cfg: RunConfig, config: dict) -> tuple[type, type]:
    """(model family, transformer class) of a transformer config."""
    from fv_accel.models import family_for_class_name, family_of

    st = cfg.models.student
    if st.init_from is None or st.model_class != "auto":
        family = family_of(cfg)
        classes = family.transformer_classes
        kind = next(iter(classes)) if st.model_class == "auto" else st.model_class
        return family, classes[kind]
    name = config.get("_class_name")
    family = family_for_class_name(name)
    if family is None:
        raise EstimateUnavailable(f"transformer class {name!r} of {st.init_from} belongs to no registered family")
    return family, next(cls for cls in family.transformer_classes.values() if cls.__name__ == name)


def build_meta_transformer(cfg: RunConfig, config: dict) -> torch.nn.Module:
    """The transformer as training builds it (dtype, storage dtype, LoRA), with meta tensors."""
    from accelerate import init_empty_weights

    from fv_accel.models.loading import DTYPES

    st = cfg.models.student
    family, cls = _transformer_class(cfg, config)
    with init_empty_weights():
        model = cls.from_config(dict(config))
    dtype = DTYPES[st.torch_dtype]
    if dtype != torch.float32:
        # As loading does: from_pretrained keeps the class's `_keep_in_fp32_modules` in fp32 (an
        # inline config casts everything, as fv_accel.models.student does).
        keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ()) if st.init_from is not None else ()
        for name, module in model.named_modules():
            if not any(part in keep for part in name.split(".")):
                for p in module.parameters(recurse=False):
                    p.data = p.data.to(dtype)
    if cfg.training.vsa.enabled:  # the gates of video sparse attention: one Linear(dim, dim) per block
        from fv_accel.vsa import enable_vsa

        enable_vsa(model, cfg.training.vsa.sparsity)
    storage = st.storage_dtype
    if storage:
        try:
            model.enable_layerwise_casting(storage_dtype=getattr(torch, storage), compute_dtype=torch.bfloat16)
        except Exception as err:  # a diffusers without layerwise casting for this class
            raise EstimateUnavailable(f"models.student.storage_dtype {storage}: {err}") from None
    if st.lora.enable:
        from fv_accel.models.lora import peft_lora_config, with_default_targets

        lora = dataclasses.replace(with_default_targets(st.lora, family.default_lora_targets(config, st)), init="default")
        model.requires_grad_(False)
        with init_empty_weights():
            model.add_adapter(peft_lora_config(lora), adapter_name="default")
        from fv_accel.vsa import is_gate_key

        for name, p in model.named_parameters():
            if is_gate_key(name):  # VSA's gates train fully beside the adapter
                p.requires_grad_(True)
            if p.requires_grad:  # the adapter trains in fp32 (diffusers' cast_training_params)
                p.data = p.data.to(torch.float32)
    else:
        model.requires_grad_(True)
    return model


def census(cfg: RunConfig) -> ParamCensus:
    c = ParamCensus()
    lora_zero_b = cfg.models.student.lora.init != "pissa"
    for config, where in read_transformer_configs(cfg):
        model = build_meta_transformer(cfg, config)
        c.configs.append(config)
        c.class_names.append(type(model).__name__)
        c.sources.append(where)
        for name, p in model.named_parameters():
            n, size = p.numel(), p.element_size()
            c.total += n
            c.param_bytes += n * size
            if p.requires_grad:
                c.trainable += n
                c.trainable_bytes += n * size
                c.trainable_tensors.append((tuple(p.shape), size, lora_zero_b and "lora_B" in name))
        blocks = getattr(model, "blocks", None) or getattr(model, "transformer_blocks", None) or []
        in_blocks = {id(m) for block in blocks for m in block.modules()}
        for module in model.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Conv3d, torch.nn.Conv2d)) and module.weight.dtype != torch.bfloat16:
                numel = module.weight.numel()
                c.matmul_weights_not_bf16 += numel
                if module.weight.requires_grad:
                    c.matmul_weights_trainable_not_bf16 += numel
                if id(module) not in in_blocks:
                    c.matmul_outside_blocks_not_bf16 += numel
        for block in blocks:
            c.largest_block_params = max(c.largest_block_params, sum(p.numel() for p in block.parameters()))
            c.largest_block_matmul_not_bf16 = max(
                c.largest_block_matmul_not_bf16,
                sum(m.weight.numel() for m in block.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype != torch.bfloat16),
            )
    return c


# --------------------------------------------------------------------------------------------
# The largest bucket
# --------------------------------------------------------------------------------------------


@dataclass
class Bucket:
    latent: tuple[int, int, int, int]  # C, T, H, W
    batch: int
    tokens: int
    text_tokens: int
    source: str


def _vae_factors_of_model(cfg: RunConfig) -> tuple[int, int, str]:
    """(temporal, spatial) compression of the student's VAE: its vae/config.json where reachable
    (Wan 2.2's records them; AutoencoderKLWan's defaults are 4 and 8), else Wan 2.1's."""
    from fv_accel.data.loader import VAE_SPATIAL, VAE_TEMPORAL

    st = cfg.models.student
    if st.init_from is None:
        return VAE_TEMPORAL, VAE_SPATIAL, "Wan 2.1 VAE: 4x time, 8x space"
    published = PUBLISHED_ARCHITECTURES.get(st.init_from)
    if published is None or _config_reachable(st.init_from, "vae", st.revision):
        from fv_accel.models import family_of
        from fv_accel.models.loading import ModelLoadError

        try:
            spec = family_of(cfg).encoding_spec(st.init_from, st.revision)
        except (ModelLoadError, ValueError, KeyError):
            if published is None:
                raise EstimateUnavailable(
                    f"activations need the VAE's compression from {st.init_from}/vae/config.json, not in the local folder "
                    f"or Hugging Face cache: `hf download {st.init_from} vae/config.json`"
                ) from None
        else:
            return int(spec.scale_factor_temporal), int(spec.scale_factor_spatial), f"{st.init_from}'s VAE"
    t, hw = published[1]
    return t, hw, f"{st.init_from}'s VAE as published ({t}x time, {hw}x space)"


def largest_bucket(cfg: RunConfig, patch: tuple[int, int, int], channels: int) -> Bucket:
    """The largest latent one step can get: the dataset's largest row shape that the recipe's
    num_latent_t / num_frames / num_height / num_width keep, those keys themselves where the data
    is not here, or the tiny clips through the tiny (Wan 2.1) VAE."""
    from fv_accel.data.loader import VAE_SPATIAL, VAE_TEMPORAL, wanted_latent_shape

    data = cfg.training.data
    pt, ph, pw = patch

    def tokens(shape: tuple[int, ...]) -> int:
        return (shape[1] // pt) * (shape[2] // ph) * (shape[3] // pw)

    text_tokens = data.text_max_length  # text embeddings are padded to it
    batch = data.train_batch_size
    path = data.data_path
    shapes: list[tuple[int, ...]] = []
    source = ""
    if path == "tiny":
        t = (data.tiny_num_frames - 1) // VAE_TEMPORAL + 1
        shapes = [(channels, t, data.tiny_height // VAE_SPATIAL, data.tiny_width // VAE_SPATIAL)]
        temporal, spatial = VAE_TEMPORAL, VAE_SPATIAL
        source = f"tiny clips {data.tiny_num_frames} frames {data.tiny_height}x{data.tiny_width}"
    else:
        from fv_accel.data.schema import local_dataset_path

        try:
            local = local_dataset_path(path)
        except Exception:
            local = None
        if local is not None and Path(local).exists():
            from fv_accel.data.loader import LatentDataset, vae_factors

            try:
                for p in [local] + [m["data_path"] for m in data.mix]:
                    # (a text-only dataset has none: the rollout's shape is the recipe's num_* keys)
                    shapes += [tuple(s) for s in LatentDataset(p).latent_shapes]
                temporal, spatial = vae_factors(local)
                source = f"dataset {path}"
            except Exception:
                shapes = []
        if not shapes:
            temporal, spatial, vae = _vae_factors_of_model(cfg)
            wanted = wanted_latent_shape(data, temporal, spatial)
            if set(wanted) != {"T", "H", "W"}:
                where = "holds no latents (text-only)" if local is not None and Path(local).exists() else "is not here"
                raise EstimateUnavailable(
                    f"activations need the latent size: training.data.data_path {where} and "
                    "training.data.num_latent_t (or num_frames) / num_height / num_width are not all set"
                )
            shapes = [(channels, wanted["T"][1], wanted["H"][1], wanted["W"][1])]
            source = f"training.data.num_* ({vae})"
    wanted = wanted_latent_shape(data, temporal, spatial)
    axis = {"T": 1, "H": 2, "W": 3}
    kept = [s for s in shapes if all(s[axis[a]] == size for a, (_, size) in wanted.items())] or shapes
    best = max(kept, key=tokens)
    return Bucket(tuple(int(x) for x in best), batch, batch * tokens(best), batch * text_tokens, source)


# --------------------------------------------------------------------------------------------
# The estimate
# --------------------------------------------------------------------------------------------


@dataclass
class MemoryEstimate:
    launch: Launch
    census: ParamCensus
    parameters: float
    gradients: float
    optimizer: float
    ema: float
    activations: Optional[float]
    host: dict
    bucket: Optional[Bucket]
    optimizer_name: str
    checkpointing: bool
    activation_note: str = ""
    activation_parts: dict = field(default_factory=dict)
    notes: list = field(default_factory=list)

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.ema + (self.activations or 0.0)


def _wan_shape(config: dict) -> Optional[WanShape]:
    needed = ("num_attention_heads", "attention_head_dim", "ffn_dim", "num_layers")
    if not all(k in config for k in needed):
        return None
    heads, hd = int(config["num_attention_heads"]), int(config["attention_head_dim"])
    patch = config.get("patch_size", [1, 2, 2])
    return WanShape(
        width=heads * hd,
        ffn=int(config["ffn_dim"]),
        heads=heads,
        head_dim=hd,
        layers=int(config["num_layers"]),
        in_channels=int(config.get("in_channels", 16)),
        patch=tuple(int(p) for p in patch),
        text_dim=int(config.get("text_dim", 4096)),
    )


def estimate_memory(cfg: RunConfig, env: Optional[Mapping[str, str]] = None) -> MemoryEstimate:
    """The per-process estimate for a recipe under the launch in `env` (os.environ by default).
    A distillation recipe adds its other roles: the critic as a second trained model (parameters,
    gradients, its optimizer's state, the activations of its own backward, held at the same time as
    the student's), the frozen teacher's parameters."""
    from fv_accel.config import DISTILLATION_METHODS, ConfigError, check_role_runs, role_config

    try:
        check_role_runs(cfg)
    except ConfigError as err:
        raise EstimateUnavailable(str(err)) from None
    if cfg.method.name == "diffusion_nft":
        # A training micro-batch is method.train_batch_size samples (else the sampling batch's).
        mc = cfg.method
        micro = int(mc.train_batch_size or mc.sample_train_batch_size or cfg.training.data.train_batch_size)
        data = dataclasses.replace(cfg.training.data, train_batch_size=micro)
        est = _estimate_role(dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, data=data)), env)
        _add_reward_roles(cfg, est, env)
        return est
    est = _estimate_role(cfg, env)
    if cfg.method.name == "causal_cd":
        _add_frozen_roles(cfg, est, env, ("teacher", "ema"), "causal_cd")
        return est
    if cfg.method.name in ("kd", "kd_causal"):  # the teacher, whole on each process while it writes the KD cache
        _add_frozen_roles(cfg, est, env, ("teacher",), cfg.method.name)
        return est
    if cfg.method.name not in DISTILLATION_METHODS:
        return est
    described = []
    for role in ("critic", "teacher"):
        other = _estimate_role(role_config(cfg, role), env)
        est.parameters += other.parameters
        if role == "critic":
            est.gradients += other.gradients
            est.optimizer += other.optimizer
            if est.activations is not None and other.activations is not None:
                est.activations += other.activations
            described.append(f"critic {other.census.total:,} parameters ({other.census.trainable:,} trained, its own optimizer)")
        else:
            described.append(f"frozen teacher {other.census.total:,} parameters (no gradient, no optimizer state)")
    est.notes.append("distillation: the student's figures plus the " + " and the ".join(described))
    if cfg.method.name == "self_forcing":
        _add_kv_cache(cfg, est)
    return est


def _add_frozen_roles(cfg: RunConfig, est: MemoryEstimate, env: Optional[Mapping[str, str]], roles: tuple[str, ...],
                      method: str) -> None:
    """Frozen whole-model roles beside the student (causal CD's teacher and EMA): their parameters only."""
    from fv_accel.config import role_config

    counted = []
    for role in roles:
        if role == "ema" and cfg.models.student.lora.enable:  # a second adapter over the student's base
            est.parameters += est.census.trainable_bytes
            counted.append(f"frozen ema adapter {est.census.trainable:,} parameters")
            continue
        other = _estimate_role(role_config(cfg, role), env)
        est.parameters += other.parameters
        counted.append(f"frozen {role} {other.census.total:,} parameters")
    est.notes.append(f"{method}: the student's figures plus the " + " and the ".join(counted) + " (no gradient, no optimizer state)")


def _add_reward_roles(cfg: RunConfig, est: MemoryEstimate, env: Optional[Mapping[str, str]]) -> None:
    """Reward training: the old policy and the reference, frozen. With a LoRA student both are
    adapters over its one base (a second adapter's parameters; the reference adds nothing); in full
    fine-tuning each is a whole copy of the model. The reward models' parameters are counted where
    the recipe's rewards can be built here (a built-in model found locally); a user's function has none."""
    from fv_accel.config import role_config

    c = est.census
    if cfg.models.student.lora.enable:
        est.parameters += c.trainable_bytes
        est.notes.append(
            f"diffusion_nft: one base; the old policy a second adapter ({c.trainable:,} parameters, frozen), "
            "the reference the base with adapters off"
        )
    else:
        for role in ("old", "reference"):
            other = _estimate_role(role_config(cfg, role), env)
            est.parameters += other.parameters
        est.notes.append(f"diffusion_nft: the old policy and the reference, two frozen copies of {c.total:,} parameters")
    est.notes.append("diffusion_nft: " + _reward_model_note(cfg))


def _reward_model_note(cfg: RunConfig) -> str:
    """The reward models' parameters, counted from their config.json (a local folder or the Hugging
    Face cache; no weights are read or fetched), or the command that fetches the config."""
    from fv_accel.rewards.spec import parse_reward_fn

    spec = parse_reward_fn(cfg.method.reward_fn)
    parts = []
    for entry in spec.entries:
        model = entry.options.get("model")  # the built-in model rewards' (defaults filled in)
        if model is None:
            parts.append(f"{entry.name}: no model")
            continue
        count = _clip_parameters(str(model), entry.options.get("revision"))
        size = 2 if entry.options.get("dtype") == "bfloat16" else 4
        parts.append(f"{entry.name} {model}: " + (f"{count:,} parameters, {fmt_bytes(count * size)} (inference only)" if count
                     else f"not counted: its config.json is not here (`hf download {model} config.json`)"))
    return "rewards: " + "; ".join(parts)


def _clip_parameters(model: str, revision: Optional[str]) -> int:
    """Parameters of the CLIP model at `model` from its config alone (built on the meta device); 0
    when its config.json is in neither the folder nor the cache."""
    folder = Path(model)
    path: Any = folder / "config.json" if folder.is_dir() else None
    if path is None:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
    if not isinstance(path, (str, Path)) or not Path(path).is_file():
        return 0
    from transformers import CLIPConfig, CLIPModel

    with torch.device("meta"):
        clip = CLIPModel(CLIPConfig.from_pretrained(str(Path(path).parent)))
    return sum(p.numel() for p in clip.parameters())


def _add_kv_cache(cfg: RunConfig, est: MemoryEstimate) -> None:
    """Self-Forcing's rollout holds the KV cache of the finished chunks (every layer's keys and
    values of all but the last chunk, or of the student's window) beside the exit steps' activations."""
    from fv_accel.config import parse_chunk_size

    shape = _wan_shape(est.census.configs[0]) if est.census.configs else None
    if est.bucket is None or shape is None or est.activations is None:
        est.notes.append("self_forcing: the KV cache of the rollout is not estimated (no Wan shape or data bucket)")
        return
    _, frames, _, _ = est.bucket.latent
    chunk = parse_chunk_size(cfg.method.chunk_size)
    cached = max(frames - chunk, 0)
    st = cfg.models.student
    if st.local_attn_size > 0:
        cached = min(cached, st.local_attn_size - chunk + st.sink_size)
    tokens_per_frame = est.bucket.tokens // max(frames // shape.patch[0], 1)  # the batch's
    act_bytes = 2 if est.launch.mixed_precision in ("bf16", "fp16") else 4
    kv = 2.0 * shape.layers * cached * tokens_per_frame * shape.width * act_bytes
    est.activations += kv
    est.activation_parts = {**est.activation_parts, "kv_cache": kv}
    est.notes.append(f"self_forcing: KV cache of {cached} latent frames x {shape.layers} layers, {fmt_bytes(kv)}, in activations")


def _estimate_role(cfg: RunConfig, env: Optional[Mapping[str, str]] = None) -> MemoryEstimate:
    """One model's estimate: `models.student` of `cfg` (a role's recipe from `role_config`)."""
    env = os.environ if env is None else env
    launch = launch_from_env(cfg, env)
    c = census(cfg)
    opt_name = cfg.training.optimizer.name
    notes: list[str] = [f"transformer: {where}" for where in dict.fromkeys(c.sources) if where.startswith("the published")]
    low = launch.mixed_precision in ("bf16", "fp16")
    frozen_bytes = c.param_bytes - c.trainable_bytes
    params, grads, opt_state = _model_state_bytes(cfg, launch, c, low, notes)
    host: dict[str, float] = {}
    ema = _ema_bytes(cfg, launch, c, host, notes)
    if launch.offload_optimizer:
        host["optimizer"] = opt_state
        opt_state = 0.0
    if launch.offload_params and (launch.engine == "FSDP" or (launch.engine == "DEEPSPEED" and launch.zero_stage >= 3)):
        host["parameters"] = params
        params = 0.0

    checkpointing = cfg.training.model.enable_gradient_checkpointing_type == "full" or launch.fsdp_checkpointing
    activations, bucket, note, parts = _activation_estimate(cfg, launch, c, low, checkpointing, notes)
    return MemoryEstimate(
        launch=launch,
        census=c,
        parameters=params,
        gradients=grads,
        optimizer=opt_state,
        ema=ema,
        activations=activations,
        host=host,
        bucket=bucket,
        optimizer_name=opt_name,
        checkpointing=checkpointing,
        activation_note=note,
        activation_parts=parts,
        notes=notes + ([] if frozen_bytes == 0 else [f"frozen base stored in {_dtype_word(cfg)}"]),
    )


def _model_state_bytes(cfg: RunConfig, launch: Launch, c: ParamCensus, low: bool, notes: list[str]) -> tuple[float, float, float]:
    """Per process: (parameters, gradients, optimizer state) bytes under the launch's engine."""
    n = launch.processes
    # Under DeepSpeed the optimizer state is computed on fp32 elements (ZeRO's master copy, below).
    opt_state = optimizer_state_bytes(cfg, c.trainable_tensors, itemsize=4 if launch.engine == "DEEPSPEED" else None)
    if launch.engine == "DEEPSPEED":
        # ZeRO (Rajbhandari et al.): with bf16 the module holds 2-byte weights and gradients and
        # the optimizer an fp32 master copy with its state, computed on fp32 elements.
        weight_bytes = 2 if low else 4
        if low:
            opt_state += 4 * c.trainable
        params = c.total * weight_bytes if low else c.param_bytes
        grads = c.trainable * weight_bytes
        grads = grads / n
        opt_state = opt_state / n
        if launch.zero_stage >= 3:
            params = params / n
        elif launch.zero_stage < 2:
            grads = grads * n
        notes.append(f"DeepSpeed ZeRO-{launch.zero_stage}: {'bf16 weights and gradients, fp32 master in the optimizer' if low else 'fp32'}")
    elif launch.engine == "FSDP":
        params = c.param_bytes / n
        grads = c.trainable_bytes / n
        opt_state = opt_state / n
        notes.append("FSDP2: parameters, gradients, optimizer state and EMA sharded over the processes")
    else:
        params = c.param_bytes
        grads = c.trainable_bytes
        if launch.engine == "DDP":
            grads *= 2
            notes.append("DDP: gradients counted twice (its gradient buckets, gradient_as_bucket_view off)")
    return params, grads, opt_state


def _ema_bytes(cfg: RunConfig, launch: Launch, c: ParamCensus, host: dict[str, float], notes: list[str]) -> float:
    """The EMA's bytes per process on the accelerator (on the host: in `host`)."""
    ema = 0.0
    if cfg.callbacks.ema.enable:
        if launch.engine == "DEEPSPEED" and launch.zero_stage >= 3:
            notes.append("EMA: refused under ZeRO-3")
        else:
            ema = 4.0 * c.trainable / (launch.processes if launch.engine == "FSDP" else 1)
            if cfg.callbacks.ema.device == "cpu":
                host["EMA"] = ema
                ema = 0.0
    return ema


def _activation_estimate(
    cfg: RunConfig, launch: Launch, c: ParamCensus, low: bool, checkpointing: bool, notes: list[str]
) -> tuple[Optional[float], Optional[Bucket], str, dict]:
    """(activation bytes or None, the largest bucket, why not estimated, the activation parts):
    the Wan transformer's formula on the largest bucket of the data."""
    activations: Optional[float] = None
    bucket: Optional[Bucket] = None
    note = ""
    parts: dict = {}
    shapes = [_wan_shape(config) for config in c.configs]
    wan_family = all(name in ("WanTransformer3DModel", "SkyReelsV2Transformer3DModel") for name in c.class_names)
    if not wan_family or shapes[0] is None:
        note = f"activations not estimated: the formula is the Wan transformer's ({', '.join(sorted(set(c.class_names)))})"
        return activations, bucket, note, parts
    shape = shapes[0]
    try:
        bucket = largest_bucket(cfg, shape.patch, shape.in_channels)
    except EstimateUnavailable as err:
        note = str(err)
    if bucket is None:
        return activations, bucket, note, parts
    # DeepSpeed casts the module to bf16 (no autocast); FSDP2 computes with bf16 copies of
    # one or two blocks at a time; elsewhere autocast keeps bf16 copies of non-bf16 weights.
    act_bytes = 2 if low else 4
    copies = block_copies = 0.0
    if low and launch.engine == "FSDP":
        block_copies = 2 * 2 * c.largest_block_params
    elif low and launch.engine != "DEEPSPEED":
        # Saved for the backward: every copy; with checkpointing those outside the blocks
        # and one recomputed block's. The autocast cache keeps the trainable ones' copies
        # through the forward either way.
        if checkpointing:
            copies = 2.0 * max(c.matmul_weights_trainable_not_bf16, c.matmul_outside_blocks_not_bf16)
            block_copies = 2.0 * c.largest_block_matmul_not_bf16
        else:
            copies = 2.0 * c.matmul_weights_not_bf16
    # Context parallelism splits each sequence's video tokens over ulysses x ring processes.
    cp = cfg.training.model.context_parallel.degree
    if cp > 1:
        notes.append(f"context parallel degree {cp}: {math.ceil(bucket.tokens / cp):,} video tokens a process")
    parts = wan_activation_bytes(
        shape,
        tokens=math.ceil(bucket.tokens / cp),
        text_tokens=bucket.text_tokens,
        act_bytes=act_bytes,
        checkpointing=checkpointing,
        weight_copy_bytes=copies,
        block_weight_copy_bytes=block_copies,
    )
    activations = sum(parts.values())
    if checkpointing and copies > 0.05 * activations:
        notes.append(
            "components summed: with checkpointing the autocast weight copies (forward) and the gradients "
            "(backward) are not all alive at once, so the peak can be lower by up to the smaller of the two"
        )
    if len(shapes) > 1:
        notes.append("two experts: activations of the one a step runs")
    return activations, bucket, note, parts


def _dtype_word(cfg: RunConfig) -> str:
    st = cfg.models.student
    return st.storage_dtype or st.torch_dtype


def fmt_bytes(x: float) -> str:
    if x >= GIB:
        return f"{x / GIB:.2f} GiB"
    return f"{x / MIB:.1f} MiB"


def format_estimate(est: MemoryEstimate, cfg: RunConfig) -> list[str]:
    st = cfg.models.student
    c = est.census
    what = f"LoRA rank {st.lora.rank} ({c.trainable:,} of {c.total:,} parameters trainable)" if st.lora.enable else (
        f"full fine-tune ({c.total:,} parameters)"
    )
    master = {
        "float32": "fp32 weights",
        "bfloat16": "bf16 weights",
        "float16": "fp16 weights",
    }[st.torch_dtype]
    if st.storage_dtype:
        master += f" ({st.storage_dtype} storage of the frozen layers)"
    mp = est.launch.mixed_precision
    mp_text = {"no": "fp32 compute", "bf16": "bf16 autocast", "fp16": "fp16 autocast"}.get(mp, mp)
    if est.launch.engine == "DEEPSPEED" and mp in ("bf16", "fp16"):
        mp_text = f"{mp} module"
    head = (
        f"# memory estimate per process ({est.launch.describe()}, {what}, {master}, {mp_text}, "
        f"{est.optimizer_name}, checkpointing {'on' if est.checkpointing else 'off'}"
    )
    if est.bucket is not None:
        b = est.bucket
        head += f", largest bucket {'x'.join(map(str, b.latent))} latent = {b.tokens // b.batch:,} tokens, batch {b.batch}"
    head += "):"
    cols = [
        ("parameters", est.parameters),
        ("gradients", est.gradients),
        ("optimizer", est.optimizer),
        ("EMA", est.ema),
        ("activations", est.activations),
    ]
    body = " | ".join(f"{name} {'-' if v is None else fmt_bytes(v)}" for name, v in cols)
    lines = [head, f"#   {body} | total {fmt_bytes(est.total)}{'' if est.activations is not None else ' (without activations)'}"]
    if est.host:
        lines.append("#   in host memory: " + ", ".join(f"{k} {fmt_bytes(v)}" for k, v in est.host.items()))
    if est.activation_note:
        lines.append(f"#   {est.activation_note}")
    assumptions = []
    if est.launch.mixed_precision_note:
        assumptions.append(f"mixed precision {est.launch.mixed_precision_note}")
    if est.bucket is not None:
        assumptions.append(f"bucket from {est.bucket.source}")
        p = est.activation_parts
        act = f"activations = saved tensors {fmt_bytes(p['saved'])}"
        if p.get("weight_copies") or p.get("block_weight_copies"):
            act += f" + bf16 weight copies {fmt_bytes(p['weight_copies'] + p['block_weight_copies'])}"
        assumptions.append(act)
    assumptions += est.notes
    if est.launch.processes == 1 and est.launch.engine == "NO":
        assumptions.append("run under `accelerate launch --config_file ...` for the per-process figures of a multi-process engine")
    assumptions.append("not counted: the CUDA context, allocator fragmentation, the data loader, validation sampling")
    lines.append("#   assumptions: " + "; ".join(assumptions))
    return lines


def dry_run_lines(cfg: RunConfig, env: Optional[Mapping[str, str]] = None) -> list[str]:
    """The estimate as YAML comment lines (the dry-run's output stays a valid recipe)."""
    extra: list[str] = []
    if cfg.method.name in ("kd", "kd_causal"):  # the teacher-trajectory cache on disk
        from fv_accel.methods.knowledge_distillation.cache import dry_run_lines as kd_cache_lines

        extra = kd_cache_lines(cfg)
    try:
        est = estimate_memory(cfg, env)
    except EstimateUnavailable as err:
        return [f"# memory estimate: {err}", *extra]
    return format_estimate(est, cfg) + extra
