"""Runs recipes through `build_from_config` + `Trainer` and records, per rank, what
tests/test_distributed.py checks. Launched by the tests as

    accelerate launch --config_file accelerate_configs/<engine>.yaml --num_processes 2 \
        tests/dist_driver.py SPEC.json

and also imported by them for the single-process runs. SPEC is a JSON list of runs, each
`{"name", "recipe", "overrides", "engine"}` (and `"expect_error": true` for a run whose build must be
refused: its error is recorded per rank instead; `"older_checkpoint": [src, dst]` to resume from a copy
laid out as older checkpoints were, `older_checkpoint`); run `name` writes `<out_root>/<name>/rank<r>.json`
(world size, engine, per-step local loss and sample indices, logged losses) and, for unsharded
engines, `rank<r>.safetensors` (that rank's final weights).

`engine: "fsdp2"` runs a launch with accelerate_configs/fsdp2.yaml: on CPU Accelerate builds
MULTI_CPU (DDP over gloo), and `build_accelerator` switches the run to FSDP with the plugin of the launch
environment (fv_accel.build.fsdp2_on_cpu, as the entry scripts do), so Accelerate's own
`_prepare_fsdp2` (torch `fully_shard`), clipping, `save_state` (torch.distributed.checkpoint) and
`get_state_dict` paths run over gloo; the driver asserts that it did.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def keep_process_group(acc) -> None:
    """Several runs share one launch: `end_training` finishes the trackers but leaves the process
    group up (bringing a static-rendezvous group up a second time hangs)."""

    def end_training() -> None:
        for tracker in acc.trackers:
            tracker.finish()

    acc.end_training = end_training


def reset_accelerate() -> None:
    """Forget the previous run's Accelerator; the process group stays up for the next one."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def save_weights(module: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().float().cpu().contiguous() for k, v in module.state_dict().items()}, str(path))


def _context_parallel_of(model: torch.nn.Module):
    parallel = getattr(model, "_parallel_config", None)
    cp = getattr(parallel, "context_parallel_config", None)
    if cp is None:
        return None
    return {"ulysses": cp.ulysses_degree, "ring": cp.ring_degree, "group_rank": cp._flattened_mesh.get_local_rank()}


def _build_error(spec: dict, cfg, acc, out_root: Path) -> dict:
    """A run expected to be refused (`"expect_error": true`): records the build's error on each rank."""
    from fv_accel.build import build_from_config

    try:
        build_from_config(cfg, accelerator=acc)
    except Exception as err:  # noqa: BLE001 - recorded for the test
        error = f"{type(err).__name__}: {err}"
    else:
        raise AssertionError(f"run {spec['name']}: the build was expected to fail and did not")
    record = {"name": spec["name"], "rank": acc.process_index, "world_size": acc.num_processes,
              "distributed_type": str(acc.distributed_type), "error": error}
    out = out_root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{acc.process_index}.json").write_text(json.dumps(record, indent=1))
    return record


def older_checkpoint(src: str, dst: str, acc) -> None:
    """`dst`: a copy of the FSDP2 distillation checkpoint `src` as fv_accel wrote them before frozen
    roles were left out: the teacher's shards as one more model folder after the trained roles'
    (`pytorch_model_fsdp_2`; the critic's, of the teacher's architecture, stand in) and no
    `frozen_roles` record, its metadata sealed again."""
    import shutil

    from fv_accel.checkpoint import METADATA_CHECKSUM_KEY, METADATA_NAME, file_records, read_metadata, write_metadata

    if acc.is_main_process:
        shutil.copytree(src, dst)
        shutil.copytree(Path(dst) / "pytorch_model_fsdp_1", Path(dst) / "pytorch_model_fsdp_2")
        meta = read_metadata(dst)
        for key in ("frozen_roles", METADATA_CHECKSUM_KEY):
            del meta[key]
        meta["files"] = file_records(Path(dst))
        write_metadata(Path(dst) / METADATA_NAME, meta)
    acc.wait_for_everyone()


def run_one(spec: dict, out_root: Path) -> dict:
    from fv_accel.build import build_accelerator, build_from_config
    from fv_accel.config import load_config
    from fv_accel.trainer import Trainer

    cfg = load_config(str(REPO / spec["recipe"]), spec.get("overrides") or {})
    acc = build_accelerator(cfg)
    if spec.get("engine") == "fsdp2":
        # build_accelerator switches an FSDP launch on CPU to FSDP2 (fv_accel.build.fsdp2_on_cpu).
        assert str(acc.distributed_type) == "DistributedType.FSDP", acc.distributed_type
    keep_process_group(acc)
    if spec.get("older_checkpoint"):
        older_checkpoint(*spec["older_checkpoint"], acc)
    if spec.get("expect_error"):
        return _build_error(spec, cfg, acc, out_root)
    run = build_from_config(cfg, accelerator=acc)
    method = run.method
    steps: dict[int, dict] = {}
    original_step = method.single_train_step

    def recording_step(batch, iteration):
        loss_map, outputs, metrics = original_step(batch, iteration)
        entry = steps.setdefault(int(iteration), {"losses": [], "samples": []})
        entry["losses"].append(float(loss_map["total_loss"].detach()))
        entry["samples"] += [int(i) for i in batch["sample_index"]]
        return loss_map, outputs, metrics

    method.single_train_step = recording_step
    model = method.student.transformer
    param = next(model.parameters())
    unwrapped = acc.unwrap_model(model)
    blocks = getattr(unwrapped, "blocks", [])
    # What reaches the model: the timesteps' dtype, and the dtype the first block computes in.
    seen = {"timestep": set(), "block": set()}
    if hasattr(unwrapped, "condition_embedder"):
        unwrapped.condition_embedder.register_forward_pre_hook(
            lambda mod, args: seen["timestep"].add(str(args[0].dtype))
        )
    if len(blocks):
        blocks[0].register_forward_pre_hook(lambda mod, args: seen["block"].add(str(next(mod.parameters()).dtype)))
    rank = acc.process_index
    out = out_root / spec["name"]
    out.mkdir(parents=True, exist_ok=True)
    sharded = bool(getattr(acc, "is_fsdp2", False))
    if not sharded and rank == 0:
        save_weights(acc.unwrap_model(model), out / "init.safetensors")
    teacher = getattr(method, "teacher", None)
    teacher_param_type = type(next(teacher.transformer.parameters())).__name__ if teacher is not None else None
    # The teacher's parameter types after each of its forwards (this hook runs after the engine's own).
    after_teacher_forward: set[str] = set()
    if teacher is not None:
        teacher.transformer.register_forward_hook(
            lambda mod, args, out: after_teacher_forward.update(type(p).__name__ for p in mod.parameters())
        )
    trainer = Trainer(run)
    trainer.run()

    record = {
        "name": spec["name"],
        "rank": rank,
        "world_size": acc.num_processes,
        "distributed_type": str(acc.distributed_type),
        "is_fsdp2": sharded,
        "param_type": type(param).__name__,
        "checkpoint_wrapped_blocks": sum(hasattr(b, "_checkpoint_wrapped_module") for b in blocks),
        "diffusers_gradient_checkpointing": bool(getattr(unwrapped, "gradient_checkpointing", False)),
        "mixed_precision": acc.mixed_precision,
        "mp_policy": str(getattr(acc.state.fsdp_plugin, "mixed_precision_policy", None)) if sharded else None,
        "timestep_dtypes": sorted(seen["timestep"]),
        "block_compute_dtypes": sorted(seen["block"]),
        "start_step": run.start_step,
        "teacher_param_type": teacher_param_type,
        "teacher_param_types_after_forward": sorted(after_teacher_forward),
        # diffusers' context-parallel config on the transformer (None: the sequence is not split).
        "context_parallel": _context_parallel_of(unwrapped),
        "steps": [
            {
                "step": s,
                "local_loss": sum(e["losses"]) / len(e["losses"]),
                "micro_losses": e["losses"],
                "samples": e["samples"],
            }
            for s, e in sorted(steps.items())
        ],
        "logged": [{"step": h["step"], "loss": h["loss"]} for h in trainer.history],
        "output_dir": cfg.training.checkpoint.output_dir,
    }
    if not sharded:
        save_weights(acc.unwrap_model(model), out / f"rank{rank}.safetensors")
        critic = getattr(method, "critic", None)
        if critic is not None:  # a distillation run's second trained role
            save_weights(acc.unwrap_model(critic.transformer), out / f"critic_rank{rank}.safetensors")

    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    return record


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out_root = Path(spec["out_root"])
    for i, run_spec in enumerate(spec["runs"]):
        if i:
            reset_accelerate()
        run_one(run_spec, out_root)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
    # Like the entry scripts: skip the interpreter teardown that can deadlock in gloo
    # (fv_accel.process.exit_without_teardown); every record is written and closed by now.
    from fv_accel.process import exit_without_teardown

    exit_without_teardown(0)
