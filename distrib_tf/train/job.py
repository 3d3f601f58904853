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
import time

import keras

from distrib_tf import cluster
from distrib_tf import data
from distrib_tf.keras import callbacks as callbacks_lib
from distrib_tf.keras import local_sgd
from distrib_tf.keras import nonfinite
from distrib_tf.keras import sigterm
from distrib_tf.models import build_model
from distrib_tf.run import Run
from distrib_tf.train import builders
from distrib_tf.train import evaluator
from distrib_tf.train import serving
from distrib_tf.train.config import MODEL_KINDS
from distrib_tf.train.config import TrainConfig
from distrib_tf.train.config import invalid_flag


@dataclasses.dataclass
class Job:
    """A validated job, ready to run: its run (strategy, tasks) and data are known."""

    config: TrainConfig
    model_dir: str
    run: Run
    info: object  # The training data's DatasetInfo, or its Examples (a user's data).
    train: object  # distrib_tf.data.Examples
    validation: object  # distrib_tf.data.Examples, or None
    steps_per_epoch: int
    validation_steps: int

    @property
    def strategy(self):
        return self.run.strategy

    @property
    def strategy_name(self) -> str:
        return self.run.strategy_name

    @property
    def task(self) -> str:  # `chief:0` for a job of one process.
        return self.run.task

    @property
    def workers(self) -> int:
        return self.run.workers

    @property
    def is_chief(self) -> bool:
        return self.run.is_chief

    @property
    def is_evaluator(self) -> bool:
        return self.run.is_evaluator

    @property
    def replica_tasks(self) -> tuple[str, ...]:  # The task of every replica, in order.
        return self.run.replica_tasks


def load_data(config: TrainConfig):
    """`(info, train, validation)` of `--dataset`: a name, `images:DIR`, or a user's function."""
    if builders.is_function_spec(config.dataset) and not config.dataset.startswith(("array_record:", "images:")):
        train, validation = builders.load_splits(config.dataset)
        return (train.info or train), _full_batches(train), _full_batches(validation)
    if not config.dataset.startswith("images:"):
        data.check_dataset_name(config.dataset)
    train = data.load(config.dataset, "train", data_dir=config.data_dir)
    info = train.info
    validation = data.load(config.dataset, "test", data_dir=config.data_dir) if "test" in info.num_examples else None
    return info, _full_batches(train), _full_batches(validation)


def _full_batches(split):
    """The job trains and evaluates full global batches (`--global_batch_size` divides the replicas)."""
    return dataclasses.replace(split, full_batches=True) if isinstance(split, data.Examples) else split


def prepare_job(config: TrainConfig, model_dir: str) -> Job:
    """Checks everything a user can get wrong, then builds the run and its strategy.

    Raises:
        ValueError: `TF_CONFIG`, the dataset, the model or the batch size is unusable.
        FileNotFoundError: the dataset is not prepared in `data_dir`.
    Nothing is written before all checks pass.
    """
    if not config.dataset.startswith("images:") and not builders.is_function_spec(config.dataset):
        data.check_dataset_name(config.dataset)
    if config.model not in MODEL_KINDS:
        builders.load_function(config.model, flag="model")  # Before the strategy: a typo is answered at once.
    run = Run(model_dir, seed=config.seed, backup_every_steps=config.backup_every_steps, on_nan=config.on_nan,
              max_rollbacks=config.max_rollbacks, sync=config.sync, outer_optimizer=config.outer()[0],
              outer_learning_rate=config.outer_learning_rate, outer_momentum=config.outer_momentum,
              allreduce_dtype=config.allreduce_dtype, run_id=config.run_id(), strategy=config.strategy,
              cpu_replicas=config.cpu_replicas, collective_timeout=config.collective_timeout,
              fresh_start=config.fresh_start, keep_checkpoints=config.keep_checkpoints,
              backup_in_background=config.backup_in_background,
              exit_on_error=False)  # The CLI leaves by its codes itself.
    info, train, validation = load_data(config)
    if config.model in MODEL_KINDS and getattr(info, "kind", None) != MODEL_KINDS[config.model]:
        invalid_flag("dataset", config.dataset,
                     f"a dataset of {MODEL_KINDS[config.model]}s for --model={config.model}")
    data.check_global_batch_size(config.global_batch_size, run.strategy.num_replicas_in_sync)
    config.check_replicas(run.strategy.num_replicas_in_sync)  # Several GPUs of one host, too.
    steps = config.steps_per_epoch or train.steps_per_epoch(config.global_batch_size)
    if steps * config.global_batch_size > train.num_examples:
        invalid_flag("steps_per_epoch", steps, f"at most {train.num_examples // config.global_batch_size} steps of "
                     f"{config.global_batch_size} in the {train.num_examples} examples of {train.name}")
    config.profile_range(last_step=config.epochs * steps)
    validation_steps = validation.steps_per_epoch(config.global_batch_size) if validation is not None else 0
    return Job(config, run.model_dir, run, info, train, validation, steps, validation_steps)


def build_compiled_model(config: TrainConfig, info, strategy):
    """The job's model, built and compiled under `strategy.scope()`, with the NaN check attached."""
    keras.mixed_precision.set_global_policy(config.dtype_policy)
    with strategy.scope():
        if config.model == "cnn":
            model = build_model("cnn", input_shape=info.input_shape, num_classes=info.num_classes)
        elif config.model == "transformer":
            model = build_model("transformer", vocab_size=info.vocab_size,
                                seq_len=info.input_shape[0], num_classes=info.num_classes)
        else:
            model = builders.load_function(config.model, flag="model")(info)
            if not isinstance(model, keras.Model):
                invalid_flag("model", config.model, f"a function returning a keras.Model (it returned a "
                             f"{type(model).__name__})")
        if not model.compiled:
            model.compile(
                optimizer=keras.optimizers.Adam(config.learning_rate),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
    nonfinite.attach(model)
    local_sgd.compress_gradients(model.optimizer, config.allreduce_dtype)
    return model


def run_job(job: Job) -> dict:
    """Trains and evaluates through the run API; returns the summary (the chief's `summary.json`).

    Every worker first agrees on the step to resume from (`distrib_tf.keras.backup`); a run
    resumed mid-epoch finishes that epoch's remaining steps, then goes on by epochs.
    An evaluator task trains nothing: it evaluates the chief's checkpoints.
    """
    config, run = job.config, job.run
    started = time.time()
    if job.is_evaluator:
        keras.utils.set_random_seed(config.seed)
        model = build_compiled_model(config, job.info, run.strategy)
        results = evaluator.evaluate_checkpoints(
            model, run.distribute(job.validation, global_batch_size=config.global_batch_size),
            steps=job.validation_steps, model_dir=job.model_dir, last_epoch=config.epochs, run=config.run_id(),
            idle_seconds=config.evaluator_idle_seconds)
        return {"evaluator": results}
    with sigterm.saved(None):  # Start-up: a SIGTERM leaves the backups as they were.
        keras.utils.set_random_seed(config.seed)  # The same initial weights whatever the data read.
        model = build_compiled_model(config, job.info, run.strategy)
    profile = [] if not config.profile_steps else [callbacks_lib.ProfileSteps(
        os.path.join(job.model_dir, "logs", job.task.replace(":", "_")), *config.profile_range(),
        workers=len(job.replica_tasks))]
    run.fit(model, job.train, epochs=config.epochs, global_batch_size=config.global_batch_size,
            steps_per_epoch=job.steps_per_epoch, validation_data=job.validation, callbacks=profile)
    final = {}
    if job.validation is not None:
        with run.outputs():  # Every worker's backup holds the last step (an epoch's end).
            final = model.evaluate(run.distribute(job.validation, global_batch_size=config.global_batch_size),
                                   steps=job.validation_steps, return_dict=True, verbose=0)
    run.summary.update({
        "config": dataclasses.asdict(config),
        "dataset": (dataclasses.asdict(job.info) if isinstance(job.info, data.DatasetInfo)
                    else {"name": job.train.name, "num_examples": {"train": job.train.num_examples}}),
        "final": {k: float(v) for k, v in final.items()},
        "wall_seconds": time.time() - started,
    })
    summary = run.summary
    if os.environ.get(cluster.VERBOSE_ENV) == "1":
        # Every worker's, verbose: identical weights on all of them is the point of synchronous training.
        print(f"{job.task} final weights sha256 {summary['weights_sha256']}", flush=True)
    with run.outputs():  # Renamed into place: a restart writes them again.
        if job.is_chief:
            serving.export_model(model, job.model_dir)
    run.end()  # summary.json, every worker at a barrier, then the backups go.
    return summary


def train_and_evaluate(config: TrainConfig, model_dir: str) -> dict:
    """Runs the main job; returns its summary.

    Example:

        >>> summary = train_and_evaluate(TrainConfig(epochs=1), "/tmp/run")
        >>> summary["final"]["accuracy"] > 0.1
        True
    """
    return run_job(prepare_job(config, model_dir))
