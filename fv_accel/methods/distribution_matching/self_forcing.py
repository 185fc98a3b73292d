"""SelfForcingMethod: DMD2 distillation of a bidirectional teacher into a block-causal few-step
student that rolls out chunk by chunk over its KV cache, as it streams at inference (FastVideo
0.2.1's `self_forcing.py` semantics and key names).

The student's rollout (`simulate` only): the start noise of the whole clip; an exit step per chunk
(`same_step_across_blocks`: one for all; `last_step_only`: always the last); each chunk from its
noise through the few steps up to its exit, without gradient before the exit, then the exit step's
x0 with gradient (where `enable_gradient_in_rollout` and the chunk starts at or after
`start_gradient_frame`). Between steps the chunk's x0 goes to the next step: `sde` re-noises it
with fresh noise, `ode` keeps the current noise direction (an Euler step). A finished chunk is
written into the cache by one more forward, of its x0 detached, re-noised to the timestep
`context_noise` (a timestep value; 0 keeps it clean). The student's streaming forwards are given
their timesteps as integers (truncated), as FastVideo's causal Wan gives its transformer
`timestep.long()`; each x0 is converted at the step itself. The DMD gradient and the critic's
flow-matching loss act on the whole rolled-out clip, as in DMD2 (`DMD2Method`), except that the
score timesteps are shifted draws clamped to [0, N] only: FastVideo's Self-Forcing never applies
`min_timestep_ratio` / `max_timestep_ratio`. Every noising and every role's x0 uses the student's
training table.

Draws, in order per micro-batch (FastVideo's, each noise in its layout: see `_rollout_randn`):
the SFT preparation's (noise, `u`, unused); when the student is updated, a rollout (start noise;
the exit steps; per chunk the re-noising noises of the steps before its exit, then its context
noise when `context_noise > 0`) and the DMD draws; then a second rollout without gradient and the
critic's draws. The exit steps and the DMD/critic draws come from the
rank's generator (`cuda_generator`); the rollout's noises from the rollout generator: one per rank,
seeded apart from `cuda_generator` and saved with each checkpoint (FastVideo draws them from
torch's global generator). Under several processes the exit steps are rank 0's, broadcast (each
rank then runs the same forwards, which sharded engines need). With `training.loop.noise_rng:
sample` every noise comes from its sample's generator and the exit steps from a generator of
(seed, step), the same on every rank and micro-batch.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import torch

from fv_accel.methods.base import LogScalar
from fv_accel.methods.distribution_matching.dmd2 import DMD2Method, write_json_atomically
from fv_accel.models.base import ModelBase, TrainingBatch
from fv_accel.schedulers import randn
from fv_accel.seeding import derived_seed

logger = logging.getLogger(__name__)


def rollout_generator_seed(seed: int, dp_rank: int) -> int:
    """The rollout generator's 63-bit seed: apart from `cuda_generator`'s (seed + rank)."""
    return derived_seed(seed, dp_rank, "self_forcing_rollout")


def exit_generator_seed(seed: int, iteration: int) -> int:
    """The seed of the exit steps' generator of one step under `noise_rng: sample`."""
    return derived_seed(seed, iteration, "self_forcing_exit")


def _strided_randn(shape: Any, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Standard normal [B, C, T, H, W], fp32, filled through its [B, T, C, H, W] view."""
    x = torch.empty(tuple(shape), device=device, dtype=torch.float32)
    x.permute(0, 2, 1, 3, 4).normal_(generator=generator)
    return x


def _flag(raw: Any, key: str, default: bool) -> bool:
    if raw is None:
        return default
    if not isinstance(raw, bool):
        raise ValueError(f"method.{key} must be true or false, got {raw!r}")
    return raw


class SelfForcingMethod(DMD2Method):
    """Self-Forcing: DMD2 with a block-causal student rolled out chunk by chunk over its KV cache."""

    def __init__(self, *, cfg: Any, role_models: dict[str, ModelBase]) -> None:
        mc = cfg.method
        if mc.rollout_mode is None:
            mc.rollout_mode = "simulate"
        if mc.rollout_mode != "simulate":
            raise ValueError(
                f"method.rollout_mode {mc.rollout_mode!r}: self_forcing rolls the student out from noise; only simulate is supported"
            )
        student = role_models.get("student")
        if student is not None and getattr(student, "causal_attention", None) is None:
            raise ValueError("self_forcing needs a block-causal student: set models.student.causal: true")
        for role in ("teacher", "critic"):
            model = role_models.get(role)
            if model is not None and getattr(model, "causal_attention", None) is not None:
                raise ValueError(f"self_forcing: the {role} is bidirectional: set models.{role}.causal: false")
        if student is not None and student.capabilities.image_conditioning:
            raise ValueError(
                "self_forcing trains text-to-video students; this student is image-to-video (models.student): "
                "distil it with dmd2, or train a text-to-video student"
            )
        self._parse_self_forcing_keys(mc)
        super().__init__(cfg=cfg, role_models=role_models)
        self._drop_score_window()
        self.block_size = int(self.student.causal_block_size)
        self._attn_kind = "dense"
        self.rollout_generator = torch.Generator(device=self.device).manual_seed(rollout_generator_seed(self.seed, self.dp_rank))
        self._iteration = 0

    def _parse_self_forcing_keys(self, mc: Any) -> None:
        sample_type = str(mc.student_sample_type).strip().lower()
        if sample_type not in ("sde", "ode"):
            raise ValueError(f"method.student_sample_type must be sde or ode, got {mc.student_sample_type!r}")
        self._sample_type: Literal["sde", "ode"] = sample_type  # type: ignore[assignment]
        if isinstance(mc.context_noise, bool) or not isinstance(mc.context_noise, (int, float)) or mc.context_noise < 0:
            raise ValueError(f"method.context_noise must be a timestep >= 0 (0 = clean context), got {mc.context_noise!r}")
        self._context_noise = float(mc.context_noise)
        start = mc.start_gradient_frame
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise ValueError(f"method.start_gradient_frame must be an integer >= 0, got {start!r}")
        self._start_gradient_frame = int(start)
        self._same_step = _flag(mc.same_step_across_blocks, "same_step_across_blocks", False)
        self._last_step_only = _flag(mc.last_step_only, "last_step_only", False)
        self._gradient_in_rollout = _flag(mc.enable_gradient_in_rollout, "enable_gradient_in_rollout", True)

    def _drop_score_window(self) -> None:
        """The score timesteps span [0, N]: DMD2's window (checked by its parse) is not applied, as in
        FastVideo's Self-Forcing, whose DMD and critic losses never read the window keys."""
        n = self.table.num_train_timesteps
        if self._score_bounds != (0, n) and self.process_index == 0:
            mc = self.cfg.method
            logger.warning(
                "method.min_timestep_ratio/max_timestep_ratio %s/%s have no effect on self_forcing: FastVideo's "
                "Self-Forcing does not apply them (its score timesteps span [0, %d]) and neither does fv_accel; "
                "they apply to dmd2", mc.min_timestep_ratio, mc.max_timestep_ratio, n,
            )
        self._score_bounds = (0, n)

    def check_sample_videos(self) -> None:
        """The sample videos stream with this method's own sampler (`sample`), at any steps."""

    def check_data(self, loader: Any) -> None:
        """DMD2's checks, then whole chunks: the clips' latent frames (for prompts alone, the
        recipe's rollout) a multiple of the chunk size, refused at build rather than at the first step."""
        from fv_accel.config import ConfigError

        super().check_data(loader)
        dataset = getattr(loader, "dataset", loader)
        if self._rollout_shape is not None:
            frames = {int(self._rollout_shape[1])}
        else:
            frames = {int(shape[1]) for part in (getattr(dataset, "parts", None) or [dataset]) for shape in part.latent_shapes}
        for num_frames in sorted(frames):
            try:
                self.blocks(num_frames)
            except ValueError as err:
                raise ConfigError(f"training.data.data_path '{self.cfg.training.data.data_path}': {err}") from None

    def student_steps_record(self) -> dict[str, Any]:
        """DMD2's, with the timesteps the streaming forwards are given (integers) and how it steps."""
        record = super().student_steps_record()
        record["timesteps"] = [float(int(t)) for t in record["timesteps"]]
        return {**record, "student_sample_type": self._sample_type, "context_noise": self._context_noise}

    def write_final_files(self, output_dir: Any) -> None:
        """DMD2's (`student_steps.json`, and `scheduler/` where a stock scheduler steps the student's
        steps), and `self_forcing.json`: how the student streams (chunk size, stepping, context noise)."""
        from pathlib import Path

        super().write_final_files(output_dir)
        info = {"chunk_size": self.block_size, "student_sample_type": self._sample_type, "context_noise": self._context_noise}
        write_json_atomically(Path(output_dir) / "self_forcing.json", info)

    # ---- state saved with checkpoints (per rank) ----
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {"rollout_generator": self.rollout_generator.get_state().cpu()}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "rollout_generator" not in tensors:
            raise ValueError("the checkpoint holds no self_forcing rollout generator state: it was not written by a self_forcing run")
        self.rollout_generator.set_state(tensors["rollout_generator"])

    # ---- draws ----
    def _rollout_gen(self) -> Any:
        return self.rollout_generator if self.noise_rng == "rank" else self._generator

    def _rollout_randn(self, shape: torch.Size, device: torch.device, *, whole_clip: bool = False) -> torch.Tensor:
        """Rollout noise [B, C, T, H, W] as FastVideo's `randn_like` draws it. FastVideo's latents and
        its chunks' x0 are [B, T, C, H, W] views of [B, C, T, H, W] memory, and `randn_like` fills such
        a view element by element, drawing other numbers than a contiguous fill. Its start noise
        (`whole_clip`) is drawn so at any batch; a chunk's x0 (the re-noising and context noises) too
        at batch 1, where its `flatten(0, 1)` is a view, but contiguous in [B, T, C, H, W] above, where
        the flatten copies. Under `noise_rng: sample` each sample's generator draws as FastVideo draws
        a batch of one."""
        gens = self._rollout_gen()
        if not isinstance(gens, torch.Generator):
            return torch.cat([_strided_randn((1, *shape[1:]), g, device) for g in gens])
        if whole_clip or shape[0] == 1:
            return _strided_randn(shape, gens, device)
        b, c, t, h, w = shape
        return randn((b, t, c, h, w), gens, device).permute(0, 2, 1, 3, 4)

    def sample_exit_indices(self, num_blocks: int, num_steps: int, device: torch.device) -> list[int]:
        shape = (1,) if self._same_step else (num_blocks,)
        if self._last_step_only:
            indices = torch.full(shape, num_steps - 1, dtype=torch.long, device=device)
        elif self.noise_rng == "sample":
            gen = torch.Generator(device=device).manual_seed(exit_generator_seed(self.seed, self._iteration))
            indices = torch.randint(0, num_steps, shape, generator=gen, device=device)
        else:
            indices = self._exit_indices_of_rank0(shape, num_steps, device)
        values = [int(i) for i in indices.tolist()]
        return values * num_blocks if self._same_step else values

    def _exit_indices_of_rank0(self, shape: tuple[int, ...], num_steps: int, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        shared = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if not shared or dist.get_rank() == 0:
            indices = torch.randint(0, num_steps, shape, generator=self.cuda_generator, device=device)
        else:
            indices = torch.empty(shape, dtype=torch.long, device=device)
        if shared:
            dist.broadcast(indices, src=0)
        return indices

    # ---- the student's chunks over the KV cache ----
    def chunk_velocity(self, x: torch.Tensor, timestep: torch.Tensor, tb: TrainingBatch, cache: Any, start: int,
                       *, write: bool = False) -> torch.Tensor:
        """The student's velocity for the chunk x [B, C, n, H, W] at frame `start` and per-frame
        timesteps [B, n] (given to the model as integers, as FastVideo's causal Wan gives them),
        attending to the finished chunks in `cache`; `write` adds its keys/values."""
        with self.student.causal_attention.kv_cache(cache, start, write=write):
            return self.student.predict_noise(x, timestep.long(), tb, conditional=True, cfg_uncond=self._cfg_uncond,
                                              attn_kind="dense")

    def blocks(self, num_frames: int) -> list[tuple[int, int]]:
        if num_frames % self.block_size:
            raise ValueError(
                f"self_forcing rolls out whole chunks: {num_frames} latent frames is not a multiple of method.chunk_size "
                f"{self.block_size} (set training.data.num_latent_t, or the clips' frame count, to a multiple)"
            )
        return [(s, s + self.block_size) for s in range(0, num_frames, self.block_size)]

    def student_rollout(self, tb: TrainingBatch, *, with_grad: bool) -> torch.Tensor:
        """The student's clip, chunk by chunk over its KV cache (see the module docstring)."""
        latents = tb.latents
        device = latents.device
        steps = self.denoising_steps(latents.shape).float()
        noise = self._rollout_randn(latents.shape, device, whole_clip=True)
        blocks = self.blocks(latents.shape[2])
        exits = self.sample_exit_indices(len(blocks), len(steps), device)
        return self._rollout(tb, noise, steps, blocks, exits, lambda shape: self._rollout_randn(shape, device), with_grad=with_grad)

    @torch.no_grad()
    def sample(self, tb: TrainingBatch, noise: torch.Tensor, generator: Any = None) -> torch.Tensor:
        """The student's sample as it streams: the training rollout with every chunk through all of
        its few steps, from `noise` [B, C, T, H, W]; the re-noising and context noises drawn from
        `generator` (torch.Generator, one per sample, or None for torch's global one)."""
        from fv_accel.sampling import chunk_bounds

        steps = self.denoising_steps(noise.shape).float()
        blocks = chunk_bounds(noise.shape[2], self.block_size)  # a shorter last chunk where the length asks

        def draw(shape: torch.Size) -> torch.Tensor:
            if generator is None:
                return torch.randn(shape, device=noise.device)
            return randn(shape, generator, noise.device)

        return self._rollout(tb, noise.float(), steps, blocks, [len(steps) - 1] * len(blocks), draw, with_grad=False)

    def _rollout(self, tb: TrainingBatch, noise: torch.Tensor, steps: torch.Tensor, blocks: list[tuple[int, int]],
                 exits: list[int], draw: Any, *, with_grad: bool) -> torch.Tensor:
        from fv_accel.models.attention import KVCache

        bsz, device = noise.shape[0], noise.device
        table = self.student.training_table(noise.shape)
        cache = KVCache()
        out = []
        for k, (start, end) in enumerate(blocks):
            x = noise[:, :, start:end]
            grad = with_grad and self._gradient_in_rollout and torch.is_grad_enabled() and start >= self._start_gradient_frame
            for i in range(exits[k] + 1):
                t = steps[i].expand(bsz, end - start)
                with torch.set_grad_enabled(grad and i == exits[k]):
                    x0 = table.x0_from_velocity(x, self.chunk_velocity(x, t, tb, cache, start), steps[i : i + 1])
                if i < exits[k]:
                    x = self._next_noisy(table, x, x0, steps[i : i + 1], steps[i + 1 : i + 2], draw)
            out.append(x0)
            with torch.no_grad():
                context, t_context = x0.detach(), torch.zeros(bsz, end - start, device=device)
                if self._context_noise > 0:
                    t_context = torch.full((bsz, end - start), self._context_noise, device=device)
                    context = table.add_noise_at(context, draw(x0.shape), t_context[:1, 0])
                if k + 1 < len(blocks):  # the last chunk's keys/values would serve no later chunk
                    self.chunk_velocity(context, t_context, tb, cache, start, write=True)
        return torch.cat(out, dim=2)

    def _next_noisy(self, table: Any, x: torch.Tensor, x0: torch.Tensor, t: torch.Tensor, t_next: torch.Tensor,
                    draw: Any) -> torch.Tensor:
        """The chunk at the next step: x0 re-noised with fresh noise (sde), or moved along the current
        noise direction (ode: (1 - s') x0 + s' (x - (1 - s) x0) / s)."""
        if self._sample_type == "sde":
            return table.add_noise_at(x0, draw(x0.shape), t_next)
        s = table.nearest_sigmas(t, x.shape[0]).to(x.device).view(-1, 1, 1, 1, 1)
        s_next = table.nearest_sigmas(t_next, x.shape[0]).to(x.device).view(-1, 1, 1, 1, 1)
        eps = (x - (1 - s) * x0) / s.clamp_min(1e-8)
        return (1 - s_next) * x0 + s_next * eps

    def predict_x0(self, role: ModelBase, x: torch.Tensor, timestep: torch.Tensor, tb: TrainingBatch, *,
                   conditional: bool, attn_kind: str) -> torch.Tensor:
        """A role's x0, converted with the student's training table (the sigma the clip was noised with)."""
        velocity = role.predict_noise(x, timestep, tb, conditional=conditional, cfg_uncond=self._cfg_uncond, attn_kind=attn_kind)
        return self.student.training_table(x.shape).x0_from_velocity(x, velocity, timestep)

    # ---- the public face ----
    def single_train_step(
        self, batch: dict[str, Any], iteration: int
    ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, LogScalar]]:
        self._iteration = int(iteration)
        return super().single_train_step(batch, iteration)

    def math_signature(self) -> dict[str, Any]:
        sig = super().math_signature()
        sig.update({
            "method.chunk_size": self.block_size,
            "method.student_sample_type": self._sample_type,
            "method.context_noise": self._context_noise,
            "method.same_step_across_blocks": self._same_step,
            "method.last_step_only": self._last_step_only,
            "method.enable_gradient_in_rollout": self._gradient_in_rollout,
            "method.start_gradient_frame": self._start_gradient_frame,
        })
        return sig
