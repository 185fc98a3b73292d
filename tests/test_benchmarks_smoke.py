"""Smoke tests: every CPU benchmark runs end to end at its --quick setting (tiny model) and writes
its results as valid JSON and a Markdown table with the machine description."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _bench_env(monkeypatch):
    # The benchmarks set these with setdefault at import; keep the test process's environment as it was.
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"fv_bench_{name}", REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(out: Path, name: str) -> tuple[dict, str]:
    data = json.loads((out / f"{name}.json").read_text())
    md = (out / f"{name}.md").read_text()
    assert data["machine"]["torch"] == torch.__version__
    assert data["machine"]["cpu_cores"] >= 1 and data["machine"]["cpu_model"]
    assert "Machine:" in md and data["machine"]["cpu_model"] in md
    return data, md


def _positive(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_step_overhead_quick(tmp_path):
    out = tmp_path / "results"
    _load("step_overhead").main(["--quick", "--dmd2", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    data, md = _read(out, "step_overhead")
    (res,) = data["sizes"]
    assert res["size"] == "tiny" and res["latent_shape"] == [16, 6, 6, 6] and res["tokens_per_step"] == 2 * 3 * 3 * 6
    assert res["rounds"] == 2 and res["steps_per_round"] == 2
    for variant in ("bare", "sft", "dfsft", "bare_lora", "sft_lora"):
        stats = res["step_time_s"][variant]
        assert stats["n"] == 4 and _positive(stats["min"]) and stats["min"] <= stats["median"] <= stats["max"]
        assert len(res["round_mean_step_time_s"]["wall"][variant]) == 2
        phases = res["phases_s"][variant]
        # forward + backward + optimizer fit inside the step
        inside = sum(phases[p]["median"] for p in ("forward", "backward", "optimizer"))
        assert 0 < inside <= phases["step"]["max"] + 1e-6
    for key in ("sft/bare", "dfsft/bare", "dfsft/sft", "sft_lora/bare_lora"):
        ratio = res["ratios"][key]["per_round"]
        assert ratio["n"] == 2 and _positive(ratio["median"])
        assert res["ratios"][key]["target"] is None  # targets are for the small size
    assert "| tiny" in md and "sft / bare" in md and "sft_lora / bare_lora" in md
    # The AdamW implementations side by side: each either ran or says why not.
    impls = res["optimizer_impls"]
    assert impls["parameters"] == res["params"]
    assert _positive(impls["for_loop"]["step_s"]["median"]) and impls["for_loop"]["over_for_loop"] == 1.0
    for impl in ("foreach", "fused"):
        assert "error" in impls[impl] or _positive(impls[impl]["over_for_loop"])
    assert "Optimizer step by implementation" in md
    # The DMD2-shaped pair: three models and two optimizers, ours through the Trainer.
    dmd2 = res["dmd2"]
    assert dmd2["rounds"] == 2 and dmd2["denoising_steps"] == [1000, 500]
    for name in ("bare_dmd2", "dmd2"):
        assert dmd2["step_time_s"][name]["n"] == 4 and _positive(dmd2["step_cpu_time_s"][name]["median"])
    assert _positive(dmd2["cpu_time_ratios"]["dmd2/bare_dmd2"]["median"]) and dmd2["trainer_data_wait_s"]["n"] == 4
    assert "A DMD2-shaped step, tiny" in md


def test_step_overhead_verdicts_read_the_cpu_ratios_and_the_data_wait(capsys):
    """`make bench`'s MET/MISSED lines, from a result of the target size (no timing here)."""
    module = _load("step_overhead")
    ratio = lambda median, target: {"per_round": {"median": median}, "target": target}  # noqa: E731
    res = {
        "size": "small",
        "cpu_time_ratios": {"sft/bare": ratio(1.004, 1.01), "dfsft/bare": ratio(1.02, 1.01), "x/y": ratio(2.0, None)},
        "trainer_data_wait_s": {"sft": {"median": 0.0004}, "dfsft": {"median": 0.003}},
    }
    assert not module.print_verdicts({"sizes": [res]})
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "MET    sft/bare CPU time (median of rounds): 1.004 (target <= 1.01)",
        "MISSED dfsft/bare CPU time (median of rounds): 1.020 (target <= 1.01)",
        "MET    sft data wait, ms (median): 0.400 (target <= 1)",
        "MISSED dfsft data wait, ms (median): 3.000 (target <= 1)",
    ]
    res["cpu_time_ratios"]["dfsft/bare"] = ratio(1.0, 1.01)
    res["trainer_data_wait_s"]["dfsft"] = {"median": 0.001}
    assert module.print_verdicts({"sizes": [res]})
    assert module.print_verdicts({"sizes": [dict(res, size="tiny")]})
    assert capsys.readouterr().out.splitlines()[-1].startswith("no targets checked")


def test_memory_quick(tmp_path):
    out = tmp_path / "results"
    _load("memory").main(["--quick", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    data, md = _read(out, "memory")
    (res,) = data["results"]
    assert "error" not in res, res.get("error")
    assert (res["method"], res["lora"], res["ckpt"], res["T"], res["batch"]) == ("sft", False, False, 6, 2)
    assert res["memory_kind"] == ("cuda allocated" if torch.cuda.is_available() else "cpu rss")
    # Setup holds the model (~0.37M fp32 parameters) and AdamW's two moments, on top of the interpreter.
    assert res["trainable_params"] == res["params"] > 300_000
    assert res["setup_gb"] > 3 * res["params"] * 4 / 2**30
    assert res["peak_step_gb"] >= res["peak_fwd_bwd_gb"] >= res["setup_gb"]
    assert res["activation_gb"] == pytest.approx(res["peak_fwd_bwd_gb"] - res["setup_gb"])
    assert "sft full" in md


def test_data_throughput_quick(tmp_path):
    out = tmp_path / "results"
    _load("data_throughput").main(["--quick", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    data, md = _read(out, "data_throughput")
    assert data["size"] == "tiny" and data["rows"] == 8
    for key in ("loader_samples_per_s", "model_samples_per_s", "ratio_loader_over_model"):
        assert data[key]["n"] == 2 and _positive(data[key]["median"])
        assert data[key]["min"] <= data[key]["median"] <= data[key]["max"]
    # Structure only: timings (and ratios of timings) are never compared in a test.
    assert 0 <= data["trainer_data_wait_share_of_step"]["median"] < 1
    assert "loader / model" in md


def test_data_scale_quick(tmp_path):
    out = tmp_path / "results"
    _load("data_scale").main(["--quick", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    data, md = _read(out, "data_scale")
    (res,) = data["results"]
    assert (res["size"], res["rows"], res["shards"], res["row_groups"]) == ("quick", 60, 3, 3)
    assert res["latent_shape"] == [16, 2, 4, 4] and res["dataset_bytes"] > 0
    # An open writes nothing: no write syscall during it, no file created or grown by it or by inspect.
    assert res["open_wchar_bytes"] == res["open_files_grown_bytes"] == res["inspect_files_grown_bytes"] == 0
    for key in ("open_s", "inspect_s", "peak_rss_after_open_mb", "items_per_s_0_workers", "items_per_s_2_workers"):
        assert _positive(res[key]), key
    assert res["inspect_output"][1] == "rows: 60 in 3 Parquet file(s), 3 row group(s)"
    assert data["wan_1_3b_model"] is None  # --quick skips the 1.3B arithmetic
    assert "| quick | 60 | 3 | 3 |" in md and "items/s, 2 workers" in md


@pytest.mark.slow  # builds a small multimodal dataset (~10-30 s on 2 shared cores)
def test_distill_quick(tmp_path, _cache_dir):
    """benchmarks/distill.py end to end on a small multimodal world: an untrained teacher saved as a
    run folder, and the same weights as a 'student' sampled by the DMD sampler at 2 steps."""
    import yaml

    from fv_accel.config import load_config
    from fv_accel.models import build_student

    recipe = yaml.safe_load((REPO / "configs" / "tiny_dmd2_teacher.yaml").read_text())
    recipe["training"]["data"].update(tiny_num_captions=2, tiny_num_clips=4, tiny_num_frames=9, tiny_height=32, tiny_width=32)
    recipe["models"]["student"]["transformer_config"].update(num_layers=1, ffn_dim=64)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    teacher = tmp_path / "teacher"
    build_student(load_config(str(path))).transformer.save_pretrained(teacher / "transformer")
    out = tmp_path / "results"
    _load("distill").main([
        "--teacher", str(teacher), "--teacher_config", str(path), "--teacher_steps", "3", "--few_steps", "2",
        "--seeds", "2", "--student", str(teacher), "--student_steps", "1000", "500", "--out", str(out),
    ])
    data, md = _read(out, "distill")
    assert data["captions"] == {c: 2 for c in data["captions"]} and len(data["captions"]) == 2
    rows = data["rows"]
    assert [r["forwards_per_sample"] for r in rows] == [3, 2, 2]
    assert rows[2]["sampler"].endswith("teacher, DMD 2 steps [1000, 500]")
    for r in rows:
        assert _positive(r["seconds_per_sample"]) and _positive(r["latent_distance"])
        assert len(r["latent_distance_per_sample"]) == 4 and r["latent_distance"] == pytest.approx(
            sum(r["latent_distance_per_sample"]) / 4)
    assert _positive(data["reference"]["latent_distance"]) and "| teacher, Euler 3 steps | 3 |" in md


def test_nft_curve_quick(tmp_path, _cache_dir):
    """benchmarks/nft.py --curve end to end on a random one-block student: NFT's held-out points, one
    RFT round at the same samples, the teacher's seed sets (its first equal to NFT's logged
    reference), and the distances to the nearest clip."""
    out = tmp_path / "results"
    _load("nft").main([
        "--curve", "--student", "random", "--outer-steps", "3", "--sample-batch", "2", "--videos-per-prompt", "2",
        "--batches", "2", "--sampling-steps", "2", "--val-videos", "2", "--teacher-seed-sets", "2", "--rft-steps", "2",
        "--rft-batch", "2", "--rft-every", "3", "--out", str(out), "--work-dir", str(tmp_path / "work"), "--name", "nft",
    ])
    (name,) = [p.stem for p in out.glob("nft_curve_*.json")]
    data, md = _read(out, name)
    assert [p["samples"] for p in data["nft"]] == [0, 4, 8, 12]
    assert data["reference_check_abs_diff"] == 0.0
    assert [p["samples"] for p in data["rft"]["points"]][-1] == 12  # one round, at NFT's 12 samples
    assert len(data["teacher_seed_sets"]["heldout"]) == 2
    assert all(_positive(d["latent"]) for d in data["distances"].values()) and "| teacher |" in md
