"""fv_accel's DiffusionNFT against FastVideo 0.2.1's: with the role predictions, the VAE decode, the
rewards and the prompt rows replaced by the stand-ins of tests/nft_standins.py (the student's, old's
and reference's one parameter `w` is the first entry of each role's `scale_shift_table`), the same
rows and seeds, every sampling batch's K-repeat rows, every reward and advantage, every micro-step's
seven loss terms, the student's `w` after every optimizer step and the old policy's `w` after every
outer step equal, to 1e-5 relative (3 of the 8 cases bit for bit), what FastVideo's own `DiffusionNFTMethod` computed
(tests/data/nft_fastvideo_golden.json, written by tests/fastvideo_reference/make_nft_golden.py), and
the rank's generator ends each outer step in FastVideo's state. The whole run goes through the
trainer's loop (its accumulation, clipping and optimizer steps)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dmd2_helpers import TINY_TEACHER
from fv_accel.build import build_from_config
from fv_accel.config import default_recipe
from fv_accel.trainer import Trainer
from nft_standins import (
    FASTVIDEO_REWARD_NAMES, NFT_STANDIN_REWARDS, W_INIT, nft_standin_media, nft_standin_predict, nft_standin_rows,
)

REPO = Path(__file__).resolve().parents[1]
GOLDEN = json.loads((REPO / "tests" / "data" / "nft_fastvideo_golden.json").read_text())
LOSS_KEYS = ("total_loss", "policy_loss", "unweighted_policy_loss", "kl_div_loss", "old_deviate", "old_kl_div", "x0_norm")
METHOD_KEYS = ("sample_train_batch_size", "train_batch_size", "num_batches_per_epoch", "num_inner_epochs",
               "num_video_per_prompt", "adv_mode", "decay_type", "adv_clip_max", "timestep_fraction", "kl_beta", "beta")


def unhex(value: Any) -> Any:
    if isinstance(value, dict) and "hex" in value:
        h = value["hex"]
        return [float.fromhex(x) for x in h] if isinstance(h, list) else float.fromhex(h)
    return value


def write_rows(folder: Path, shapes: dict) -> str:
    from fv_accel.data.schema import make_row, write_dataset_info, write_rows as write

    spec = GOLDEN["rows"]
    rows = nft_standin_rows(spec["num_rows"], spec["L"], spec["D"], spec["seed"])
    latent = torch.zeros(shapes["C"], shapes["T"], shapes["H"], shapes["W"])
    write([make_row(sample_id=f"row-{i}", latent=latent, text_embedding=r["text_embedding"], caption=r["caption"])
           for i, r in enumerate(rows)], folder / "data.parquet")
    write_dataset_info(folder, model=None, latent_stats=([0.0] * shapes["C"], [1.0] * shapes["C"]))
    return str(folder)


def overrides(case: dict, tmp_path: Path) -> dict:
    m, tr, s, d = case["method"], case["training"], case["shapes"], case["derived"]
    # FastVideo's defaults as the golden run resolved them (the tiny recipe's own values differ).
    out = {f"method.{k}": d[k] for k in ("adv_clip_max", "timestep_fraction", "kl_beta", "beta", "decay_type", "adv_mode",
                                         "train_batch_size")}
    out.update({f"method.{k}": m[k] for k in METHOD_KEYS if k in m})
    out.update({f"method.sampling.{k}": v for k, v in m["sampling"].items()})
    out.update({
        "method.reward_fn": dict(m["reward_fn"]),
        "method.ema.enabled": False,
        "method.validation.every_steps": 0,
        "method.validation.prompts": [],
        "models.student.init_from": None,
        "models.student.transformer_config": dict(TINY_TEACHER),
        "models.student.flow_shift": case["flow_shift"]["student"],
        "training.data.data_path": write_rows(tmp_path / "rows", s),
        "training.data.train_batch_size": s["B"],
        "training.data.text_max_length": s["L"],
        "training.data.seed": GOLDEN["generator_seed"],
        "training.loop.noise_rng": "rank",
        "training.loop.gradient_accumulation_steps": tr["gradient_accumulation_steps"],
        "training.loop.max_train_steps": d["optimizer_steps_per_iteration"] * len(case["iterations"]),
        "training.optimizer.learning_rate": tr["learning_rate"],
        "training.optimizer.betas": tr["betas"],
        "training.optimizer.weight_decay": tr["weight_decay"],
        "training.optimizer.eps": tr["eps"],
        "training.optimizer.lr_scheduler": tr["lr_scheduler"],
        "callbacks.grad_clip.max_grad_norm": d["max_grad_norm"] if d["max_grad_norm"] > 0 else 1e30,
        "callbacks.ema.enable": False,
        "callbacks.validation.enable": False,
        "training.checkpoint.output_dir": str(tmp_path / "out"),
        "training.checkpoint.save_final": False,
        "training.tracker.trackers": ["none"],
        "training.tracker.write_plots": False,
    })
    return out


def w_of(role: Any) -> torch.Tensor:
    return role.transformer.scale_shift_table.reshape(-1)[0:1]


class Recorder:
    """The stand-ins installed on a built method, and what it computed."""

    def __init__(self, method: Any, case: dict):
        self.method, self.case = method, case
        self.micro: list[dict] = []
        self.student_w: list[float] = []
        self.outers: list[dict] = []
        iterations = case["iterations"]
        weights = dict(case["method"]["reward_fn"])
        with torch.no_grad():
            for role in (method.student, method.reference):
                role.transformer.scale_shift_table.view(-1)[0] = W_INIT
        method.predict_override = lambda role, x, t, tb: nft_standin_predict(
            "reference" if role is method.reference else "policy", x, t, w_of(role))
        method.decode_for_reward = nft_standin_media

        def score(media, prompts):
            scores = {name: NFT_STANDIN_REWARDS[FASTVIDEO_REWARD_NAMES[name]](media, prompts) for name in weights}
            total = None
            for name, weight in weights.items():
                total = scores[name] * float(weight) if total is None else total + scores[name] * float(weight)
            return {**scores, "avg": total}, torch.zeros(len(prompts), dtype=torch.bool)

        method.score = score
        sample, update, loss, on_step_end = method.sample_outer_step, method.update_old_policy, method.nft_loss, method.on_step_end

        def sample_outer_step(k):  # outer step k of the run is FastVideo's iteration iterations[k - 1]
            outer = sample(iterations[k - 1])
            self.outers.append({"advantages": outer.advantages.clone(), "x0": outer.x0.clone()})
            outer.iteration = k
            return outer

        def nft_loss(*args, **kwargs):
            losses = loss(*args, **kwargs)
            self.micro.append({k: v.detach().clone() for k, v in losses.items()})
            return losses

        def step_end(step):
            self.student_w.append(float(w_of(method.student).detach()))
            on_step_end(step)
            if step % method.steps_per_outer == 0:
                self.outers[-1]["old_w"] = float(w_of(method.old))
                self.outers[-1]["generator"] = hashlib.sha256(method.cuda_generator.get_state().numpy().tobytes()).hexdigest()

        method.sample_outer_step = sample_outer_step
        method.update_old_policy = lambda k: update(iterations[k - 1])
        method.nft_loss = nft_loss
        method.on_step_end = step_end


def close(ours: float, theirs: float, what: str, rel: float = 1e-5, floor: float = 1e-7) -> None:
    assert abs(ours - theirs) <= max(rel * abs(theirs), floor), f"{what}: ours {ours!r}, FastVideo's {theirs!r}"


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["name"] for c in GOLDEN["cases"]])
def test_diffusion_nft_equals_fastvideo(case, tmp_path):
    run = build_from_config(str(default_recipe("diffusion_nft")), overrides(case, tmp_path))
    rec = Recorder(run.method, case)
    Trainer(run).run()
    micro = [m for r in case["results"] for m in r["micro_steps"]]
    assert len(rec.micro) == len(micro)
    for i, (ours, theirs) in enumerate(zip(rec.micro, micro)):
        for key in LOSS_KEYS:
            close(float(ours[key]), unhex(theirs["losses"][key]), f"micro-step {i} {key}")
    steps = [s for r in case["results"] for s in r["optimizer_steps"]]
    assert len(rec.student_w) == len(steps)
    for i, (ours, theirs) in enumerate(zip(rec.student_w, steps)):
        close(ours, unhex(theirs["student_w_after"]), f"optimizer step {i + 1} student w")
    for k, (ours, theirs) in enumerate(zip(rec.outers, case["results"])):
        for a, b in zip(ours["advantages"].tolist(), unhex(theirs["advantages"])):
            close(a, b, f"outer step {k + 1} advantage", floor=1e-5)
        close(ours["old_w"], unhex(theirs["old_w"]), f"outer step {k + 1} old w")
        assert ours["generator"] == theirs["generator_state_sha256"], f"outer step {k + 1} generator state"
