"""The distillation chains as recipes: each recipe that starts from another run names it, and a
missing start run stops the launch in one line that gives the command making it, before any model
is read (no Hub lookup of a folder name)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fv_accel.cli import main

REPO = Path(__file__).resolve().parents[1]

# (entry script's method, recipe, the start run it names, the recipe and script that make that run)
CHAINS = [
    ("self_forcing", "tiny_self_forcing_from_kd.yaml", "outputs/tiny_kd", "train_kd.py --config configs/tiny_kd.yaml"),
    ("self_forcing", "tiny_self_forcing_from_cd.yaml", "outputs/tiny_causal_cd", "train_causal_cd.py --config configs/tiny_causal_cd.yaml"),
    ("causal_cd", "tiny_causal_cd.yaml", "outputs/tiny_tfsft_multimodal", "train_dfsft.py --config configs/tiny_tfsft_multimodal.yaml"),
    ("kd", "tiny_kd.yaml", "outputs/tiny_dmd2_teacher", "train_finetune.py --config configs/tiny_dmd2_teacher.yaml"),
    ("anyflow", "tiny_anyflow.yaml", "outputs/tiny_anyflow_pretrain", "train_anyflow_pretrain.py --config configs/tiny_anyflow_pretrain.yaml"),
    ("anyflow_pretrain", "tiny_anyflow_pretrain.yaml", "outputs/tiny_dmd2_teacher", "train_finetune.py --config configs/tiny_dmd2_teacher.yaml"),
]


@pytest.mark.parametrize("method,recipe,start,maker", CHAINS, ids=[c[1] for c in CHAINS])
def test_missing_start_run_gives_the_command_that_makes_it(method, recipe, start, maker, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no outputs/ here: every start run is missing
    code = main(method, ["--config", str(REPO / "configs" / recipe), "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert f"'{start}' does not exist yet" in err[-1]
    assert f"make it first with `accelerate launch {maker}`" in err[-1]
    assert not (tmp_path / "out").exists()
