"""Writes tests/data/nft_fastvideo_golden.json: what FastVideo 0.2.1's own DiffusionNFT computes with
stand-in role transformers, a stand-in decode, stand-in rewards and a stand-in prompt dataset
(tests/nft_standins.py), for fv_accel's NFT parity test.

What runs is FastVideo's: `DiffusionNFTMethod` (its real constructor, `on_train_start` and
`managed_train_step`: K-repeat prompt selection, sampling with `DiffusionSampler` (ode and
sde_reflow, model_default and flow_match_euler schedulers), `MultiRewardScorer`, the per-prompt
advantages, the shuffles, the NFT loss, gradient accumulation, the old-policy decay, the reward
metrics), `TrainingMethod.on_train_start` (seeding, `cuda_generator`), the Wan plugin (`prepare_batch`
with its two draws, `predict_noise`, `predict_x0`, `add_noise`, `backward`),
`collate_rows_from_parquet_schema` with FastVideo's text-only parquet schema,
`build_optimizer_and_scheduler` (AdamW, constant LR), `clip_grad_norm_while_handling_failing_dtensor_cases`
and `EMA_FSDP` (both run on the CPU without a process group: the script checks that the clip did
clip and was not silently skipped).

A stand-in role is make_dmd2_golden's stand-in Wan plugin with FastVideo's own `predict_noise` and
`backward` put back, whose transformer is a module holding one trainable parameter `w` (shape [1],
initial W_INIT) and whose forward, given FastVideo's hidden_states [B, C, T, H, W] and the timestep,
is `nft_standin_predict`; `decode_latents` is `nft_standin_media` (permuted from FastVideo's
[B, T, C, H, W]). Stubbed or replaced (on top of make_dmd2_golden's installer):
- `fastvideo.dataset` is entered as a namespace package (its `__init__` imports torchvision) and
  `fastvideo.dataset.parquet_dataset_map_style` (pyarrow files, torchdata, distributed) is a stub
  that raises if called; the method module's `read_row_from_parquet_file` is replaced by a reader of
  the stand-in rows (row dicts in the parquet layout: text_embedding bytes/shape/dtype, caption, id).
- `fastvideo.distributed.get_world_group` answers rank 0 of 1 and `fastvideo.utils.set_random_seed`
  is FastVideo's base `Platform.seed_everything` (what `set_random_seed` calls on a CPU platform).
- the method module's `build_multi_reward_scorer` passes the stand-in rewards as `scorers`
  (FASTVIDEO_REWARD_NAMES: pickscore -> r_mean, clipscore -> r_first); FastVideo's own
  `build_multi_reward_scorer` and `MultiRewardScorer` run.
Everything runs in fp32 on the CPU (Wan trains in bf16 on a GPU); `cuda_generator` is the CPU
generator FastVideo's `on_train_start` seeds on rank 0 (seed + 0).

Values are captured by wrapping, never replacing, FastVideo's methods on the instance
(`_sampler.sample`, `_score_samples`, `_compute_advantages`, `_training_timestep_loss`,
`_clip_student_grads`, the optimizer's `step`, `_update_ema`, `_inner_train` (to log its
`torch.randperm` draws) and the module's `distributed_k_repeat_indices`).

Usage: see tests/fastvideo_reference/README.md. FastVideo is never a dependency of fv_accel."""

from __future__ import annotations

import hashlib
import importlib
import json
import sys
import traceback
import types
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_dmd2_golden as dmd2_golden  # noqa: E402

sys.path.insert(0, str(HERE.parent))
from nft_standins import (  # noqa: E402
    FASTVIDEO_REWARD_NAMES,
    NFT_STANDIN_COEFFICIENTS,
    NFT_STANDIN_REWARDS,
    W_INIT,
    nft_standin_media,
    nft_standin_predict,
    nft_standin_rows,
)

REPO = dmd2_golden.REPO
OUT = REPO / "tests" / "data" / "nft_fastvideo_golden.json"
NFT_FILES = (
    "fastvideo/train/methods/rl/diffusion_nft.py",
    "fastvideo/train/methods/rl/common/sampling.py",
    "fastvideo/train/methods/rl/common/prompt_sampling.py",
    "fastvideo/train/methods/rl/rewards/media.py",
)
# Latent [B, C, T, H, W]: C the Wan VAE's z_dim; B and T per case. Text [L, D] per row (the negative
# prompt embedding of make_dmd2_golden's stand-in has the same L, D; the NFT never uses it).
C, H, W = 16, 4, 6
L, D = dmd2_golden.SHAPES["L"], dmd2_golden.SHAPES["D"]
SPATIAL_COMPRESSION = 8
NUM_ROWS = 3
ROWS_SEED = 11
GENERATOR_SEED = 42  # training.data.seed
ROLE_FLOW_SHIFT = 3.0  # every role's flow_shift and the pipeline's
STANDIN_ROLE = {"student": "policy", "old": "policy", "reference": "reference"}
TRAINING = {
    "learning_rate": 0.05,
    "betas": [0.9, 0.99],
    "weight_decay": 0.01,
    "eps": 1e-8,  # FastVideo's build_optimizer_and_scheduler hard-codes it
    "lr_scheduler": "constant",
    "seed": GENERATOR_SEED,
}


def _case(name: str, *, T: int, sample_bs: int, nvp: int, batches: int, train_bs: int, inner: int = 1,
          grad_accum: int = 1, sampling: dict[str, Any], iterations=(1, 2, 3), **method: Any) -> dict[str, Any]:
    config = {
        "sampling": dict(sampling),
        "sample_train_batch_size": sample_bs,
        "train_batch_size": train_bs,
        "num_batches_per_epoch": batches,
        "num_inner_epochs": inner,
        "num_video_per_prompt": nvp,
        "reward_fn": {"pickscore": 1.0, "clipscore": 0.5},
        "terminal_progress": False,
        **method,
    }
    return {"name": name, "T": T, "gradient_accumulation_steps": grad_accum, "iterations": list(iterations),
            "method": config}


ODE4 = {"num_steps": 4, "scheduler": "model_default", "trajectory": "ode"}
SDE4 = {"num_steps": 4, "scheduler": "model_default", "trajectory": "sde_reflow"}
CASES = [
    # 4 samples (2 prompts x 2 videos) -> 2 training batches of 2; defaults elsewhere.
    _case("ode_all_T1_decay1", T=1, sample_bs=2, nvp=2, batches=2, train_bs=2, sampling=ODE4,
          adv_mode="all", decay_type=1),
    # 8 samples, 4 training batches of 2, 2 inner epochs, grad accumulation 2; non-default beta / kl_beta.
    _case("ode_positive_only_T3_decay0_inner2_accum2", T=3, sample_bs=4, nvp=2, batches=2, train_bs=2, inner=2,
          grad_accum=2, sampling=ODE4, adv_mode="positive_only", decay_type=0, beta=0.3, kl_beta=0.05),
    # groups of 4 videos per prompt: advantages beyond adv_clip_max 1.5 are clipped.
    _case("sde_negative_only_T1_clip1.5_accum2", T=1, sample_bs=4, nvp=4, batches=2, train_bs=4, grad_accum=2,
          sampling=SDE4, adv_mode="negative_only", decay_type=1, adv_clip_max=1.5, kl_beta=0.02),
    # sde_reflow with several frames runs only at sample_train_batch_size 1 (see expected_failures).
    _case("sde_one_only_T3_bs1_fm_euler5", T=3, sample_bs=1, nvp=1, batches=4, train_bs=2,
          sampling={**SDE4, "scheduler": "flow_match_euler", "flow_shift": 5.0}, adv_mode="one_only", decay_type=1,
          ema={"decay": 0.8, "update_after_step": 2}),
    # decay_type 2 is flat (0) up to iteration 75: iterations 76 (decay 0.0075), 120 (0.3375) and 300 (the
    # cap 0.999); flow_match_euler with its own shift, timestep_fraction 0.5 -> 2 train timesteps of 4.
    _case("ode_binary_T2_decay2_iter76_120_300_fm_euler5_tf0.5", T=2, sample_bs=4, nvp=4, batches=2, train_bs=2,
          sampling={**ODE4, "scheduler": "flow_match_euler", "flow_shift": 5.0}, iterations=(76, 120, 300),
          adv_mode="binary", decay_type=2, timestep_fraction=0.5, adv_clip_max=1.5),
    # decay_type 2 from iteration 1: decay 0 (flat) in every iteration.
    # ... with other reward weights (given clipscore first).
    _case("ode_all_T2_decay2_flat_clip1.5_kl_weights", T=2, sample_bs=4, nvp=4, batches=2, train_bs=4, grad_accum=2,
          sampling=ODE4, adv_mode="all", decay_type=2, adv_clip_max=1.5, beta=0.05, kl_beta=0.1,
          reward_fn={"clipscore": 2.0, "pickscore": 0.25}),
    # five sampling steps (shift 3), grad clipping at 0.05, no EMA; decay_type 1 at iterations 1 (0.001),
    # 250 (0.25) and 600 (the cap 0.5).
    _case("ode_all_T1_steps5_gradclip_noema_iter1_250_600", T=1, sample_bs=2, nvp=2, batches=2, train_bs=1,
          grad_accum=2, sampling={**ODE4, "num_steps": 5}, iterations=(1, 250, 600), adv_mode="all", decay_type=1,
          max_grad_norm=0.05, ema=False),
    # sde with T = 1 at batch 4 and timestep_fraction 0.5; no grad clipping (max_grad_norm 0).
    _case("sde_all_T1_tf0.5_noclip", T=1, sample_bs=4, nvp=2, batches=2, train_bs=2, sampling=SDE4, adv_mode="all",
          decay_type=0, timestep_fraction=0.5, max_grad_norm=0.0, reward_fn={"pickscore": 0.7, "clipscore": 2.0}),
]
# FastVideo's sde_reflow with sample_train_batch_size > 1 and several latent frames: expected to fail.
FAILING_CASES = [
    _case("sde_reflow_B2_T3", T=3, sample_bs=2, nvp=2, batches=1, train_bs=2, sampling=SDE4, iterations=(1, )),
]


# ---- importing FastVideo: make_dmd2_golden's installer plus what the NFT needs ----
class _RankZero:
    rank = 0
    world_size = 1


def install_fastvideo(root: Path) -> types.SimpleNamespace:
    fv = dmd2_golden.install_fastvideo(root)
    # fastvideo/dataset/__init__.py imports torchvision and every dataset: a namespace package instead;
    # fastvideo.dataset.utils (collate_rows_from_parquet_schema) and dataloader.schema are real.
    package = dmd2_golden._stub("fastvideo.dataset")
    package.__path__ = [str(fv.root / "fastvideo/dataset")]
    package.__spec__.submodule_search_locations = package.__path__
    dmd2_golden._stub(
        "fastvideo.dataset.parquet_dataset_map_style",
        get_parquet_files_and_length=dmd2_golden._unreachable("get_parquet_files_and_length"),
        read_row_from_parquet_file=dmd2_golden._unreachable("read_row_from_parquet_file"),
    )
    interface = importlib.import_module("fastvideo.platforms.interface")
    # TrainingMethod.on_train_start: rank 0 of 1, and FastVideo's set_random_seed, which calls the
    # platform's seed_everything (the base Platform's on a CPU platform).
    sys.modules["fastvideo.distributed"].get_world_group = lambda: _RankZero()
    sys.modules["fastvideo.utils"].set_random_seed = interface.Platform.seed_everything
    fv.nft = importlib.import_module("fastvideo.train.methods.rl.diffusion_nft")
    fv.rewards = importlib.import_module("fastvideo.train.methods.rl.rewards")
    fv.schema = importlib.import_module("fastvideo.dataset.dataloader.schema")
    fv.training_utils = importlib.import_module("fastvideo.training.training_utils")

    real_build = fv.nft.build_multi_reward_scorer

    def build_multi_reward_scorer(reward_weights, *, device="cuda", scorers=None):
        if scorers is not None:
            raise RuntimeError("the golden run supplies the scorers")
        standins = {name: NFT_STANDIN_REWARDS[standin] for name, standin in FASTVIDEO_REWARD_NAMES.items()}
        return real_build(reward_weights, device=device, scorers=standins)

    fv.nft.build_multi_reward_scorer = build_multi_reward_scorer
    fv.nft.read_row_from_parquet_file = _read_standin_row
    return fv


# ---- the stand-in prompt dataset ----
def _parquet_row(index: int, row: dict[str, Any]) -> dict[str, Any]:
    emb = row["text_embedding"].contiguous()
    return {
        "id": f"standin-{index}",
        "text_embedding_bytes": emb.numpy().tobytes(),
        "text_embedding_shape": list(emb.shape),
        "text_embedding_dtype": "float32",
        "caption": row["caption"],
    }


STANDIN_ROWS = [_parquet_row(i, row) for i, row in enumerate(nft_standin_rows(NUM_ROWS, L, D, ROWS_SEED))]


def _read_standin_row(parquet_files: list[str], global_row_idx: int, lengths: list[int]) -> dict[str, Any]:
    """Stands in for FastVideo's read_row_from_parquet_file: the row of the stand-in dataset."""
    if list(parquet_files) != ["standin.parquet"] or list(lengths) != [NUM_ROWS]:
        raise RuntimeError("not the stand-in dataset")
    if not 0 <= int(global_row_idx) < NUM_ROWS:
        raise IndexError(global_row_idx)
    return dict(STANDIN_ROWS[int(global_row_idx)])


def standin_dataset(fv: types.SimpleNamespace) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        parquet_files=["standin.parquet"],
        lengths=[NUM_ROWS],
        parquet_schema=fv.schema.pyarrow_schema_text_only,
        text_padding_length=L,
        path="standin",
    )


# ---- stand-in roles ----
class StandinTransformer(torch.nn.Module):
    """One trainable parameter w; forward is the shared stand-in on FastVideo's [B, C, T, H, W] input."""

    def __init__(self, standin_role: str) -> None:
        super().__init__()
        self.standin_role = standin_role
        self.w = torch.nn.Parameter(torch.full((1, ), W_INIT, dtype=torch.float32))

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask, timestep, return_dict=False):
        return nft_standin_predict(self.standin_role, hidden_states, timestep, self.w)


def standin_nft_class(fv: types.SimpleNamespace) -> type:
    base = dmd2_golden.standin_wan_class(fv)

    class StandinNFTWanModel(base):
        """make_dmd2_golden's stand-in Wan plugin with FastVideo's own predict_noise and backward: only
        the transformer (StandinTransformer), the VAE decode and the dataloader are stand-ins."""

        predict_noise = fv.wan.WanModel.predict_noise
        backward = fv.wan.WanModel.backward

        def __init__(self, *, role: str, **kwargs: Any) -> None:
            self.standin_role = STANDIN_ROLE[role]
            super().__init__(role=role, call_log=[], **kwargs)

        def _load_transformer(self, *, trainable: bool, **kwargs: Any) -> torch.nn.Module:
            return fv.module_state.apply_trainable(StandinTransformer(self.standin_role), trainable=trainable)

        def init_preprocessors(self, training_config: Any) -> None:
            super().init_preprocessors(training_config)
            self.dataloader = types.SimpleNamespace(dataset=standin_dataset(fv))

        @torch.no_grad()
        def decode_latents(self, latents_b_t_c_h_w: torch.Tensor) -> torch.Tensor:
            return nft_standin_media(latents_b_t_c_h_w.permute(0, 2, 1, 3, 4))

    return StandinNFTWanModel


def training_config(fv: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    tc = dmd2_golden.training_config(fv, ROLE_FLOW_SHIFT)
    tc.data.train_batch_size = case["method"]["sample_train_batch_size"]
    tc.data.seed = GENERATOR_SEED
    tc.data.num_latent_t = case["T"]
    tc.data.num_height = H * SPATIAL_COMPRESSION
    tc.data.num_width = W * SPATIAL_COMPRESSION
    tc.data.preprocessed_data_type = "text_only"
    tc.optimizer.learning_rate = TRAINING["learning_rate"]
    tc.optimizer.betas = tuple(TRAINING["betas"])
    tc.optimizer.weight_decay = TRAINING["weight_decay"]
    tc.optimizer.lr_scheduler = TRAINING["lr_scheduler"]
    tc.loop.max_train_steps = max(case["iterations"])
    tc.loop.gradient_accumulation_steps = case["gradient_accumulation_steps"]
    tc.pipeline_config.vae_config.arch_config.z_dim = C
    tc.pipeline_config.vae_config.arch_config.spatial_compression_ratio = SPATIAL_COMPRESSION
    return tc


def build_method(fv: types.SimpleNamespace, case: dict[str, Any]) -> Any:
    tc = training_config(fv, case)
    cls = standin_nft_class(fv)
    roles = {
        role: cls(role=role, training_config=tc, trainable=role == "student", flow_shift=ROLE_FLOW_SHIFT)
        for role in ("student", "old", "reference")
    }
    cfg = types.SimpleNamespace(training=tc, method=json.loads(json.dumps(case["method"])), validation={})
    method = fv.nft.DiffusionNFTMethod(cfg=cfg, role_models=roles)
    method.on_train_start()
    return method


# ---- recording ----
def _f(value: Any) -> dict[str, Any]:
    v = float(value)
    return {"hex": v.hex(), "value": v}


def _fl(values: Any) -> dict[str, Any]:
    vals = [float(v) for v in torch.as_tensor(values).detach().reshape(-1).tolist()]
    return {"hex": [v.hex() for v in vals], "values": vals}


def _loss(value: torch.Tensor) -> dict[str, Any]:
    return {**_f(value.detach()), "dtype": str(value.dtype).replace("torch.", "")}


def sha256_tensor(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()


def generator_sha256(generator: torch.Generator) -> str:
    return sha256_tensor(generator.get_state())


def _w(model: Any) -> float:
    return float(model.transformer.w.detach()[0])


class Recorder:
    """Wraps FastVideo's methods on one DiffusionNFTMethod instance and records what they return."""

    def __init__(self, fv: types.SimpleNamespace, method: Any) -> None:
        self.fv, self.m = fv, method
        self.it: dict[str, Any] = {}
        self.latents_fv: list[torch.Tensor] = []  # the iteration's sampled latents, FastVideo's layout
        self._wrap()

    def start_iteration(self, iteration: int) -> None:
        self.it = {"iteration": iteration, "sampling_batches": [], "inner_epochs": [], "micro_steps": [],
                   "optimizer_steps": []}
        self.latents_fv = []

    def _wrap(self) -> None:
        m, fv = self.m, self.fv
        sampler_sample = m._sampler.sample
        score_samples = m._score_samples
        compute_advantages = m._compute_advantages
        timestep_loss = m._training_timestep_loss
        clip = m._clip_student_grads
        update_ema = m._update_ema
        inner_train = m._inner_train
        k_repeat = fv.nft.distributed_k_repeat_indices
        rec = self

        def k_repeat_wrapper(**kwargs):
            sample = k_repeat(**kwargs)
            rec.it["sampling_batches"].append({
                "batch_idx": len(rec.it["sampling_batches"]),
                "k_repeat_seed": int(kwargs["seed"]),
                "row_indices": list(sample.local_indices),
                "unique_prompt_count": int(sample.unique_prompt_count),
            })
            return sample

        def sample_wrapper(model, batch, *, generator):
            if model is not m.old:
                raise RuntimeError("FastVideo samples with the old policy")
            result = sampler_sample(model, batch, generator=generator)
            latents = result.latents.permute(0, 2, 1, 3, 4).contiguous()  # -> [B, C, T, H, W]
            self.latents_fv.append(result.latents.detach().clone())
            rec.it["sampling_batches"][-1].update({
                "prompts": [str(info["prompt"]) for info in batch.infos],
                "schedule_timesteps": _fl(result.timesteps),
                "schedule_sigmas": _fl(result.sigmas),
                "train_timesteps": _fl(result.timesteps[:m._num_train_timesteps()]),
                "latents_clean": {
                    "sum": _f(latents.double().sum()),
                    "abs_sum": _f(latents.double().abs().sum()),
                    "per_sample_sum": _fl(latents.double().flatten(1).sum(1)),
                    "sha256_bcthw_float32": sha256_tensor(latents),
                },
            })
            return result

        def score_wrapper(sample_items):
            rewards = score_samples(sample_items)
            rec.it["rewards"] = {key: _fl(value) for key, value in rewards.items()}
            return rewards

        def advantages_wrapper(sample_items, rewards):
            adv = compute_advantages(sample_items, rewards)
            rec.it["advantages"] = _fl(adv[:, 0])
            rec.it["num_advantages_beyond_clip"] = int((adv[:, 0].abs() > m._adv_clip_max).sum())
            return adv

        def inner_train_wrapper(sample_items, advantages, iteration):
            real_randperm = torch.randperm
            total = int(advantages.shape[0])

            def randperm(n, *args, generator=None, **kwargs):
                # Per inner epoch: randperm(total_samples), then total_samples x randperm(num_train_timesteps).
                out = real_randperm(n, *args, generator=generator, **kwargs)
                if generator is m.cuda_generator:
                    epochs = rec.it["inner_epochs"]
                    if not epochs or len(epochs[-1]["perms_time"]) == total:
                        if n != total:
                            raise RuntimeError("unexpected randperm order")
                        epochs.append({"perm": out.tolist(), "perms_time": []})
                    else:
                        epochs[-1]["perms_time"].append(out.tolist())
                return out

            torch.randperm = randperm
            try:
                return inner_train(sample_items, advantages, iteration)
            finally:
                torch.randperm = real_randperm

        def timestep_loss_wrapper(sample, advantages, timestep_idx):
            losses, ctx = timestep_loss(sample, advantages, timestep_idx)
            collated = torch.cat(self.latents_fv, dim=0)
            indices = []
            for row in sample["latents_clean"]:
                hits = [i for i in range(collated.shape[0]) if torch.equal(collated[i], row)]
                if len(hits) != 1:
                    raise RuntimeError("could not identify a training sample")
                indices.append(hits[0])
            rec.it["micro_steps"].append({
                "micro_step": len(rec.it["micro_steps"]),
                "inner_epoch": len(rec.it["inner_epochs"]) - 1,
                "timestep_idx": int(timestep_idx),
                "sample_indices": indices,
                "timesteps": _fl(sample["timesteps"][:, timestep_idx]),
                "advantages": _fl(advantages),
                "losses": {key: _loss(value) for key, value in losses.items()},
                "generator_state_sha256_after": generator_sha256(m.cuda_generator),
            })
            return losses, ctx

        def clip_wrapper():
            grad = m.student.transformer.w.grad.detach().clone()
            clip()
            if getattr(fv.training_utils, "_HAS_ERRORED_CLIP_GRAD_NORM_WHILE_HANDLING_FAILING_DTENSOR_CASES"):
                raise RuntimeError("FastVideo's gradient clipping failed and was skipped")
            clipped = m.student.transformer.w.grad.detach().clone()
            if m._max_grad_norm > 0.0 and float(grad.norm()) > m._max_grad_norm and not float(clipped.norm()) < float(
                    grad.norm()):
                raise RuntimeError("FastVideo's gradient clipping did not clip")
            rec.it["optimizer_steps"].append({
                "after_micro_step": len(rec.it["micro_steps"]) - 1,
                "grad_before_clip": _f(grad[0]),
                "grad_after_clip": _f(clipped[0]),
                "clipped": bool(not torch.equal(grad, clipped)),
            })

        def opt_step_hook(optimizer, args, kwargs):
            rec.it["optimizer_steps"][-1]["student_w_after"] = _f(_w(m.student))
            rec.it["optimizer_steps"][-1]["lr"] = _f(optimizer.param_groups[0]["lr"])

        def update_ema_wrapper():
            update_ema()
            if m._student_ema is not None:
                rec.it["optimizer_steps"][-1]["ema_w_after"] = _f(m._student_ema.shadow["w"][0])
            rec.it["optimizer_steps"][-1]["ema_update_count_after"] = int(m._ema_update_count)

        m._sampler.sample = sample_wrapper
        m._score_samples = score_wrapper
        m._compute_advantages = advantages_wrapper
        m._training_timestep_loss = timestep_loss_wrapper
        m._clip_student_grads = clip_wrapper
        m._student_optimizer.register_step_post_hook(opt_step_hook)
        m._update_ema = update_ema_wrapper
        m._inner_train = inner_train_wrapper
        fv.nft.distributed_k_repeat_indices = k_repeat_wrapper

        # The generator state after each sampling batch: wrap decode_latents (called right after sampling).
        decode = m.student.decode_latents

        def decode_wrapper(latents):
            rec.it["sampling_batches"][-1]["generator_state_sha256_after"] = generator_sha256(m.cuda_generator)
            return decode(latents)

        m.student.decode_latents = decode_wrapper

    def unwrap_module(self, k_repeat: Any) -> None:
        self.fv.nft.distributed_k_repeat_indices = k_repeat


def _no_data_stream():
    raise RuntimeError("FastVideo reads prompts through the stand-in parquet dataset, not the data stream")
    yield  # pragma: no cover


def run_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> dict[str, Any]:
    k_repeat = fv.nft.distributed_k_repeat_indices
    method = build_method(fv, case)
    rec = Recorder(fv, method)
    try:
        start = {
            "student_w": _f(_w(method.student)), "old_w": _f(_w(method.old)), "reference_w": _f(_w(method.reference)),
            "ema_w": _f(method._student_ema.shadow["w"][0]) if method._student_ema is not None else None,
            "generator_state_sha256": generator_sha256(method.cuda_generator),
        }
        records = []
        for iteration in case["iterations"]:
            rec.start_iteration(iteration)
            decay = method._return_decay(iteration, method._decay_type)
            loss_map, outputs, metrics = method.managed_train_step(_no_data_stream(), iteration)
            if outputs:
                raise RuntimeError("DiffusionNFT returns no outputs")
            rec.it.update({
                "old_decay": _f(decay),
                "loss_map": {key: _loss(value) for key, value in sorted(loss_map.items())},
                "metrics": {key: _f(value) for key, value in sorted(metrics.items())},
                "student_w": _f(_w(method.student)),
                "old_w": _f(_w(method.old)),
                "reference_w": _f(_w(method.reference)),
                "ema_w": _f(method._student_ema.shadow["w"][0]) if method._student_ema is not None else None,
                "ema_update_count": int(method._ema_update_count),
                "generator_state_sha256": generator_sha256(method.cuda_generator),
            })
            records.append(rec.it)
    finally:
        rec.unwrap_module(k_repeat)
    facts = derived(method, case)
    if not facts["inner_batches_multiple_of_grad_accum"]:
        raise RuntimeError(f"{case['name']}: the micro-steps of an iteration are not a multiple of the accumulation")
    for record in records:
        if len(record["optimizer_steps"]) != facts["optimizer_steps_per_iteration"]:
            raise RuntimeError(f"{case['name']}: unexpected number of optimizer steps")
    return {"start": start, "results": records, "derived": facts}


def derived(method: Any, case: dict[str, Any]) -> dict[str, Any]:
    """What FastVideo's constructor made of the case's settings."""
    m = case["method"]
    ntt = method._num_train_timesteps()
    total = m["sample_train_batch_size"] * m["num_batches_per_epoch"]
    train_batches = max(1, total // max(1, method._train_batch_size))
    accum = case["gradient_accumulation_steps"] * ntt
    micro = m.get("num_inner_epochs", 1) * train_batches * ntt
    return {
        "num_train_timesteps": ntt,
        "samples_per_iteration": total,
        "train_batches_per_inner_epoch": train_batches,
        "effective_grad_accum_micro_steps": accum,
        "micro_steps_per_iteration": micro,
        "optimizer_steps_per_iteration": micro // accum,
        "inner_batches_multiple_of_grad_accum": micro % accum == 0,
        "sampling_config": {
            "num_steps": method._sampling_config.num_steps, "scheduler": method._sampling_config.scheduler,
            "trajectory": method._sampling_config.trajectory, "flow_shift": method._sampling_config.flow_shift,
        },
        "adv_clip_max": method._adv_clip_max, "timestep_fraction": method._timestep_fraction,
        "kl_beta": method._kl_beta, "beta": method._nft_beta, "max_grad_norm": method._max_grad_norm,
        "decay_type": method._decay_type, "adv_mode": method._adv_mode,
        "ema": {"enabled": method._ema_enabled, "decay": method._ema_decay,
                "update_after_step": method._ema_update_after_step},
        "train_batch_size": method._train_batch_size,
    }


def run_failing_case(fv: types.SimpleNamespace, case: dict[str, Any]) -> dict[str, Any]:
    k_repeat = fv.nft.distributed_k_repeat_indices
    method = build_method(fv, case)
    try:
        method.managed_train_step(_no_data_stream(), case["iterations"][0])
    except Exception as exc:  # noqa: BLE001 - the failure is what is recorded
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        where = Path(frame.filename).resolve()
        try:
            where_text = str(where.relative_to(fv.root))
        except ValueError:
            where_text = where.name
        return {"error_type": type(exc).__name__, "error_message": str(exc),
                "raised_in": f"{where_text}:{frame.name}", "raising_line": (frame.line or "").strip()}
    finally:
        fv.nft.distributed_k_repeat_indices = k_repeat
    raise RuntimeError(f"{case['name']} was expected to fail in FastVideo and did not")


def _case_settings(case: dict[str, Any]) -> dict[str, Any]:
    m = case["method"]
    return {
        "name": case["name"],
        "iterations": case["iterations"],
        "method": m,
        "shapes": {"B": m["sample_train_batch_size"], "C": C, "T": case["T"], "H": H, "W": W, "L": L, "D": D},
        "training": {**TRAINING, "gradient_accumulation_steps": case["gradient_accumulation_steps"],
                     "max_train_steps": max(case["iterations"]), "num_height": H * SPATIAL_COMPRESSION,
                     "num_width": W * SPATIAL_COMPRESSION, "num_latent_t": case["T"]},
        "flow_shift": {role: ROLE_FLOW_SHIFT for role in ("student", "old", "reference")},
        "pipeline_flow_shift": ROLE_FLOW_SHIFT,
        "reward_names": dict(FASTVIDEO_REWARD_NAMES),
    }


NOTES = [
    "Layouts: FastVideo's sampler and loss work on [B, T, C, H, W]; every random draw below is in that "
    "layout except prepare_batch's noise. latents_clean sums/sha256 are of fv_accel's [B, C, T, H, W].",
    "Per sampling batch the generator is drawn, in order: prepare_batch (latents_source='zeros') draws "
    "randn([B, C, T, H, W]) noise and rand([B]) uniform timesteps (both unused by the NFT); the sampler draws "
    "randn([B, T, C, H, W]) initial noise; sde_reflow draws randn([B, T, C, H, W]) after every step but the last.",
    "Per inner epoch: randperm(total_samples), then total_samples x randperm(num_train_timesteps); per micro-step "
    "randn(x0.shape) ([b, T, C, H, W]) for x_t. All on cuda_generator (CPU, seeded with seed + rank = 42).",
    "The model is given a [B] timestep; in the loss each sample has its own timestep (after perms_time).",
    "total_loss, policy_loss and unweighted_policy_loss are float64 (the weight factors are computed in float64 and "
    "divide float32 squares); kl_div_loss, old_deviate, old_kl_div and x0_norm are float32. loss_map values are the "
    "means over the iteration's micro-steps of each term.",
    "The loss is divided by gradient_accumulation_steps * num_train_timesteps; the optimizer steps every that many "
    "micro-steps (counting across train batches and inner epochs).",
    "sde_reflow converts to x0 and re-noises with the old model's own noise_scheduler (flow_shift 3 table, nearest "
    "entry), also when the sampling schedule is flow_match_euler with another shift.",
    "Advantages: per prompt over the whole iteration's samples, (r - mean) / (std(unbiased=False) + 1e-4) of avg.",
]


def format_golden(golden: dict[str, Any]) -> str:
    """JSON with one line per sampling batch, micro-step and optimizer step."""
    head = {k: v for k, v in golden.items() if k != "cases"}
    text = json.dumps(head, indent=1)[:-2] + ',\n "cases": [\n'
    cases = []
    for case in golden["cases"]:
        settings = json.dumps({k: v for k, v in case.items() if k != "results"})
        its = []
        for it in case["results"]:
            parts = []
            for key, value in it.items():
                if key in ("sampling_batches", "micro_steps", "optimizer_steps", "inner_epochs"):
                    body = ",\n".join("      " + json.dumps(v) for v in value)
                    parts.append(f'     {json.dumps(key)}: [\n{body}\n     ]' if value else f'     {json.dumps(key)}: []')
                else:
                    parts.append(f"     {json.dumps(key)}: {json.dumps(value)}")
            its.append("    {\n" + ",\n".join(parts) + "\n    }")
        cases.append(f'  {settings[:-1]}, "results": [\n' + ",\n".join(its) + "\n  ]}")
    text += ",\n".join(cases) + "\n ]\n}\n"
    if json.loads(text) != golden:
        raise AssertionError("format_golden changed the data")
    return text


def main(argv: list[str] | None = None) -> int:
    fv, args = dmd2_golden.fastvideo_from_cli(argv, __doc__, OUT, install_fastvideo)
    torch.set_num_threads(1)
    # Wan's predict_noise enters torch.autocast("cpu", dtype=float32), which CPU autocast disables.
    warnings.filterwarnings("ignore", message="In CPU autocast, but the target dtype is not supported")
    golden = {
        "fastvideo_version": fv.version,
        "source_sha256": {name: hashlib.sha256((fv.root / name).read_bytes()).hexdigest() for name in NFT_FILES},
        "torch_version": torch.__version__,
        "standin_coefficients": {k: list(v) for k, v in NFT_STANDIN_COEFFICIENTS.items()},
        "standin_roles": dict(STANDIN_ROLE),
        "w_init": W_INIT,
        "rows": {"num_rows": NUM_ROWS, "L": L, "D": D, "seed": ROWS_SEED,
                 "captions": [row["caption"] for row in STANDIN_ROWS]},
        "reward_names": dict(FASTVIDEO_REWARD_NAMES),
        "generator_seed": GENERATOR_SEED,
        "dtype": "float32",
        "device": "cpu",
        "notes": NOTES,
        "expected_failures": [],
        "cases": [],
    }
    for case in FAILING_CASES:
        golden["expected_failures"].append({**_case_settings(case), **run_failing_case(fv, case)})
        print(case["name"], "fails:", golden["expected_failures"][-1]["error_type"])
    for case in CASES:
        result = run_case(fv, case)
        golden["cases"].append({**_case_settings(case), "start": result["start"], "derived": result["derived"],
                                "results": result["results"]})
        print(case["name"], [r["loss_map"]["total_loss"]["value"] for r in result["results"]],
              [r["student_w"]["value"] for r in result["results"]])
    dmd2_golden.write_golden(args.out, format_golden(golden))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
