"""W&B for real: a tiny run with trackers [wandb] in offline mode, its run file read back."""

from __future__ import annotations

import json

import pytest

from fv_accel.config import default_recipe
from tests.conftest import tiny_overrides


@pytest.mark.slow
def test_offline_wandb_run_holds_the_losses_videos_and_plots(tmp_path, tiny_data_path, monkeypatch):
    pytest.importorskip("wandb")
    from fv_accel.build import build_from_config
    from fv_accel.trainer import Trainer
    from tests.wandb_reader import history, read_complete_records

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    overrides = {
        **tiny_overrides(tmp_path),
        "training.loop.max_train_steps": 2,
        "training.tracker.trackers": ["wandb"],
        "training.tracker.run_name": "wb_run",
        "training.tracker.project_name": "wb_project",
        "training.tracker.write_plots": True,
        "callbacks.validation.enable": True,
        "callbacks.validation.at_start": False,
        "callbacks.validation.every_steps": 2,
        "callbacks.validation.sampling_steps": 2,
        "callbacks.validation.prompts": ["a white square moving up on a light background"],
        "callbacks.validation.heldout_max_samples": 2,
    }
    Trainer(build_from_config(default_recipe("dfsft"), overrides)).run()
    import wandb

    # W&B's service process writes the run file: shut it down so that the file is complete.
    wandb.teardown()
    (run_dir,) = (tmp_path / "wandb_dir" / "wandb").glob("offline-run-*")
    (run_file,) = run_dir.glob("run-*.wandb")
    records = read_complete_records(run_file)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.display_name, run.project) == ("wb_run", "wb_project")
    rows = history(records)
    logged = [json.loads(line) for line in open(tmp_path / "out" / "logs" / "metrics.jsonl")]
    losses = [(r["_step"], r["loss"]) for r in rows if "loss" in r]
    assert losses == [(r["step"], r["loss"]) for r in logged if "loss" in r] and len(losses) == 2
    merged = {k: v for r in rows for k, v in r.items()}
    assert isinstance(merged["heldout/loss"], float)
    # Media rows are flattened to "<key>/<field>"; their files sit under the run's files/media.
    assert merged["validation/00-a-white-square-moving-up-on-a-light-back/_type"] == "video-file"
    assert merged["validation/grid/_type"] == "image-file"  # the sample grid (samples/grid.png)
    assert merged["plots/heldout_loss/_type"] == "image-file" and merged["plots/loss/_type"] == "image-file"
    assert list((run_dir / "files" / "media" / "videos").rglob("*.mp4"))
    assert list((run_dir / "files" / "media" / "images").rglob("*.png"))
