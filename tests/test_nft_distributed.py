"""DiffusionNFT (method.name diffusion_nft) on two CPU processes (gloo), through tests/dist_driver.py
under `accelerate launch` as tests/test_distributed.py runs the other methods:

- DDP (accelerate_configs/cpu_2proc.yaml): each rank samples its K-repeat slice of every sampling
  batch, the rewards of both ranks make the advantages (grouped by prompt over both), the ranks end
  with the same student and old policy;
- FSDP2 (accelerate_configs/fsdp2.yaml; fv_accel.build.fsdp2_on_cpu): student, old and reference
  all sharded; the old policy's update runs on the shards and ends where the DDP run's does; a
  checkpoint saved inside an outer step (each rank's shards of `old`, the outer step's samples)
  resumes bitwise;
- DeepSpeed is refused in one line before anything is built.

This file is also the launched script: run as `accelerate launch ... tests/test_nft_distributed.py
SPEC.json`, it records each role's parameter layout before training, then runs dist_driver's runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
ACCELERATE = Path(sys.executable).parent / "accelerate"
RECIPE = "configs/tiny_nft.yaml"
# nft_overrides' scale: 2 outer steps of 2 optimizer steps; per outer step 2 sampling batches of 2
# videos per process, num_video_per_prompt 2 (2 prompts per sampling batch over the 2 ranks).
STEPS, STEPS_PER_OUTER, BATCHES, PER_RANK, REPEATS = 4, 2, 2, 2, 2
WEIGHT_TOL = 1e-5
# A user reward (`module:function`) that scores brightness and records, per rank, what it scored.
REWARD_MODULE = '''
import json, os
import torch

def brightness(clips, prompts):
    scores = clips.float().mean(dim=(1, 2, 3, 4)) / 255.0
    folder = os.environ.get("NFT_REWARD_LOG")
    if folder:
        with open(os.path.join(folder, f"rank{os.environ['RANK']}.jsonl"), "a") as fh:
            fh.write(json.dumps({"prompts": list(prompts), "rewards": scores.tolist()}) + "\\n")
    return scores
'''
REWARD = {"method.reward_fn": [{"name": "nft_dist_rewards:brightness", "weight": 1.0}]}
# A LoRA student: the old policy a second adapter over its base, the reference the base alone.
LORA = {"models.student.lora.enable": True, "models.student.lora.rank": 4}


# ---- the launched side --------------------------------------------------------------------------


def _layout(module: torch.nn.Module) -> dict:
    params = list(module.parameters())
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
    return {"types": sorted({type(p).__name__ for p in params}), "local": local, "full": sum(p.numel() for p in params)}


def _record_role_layouts() -> None:
    """Before each run trains: every role's parameter types and this rank's share of its elements,
    and the student's parameter names in order, written beside the run's output_dir
    (`roles_start<step>_rank<r>.json`)."""
    from fv_accel.trainer import Trainer

    original = Trainer.run

    def run(self, *args, **kwargs):
        out = Path(self.config.training.checkpoint.output_dir)
        layouts = {name: _layout(role.transformer) for name, role in self.method.role_models.items()}
        student = self.accelerator.unwrap_model(self.method.student.transformer)
        layouts["student_names"] = [name for name, _ in student.named_parameters()]
        (out.parent / f"roles_start{self.step}_rank{self.accelerator.process_index}.json").write_text(json.dumps(layouts))
        return original(self, *args, **kwargs)

    Trainer.run = run


# ---- the test side --------------------------------------------------------------------------------


def nft_run(name: str, root: Path, data_path: str, engine: str, **extra) -> dict:
    from test_nft import nft_overrides

    overrides = nft_overrides(root / name, data_path, **{**REWARD, "training.loop.max_train_steps": STEPS, **extra})
    return {"name": name, "recipe": RECIPE, "engine": engine, "overrides": overrides}


def launch(config: str, runs: list[dict], root: Path, *extra_args: str, reward_log: Path | None = None) -> dict:
    """One `accelerate launch` of this file (dist_driver's runs) on 2 CPU processes; each run's per-rank records."""
    from launch_helpers import ANY_FREE_PORT, wait_or_diagnose

    (root / "nft_dist_rewards.py").write_text(REWARD_MODULE)
    spec = root / "spec.json"
    spec.write_text(json.dumps({"out_root": str(root / "records"), "runs": runs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
    env.pop("ACCELERATE_USE_CPU", None)
    if reward_log is not None:
        reward_log.mkdir()
        env["NFT_REWARD_LOG"] = str(reward_log)
    log_path = root / "launch.log"
    cmd = [str(ACCELERATE), "launch", "--config_file", str(REPO / config), "--num_processes", "2", *ANY_FREE_PORT,
           *extra_args, __file__, str(spec)]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    code = wait_or_diagnose(proc, 300, log_path)
    if code != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({code}):\n{log_path.read_text(errors='replace')[-6000:]}")
    records = {}
    for run in runs:
        folder = root / "records" / run["name"]
        records[run["name"]] = [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]
        # The world size as each process saw it.
        assert [(rec["rank"], rec["world_size"]) for rec in records[run["name"]]] == [(0, 2), (1, 2)], run["name"]
    return records


def metrics(output_dir: str) -> dict[int, dict]:
    lines = (Path(output_dir) / "logs" / "metrics.jsonl").read_text().splitlines()
    return {rec["step"]: rec for rec in map(json.loads, lines)}


def old_policy(ckpt: Path, rank: int, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """The old policy's tensors a rank saved in a checkpoint (its shards under FSDP2), by the
    student's parameter names (`names`, in order) where the checkpoint numbers them."""
    from safetensors.torch import load_file

    prefix = "extra/method/old."
    tensors = load_file(str(ckpt / f"fv_rank_{rank}.safetensors"))
    saved = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    assert saved
    return {names[int(k)] if names and k.isdigit() else k: v for k, v in saved.items()}


def student_names(root: Path, run: str) -> list[str]:
    return json.loads((root / run / "roles_start0_rank0.json").read_text())["student_names"]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def captions(data_path: str) -> list[str]:
    import pyarrow.parquet as pq

    files = sorted(Path(data_path).glob("*.parquet"))
    return [c for f in files for c in pq.read_table(f, columns=["caption"]).column("caption").to_pylist()]


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory, tiny_data_path):
    """4 optimizer steps (2 outer steps) under DDP, a checkpoint at the last (each rank's old
    policy); then the same with a LoRA student (rewards recorded for the first run only)."""
    root = tmp_path_factory.mktemp("nft_ddp")
    last = {"training.checkpoint.training_state_checkpointing_steps": STEPS}
    runs = [nft_run("ddp", root, tiny_data_path, "launch", **last),
            nft_run("ddp_lora", root, tiny_data_path, "launch", **last, **LORA)]
    records = launch("accelerate_configs/cpu_2proc.yaml", runs, root, reward_log=root / "rewards")
    return root, records


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory, tiny_data_path):
    """Under FSDP2: a straight 4-step run checkpointing at steps 3 and 4; a run stopped at step 3
    (inside outer step 2) with its checkpoint; a run resumed from that checkpoint to step 4; a
    LoRA run checkpointing at step 4."""
    root = tmp_path_factory.mktemp("nft_fsdp2")
    every = {"training.checkpoint.training_state_checkpointing_steps": 3, "training.checkpoint.save_final": True}
    runs = [
        nft_run("straight", root, tiny_data_path, "fsdp2", **every),
        nft_run("stopped", root, tiny_data_path, "fsdp2", **every, **{"training.loop.max_train_steps": 3}),
        # Into its own output_dir: the launch's processes go on to the next run as soon as they are
        # done, and the main process may still hold the stopped run's output_dir lock.
        nft_run("resumed", root, tiny_data_path, "fsdp2", **every, **{
            "training.checkpoint.resume_from_checkpoint": str(root / "stopped" / "out" / "checkpoint-3")}),
        nft_run("lora", root, tiny_data_path, "fsdp2", **LORA,
                **{"training.checkpoint.training_state_checkpointing_steps": STEPS}),
    ]
    return root, launch("accelerate_configs/fsdp2.yaml", runs, root, "--mixed_precision", "no")


@pytest.mark.multiproc
@pytest.mark.slow
def test_ddp_ranks_sample_k_repeat_slices_and_share_advantages_and_weights(ddp_runs, tiny_data_path):
    from safetensors.torch import load_file

    from fv_accel.methods.rl.diffusion_nft import group_advantages
    from fv_accel.methods.rl.sampling import k_repeat_rows

    root, records = ddp_runs
    ranks = records["ddp"]
    assert [r["distributed_type"] for r in ranks] == ["DistributedType.MULTI_CPU"] * 2
    assert [[s["step"] for s in r["steps"]] for r in ranks] == [list(range(1, STEPS + 1))] * 2

    # Each rank scored its slice of the K-repeat choice of every sampling batch (seed data.seed +
    # (outer - 1) x num_batches_per_epoch + batch): 2 prompts, each twice over the 2 ranks.
    scored = [list(map(json.loads, (root / "rewards" / f"rank{r}.jsonl").read_text().splitlines())) for r in (0, 1)]
    outers = STEPS // STEPS_PER_OUTER
    # The launch's runs one after the other: "ddp"'s sampling batches, then "ddp_lora"'s (the same prompts).
    assert [len(s) for s in scored] == [2 * outers * BATCHES] * 2
    for s in scored:
        assert [b["prompts"] for b in s[outers * BATCHES:]] == [b["prompts"] for b in s[: outers * BATCHES]]
    scored = [s[: outers * BATCHES] for s in scored]
    text = captions(tiny_data_path)
    split = 0
    for i in range(outers * BATCHES):
        for r in (0, 1):
            rows = k_repeat_rows(range(len(text)), batch_size=PER_RANK, repeats=REPEATS, world_size=2, rank=r, seed=i)
            assert scored[r][i]["prompts"] == [text[row] for row in rows], (i, r)
        both = scored[0][i]["prompts"] + scored[1][i]["prompts"]
        assert sorted(Counter(both).values()) == [REPEATS] * (2 * PER_RANK // REPEATS)
        split += len(set(scored[0][i]["prompts"]) & set(scored[1][i]["prompts"]))
    assert split >= 1  # some prompt's copies are on both ranks: its group needs the other rank's rewards

    # The outer step's figures are over both ranks' samples (gathered in rank order), and the
    # advantages group each prompt's rewards over both ranks.
    logged = metrics(ranks[0]["output_dir"])
    assert sorted(logged) == list(range(1, STEPS + 1))
    for outer in range(outers):
        own = [(sum((scored[r][outer * BATCHES + b]["rewards"] for b in range(BATCHES)), []),
                sum((scored[r][outer * BATCHES + b]["prompts"] for b in range(BATCHES)), [])) for r in (0, 1)]
        rewards = torch.tensor(own[0][0] + own[1][0], dtype=torch.float64)
        prompts = own[0][1] + own[1][1]
        adv = group_advantages(rewards, prompts, torch.ones(len(prompts), dtype=torch.bool))
        # What grouping within each rank alone would give.
        adv_per_rank = torch.cat([group_advantages(torch.tensor(o[0], dtype=torch.float64), o[1],
                                                   torch.ones(len(o[1]), dtype=torch.bool)) for o in own])
        rank_std = [torch.tensor(o[0], dtype=torch.float64).std(unbiased=False).item() for o in own]
        for step in range(outer * STEPS_PER_OUTER + 1, (outer + 1) * STEPS_PER_OUTER + 1):
            m = logged[step]
            assert m["outer_step"] == outer + 1
            # The mean of equal shares is also the mean of the ranks' means: the spread and the
            # advantages below are what a rank's own figures (averaged by the trainer's log) would miss.
            assert m["reward/avg"] == pytest.approx(rewards.mean().item(), abs=1e-6)
            assert m["reward/avg_std"] == pytest.approx(rewards.std(unbiased=False).item(), abs=1e-6)
            assert abs(m["reward/avg_std"] - sum(rank_std) / 2) > 1e-4  # not the mean of the ranks' own figures
            assert m["advantage/abs_mean"] == pytest.approx(adv.abs().mean().item(), abs=1e-5)
            assert m["advantage/std"] == pytest.approx(adv.std(unbiased=False).item(), abs=1e-5)
        assert abs(adv.abs().mean().item() - adv_per_rank.abs().mean().item()) > 0.05

    # The ranks trained on different samples, their gradients averaged (logged loss = mean of the
    # ranks' losses), and end with the same student (DDP) and the same old policy.
    for step in range(STEPS):
        local = [r["steps"][step]["local_loss"] for r in ranks]
        assert ranks[0]["logged"][step]["loss"] == pytest.approx(sum(local) / 2, abs=1e-5)
        assert logged[step + 1]["loss"] == pytest.approx(sum(local) / 2, abs=1e-5)
    assert abs(ranks[0]["steps"][0]["local_loss"] - ranks[1]["steps"][0]["local_loss"]) > 1e-3
    folder = root / "records" / "ddp"
    w0, w1 = (load_file(str(folder / f"rank{r}.safetensors")) for r in (0, 1))
    assert max_diff(w0, w1) == 0.0
    init = load_file(str(folder / "init.safetensors"))
    assert max_diff(w0, init) > 1e-4  # it trained
    ckpt = Path(ranks[0]["output_dir"]) / f"checkpoint-{STEPS}"
    names = student_names(root, "ddp")
    old0, old1 = old_policy(ckpt, 0, names), old_policy(ckpt, 1, names)
    assert max_diff(old0, old1) == 0.0
    # decay_type 1: after outer step 2 the old policy keeps 0.2% of itself, the rest is the student.
    assert max_diff(old0, init) > 1e-4 and max_diff(old0, w0) < 0.01 * max_diff(w0, init)


@pytest.mark.multiproc
@pytest.mark.slow
def test_fsdp2_shards_every_role_updates_the_old_policy_and_resumes_mid_outer_step_bitwise(fsdp2_runs, ddp_runs):
    from safetensors.torch import load_file

    root, records = fsdp2_runs
    ddp_root, ddp_records = ddp_runs
    ddp_ranks = ddp_records["ddp"]
    for name in ("straight", "stopped", "resumed"):
        for rec in records[name]:
            assert (rec["distributed_type"], rec["is_fsdp2"], rec["param_type"]) == ("DistributedType.FSDP", True, "DTensor")
    # Student, old and reference are sharded: each rank holds its part of each.
    for start, folder in ((0, "straight"), (3, "resumed")):
        layouts = [json.loads((root / folder / f"roles_start{start}_rank{r}.json").read_text()) for r in (0, 1)]
        for role in ("student", "old", "reference"):
            full, local = layouts[0][role]["full"], [lay[role]["local"] for lay in layouts]
            assert [lay[role]["types"] for lay in layouts] == [["DTensor"], ["DTensor"]], role
            assert sum(local) == full and max(local) < full, (role, local, full)

    # FSDP2 trains what DDP trains: the same losses and final student, and the old policy's update
    # on the shards gives the DDP run's old policy.
    straight = records["straight"]
    out = root / "straight" / "out"
    fsdp2_logged, ddp_logged = metrics(str(out)), metrics(ddp_ranks[0]["output_dir"])
    for step in range(1, STEPS + 1):
        assert fsdp2_logged[step]["loss"] == pytest.approx(ddp_logged[step]["loss"], abs=1e-5)
        # The old policy's mean squared change at the last update, over the whole model (not a shard's).
        assert fsdp2_logged[step]["old_drift"] == pytest.approx(ddp_logged[step]["old_drift"], rel=1e-4, abs=1e-12)
    assert ddp_logged[STEPS]["old_drift"] > 1e-7
    final = load_file(str(out / "transformer" / "diffusion_pytorch_model.safetensors"))
    ddp_final = load_file(str(ddp_root / "records" / "ddp" / "rank0.safetensors"))
    assert max_diff(final, ddp_final) < WEIGHT_TOL
    names = student_names(root, "straight")
    assert names == student_names(ddp_root, "ddp")
    ddp_old = old_policy(Path(ddp_ranks[0]["output_dir"]) / f"checkpoint-{STEPS}", 0, names)
    shards = [old_policy(out / f"checkpoint-{STEPS}", r, names) for r in (0, 1)]
    assert any(shards[0][k].shape != ddp_old[k].shape for k in ddp_old)  # each rank saved its shards
    gathered = {k: torch.cat([shards[0][k], shards[1][k]]) for k in ddp_old}
    assert max_diff(gathered, ddp_old) < WEIGHT_TOL
    ddp_init = load_file(str(ddp_root / "records" / "ddp" / "init.safetensors"))
    assert max_diff(gathered, ddp_final) < 0.01 * max_diff(ddp_final, ddp_init)  # it follows the student

    # Stopped at step 3 (inside outer step 2): its checkpoint holds the outer step's samples and
    # each rank's old policy shards; resumed, the run ends bitwise where the straight run ends.
    stopped_ckpt = root / "stopped" / "out" / "checkpoint-3"
    tensors = load_file(str(stopped_ckpt / "fv_rank_1.safetensors"))
    assert int(tensors["extra/method/outer.iteration"]) == 2
    assert tensors["extra/method/outer.x0"].shape[0] == BATCHES * PER_RANK  # this rank's samples of outer step 2
    resumed = records["resumed"]
    assert [r["start_step"] for r in resumed] == [3, 3] and [s["step"] for s in resumed[0]["steps"]] == [STEPS]
    for r in (0, 1):
        assert resumed[r]["steps"][0]["micro_losses"] == straight[r]["steps"][STEPS - 1]["micro_losses"]
    resumed_out = root / "resumed" / "out"
    resumed_final = load_file(str(resumed_out / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert max_diff(resumed_final, final) == 0.0
    for r in (0, 1):
        a = load_file(str(out / f"checkpoint-{STEPS}" / f"fv_rank_{r}.safetensors"))
        b = load_file(str(resumed_out / f"checkpoint-{STEPS}" / f"fv_rank_{r}.safetensors"))
        assert a.keys() == b.keys() and any(k.startswith("extra/method/old.") for k in a)
        assert [k for k in a if not torch.equal(a[k], b[k])] == []  # old policy shards and generators


@pytest.mark.multiproc
@pytest.mark.slow
def test_fsdp2_lora_old_adapter_follows_the_trained_adapter_as_under_ddp(fsdp2_runs, ddp_runs):
    """With a LoRA student the old policy is a second adapter: under FSDP2 its update reaches the
    sharded adapter the model computes with, and ends where the DDP run's does."""
    root, records = fsdp2_runs
    ddp_root, ddp_records = ddp_runs
    assert all(rec["is_fsdp2"] for rec in records["lora"])
    ddp_ckpt = Path(ddp_records["ddp_lora"][0]["output_dir"]) / f"checkpoint-{STEPS}"
    ddp_old = old_policy(ddp_ckpt, 0)
    assert max_diff(ddp_old, old_policy(ddp_ckpt, 1)) == 0.0
    # LoRA's B matrices start at zero: the old adapter's moved with the trained one's.
    assert max(v.abs().max().item() for v in ddp_old.values()) > 1e-3
    assert sum(v.abs().max().item() == 0.0 for v in ddp_old.values()) == 0
    fsdp2_ckpt = root / "lora" / "out" / f"checkpoint-{STEPS}"
    shards = [old_policy(fsdp2_ckpt, r) for r in (0, 1)]
    assert all(shards[0][k].shape[0] < ddp_old[k].shape[0] for k in ddp_old)  # each rank saved its shards
    assert max_diff({k: torch.cat([shards[0][k], shards[1][k]]) for k in ddp_old}, ddp_old) < WEIGHT_TOL


# `noise_rng: sample`, 2 processes against 1 with twice the batches: the 2 ranks' gradients of TRAIN
# samples each are averaged where 1 process averages 2 x TRAIN, and each model call sees half the
# batch: only float32 rounding (the order of the sums) tells them apart. Measured (CPU, fp32):
# losses 7.5e-8 relative; the reward and advantage figures 6.5e-8 at outer step 1 and 2.4e-6 at
# outer step 2 (sampled by old policies 3e-6 apart; an advantage divides its pair's reward
# difference by the pair's spread, ~1e-3); student and old policy at most 3.1e-6 apart (Adam
# normalises each element's gradient, so rounding in a nearly cancelling one moves it by a
# fraction of the learning rate), against 4e-3 moved by training. With the rank's generators
# (noise_rng rank) the same runs differ by 2.2e-2, 0.61 and 7.9e-3.
TRAIN = 2
EQUAL_LOSS_REL, EQUAL_FIGURE_REL = 1e-5, 1e-4
EQUAL_WEIGHT_RTOL, EQUAL_WEIGHT_ATOL = 1e-5, 3e-5


@pytest.mark.multiproc
@pytest.mark.slow
def test_per_sample_noise_makes_2_ddp_processes_train_as_1_with_twice_the_batches(tmp_path, tiny_data_path, monkeypatch):
    """`training.loop.noise_rng: sample`: 2 processes with sampling batches of PER_RANK and training
    micro-batches of TRAIN end where 1 process with batches of 2 x PER_RANK and 2 x TRAIN does (the
    same seeds): the logged losses, each outer step's reward and advantage figures, the final
    student and the old policy."""
    from safetensors.torch import load_file

    from fv_accel.build import build_from_config
    from fv_accel.methods.rl.sampling import k_repeat_rows
    from fv_accel.trainer import Trainer
    from test_nft import nft_overrides

    # Each sampling batch's K-repeat list: world 1 with batch 2B is world 2's slices of B in rank order.
    rows = range(len(captions(tiny_data_path)))
    for seed in range(STEPS // STEPS_PER_OUTER * BATCHES):
        both = [k_repeat_rows(rows, batch_size=PER_RANK, repeats=REPEATS, world_size=2, rank=r, seed=seed) for r in (0, 1)]
        assert k_repeat_rows(rows, batch_size=2 * PER_RANK, repeats=REPEATS, world_size=1, rank=0, seed=seed) == both[0] + both[1]

    common = {"training.loop.noise_rng": "sample", "training.checkpoint.training_state_checkpointing_steps": STEPS}
    run = nft_run("two", tmp_path, tiny_data_path, "launch", **common,
                  **{"method.sample_train_batch_size": PER_RANK, "method.train_batch_size": TRAIN})
    ranks = launch("accelerate_configs/cpu_2proc.yaml", [run], tmp_path)["two"]
    two_logged = metrics(ranks[0]["output_dir"])

    monkeypatch.syspath_prepend(str(tmp_path))  # the reward module launch() wrote
    single = build_from_config(RECIPE, nft_overrides(tmp_path / "one", tiny_data_path, **{
        **REWARD, **common, "training.loop.max_train_steps": STEPS,
        "method.sample_train_batch_size": 2 * PER_RANK, "method.train_batch_size": 2 * TRAIN}))
    assert single.method.steps_per_outer == STEPS_PER_OUTER
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the launched processes do (the cores may be shared)
    try:
        Trainer(single).run()
    finally:
        torch.set_num_threads(threads)
    one_out = Path(single.config.training.checkpoint.output_dir)
    one_logged = metrics(str(one_out))
    assert sorted(one_logged) == sorted(two_logged) == list(range(1, STEPS + 1))

    def rel(a: float, b: float) -> float:
        return abs(a - b) / max(abs(a), abs(b), 1e-12)

    loss_rel = {s: rel(one_logged[s]["loss"], two_logged[s]["loss"]) for s in one_logged}
    assert max(loss_rel.values()) < EQUAL_LOSS_REL, loss_rel
    assert len({one_logged[s]["loss"] for s in one_logged}) == STEPS  # 4 different micro-batches' losses
    figures = ("reward/avg", "reward/avg_std", "advantage/abs_mean", "advantage/std")
    figure_rel = {(s, k): rel(one_logged[s][k], two_logged[s][k]) for s in one_logged for k in figures}
    assert max(figure_rel.values()) < EQUAL_FIGURE_REL, figure_rel
    assert one_logged[1]["reward/avg"] != one_logged[STEPS]["reward/avg"]  # each outer step its own samples

    # The final student and the old policy (decay_type 1: after outer step 2, 0.2% of itself).
    folder = tmp_path / "records" / "two"
    two_student = load_file(str(folder / "rank0.safetensors"))
    one_student = {k: v.detach().float() for k, v in single.method.student._unwrapped().state_dict().items()}
    names = student_names(tmp_path, "two")
    two_old = old_policy(Path(ranks[0]["output_dir"]) / f"checkpoint-{STEPS}", 0, names)
    one_old = old_policy(one_out / f"checkpoint-{STEPS}", 0, names)
    assert max_diff(two_student, load_file(str(folder / "init.safetensors"))) > 1e-3  # it trained
    for one, two in ((one_student, two_student), (one_old, two_old)):
        assert sorted(one) == sorted(two)
        for k in one:
            torch.testing.assert_close(one[k], two[k].to(one[k].dtype), rtol=EQUAL_WEIGHT_RTOL, atol=EQUAL_WEIGHT_ATOL,
                                       msg=lambda m, k=k: f"{k}: {m}")


def test_deepspeed_is_refused_in_one_line_before_anything_is_built(tmp_path, monkeypatch, capsys):
    from fv_accel.build import check_engine_takes_method
    from fv_accel.cli import main
    from fv_accel.config import ConfigError, load_config

    message = (
        "method.name diffusion_nft: not under DeepSpeed (the old policy follows the student's weights between optimizer "
        "steps, which DeepSpeed's engine keeps to itself): launch with accelerate_configs/ddp.yaml or fsdp2.yaml"
    )
    cfg = load_config(REPO / RECIPE)
    with pytest.raises(ConfigError) as err:
        check_engine_takes_method(cfg, "DEEPSPEED")
    assert str(err.value) == message
    for engine in ("DDP", "FSDP", "NO"):
        check_engine_takes_method(cfg, engine)
    check_engine_takes_method(load_config(REPO / "configs/tiny_finetune.yaml"), "DEEPSPEED")
    # A launch under a DeepSpeed config (the variable `accelerate launch` exports): the entry's exit
    # status 2 and that one line, nothing written.
    for key in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_CPU", "FV_ACCEL_TRACEBACK"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    out = tmp_path / "refused"
    capsys.readouterr()
    assert main("diffusion_nft", ["--config", str(REPO / RECIPE), "--output_dir", str(out), "--max_train_steps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"error: {message}"]
    assert not out.exists()


if __name__ == "__main__":
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    torch.set_num_threads(1)
    import dist_driver

    _record_role_layouts()
    dist_driver.main(sys.argv[1])
    from fv_accel.process import exit_without_teardown

    exit_without_teardown(0)
