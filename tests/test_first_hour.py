"""What a new user meets in the first hour: a dataset of another model family refused, LoRA keys
without LoRA refused, a smoothed end-of-run loss, defaults in every --help, a warning on upscaled
clips, offline Hub lookups that fail fast, and one error line per launch."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_overrides

from fv_accel.build import build_from_config
from fv_accel.config import ConfigError, default_recipe, load_config
from fv_accel.trainer import Trainer, smoothed_loss_ends

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([PY, *args], cwd=REPO, env=full, capture_output=True, text=True, timeout=timeout)


# ---- a dataset encoded by another model family ----


def test_a_wan_dataset_is_refused_for_an_ltx_student_naming_both_families(tmp_path, tiny_model_of, tiny_data_path):
    over = tiny_overrides(tmp_path, **{
        "models.student.init_from": str(tiny_model_of("ltx_video")),
        "models.student.transformer_config": None,
        "training.data.data_path": tiny_data_path,
    })
    with pytest.raises(ConfigError) as err:
        build_from_config(default_recipe("finetune"), over)
    line = str(err.value)
    assert "\n" not in line
    assert str(Path(tiny_data_path) / "fv_dataset.json") in line
    assert "(wan family, VAE AutoencoderKLWan)" in line and "the ltx_video family (VAE AutoencoderKLLTXVideo)" in line
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_a_dataset_without_recorded_family_is_checked_through_its_model_folder(tmp_path, tiny_model_of, tiny_data_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data_path, data)
    info = json.loads((data / "fv_dataset.json").read_text())
    assert info["family"] == "wan" and info["vae_class"] == "AutoencoderKLWan"  # preprocessing records them
    for key in ("family", "vae_class"):
        del info[key]
    (data / "fv_dataset.json").write_text(json.dumps(info))
    over = tiny_overrides(tmp_path, **{
        "models.student.init_from": str(tiny_model_of("ltx_video")),
        "models.student.transformer_config": None,
        "training.data.data_path": str(data),
    })
    with pytest.raises(ConfigError, match=r"\(wan family, VAE AutoencoderKLWan\), but the student is of the ltx_video family"):
        build_from_config(default_recipe("finetune"), over)


def test_a_mixed_in_dataset_of_another_family_is_refused_naming_it(tmp_path, tiny_data_path):
    mixed = tmp_path / "ltx_data"
    shutil.copytree(tiny_data_path, mixed)
    info = json.loads((mixed / "fv_dataset.json").read_text())
    info.update(model="someone/ltx-model", family="ltx_video", vae_class="AutoencoderKLLTXVideo")
    (mixed / "fv_dataset.json").write_text(json.dumps(info))
    over = tiny_overrides(tmp_path, **{"training.data.data_path": tiny_data_path, "training.data.mix": [{"data_path": str(mixed)}]})
    with pytest.raises(ConfigError) as err:
        build_from_config(default_recipe("finetune"), over)
    assert str(err.value).startswith(f"{mixed / 'fv_dataset.json'}: the dataset was encoded by 'someone/ltx-model' "
                                     "(ltx_video family, VAE AutoencoderKLLTXVideo), but the student is of the wan family")


def test_another_model_of_the_same_family_trains_on_the_dataset(tmp_path, tiny_model_of, tiny_data_path):
    """SkyReels-V2 is of the Wan family (its VAE is Wan's): a dataset the tiny Wan model encoded trains it."""
    model = tiny_model_of("skyreels_v2")
    assert json.loads((Path(tiny_data_path) / "fv_dataset.json").read_text())["model"] != str(model)
    over = tiny_overrides(tmp_path, **{
        "models.student.init_from": str(model),
        "models.student.transformer_config": None,
        "training.data.data_path": tiny_data_path,
        "training.data.train_batch_size": 1,
        "training.loop.max_train_steps": 1,
        "training.checkpoint.save_final": False,
    })
    summary = Trainer(build_from_config(default_recipe("finetune"), over)).run()
    assert summary["steps"] == 1


# ---- LoRA keys while LoRA is off ----


def test_lora_keys_without_lora_enable_are_refused_from_the_command_line():
    proc = run_cli("train_finetune.py", "--models.student.lora.rank", "8", "--models.student.lora.alpha", "8", "--dry-run")
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    assert "models.student.lora.rank, models.student.lora.alpha set but models.student.lora.enable is false" in errors[0]
    assert "set models.student.lora.enable true" in errors[0]


def test_lora_keys_without_lora_enable_are_refused_from_a_recipe(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    student = "models:\n  student:\n    transformer_config: {num_layers: 1}\n    lora:\n"
    recipe.write_text(student + "      target_modules: [to_q]\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}: models.student.lora.target_modules set but"):
        load_config(recipe)
    recipe.write_text(student + "      enable: true\n      target_modules: [to_q]\n")
    assert load_config(recipe).models.student.lora.target_modules == ["to_q"]


def test_defaults_and_a_printed_recipe_do_not_count_as_lora_keys(tmp_path):
    """`--dry-run` prints every key, the LoRA section's defaults included: that recipe loads."""
    cfg = load_config(default_recipe("finetune"))
    assert cfg.models.student.lora.enable is False
    printed = tmp_path / "printed.yaml"
    printed.write_text(cfg.to_yaml())
    assert yaml.safe_load(printed.read_text())["models"]["student"]["lora"]["rank"] == 16
    assert load_config(printed).models.student.lora.rank == 16
    assert load_config(default_recipe("finetune"), {"models.student.lora.enable": True, "models.student.lora.rank": 8}).models.student.lora.rank == 8


# ---- the end line's loss ----


def test_smoothed_loss_ends_are_the_means_of_the_first_and_last_steps():
    history = [{"loss": v} for v in (4.0, 2.0, 9.0, float("nan"), 1.0, 3.0, 5.0)]
    out = smoothed_loss_ends(history, window=2)
    assert out == {"first_loss_mean": 3.0, "last_loss_mean": 4.0, "loss_mean_window": 2}
    assert smoothed_loss_ends(history[:3], window=10) == {"first_loss_mean": 4.0, "last_loss_mean": 9.0, "loss_mean_window": 1}


def test_the_end_line_reports_the_mean_loss_of_the_first_and_last_steps(tmp_path, tiny_data_path, capsys):
    over = tiny_overrides(tmp_path, **{
        "training.data.data_path": tiny_data_path,
        "training.loop.max_train_steps": 6,
        "training.checkpoint.save_final": False,
    })
    trainer = Trainer(build_from_config(default_recipe("finetune"), over))
    summary = trainer.run()
    losses = [h["loss"] for h in trainer.history]
    assert len(losses) == 6
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done: "))
    m = re.search(r"loss \(mean of the first/last 3 steps\) ([\d.]+) -> ([\d.]+);", line)
    assert m, line
    assert float(m.group(1)) == pytest.approx(sum(losses[:3]) / 3, abs=1e-4)
    assert float(m.group(2)) == pytest.approx(sum(losses[3:]) / 3, abs=1e-4)
    assert summary["first_loss_mean"] == pytest.approx(sum(losses[:3]) / 3)
    assert summary["first_loss"] == losses[0]  # the single steps stay in the summary


# ---- Hub lookups without the Hub ----

FAKE_REPO = "nobody-here/no-such-model-fv"


def fake_hub_recipe(tmp_path: Path) -> Path:
    recipe = tmp_path / "hub.yaml"
    recipe.write_text(f"models:\n  student:\n    init_from: {FAKE_REPO}\n")
    return recipe


def test_an_offline_dry_run_of_a_hub_recipe_says_hf_download_in_one_line(tmp_path):
    proc = run_cli("train_finetune.py", "--config", str(fake_hub_recipe(tmp_path)), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    hints = [line for line in proc.stdout.splitlines() if f"hf download {FAKE_REPO}" in line]
    assert len(hints) == 1 and hints[0].startswith("# memory estimate: ")
    assert yaml.safe_load(proc.stdout)["models"]["student"]["init_from"] == FAKE_REPO  # the printed recipe stays YAML
    assert "Retrying" not in proc.stderr


@pytest.mark.parametrize("env", [{"HF_HUB_OFFLINE": "1"}, {"HF_HUB_OFFLINE": "", "HF_ENDPOINT": "http://127.0.0.1:9"}],
                         ids=["HF_HUB_OFFLINE", "no-answer"])
def test_a_hub_model_missing_from_the_cache_is_one_line_without_retries(tmp_path, env):
    """No network (here: an endpoint that refuses connections) is found out with one request; the
    lookup is then local only, with no retries."""
    proc = run_cli("train_finetune.py", "--config", str(fake_hub_recipe(tmp_path)), "--output_dir", str(tmp_path / "out"), env=env)
    assert proc.returncode == 2
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"`hf download {FAKE_REPO}`" in errors[0], proc.stderr
    assert ("does not answer" in errors[0]) == ("HF_ENDPOINT" in env)
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr


# ---- one error line per launch ----

LAUNCH_2 = ["--multi_gpu", "--num_processes", "2", "--main_process_port", "0", "--num_machines", "1",
            "--mixed_precision", "no", "--dynamo_backend", "no"]


def launch(launcher: str, *script_args: str) -> subprocess.CompletedProcess:
    """A 2-process CPU launch of train_finetune.py; torch's launcher logs (LOGLEVEL=INFO) the world size it started."""
    proc = run_cli("-m", launcher, *LAUNCH_2, "train_finetune.py", *script_args, env={"ACCELERATE_USE_CPU": "1", "LOGLEVEL": "INFO"})
    assert "global_world_sizes=[2, 2]" in proc.stderr, proc.stderr[-2000:]
    return proc


@pytest.mark.parametrize("launcher", ["accelerate.commands.launch", "fv_accel.launch"])
def test_a_two_process_dry_run_prints_the_recipe_and_estimate_once(launcher):
    proc = launch(launcher, "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\nmethod:\n") == 1 and proc.stdout.count("# memory estimate per process") == 1


BAD = ("--training.optimizer.learning_rate", "-1")
BAD_LINE = "key 'training.optimizer.learning_rate': expected a number > 0, got -1.0"


def test_an_error_under_a_two_process_launch_is_one_line_and_its_exit_status():
    proc = launch("fv_accel.launch", *BAD)
    assert proc.returncode == 2
    assert proc.stderr.count(BAD_LINE) == 1, proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr and "exitcode" not in proc.stderr


def test_plain_accelerate_launch_gets_the_line_once_from_the_training_processes():
    """Accelerate's own launcher then adds its traceback (ChildFailedError), which it prints
    whatever the training processes do; the line itself comes once."""
    proc = launch("accelerate.commands.launch", *BAD)
    assert proc.returncode != 0
    assert proc.stderr.count(BAD_LINE) == 1, proc.stderr


def test_fv_accel_traceback_shows_where_the_error_was_raised():
    proc = run_cli("train_finetune.py", *BAD, env={"FV_ACCEL_TRACEBACK": "1"})
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr and "fv_accel/config.py" in proc.stderr
    assert proc.stderr.count(BAD_LINE) == 2  # in the exception and in the error line


# ---- --help shows the defaults ----

CLI_MODULES = ["fv_accel.preprocess", "fv_accel.export", "fv_accel.plot", "fv_accel.data.inspect", "fv_accel.tiny_model",
               "fv_accel.tiny.motion"]


def test_preprocess_help_shows_its_defaults():
    proc = run_cli("-m", "fv_accel.preprocess", "--help")
    assert proc.returncode == 0
    text = " ".join(proc.stdout.split())  # argparse wraps the lines
    assert "longest a clip can fill (default: 81)" in text and "to the nearest (default: 480x832)" in text
    assert "(default: utf-8)" in text and "(default: 32)" in text


@pytest.mark.parametrize("module", CLI_MODULES)
def test_every_option_with_a_default_shows_it(module, monkeypatch, capsys):
    import argparse
    import importlib

    parsers = []
    original = argparse.ArgumentParser.parse_args

    def keep(self, args=None, namespace=None):
        parsers.append(self)
        return original(self, args, namespace)

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", keep)
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).main(["--help"])
    assert done.value.code == 0
    (parser,) = parsers
    text = "".join(capsys.readouterr().out.split())  # argparse wraps at widths of its own
    shown = [a for a in parser._actions if a.option_strings and a.default not in (None, False, argparse.SUPPRESS)]
    assert "(default:" in text
    for action in shown:
        formatted = "".join(parser._get_formatter()._format_action(action).split())
        assert "(default:" in formatted and formatted in text, (module, action.option_strings)


def test_the_training_scripts_help_shows_the_recipes_defaults():
    proc = run_cli("train_finetune.py", "--help")
    assert proc.returncode == 0 and not proc.stderr.startswith("error")
    cfg = load_config(default_recipe("finetune"))
    assert f"training.loop.max_train_steps (default: {cfg.training.loop.max_train_steps})" in proc.stdout
    assert f"training.checkpoint.output_dir (default: {cfg.training.checkpoint.output_dir})" in proc.stdout


# ---- upscaled clips ----


def test_an_upscaled_clip_is_one_warning_naming_it_and_the_sizes(caplog):
    from fv_accel.preprocess import warn_if_upscaled

    with caplog.at_level("WARNING", logger="fv_accel.preprocess"):
        warn_if_upscaled("a.gif", (14, 25), (48, 80))
        warn_if_upscaled("big.mp4", (96, 160), (48, 80))  # made smaller: nothing to say
        warn_if_upscaled("tall.mp4", (100, 60), (48, 80))  # narrower than the bucket
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert lines[0] == ("a.gif: upscaled 3.4x: its frames are 14x25 (HEIGHTxWIDTH), smaller than its 48x80 bucket; "
                        "smaller --buckets keep it sharp")
    assert lines[1].startswith("tall.mp4: upscaled 1.3x: its frames are 100x60")


# ---- docs/your-clips-with-the-tiny-model.md, run as written ----

WALKTHROUGH = REPO / "docs" / "your-clips-with-the-tiny-model.md"


def write_sliding_square(path: Path, height: int, width: int, color: tuple, caption: str) -> None:
    """36 frames at 12 fps of a square sliding right, written with PyAV, and its caption file."""
    import numpy as np

    from fv_accel.data.video import write_video

    frames = np.full((36, height, width, 3), 20, dtype=np.uint8)
    side = height // 3
    for i, frame in enumerate(frames):
        x = (width - side) * i // 35
        frame[side : 2 * side, x : x + side] = color
    write_video(path, frames, fps=12)
    path.with_suffix(".txt").write_text(caption + "\n")


def walkthrough_commands(text: str) -> list[tuple[str, str]]:
    """("bash", command) for each command of the page's bash blocks (continuations joined) and
    ("python", code) for each python block, in the page's order."""
    steps = []
    for lang, code in re.findall(r"```(bash|python)\n(.*?)```", text, flags=re.S):
        if lang == "python":
            steps.append((lang, code))
        else:
            steps += [(lang, line.strip()) for line in code.replace("\\\n", " ").splitlines() if line.strip()]
    return steps


# Runs the page's steps one after the other in one interpreter (the imports paid once): a
# `python -m` command through runpy as `python -m` runs it, `accelerate launch SCRIPT` as the one
# process it launches on a machine without GPUs (`python SCRIPT`), a python block as a script.
# Each step's output goes to the files the test reads; logging and Accelerate's state are reset between steps.
RUNNER = r"""
import contextlib, json, runpy, shlex, sys, traceback
from pathlib import Path

repo, steps = sys.argv[1], json.loads(Path(sys.argv[2]).read_text())
for i, (lang, step) in enumerate(steps):
    out, err = open(f"step-{i}.out", "w"), open(f"step-{i}.err", "w")
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if lang == "python":
                exec(compile(step, f"block {i}", "exec"), {"__name__": "__main__"})
            else:
                argv = shlex.split(step)
                if argv[:2] == ["accelerate", "launch"]:
                    argv = ["python", *argv[2:]]
                assert argv[0] == "python", step
                if argv[1] == "-m":
                    sys.argv = [argv[2], *argv[3:]]
                    runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
                else:
                    sys.argv = [str(Path(repo) / argv[1]), *argv[2:]]
                    runpy.run_path(sys.argv[0], run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    import logging

    logging.root.handlers.clear()  # each step configures its logging, to its own files
    out.close(), err.close()
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True), GradientState._reset_state(), PartialState._reset_state()
    if code:
        sys.exit(f"step {i} exited {code}")
"""


def test_the_walkthrough_runs_as_written(tmp_path):
    clips = tmp_path / "my_clips"
    clips.mkdir()
    write_sliding_square(clips / "red.mp4", 96, 160, (220, 30, 30), "a red square sliding right")
    write_sliding_square(clips / "small.mp4", 32, 48, (30, 200, 60), "a green square sliding right")
    text = WALKTHROUGH.read_text()
    steps = walkthrough_commands(text)
    assert [s for _, s in steps if "fv_accel.preprocess" in s and "--help" not in s]  # the page has its commands
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    # One compute thread, as `accelerate launch` gives the process it starts on a CPU machine.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([PY, "-c", RUNNER, str(REPO), "steps.json"], cwd=tmp_path, capture_output=True, text=True,
                          env=env, timeout=600)
    ran = {step: ((tmp_path / f"step-{i}.out").read_text(), (tmp_path / f"step-{i}.err").read_text())
           for i, (_, step) in enumerate(steps) if (tmp_path / f"step-{i}.err").is_file()}
    assert proc.returncode == 0, f"{proc.stderr[-2000:]}\n{list(ran.values())[-1][1][-3000:] if ran else ''}"
    assert len(ran) == len(steps)
    _, preprocess_err = next(p for s, p in ran.items() if "fv_accel.preprocess --model" in s)
    warnings = [line for line in preprocess_err.splitlines() if "upscaled" in line]
    assert len(warnings) == 1 and "small.mp4: upscaled 1.7x: its frames are 32x48 (HEIGHTxWIDTH)" in warnings[0]
    assert warnings[0].split("WARNING ", 1)[1] in text  # the line the page shows
    done = [line for out, _ in ran.values() for line in out.splitlines() if line.startswith("done: 100 steps")]
    assert len(done) == 2 and all("loss (mean of the first/last 10 steps)" in line for line in done)
    assert (tmp_path / "outputs/my_clips/samples/step-100").is_dir()
    import av

    with av.open(str(tmp_path / "my_sample.mp4")) as video:
        stream = video.streams.video[0]
        assert (stream.height, stream.width) == (48, 80) and sum(1 for _ in video.decode(stream)) == 17
    assert (tmp_path / "outputs/my_clips_lora/exports/final_merged/transformer/config.json").is_file()


def test_processes_of_one_launch_write_a_shared_line_once_and_their_own_lines_each(tmp_path, monkeypatch, capsys):
    """report_error in processes started by one launcher (here: this process, as each of them in turn)."""
    import tempfile

    from fv_accel.process import report_error

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.delenv("FV_ACCEL_TRACEBACK", raising=False)
    for err in (ValueError("data/x: bad"), ValueError("data/x: bad"), OSError("data/y: only here")):
        report_error(err)
    assert capsys.readouterr().err == "error: data/x: bad\nerror: data/y: only here\n"
    monkeypatch.delenv("LOCAL_RANK")  # a process started on its own says every line
    report_error(ValueError("data/x: bad"))
    assert capsys.readouterr().err == "error: data/x: bad\n"
