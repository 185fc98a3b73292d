"""KD (ODE initialisation): the teacher-trajectory cache (resume after a kill, two processes writing
half each, the fingerprint, checksums, the disk check, t_list), and a short tiny kd_causal run whose
student loads back and streams with `python -m fv_accel.generate`."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kd_helpers import KD_RECIPE, kd_overrides
from launch_helpers import ANY_FREE_PORT

REPO = Path(__file__).resolve().parents[1]
ACCELERATE = Path(sys.executable).parent / "accelerate"


def _cfg(tmp_path, data_path, cache=None, **extra):
    from fv_accel.config import load_config

    over = kd_overrides(tmp_path, **{"training.data.data_path": data_path, **extra})
    if cache is not None:
        over["method.teacher_path_cache"] = str(cache)
    return load_config(KD_RECIPE, over)


def _write(tmp_path, data_path, cache=None, **extra):
    from fv_accel.kd_cache import write_cache

    return write_cache(_cfg(tmp_path, data_path, cache, **extra))


def _files(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((folder / "samples").iterdir())}


@pytest.fixture(scope="module")
def reference_cache(tmp_path_factory, tiny_data_path):
    """The cache of the tiny recipe, written uninterrupted by one process."""
    root = tmp_path_factory.mktemp("kd_reference")
    spec = _write(root, tiny_data_path, root / "cache")
    return spec


def test_the_cache_holds_the_teachers_trajectory_of_every_row(reference_cache):
    from fv_accel.methods.knowledge_distillation.cache import KDCacheDataset

    spec = reference_cache
    assert spec.num_samples == 8 and spec.timesteps == [1000, 900, 750, 500] and spec.stored == spec.timesteps
    files = _files(spec.folder)
    assert len(files) == 16  # a sample and its sha256 per row
    item = KDCacheDataset(spec)[3]
    assert item["trajectory_latents"].dtype == torch.bfloat16 and tuple(item["trajectory_latents"].shape) == (4, 16, 6, 6, 6)
    assert item["trajectory_timesteps"].tolist() == [1000, 900, 750, 500]
    assert item["real"].shape == (16, 6, 6, 6)
    # The first state is pure noise (sigma 1), each later one moves towards the teacher's x0.
    states = item["trajectory_latents"].float()
    assert abs(float(states[0].std()) - 1.0) < 0.1
    gaps = [float((s - item["real"].float()).abs().mean()) for s in states]
    assert gaps[-1] < gaps[0]
    # Rows differ (their own noise and caption).
    assert not torch.equal(KDCacheDataset(spec)[0]["trajectory_latents"], item["trajectory_latents"])


def test_a_kill_mid_generation_resumes_to_the_same_bytes_each_sample_written_once(reference_cache, tmp_path, tiny_data_path,
                                                                                  monkeypatch):
    from fv_accel.methods.knowledge_distillation import cache as kd_cache

    cache = tmp_path / "cache"
    real_write = kd_cache.write_sample
    written: list[int] = []

    class Killed(BaseException):
        pass

    def killed_after_sample_file(spec, index, states, real):
        if index == 3:
            # The kill lands after the sample's file is renamed into place, before its checksum.
            real_write(spec, index, states, real)
            spec.checksum_path(index).unlink()
            raise Killed()
        written.append(index)
        return real_write(spec, index, states, real)

    monkeypatch.setattr(kd_cache, "write_sample", killed_after_sample_file)
    with pytest.raises(Killed):
        _write(tmp_path, tiny_data_path, cache)
    assert written == [0, 1, 2]
    assert not list((cache / "samples").glob(".*tmp"))

    def counted(spec, index, states, real):
        written.append(index)
        return real_write(spec, index, states, real)

    monkeypatch.setattr(kd_cache, "write_sample", counted)
    _write(tmp_path, tiny_data_path, cache)
    assert written == list(range(8))  # each finished once; the unfinished row 3 written again
    assert _files(cache) == _files(reference_cache.folder)
    # A third start finds nothing to write.
    _write(tmp_path, tiny_data_path, cache)
    assert written == list(range(8))


def test_another_teacher_or_guidance_is_refused_in_one_line(reference_cache, tmp_path, tiny_data_path):
    cache = reference_cache.folder
    with pytest.raises(ValueError, match=r"another fingerprint\.teacher_guidance_scale .*cached 1\.0, this run 3\.0") as err:
        _write(tmp_path, tiny_data_path, cache, **{"method.teacher_guidance_scale": 3.0})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"another fingerprint\.teacher_sha256") as err:
        _write(tmp_path, tiny_data_path, cache, **{"models.teacher.transformer_config.ffn_dim": 96})
    assert "\n" not in str(err.value) and str(cache) in str(err.value)
    with pytest.raises(ValueError, match=r"another teacher_timesteps"):
        _write(tmp_path, tiny_data_path, cache, **{"method.teacher_inference_steps": 8, "method.t_list": [1000, 750, 500, 0]})


def test_a_truncated_sample_is_named(reference_cache, tmp_path):
    import shutil

    from fv_accel.methods.knowledge_distillation.cache import CacheSpec, KDCacheDataset

    spec = reference_cache
    copy = CacheSpec(tmp_path / "copy", spec.num_samples, spec.latent_shape, spec.timesteps, spec.stored, spec.fingerprint)
    shutil.copytree(spec.folder, copy.folder)
    path = copy.sample_path(5)
    path.write_bytes(path.read_bytes()[:1000])
    dataset = KDCacheDataset(copy)
    assert dataset[4]["real"].shape == (16, 6, 6, 6)
    with pytest.raises(ValueError, match="truncated or corrupt KD cache sample") as err:
        dataset[5]
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_t_list_entries_must_be_cached_timesteps_named_with_the_nearest(tmp_path):
    from fv_accel.methods.knowledge_distillation.cache import check_t_list, teacher_timesteps

    cached = teacher_timesteps(48, 5.0)
    assert check_t_list([995, 937, 833, 625, 0], cached, "cache") == {995: 1, 937: 12, 833: 24, 625: 36}
    # FastVideo's own example fails on its own 48-step cache: 999 and 624 are not cached.
    with pytest.raises(ValueError, match=r"t_list entry 999 is not one of .* the nearest are 1000, 995"):
        check_t_list([999, 937, 833, 624, 0], cached, "cache")
    with pytest.raises(ValueError, match=r"t_list entry 624 .* nearest are 650, 625"):
        check_t_list([995, 937, 833, 624, 0], cached, "cache")
    from test_kd_parity import build_kd_method

    with pytest.raises(ValueError, match=r"method.t_list entry 857 is not one of the teacher's 4 ODE timesteps at shift 3 .* 900, 750"):
        build_kd_method(kd_overrides(tmp_path, **{"method.t_list": [1000, 857, 500, 0]}))


def test_sigmas_come_from_the_dense_grid():
    from fv_accel.schedulers import FlowMatchTable

    assert float(FlowMatchTable(5.0).nearest_sigmas(torch.tensor([937.0]), 1)[0]) == pytest.approx(0.93687, abs=1e-5)


def test_a_cache_the_disk_cannot_hold_is_refused_before_any_sample(tmp_path, tiny_data_path, monkeypatch):
    import shutil as shutil_module

    from fv_accel.methods.knowledge_distillation import cache as kd_cache

    monkeypatch.setattr(kd_cache.shutil, "disk_usage", lambda path: shutil_module._ntuple_diskusage(10**12, 10**12 - 10**5, 10**5))
    with pytest.raises(ValueError, match=r"the KD cache needs 309.2 KB more \(8 samples x 38.7 KB\) but .* has 100.0 KB free") as err:
        _write(tmp_path, tiny_data_path, tmp_path / "cache")
    assert "\n" not in str(err.value)
    assert not (tmp_path / "cache" / "samples").exists() or not any((tmp_path / "cache" / "samples").iterdir())


def test_a_student_steps_count_that_is_not_the_t_list_length_is_refused(tmp_path):
    from test_kd_parity import build_kd_method

    with pytest.raises(ValueError, match=r"method.t_list has 4 entries but method.student_sample_steps is 4"):
        build_kd_method(kd_overrides(tmp_path, **{"method.student_sample_steps": 4}))


@pytest.mark.multiproc
def test_two_processes_write_half_the_samples_each_with_the_same_bytes(reference_cache, tmp_path, tiny_data_path):
    recipe = tmp_path / "kd.yaml"
    recipe.write_text(_cfg(tmp_path, tiny_data_path, tmp_path / "cache").to_yaml())
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONPATH=str(REPO))
    cmd = [str(ACCELERATE), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", *ANY_FREE_PORT, "-m", "fv_accel.kd_cache", str(recipe)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "process 0 of 2 wrote 4 sample(s): rows [0, 2, 4, 6]" in out, out[-4000:]
    assert "process 1 of 2 wrote 4 sample(s): rows [1, 3, 5, 7]" in out, out[-4000:]
    assert _files(tmp_path / "cache") == _files(reference_cache.folder)


def test_a_short_kd_causal_run_loads_back_and_streams(reference_cache, tmp_path, tiny_data_path):
    from fv_accel import build_from_config
    from fv_accel.generate import build_parser, generate
    from fv_accel.trainer import Trainer

    over = kd_overrides(tmp_path, **{
        "training.data.data_path": tiny_data_path,
        "method.teacher_path_cache": str(reference_cache.folder),
        "training.loop.max_train_steps": 3,
        "training.checkpoint.training_state_checkpointing_steps": 3,
        "training.checkpoint.save_final": True,
    })
    run = build_from_config(KD_RECIPE, over)
    assert type(run.method).__name__ == "KDCausalMethod" and run.method.student.causal_block_size == 3
    losses = []
    original = run.method.single_train_step

    def recorded(batch, iteration):
        out = original(batch, iteration)
        losses.append(float(out[0]["kd_loss"].detach()))
        assert batch["trajectory_latents"].shape[1:3] == (4, 16) and batch["real"].shape[1:] == (16, 6, 6, 6)
        return out

    run.method.single_train_step = recorded
    Trainer(run).run()
    assert len(losses) == 3 and all(v > 0 for v in losses)
    out_dir = tmp_path / "out"
    steps = __import__("json").loads((out_dir / "student_steps.json").read_text())
    assert steps["timesteps"] == [1000.0, 750.0, 500.0] and steps["student_sample_type"] == "ode"
    video = tmp_path / "kd.mp4"
    report = generate(build_parser().parse_args([str(out_dir), "--prompt", "a red circle", "--output", str(video),
                                                 "--num_frames", "21"]))
    assert video.is_file() and report.chunks == 2 and report.frames == 21


def test_dry_run_counts_the_cache_on_disk_and_the_teacher(reference_cache, tmp_path, tiny_data_path):
    from fv_accel.memory_estimate import dry_run_lines

    lines = "\n".join(dry_run_lines(_cfg(tmp_path, tiny_data_path, reference_cache.folder)))
    assert f"KD cache {reference_cache.folder}: 8 of 8 samples on disk" in lines, lines
    assert "frozen teacher" in lines
    fresh = "\n".join(dry_run_lines(_cfg(tmp_path, tiny_data_path, tmp_path / "none")))
    assert "not written yet" in fresh and "38.7 KB per sample" in fresh, fresh


def _kd_run(tmp_path, tiny_data_path, cache, out, **extra):
    from fv_accel import build_from_config
    from resume_helpers import reset_accelerate

    reset_accelerate()
    over = kd_overrides(tmp_path, **{
        "training.data.data_path": tiny_data_path,
        "method.teacher_path_cache": str(cache),
        "training.checkpoint.output_dir": str(out),
        "training.loop.max_train_steps": 4,
        "training.data.train_batch_size": 1,
        "training.checkpoint.save_final": False,
        **extra,
    })
    return build_from_config(KD_RECIPE, over)


def test_a_lora_kd_run_resumes_exactly(reference_cache, tmp_path, tiny_data_path):
    from fv_accel.trainer import Trainer
    from resume_helpers import weights

    lora = {"models.student.lora.enable": True, "models.student.lora.rank": 4, "models.student.lora.alpha": 4}
    whole = _kd_run(tmp_path, tiny_data_path, reference_cache.folder, tmp_path / "whole", **lora)
    Trainer(whole).run()
    first = _kd_run(tmp_path, tiny_data_path, reference_cache.folder, tmp_path / "cut", **lora,
                    **{"training.loop.max_train_steps": 2, "training.checkpoint.training_state_checkpointing_steps": 2})
    Trainer(first).run()
    resumed = _kd_run(tmp_path, tiny_data_path, reference_cache.folder, tmp_path / "cut", **lora,
                      **{"training.checkpoint.resume_from_checkpoint": "latest"})
    assert resumed.start_step == 2
    Trainer(resumed).run()
    a, b = weights(whole), weights(resumed)
    trained = [k for k in a if "lora" in k]
    assert trained and all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], weights(first)[k]) for k in trained)


def test_the_teachers_ode_applies_guidance_and_at_1_runs_the_conditional_branch_only():
    from fv_accel.methods.knowledge_distillation.cache import TrajectorySettings, teacher_trajectory
    from fv_accel.schedulers import FlowMatchTable

    calls = []

    class Teacher:
        def predict_noise(self, x, t, tb, *, conditional=True):
            calls.append(conditional)
            return 0.8 * x + (0.3 if conditional else -0.2)

    noise = torch.randn(1, 2, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    table = FlowMatchTable(3.0)
    steps = [1000, 750, 500]
    states, x0 = teacher_trajectory(Teacher(), None, noise, TrajectorySettings(steps, 1.0, table))
    assert calls == [True] * 3 and states.dtype == torch.bfloat16 and torch.equal(states[0], noise[0].bfloat16())
    calls.clear()
    guided_states, guided_x0 = teacher_trajectory(Teacher(), None, noise, TrajectorySettings(steps, 3.0, table))
    assert calls == [True, False] * 3
    # The first step by hand: v = v_u + 3 (v_c - v_u) at sigma 1, then Euler to sigma(750).
    x = noise.bfloat16().float()
    v = (0.8 * x - 0.2) + 3.0 * 0.5
    first_x0 = x - v
    s1 = float(table.nearest_sigmas(torch.tensor([750.0]), 1)[0])
    expected = ((1 - s1) * first_x0 + s1 * x).bfloat16()
    assert torch.equal(guided_states[1], expected[0])
    assert not torch.equal(guided_states[1], states[1]) and not torch.allclose(guided_x0, x0)


@pytest.mark.multiproc
def test_two_processes_train_as_one(reference_cache, tmp_path, tiny_data_path):
    """Causal KD, 2 processes x batch 1 (DDP) == 1 process x batch 2 over the same cache: with
    `noise_rng: sample` each sample's block indices come from its own generator."""
    from safetensors.torch import load_file

    from test_distributed import WEIGHT_TOL, _driver, launch, max_diff

    def run(name: str, batch: int) -> dict:
        return {"name": name, "recipe": KD_RECIPE, "engine": "launch", "overrides": kd_overrides(tmp_path / name, **{
            "training.data.data_path": tiny_data_path, "method.teacher_path_cache": str(reference_cache.folder),
            "training.checkpoint.output_dir": str(tmp_path / name / "out"), "training.loop.noise_rng": "sample",
            "training.data.train_batch_size": batch, "training.loop.max_train_steps": 3, "training.optimizer.eps": 1e-5})}

    records = launch("accelerate_configs/cpu_2proc.yaml", [run("kd_2proc", 1)], tmp_path)["kd_2proc"]
    folder = tmp_path / "records" / "kd_2proc"
    w0, w1, init = (load_file(str(folder / f"{n}.safetensors")) for n in ("rank0", "rank1", "init"))
    assert len(records) == 2 and max_diff(w0, w1) == 0.0 and max_diff(w0, init) > 1e-4
    driver = _driver()
    driver.reset_accelerate()
    single = driver.run_one(run("kd_batch2", 2), tmp_path / "records")
    assert max_diff(w0, load_file(str(tmp_path / "records" / "kd_batch2" / "rank0.safetensors"))) < WEIGHT_TOL
    for step in range(3):
        mean_of_ranks = (records[0]["steps"][step]["local_loss"] + records[1]["steps"][step]["local_loss"]) / 2
        assert single["logged"][step]["loss"] == pytest.approx(mean_of_ranks, abs=1e-5)


@pytest.mark.multiproc
def test_fsdp2_trains_causal_kd_and_resumes_it_exactly(reference_cache, tmp_path, tiny_data_path):
    """Causal KD under FSDP2 (2 processes, the student sharded; the driver asserts the engine): a run
    resumed from its step-2 checkpoint computes step 3's losses bit for bit as the straight run did
    on each rank, and the first step's losses equal those of the same run under DDP (same weights,
    same samples, same block draws)."""
    from test_distributed import launch

    def run(name: str, engine: str, **extra) -> dict:
        return {"name": name, "recipe": KD_RECIPE, "engine": engine, "overrides": kd_overrides(tmp_path / name, **{
            "training.data.data_path": tiny_data_path, "method.teacher_path_cache": str(reference_cache.folder),
            "training.checkpoint.output_dir": str(tmp_path / name / "out"), "training.loop.noise_rng": "sample",
            "training.data.train_batch_size": 1, "training.loop.max_train_steps": 3,
            "training.checkpoint.training_state_checkpointing_steps": 2,
            "training.checkpoint.checkpoints_total_limit": 0, **extra})}

    ckpt = str(tmp_path / "kd_fsdp2" / "out" / "checkpoint-2")
    records = launch("accelerate_configs/fsdp2.yaml", [
        run("kd_fsdp2", "fsdp2"), run("kd_fsdp2_resumed", "fsdp2", **{"training.checkpoint.resume_from_checkpoint": ckpt}),
    ], tmp_path, "--mixed_precision", "no")
    ddp = launch("accelerate_configs/cpu_2proc.yaml", [run("kd_ddp", "launch")], tmp_path)["kd_ddp"]
    straight, resumed = records["kd_fsdp2"], records["kd_fsdp2_resumed"]
    for rank in (0, 1):
        assert [s["local_loss"] for s in resumed[rank]["steps"]] == [straight[rank]["steps"][2]["local_loss"]]
        assert straight[rank]["steps"][0]["local_loss"] == pytest.approx(ddp[rank]["steps"][0]["local_loss"], abs=1e-6)
    assert straight[0]["steps"][2]["local_loss"] != straight[1]["steps"][2]["local_loss"]  # the ranks' own samples
