"""The ``dspark-jax`` command: thin wrappers that parse, call the library and print."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "auto": None}
WEIGHT_DTYPES = ("bfloat16",)
WEIGHT_DTYPE_HELP = ("decode with the target's weight matrices in this dtype under its --dtype "
                     "activations (multiplied in bfloat16, accumulated in float32): on a CPU "
                     "with AMX faster at every batch size; the law then is the bfloat16-weight "
                     "target's, and a greedy output may depend on the batch")
DRAFT_WEIGHT_DTYPE_HELP = ("the drafter's weight matrices in this dtype (multiplied in bfloat16, "
                           "accumulated in float32): a faster draft step on a CPU with AMX; "
                           "only the draft law changes, so outputs stay exact")
# Errors that mean bad input: a one-line message and exit status 2. Our argument and input checks
# raise ValueError, and so do the project's own error types (CheckpointError and
# UnsupportedModelError subclass it); a missing input folder or file (a data folder without
# its manifest, say) is a FileNotFoundError. Anything else, a TypeError from a bug included, keeps its
# traceback. (The library's deliberate TypeError, generate's "prompts must be a list of
# strings", cannot come from here: the commands always pass a list of --prompt strings.)
USER_ERRORS = (ValueError, FileNotFoundError)


def _dtype(name):
    import jax.numpy as jnp

    return None if DTYPES[name] is None else jnp.dtype(DTYPES[name])


def _verify_params(args) -> dict:
    params = {}
    if args.threshold is not None:
        params["threshold"] = args.threshold
    if args.gamma is not None:
        params["gamma"] = args.gamma
    return params


def _sps_table(args, target, drafter, prompts):
    """The steps/s table of ``--sps``: a JSON file (a ``profile-sps`` profile, or a list of
    steps/s by forward tokens), or ``auto``: this machine's profile for the batch (measured
    once, then cached)."""
    if args.sps != "auto":
        return _load_sps_file(args.sps)
    from dspark_jax.prompts import encode_prompts
    from dspark_jax.engine import machine_sps_table

    print(f"--sps auto: this machine's steps/s for {len(prompts)} request(s) "
          "(measured once, then cached)", file=sys.stderr)
    return machine_sps_table(target, drafter, slots=len(prompts),
                             prompt_len=max(len(ids) for ids in encode_prompts(target, prompts)),
                             max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, weight_dtype=args.weight_dtype,
                             draft_weight_dtype=args.draft_weight_dtype)


def cmd_generate(args) -> int:
    from dspark_jax import generate, init_drafter, load_drafter, load_target

    target = load_target(args.model, dtype=_dtype(args.dtype))
    drafter = None
    if args.drafter == "init":
        drafter = init_drafter(target, seed=args.seed)
    elif args.drafter:
        drafter = load_drafter(args.drafter, target)
    prompts = args.prompt or ["Explain speculative decoding in two sentences."]
    params = _verify_params(args)
    if args.sps:
        if drafter is None:
            raise ValueError("--sps needs --drafter (it sizes speculative verification)")
        params["sps"] = _sps_table(args, target, drafter, prompts)
    results = generate(target, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, drafter=drafter, verify=args.verify,
                       verify_params=params, weight_dtype=args.weight_dtype,
                       draft_weight_dtype=args.draft_weight_dtype)
    for prompt, result in zip(prompts, results):
        print(f">>> {prompt}\n{result.text}\n")
        if drafter is not None:
            s = result.stats
            rates = " ".join("-" if r is None else f"{r:.2f}" for r in s["accept_rate_at_k"])
            print(f"    tau {s['tau']:.2f}, {s['rounds']} rounds, mean proposal "
                  f"{s['proposal_len']:.2f}, verify rate {s['verify_rate']:.2f}, "
                  f"accept rate @k {rates}\n")
    stats = results[0].stats
    new_tokens = sum(r.stats["new_tokens"] for r in results)
    print(f"[{target.name}] {new_tokens} new tokens for {len(results)} prompt(s) in "
          f"{stats['wall_s']:.2f} s: {stats['tokens_per_s']:.1f} tokens/s "
          f"(compile {stats['compile_s']:.1f} s, {stats['steps']} target steps)")
    return 0


def cmd_demo(args) -> int:
    from dspark_jax.demo import DEFAULT_PROMPTS, format_report, mismatches, run_demo

    rows = run_demo(args.model, args.drafter, args.prompt or DEFAULT_PROMPTS,
                    max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                    weight_dtype=args.weight_dtype, draft_weight_dtype=args.draft_weight_dtype)
    print(format_report(rows))
    failures = mismatches(rows)
    for line in failures:
        print(f"dspark-jax demo: FAILED: {line}", file=sys.stderr)
    return 1 if failures else 0


def _drafter_labels(args) -> list[str]:
    labels = args.label or [Path(p).name for p in args.drafter]
    if len(labels) != len(args.drafter) or len(set(labels)) != len(labels):
        raise ValueError(f"give one distinct --label per --drafter (got {len(labels)} label(s) "
                         f"for {len(args.drafter)} drafter(s))")
    return labels


def cmd_eval(args) -> int:
    from dspark_jax import load_drafter, load_target
    from dspark_jax.evaluation import suite
    from dspark_jax.prompts import load_benchmark

    benches = [b.strip() for b in args.bench.split(",") if b.strip()]
    for bench in benches:
        load_benchmark(bench, args.data_dir, 1)  # fail early on names and files
    labels = _drafter_labels(args)
    if args.report_only:
        report = suite.write_report(args.output, labels, benches)
    else:
        target = load_target(args.model, dtype=_dtype(args.dtype))
        drafters = {label: load_drafter(path, target) for label, path in zip(labels, args.drafter)}
        report = suite.evaluate(target, drafters, benches, args.output, data_dir=args.data_dir,
                                limit=args.limit, max_new_tokens=args.max_new_tokens,
                                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                batch_size=args.batch_size, max_batch_tokens=args.max_batch_tokens)
    print(suite.markdown_table(report))
    print(f"report: {Path(args.output) / 'report.json'}")
    return 0


def cmd_calibrate(args) -> int:
    from dspark_jax.evaluation import AcceptanceTrace, calibrate, concatenate_traces
    from dspark_jax.evaluation.calibration import save_calibration

    trace = concatenate_traces([AcceptanceTrace.load(p) for p in args.traces])
    temperatures, fit = calibrate(trace, fit_fraction=args.fit_fraction, seed=args.seed,
                                  min_survivors=args.min_survivors)
    fit["traces"] = [str(p) for p in args.traces]
    path = save_calibration(args.drafter, temperatures, fit)
    held = fit["heldout"]
    print(f"temperatures: {', '.join(f'{t:.3f}' for t in temperatures)}")
    for when in ("before", "after"):
        m = held[when]
        print(f"{when:>6} (held-out {fit['heldout_rounds']} rounds): ECE {m['ece_mean']:.4f}  "
              f"AUROC {m['auroc_mean']:.4f}  Brier {m['brier_mean']:.4f}")
    print(f"wrote {path}")
    return 0


def cmd_draft_vocab(args) -> int:
    from dspark_jax.checkpoints.draft_vocab_file import save_draft_vocab
    from dspark_jax.training.data import answer_token_counts, most_frequent

    counts = answer_token_counts(args.data)
    ids = most_frequent(counts, args.size)
    source = dict(data=[str(d) for d in args.data], size=args.size,
                  answer_tokens=int(counts.sum()), distinct_tokens=int((counts > 0).sum()),
                  coverage=float(counts[ids].sum() / max(counts.sum(), 1)))
    if args.heldout:
        held = answer_token_counts(args.heldout)
        source.update(heldout=[str(d) for d in args.heldout],
                      heldout_coverage=float(held[ids].sum() / max(held.sum(), 1)))
    path = save_draft_vocab(args.drafter, ids, source)
    print(f"{args.size} of {counts.size} tokens ({source['distinct_tokens']} distinct among "
          f"{source['answer_tokens']} answer tokens): they cover {source['coverage']:.2%} of the "
          "data's answer tokens" + (f", {source['heldout_coverage']:.2%} of the held-out's"
                                    if args.heldout else ""))
    print(f"wrote {path}")
    return 0


def cmd_convert(args) -> int:
    from dspark_jax import load_drafter, load_target

    if args.drafter:
        if args.to not in ("deepspec", "dflash", "orbax"):
            raise ValueError(f"a drafter converts to deepspec, dflash or orbax, not {args.to!r}")
        from dspark_jax import storage

        target = load_target(args.model)
        drafter = load_drafter(args.drafter, target)
        # A folder's recorded training setting (anchors per sequence) carries over.
        source = storage.as_path(args.drafter) / "config.json"
        recorded = json.loads(source.read_text()) if source.exists() else {}
        path = drafter.save(args.output, layout=args.to, dtype=_dtype(args.dtype),
                            target_tensors=not args.compact,
                            num_anchors=recorded.get("num_anchors"))
        print(f"wrote {args.to} drafter to {path}")
        return 0
    if args.to not in ("hf", "orbax", "gguf"):
        raise ValueError(f"a model converts to hf, orbax or gguf, not {args.to!r}")
    target = load_target(args.model, dtype=_dtype(args.dtype))
    save = {"hf": target.save_hf, "orbax": target.save_orbax, "gguf": target.save_gguf}[args.to]
    path = save(args.output)
    print(f"wrote {args.to} checkpoint of {target.name} to {path}")
    return 0


def cmd_prepare_data(args) -> int:
    from dspark_jax import load_target
    from dspark_jax.training.data import prepare_data

    target = load_target(args.model, dtype=_dtype(args.dtype))
    manifest = prepare_data(target, args.prompts, args.output, max_samples=args.max_samples,
                            first_prompt=args.first_prompt,
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            max_length=args.max_length, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            min_loss_tokens=args.min_loss_tokens, shard_size=args.shard_size,
                            select=args.select, weight_dtype=args.weight_dtype)
    print(f"{manifest['num_samples']} samples ({manifest['num_loss_tokens']} loss tokens) in "
          f"{len(manifest['files'])} shard(s) under {args.output}; dropped {manifest['dropped']}")
    return 0


def cmd_prepare_features(args) -> int:
    import jax

    from dspark_jax import sharding
    from dspark_jax.experiment import load_config
    from dspark_jax.target import load_target
    from dspark_jax.training.features import config_tap_layer_ids, extract_features
    from dspark_jax.training.trainer import compute_dtype

    config = load_config(args.config)
    if args.target:
        config.target = args.target
    if not config.target:
        raise ValueError(f"{args.config} names no target: pass --target PATH (a local Hugging "
                         "Face folder, .gguf file or Orbax folder)")
    with jax.set_mesh(sharding.make_mesh(tuple(config.train.mesh_shape))):
        target = load_target(config.target, dtype=compute_dtype(config.train))
        taps = config_tap_layer_ids(config, target)
        manifest = extract_features(target, args.data, args.output, taps, dtype=args.dtype,
                                    batch_size=args.batch_size)
    print(f"features of {manifest['num_samples']} samples ({manifest['num_tokens']} tokens, taps "
          f"{list(taps)}, {args.dtype}) in {len(manifest['files'])} file(s) under {args.output}; "
          f"train with --train.feature_dir=\"('{args.output}',)\"")
    return 0


def cmd_train(args, overrides) -> int:
    import jax

    if args.coordinator or args.distributed:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts (tests)
        if args.coordinator:
            jax.distributed.initialize(args.coordinator, num_processes=args.num_processes,
                                       process_id=args.process_id)
        else:
            jax.distributed.initialize()
    from dspark_jax.experiment import apply_overrides, check_runnable, load_config
    from dspark_jax.training.trainer import train

    config = load_config(args.config)
    apply_overrides(config, overrides)
    check_runnable(config, args.config)  # required fields, target and data folders
    workdir = args.workdir or f"runs/{Path(args.config).stem}"
    drafter = train(config, workdir)
    print(f"trained {drafter}; checkpoints and metrics in {workdir}, drafter in {workdir}/drafter")
    return 0


def _csv(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _serving_models(args):
    from dspark_jax import init_drafter, load_drafter, load_target

    if not args.drafter:
        raise ValueError("--drafter is required (a drafter folder or packaged name, or 'init')")
    target = load_target(args.model, dtype=_dtype(args.dtype))
    drafter = (init_drafter(target, seed=args.seed) if args.drafter == "init"
               else load_drafter(args.drafter, target))
    return target, drafter


def cmd_profile_sps(args) -> int:
    from dspark_jax.engine import Engine
    from dspark_jax.evaluation.figures import plot_sps_profile
    from dspark_jax.scheduling import sps

    target, drafter = _serving_models(args)
    buckets = [int(b) for b in _csv(args.buckets)] if args.buckets else None
    engine = Engine(target, drafter, slots=args.slots, max_len=args.max_len, buckets=buckets,
                    weight_dtype=args.weight_dtype, draft_weight_dtype=args.draft_weight_dtype)
    profile = engine.profile_sps(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                 repeats=args.repeats, warmup=args.warmup, refresh=args.refresh)
    path = sps.cache_file(profile.key)
    plot = plot_sps_profile(profile, args.plot or path.with_suffix(".png"))
    for tokens, seconds in zip(profile.grid, profile.seconds):
        print(f"B = {tokens:5d} tokens: {1 / seconds:9.1f} steps/s ({1000 * seconds:.2f} ms)")
    print(f"profile: {path}\nplot: {plot}")
    return 0


def _serve_bench_url(args) -> int:
    from dspark_jax.serving import http_load

    model = http_load.server_model(args.url)
    texts = http_load.eval_texts(_csv(args.datasets), args.prompts,
                                 max_chars=4 * args.max_prompt_len, data_dir=args.data_dir)
    results = []
    for concurrency in (int(c) for c in _csv(args.concurrency)):
        results.append(http_load.closed_loop(
            args.url, model, texts, concurrency=concurrency, max_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p,
            request_timeout_s=args.request_timeout, run_timeout_s=args.run_timeout))
        print(http_load.markdown_table(results[-1:]).splitlines()[-1], file=sys.stderr)
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    report = dict(url=args.url, model=model, datasets=_csv(args.datasets),
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_p=args.top_p, results=results)
    (output / "serve_bench_http.json").write_text(json.dumps(report, indent=1))
    table = http_load.markdown_table(results)
    (output / "serve_bench_http.md").write_text(table + "\n")
    print(table)
    print(f"json: {output / 'serve_bench_http.json'}")
    return 0 if all(r["failed"] == r["not_sent"] == 0 for r in results) else 1


def cmd_serve_bench(args) -> int:
    from dspark_jax.serving import bench, loadgen

    if args.url:
        return _serve_bench_url(args)
    target, drafter = _serving_models(args)
    datasets = _csv(args.datasets)
    prompts = loadgen.eval_prompts(target.tokenizer, datasets, args.prompts,
                                   max_prompt_len=args.max_prompt_len, data_dir=args.data_dir)
    result = bench.serve_bench(
        target, drafter, prompts, policies=_csv(args.policies),
        concurrency=[int(c) for c in _csv(args.concurrency)], max_new_tokens=args.max_new_tokens,
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        buckets=[int(b) for b in _csv(args.buckets)] if args.buckets else None,
        repeats=args.repeats, sps_repeats=args.sps_repeats, sps_warmup=args.sps_warmup,
        refresh_sps=args.refresh_sps, weight_dtype=args.weight_dtype,
        draft_weight_dtype=args.draft_weight_dtype)
    result["config"].update(model=args.model, drafter=args.drafter, datasets=datasets)
    paths = bench.write_report(result, args.output)
    print(bench.markdown_table(result))
    print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))
    return 0


def _load_sps_file(path_text: str) -> list:
    path = Path(path_text)
    if not path.is_file():
        raise ValueError(f"--sps {path_text}: no such file (a profile-sps JSON, or 'auto')")
    data = json.loads(path.read_text())
    if isinstance(data, dict) and "samples" in data:  # a profile: its table from its samples
        from dspark_jax.scheduling.sps import SPSProfile

        return SPSProfile.from_json(data).table().tolist()
    table = data.get("table") if isinstance(data, dict) else data
    if not isinstance(table, list) or not table:
        raise ValueError(f"--sps {path_text}: expected a profile-sps JSON (with 'table') or a "
                         "JSON list of steps/s by forward tokens")
    return table


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ValueError("the server needs its extra: pip install 'dspark-jax[serve]'") from None

    from dspark_jax import init_drafter, load_drafter, load_target
    from dspark_jax.engine import Engine
    from dspark_jax.serving.server import build_app
    from dspark_jax.serving.worker import EngineWorker

    if args.max_slots < 1 or args.max_queue < 1:
        raise ValueError("--max-slots and --max-queue must be >= 1")
    target = load_target(args.model, dtype=_dtype(args.dtype))
    if target.tokenizer is None:
        raise ValueError(f"{args.model}: the server needs the model's tokenizer, and this model "
                         "has none")
    drafter = None
    if args.drafter == "init":
        drafter = init_drafter(target, seed=args.seed)
    elif args.drafter:
        drafter = load_drafter(args.drafter, target)
    engine = Engine(target, drafter, slots=args.max_slots, max_len=args.max_len, seed=args.seed,
                    weight_dtype=args.weight_dtype, draft_weight_dtype=args.draft_weight_dtype)
    if drafter is not None:
        params = _verify_params(args)
        if args.verify in ("prefix", "production") and args.sps == "auto":
            print("--sps auto: this machine's steps/s of the serving engine at temperature 1 "
                  "(measured once, then cached)", file=sys.stderr)
            params["sps"] = engine.profile_sps(temperature=1.0).table()
        elif args.verify in ("prefix", "production"):
            params["sps"] = _load_sps_file(args.sps)
        engine.set_policy(args.verify, params)
    print(f"compiling ({args.max_slots} slots of {args.max_len} tokens)...", file=sys.stderr)
    engine.compile(min(args.precompile_prompt_len, args.max_len - 1))
    worker = EngineWorker(engine, max_queue=args.max_queue)
    name = args.served_model_name or args.model
    app = build_app(worker, model_name=name, tokenizer=target.tokenizer)
    print(f"serving {name!r} at http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        worker.close()
    return 0


def weight_dtype_args(parser: argparse.ArgumentParser) -> None:
    """--weight-dtype and --draft-weight-dtype of the commands that build an Engine."""
    parser.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, help=WEIGHT_DTYPE_HELP)
    parser.add_argument("--draft-weight-dtype", choices=WEIGHT_DTYPES,
                        help=DRAFT_WEIGHT_DTYPE_HELP)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark-jax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="answer prompts with the target model")
    gen.add_argument("--model", default="smollm2-135m-instruct",
                     help="registered name, Hugging Face folder, .gguf file or Orbax folder")
    gen.add_argument("--prompt", action="append", help="a user message (repeat for a batch)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--dtype", choices=DTYPES, default="auto")
    weight_dtype_args(gen)
    gen.add_argument("--drafter", help="drafter folder (DeepSpec, z-lab DFlash or Orbax layout) "
                     "for speculative decoding, or 'init' for an untrained one")
    gen.add_argument("--verify", default="full",
                     choices=("full", "fixed", "threshold", "prefix", "production"),
                     help="verification policy (with --drafter)")
    gen.add_argument("--threshold", type=float, help="confidence threshold (--verify threshold)")
    gen.add_argument("--gamma", type=int, help="drafts verified per round (--verify fixed)")
    gen.add_argument("--sps", help="steps/s table of --verify prefix/production: a profile-sps "
                     "JSON, or 'auto' for this machine's profile (measured once, cached); "
                     "without one they verify like 'full' (and say so)")
    gen.set_defaults(func=cmd_generate)

    demo = sub.add_parser("demo", help="speculative vs autoregressive decoding on the embedded "
                          "default model with its packaged DSpark drafter: answers, tau, speedup")
    demo.add_argument("--model", default="smollm2-135m-instruct")
    demo.add_argument("--drafter", default="dspark-smollm2-135m-campaign",
                      help="drafter folder or packaged drafter name")
    demo.add_argument("--prompt", action="append", help="a user message (repeat for several)")
    demo.add_argument("--max-new-tokens", type=int, default=128)
    demo.add_argument("--repeats", type=int, default=2,
                      help="decodes of each prompt per way; each way keeps its fastest time")
    demo.add_argument("--weight-dtype", choices=WEIGHT_DTYPES,
                      help=WEIGHT_DTYPE_HELP + "; greedy outputs may then part at a near-tie, "
                      "which the demo reports as a failure")
    demo.add_argument("--draft-weight-dtype", choices=("float32",) + WEIGHT_DTYPES,
                      default="bfloat16", help=DRAFT_WEIGHT_DTYPE_HELP + " (default bfloat16)")
    demo.set_defaults(func=cmd_demo)

    ev = sub.add_parser("eval", help="tau and acceptance of drafters on the benchmark prompts")
    ev.add_argument("--model", default="smollm2-135m-instruct")
    ev.add_argument("--drafter", action="append", required=True,
                    help="drafter folder or packaged name (repeat: one table row each)")
    ev.add_argument("--label", action="append", help="row label per --drafter (default: folder name)")
    ev.add_argument("--bench", default="gsm8k,humaneval,mt-bench",
                    help="comma-separated: gsm8k, math500, aime25, humaneval, mbpp, "
                    "livecodebench, mt-bench, alpaca, arena-hard-v2")
    ev.add_argument("--data-dir", help="folder of the benchmark JSONL files "
                    "(default ../shared/data/eval)")
    ev.add_argument("--limit", type=int, help="first N prompts of each benchmark (after the cap)")
    ev.add_argument("--output", required=True, help="report folder (resumable per benchmark)")
    ev.add_argument("--max-new-tokens", type=int, default=256)
    ev.add_argument("--temperature", type=float, default=0.0)
    ev.add_argument("--top-p", type=float, default=1.0)
    ev.add_argument("--top-k", type=int, default=0)
    ev.add_argument("--batch-size", type=int, default=8)
    ev.add_argument("--max-batch-tokens", type=int,
                    help="sort prompts by length and cap each batch at this many padded prompt "
                    "tokens (for long-prompt sets; default: batches of --batch-size in order)")
    ev.add_argument("--report-only", action="store_true",
                    help="only rewrite report.json/.md from the finished results of --bench")
    ev.add_argument("--dtype", choices=DTYPES, default="auto")
    ev.set_defaults(func=cmd_eval)

    cal = sub.add_parser("calibrate", help="fit STS confidence temperatures from eval traces")
    cal.add_argument("--drafter", required=True, help="drafter folder: calibration.json goes here")
    cal.add_argument("--traces", nargs="+", required=True,
                     help="trace files written by `dspark-jax eval` (<output>/<label>/*.npz)")
    cal.add_argument("--fit-fraction", type=float, default=0.5,
                     help="share of the requests used to fit; the rest reports before/after")
    cal.add_argument("--seed", type=int, default=0)
    cal.add_argument("--min-survivors", type=int, default=30,
                     help="a position with fewer surviving rounds in the fit split keeps T = 1")
    cal.set_defaults(func=cmd_calibrate)

    dv = sub.add_parser("draft-vocab", help="restrict a drafter's proposals to the most frequent "
                        "answer tokens of its training data (a cheaper draft step, still exact)")
    dv.add_argument("--drafter", required=True, help="drafter folder: draft_vocab.json goes here "
                    "(delete it to draft from the whole vocabulary again)")
    dv.add_argument("--data", nargs="+", required=True,
                    help="prepared training data folders (`prepare-data`; never eval sets)")
    dv.add_argument("--size", type=int, required=True, help="V', the tokens the drafter may propose")
    dv.add_argument("--heldout", nargs="+", default=[],
                    help="prepared held-out folders: also report the share of their answer "
                         "tokens the draft vocabulary covers")
    dv.set_defaults(func=cmd_draft_vocab)

    prep = sub.add_parser("prepare-data", help="regenerate answers with the target (resumable)")
    prep.add_argument("--model", default="smollm2-135m-instruct")
    prep.add_argument("--prompts", nargs="+", required=True,
                      help="prompt JSONL files ({'turns': [...]} or {'prompt': ...}); never eval sets")
    prep.add_argument("--output", required=True, help="folder for shards + manifest.json")
    prep.add_argument("--max-samples", type=int, help="number of prompts to use (default: all)")
    prep.add_argument("--first-prompt", type=int, default=0,
                      help="skip the prompts before this index (held-out splits)")
    prep.add_argument("--batch-size", type=int, default=8)
    prep.add_argument("--max-new-tokens", type=int, default=512)
    prep.add_argument("--max-length", type=int, default=4096)
    prep.add_argument("--temperature", type=float, default=0.7)
    prep.add_argument("--top-p", type=float, default=0.8)
    prep.add_argument("--top-k", type=int, default=20)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--min-loss-tokens", type=int, default=14)
    prep.add_argument("--shard-size", type=int, default=1024, help="prompts per shard")
    prep.add_argument("--select", choices=("code", "chat"),
                      help="only the prompts that ask for code, or only the others")
    prep.add_argument("--dtype", choices=DTYPES, default="auto")
    prep.add_argument("--weight-dtype", choices=WEIGHT_DTYPES, help=WEIGHT_DTYPE_HELP)
    prep.set_defaults(func=cmd_prepare_data)

    feat = sub.add_parser("prepare-features",
                          help="cache the target's features of a data folder (resumable)")
    feat.add_argument("--config", required=True,
                      help="experiment config file (configs/*.py): its target and drafter taps")
    feat.add_argument("--target", help="the target (local folder, .gguf or Orbax folder), for "
                      "configs that leave it to the user (configs/*qwen3*.py)")
    feat.add_argument("--data", required=True, help="folder written by prepare-data")
    feat.add_argument("--output", required=True, help="folder for feature files + manifest.json")
    feat.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                      help="storage dtype (bfloat16/float16: half the disk, rounded features)")
    feat.add_argument("--batch-size", type=int, default=8, help="samples per target call")
    feat.set_defaults(func=cmd_prepare_features)

    tr = sub.add_parser("train", help="train a drafter (resumes from the workdir's checkpoints)",
                        description="Extra arguments are config overrides: --train.max_steps=100")
    tr.add_argument("--config", required=True, help="experiment config file (configs/*.py)")
    tr.add_argument("--workdir", help="checkpoints, metrics.jsonl, drafter (default runs/<config>)")
    tr.add_argument("--distributed", action="store_true",
                    help="jax.distributed.initialize() with the platform's auto-detection (TPU pods)")
    tr.add_argument("--coordinator", help="host:port of process 0 (multi-host GPU or CPU)")
    tr.add_argument("--num-processes", type=int, default=1)
    tr.add_argument("--process-id", type=int, default=0)
    tr.set_defaults(func=cmd_train)

    conv = sub.add_parser("convert", help="convert models between GGUF, HF folder and Orbax, "
                          "or drafters between the DeepSpec, z-lab DFlash and Orbax layouts")
    conv.add_argument("--model", default="smollm2-135m-instruct",
                      help="registered name, Hugging Face folder, .gguf file or Orbax folder "
                      "(with --drafter: its target)")
    conv.add_argument("--drafter", help="convert this drafter folder instead of the model")
    conv.add_argument("--to", choices=("hf", "orbax", "gguf", "deepspec", "dflash"),
                      required=True)
    conv.add_argument("--output", required=True,
                      help="folder (hf, orbax, deepspec, dflash) or .gguf file to write, "
                      "replaced atomically")
    conv.add_argument("--dtype", choices=DTYPES, default="auto")
    conv.add_argument("--compact", action="store_true",
                      help="deepspec drafter without copies of the target's embedding and LM "
                      "head (dspark-jax reads those from the target)")
    conv.set_defaults(func=cmd_convert)

    def serving_args(p):
        p.add_argument("--model", default="smollm2-135m-instruct",
                       help="registered name, Hugging Face folder, .gguf file or Orbax folder")
        p.add_argument("--drafter",
                       help="drafter folder or packaged name, or 'init' for an untrained one "
                       "(required, except for serve-bench --url)")
        p.add_argument("--buckets", help="flat verify token counts, comma-separated "
                       "(default: powers of two up to slots * (P + 1))")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--dtype", choices=DTYPES, default="auto")
        weight_dtype_args(p)

    prof = sub.add_parser("profile-sps", help="measure the serving engine's steps/s by forward "
                          "tokens (cached; table for the prefix/production schedulers) + plot")
    serving_args(prof)
    prof.add_argument("--slots", type=int, default=16, help="concurrent requests of the engine")
    prof.add_argument("--max-len", type=int, default=2048, help="cache slots per request")
    prof.add_argument("--repeats", type=int, default=10, help="timed steps per bucket (median)")
    prof.add_argument("--warmup", type=int, default=3, help="untimed steps per bucket first")
    prof.add_argument("--temperature", type=float, default=1.0,
                      help="sampling of the profiled steps (0: greedy, cheaper); match the load")
    prof.add_argument("--top-p", type=float, default=1.0)
    prof.add_argument("--top-k", type=int, default=0)
    prof.add_argument("--refresh", action="store_true", help="measure again despite the cache")
    prof.add_argument("--plot", help="PNG path (default: beside the cached JSON)")
    prof.set_defaults(func=cmd_profile_sps)

    srv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (completions, chat "
                         "completions, streaming, /metrics) on the engine")
    srv.add_argument("--model", default="smollm2-135m-instruct",
                     help="registered name, Hugging Face folder, .gguf file or Orbax folder")
    srv.add_argument("--drafter", help="drafter folder or packaged name for speculative "
                     "decoding, or 'init' for an untrained one (default: autoregressive)")
    srv.add_argument("--verify", default="production",
                     choices=("full", "fixed", "threshold", "prefix", "production"),
                     help="verification policy (with --drafter)")
    srv.add_argument("--sps", default="auto", help="steps/s table of --verify prefix/production: "
                     "a profile-sps JSON, or 'auto' (this engine's profile, measured once, cached)")
    srv.add_argument("--threshold", type=float, help="confidence threshold (--verify threshold)")
    srv.add_argument("--gamma", type=int, help="drafts verified per round (--verify fixed)")
    srv.add_argument("--host", default="127.0.0.1")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--max-slots", type=int, default=8, help="requests decoded together")
    srv.add_argument("--max-queue", type=int, default=64,
                     help="requests that may wait for a slot; more are answered 429")
    srv.add_argument("--max-len", type=int, default=2048,
                     help="context per request: prompt + generated tokens")
    srv.add_argument("--precompile-prompt-len", type=int, default=256,
                     help="compile the admissions of prompts up to this length at start")
    srv.add_argument("--served-model-name", help="the model name clients send (default --model)")
    srv.add_argument("--seed", type=int, default=0)
    srv.add_argument("--dtype", choices=DTYPES, default="auto")
    weight_dtype_args(srv)
    srv.add_argument("--log-level", default="info",
                     choices=("critical", "error", "warning", "info", "debug"))
    srv.set_defaults(func=cmd_serve)

    sb = sub.add_parser("serve-bench", help="continuous-batching throughput and verification "
                        "proposal length against concurrency, per policy (closed-loop eval prompts)")
    serving_args(sb)
    sb.add_argument("--policies", default="prefix,production,fixed1,fixed-best,full",
                    help="comma-separated: full, prefix, production, fixed<G>, fixed-best, "
                    "threshold<T>")
    sb.add_argument("--concurrency", default="1,4,16,64", help="comma-separated user counts")
    sb.add_argument("--prompts", type=int, default=64, help="prompts replayed per run")
    sb.add_argument("--max-new-tokens", type=int, default=256)
    sb.add_argument("--max-prompt-len", type=int, default=512, help="longer prompts are skipped")
    sb.add_argument("--datasets", default="gsm8k,humaneval,mt-bench",
                    help="comma-separated eval sets, interleaved")
    sb.add_argument("--data-dir",
                    help="folder of the eval JSONL files (default ../shared/data/eval)")
    sb.add_argument("--temperature", type=float, default=1.0)
    sb.add_argument("--top-p", type=float, default=1.0)
    sb.add_argument("--top-k", type=int, default=0)
    sb.add_argument("--repeats", type=int, default=1,
                    help="runs per policy and concurrency, round-robin; the median is reported")
    sb.add_argument("--sps-repeats", type=int, default=10)
    sb.add_argument("--sps-warmup", type=int, default=3)
    sb.add_argument("--refresh-sps", action="store_true")
    sb.add_argument("--output", default="benchmarks/results/serve_bench",
                    help="folder for serve_bench.json, .md and .png")
    sb.add_argument("--url", help="drive a running server (dspark-jax serve, or any OpenAI "
                    "server) over HTTP instead: streaming chat completions, closed loop; "
                    "its policy is the server's (--policies is not used); exit 1 if any request "
                    "fails")
    sb.add_argument("--request-timeout", type=float, default=600.0,
                    help="--url: seconds one request may take")
    sb.add_argument("--run-timeout", type=float, default=3600.0,
                    help="--url: no request starts after this many seconds of a run")
    sb.set_defaults(func=cmd_serve_bench)
    return parser


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command != "train":
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if args.command == "train" else args.func(args)
    except USER_ERRORS as e:  # bad input: a clear message, no traceback
        print(f"dspark-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
