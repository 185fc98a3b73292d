"""Shared pieces of the benchmarks: model sizes, benchmark datasets, the machine description,
statistics, the bare PyTorch loop, our run driven through the real Trainer, and result files.

The scripts run from the repository root (`python benchmarks/step_overhead.py`); this module puts
the repository on `sys.path` so that `fv_accel` imports without an install.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from fv_accel.process import quiet_libraries  # noqa: E402  (imports no library)

# Before any benchmark imports diffusers or peft (which imports bitsandbytes, whose CPU backend
# announces a missing 4-bit kernel package no benchmark uses).
quiet_libraries()
# On a shared CPU, OpenMP threads that spin at barriers while another process holds the core make
# small ops many times slower (seen here: a tiny step 80 ms -> 1-4 s at load 8 on 2 cores). Passive
# waiting keeps the figures meaningful; it must be set before torch starts its thread pool.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from fv_accel.data.loader import TEXT_MAX_LENGTH  # noqa: E402  (text embeddings padded/cut to this)
from fv_accel.trainer import TrainerCallback  # noqa: E402

RESULTS_DIR = REPO / "benchmarks" / "results"
WORK_DIR = REPO / "outputs" / "bench"

# Benchmark sizes: a recipe (the one source of the model and its training settings).
SIZE_RECIPES = {
    "tiny": "configs/tiny_finetune.yaml",
    "small": "configs/bench_small.yaml",
    "wan_1_3b": "configs/gpu_bench_1_3b.yaml",
    "wan_14b": "configs/gpu_bench_14b.yaml",
}


# ---------------------------------------------------------------------------------------------
# sizes and data
# ---------------------------------------------------------------------------------------------
@dataclass
class BenchSize:
    name: str
    recipe: Path
    latent_shape: tuple[int, int, int, int]  # [C, T, H, W]
    text_shape: tuple[int, int]  # [L, D]
    batch_size: int

    @property
    def tokens_per_sample(self) -> int:
        from fv_accel.data.loader import latent_tokens

        return latent_tokens(self.latent_shape)

    def describe(self) -> str:
        c, t, h, w = self.latent_shape
        return f"{self.name}: latent {c}x{t}x{h}x{w} ({self.tokens_per_sample} tokens), batch {self.batch_size}"


def bench_size(name: str, *, num_latent_t: Optional[int] = None, batch_size: Optional[int] = None) -> BenchSize:
    """The latent and text shapes of a size, read from its recipe (`num_latent_t`, `num_height`,
    `num_width`; the tiny recipe's `tiny_*` clip settings), optionally with other T or batch."""
    from fv_accel.config import load_config

    if name not in SIZE_RECIPES:
        raise SystemExit(f"unknown size {name!r}; choose from {', '.join(SIZE_RECIPES)}")
    recipe = REPO / SIZE_RECIPES[name]
    cfg = load_config(recipe)
    data = cfg.training.data
    tc = cfg.models.student.transformer_config or {}
    if data.num_latent_t is not None:
        t, h, w = data.num_latent_t, data.num_height // 8, data.num_width // 8
    else:  # the tiny recipe generates its clips: Wan VAE, 4x in time and 8x in space
        t, h, w = (data.tiny_num_frames - 1) // 4 + 1, data.tiny_height // 8, data.tiny_width // 8
    if num_latent_t is not None:
        t = num_latent_t
    shape = (int(tc["in_channels"]), int(t), int(h), int(w))
    return BenchSize(name, recipe, shape, (TEXT_MAX_LENGTH, int(tc["text_dim"])), batch_size or data.train_batch_size)


def write_latent_dataset(folder: Path, size: BenchSize, rows: int, *, seed: int = 0) -> str:
    """Random latents and text embeddings in FastVideo's Parquet schema (schema.make_row/write_rows),
    float32 as CPU preprocessing writes them; reused when a matching one is already there."""
    folder = Path(folder)
    spec = {"latent_shape": list(size.latent_shape), "text_shape": list(size.text_shape), "rows": rows, "seed": seed}
    marker = folder / "bench_dataset.json"
    shard = folder / "data-00000.parquet"
    if shard.is_file() and marker.is_file() and json.loads(marker.read_text()) == spec:
        return str(folder)
    from fv_accel.data.schema import make_row, write_rows

    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    g = torch.Generator().manual_seed(seed)
    c, t, h, w = size.latent_shape
    out = []
    for i in range(rows):
        out.append(
            make_row(
                sample_id=f"bench-{i:05d}",
                latent=torch.randn(size.latent_shape, generator=g),
                text_embedding=torch.randn(size.text_shape, generator=g),
                caption=f"random benchmark clip {i}",
                file_name=f"bench-{i:05d}.mp4",
                width=w * 8,
                height=h * 8,
                num_frames=(t - 1) * 4 + 1,
                duration_sec=((t - 1) * 4 + 1) / 16.0,
                fps=16.0,
            )
        )
    write_rows(out, shard)
    marker.write_text(json.dumps(spec) + "\n")
    return str(folder)


def datasets_available() -> bool:
    try:
        import datasets  # noqa: F401
    except ImportError:
        return False
    return True


class InMemoryLatentDataset:
    """Stand-in for `LatentDataset` on a machine without the `datasets` package (the GPU script is
    meant to need only torch, diffusers and accelerate): the same items from random tensors, so the
    Trainer, sampler and collate are ours unchanged. Recorded in the results when used."""

    def __init__(self, data_path: str, **_: Any):
        spec = json.loads((Path(data_path) / "bench_dataset.json").read_text())
        self.data_path = str(data_path)
        self.latent_shapes = [tuple(spec["latent_shape"])] * spec["rows"]
        g = torch.Generator().manual_seed(spec["seed"])
        self.latents = [torch.randn(spec["latent_shape"], generator=g) for _ in range(min(spec["rows"], 4))]
        self.text = torch.randn(spec["text_shape"], generator=g)
        self.global_offset = 0

    def __len__(self) -> int:
        return len(self.latent_shapes)

    def bucket_key(self, i: int) -> tuple:
        return self.latent_shapes[i][1:]

    def __getitem__(self, key: Any) -> dict:
        index, epoch, position = key if isinstance(key, tuple) else (key, 0, 0)
        return {
            "vae_latent": self.latents[int(index) % len(self.latents)].clone(),
            "text_embedding": self.text.clone(),
            "text_attention_mask": torch.ones(self.text.shape[0], dtype=torch.long),
            "caption": "",
            "sample_index": int(index),
            "epoch": int(epoch),
            "position": int(position),
        }


def prepare_dataset(work_dir: Path, size: BenchSize, rows: int) -> tuple[str, str]:
    """(data path, how it is read): Parquet through our loader, or in memory without `datasets`.
    Its fv_dataset.json records latent statistics 0 and 1: the random latents are drawn normalised."""
    from fv_accel.data.schema import write_dataset_info

    folder = Path(work_dir) / "data" / f"{size.name}_{'x'.join(map(str, size.latent_shape))}_{rows}"
    channels = int(size.latent_shape[0])
    folder.mkdir(parents=True, exist_ok=True)
    write_dataset_info(folder, model=None, latent_stats=([0.0] * channels, [1.0] * channels))
    if datasets_available():
        return write_latent_dataset(folder, size, rows), "parquet (fv_accel.data.loader)"
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"latent_shape": list(size.latent_shape), "text_shape": list(size.text_shape), "rows": rows, "seed": 0}
    (folder / "bench_dataset.json").write_text(json.dumps(spec) + "\n")
    import fv_accel.data.loader as loader_module

    loader_module.LatentDataset = InMemoryLatentDataset  # type: ignore[misc]
    return str(folder), "in memory (the datasets package is not installed)"


def bench_overrides(out_dir: Path, data_path: str, method: str, **extra: Any) -> dict:
    """Our run as a user would launch it, minus the optional extras (trackers, EMA, samples, checkpoints)."""
    out = {
        "method.name": method,
        "training.data.data_path": data_path,
        "training.checkpoint.output_dir": str(out_dir),
        "training.checkpoint.training_state_checkpointing_steps": 0,
        "training.checkpoint.save_final": False,
        "training.tracker.trackers": ["none"],
        "training.tracker.write_plots": False,
        "callbacks.validation.enable": False,
        "callbacks.ema.enable": False,
        # The benchmark sets the step budget per segment (OursRunner.steps).
        "training.loop.max_train_steps": 1_000_000,
    }
    out.update(extra)
    return out


# ---------------------------------------------------------------------------------------------
# the machine
# ---------------------------------------------------------------------------------------------
def machine_info() -> dict:
    info: dict[str, Any] = {
        "cpu_model": _cpu_model(),
        "cpu_cores": os.cpu_count(),
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "ram_gb": round(_ram_bytes() / 2**30, 1),
        "load_average_1m_at_start": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    for name in ("diffusers", "accelerate"):
        try:
            info[name] = __import__(name).__version__
        except ImportError:
            info[name] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return 0


def machine_line(info: dict) -> str:
    parts = [f"{info['cpu_model']}, {info['cpu_cores_usable']} usable cores", f"torch {info['torch']}"]
    if info.get("gpu"):
        parts.insert(0, f"{info['gpu']} ({info['gpu_memory_gb']} GiB)")
    if info.get("load_average_1m_at_start") is not None:
        parts.append(f"load average {info['load_average_1m_at_start']} at start")
    return "; ".join(parts)


# ---------------------------------------------------------------------------------------------
# statistics and timing
# ---------------------------------------------------------------------------------------------
def summarize(values: Sequence[float]) -> dict:
    vals = [float(v) for v in values]
    if not vals:
        return {"n": 0, "min": math.nan, "median": math.nan, "max": math.nan, "mean": math.nan}
    return {
        "n": len(vals),
        "min": min(vals),
        "median": statistics.median(vals),
        "max": max(vals),
        "mean": statistics.fmean(vals),
    }


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def fmt_mmm(stats: dict, digits: int = 3) -> str:
    """'median (min-max)'."""
    return f"{stats['median']:.{digits}f} ({stats['min']:.{digits}f}-{stats['max']:.{digits}f})"


# ---------------------------------------------------------------------------------------------
# the two loops being compared
# ---------------------------------------------------------------------------------------------
class StepTime(NamedTuple):
    wall: float  # seconds of wall clock
    cpu: float  # seconds of this process's CPU time, all threads (robust to other processes' load)
    phases: Optional[dict] = None  # PhaseTimer's seconds per phase in this step


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float], phases: Optional[dict] = None) -> StepTime:
    wall, cpu = clocks()
    return StepTime(wall - start[0], cpu - start[1], phases)


class PhaseTimer:
    """Wall time of the parts that every loop shares: the transformer's forward (module hooks), the
    backward (a wrapped call) and the optimizer step (optimizer hooks). What a step spends outside
    them is the loop's own cost (data, noise and loss bookkeeping, clipping, logging), measured per
    step instead of as the difference of two large, noisy step times. CPU only: on CUDA these
    would be kernel launch times."""

    PHASES = ("forward", "backward", "optimizer")  # the model's work, the same in every loop

    def __init__(self, model: torch.nn.Module, optimizer: Any):
        self.totals: dict[str, float] = dict.fromkeys(self.PHASES, 0.0)
        self._began: dict[str, float] = {}
        model.register_forward_pre_hook(lambda *_: self._begin("forward"))
        model.register_forward_hook(lambda *_: self._end("forward"))
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper holds the torch one
        inner.register_step_pre_hook(lambda *_: self._begin("optimizer"))
        inner.register_step_post_hook(lambda *_: self._end("optimizer"))

    def _begin(self, phase: str) -> None:
        self._began[phase] = time.perf_counter()

    def _end(self, phase: str) -> None:
        self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - self._began.pop(phase)

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        """Time every call of `owner.attr` as `phase` (an instance attribute shadows the method)."""
        original = getattr(owner, attr)

        def timed(*args: Any, **kwargs: Any) -> Any:
            self._begin(phase)
            try:
                return original(*args, **kwargs)
            finally:
                self._end(phase)

        setattr(owner, attr, timed)

    def take(self) -> dict:
        out, self.totals = self.totals, dict.fromkeys(self.PHASES, 0.0)
        return out


class StepClock(TrainerCallback):
    """A trainer callback that times every loop iteration of the Trainer, end to end: data, the
    method's step, backward, clipping, optimizer, logging and telemetry (everything between two
    step ends; the first step of a `run()` is timed from the start of training)."""

    def __init__(self) -> None:
        self._last = clocks()
        self.times: list[StepTime] = []
        self.phase_timer: Optional[PhaseTimer] = None

    def on_train_start(self, trainer: Any) -> None:
        self._last = clocks()

    def on_step_end(self, trainer: Any, step: int, logs: dict) -> None:
        synchronize()  # the step's last kernels (the optimizer's) are inside its time
        phases = None
        if self.phase_timer is not None:
            phases = {**self.phase_timer.take(), "data": logs["data_wait"]}  # the Trainer's own figure
        self.times.append(since(self._last, phases))
        self._last = clocks()

    def take(self) -> list[StepTime]:
        out, self.times = self.times, []
        return out


class OursRunner:
    """Our method through `build_from_config` and the real `Trainer`; `steps(n)` runs `Trainer.run()`
    for n more steps (the recipe's `max_train_steps` is moved forward each time)."""

    def __init__(
        self, recipe: Path, overrides: dict, *, accelerator: Any = None, extra_callbacks: Sequence = (), phases: bool = False
    ):
        from fv_accel.build import build_from_config
        from fv_accel.trainer import Trainer

        self.clock = StepClock()
        self.run = build_from_config(str(recipe), overrides, accelerator=accelerator)
        self.trainer = Trainer(self.run, callbacks=list(self.run.callbacks) + list(extra_callbacks) + [self.clock])
        if phases:
            method = self.run.method
            self.clock.phase_timer = PhaseTimer(method.student.transformer, method.optimizer)
            self.clock.phase_timer.wrap(method, "backward", "backward")
            # The method's step holds the forward; the rest of it is noise, timesteps and the loss.
            self.clock.phase_timer.wrap(method, "single_train_step", "method_step")
            # The Trainer's clipping: the gradient norm, and the scaling when over the limit.
            self.clock.phase_timer.wrap(self.trainer, "_grad_norms", "clip")
            self.clock.phase_timer.wrap(self.trainer, "_clip_to", "clip")

    @property
    def accelerator(self) -> Any:
        return self.run.accelerator

    @property
    def history(self) -> list[dict]:
        return self.trainer.history

    def steps(self, n: int) -> list[StepTime]:
        self.run.config.training.loop.max_train_steps = self.trainer.step + n
        # The end-of-run summary table and the progress bar come with every segment: keep them off
        # the console (log records still show: logging handlers hold the original stream).
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            self.trainer.run()
        synchronize()
        return self.clock.take()


class BareLoop:
    """The cheapest loop we can write on the same model, batch and optimizer math: noise,
    flow-matching loss, backward, the recipe's gradient clipping as a bare loop writes it
    (`torch.nn.utils.clip_grad_norm_` to `callbacks.grad_clip.max_grad_norm`, when > 0), the recipe's
    optimizer step as our run builds it (`build_optimizer`; the benchmark recipes': AdamW, in the
    kernel `implementation: auto` picks, fused where torch has it); nothing else (no logging, no
    non-finite check; its batches kept on the device: `batch` is one batch, or a list of batches the
    steps take in turn, e.g. one epoch of the benchmark dataset, so that it trains on the same rows as
    our loop rather than on one batch kept hot in the CPU caches). `lora`: the recipe's peft LoRA
    adapter on the frozen model, trained alone. On CUDA each step ends with a synchronize so that
    per-step times are real (our Trainer syncs once a step too, in its non-finite check)."""

    def __init__(
        self, cfg: Any, batch: dict, device: torch.device, mixed_precision: str, *, phases: bool = False, lora: bool = False
    ):
        from accelerate.utils import set_seed
        from diffusers import WanTransformer3DModel

        set_seed(cfg.training.data.seed)  # the same initial weights as our student
        self.model = WanTransformer3DModel(**dict(cfg.models.student.transformer_config)).to(device)
        if lora:
            # As our student does it: the recipe's targets or the Wan family's, the model frozen, the
            # adapter trainable in fp32 (the model is fp32 here).
            from fv_accel.models.lora import apply_lora, with_default_targets
            from fv_accel.models.wan import WanStudent

            apply_lora(self.model, with_default_targets(cfg.models.student.lora, WanStudent.lora_target_modules))
        if cfg.training.model.enable_gradient_checkpointing_type == "full":
            self.model.enable_gradient_checkpointing()
        self.model.train()
        from fv_accel.optim import build_optimizer

        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(cfg, self.params)
        self.max_norm = float(cfg.callbacks.grad_clip.max_grad_norm)
        batches = batch if isinstance(batch, list) else [batch]
        self.data = [
            (b["vae_latent"].to(device=device, dtype=torch.float32), b["text_embedding"].to(device=device, dtype=torch.float32))
            for b in batches
        ]
        self.next_batch = 0
        # The bare loop trains the Wan transformer: the Wan family's training shift.
        from fv_accel.models.wan import WanStudent

        shift = cfg.models.student.flow_shift
        self.shift = float(WanStudent.default_flow_shift if shift is None else shift)
        self.device = device
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision)
        self.generator = torch.Generator(device=device).manual_seed(cfg.training.data.seed)
        self.phase_timer: Optional[PhaseTimer] = None
        if phases:
            self.phase_timer = PhaseTimer(self.model, self.optimizer)
            self.phase_timer.wrap(self, "backward", "backward")
            self.phase_timer.wrap(self, "clip", "clip")

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> float:
        (x0, text), g = self.data[self.next_batch % len(self.data)], self.generator
        self.next_batch += 1
        noise = torch.randn(x0.shape, generator=g, device=self.device)
        u = torch.rand(x0.shape[0], generator=g, device=self.device)
        sigma = self.shift * u / (1 + (self.shift - 1) * u)
        s = sigma.view(-1, 1, 1, 1, 1)
        noisy = (1 - s) * x0 + s * noise
        with torch.autocast(self.device.type, dtype=self.autocast_dtype or torch.float32, enabled=self.autocast_dtype is not None):
            pred = self.model(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=text, return_dict=False)[0]
        loss = (pred.float() - (noise - x0)).pow(2).mean()
        self.backward(loss)
        self.clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss

    def clip(self) -> None:
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.max_norm)

    def steps(self, n: int) -> list[StepTime]:
        out = []
        for _ in range(n):
            start = clocks()
            self.step()
            synchronize()
            out.append(since(start, self.phase_timer.take() if self.phase_timer is not None else None))
        return out


# DMD2 at a benchmark size: the recipe's model as the frozen teacher, the student and critic its
# copies; a 2-step student updated every step, so that every step runs all three models and both
# optimizers (student and critic).
DMD2_STEPS = [1000, 500]


def dmd2_overrides(cfg: Any) -> dict:
    """Overrides that turn a size's SFT recipe `cfg` into a DMD2 run of the same model."""
    student = cfg.models.student
    teacher = {"init_from": None, "model_class": student.model_class, "flow_shift": student.flow_shift,
               "transformer_config": dict(student.transformer_config)}
    return {
        "method.name": "dmd2",
        "models.teacher": teacher,
        "models.student": dict(teacher),
        "method.rollout_mode": "simulate",
        "method.dmd_denoising_steps": list(DMD2_STEPS),
        "method.generator_update_interval": 1,
        "method.real_score_guidance_scale": 3.0,
        "method.min_timestep_ratio": 0.02,
        "method.max_timestep_ratio": 0.98,
        "method.fake_score_learning_rate": cfg.training.optimizer.learning_rate,
        "method.fake_score_betas": [0.0, 0.999],
        "method.fake_score_lr_scheduler": "constant",
    }


class BareDMD2Loop:
    """DMD2's step written bare on the same Wan model: three transformers (a frozen teacher, a
    student and a critic, each its own copy), two optimizers as our run builds them, the recipe's
    clipping of both (torch's clip_grad_norm_), one batch kept on the device. Per step, as
    DMD2Method with a 2-step student updated every step: a rollout of the student (its first step
    without gradient, the exit step's prediction with it), the DMD gradient (critic, teacher
    conditional and unconditional on the re-noised rollout), a second rollout without gradient for
    the critic's flow-matching loss; backward of both losses, clip, both optimizer steps."""

    def __init__(self, cfg: Any, batch: dict, device: torch.device):
        from accelerate.utils import set_seed
        from diffusers import WanTransformer3DModel

        from fv_accel.optim import build_optimizer

        set_seed(cfg.training.data.seed)
        make = lambda: WanTransformer3DModel(**dict(cfg.models.student.transformer_config)).to(device)  # noqa: E731
        self.teacher, self.student, self.critic = make(), make(), make()
        self.teacher.requires_grad_(False).eval()
        self.student.load_state_dict(self.teacher.state_dict())
        self.critic.load_state_dict(self.teacher.state_dict())
        self.student.train()
        self.critic.train()
        self.opt_student = build_optimizer(cfg, list(self.student.parameters()))
        self.opt_critic = build_optimizer(cfg, list(self.critic.parameters()))
        self.max_norm = float(cfg.callbacks.grad_clip.max_grad_norm)
        self.x0 = batch["vae_latent"].to(device=device, dtype=torch.float32)
        self.text = batch["text_embedding"].to(device=device, dtype=torch.float32)
        self.uncond = torch.zeros_like(self.text)
        from fv_accel.models.wan import WanStudent

        shift = cfg.models.student.flow_shift
        self.shift = float(WanStudent.default_flow_shift if shift is None else shift)
        self.steps = torch.tensor([float(t) for t in DMD2_STEPS], device=device)
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(cfg.training.data.seed)

    def sigma(self, t: torch.Tensor) -> torch.Tensor:
        u = t / 1000.0
        return self.shift * u / (1 + (self.shift - 1) * u)

    def x0_of(self, model: Any, x: torch.Tensor, t: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        velocity = model(hidden_states=x, timestep=t.expand(x.shape[0]), encoder_hidden_states=text, return_dict=False)[0]
        return x - self.sigma(t).view(-1, 1, 1, 1, 1) * velocity

    def renoise(self, x0: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        noise = torch.randn(x0.shape, generator=self.generator, device=self.device)
        s = self.sigma(t).view(-1, 1, 1, 1, 1)
        return (1 - s) * x0 + s * noise, noise

    def rollout(self, *, with_grad: bool) -> torch.Tensor:
        exit_index = int(torch.randint(0, len(self.steps), (1,), generator=self.generator, device=self.device).item())
        x = torch.randn(self.x0.shape, generator=self.generator, device=self.device)
        start = x
        with torch.no_grad():
            x = self.renoise(self.x0_of(self.student, x, self.steps[:1], self.text), self.steps[1:2])[0]
        noisy = x if exit_index > 0 else start
        with torch.set_grad_enabled(with_grad):
            return self.x0_of(self.student, noisy, self.steps[exit_index : exit_index + 1], self.text)

    def score_timestep(self) -> torch.Tensor:
        t = torch.randint(0, 1000, (1,), generator=self.generator, device=self.device).float()
        return (self.shift * t / (1 + (self.shift - 1) * t / 1000)).clamp(20, 980)

    def step(self) -> torch.Tensor:
        generated = self.rollout(with_grad=True)
        with torch.no_grad():
            t = self.score_timestep()
            noisy, _ = self.renoise(generated, t)
            fake = self.x0_of(self.critic, noisy, t, self.text)
            real_cond = self.x0_of(self.teacher, noisy, t, self.text)
            real_uncond = self.x0_of(self.teacher, noisy, t, self.uncond)
            real = real_uncond + (real_cond - real_uncond) * 3.0
            grad = torch.nan_to_num((fake - real) / torch.abs(generated - real).mean())
        generator_loss = 0.5 * torch.nn.functional.mse_loss(generated, (generated - grad).detach())
        with torch.no_grad():
            critic_x0 = self.rollout(with_grad=False)
        t = self.score_timestep()
        noisy, noise = self.renoise(critic_x0, t)
        pred = self.critic(hidden_states=noisy, timestep=t, encoder_hidden_states=self.text, return_dict=False)[0]
        critic_loss = torch.mean((pred - (noise - critic_x0)) ** 2)
        generator_loss.backward()
        critic_loss.backward()
        if self.max_norm > 0:
            torch.nn.utils.clip_grad_norm_(list(self.student.parameters()), self.max_norm)
            torch.nn.utils.clip_grad_norm_(list(self.critic.parameters()), self.max_norm)
        self.opt_student.step()
        self.opt_critic.step()
        self.opt_student.zero_grad(set_to_none=True)
        self.opt_critic.zero_grad(set_to_none=True)
        return generator_loss + critic_loss

    def steps_timed(self, n: int) -> list[StepTime]:
        out = []
        for _ in range(n):
            start = clocks()
            self.step()
            synchronize()
            out.append(since(start))
        return out


def first_batch(data_path: str, cfg: Any) -> dict:
    """One collated batch of the benchmark dataset, as our loader builds it (for the bare loop)."""
    from fv_accel.data.loader import build_train_loader

    return next(iter(build_train_loader(cfg, world_size=1, rank=0, data_path=data_path)))


def epoch_batches(data_path: str, cfg: Any) -> list[dict]:
    """The first epoch of the benchmark dataset, collated as our loader builds it and in its order
    (a bare loop then trains on the rows ours does)."""
    from itertools import islice

    from fv_accel.data.loader import build_train_loader

    loader = build_train_loader(cfg, world_size=1, rank=0, data_path=data_path)
    return list(islice(iter(loader), loader.sampler.steps_per_epoch()))


def model_flops_per_step(transformer: torch.nn.Module, size: BenchSize) -> float:
    """Analytic model FLOPs of one training step (fv_accel.telemetry: 6 N S + attention terms)."""
    from fv_accel.telemetry import train_step_flops, transformer_shape

    shape = transformer_shape(transformer)
    return train_step_flops(shape, size.batch_size, size.batch_size * size.tokens_per_sample, text_tokens=size.text_shape[0])


def peak_flops() -> Optional[float]:
    if not torch.cuda.is_available():
        return None
    from fv_accel.telemetry import device_peak_flops

    return device_peak_flops(torch.cuda.get_device_name(0))


def reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; a new Accelerator (another size) needs them reset."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


# ---------------------------------------------------------------------------------------------
# result files
# ---------------------------------------------------------------------------------------------
def write_results(out_dir: Path, name: str, payload: dict, markdown: str) -> tuple[Path, Path]:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{name}.json"
    md_path = out_dir / f"{name}.md"
    json_path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    md_path.write_text(markdown.rstrip() + "\n")
    return json_path, md_path


def publish_results(out_dir: Path, name: str, payload: dict, markdown: str) -> None:
    """Write the results (`write_results`), then print the table and where it went."""
    json_path, md_path = write_results(out_dir, name, payload, markdown)
    print(markdown)
    print(f"wrote {json_path} and {md_path}")


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, torch.Tensor):
        return value.tolist()
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def command_line(script: str, argv: Sequence[str]) -> str:
    return " ".join(["python", f"benchmarks/{script}", *argv])


def rss_high_water_kb() -> Optional[int]:
    try:
        m = re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text())
        return int(m.group(1)) if m else None
    except OSError:
        return None
