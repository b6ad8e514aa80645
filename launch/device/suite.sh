#!/usr/bin/env bash
# The accelerator benchmark suite (issue 17) on a lent NVIDIA H200, as one device `run`.
#
# Prepare here, once (the device machine has JAX, flax, optax, orbax and transformers, and no
# network; ml-collections travels as a wheel):
#
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .whl ml-collections==1.1.0
#
# The working tree that travels must stay under 64 MiB: the tracked files are about 79 MB, so
# untrack the comparison pair for the run (it stays on disk; `git add` it back afterwards; the
# suite loads only the campaign drafter, and that only with --smollm2):
#
#   git rm -r -q --cached dspark_jax/assets/dspark-smollm2-135m dspark_jax/assets/dflash-smollm2-135m
#   printf '%s\n' /dspark_jax/assets/dspark-smollm2-135m/ /dspark_jax/assets/dflash-smollm2-135m/ \
#       >> .git/info/exclude
#
# Then the device run (carry: [".whl"], timeout_s 600), from the repository root:
#
#   bash launch/device/suite.sh
#
# It writes $OUT/device_suite.json (and the log $OUT/device_suite.log) section by section, so a
# run cut short still returns what it finished. Record the JSON's numbers in BENCHMARKS.md with
# the machine and date.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/device_suite.log"
python3 benchmarks/device_suite.py --output "$OUT/device_suite.json" "$@" 2>&1 | tee -a "$OUT/device_suite.log"
