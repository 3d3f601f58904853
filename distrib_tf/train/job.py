"""The main job as a library: `train_and_evaluate(config, model_dir)`.

`prepare_job` checks everything a user can get wrong and builds the strategy; `run_job`
builds the data and the model and runs `fit`. A notebook or a sweep calls them as the
command line (`distrib_tf.train.cli`) does. Under `model_dir`:
`backup/<task>/` on every worker's own disk (a restarted job resumes from it, see
`distrib_tf.keras.backup`); `checkpoints/`, `logs/` (TensorBoard), `summary.json` and the
trained model (`model.keras`, and `serving/`, a SavedModel; `distrib_tf.train.serving`),
written by the chief only; `eval/`, written by an `evaluator` task only
(`distrib_tf.train.evaluator`).
"""

import dataclasses
import os
import sys
import time

import keras

from distrib_tf import cluster
from distrib_tf import data
from distrib_tf import events
from distrib_tf.keras import backup
from distrib_tf.keras import callbacks as callbacks_lib
from distrib_tf.keras import local_sgd
from distrib_tf.keras import nonfinite
from distrib_tf.keras import phases
from distrib_tf.keras import preemption
from distrib_tf.keras import progress
from distrib_tf.models import build_model
from distrib_tf.strategy import make_strategy
from distrib_tf.strategy import strategy_name
from distrib_tf.train import evaluator
from distrib_tf.train import serving
from distrib_tf.train.config import MODEL_KINDS
from distrib_tf.train.config import TrainConfig
from distrib_tf.train.config import invalid_flag


@dataclasses.dataclass
class Job:
    """A validated job, ready to run: its strategy, data and model are built."""

    config: TrainConfig
    model_dir: str
    strategy: object
    strategy_name: str
    info: object
    task: str  # `chief:0` for a job of one process.
    workers: int
    is_chief: bool
    steps_per_epoch: int
    validation_steps: int
    is_evaluator: bool = False
    replica_tasks: tuple[str, ...] = ("chief:0",)  # The task of every replica, in order.


def prepare_job(config: TrainConfig, model_dir: str) -> Job:
    """Checks everything a user can get wrong, then builds the strategy.

    Raises:
        ValueError: `TF_CONFIG`, the dataset, the model or the batch size is unusable.
        FileNotFoundError: the dataset is not prepared in `data_dir`.
    Nothing is written before all checks pass.
    """
    data.check_dataset_name(config.dataset)
    strategy = make_strategy(config.strategy, cpu_replicas=config.cpu_replicas,
                             timeout_seconds=config.collective_timeout)
    preemption.reclaim_sigterm()  # From TensorFlow's notifier, if the job had installed ours.
    info = data.load_info(config.dataset, data_dir=config.data_dir)
    data.check_random_access(info)
    if info.kind != MODEL_KINDS[config.model]:
        invalid_flag("dataset", config.dataset,
                 f"a dataset of {MODEL_KINDS[config.model]}s for --model={config.model}")
    data.check_global_batch_size(config.global_batch_size, strategy.num_replicas_in_sync)
    config.check_replicas(strategy.num_replicas_in_sync)  # Several GPUs of one host, too.
    steps = config.steps_per_epoch or data.steps_per_epoch(info, "train", config.global_batch_size)
    config.profile_range(last_step=config.epochs * steps)
    validation_steps = data.steps_per_epoch(info, "test", config.global_batch_size)
    tf_config = cluster.load_tf_config()
    multi_worker = strategy_name(strategy) == "MultiWorkerMirroredStrategy"
    if tf_config is not None and tf_config[1].type == "evaluator":
        return Job(config, model_dir, strategy, strategy_name(strategy), info,
                   str(tf_config[1]), tf_config[0].num_workers, False, steps,
                   validation_steps, is_evaluator=True)
    resolver = strategy.cluster_resolver if multi_worker else None
    task = f"{resolver.task_type}:{resolver.task_id}" if multi_worker else "chief:0"
    workers = tf_config[0].num_workers if multi_worker else 1
    trainers = [str(t) for t in tf_config[0].tasks if t.type != "evaluator"] if multi_worker else [task]
    local = strategy.num_replicas_in_sync // len(trainers)
    return Job(config, model_dir, strategy, strategy_name(strategy), info, task, workers,
               strategy.extended.should_checkpoint, steps, validation_steps,
               replica_tasks=tuple(t for t in trainers for _ in range(local)))


def build_compiled_model(config: TrainConfig, info, strategy):
    """The job's model, built and compiled under `strategy.scope()`."""
    with strategy.scope():
        if config.model == "cnn":
            model = build_model("cnn", input_shape=info.input_shape, num_classes=info.num_classes)
        else:
            model = build_model("transformer", vocab_size=info.vocab_size,
                                seq_len=info.input_shape[0], num_classes=info.num_classes)
        model.compile(
            optimizer=keras.optimizers.Adam(config.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", nonfinite.NonFiniteReplicas()],
        )
    local_sgd.compress_gradients(model.optimizer, config.allreduce_dtype)
    return model


def run_job(job: Job) -> dict:
    """Trains and evaluates; returns the summary (written to `summary.json` by the chief).

    Every worker first agrees on the step to resume from (`distrib_tf.keras.backup`); a run
    resumed mid-epoch finishes that epoch's remaining steps, then goes on by epochs.
    An evaluator task trains nothing: it evaluates the chief's checkpoints.
    """
    config, strategy, info = job.config, job.strategy, job.info
    started = time.time()
    keras.utils.set_random_seed(config.seed)
    keras.mixed_precision.set_global_policy(config.dtype_policy)

    def distributed(split, start_step=0):
        return strategy.distribute_datasets_from_function(data.make_dataset_fn(
            info, split, global_batch_size=config.global_batch_size, seed=config.seed,
            start_step=start_step))

    if job.is_evaluator:
        model = build_compiled_model(config, info, strategy)
        results = evaluator.evaluate_checkpoints(
            model, distributed("test"), steps=job.validation_steps, model_dir=job.model_dir,
            last_epoch=config.epochs, run=config.run_id())
        return {"evaluator": results}
    with preemption.saved(None):  # Start-up: a SIGTERM leaves the backups as they were.
        model = build_compiled_model(config, info, strategy)
        if job.is_chief:
            os.makedirs(job.model_dir, mode=0o700, exist_ok=True)
        backup_dir = os.path.join(job.model_dir, "backup", backup.task_dirname(job.task))
        start_step = backup.agree_on_resume(model, backup_dir, run=config.run_id(), task=job.task)
    if start_step:
        print(f"{job.task} resumes at step {start_step} (epoch {start_step // job.steps_per_epoch + 1}, "
              f"step {start_step % job.steps_per_epoch} of it) from {backup_dir}", flush=True)
    worker_backup = backup.WorkerBackup(
        backup_dir, run=config.run_id(), task=job.task, steps_per_epoch=job.steps_per_epoch,
        every_steps=config.backup_every_steps)
    callbacks = callbacks_lib.make_callbacks(
        job.model_dir, task=job.task, is_chief=job.is_chief, epochs=config.epochs,
        examples_per_epoch=job.steps_per_epoch * config.global_batch_size,
        worker_backup=worker_backup, run=config.run_id())
    at = callbacks.index(worker_backup)  # Checked before the step is backed up; saved after.
    periodic = [] if config.sync == "step" else [local_sgd.PeriodicSync(
        strategy, config.sync_every() or job.steps_per_epoch, outer=config.outer()[0],
        outer_learning_rate=config.outer()[1], outer_momentum=config.outer()[2])]
    callbacks[at:at + 1] = [
        *periodic, nonfinite.StopOnNonFinite(workers=list(job.replica_tasks), steps_per_epoch=job.steps_per_epoch),
        worker_backup, preemption.SaveOnPreemption(worker_backup),
        progress.Progress(task=job.task, workers=list(job.replica_tasks), epochs=config.epochs,
                          steps_per_epoch=job.steps_per_epoch, global_batch_size=config.global_batch_size)]
    if config.profile_steps:
        callbacks.append(callbacks_lib.ProfileSteps(
            os.path.join(job.model_dir, "logs", job.task.replace(":", "_")), *config.profile_range(),
            workers=len(job.replica_tasks)))
    verbose = (1 if sys.stdout.isatty() else 2) if job.is_chief else 0
    history, epochs, rollbacks = {}, [], []
    step, last_step = start_step, config.epochs * job.steps_per_epoch
    while step < last_step:
        epoch, done = divmod(step, job.steps_per_epoch)
        until = epoch + 1 if done else config.epochs  # A partial epoch alone, then the rest.
        try:
            fitted = model.fit(
                distributed("train", step), initial_epoch=epoch, epochs=until,
                steps_per_epoch=job.steps_per_epoch - done,
                validation_data=distributed("test"), validation_steps=job.validation_steps,
                callbacks=callbacks, verbose=verbose, shuffle=False,  # The pipeline shuffles.
            )
        except nonfinite.NonFiniteLoss as e:
            nonfinite.name_input_culprits(e, job.strategy, job.replica_tasks, distributed("train", e.step - 1))
            if config.on_nan == "stop" or len(rollbacks) == config.max_rollbacks:
                raise
            step = _roll_back(model, backup_dir, config, job, e)
            rollbacks.append({"at_step": e.step, "to_step": step,
                              "learning_rate": float(model.optimizer.learning_rate.numpy())})
            worker_backup.saved_step = None
            continue
        for key, values in fitted.history.items():
            history.setdefault(key, []).extend(values)
        epochs += fitted.epoch
        step = until * job.steps_per_epoch
    with preemption.saved(step):  # Every worker's backup holds the last step (an epoch's end).
        final = model.evaluate(distributed("test"), steps=job.validation_steps,
                               return_dict=True, verbose=0)
    timer = callbacks[0]
    summary = {
        "config": dataclasses.asdict(config),
        "run_id": config.run_id(),
        "dataset": dataclasses.asdict(info),
        "strategy": job.strategy_name,
        "workers": job.workers,
        "replicas": strategy.num_replicas_in_sync,
        "resumed_at_step": start_step,
        "rollbacks": rollbacks,
        "epochs": [{"epoch": epoch + 1, **{k: float(v[i]) for k, v in history.items()}}
                   for i, epoch in enumerate(epochs)],
        "final": {k: float(v) for k, v in final.items()},
        "examples_per_second": _steady_rate(timer.seconds, timer.examples_per_epoch),
        "wall_seconds": time.time() - started,
        "first_step_unix_time": timer.first_step_at,
        "epoch_end_unix_times": timer.ended_at, "epoch_step_seconds": timer.seconds,
        "weights_sha256": serving.weights_fingerprint(model),
        "periodic_sync": {"syncs": periodic[0].syncs, "bytes_per_worker": periodic[0].bytes_per_worker}
        if periodic else None,
    }
    # Every worker: identical weights on all of them is the point of synchronous training.
    print(f"{job.task} final weights sha256 {summary['weights_sha256']}", flush=True)
    if job.is_chief:
        with preemption.saved(step):  # Renamed into place: a restart writes them again.
            serving.export_model(model, job.model_dir)
            backup.write_json_atomically(os.path.join(job.model_dir, "summary.json"), summary)
    # Backups go only once the chief's outputs are written: every worker meets here first,
    # at a barrier (an export may take longer than a collective timeout). A job killed
    # before this resumes at its last step on every worker and writes them again; deleting
    # earlier left a worker without a backup beside a chief that had not finished, a
    # restart that could only exit 2.
    phases.enter(strategy, "outputs_written")
    backup.remove_backups(backup_dir)
    events.emit("finished", final=summary["final"],
                summary=os.path.join(job.model_dir, "summary.json") if job.is_chief else None)
    return summary


def _roll_back(model, backup_dir: str, config: TrainConfig, job: Job, error) -> int:
    """Restores the last backup every worker holds and halves the learning rate."""
    rate = float(model.optimizer.learning_rate.numpy()) / 2  # Before the backup restores it.
    step = backup.agree_on_resume(model, backup_dir, run=config.run_id(), task=job.task,
                                  include_start=True)
    model.optimizer.learning_rate = rate
    print(f"{job.task} {error} Rolled back to step {step}; learning rate halved to {rate:.3g}.",
          flush=True)
    return step


def _steady_rate(seconds: list[float], examples: int) -> float | None:
    """Examples per second, leaving out the first epoch (tracing) when there are others."""
    steady = seconds[1:] or seconds
    return examples * len(steady) / sum(steady) if steady else None


def train_and_evaluate(config: TrainConfig, model_dir: str) -> dict:
    """Runs the main job; returns its summary.

    Example:

        >>> summary = train_and_evaluate(TrainConfig(epochs=1), "/tmp/run")
        >>> summary["final"]["accuracy"] > 0.1
        True
    """
    return run_job(prepare_job(config, model_dir))
