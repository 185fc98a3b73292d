"""The plot command and the run telemetry (summary table, FLOPs estimate)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, tiny_overrides


def run_plot(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-m", "fv_accel.plot", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_plot_command_writes_pngs_from_a_tiny_run(tmp_path):
    import matplotlib.image

    from fv_accel.build import build_from_config
    from fv_accel.config import default_recipe
    from fv_accel.trainer import Trainer

    over = tiny_overrides(
        tmp_path,
        **{
            "training.loop.max_train_steps": 3,
            "training.checkpoint.save_final": False,
            "callbacks.validation.enable": True,
            "callbacks.validation.every_steps": 1,
            "callbacks.validation.at_start": True,
            "callbacks.validation.prompts": [],  # held-out loss only
            "callbacks.validation.heldout_data_path": None,
            "callbacks.validation.heldout_fraction": 0.25,
            "callbacks.validation.heldout_max_samples": 1,
        },
    )
    Trainer(build_from_config(default_recipe("finetune"), over)).run()
    out = tmp_path / "out"
    assert not (out / "plots").exists()  # write_plots is off in tiny_overrides

    result = run_plot(str(out), "--out", str(tmp_path / "pngs"))
    assert result.returncode == 0, result.stderr
    written = [Path(line) for line in result.stdout.split()]
    assert sorted(p.name for p in written) == ["heldout_loss.png", "loss.png", "throughput.png"]
    for path in written:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, path
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 400 and image.std() > 0.01, path


def test_plot_reads_the_last_value_of_a_step_and_reports_missing_logs(tmp_path):
    from fv_accel.plot import read_metrics, smooth

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    rows = [
        {"step": 1, "loss": 3.0, "note": "text is ignored"},
        {"step": 2, "loss": 2.0},
        {"step": 2, "loss": 1.5},  # the same step again after a resume: the last value counts
        {"step": 0, "heldout/loss": 4.0, "heldout/sigma_0.50": 4.0},
    ]
    (logs / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    series = read_metrics(tmp_path / "run")
    assert series["loss"] == ([1, 2], [3.0, 1.5])
    assert series["heldout/loss"] == ([0], [4.0])
    assert "note" not in series
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]

    missing = run_plot(str(tmp_path / "nowhere"))
    assert missing.returncode == 2 and "metrics.jsonl" in missing.stderr


def test_step_flops_peak_table_and_summary_table():
    from fv_accel.telemetry import device_peak_flops, format_summary, train_step_flops

    shape = {"params": 100, "layers": 2, "width": 8}
    # 2 samples of 10 tokens: forward per sample 2*100*10 + 4*2*10^2*8 + 4*2*10*512*8 = 336080
    assert train_step_flops(shape, samples=2, tokens=20, text_tokens=512) == 3 * 2 * 336080
    assert train_step_flops(shape, samples=0, tokens=0) == 0.0
    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert device_peak_flops("Some Future Chip") is None

    table = format_summary({"steps": 300, "wall_time_s": 61.234, "best_heldout_loss": 0.51234})
    lines = table.splitlines()
    assert lines[0] == lines[-1] and len({len(line) for line in lines}) == 1  # a closed, aligned box
    assert lines[1:-1] == [
        "| steps             |    300 |",
        "| wall time s       |  61.23 |",
        "| best heldout loss | 0.5123 |",
    ]



def test_throughput_plot_gives_samples_and_tokens_an_axis_each(tmp_path, monkeypatch):
    import fv_accel.plot as plot

    figures = []
    monkeypatch.setattr(plot, "_save", lambda plt, fig, path: figures.append(fig) or path)
    series = {
        "samples_per_s": ([1, 2, 3], [2.0, 2.1, 2.2]),
        "latent_tokens_per_s": ([1, 2, 3], [216.0, 226.8, 237.6]),  # 108 tokens a sample
        "step_time": ([1, 2, 3], [0.5, 0.48, 0.46]),
        "cpu_rss_gb": ([1, 2, 3], [0.5, 0.5, 0.5]),
    }
    assert plot.plot_throughput(series, tmp_path) == tmp_path / "throughput.png"
    (fig,) = figures
    labels = [ax.get_ylabel() for ax in fig.axes]
    assert labels == ["samples/s", "latent tokens/s", "seconds", "GiB"]  # no twin axis drawn over another
    assert [len(ax.lines) for ax in fig.axes[:2]] == [1, 1]


def test_reward_plot_draws_the_held_out_reward_beside_the_reference_and_the_kl(tmp_path, monkeypatch):
    """plots/reward.png of a reward-training log: the held-out reward and the training samples' (one
    reward: its `avg` is not drawn twice), the reference's as a line, the KL term below."""
    from fv_accel import plot

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    rows = [{"step": 0, "validation/reference/reward/tiny_speed": 0.31, "validation/reference/reward/avg": 0.31}]
    rows += [{"step": s, "reward/tiny_speed": 0.3 + s / 100, "reward/avg": 0.3 + s / 100, "kl_div_loss": 1e-3 * s,
              "validation/reward/tiny_speed": 0.31 + s / 1000, "validation/reward/avg": 0.31 + s / 1000} for s in (1, 2, 3)]
    (logs / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    drawn = []
    real = plot._figure

    def figure(rows_):
        plt, fig, axes = real(rows_)
        for ax in axes:
            original = ax.plot

            def record(*a, _original=original, **k):
                drawn.append(k.get("label"))
                return _original(*a, **k)

            ax.plot = record
        return plt, fig, axes

    monkeypatch.setattr(plot, "_figure", figure)
    path = plot.plot_reward(plot.read_metrics(tmp_path / "run"), tmp_path)
    assert path is not None and path.is_file()
    assert drawn == ["training samples' tiny_speed", "held-out tiny_speed", "KL term to the reference"]
    assert plot.plot_reward({"loss": ([1], [1.0])}, tmp_path / "none") is None
