"""Training with online target features against a feature cache, and train-step memory.

Issue 5: "training throughput in tokens/s with online target features vs the same batches read
from the cache (the ratio is the cost of online extraction), and peak memory of one train step
as anchors per row grows 64, 128, 256, 512".

    python benchmarks/bench_train_features.py

(options: --config configs/dspark_smollm2_135m.py --data /work/data/smollm2_math --steps 10
--warmup 1 --pack-length 512 --batch-size 4 --anchors 64 128 256 512 --feature-dir DIR
--feature-dtype float32 --compute-dtype bfloat16 --output benchmarks/results/train_features.json)

Target: the config's (SmolLM2-135M-Instruct by default), in the training compute dtype
(``train.compute_dtype``, or --compute-dtype: float32 on CPU, bfloat16 on accelerators by
default); the drafter is the config's, randomly initialised
(timings and memory do not depend on the values). Training settings are the config's
(``global_batch_size`` rows of ``pack_length`` tokens with ``anchors_per_row`` anchor slots),
with --batch-size / --pack-length overriding them, on a one-device mesh.

1. Feature cache: ``extract_features`` over the whole data folder into --feature-dir (default: a
   temporary folder, deleted at the end; an existing cache there is reused or extended), timed.
2. Throughput: two pipelines with the same seed give the same batches, one without and one with
   the cached features; one jitted train step (two traces). After --warmup untimed steps each,
   --steps steps alternate online / cached (so machine noise hits both alike). A step's time is
   ``next(pipeline)`` + the step + ``block_until_ready``; tokens are the non-padding tokens.
   Reported: tokens/s of each and ratio = online step time / cached step time.
3. Memory, per anchors-per-row value and mode (online / cached), each in a fresh subprocess: a
   synthetic batch of the same shapes (memory depends only on shapes), the step lowered and
   compiled, ``compiled.memory_analysis()`` (XLA's buffer assignment: total = arguments +
   outputs + temporaries - aliased (donated) bytes; the raw fields, peak_memory_in_bytes included,
   are in the JSON), then one step run, with the process's peak RSS (Linux VmHWM, reset through
   /proc/self/clear_refs after loading and again after compiling) of the compilation and of the
   run: the run's includes the resident target, drafter, optimizer state and batch, i.e. all a
   CPU step needs; the RSS before compiling is reported too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT, command_line, cpu_name

MODES = ("online", "cached")


def setup(args):
    """(config, target, drafter, train config) with the command line's overrides."""
    from dspark_jax.drafter import init_drafter
    from dspark_jax.experiment import load_config
    from dspark_jax.target import load_target
    from dspark_jax.training.trainer import compute_dtype

    config = load_config(args.config)
    tcfg = config.train
    if args.pack_length:
        tcfg.pack_length = args.pack_length
    if args.batch_size:
        tcfg.global_batch_size = args.batch_size
    if args.compute_dtype:
        tcfg.compute_dtype = args.compute_dtype
    target = load_target(config.target, dtype=compute_dtype(tcfg))
    drafter = init_drafter(target, config, seed=0)
    return config, target, drafter, tcfg


def make_step(target, drafter, tcfg):
    """(jitted train step, fresh-state function) on a one-device mesh."""
    import jax

    from dspark_jax import sharding
    from dspark_jax.training import step as train_step
    from dspark_jax.training.trainer import compute_dtype

    mesh = sharding.make_mesh((1, 1, 1), devices=jax.devices()[:1])
    optimizer = train_step.make_optimizer(tcfg, 1000)
    example = jax.eval_shape(lambda s: train_step.init_train_state(s, optimizer), drafter.state)
    step = train_step.make_train_step(
        drafter.graphdef, target.graphdef, tcfg, optimizer, mesh=mesh, state=example,
        target_state=target.state, anchor_chunk=tcfg.anchor_chunk, compute_dtype=compute_dtype(tcfg))
    return step, lambda: train_step.init_train_state(drafter.state, optimizer, mesh)


def synthetic_batch(target, drafter, rows: int, length: int, anchors: int,
                    feature_dtype: str | None) -> dict:
    """A batch of the pipeline's shapes: one sequence per row, all tokens loss tokens,
    ``anchors`` anchor slots spread over the row; random cached features in ``feature_dtype``
    (None: none)."""
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    d = target.config.hidden_size
    taps = len(drafter.config.target_layer_ids)
    batch = dict(
        input_ids=rng.integers(0, target.config.vocab_size, (rows, length)).astype(np.int32),
        positions=np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)).copy(),
        segment_ids=np.ones((rows, length), np.int32), loss_mask=np.ones((rows, length), np.int32),
        anchors=np.broadcast_to((np.arange(anchors) * (length - 1)) // anchors,
                                (rows, anchors)).astype(np.int32),
        keep=np.ones((rows, anchors), bool))
    if feature_dtype:
        dtype = jnp.dtype(feature_dtype)
        batch["taps"] = rng.standard_normal((rows, length, taps * d), np.float32).astype(dtype)
        batch["hidden"] = rng.standard_normal((rows, length, d), np.float32).astype(dtype)
    return batch


def rss_mib(field: str) -> float:
    """VmRSS (current) or VmHWM (peak since the last reset) of this process, in MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak_rss() -> None:
    """Resets VmHWM to the current RSS (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def child_memory(args) -> None:
    """One memory measurement (a fresh process): prints a MEMORY JSON line."""
    import jax

    _, target, drafter, tcfg = setup(args)
    tcfg.anchors_per_row = args.child_anchors
    step, fresh_state = make_step(target, drafter, tcfg)
    batch = synthetic_batch(target, drafter, tcfg.global_batch_size, tcfg.pack_length,
                            args.child_anchors,
                            args.feature_dtype if args.child_mode == "cached" else None)
    state = fresh_state()
    base_rss = rss_mib("VmRSS")
    reset_peak_rss()
    compiled = step.lower(state, target.state, batch).compile()
    compile_rss = rss_mib("VmHWM")
    reset_peak_rss()
    stats = compiled.memory_analysis()
    fields = ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
              "alias_size_in_bytes", "generated_code_size_in_bytes", "peak_memory_in_bytes")
    analysis = {f: int(getattr(stats, f, 0) or 0) for f in fields}
    analysis["total_bytes"] = (analysis["argument_size_in_bytes"] + analysis["output_size_in_bytes"]
                               + analysis["temp_size_in_bytes"] - analysis["alias_size_in_bytes"])
    started = time.perf_counter()
    jax.block_until_ready(compiled(state, target.state, batch))
    result = dict(anchors_per_row=args.child_anchors, mode=args.child_mode, xla=analysis,
                  step_s=time.perf_counter() - started, rss_before_mib=base_rss,
                  compile_peak_rss_mib=compile_rss, step_peak_rss_mib=rss_mib("VmHWM"))
    print("MEMORY " + json.dumps(result), flush=True)


def measure_memory(args, anchors: int, mode: str) -> dict:
    command = [sys.executable, __file__, "--child-anchors", str(anchors), "--child-mode", mode,
               "--config", str(args.config), "--feature-dtype", args.feature_dtype]
    for flag in ("pack_length", "batch_size", "compute_dtype"):
        if getattr(args, flag):
            command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("MEMORY ")]
    if proc.returncode and "RESOURCE_EXHAUSTED" in proc.stderr:
        message = next(l for l in proc.stderr.splitlines() if "RESOURCE_EXHAUSTED" in l)
        return dict(anchors_per_row=anchors, mode=mode, out_of_memory=message.strip())
    if proc.returncode or not lines:
        raise RuntimeError(f"memory run ({anchors} anchors, {mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("MEMORY "):])


def memory_cells(result: dict) -> str:
    """'XLA MiB | RSS MiB' of one memory run, or the failed allocation's size."""
    if "out_of_memory" in result:
        size = [w for w in result["out_of_memory"].split() if w.isdigit()]
        return f"out of memory ({int(size[0]) / 2**30:.1f} GiB allocation) | -" if size else "out of memory | -"
    return f"{result['xla']['total_bytes'] / 2**20:.1f} | {result['step_peak_rss_mib']:.1f}"


def throughput(args, target, drafter, tcfg, feature_dir) -> dict:
    """Alternating online / cached steps over the same batches (module docstring, 2)."""
    import jax
    import numpy as np

    from dspark_jax.training.features import cache_key
    from dspark_jax.training.pipeline import make_pipeline

    step, fresh_state = make_step(target, drafter, tcfg)
    pipes, states = {}, {}
    for mode in MODES:
        pipes[mode] = make_pipeline(
            args.data, batch_size=tcfg.global_batch_size, pack_length=tcfg.pack_length,
            anchors_per_row=tcfg.anchors_per_row, anchors_per_sequence=tcfg.num_anchors,
            block_size=drafter.config.block_size, seed=tcfg.seed,
            **(dict(feature_dir=feature_dir,
                    feature_key=cache_key(target, drafter.config.target_layer_ids))
               if mode == "cached" else {}))
        states[mode] = fresh_state()
    times = {mode: [] for mode in MODES}
    data_times = {mode: [] for mode in MODES}
    tokens = []
    for i in range(args.warmup + args.steps):
        timed = i >= args.warmup
        ids, elapsed = {}, {}
        for mode in MODES:
            started = time.perf_counter()
            batch = next(pipes[mode])
            loaded = time.perf_counter()
            states[mode], metrics = step(states[mode], target.state, batch)
            jax.block_until_ready(metrics)
            elapsed[mode] = time.perf_counter() - started
            ids[mode] = batch["input_ids"]
            if timed:
                times[mode].append(elapsed[mode])
                data_times[mode].append(loaded - started)
        if not np.array_equal(ids["online"], ids["cached"]):
            raise RuntimeError(f"step {i}: the online and cached pipelines gave different batches")
        if timed:
            tokens.append(int((batch["segment_ids"] > 0).sum()))
        print(f"step {i + 1}/{args.warmup + args.steps}{'' if timed else ' (warmup)'}: "
              + ", ".join(f"{m} {elapsed[m]:.2f} s" for m in MODES), flush=True)
    out = dict(tokens_per_step=tokens)
    for mode in MODES:
        out[mode] = dict(step_s=times[mode], data_s=data_times[mode],
                         median_step_s=statistics.median(times[mode]),
                         median_data_s=statistics.median(data_times[mode]),
                         tokens_per_s=sum(tokens) / sum(times[mode]))
    out["online_over_cached_time"] = sum(times["online"]) / sum(times["cached"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "dspark_smollm2_135m.py")
    parser.add_argument("--data", type=Path, default=Path("/work/data/smollm2_math"),
                        help="a folder written by prepare-data")
    parser.add_argument("--feature-dir", type=Path,
                        help="feature cache folder (default: a temporary one, deleted afterwards)")
    parser.add_argument("--feature-dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--compute-dtype", choices=("float32", "bfloat16"),
                        help="the step's forward dtype (default: the config's train.compute_dtype)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode (compile)")
    parser.add_argument("--pack-length", type=int, help="tokens per row (default: the config's)")
    parser.add_argument("--batch-size", type=int, help="rows per step (default: the config's)")
    parser.add_argument("--anchors", type=int, nargs="*", default=[64, 128, 256, 512],
                        help="anchors per row of the memory runs (none: skip them)")
    parser.add_argument("--output", type=Path,
                        default=ROOT / "benchmarks" / "results" / "train_features.json")
    parser.add_argument("--child-anchors", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--child-mode", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    if args.child_anchors:
        return child_memory(args)

    import jax

    from dspark_jax.training.features import extract_features
    from dspark_jax.training.trainer import compute_dtype

    started = time.perf_counter()
    config, target, drafter, tcfg = setup(args)
    feature_dir = args.feature_dir or Path(tempfile.mkdtemp(prefix="dspark_features_"))
    began = time.perf_counter()
    manifest = extract_features(target, args.data, feature_dir, drafter.config.target_layer_ids,
                                dtype=args.feature_dtype)
    extraction = dict(seconds=time.perf_counter() - began, tokens=manifest["num_tokens"],
                      samples=manifest["num_samples"],
                      bytes=sum((feature_dir / f["file"]).stat().st_size for f in manifest["files"]))
    try:
        speed = throughput(args, target, drafter, tcfg, feature_dir)
    finally:
        if args.feature_dir is None:
            shutil.rmtree(feature_dir)
    memory = []
    for anchors in args.anchors:
        for mode in MODES:
            memory.append(measure_memory(args, anchors, mode))
            print(f"memory {anchors} anchors, {mode} (XLA MiB | RSS MiB): "
                  f"{memory_cells(memory[-1])}", flush=True)

    lines = [
        f"{config.target}, {jax.default_backend()}, compute {compute_dtype(tcfg).name}, "
        f"{tcfg.global_batch_size} rows x "
        f"{tcfg.pack_length} tokens, {tcfg.anchors_per_row} anchors/row, {args.steps} steps "
        f"alternating (after {args.warmup} warmup); cache {args.feature_dtype}, "
        f"{extraction['bytes'] / 2**20:.0f} MiB for {extraction['tokens']} tokens, extracted in "
        f"{extraction['seconds']:.0f} s",
        "",
        "| features | tokens/s | median step (s) | median data (s) |",
        "|---|---|---|---|",
    ]
    for mode in MODES:
        s = speed[mode]
        lines.append(f"| {mode} | {s['tokens_per_s']:.0f} | {s['median_step_s']:.2f} | "
                     f"{s['median_data_s']:.3f} |")
    lines += ["", f"online / cached step time: {speed['online_over_cached_time']:.2f}x"]
    if memory:
        lines += ["", "Memory of one train step (MiB): XLA = compiled.memory_analysis() arguments + "
                  "outputs + temporaries - donated; RSS = peak RSS of a fresh process while it runs "
                  "the compiled step (model, optimizer state and batch resident; compilation "
                  "excluded)", "",
                  "| anchors/row | online XLA | online RSS | cached XLA | cached RSS |",
                  "|---|---|---|---|---|"]
        for anchors in args.anchors:
            row = {m["mode"]: m for m in memory if m["anchors_per_row"] == anchors}
            lines.append(f"| {anchors} | " + " | ".join(memory_cells(row[mode]) for mode in MODES)
                         + " |")
    table = "\n".join(lines)
    print()
    print(table)

    report = dict(
        benchmark="train_features", config=str(args.config), target=config.target,
        data=str(args.data), backend=jax.default_backend(), rows=tcfg.global_batch_size,
        pack_length=tcfg.pack_length, anchors_per_row=tcfg.anchors_per_row,
        feature_dtype=args.feature_dtype, steps=args.steps, warmup=args.warmup,
        extraction=extraction, throughput=speed, memory=memory,
        machine=f"{platform.machine()} {cpu_name()}", cpus=os.cpu_count(),
        load_average=list(os.getloadavg()), jax=jax.__version__,
        date=time.strftime("%Y-%m-%d %H:%M:%S"), command=command_line(__file__),
        wall_s=time.perf_counter() - started, table=table)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.output} ({report['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
