"""DiffusionNFTMethod: reward post-training by negative-aware fine-tuning (DiffusionNFT), with
FastVideo 0.2.1's semantics and key names, inside the trainer's one loop.

Roles: `student` (trained), `old` (the sampling policy, moved toward the student after each outer
step by `decay_type`) and `reference` (frozen, for the KL term).

An outer step (FastVideo's trainer step) is: `num_batches_per_epoch` sampling batches, each
`sample_train_batch_size` prompt rows per process chosen by the K-repeat sampler (seed
`data.seed + (outer - 1) * num_batches_per_epoch + batch`), sampled by the old policy from pure
noise, decoded, scored; advantages per prompt over every process, `(r - mean) / (std + 1e-4)`;
then `num_inner_epochs` passes over the samples in micro-batches of `train_batch_size`, each at
every trained timestep. Here each optimizer step of it is one trainer step:
`gradient_accumulation_steps` micro-batches x the trained timesteps, so the trainer's clipping,
non-finite checks, logging and checkpoints apply to each. The samples, advantages and
permutations of the outer step in progress travel in the checkpoint (`state_tensors`): storing
them costs one copy of the outer step's latents and text per process, against a whole sampling
phase to regenerate them, so a run stopped between optimizer steps resumes bitwise.

Every draw is FastVideo's, in its order, from the rank's generator: per sampling batch the two
draws of FastVideo's `prepare_batch` that nothing uses (noise, then `u`), the sampler's start noise
(and `sde_reflow`'s re-noising noises); per inner epoch one permutation of the samples, then one
permutation of the timesteps per sample; per micro-batch one noise. With `training.loop.noise_rng:
sample` each sample draws from a generator of its own (keyed by the outer step and its number among
every process's samples), the processes' samples are gathered and permuted together and each
process trains its share of every micro-batch: N processes train as one would.

With a LoRA student the old policy is a second, frozen adapter over its base and the reference is
the base with adapters off (`AdapterView`): one copy of the model.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from typing import Any, Optional

import torch

from fv_accel.config import ConfigError, nft_train_timesteps
from fv_accel.methods.base import LogScalar, TrainingMethod
from fv_accel.methods.rl.sampling import CLEAN_CONDITION, k_repeat_rows, sample_policy, sampling_schedule, with_clean_condition
from fv_accel.models.base import Conditioning, ModelBase, TrainingBatch, reshard_fsdp_units
from fv_accel.schedulers import randn
from fv_accel.seeding import derived_seed

ROLES = ("student", "old", "reference")
# With a LoRA student, the old policy's adapter beside the trained one ("default").
OLD_ADAPTER = "old"
# The per-sample loss terms' floor (DiffusionNFT's weight factor clip).
WEIGHT_FLOOR = 1e-5
# The advantage's denominator guard.
STD_EPS = 1e-4


def return_decay(step: int, decay_type: int) -> float:
    """How much of the old policy is kept after outer step `step` (DiffusionNFT's return_decay)."""
    flat, uprate, uphold = {0: (0, 0.0, 0.0), 1: (0, 0.001, 0.5), 2: (75, 0.0075, 0.999)}[int(decay_type)]
    if step < flat:
        return 0.0
    return min((step - flat) * uprate, uphold)


def group_advantages(rewards: torch.Tensor, prompts: list[str], valid: torch.Tensor) -> torch.Tensor:
    """Per prompt, `(r - mean) / (std + 1e-4)` over that prompt's valid samples (population std);
    an invalid sample (a non-finite reward) is left out of its group and gets advantage 0."""
    adv = torch.zeros_like(rewards)
    groups: dict[str, list[int]] = defaultdict(list)
    for i, prompt in enumerate(prompts):
        if bool(valid[i]):
            groups[prompt].append(i)
    for indices in groups.values():
        index = torch.tensor(indices, device=rewards.device, dtype=torch.long)
        r = rewards[index]
        adv[index] = (r - r.mean()) / (r.std(unbiased=False) + STD_EPS)
    return adv


class AdapterView:
    """A frozen role over a LoRA student's transformer: its predictions through one adapter (the
    old policy's) or none (the reference: the base), sharing the student's one base."""

    _trainable = False

    def __init__(self, student: ModelBase, adapter: Optional[str]):
        self.student, self.adapter = student, adapter
        self.role = "reference" if adapter is None else "old"

    @property
    def transformer(self) -> torch.nn.Module:
        return self.student.transformer

    def training_table(self, latent_shape: Any) -> Any:
        return self.student.training_table(latent_shape)

    def predict_noise(self, x: torch.Tensor, t: torch.Tensor, tb: TrainingBatch, **kwargs: Any) -> torch.Tensor:
        from fv_accel.models.lora import adapter_view

        with adapter_view(self.student._unwrapped(), self.adapter):
            return self.student.predict_noise(x, t, tb, **kwargs)


class OuterStep:
    """What one outer step trains on, on this process: clean samples x0 [N, C, T, H, W], their
    conditioning, the trained timesteps [N, n_t] and advantages [N], which samples are valid, and the
    current inner epoch's permutations (drawn at its first micro-batch)."""

    def __init__(self, iteration: int, x0: torch.Tensor, cond: Conditioning, timesteps: torch.Tensor,
                 advantages: torch.Tensor, valid: torch.Tensor, metrics: dict[str, float]):
        self.iteration = iteration
        self.x0, self.cond, self.timesteps, self.advantages, self.valid = x0, cond, timesteps, advantages, valid
        self.metrics = metrics
        self.epoch = -1
        self.perm: Optional[torch.Tensor] = None
        self.time_perm: Optional[torch.Tensor] = None

    def state_tensors(self) -> dict[str, torch.Tensor]:
        out = {"iteration": torch.tensor(self.iteration), "epoch": torch.tensor(self.epoch), "x0": self.x0,
               "clean_frames": torch.tensor(self.cond.clean_frames),
               "timesteps": self.timesteps, "advantages": self.advantages, "valid": self.valid.to(torch.uint8)}
        for name in Conditioning.SAMPLE_FIELDS:
            if getattr(self.cond, name) is not None:
                out[f"cond.{name}"] = getattr(self.cond, name)
        for name, value in self.cond.extras.items():
            out[f"cond_extra.{name}"] = value
        if self.perm is not None:
            out["perm"], out["time_perm"] = self.perm, self.time_perm
        out.update({f"metric.{k}": torch.tensor(float(v), dtype=torch.float64) for k, v in self.metrics.items()})
        return {k: v.detach().cpu().contiguous() for k, v in out.items()}

    @classmethod
    def from_state(cls, t: dict[str, torch.Tensor], device: torch.device) -> "OuterStep":
        on = {k: v.to(device) for k, v in t.items()}
        cond = Conditioning(clean_frames=int(t["clean_frames"]), **{n: on[f"cond.{n}"] for n in Conditioning.SAMPLE_FIELDS if f"cond.{n}" in on},
                            extras={k[len("cond_extra."):]: v for k, v in on.items() if k.startswith("cond_extra.")})
        metrics = {k[len("metric."):]: float(v) for k, v in t.items() if k.startswith("metric.")}
        outer = cls(int(t["iteration"]), on["x0"], cond, on["timesteps"], on["advantages"], on["valid"].bool(), metrics)
        outer.epoch = int(t["epoch"])
        if "perm" in on:
            outer.perm, outer.time_perm = on["perm"], on["time_perm"]
        return outer


class NFTBatches:
    """The trainer's micro-batches of reward training from optimizer step `step` on: each is one
    training micro-batch at one trained timestep, in FastVideo's order. A new outer step is sampled
    (or taken from the checkpoint it was saved in) when the previous one is used up."""

    def __init__(self, method: "DiffusionNFTMethod", step: int):
        self.method = method
        self.micro = step * method.micro_per_step

    def __iter__(self) -> "NFTBatches":
        return self

    def __next__(self) -> dict:
        m = self.method
        outer_index, r = divmod(self.micro, m.micro_per_outer)
        outer = m.outer_for(outer_index + 1, r)
        epoch, rem = divmod(r, m.num_batches * m.n_t)
        b, j = divmod(rem, m.n_t)
        if outer.epoch != epoch:
            m.draw_permutations(outer, epoch)
        n = outer.x0.shape[0]
        size = n // m.num_batches
        stop = n if b == m.num_batches - 1 else (b + 1) * size
        index = outer.perm[b * size : stop]
        # The timestep permutations belong to the permuted positions (FastVideo permutes the samples first).
        columns = outer.time_perm[b * size : stop, j]
        if m.per_sample:  # every process holds every sample: this one trains its share of the micro-batch
            share = index.numel() // m.dp_size
            rows = slice(m.dp_rank * share, (m.dp_rank + 1) * share)
            index, columns = index[rows], columns[rows]
        self.micro += 1
        return {
            "nft": {"outer": outer, "index": index, "columns": columns},
            "sample_index": index.cpu(),
            "epoch": torch.full((index.numel(),), outer.iteration, dtype=torch.long),
            "position": r,
        }

    def close(self) -> None:
        """Nothing to stop: the micro-batches are made on the calling thread, none read ahead."""


class DiffusionNFTMethod(TrainingMethod):
    """DiffusionNFT over a student, its sampling policy `old` and a frozen `reference`."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        super().__init__(cfg=cfg, role_models=role_models)
        self._require_trainable_student("DiffusionNFTMethod")
        self.lora = bool(cfg.models.student.lora.enable)
        if self.lora:
            # One base: the old policy is a second adapter over the student's, the reference the base alone.
            from fv_accel.models.lora import add_frozen_adapter

            add_frozen_adapter(self.student.transformer, OLD_ADAPTER)
            role_models = {**role_models, "old": AdapterView(self.student, OLD_ADAPTER),
                           "reference": AdapterView(self.student, None)}
        missing = [r for r in ROLES if r not in role_models]
        if missing:
            raise ValueError(f"DiffusionNFTMethod requires roles {', '.join(ROLES)}; missing {', '.join(missing)}")
        self.old, self.reference = role_models["old"], role_models["reference"]
        for name in ("old", "reference"):
            if role_models[name]._trainable:
                raise ValueError(f"DiffusionNFTMethod requires {name} to be frozen (models.{name}.trainable: false)")
        if cfg.training.model.context_parallel.degree > 1:
            raise ConfigError(
                "training.model.context_parallel: reward training does not run with context parallelism (each process "
                "samples and scores its own videos); set ulysses and ring to 1"
            )
        self._attn_kind = self._infer_attn_kind()
        self._parse_recipe(cfg.method)
        self._init_student()
        for role in (self.old, self.reference):
            if not isinstance(role, AdapterView):
                role.init_preprocessors(self.training_config)
                role.transformer.eval()
        from fv_accel.rewards import parse_reward_fn

        self.reward_spec = parse_reward_fn(cfg.method.reward_fn)
        self.rewards: Any = None  # built at the first scoring (reward models load then)
        self.outer: Optional[OuterStep] = None
        self._restored: Optional[dict[str, torch.Tensor]] = None
        self._loader: Any = None
        self._vae: Any = None
        self._old_drift = 0.0

    # ---- recipe ----
    def _parse_recipe(self, mc: Any) -> None:
        data = self.training_config.data
        self.sample_batch = int(mc.sample_train_batch_size or data.train_batch_size)
        self.train_batch = int(mc.train_batch_size or self.sample_batch)
        for key, value in (("sample_train_batch_size", self.sample_batch), ("train_batch_size", self.train_batch),
                           ("num_batches_per_epoch", mc.num_batches_per_epoch), ("num_inner_epochs", mc.num_inner_epochs),
                           ("num_video_per_prompt", mc.num_video_per_prompt)):
            if int(value) < 1:
                raise ConfigError(f"method.{key} must be an integer >= 1, got {value!r}")
        for key in ("adv_clip_max", "beta"):
            if not float(getattr(mc, key)) > 0:
                raise ConfigError(f"method.{key} must be > 0, got {getattr(mc, key)!r}")
        if not 0 < float(mc.timestep_fraction) <= 1:
            raise ConfigError(f"method.timestep_fraction must be in (0, 1], got {mc.timestep_fraction!r}")
        if float(mc.kl_beta) < 0 or not math.isfinite(float(mc.kl_beta)):
            raise ConfigError(f"method.kl_beta must be a number >= 0, got {mc.kl_beta!r}")
        self.n_t = nft_train_timesteps(mc)
        total = int(mc.num_batches_per_epoch) * self.sample_batch
        self.num_batches = max(1, total // self.train_batch)
        # training.loop.noise_rng sample: each sample's draws from its own generator, the samples of
        # every process gathered and permuted together, so that N processes train as one would.
        self.per_sample = self.noise_rng == "sample"
        if self.per_sample and total % self.train_batch:
            raise ConfigError(
                f"training.loop.noise_rng sample: method.train_batch_size {self.train_batch} must divide the samples of an "
                f"outer step on a process (num_batches_per_epoch x sample_train_batch_size = {total})"
            )
        k = int(self.training_config.loop.gradient_accumulation_steps)
        per_outer = int(mc.num_inner_epochs) * self.num_batches
        if per_outer % k:
            raise ConfigError(
                f"training.loop.gradient_accumulation_steps {k} must divide the training micro-batches of an outer step "
                f"(method.num_inner_epochs x training batches = {mc.num_inner_epochs} x {self.num_batches} = {per_outer})"
            )
        self.steps_per_outer = per_outer // k
        self.micro_per_step = k * self.n_t
        self.micro_per_outer = per_outer * self.n_t

    # ---- what the trainer runs ----
    def train_batches(self, loader: Any, device: torch.device, step: int) -> NFTBatches:
        """From the start of a run the old policy starts as the student's weights (a resumed run
        has its own from the checkpoint)."""
        if step == 0 and self._loader is None:
            with torch.no_grad():
                for src, tgt in self.old_pairs():
                    tgt.copy_(src.detach())
        self._loader = loader
        return NFTBatches(self, step)

    def check_data(self, loader: Any) -> None:
        """Refused before any step, in one line: a text-only dataset without the recipe's latent
        shape, and a sampling batch that needs more distinct prompts than the data has."""
        from fv_accel.data.loader import rollout_latent_shape

        if getattr(loader, "preprocessed_data_type", None) == "text_only":
            rollout_latent_shape(self.cfg, self.student.in_channels)
        try:
            k_repeat_rows(self.trainable_rows(loader), batch_size=self.sample_batch,
                          repeats=int(self.cfg.method.num_video_per_prompt), world_size=self.dp_size, rank=self.dp_rank, seed=0)
        except ValueError as err:
            raise ConfigError(str(err)) from None

    def outer_for(self, iteration: int, position: int) -> OuterStep:
        """Outer step `iteration`'s samples: the one in progress, the checkpoint's, or sampled now
        (only at its start: a position inside it without saved samples cannot be rebuilt)."""
        if self.outer is not None and self.outer.iteration == iteration:
            return self.outer
        if self._restored is not None and int(self._restored["iteration"]) == iteration:
            self.outer = OuterStep.from_state(self._restored, self.device)
            self._restored = None
            return self.outer
        if position != 0:
            raise RuntimeError(f"outer step {iteration} is in progress but its samples are not in the checkpoint")
        self.outer = self.sample_outer_step(iteration)
        return self.outer

    def draw_permutations(self, outer: OuterStep, epoch: int) -> None:
        """The inner epoch's sample permutation, then one timestep permutation per sample (the
        rank's generator; with noise_rng sample, seeded by the outer step, epoch and sample)."""
        n = outer.x0.shape[0]
        if self.per_sample:
            g = torch.Generator().manual_seed(derived_seed(self.seed, "nft-perm", outer.iteration, epoch))
            perm = torch.randperm(n, generator=g)
            outer.perm = perm.to(self.device)
            outer.time_perm = torch.stack([
                torch.randperm(self.n_t, generator=torch.Generator().manual_seed(
                    derived_seed(self.seed, "nft-time", outer.iteration, epoch, int(i)))) for i in perm
            ]).to(self.device)
        else:
            g = self.cuda_generator
            outer.perm = torch.randperm(n, device=self.device, generator=g)
            outer.time_perm = torch.stack([torch.randperm(self.n_t, device=self.device, generator=g) for _ in range(n)])
        outer.epoch = epoch

    def sample_generator(self, *parts: Any) -> torch.Generator:
        """A sample's own generator (noise_rng sample), seeded by the run's seed and `parts`."""
        return torch.Generator(device=self.device).manual_seed(derived_seed(self.seed, *parts))

    def on_step_end(self, step: int) -> None:
        """After the last optimizer step of an outer step: the old policy moves toward the student."""
        if step % self.steps_per_outer:
            return
        iteration = step // self.steps_per_outer
        self.update_old_policy(iteration)
        self.outer = None

    def old_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(student, old) parameter pairs: the whole models', or with LoRA the two adapters', read from
        the modules at each call (FSDP2's prepare replaces the parameters), each this process's shards."""
        if not self.lora:
            return list(zip(sharded_parameters(self.student.transformer), sharded_parameters(self.old.transformer), strict=True))
        from fv_accel.models.lora import adapter_pairs

        sharded_parameters(self.student.transformer)
        return adapter_pairs(self.student.transformer, OLD_ADAPTER)

    @torch.no_grad()
    def update_old_policy(self, iteration: int) -> None:
        """old <- decay * old + (1 - decay) * student, decay = return_decay(iteration, decay_type);
        the drift (mean squared change) is logged with the next outer step."""
        decay = return_decay(iteration, int(self.cfg.method.decay_type))
        drift = torch.zeros((), dtype=torch.float64, device=self.device)
        count, sharded = 0, False
        for src, tgt in self.old_pairs():
            new = tgt.detach() * decay + src.detach() * (1.0 - decay)
            change = (new.float() - tgt.float()).pow(2).sum()
            sharded = sharded or hasattr(change, "to_local")
            drift += local_tensor(change).double()  # under FSDP2 this process's shards' part
            count += tgt.numel()  # a DTensor's numel is the whole parameter's
            tgt.copy_(new)
        if sharded:
            from accelerate.utils import reduce

            drift = reduce(drift, reduction="sum")
        self._old_drift = float(drift) / max(1, count)

    # ---- sampling, decoding, scoring ----
    def sample_outer_step(self, iteration: int) -> OuterStep:
        """Sample, decode and score the outer step's batches; the advantages over every process."""
        t0 = time.perf_counter()
        timing = {"sample_s": 0.0, "decode_s": 0.0, "score_s": 0.0}
        xs, conds, prompts, rewards, valids = [], [], [], defaultdict(list), []
        self.old.transformer.eval()
        schedule = None
        for b in range(int(self.cfg.method.num_batches_per_epoch)):
            batch, batch_prompts = self.prompt_batch(iteration, b)
            tb, shape = self.sampling_batch(batch)
            if schedule is None:
                schedule = sampling_schedule(self.sampling_shift(shape), self.cfg.method.sampling, self.device)
            t1 = self._clock()
            generator: Any = self.cuda_generator
            if self.per_sample:
                first = self.dp_rank * shape[0]
                generator = [self.sample_generator("nft-sample", iteration, b, first + i) for i in range(shape[0])]
            x0 = sample_policy(self.old, tb, shape, schedule, self.cfg.method.sampling.trajectory, generator,
                               predict=self.predict_override)
            t2 = self._clock()
            clips = self.decode_for_reward(x0)
            t3 = self._clock()
            scores, invalid = self.score(clips, batch_prompts)
            t4 = self._clock()
            timing["sample_s"] += t2 - t1
            timing["decode_s"] += t3 - t2
            timing["score_s"] += t4 - t3
            xs.append(x0.detach())
            conds.append(tb.conditioning)
            prompts += batch_prompts
            valids.append(~invalid.to(self.device))
            for name, value in scores.items():
                rewards[name].append(value.to(self.device, torch.float32))
        x0, cond = torch.cat(xs), Conditioning.concat(conds)
        reward = {k: torch.cat(v) for k, v in rewards.items()}
        valid = torch.cat(valids)
        adv, adv_all, metrics = self.advantages(reward, prompts, valid)
        if self.per_sample:  # every process keeps every process's samples, in the order one process samples them
            batches = int(self.cfg.method.num_batches_per_epoch)

            def gather(t: torch.Tensor) -> torch.Tensor:
                return batch_major(self.gather(t.contiguous()), self.dp_size, batches)

            x0, valid, adv = gather(x0), gather(valid), batch_major(adv_all, self.dp_size, batches)
            cond = cond.map_samples(gather)
        train_t = schedule.timesteps[: self.n_t]
        metrics.update(timing, old_drift=self._old_drift, outer_step=float(iteration),
                       outer_s=time.perf_counter() - t0)
        return OuterStep(iteration, x0, cond, train_t[None].expand(x0.shape[0], -1).clone(), adv, valid, metrics)

    def _clock(self) -> float:
        """perf_counter once the device's queued work is done (the phase times are their kernels')."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    # A stand-in for the roles' predictions (tests): predict(role, x, t, tb) -> velocity.
    predict_override: Any = None
    # The generator(s) of the micro-batch's noise (set by single_train_step).
    _noise_generator: Any = None

    def sampling_shift(self, shape: Any) -> float:
        """The sampler's table shift: the student's training shift (`model_default`), or
        `method.sampling.flow_shift` with `flow_match_euler` (the student's when unset)."""
        spec = self.cfg.method.sampling
        if spec.scheduler == "flow_match_euler" and spec.flow_shift is not None:
            return float(spec.flow_shift)
        return float(self.student.training_shift(torch.Size(shape)))

    def prompt_batch(self, iteration: int, b: int) -> tuple[dict, list[str]]:
        """The rows of this process's sampling batch `b` of outer step `iteration`, collated."""
        from fv_accel.data.loader import collate

        loader = self._loader
        dataset = loader.dataset
        rows = self.trainable_rows(loader)
        seed = self.seed + (iteration - 1) * int(self.cfg.method.num_batches_per_epoch) + b
        picked = k_repeat_rows(rows, batch_size=self.sample_batch, repeats=int(self.cfg.method.num_video_per_prompt),
                               world_size=self.dp_size, rank=self.dp_rank, seed=seed)
        items = [dataset[(i, iteration, 0)] for i in picked]
        batch = collate(items)
        return batch, [str(item.get("caption", "")) for item in items]

    def trainable_rows(self, loader: Any) -> list[int]:
        """The rows prompts are drawn from: the loader's, less the held-out and set-aside ones and
        those whose caption is a held-out prompt of `method.validation.prompts`."""
        excluded = set(loader.sampler.exclude_indices) | set(getattr(loader, "set_aside_rows", {}))
        for prompt in self.cfg.method.validation.prompts:
            excluded |= set(self.caption_rows(loader.dataset).get(prompt, ()))
        rows = [i for i in range(len(loader.dataset)) if i not in excluded]
        if not rows:
            raise ConfigError("method.validation.prompts: every row of the training data holds a held-out prompt: nothing to train on")
        return rows

    def caption_rows(self, dataset: Any) -> dict[str, list[int]]:
        """Each caption of `dataset` with its rows (read once from the rows' caption column)."""
        if getattr(self, "_caption_rows", None) is None:
            rows: dict[str, list[int]] = defaultdict(list)
            for i in range(len(dataset)):
                row = dataset.rows.row(i) if hasattr(dataset, "rows") else dataset[(i, 0, 0)]
                rows[str(row.get("caption", "") or "")].append(i)
            self._caption_rows = dict(rows)
        return self._caption_rows

    def sampling_batch(self, batch: dict) -> tuple[TrainingBatch, tuple[int, ...]]:
        """`conditioning_of` the batch, after the two draws of FastVideo's `prepare_batch` that
        nothing uses (noise of the latent's shape, then `u`)."""
        cond, shape = self.conditioning_of(batch)
        if not self.per_sample:
            g = self.cuda_generator
            randn(shape, g, self.device)
            self.sample_homogeneous_indices(shape[0], g, self.device, in_range=False)
        return TrainingBatch(conditioning=cond), shape

    def conditioning_of(self, batch: dict) -> tuple[Conditioning, tuple[int, ...]]:
        """What a batch of prompt rows is sampled with: the student's conditioning (an image-to-video
        student's with each row's own clean first frames) and the latent shape [B, C, T, H, W] (the
        rows', or the recipe's for text-only rows)."""
        from fv_accel.data.loader import rollout_latent_shape

        cond = self.student.build_conditioning(batch)
        if cond.clean_frames:  # image-to-video by frame replacement: each prompt row's own first frames
            if batch.get("vae_latent") is None:
                raise ConfigError("method.name diffusion_nft: an image-to-video student takes its condition frames from the "
                                  "rows' clips; this dataset is text-only: preprocess clips (python -m fv_accel.preprocess --input ...)")
            cond.extras[CLEAN_CONDITION] = self.student.clean_latents(batch)[:, :, : cond.clean_frames]
        b = int(batch["sample_index"].shape[0])
        if batch.get("vae_latent") is not None:
            shape = (b, *batch["vae_latent"].shape[1:])
        else:
            shape = (b, *rollout_latent_shape(self.cfg, self.student.in_channels))
        return cond, tuple(int(s) for s in shape)

    def decode_for_reward(self, latents: torch.Tensor) -> torch.Tensor:
        """Clean latents [B, C, T, H, W] -> uint8 clips [B, F, H, W, 3] (the student family's VAE)."""
        from fv_accel.sampling import decode_latents

        if self._vae is None:
            self._vae = self.load_vae()
        family = type(self.student)
        frames = decode_latents(self._vae, latents, self.student.latents_mean, self.student.latents_std, decode=family.decode)
        return torch.from_numpy(frames)

    def load_vae(self) -> Any:
        """The VAE of the student's model (or the dataset's encoding model for a run folder)."""
        if self.model_source is None:
            raise ConfigError(
                "method.name diffusion_nft: no VAE to decode samples for the rewards (the student has no init_from and the "
                "dataset records no model); set callbacks.validation.model_from to the model folder or Hub id"
            )
        vae = type(self.student).load_vae(self.model_source)
        return vae.to(self.device).float().eval().requires_grad_(False)

    def score(self, clips: torch.Tensor, prompts: list[str]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Each reward per sample and `avg` (their weighted sum), and which samples had a non-finite reward."""
        if self.rewards is None:
            from fv_accel.rewards import build_rewards

            self.rewards = build_rewards(self.reward_spec, self.device)
        return self.rewards.score(clips, prompts)

    def advantages(self, reward: dict[str, torch.Tensor], prompts: list[str], valid: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """This process's advantages and every process's (gathered in rank order) from the rewards
        of every process, and the outer step's reward and advantage figures."""
        avg = torch.where(valid, reward["avg"], torch.zeros_like(reward["avg"]))
        all_avg, all_valid, all_prompts = self.gather(avg), self.gather(valid), self.gather_prompts(prompts)
        adv_all = group_advantages(all_avg, all_prompts, all_valid)
        n = avg.shape[0]
        adv = adv_all[self.dp_rank * n : (self.dp_rank + 1) * n]
        metrics: dict[str, float] = {}
        for name, value in reward.items():
            v = self.gather(torch.where(valid, value, torch.zeros_like(value)))[all_valid]
            metrics[f"reward/{name}"] = float(v.mean()) if v.numel() else math.nan
            metrics[f"reward/{name}_std"] = float(v.std(unbiased=False)) if v.numel() else math.nan
        a = adv_all[all_valid]
        metrics["advantage/std"] = float(a.std(unbiased=False)) if a.numel() else 0.0
        metrics["advantage/abs_mean"] = float(a.abs().mean()) if a.numel() else 0.0
        metrics["advantage/clipped_share"] = float((a.abs() > float(self.cfg.method.adv_clip_max)).float().mean()) if a.numel() else 0.0
        metrics["reward/dropped"] = float((~all_valid).sum())
        return adv, adv_all, metrics

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        if self.dp_size == 1:
            return t
        from accelerate.utils import gather

        return gather(t.contiguous())

    def gather_prompts(self, prompts: list[str]) -> list[str]:
        if self.dp_size == 1:
            return list(prompts)
        from accelerate.utils import gather_object

        return list(gather_object(list(prompts)))

    # ---- the loss ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        """One micro-batch at one trained timestep: FastVideo's DiffusionNFT loss."""
        item = batch["nft"]
        outer, index = item["outer"], item["index"]
        x0 = outer.x0[index]
        timestep = outer.timesteps[index, item["columns"]]
        adv = outer.advantages[index]
        valid = outer.valid[index]
        cond = outer.cond.select(index)
        tb = TrainingBatch(latents=x0, conditioning=cond, timesteps=timestep)
        self._noise_generator = self.cuda_generator
        if self.per_sample:
            self._noise_generator = [self.sample_generator("nft-noise", outer.iteration, outer.epoch, int(i), int(c))
                                     for i, c in zip(index.tolist(), item["columns"].tolist())]
        losses = self.nft_loss(x0, timestep, adv, valid, tb)
        outputs: dict[str, Any] = {"_fv_backward": (timestep, None), "training_batch": tb}
        metrics = {k: torch.tensor(v) for k, v in outer.metrics.items()}
        return losses, outputs, metrics

    def _predict(self, role: ModelBase, x: torch.Tensor, t: torch.Tensor, tb: TrainingBatch) -> torch.Tensor:
        if self.predict_override is not None:
            return self.predict_override(role, x, t, tb)
        return role.predict_noise(x, t, tb, conditional=True, attn_kind=self._attn_kind if role is self.student else "dense")

    def nft_loss(self, x0: torch.Tensor, timestep: torch.Tensor, adv: torch.Tensor, valid: torch.Tensor,
                 tb: TrainingBatch) -> dict[str, torch.Tensor]:
        """The positive prediction beta * v + (1 - beta) * v_old and the implicit negative
        (1 + beta) * v_old - beta * v, each turned into x0 and weighted per sample by its mean
        absolute error (no gradient); mixed by r = clamp(clip(adv) / adv_clip_max / 2 + 0.5, 0, 1);
        plus kl_beta * ||v - v_ref||^2. Samples whose reward was non-finite carry no loss."""
        mc = self.cfg.method
        beta, clip_max = float(mc.beta), float(mc.adv_clip_max)
        t = (timestep.float() / float(self.table.num_train_timesteps)).view(-1, *([1] * (x0.ndim - 1)))
        noise = randn((x0.shape[0], x0.shape[2], x0.shape[1], *x0.shape[3:]), self._noise_generator, x0.device).permute(0, 2, 1, 3, 4)
        xt = ((1 - t) * x0 + t * noise).to(x0.dtype)
        model_t = timestep
        k = tb.conditioning.clean_frames
        if k:  # the condition frames go in clean at timestep 0 and carry no loss
            xt, model_t = with_clean_condition(xt, timestep, tb.conditioning)
        with torch.no_grad():
            old = self._predict(self.old, xt, model_t, tb).detach()
            ref = self._predict(self.reference, xt, model_t, tb).detach()
        pred = self._predict(self.student, xt, model_t, tb)
        if k:
            x0, xt, old, ref, pred = (v[:, :, k:] for v in (x0, xt, old, ref, pred))
        # The loss in FastVideo's layout [B, T, C, H, W] (views): its sums over a sample's elements,
        # and so the gradients' float32 rounding, run in FastVideo's order.
        x0, xt, old, ref, pred = (v.permute(0, 2, 1, 3, 4) for v in (x0, xt, old, ref, pred))
        a = clip_advantages(adv, clip_max, mc.adv_mode)
        r = torch.clamp((a / clip_max) / 2.0 + 0.5, 0, 1)
        dims = tuple(range(1, x0.ndim))
        positive = xt - t * (beta * pred + (1 - beta) * old)
        negative = xt - t * ((1.0 + beta) * old - beta * pred)
        with torch.no_grad():
            w_pos = (positive.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
            w_neg = (negative.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clip(min=WEIGHT_FLOOR)
        positive_loss = ((positive - x0) ** 2 / w_pos).mean(dim=dims)
        negative_loss = ((negative - x0) ** 2 / w_neg).mean(dim=dims)
        per_sample = r * positive_loss / beta + (1.0 - r) * negative_loss / beta
        kl = ((pred - ref) ** 2).mean(dim=dims)
        policy_loss = masked_mean(per_sample * clip_max, valid)
        kl_loss = masked_mean(kl, valid)
        return {
            "total_loss": policy_loss + float(mc.kl_beta) * kl_loss,
            "policy_loss": policy_loss,
            "unweighted_policy_loss": masked_mean(per_sample, valid),
            "kl_div_loss": kl_loss,
            "old_deviate": ((pred - old) ** 2).mean(),
            "old_kl_div": ((old - ref) ** 2).mean(),
            "x0_norm": torch.mean(x0 ** 2),
        }

    # ---- checkpoints ----
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The old policy's weights (this process's part), and the outer step in progress."""
        out = {f"old.{i}": local_tensor(old).detach().clone() for i, (_, old) in enumerate(self.old_pairs())}
        if self.outer is not None:
            out.update({f"outer.{k}": v for k, v in self.outer.state_tensors().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        old = {k[len("old."):]: v for k, v in tensors.items() if k.startswith("old.")}
        if old:
            with torch.no_grad():
                for i, (_, param) in enumerate(self.old_pairs()):
                    local_tensor(param).copy_(old[str(i)].to(param.device))
        outer = {k[len("outer."):]: v for k, v in tensors.items() if k.startswith("outer.")}
        self._restored = outer or None
        self.outer = None

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        mc = self.cfg.method
        for key in ("num_batches_per_epoch", "num_inner_epochs", "num_video_per_prompt", "adv_clip_max", "adv_mode",
                    "timestep_fraction", "kl_beta", "beta", "decay_type"):
            sig[f"method.{key}"] = getattr(mc, key)
        sig["method.sample_train_batch_size"] = self.sample_batch
        sig["method.train_batch_size"] = self.train_batch
        sig["method.sampling"] = {k: getattr(mc.sampling, k) for k in ("num_steps", "scheduler", "trajectory", "flow_shift",
                                                                        "timesteps", "sigmas")}
        sig["method.reward_fn"] = repr(self.reward_spec)
        return sig


def clip_advantages(adv: torch.Tensor, clip_max: float, mode: str) -> torch.Tensor:
    """The advantage as the loss reads it under `method.adv_mode`."""
    a = torch.clamp(adv, -clip_max, clip_max)
    if mode == "positive_only":
        return torch.clamp(a, 0, clip_max)
    if mode == "negative_only":
        return torch.clamp(a, -clip_max, 0)
    if mode == "one_only":
        return torch.where(a > 0, torch.ones_like(a), torch.zeros_like(a))
    if mode == "binary":
        return torch.sign(a)
    return a


def masked_mean(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The mean over the valid samples (the plain mean when all are; 0 with a gradient when none is)."""
    if bool(valid.all()):
        return values.mean()
    w = valid.to(values.dtype)
    return (values * w).sum() / w.sum().clamp_min(1)


def sharded_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """`module.parameters()` as the optimizer holds them (under FSDP2 DTensor shards). FSDP2 leaves the
    parameters of a root module (and of groups wrapped with reshard_after_forward False) gathered
    after a forward that no backward follows, a frozen role's: plain tensors that writes would not
    reach the shards through. Resharding first makes every parameter its shard again."""
    reshard_fsdp_units(module)
    return list(module.parameters())


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This process's part of a tensor (a DTensor's local shard under FSDP2)."""
    return t.to_local() if hasattr(t, "to_local") else t


def batch_major(t: torch.Tensor, world: int, batches: int) -> torch.Tensor:
    """Samples gathered rank by rank, each rank's batch by batch ([world, batches, b, ...]), put
    batch by batch, each batch's ranks in order ([batches, world, b, ...]): where one process with
    batches of world x b holds them (sample number rank x b + i of each batch)."""
    return t.reshape(world, batches, -1, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

