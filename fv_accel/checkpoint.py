"""Training-state checkpoints: `output_dir/checkpoint-<step>/` via Accelerate's `save_state`.

Besides what Accelerate saves (model or adapter, optimizer, LR scheduler), each checkpoint holds
every rank's method generator and data position (safetensors / JSON, never pickle) and a
`metadata.json` with the step and the resolved config.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file

logger = logging.getLogger(__name__)

CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    out = Path(output_dir)
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if p.is_dir() and (m := CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def resolve_resume(output_dir: str | Path, resume: str) -> Optional[Path]:
    if not resume:
        return None
    if resume == "latest":
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise FileNotFoundError(f"training.checkpoint.resume_from_checkpoint: '{resume}' is not a checkpoint folder")
    return path


def rank_state_file(ckpt: Path, rank: int) -> Path:
    return ckpt / f"fv_rank_{rank}.safetensors"


def save_checkpoint(trainer: Any, step: int) -> Path:
    acc = trainer.accelerator
    out = Path(trainer.config.training.checkpoint.output_dir)
    ckpt = out / f"checkpoint-{step}"
    acc.wait_for_everyone()
    acc.save_state(str(ckpt))
    tensors = {"method_generator": trainer.method.cuda_generator.get_state().cpu()}
    tensors.update({f"extra/{k}": v for k, v in trainer.extra_state_tensors().items()})
    save_file(tensors, str(rank_state_file(ckpt, acc.process_index)))
    if acc.is_main_process:
        meta = {
            "step": step,
            "data": trainer.dataloader.state_dict(),
            "math": trainer.method.math_signature(),
            "config": trainer.config.to_dict(),
            "world_size": acc.num_processes,
        }
        (ckpt / "metadata.json").write_text(json.dumps(meta, indent=2, default=str))
        _prune(out, trainer.config.training.checkpoint.checkpoints_total_limit)
    acc.wait_for_everyone()
    return ckpt


def _prune(out: Path, limit: int) -> None:
    if limit <= 0:
        return
    found = list_checkpoints(out)
    for old in found[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(trainer: Any, ckpt: Path) -> int:
    acc = trainer.accelerator
    meta = json.loads((ckpt / "metadata.json").read_text())
    acc.load_state(str(ckpt))
    state_file = rank_state_file(ckpt, acc.process_index)
    if state_file.is_file():
        tensors = load_file(str(state_file))
        gen = tensors.pop("method_generator")
        trainer.method.cuda_generator.set_state(gen.to(torch.uint8))
        trainer.load_extra_state_tensors({k[len("extra/"):]: v for k, v in tensors.items() if k.startswith("extra/")})
    trainer.dataloader.load_state_dict(meta["data"])
    return int(meta["step"])
