"""The ``dspark-jax`` command: thin wrappers that parse, call the library and print."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "auto": None}


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


def cmd_generate(args) -> int:
    from dspark_jax import generate, init_drafter, load_drafter, load_target

    target = load_target(args.model, dtype=_dtype(args.dtype))
    drafter = None
    if args.drafter == "init":
        drafter = init_drafter(target, seed=args.seed)
    elif args.drafter:
        drafter = load_drafter(args.drafter, target)
    prompts = args.prompt or ["Explain speculative decoding in two sentences."]
    results = generate(target, prompts, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       seed=args.seed, drafter=drafter, verify=args.verify,
                       verify_params=_verify_params(args))
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


def cmd_convert(args) -> int:
    from dspark_jax import load_target

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
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            max_length=args.max_length, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            min_loss_tokens=args.min_loss_tokens, shard_size=args.shard_size)
    print(f"{manifest['num_samples']} samples ({manifest['num_loss_tokens']} loss tokens) in "
          f"{len(manifest['files'])} shard(s) under {args.output}; dropped {manifest['dropped']}")
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
    from dspark_jax.experiment import apply_overrides, load_config
    from dspark_jax.training.trainer import train

    config = load_config(args.config)
    apply_overrides(config, overrides)
    workdir = args.workdir or f"runs/{Path(args.config).stem}"
    drafter = train(config, workdir)
    print(f"trained {drafter}; checkpoints and metrics in {workdir}, drafter in {workdir}/drafter")
    return 0


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
    gen.add_argument("--drafter", help="drafter folder (DeepSpec, z-lab DFlash or Orbax layout) "
                     "for speculative decoding, or 'init' for an untrained one")
    gen.add_argument("--verify", default="full",
                     choices=("full", "fixed", "threshold", "prefix", "production"),
                     help="verification policy (with --drafter)")
    gen.add_argument("--threshold", type=float, help="confidence threshold (--verify threshold)")
    gen.add_argument("--gamma", type=int, help="drafts verified per round (--verify fixed)")
    gen.set_defaults(func=cmd_generate)

    prep = sub.add_parser("prepare-data", help="regenerate answers with the target (resumable)")
    prep.add_argument("--model", default="smollm2-135m-instruct")
    prep.add_argument("--prompts", nargs="+", required=True,
                      help="prompt JSONL files ({'turns': [...]} or {'prompt': ...}); never eval sets")
    prep.add_argument("--output", required=True, help="folder for shards + manifest.json")
    prep.add_argument("--max-samples", type=int, help="number of prompts to use (default: all)")
    prep.add_argument("--batch-size", type=int, default=8)
    prep.add_argument("--max-new-tokens", type=int, default=512)
    prep.add_argument("--max-length", type=int, default=4096)
    prep.add_argument("--temperature", type=float, default=0.7)
    prep.add_argument("--top-p", type=float, default=0.8)
    prep.add_argument("--top-k", type=int, default=20)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--min-loss-tokens", type=int, default=14)
    prep.add_argument("--shard-size", type=int, default=1024, help="prompts per shard")
    prep.add_argument("--dtype", choices=DTYPES, default="auto")
    prep.set_defaults(func=cmd_prepare_data)

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

    conv = sub.add_parser("convert", help="convert between GGUF, HF folder and Orbax")
    conv.add_argument("--model", required=True,
                      help="registered name, Hugging Face folder, .gguf file or Orbax folder")
    conv.add_argument("--to", choices=("hf", "orbax", "gguf"), required=True)
    conv.add_argument("--output", required=True,
                      help="folder (hf, orbax) or .gguf file to write, replaced atomically")
    conv.add_argument("--dtype", choices=DTYPES, default="auto")
    conv.set_defaults(func=cmd_convert)
    return parser


def main(argv=None) -> int:
    args, extra = build_parser().parse_known_args(argv)
    if extra and args.command != "train":
        build_parser().error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.func(args, extra) if args.command == "train" else args.func(args)
    except (ValueError, TypeError) as e:  # bad input: a clear message, no traceback
        print(f"dspark-jax {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
