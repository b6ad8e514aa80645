"""The training loop: data, sharded steps, metrics, Orbax checkpoints, resume, export.

``train(config, workdir)`` trains ``config.drafter`` for ``config.target`` on the folders of
``config.train.data_dir`` (with the target features of ``config.train.feature_dir`` when it
names feature caches, one per data folder: ``dspark-jax prepare-features``). Every host runs the same loop on its slice of the data
(``jax.process_index()``); batches are assembled into global arrays over the mesh.

Checkpoints (orbax CheckpointManager under ``workdir/checkpoints``, asynchronous, atomic,
keep-last-N) hold the train state (step, fp32 parameters, optimizer state) and the data
iterator's state; the step itself draws no random numbers (anchors are sampled by the data
pipeline from seeded per-record generators), so restoring both continues the run exactly. The
state is restored with the shardings of the current mesh, so a run can resume on another mesh.
Metrics go to ``workdir/metrics.jsonl`` (and TensorBoard when ``tensorboardX`` is installed);
the trained drafter is exported in the DeepSpec layout to ``workdir/drafter``.
"""

from __future__ import annotations

import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from tqdm.auto import tqdm

from dspark_jax import sharding, storage
from dspark_jax.drafter import Drafter, init_drafter, load_drafter
from dspark_jax.target import load_target
from dspark_jax.training import recipe, step as train_step
from dspark_jax.training.features import cache_key
from dspark_jax.training.heldout import HeldOut
from dspark_jax.training.pipeline import batches_per_epoch, make_pipeline


COMPUTE_DTYPES = ("float32", "bfloat16")


def compute_dtype(train_cfg) -> jnp.dtype:
    """The forward dtype of training and feature extraction, ``train.compute_dtype``: "" the
    backend's (float32 on CPU, bfloat16 on accelerators), or "float32" / "bfloat16" (e.g.
    bfloat16 on a CPU with AMX, where its matmuls run about twice as fast; BENCHMARKS.md).
    Master weights, softmaxes and losses stay float32 either way."""
    name = train_cfg.get("compute_dtype", "")
    if name == "":
        return jnp.dtype(jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"train.compute_dtype {name!r}: choose \"\" (the backend's) or one of "
                         f"{', '.join(COMPUTE_DTYPES)}")
    return jnp.dtype(name)


def _folders(train_cfg, field: str) -> list[str]:
    """A train-config folder field (a path or a tuple of them) as a list ([] when unset)."""
    dirs = train_cfg.get(field, ())
    return [dirs] if isinstance(dirs, str) else list(dirs)


def _data_dirs(train_cfg) -> list[str]:
    dirs = _folders(train_cfg, "data_dir")
    if not dirs:
        raise ValueError("config.train.data_dir is empty: run `dspark-jax prepare-data` first")
    return dirs


def _feature_dirs(train_cfg) -> list[str] | None:
    """The feature caches of ``train_cfg.feature_dir``, or None when it names none."""
    return _folders(train_cfg, "feature_dir") or None


def _packing(train_cfg, drafter_config) -> dict:
    """This host's ``make_pipeline`` settings, without the data and feature folders."""
    hosts = jax.process_count()
    return dict(batch_size=train_cfg.global_batch_size // hosts,
                pack_length=train_cfg.pack_length, anchors_per_row=train_cfg.anchors_per_row,
                anchors_per_sequence=train_cfg.num_anchors,
                block_size=drafter_config.block_size, seed=train_cfg.seed,
                shard_index=jax.process_index(), shard_count=hosts)


def _max_over_hosts(value: int) -> int:
    """The largest of every host's ``value`` (a collective: all hosts call it)."""
    if jax.process_count() == 1:
        return value
    return int(np.max(multihost_utils.process_allgather(np.int64(value))))


def total_steps(train_cfg, drafter_config) -> int:
    """max_steps when it is > 0, else epochs x the global batches of one pass over the data.

    A pass is what the packing pipeline yields for the data (``pipeline.batches_per_epoch``,
    rows holding several samples): one batch per host makes a global batch, and a host with
    more batches than the others sets the count, so every host sees all its records. The count
    is that of the first pass: later epochs reshuffle and resample anchors, so theirs can differ
    a little.

    Args:
      train_cfg: the ``.train`` settings (data_dir, global_batch_size, pack_length, ...).
      drafter_config: the drafter's config (block_size).
    """
    if train_cfg.max_steps > 0:
        return int(train_cfg.max_steps)
    per_epoch = batches_per_epoch(_data_dirs(train_cfg), **_packing(train_cfg, drafter_config))
    return int(train_cfg.epochs * _max_over_hosts(per_epoch))


def _global_batch(batch: dict, mesh) -> dict:
    """Host-local numpy rows -> global arrays with rows over the data axes."""
    def put(x):
        spec = sharding.logical_to_spec(("batch",) + (None,) * (x.ndim - 1),
                                        (x.shape[0] * jax.process_count(),) + x.shape[1:], mesh)
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), x)

    return {k: put(v) for k, v in batch.items()}


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class _Logger:
    """metrics.jsonl on the first host, plus TensorBoard when tensorboardX is installed."""

    def __init__(self, workdir: storage.Path):
        self.enabled = jax.process_index() == 0
        self.file = storage.LineLog(workdir / "metrics.jsonl")
        self.tb = None
        if self.enabled:
            try:
                from tensorboardX import SummaryWriter
                self.tb = SummaryWriter(str(workdir / "tensorboard"))
            except ImportError:
                pass

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        if self.tb is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, record["step"])


def warm_start_params(path: str, drafter: Drafter, grow_layers: bool = False):
    """The parameters of a saved drafter (``train.init_from``) to start a run from, checked
    against the run's drafter: same config and tensor shapes, or, with ``grow_layers``
    (``train.grow_layers``), the same but for fewer draft layers, which
    :func:`recipe.grown_state` extends by identity layers.

    A warm start is a new run: the optimizer state and the learning-rate schedule start over.
    """
    loaded = load_drafter(path, drafter.target)
    mine, theirs = dict(drafter.config), dict(loaded.config)
    if grow_layers:
        theirs["num_layers"] = mine["num_layers"]  # grown_state checks it and the shapes
    if mine != theirs:
        diff = sorted(k for k in mine if mine[k] != theirs.get(k))
        raise ValueError(f"train.init_from {path}: its drafter config differs in "
                         + ", ".join(f"{k} ({theirs.get(k)!r}, the run has {mine[k]!r})" for k in diff))
    if grow_layers:
        return recipe.grown_state(loaded.state, drafter.state)
    shapes = lambda state: jax.tree.map(lambda x: (x.shape, str(x.dtype)), state)
    if shapes(loaded.state) != shapes(drafter.state):
        raise ValueError(f"train.init_from {path}: its tensors differ from the run's drafter")
    return loaded.state


class _HeldOutCurve:
    """The learning curve: held-out metrics at steps, with the Markov head zeroed too, appended
    to ``workdir/heldout.jsonl`` (one record per evaluation; process 0 writes)."""

    def __init__(self, drafter: Drafter, tcfg, workdir: storage.Path):
        self.heldout = HeldOut(drafter, _folders(tcfg, "heldout_dir"), tcfg,
                               max_batches=int(tcfg.get("heldout_batches", 0)) or None,
                               feature_dir=_folders(tcfg, "heldout_feature_dir"))
        self.zero_w2 = drafter.config.head == "markov"
        self.file = storage.LineLog(workdir / "heldout.jsonl")

    def evaluate(self, step: int, params) -> None:
        record = dict(step=step, **self.heldout.metrics(params, progress=False))
        if self.zero_w2:
            w2 = params["markov_head"]["markov_w2"]["kernel"]
            zeroed = recipe.replace_params(params, {recipe.W2_PATH: np.zeros(w2.shape, np.float32)})
            record["w2_zero"] = self.heldout.metrics(zeroed, progress=False)
        if jax.process_index() == 0:
            self.file.write(json.dumps(record) + "\n")


def train(config, workdir: storage.PathLike, *, progress: bool = True) -> Drafter:
    """Trains (or resumes training) a drafter; returns it with the trained parameters.

    Args:
      config: an experiment config (``configs/*.py``): ``.target``, ``.drafter``, ``.train``.
      workdir: checkpoints, metrics.jsonl and the exported drafter go here: a local folder
        or an object-store URI (gs://...), the same for every host.
    """
    import orbax.checkpoint as ocp

    workdir = storage.as_path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    tcfg = config.train
    dtype = compute_dtype(tcfg)
    mesh = sharding.make_mesh(tuple(tcfg.mesh_shape))
    with jax.set_mesh(mesh):
        target = load_target(config.target, dtype=dtype)
        drafter = init_drafter(target, config, seed=tcfg.seed)
    hosts = jax.process_count()
    if tcfg.global_batch_size % hosts:
        raise ValueError(f"global_batch_size {tcfg.global_batch_size} does not split over {hosts} hosts")
    row_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if tcfg.global_batch_size % row_shards:
        raise ValueError(f"global_batch_size {tcfg.global_batch_size} does not split over the "
                         f"{row_shards} row shards (data x fsdp) of mesh_shape {tuple(mesh.shape.values())}")
    steps = total_steps(tcfg, drafter.config)
    data = make_pipeline(_data_dirs(tcfg), **_packing(tcfg, drafter.config),
                         feature_dir=_feature_dirs(tcfg),
                         feature_key=cache_key(target, drafter.config.target_layer_ids))
    manager = ocp.CheckpointManager(
        workdir / "checkpoints",
        options=ocp.CheckpointManagerOptions(max_to_keep=tcfg.keep_checkpoints,
                                             enable_async_checkpointing=True))
    start = manager.latest_step() or 0
    if start:
        params = drafter.state  # replaced by the checkpoint below
    elif tcfg.get("init_from"):
        with jax.set_mesh(mesh):
            params = warm_start_params(tcfg.init_from, drafter,
                                       grow_layers=bool(tcfg.get("grow_layers", False)))
    elif tcfg.get("grow_layers", False):
        raise ValueError("train.grow_layers grows the drafter of train.init_from, which is unset")
    else:
        params = recipe.initial_state(drafter.state, drafter.config, target.state, tcfg,
                                      _data_dirs(tcfg), target_config=target.config)
    optimizer = train_step.make_optimizer(tcfg, steps)
    state = train_step.init_train_state(params, optimizer, mesh)
    step_fn = train_step.make_train_step(
        drafter.graphdef, target.graphdef, tcfg, optimizer, mesh=mesh, state=state,
        target_state=target.state, grad_accum_steps=tcfg.grad_accum_steps,
        anchor_chunk=tcfg.anchor_chunk, compute_dtype=dtype)
    schedule = train_step.learning_rate_schedule(tcfg, steps)

    if start:
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(_abstract(state)), data=ocp.args.JsonRestore()))
        state = restored.state
        data.set_state(restored.data)
    if jax.process_index() == 0:
        storage.write_atomic(workdir / "config.json", config.to_json_best_effort(indent=2))

    logger = _Logger(workdir)
    curve = _HeldOutCurve(drafter, tcfg, workdir) if _folders(tcfg, "heldout_dir") else None
    if curve is not None and start == 0:
        curve.evaluate(0, state.params)
    bar = tqdm(total=steps, initial=start, desc="train", unit="step",
               disable=not progress or jax.process_index() != 0)
    with jax.set_mesh(mesh):
        for step in range(start, steps):
            batch = next(data)
            tokens = int((batch["segment_ids"] > 0).sum()) * hosts
            began = time.perf_counter()
            state, metrics = step_fn(state, target.state, _global_batch(batch, mesh))
            metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
            elapsed = time.perf_counter() - began
            done = step + 1
            record = dict(step=done, lr=float(schedule(step)), step_time_s=elapsed,
                          tokens_per_s=tokens / elapsed, **metrics)
            if done % tcfg.log_every == 0 or done == steps or done == start + 1:
                logger.log(record)
            bar.set_postfix(loss=f"{metrics['loss']:.3f}",
                            tau=f"{metrics['tau_probabilistic']:.2f}")
            bar.update(1)
            if curve is not None and (done == steps or (tcfg.heldout_every
                                                         and done % tcfg.heldout_every == 0)):
                curve.evaluate(done, state.params)
            if done % tcfg.checkpoint_every == 0 or done == steps:
                for log in (logger, curve):
                    if log is not None:
                        log.file.flush()
                manager.save(done, args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data.get_state())))
    bar.close()
    manager.wait_until_finished()
    manager.close()

    params = jax.tree.map(lambda p: p.astype(drafter.dtype), state.params)
    trained = Drafter(drafter.config, drafter.model_config, params, drafter.graphdef, target)
    if jax.process_index() == 0:
        trained.save(workdir / "drafter", layout="deepspec", num_anchors=tcfg.num_anchors)
    return trained
