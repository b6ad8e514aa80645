"""Train a drafter on several GPU hosts reachable over ssh: copy, install, train on every host.

Host 0 is the coordinator; each host runs ``dspark-jax train`` with
``--coordinator HOST0:PORT --num-processes N --process-id i``, which call
``jax.distributed.initialize`` before anything touches a device.

    python launch/gpu_multihost.py --hosts gpu0,gpu1 --config configs/dspark_qwen3_4b.py \
        [--port 1234] [--dry-run] [--remote-paths] -- \
        --target=/models/Qwen3-4B --train.data_dir="('/data/qwen3',)" [--train.max_steps=100 ...]

``--dry-run`` prints the rsync/ssh commands without running them. Everything after ``--`` is
passed to ``dspark-jax train`` as config overrides.
Before any command runs, the config is loaded with the overrides and checked: the target
(``--target=``, a local Hugging Face folder, .gguf file or Orbax folder) and the data folders
(``--train.data_dir=``, each with the manifest.json of ``dspark-jax prepare-data``) are
required and must exist on this machine under the paths the hosts see (a shared or mounted
filesystem; relative paths start at the project root); ``--remote-paths`` checks only that
they are given. Object-store URIs (``gs://``, ``s3://``) are passed through unchecked; give
``--workdir`` one the hosts share, so that they write one set of checkpoints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (ROOT, REPO_DIR, add_run_args, check_config, install_command,  # noqa: E402
                    run, split_overrides, train_command)


def main(argv=None) -> int:
    argv, overrides = split_overrides(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", required=True, help="comma-separated ssh hosts; the first coordinates")
    p.add_argument("--port", type=int, default=1234, help="coordinator port")
    p.add_argument("--config", required=True, help="config file, relative to the project root")
    p.add_argument("--cuda-extra", default="jax[cuda12]", help="pip spec of JAX for the GPUs")
    p.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    add_run_args(p)
    args = p.parse_args(argv)
    check_config(args.config, overrides, args.remote_paths, args.workdir,
                 hosts=len([h for h in args.hosts.split(",") if h]))

    hosts = [h for h in args.hosts.split(",") if h]
    coordinator = f"{hosts[0].split('@')[-1]}:{args.port}"
    for host in hosts:
        run(["rsync", "-a", "--exclude", ".git", "--exclude", ".venv", f"{ROOT}/",
             f"{host}:{REPO_DIR}/"], args.dry_run)
        run(["ssh", host, install_command(args.cuda_extra)], args.dry_run)
    for i, host in enumerate(hosts):
        distributed = (f"--coordinator {coordinator} --num-processes {len(hosts)} "
                       f"--process-id {i}")
        # every host but the last runs in the background; the last one holds the terminal
        run(["ssh", host, train_command(args.config, overrides, distributed, args.workdir)], args.dry_run,
            background=i < len(hosts) - 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
