"""Issue 14, outputs and checkpoints: exports land outside checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fv_accel.config import default_recipe, load_config
from fv_accel.trainer import Trainer, TrainerCallback
from tests.resume_helpers import build, small_overrides, write_latent_dataset

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def latent_data(tmp_path_factory):
    return write_latent_dataset(tmp_path_factory.mktemp("latents"), num_clips=6)


def snapshot(folder: Path) -> list[tuple[str, int, int]]:
    """Every file under `folder` with its size and modification time (what 'nothing written' means)."""
    if not folder.exists():
        return []
    return sorted((str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*") if p.is_file())


class StopAtStep(TrainerCallback):
    """Asks the trainer to stop after `step` as a preemption would (checkpoint, exit 0)."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer, step, logs):
        if step == self.step:
            trainer._stop_signal = 15  # SIGTERM, without sending one


def recipe_file(tmp_path: Path, method: str, overrides: dict) -> Path:
    path = tmp_path / f"recipe-{len(list(tmp_path.glob('recipe-*')))}.yaml"
    path.write_text(load_config(default_recipe(method), overrides).to_yaml())
    return path


def metrics_lines(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "logs" / "metrics.jsonl").read_text().splitlines()]


# ---- 7. exports outside the checkpoints ----------------------------------------------------------


def test_export_defaults_to_the_runs_exports_folder_which_pruning_keeps(tmp_path, latent_data, capsys):
    from fv_accel.export import main as export_main

    out = tmp_path / "out"
    over = small_overrides(out, latent_data, **{"training.loop.max_train_steps": 4, "training.checkpoint.training_state_checkpointing_steps": 2,
                                                "training.checkpoint.checkpoints_total_limit": 1, "training.checkpoint.save_final": True})
    run = build("finetune", over)
    Trainer(run, callbacks=[*run.callbacks, StopAtStep(2)]).run()
    capsys.readouterr()
    export_main([str(out / "checkpoint-2"), "--to", "diffusers"])
    target = out / "exports" / "checkpoint-2_diffusers" / "transformer"
    assert capsys.readouterr().out.strip() == f"wrote {target}"
    with pytest.raises(SystemExit, match=rf"--out {out / 'checkpoint-2' / 'mine'} is inside the checkpoint {out / 'checkpoint-2'}"):
        export_main([str(out / "checkpoint-2"), "--to", "diffusers", "--out", str(out / "checkpoint-2" / "mine")])
    # Training on with a limit of 1 checkpoint deletes checkpoint-2, not the export.
    Trainer(build("finetune", {**over, "training.loop.max_train_steps": 5, "training.checkpoint.resume_from_checkpoint": "latest"})).run()
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-4").is_dir()
    assert (target / "diffusion_pytorch_model.safetensors").is_file()
    capsys.readouterr()
    export_main([str(out), "--to", "diffusers"])
    assert capsys.readouterr().out.strip() == f"wrote {out / 'exports' / 'final_diffusers' / 'transformer'}"
