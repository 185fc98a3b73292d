"""Opening and reading latent datasets of growing size in place (fv_accel.data.loader.LatentDataset).

    python benchmarks/data_scale.py                  # all sizes (writes about 5.4 GB under --work-dir)
    python benchmarks/data_scale.py --sizes rows_100k wan_1_3b_300
    python benchmarks/data_scale.py --quick          # two tiny sizes (smoke test)

Writes synthetic FastVideo-schema datasets (pyarrow, snappy; row groups of at most 16 MB as
fv_accel.preprocess writes them, or 100 MB as `datasets` does; `data-SSSSS-of-NNNNN.parquet`
shards and fv_dataset.json) under --work-dir,
by default in the temporary folder, never in the repository; a dataset already there is reused.
Per size, each in a fresh process:

- open time of `LatentDataset(path)` (imports excluded) and its peak RSS;
- bytes written during the open: the process's write syscalls (/proc/self/io wchar) around it, and
  the bytes of files created under HOME, TMPDIR and the Hugging Face caches (pointed at empty
  folders) and in the dataset folder;
- `python -m fv_accel.data.inspect PATH` wall time, imports included (a separate process);
- items/s of the training loader (batch 1, shuffled buckets) with 0 and 2 DataLoader workers.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

DATASETS_ROW_GROUP_BYTES = 100 * 10**6  # `datasets`' MAX_ROW_GROUP_SIZE (Hub and FastVideo-written data)
WAN_LATENT, WAN_TEXT = (16, 21, 60, 104), (512, 4096)  # 81 frames of 480x832; umT5's padded text

# name -> rows, shards, latent [C, T, H, W] and text [L, D] shapes (bf16), items timed per loader,
# and row groups of at most `row_group_bytes` (None: as fv_accel.preprocess writes them,
# fv_accel.data.schema.ROW_GROUP_BYTES).
SIZES = {
    "rows_1k": dict(rows=1_000, shards=10, latent=(16, 2, 4, 4), text=(8, 32), items=400),
    "rows_100k": dict(rows=100_000, shards=1_000, latent=(16, 2, 4, 4), text=(8, 32), items=400),
    "wan_1_3b_30": dict(rows=30, shards=1, latent=WAN_LATENT, text=WAN_TEXT, items=48),
    "wan_1_3b_300": dict(rows=300, shards=6, latent=WAN_LATENT, text=WAN_TEXT, items=48),
    "wan_1_3b_300_rg100mb": dict(rows=300, shards=6, latent=WAN_LATENT, text=WAN_TEXT, items=24,
                                 row_group_bytes=DATASETS_ROW_GROUP_BYTES),
}
QUICK_SIZES = {"quick": dict(rows=60, shards=3, latent=(16, 2, 4, 4), text=(8, 32), items=20)}


def _bf16_bytes(rng, count: int) -> bytes:
    """`count` bf16 values of a standard normal (the high halves of float32s)."""
    import numpy as np

    f32 = rng.standard_normal(count, dtype=np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def write_dataset(folder: Path, spec: dict) -> Path:
    """The dataset of `spec` in `folder` (kept when its marker says it is complete)."""
    import math

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fv_accel.data.schema import ROW_GROUP_BYTES

    latent_n, text_n = math.prod(spec["latent"]), math.prod(spec["text"])
    row_bytes = 2 * (latent_n + text_n)
    group = max(1, min(1000, (spec.get("row_group_bytes") or ROW_GROUP_BYTES) // row_bytes))
    marker = folder / "bench_spec.json"
    recorded = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.items() if k not in ("items", "row_group_bytes")}
    want = json.dumps({**recorded, "row_group_rows": group}, sort_keys=True)
    if marker.is_file() and marker.read_text() == want:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.parquet"):
        old.unlink()
    rows, shards = spec["rows"], spec["shards"]
    rng = np.random.default_rng(0)
    per = -(-rows // shards)
    for s in range(shards):
        ids = range(s * per, min(rows, (s + 1) * per))
        n = len(ids)
        table = pa.table({
            "id": [f"clip-{i}" for i in ids],
            "vae_latent_bytes": pa.array([_bf16_bytes(rng, latent_n) for _ in ids], pa.binary()),
            "vae_latent_shape": [list(spec["latent"])] * n,
            "vae_latent_dtype": ["bfloat16"] * n,
            "text_embedding_bytes": pa.array([_bf16_bytes(rng, text_n) for _ in ids], pa.binary()),
            "text_embedding_shape": [list(spec["text"])] * n,
            "text_embedding_dtype": ["bfloat16"] * n,
            "file_name": [f"clip-{i}.mp4" for i in ids],
            "caption": [f"synthetic clip {i}" for i in ids],
            "media_type": ["video"] * n,
            "width": [spec["latent"][3] * 8] * n,
            "height": [spec["latent"][2] * 8] * n,
            "num_frames": [(spec["latent"][1] - 1) * 4 + 1] * n,
            "duration_sec": [((spec["latent"][1] - 1) * 4 + 1) / 16.0] * n,
            "fps": [16.0] * n,
        })
        pq.write_table(table, folder / f"data-{s:05d}-of-{shards:05d}.parquet", row_group_size=group)
    from fv_accel.data.schema import write_dataset_info

    channels = spec["latent"][0]
    write_dataset_info(folder, model=None, latent_stats=([0.0] * channels, [1.0] * channels), num_rows=rows)
    marker.write_text(want)
    return folder


# ---------------------------------------------------------------------------------------------
# measured in a fresh process
# ---------------------------------------------------------------------------------------------
def _io() -> dict:
    try:
        return {k: int(v) for k, v in (line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())}
    except OSError:
        return {}


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _peak_rss_mb() -> float:
    """This process's peak resident set (VmHWM: of its own memory since exec; ru_maxrss would
    include the parent's at fork). It counts the memory-mapped file pages read (page cache)."""
    return _status_mb("VmHWM")


def child(mode: str, path: str, workers: int, items: int) -> dict:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    t0 = time.perf_counter()
    import fv_accel.data.checks  # noqa: F401  (imported by the open: timed as imports, not as the open)
    import fv_accel.data.parquet_rows  # noqa: F401
    from fv_accel.data.loader import BucketBatchSampler, LatentDataset, TrainLoader

    imported = time.perf_counter() - t0
    rss_before = _peak_rss_mb()
    io0 = _io()
    t0 = time.perf_counter()
    ds = LatentDataset(path)
    opened = time.perf_counter() - t0
    io1 = _io()
    out = {
        "import_s": imported,
        "open_s": opened,
        "open_wchar_bytes": io1.get("wchar", 0) - io0.get("wchar", 0),
        "open_storage_write_bytes": io1.get("write_bytes", 0) - io0.get("write_bytes", 0),
        "rss_before_open_mb": rss_before,
        "peak_rss_after_open_mb": _peak_rss_mb(),
        "rows": len(ds),
    }
    if mode == "items":
        sampler = BucketBatchSampler([ds.bucket_key(i) for i in range(len(ds))], batch_size=1, seed=0)
        batches = iter(TrainLoader(ds, sampler, num_workers=workers))
        next(batches)  # worker start, first row group
        t0 = time.perf_counter()
        for _ in range(items):
            next(batches)
        out["items_per_s"] = items / (time.perf_counter() - t0)
        out["workers"] = workers
        out["peak_rss_mb"] = _peak_rss_mb()  # the main process's (workers not included)
        out["anon_rss_mb"] = _status_mb("RssAnon")  # its own memory, without mapped file pages
    return out


def _isolated_env(root: Path) -> dict:
    env = dict(os.environ)
    for name, sub in (("HOME", "home"), ("TMPDIR", "tmp"), ("HF_HOME", "hf"), ("HF_DATASETS_CACHE", "hf/datasets"),
                      ("XDG_CACHE_HOME", "home/.cache")):
        (root / sub).mkdir(parents=True, exist_ok=True)
        env[name] = str(root / sub)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return env


def _files(*folders: Path) -> dict[str, int]:
    return {str(p): p.stat().st_size for f in folders for p in Path(f).rglob("*") if p.is_file()}


def _grown(before: dict[str, int], after: dict[str, int]) -> int:
    """Bytes of files created or grown."""
    return sum(max(0, size - before.get(path, 0)) for path, size in after.items())


def measure(name: str, spec: dict, work_dir: Path) -> dict:
    t0 = time.perf_counter()
    folder = write_dataset(work_dir / "data" / name, spec)
    written_s = time.perf_counter() - t0
    import pyarrow.parquet as pq

    files = sorted(folder.glob("*.parquet"))
    result = {
        "size": name,
        "rows": spec["rows"],
        "shards": len(files),
        "row_groups": sum(pq.ParquetFile(f).metadata.num_row_groups for f in files),
        "row_group_bytes_max": spec.get("row_group_bytes"),
        "latent_shape": list(spec["latent"]),
        "text_shape": list(spec["text"]),
        "dataset_bytes": sum(f.stat().st_size for f in files),
        "write_dataset_s": written_s,
    }
    with tempfile.TemporaryDirectory(dir=work_dir, prefix="env-") as scratch:
        env = _isolated_env(Path(scratch))
        watched = (Path(scratch), folder)

        def run(args: list[str]) -> dict:
            before = _files(*watched)
            done = subprocess.run([sys.executable, str(Path(__file__)), "--child", *args], env=env,
                                  capture_output=True, text=True, timeout=1800)
            if done.returncode:
                raise RuntimeError(f"{name}: child {args} failed:\n{done.stderr[-3000:]}")
            out = json.loads(done.stdout.strip().splitlines()[-1])
            out["files_grown_bytes"] = _grown(before, _files(*watched))
            return out

        opened = run(["open", str(folder)])
        result.update({k: opened[k] for k in ("import_s", "open_s", "open_wchar_bytes", "open_storage_write_bytes",
                                              "rss_before_open_mb", "peak_rss_after_open_mb")})
        result["open_files_grown_bytes"] = opened["files_grown_bytes"]
        before = _files(*watched)
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fv_accel.data.inspect", str(folder)], env=env,
                              capture_output=True, text=True, timeout=600)
        result["inspect_s"] = time.perf_counter() - t0
        if done.returncode:
            raise RuntimeError(f"{name}: inspect failed: {done.stderr.strip()}")
        result["inspect_files_grown_bytes"] = _grown(before, _files(*watched))
        result["inspect_output"] = done.stdout.strip().splitlines()
        for workers in (0, 2):
            got = run(["items", str(folder), str(workers), str(spec["items"])])
            result[f"items_per_s_{workers}_workers"] = got["items_per_s"]
            result[f"peak_rss_items_{workers}_workers_mb"] = got["peak_rss_mb"]
            result[f"anon_rss_items_{workers}_workers_mb"] = got["anon_rss_mb"]
        result["items_timed"] = spec["items"]
    return result


def wan_1_3b_model_rate() -> dict:
    """Samples/s the Wan 1.3B architecture (configs/gpu_bench_1_3b.yaml) consumes at one H200's
    dense bf16 peak, by benchmarks/gpu.sh's arithmetic (fv_accel.telemetry.train_step_flops)."""
    import yaml

    from fv_accel.process import quiet_libraries
    from fv_accel.telemetry import PEAK_BF16_FLOPS, train_step_flops

    quiet_libraries()  # before diffusers imports peft and bitsandbytes

    cfg = yaml.safe_load((REPO / "configs" / "gpu_bench_1_3b.yaml").read_text())["models"]["student"]["transformer_config"]
    import torch
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**cfg)
    params = sum(p.numel() for p in model.parameters())
    tokens = WAN_LATENT[1] * (WAN_LATENT[2] // 2) * (WAN_LATENT[3] // 2)
    shape = {"params": params, "layers": cfg["num_layers"], "width": cfg["num_attention_heads"] * cfg["attention_head_dim"]}
    flops = train_step_flops(shape, 1, tokens)
    peak = dict(PEAK_BF16_FLOPS)["H200"]
    return {"params": params, "tokens": tokens, "flops_per_sample": flops, "peak_flops": peak,
            "samples_per_s_at_peak": peak / flops}


def to_markdown(p: dict) -> str:
    import _common as C

    def mb(n: float) -> str:
        return f"{n / 1e6:,.1f}" if n >= 1e5 else f"{n / 1e6:.3f}"

    rows = [[
        r["size"], f"{r['rows']:,}", r["shards"], r["row_groups"],
        f"{'x'.join(map(str, r['latent_shape']))} + {'x'.join(map(str, r['text_shape']))}",
        mb(r["dataset_bytes"]), f"{r['open_s']:.3f}", f"{r['inspect_s']:.2f}",
        f"{r['open_wchar_bytes']} / {r['open_files_grown_bytes']}", r["inspect_files_grown_bytes"],
        f"{r['peak_rss_after_open_mb']:.0f} ({r['peak_rss_after_open_mb'] - r['rss_before_open_mb']:+.0f})",
        f"{r['peak_rss_items_0_workers_mb']:.0f} / {r['anon_rss_items_0_workers_mb']:.0f}",
        f"{r['items_per_s_0_workers']:.1f}", f"{r['items_per_s_2_workers']:.1f}",
    ] for r in p["results"]]
    header = ["size", "rows", "shards", "row groups", "latent + text (bf16)", "MB", "open s", "inspect s (imports incl.)",
              "bytes written during open (syscalls / files)", "bytes of files written by inspect",
              "peak RSS after open MB (the open's share)", "RSS reading, 0 workers: peak / anonymous at the end, MB", "items/s, 0 workers",
              "items/s, 2 workers"]
    lines = [
        "# Data at scale: opening datasets in place",
        "",
        f"Machine: {C.machine_line(p['machine'])}.",
        f"Command: `{p['command']}`",
        "",
        "Each figure from a fresh process; items/s: the training loader (batch 1, buckets shuffled) after its first batch, "
        f"{', '.join(str(r['items_timed']) for r in p['results'])} items. `open s` excludes imports; `inspect s` is "
        "`python -m fv_accel.data.inspect PATH`'s wall time, imports included. Bytes written: the process's write "
        "syscalls during the open (/proc/self/io wchar) and the bytes of files created under HOME, TMPDIR, the Hugging "
        "Face caches and the dataset folder. Peak RSS counts the memory-mapped file pages read (page cache, "
        "reclaimable); anonymous RSS is the process's own memory.",
        "",
        C.markdown_table(header, rows),
    ]
    model = p.get("wan_1_3b_model")
    if model:
        lines += [
            "",
            f"Wan 1.3B architecture ({model['params'] / 1e9:.2f}B parameters, {model['tokens']:,} tokens a sample): "
            f"{model['flops_per_sample'] / 1e12:.0f} TFLOPs a training sample (benchmarks/gpu.sh's arithmetic), so one "
            f"H200 at its full dense bf16 peak ({model['peak_flops'] / 1e12:.0f} TFLOP/s) consumes "
            f"{model['samples_per_s_at_peak']:.2f} samples/s.",
        ]
        for r in p["results"]:
            if tuple(r["latent_shape"]) == WAN_LATENT:
                lines.append(
                    f"- {r['size']}: the loader gives {r['items_per_s_2_workers']:.1f} samples/s with 2 workers "
                    f"({r['items_per_s_2_workers'] / model['samples_per_s_at_peak']:.0f}x that) and "
                    f"{r['items_per_s_0_workers']:.1f} with none, on this CPU."
                )
    return "\n".join(lines)


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    from fv_accel.process import DefaultsHelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=DefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=None, help=f"of {', '.join(SIZES)} (default: all)")
    p.add_argument("--quick", action="store_true", help="one tiny size: a smoke test")
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument("--name", default="data_scale", help="base name of the result files")
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "fv_accel_data_scale")
    p.add_argument("--no-model", action="store_true", help="skip the 1.3B model's consumption rate (needs diffusers)")
    return p.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        mode, path = argv[1], argv[2]
        workers, items = (int(argv[3]), int(argv[4])) if mode == "items" else (0, 0)
        print(json.dumps(child(mode, path, workers, items)))
        return {}
    args = parse_args(argv)
    sys.path.insert(0, str(HERE))
    import _common as C

    table = QUICK_SIZES if args.quick else SIZES
    names = args.sizes or list(table)
    unknown = [n for n in names if n not in table]
    if unknown:
        raise SystemExit(f"error: --sizes: unknown {', '.join(unknown)}; expected some of {', '.join(table)}")
    args.work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for name in names:
        r = measure(name, table[name], args.work_dir)
        print(
            f"[data_scale] {name}: {r['rows']} rows, {r['shards']} shards, {r['dataset_bytes'] / 1e6:.1f} MB: open "
            f"{r['open_s']:.3f} s, inspect {r['inspect_s']:.2f} s, written {r['open_wchar_bytes']} B, items/s "
            f"{r['items_per_s_0_workers']:.1f} (0 workers) {r['items_per_s_2_workers']:.1f} (2 workers)",
            flush=True,
        )
        results.append(r)
    payload = {
        "benchmark": "data_scale",
        "command": C.command_line("data_scale.py", argv),
        "machine": C.machine_info(),
        "results": results,
        "wan_1_3b_model": None if args.quick or args.no_model else wan_1_3b_model_rate(),
        "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    C.publish_results(args.out, args.name, payload, to_markdown(payload))
    return payload


if __name__ == "__main__":
    main()
