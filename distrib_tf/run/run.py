"""`Run`: every guarantee of distrib_tf for a user's own Keras script, as Keras writes it.

Two lines at the top of a Keras script; the rest stays as it is (its own model, optimizer,
schedule, loss, metrics, callbacks, data and `fit` calls):

    import distrib_tf
    run = distrib_tf.Run("runs/mine", backup_every_steps=100, on_nan="rollback")
    model = build_my_model()  # Built under the run's strategy, its default from now on.
    model.compile(optimizer=keras.optimizers.AdamW(schedule), loss="mse")
    history = model.fit(x, y, batch_size=256, epochs=5, validation_split=0.1)  # run.fit(model, ...)

What `fit` adds to Keras's own, on one device, several GPUs or several workers:

- every worker backs up to its own disk (`model_dir/backup/<task>/`, at epoch ends and
  every `backup_every_steps`): weights, optimizer slots, every `SeedGenerator`, the
  epoch's metric sums, the user's callbacks' state and History; a restarted run resumes
  at the step every worker agrees on, mid-epoch included, on the same batches
  (`distrib_tf.keras.backup`, `distrib_tf.data.examples`): the final weights are those
  of a run never interrupted, and so is what the user's objects hold;
- SIGTERM during `fit`, after it or in the outputs: every worker backs up one agreed step
  and the run exits 75; before the first `fit` SIGTERM keeps its default meaning
  (`distrib_tf.run.ending`, case by case);
- a NaN or Inf stops every worker at one step, the culprit named (exit 65), or with
  `on_nan="rollback"` restores the last common backup and halves the learning rate (a
  `LearningRateSchedule` too);
- periodic sync (`sync="every:N"` or `"epoch"`) and compressed all-reduce;
- progress events (the launcher's status line, notebooks, sweeps), chief-only
  checkpoints, TensorBoard logs and `summary.json`, and a clean end at a barrier.

Each `fit` call is a stage (`distrib_tf.run.stage`): a restart returns a finished stage
at once, with its History and final state, and resumes the interrupted one.

The exit codes a scheduler reads: leaving by `Preempted` exits 75, by `NonFiniteLoss` 65,
by a bad input or an impossible resume 2, each with one line (`distrib_tf.run.ending`),
from the `with` block or, without one, from the uncaught error; leaving normally (the
block, or the script's end) writes `summary.json`, keeps only each worker's last backup
of each `fit` once every worker's outputs are written (a rerun returns at once), and,
under several workers, meets every worker at a barrier before returning. In Jupyter (no
exit codes wanted) pass `exit_on_error=False` and call `run.end()`: the errors are raised as
they are.
"""

import contextlib
import os
import sys
from typing import Any

import keras
import tensorflow as tf

from distrib_tf import cluster
from distrib_tf import events
from distrib_tf import lifeline
from distrib_tf import trial
from distrib_tf.data import batches as batches_lib
from distrib_tf.data import examples as examples_lib
from distrib_tf.data import pipeline
from distrib_tf.keras import backup
from distrib_tf.keras import local_sgd
from distrib_tf.keras import nonfinite
from distrib_tf.keras import phases
from distrib_tf.keras import sigterm
from distrib_tf.keras import step_logs
from distrib_tf.keras import uneven
from distrib_tf.run import checks
from distrib_tf.run import ending
from distrib_tf.run import export
from distrib_tf.run import inputs
from distrib_tf.run import routing
from distrib_tf.run import schedules
from distrib_tf.run import stage as stage_lib
from distrib_tf.run.ending import InvalidRun
from distrib_tf.run.options import RunOptions
from distrib_tf.run.options import invalid
from distrib_tf.strategy import make_strategy
from distrib_tf.strategy import strategy_name


class Run:
    """A training run of a user's own Keras model, with every guarantee of distrib_tf.

    Make it first, before any other TensorFlow call: it builds the strategy
    (`distrib_tf.make_strategy`, which reads `TF_CONFIG`) and makes it the default one
    until the run ends (so the script's models are built under it), seeds Keras, takes
    SIGTERM, and sends the `model.fit` of those models through `Run.fit`
    (`distrib_tf.run.routing`).

    Args:
        model_dir: where the run writes: `backup/<task>/` on every worker's own disk;
            `checkpoints/`, `logs/`, `summary.json` and the saved model by the chief. In a
            trial of `distrib-tf-sweep`, the trial's own directory instead
            (`distrib_tf.trial`).
        seed: seeds Keras (the model's initial weights) and the data order.
        backup_every_steps: back up every this many global steps too (default: at epoch
            ends only); a SIGTERM backs up its own step in any case.
        on_nan: `"stop"` (exit 65) or `"rollback"` (the last common backup, half the
            learning rate, at most `max_rollbacks` times).
        sync: `"step"` (all-reduce gradients every step), `"every:N"` or `"epoch"`
            (each replica applies its own; the weights are averaged every N steps, or
            once an epoch), with `outer_optimizer` `"average"` or `"nesterov"`.
        allreduce_dtype: the type gradients travel in (`"bfloat16"` halves the bytes).
        run_id: what a backup must match to be resumed; by default a digest of the
            model's variables, its optimizer's configuration, the data, the global batch,
            the seed and the sync mode.
        strategy: passed to `make_strategy`: `"auto"`, `"one_device"`, `"mirrored"` or
            `"multi_worker"` (the strategy object is `run.strategy`).
        cpu_replicas: passed to `make_strategy`.
        collective_timeout: passed to `make_strategy`.
        keep_checkpoints: the chief keeps the last N epoch checkpoints of each `fit`
            (`checkpoints/epochNNN.weights.h5`, the second `fit`'s `fit2-epochNNN...`);
            `None`: every epoch's.
        backup_in_background: a backup stops training only while the state is copied into
            memory; its files are written in the background (default). False: each backup
            waits for its files (`distrib_tf.keras.backup`).
        fresh_start: start at step 0 even beside backups of this run (each worker deletes
            its own and every backup of the run it can see, and says so); by default a run
            always resumes from the newest of them, on any layout.
        exit_on_error: leave by the exit codes of `distrib_tf.run.ending`, from the `with`
            block or an uncaught error, and end the run with the script (default: yes,
            but not in Jupyter, where `run.end()` ends it).

    Example:

        >>> run = Run("/tmp/mine", seed=0)
        >>> model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(1)])
        >>> model.compile(optimizer="sgd", loss="mse")
        >>> history = model.fit(x, y, batch_size=32, epochs=2)  # Through run.fit: every guarantee.
    """

    def __init__(self, model_dir: str, *, seed: int = 0, backup_every_steps: int | None = None,
                 on_nan: str = "stop", max_rollbacks: int = 3, sync: str = "step",
                 outer_optimizer: str = "average", outer_learning_rate: float | None = None,
                 outer_momentum: float | None = None, allreduce_dtype: str = "float32",
                 run_id: str | None = None, strategy: str = "auto", cpu_replicas: int | None = None,
                 collective_timeout: float | None = None, fresh_start: bool = False,
                 keep_checkpoints: int | None = 3, backup_in_background: bool = True,
                 exit_on_error: bool | None = None):
        self.exit_on_error = (("ipykernel" not in sys.modules) if exit_on_error is None else exit_on_error)
        try:
            self._start(model_dir, seed=seed, backup_every_steps=backup_every_steps, on_nan=on_nan,
                        max_rollbacks=max_rollbacks, sync=sync, outer_optimizer=outer_optimizer,
                        outer_learning_rate=outer_learning_rate, outer_momentum=outer_momentum,
                        allreduce_dtype=allreduce_dtype, run_id=run_id, strategy=strategy,
                        cpu_replicas=cpu_replicas, collective_timeout=collective_timeout,
                        keep_checkpoints=keep_checkpoints, backup_in_background=backup_in_background)
        except InvalidRun as e:
            if not self.exit_on_error:
                raise
            ending.exit_for(e, "chief:0", program=ending.program())  # One line, exit 2.
        self.fresh_start = bool(fresh_start)
        self.step = 0
        self.summary: dict = {}  # Written by the chief as `summary.json` at the end; add to it.
        self._fitted = self._ended = self._crashed = False
        self._stages: list[tuple[str, str]] = []  # Each fit's backup directory and run id.
        self._held: list[int] = []  # The backup directories this process holds (`resume.hold`).
        tf.distribute.experimental_set_strategy(self.strategy)  # The script's models are built under it.
        routing.activate(self)  # And their `model.fit` is this run's.
        if self.exit_on_error:
            ending.take_uncaught(self)

    def _start(self, model_dir, *, seed, strategy, cpu_replicas, collective_timeout, **options):
        if not isinstance(model_dir, (str, os.PathLike)) or not str(model_dir):
            invalid("model_dir", model_dir, "a directory path")
        self.options = RunOptions(seed=seed, **options)
        self.model_dir = trial.model_dir(str(model_dir))  # A sweep's trial writes in its own directory.
        # Reclaimed from TensorFlow's once the strategy is made; outside fit and the outputs, its own meaning.
        sigterm.install(outside_phases="default")
        if routing.live() is not None:
            raise InvalidRun(f"distrib_tf.Run({str(model_dir)!r}) while {routing.live()!r} is live in this process. "
                             "Expected one Run at a time: end the first (`run.end()`, or leave its `with` block)")
        try:
            self.strategy = make_strategy(strategy, cpu_replicas=cpu_replicas, collective_timeout=collective_timeout)
        except ValueError as e:
            raise InvalidRun(str(e)) from e
        except RuntimeError as e:
            if not str(e).startswith("make_strategy() must be called before"):
                raise
            raise InvalidRun("distrib_tf.Run(...) came after the script's first TensorFlow operation (a tf.data "
                             "pipeline, a tensor or a model made above it), and the strategy is configured when "
                             "TensorFlow starts. Expected its two lines (`import distrib_tf`, `run = "
                             "distrib_tf.Run(...)`) right after the script's imports") from e
        sigterm.reclaim()
        lifeline.die_with_parent()  # Started by a parent that asked (a Ray worker): SIGTERM when it dies.
        sigterm.watch_peers(self.strategy)  # One worker's SIGTERM, in any phase, is every worker's.
        keras.utils.set_random_seed(seed)
        self._describe_tasks()
        sigterm.set_task(self.task, leader=self.is_chief)
        self.backup_dir = os.path.join(self.model_dir, "backup", backup.task_dirname(self.task))

    def _describe_tasks(self):
        tf_config = cluster.load_tf_config()
        self.strategy_name = strategy_name(self.strategy)
        multi_worker = self.strategy_name == "MultiWorkerMirroredStrategy"
        self.is_evaluator = tf_config is not None and tf_config[1].type == "evaluator"
        if self.is_evaluator:
            self.task, self.workers, self.is_chief = str(tf_config[1]), tf_config[0].num_workers, False
            self.replica_tasks = (self.task,)
            return
        resolver = self.strategy.cluster_resolver if multi_worker else None
        self.task = f"{resolver.task_type}:{resolver.task_id}" if multi_worker else "chief:0"
        self.workers = tf_config[0].num_workers if multi_worker else 1
        trainers = [str(t) for t in tf_config[0].tasks if t.type != "evaluator"] if multi_worker else [self.task]
        local = self.strategy.num_replicas_in_sync // len(trainers)
        self.replica_tasks = tuple(t for t in trainers for _ in range(local))  # The task of every replica.
        self.is_chief = bool(self.strategy.extended.should_checkpoint)

    def __repr__(self):
        return (f"Run({self.model_dir!r}, task={self.task!r}, strategy={self.strategy_name}, "
                f"replicas={self.strategy.num_replicas_in_sync}, step={self.step})")

    # The data.

    def distribute(self, data: Any, *, global_batch_size: int, start_step: int = 0, shuffle: bool = False,
                   one_pass: bool = True) -> tf.distribute.DistributedDataset:
        """`data` (a `distrib_tf.data` source or a batched `tf.data.Dataset`) as a distributed
        dataset of global batches, in the run's order from `start_step`: by default one pass,
        to the end of that epoch (for `evaluate` and `predict`); `one_pass=False`: endless."""
        if isinstance(data, tf.data.Dataset):
            data = batches_lib.from_dataset(data)
        if isinstance(data, examples_lib.Batches):  # A PyDataset's batches reshuffled by (seed, epoch) with shuffle.
            return self.strategy.experimental_distribute_dataset(
                data.batches(start_step, not one_pass, seed=self.options.seed if shuffle else None))
        if isinstance(data, examples_lib.DatasetFn):
            return self.strategy.distribute_datasets_from_function(
                lambda context: data.fn(context).skip(start_step))
        return self.strategy.distribute_datasets_from_function(pipeline.make_examples_fn(
            data.name, data.num_examples, data.make_reader, global_batch_size=global_batch_size,
            steps_per_epoch=data.steps_per_epoch(global_batch_size), seed=self.options.seed, shuffle=shuffle,
            start_step=start_step, one_pass=one_pass))

    # Training.

    def fit(self, model: keras.Model, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", callbacks: list[keras.callbacks.Callback] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
            class_weight: dict | None = None, sample_weight: Any = None, initial_epoch: int = 0,
            steps_per_epoch: int | None = None, validation_steps: int | None = None,
            validation_batch_size: int | None = None, validation_freq: int = 1, *,
            global_batch_size: int | None = None) -> keras.callbacks.History:
        """Keras's `model.fit(...)`, its arguments with their meanings, and every guarantee.

        A script's own `model.fit(...)` comes here while the run is live (`distrib_tf.run.
        routing`); each call is a stage with its own backups: a restart returns what a
        finished stage returned, with its final state, and resumes the interrupted one at
        its step. The returned `History` holds the user's metrics only, every epoch's.

        Args:
            model: a compiled Keras model, built while the run is live (or under
                `run.strategy.scope()`).
            x: as Keras's (an array, a dict of arrays), a batched `tf.data.Dataset` or a
                `distrib_tf.data` source (`from_source`, `from_images`, `load`, `from_dataset_fn`).
            y: as Keras's: the targets (an array, a dict of arrays), with arrays as `x`.
            sample_weight: as Keras's: one weight per example.
            class_weight: as Keras's: a weight per class.
            validation_split: as Keras's: the last share of the arrays validates.
            batch_size: the global batch (over all replicas: a step's rows split as evenly as
                they go, each row weighing as in one process: `distrib_tf.keras.uneven`);
                `global_batch_size` is the same.
            epochs: epochs in all, counting those a resumed run already trained.
            validation_data: a tuple `(x, y[, sample_weight])`, a dataset or a source,
                evaluated in order, every row, in batches of `validation_batch_size` (default:
                `batch_size`; `validation_steps` fewer).
            shuffle: the run's seeded order (exact on every layout), or the rows in order.
            callbacks: the user's own, called after distrib_tf's; a stage's partial epoch
                and its rest are one training to them (`on_train_begin` once).
            verbose: Keras's, on the chief; other workers print one line an epoch.

        Raises:
            InvalidRun: the model, the data or a number cannot run (exit code 2).
            resume.ResumeError: the workers' backups give no common step (exit code 2).
            sigterm.Preempted, nonfinite.NonFiniteLoss: see `distrib_tf.run.ending`.
        """
        if self.is_evaluator:
            raise InvalidRun(f"Run.fit on {self.task}. Expected a training task: an evaluator trains nothing.")
        train, validation_data = inputs.training_data(
            x, y, sample_weight=sample_weight, class_weight=class_weight, validation_split=validation_split,
            validation_data=validation_data, steps_per_epoch=steps_per_epoch)
        if self.is_chief:  # What batched data costs or cannot guarantee; an ignored batch_size.
            inputs.say(train, global_batch_size or batch_size, task=self.task)
        global_batch_size = inputs.batch_size_of(train, global_batch_size or batch_size)
        validation_batch_size = validation_batch_size or global_batch_size
        steps, val_steps = checks.check_fit(
            model, self.strategy, train, epochs=epochs, global_batch_size=global_batch_size,
            steps_per_epoch=steps_per_epoch, validation_data=validation_data, validation_steps=validation_steps,
            validation_batch_size=validation_batch_size)
        checks.check_initial_epoch(initial_epoch, epochs)
        stage = len(self._stages)
        self._fitted = True
        self.global_batch_size, self.steps_per_epoch, self.epochs = global_batch_size, steps, epochs
        options = self.options
        nonfinite.attach(model)
        if isinstance(train, examples_lib.Examples):
            self._split_rows(model, train, global_batch_size)
        local_sgd.compress_gradients(model.optimizer, options.allreduce_dtype)
        if options.sync == "step" and options.allreduce_dtype == "float32" and phases.is_multi_worker(self.strategy):
            step_logs.carry(model)  # One collective a step: the logs travel with the gradients.
        try:
            with routing.plain_fit(), sigterm.guarded():
                history = stage_lib.fit_stage(
                    self, model, train, validation_data, stage=stage, epochs=epochs, steps=steps, val_steps=val_steps,
                    global_batch_size=global_batch_size, validation_batch_size=validation_batch_size,
                    offset=initial_epoch * steps, shuffle=shuffle, callbacks=callbacks, verbose=verbose,
                    validation_freq=validation_freq)
                ending.end_fit(self)  # Every worker's files written; a SIGTERM from now on: 75 at once.
                return history
        finally:  # The user's model and optimizer as Keras left them (with the learning rate rollbacks left).
            local_sgd.release(model.optimizer)  # Its gradients all-reduced again, nothing else carried.
            schedules.settle(model, self.task)
            step_logs.release(model)  # The model is the user's again: its evaluate logs its metrics only.
            uneven.unweigh(model)
            nonfinite.detach(model)

    def _split_rows(self, model, train, global_batch_size: int) -> None:
        """Where a step's rows split unevenly over the replicas, each row weighs as in one
        process (`distrib_tf.keras.uneven`); a step leaving a replica none is said once."""
        replicas, rows = self.strategy.num_replicas_in_sync, train.num_examples
        if uneven.needed(rows, global_batch_size, replicas, full_batches=train.full_batches):
            reductions = uneven.reductions(model)
            if reductions <= uneven.MEANS:
                uneven.weigh_rows(model)
            elif reductions != {"sum"} and self.is_chief:
                print(f"{self.task}: losses reduced by {', '.join(sorted(map(str, reductions)))}: a step the replicas "
                      "split unevenly keeps Keras's per-replica arithmetic there (exact for means or sums alone)",
                      flush=True)
        if (last := uneven.empty_share(rows, global_batch_size, replicas, full_batches=train.full_batches)) \
                and self.is_chief:
            print(f"{self.task}: a step of {last} row(s) for {replicas} replicas leaves some none to train on: a "
                  "layer that reduces over its batch (BatchNormalization) gives NaN there; expected a batch_size "
                  f"giving every step at least {replicas} of the {rows} rows", flush=True)

    # Outputs and the end.

    def outputs(self) -> contextlib.AbstractContextManager:
        """The chief's outputs after `fit`: a SIGTERM inside exits 75 at once (a restart writes them again)."""
        return sigterm.saved(self.step)

    def save(self, model: keras.Model) -> str | None:
        """The chief writes `model.keras` and `serving/` under `model_dir`; returns that path."""
        with self.outputs():
            if not self.is_chief:
                return None
            return export.export_model(model, self.model_dir)[0]

    def end(self) -> None:
        """The clean end, on every worker: the chief writes `summary.json`; once every
        worker is here each keeps only its last backup of each `fit`, marked finished (the
        same script run again returns at once; `fresh_start` trains again), and a `finished`
        event is emitted. Called on leaving the `with` block or at the script's end;
        idempotent."""
        if self._ended:
            return
        self._ended = True
        tf.distribute.experimental_set_strategy(None)
        routing.deactivate(self)
        if not self._fitted:
            return
        path = os.path.join(self.model_dir, "summary.json")
        if self.is_chief:
            with self.outputs():
                backup.write_json_atomically(path, self.summary)
        # Backups go only once the chief's outputs are written: every worker meets here first,
        # at a barrier (an export may take longer than a collective timeout). A job killed
        # before this resumes at its last step on every worker and writes them again; a
        # worker waiting here when the chief is preempted in its export is preempted too.
        with self.outputs():
            try:
                phases.enter(self.strategy, "outputs_written")
            except Exception:  # pylint: disable=broad-except  (the chief gone: preempted, or dead)
                sigterm.check(self.step)
                raise
        sigterm.stop_watching()
        backup.WRITER.wait()  # (Every fit's end waited for its backups already.)
        for directory, run_id in reversed(self._stages):
            backup.retire_gone(directory, run=run_id, tasks=self.replica_tasks, below=2**62)  # Gone tasks' go.
            backup.finish(directory)  # Its last backup, for a rerun of the same script.
        self._let_go()
        final = self.summary.get("final") or {  # The last epoch's logs, where the script evaluated nothing.
            k: v for k, v in (self.summary.get("epochs") or [{}])[-1].items() if k != "epoch"}
        events.emit("finished", final=final, summary=path if self.is_chief else None)
        if not self.exit_on_error:  # (Else `ending` does, once every worker left together.)
            sigterm.settle(None)

    def _let_go(self) -> None:
        """Lets go of the backup directories held (`resume.hold`) for a next Run in this process."""
        while self._held:
            os.close(self._held.pop())

    def __enter__(self):
        return self

    def __exit__(self, kind, error, traceback):
        self._crashed = error is not None  # No clean end at exit either (`ending.take_uncaught`).
        if error is not None:  # The run ends here too: Keras's `fit` and the default strategy are the script's again.
            tf.distribute.experimental_set_strategy(None)
            routing.deactivate(self)
        ending.leave_block(self, error)
        if error is not None:  # (With exit_on_error, leave_block ended the process.)
            self._let_go()
        return False

