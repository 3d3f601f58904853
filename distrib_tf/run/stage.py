"""A stage of a run: one `fit` call, resumed where its backups agree, to its last epoch.

Every worker agrees on the step to resume from (`distrib_tf.keras.resume`); a stage resumed
inside an epoch trains that epoch's remaining steps, then goes on by epochs; a NaN rolls
back to the last common backup with half the learning rate (`on_nan="rollback"`). The
guarantees come as callbacks, in their order: distrib_tf's, then `HideOwnLogs`, then the
user's, which see one training (`user_view.Segments`).
"""

import hashlib
import json
import os
import sys

import keras
import numpy as np

from distrib_tf import cluster
from distrib_tf import trial
from distrib_tf.data import examples as examples_lib
from distrib_tf.keras import backup
from distrib_tf.keras import callbacks as callbacks_lib
from distrib_tf.keras import ema
from distrib_tf.keras import held_optimizers
from distrib_tf.keras import local_sgd
from distrib_tf.keras import nonfinite
from distrib_tf.keras import preemption
from distrib_tf.keras import progress
from distrib_tf.keras import pruning
from distrib_tf.keras import replica_state
from distrib_tf.keras import resume as resume_lib
from distrib_tf.keras import sigterm
from distrib_tf.keras import steps as steps_lib
from distrib_tf.keras import user_view
from distrib_tf.keras import worker_backup as worker_backup_lib
from distrib_tf.run import export
from distrib_tf.run import inputs
from distrib_tf.run import schedules


def fit_stage(run, model, train, validation_data, *, stage, epochs, steps, val_steps, global_batch_size,
              validation_batch_size, offset, shuffle, callbacks, verbose, validation_freq):
    """One `fit` call of the run's (`Run.fit` checked its arguments); returns its History."""
    options = run.options
    run_id = options.run_id or identity(run, model, train, global_batch_size, steps)
    if stage or offset:
        run_id = f"{run_id}-fit{stage + 1}" + (f"-from{offset}" if offset else "")
    run.run_id = run_id
    backup_dir = run.backup_dir if not stage else os.path.join(  # The second fit's in backup/fit2/.
        run.model_dir, "backup", f"fit{stage + 1}", backup.task_dirname(run.task))
    with sigterm.saved(None):  # Start-up: a SIGTERM leaves the backups as they were.
        backup.make_private_dirs(run.model_dir, tighten=True)  # Every worker's: its backups live there.
        grace = float(os.environ.get(sigterm.GRACE_ENV) or 60)
        run._held.append(resume_lib.hold(backup_dir, wait_seconds=2 * grace))  # A task's old process ends first.
        if run.fresh_start and (cleared := backup.clear_run(backup_dir, run=run_id)):
            print(f"{run.task} starts at step 0 (fresh_start): deleted the backups of steps {cleared} of "
                  f"this run in {os.path.dirname(backup_dir)}", flush=True)
        elif retired := backup.retire_finished(backup_dir, run=run_id):
            print(f"{run.task} starts at step 0: its backup of step {retired[-1]} in {backup_dir} is a finished "
                  "run's of another script (another model, optimizer, data or batch); deleted", flush=True)
            run._held.append(resume_lib.hold(backup_dir, wait_seconds=2 * grace))
        run._stages.append((backup_dir, run_id))
        resume = resume_lib.agree_on_resume(model, backup_dir, run=run_id, task=run.task)
    start_step, meta = offset + resume.step, resume.meta  # What the step's backup holds beside weights.
    rollbacks = schedules.redo(model, meta.get("rollbacks") or [])  # The learning rate they left.
    if resume.step:
        source = _described(resume.source, run.replica_tasks)
        if meta.get("finished") and (start_step >= epochs * steps or meta.get("stopped")):
            print(f"{run.task}: fit {stage + 1} finished at step {start_step} before, in {source}: "
                  "returning its History and final state (fresh_start=True trains it again)", flush=True)
        else:
            print(f"{run.task} resumes at step {start_step} (epoch {start_step // steps + 1}, "
                  f"step {start_step % steps} of it) from {source}", flush=True)
            if isinstance(train, examples_lib.DatasetFn):
                print(f"{run.task} skips the first {start_step} batches of {train.name}: the same batches as "
                      "before only if it is deterministic", flush=True)
            elif getattr(train, "skips", False):
                _say_replay(run, train, start_step, meta)
    if getattr(train, "unreplayable", ()) and run.is_chief:
        print(f"{run.task}: {train.name} draws in an order its threads decide ({', '.join(train.unreplayable)}): "
              "a resumed or repeated run reads other values there (seed a stateless op, e.g. "
              "tf.random.stateless_uniform, or map sequentially)", flush=True)
    run.resumed_at_step = start_step
    stage_steps = steps_lib.BatchSteps(steps, done=resume.step)  # What every guarantee counts: the batches.
    users = user_view.Segments(user_view.without_backup_and_restore(callbacks or (), run.task), model,
                               states=meta.get("callbacks"), arrays=backup.read_arrays(resume.source, meta),
                               task=run.task, params={"verbose": verbose, "epochs": epochs, "steps": steps})
    worker_backup = worker_backup_lib.WorkerBackup(
        backup_dir, run=run_id, task=run.task, steps_per_epoch=steps, every_steps=options.backup_every_steps,
        history=[h for h in meta.get("history", []) if h["epoch"] * steps <= start_step],
        callbacks=users.callbacks, layout=run.replica_tasks, rollbacks=rollbacks,
        asynchronous=options.backup_in_background, steps=stage_steps, epoch_end_saves=False,  # SaveOnPreemption's.
        epoch_metrics=meta.get("metrics") if resume.source == backup_dir else None)  # This task's own sums.
    rollbacks = worker_backup.rollbacks  # Kept in every backup from now on.
    timer = callbacks_lib.EpochTimer(global_batch_size)
    every = options.sync_every()
    name, rate, momentum = options.outer()
    exact = (resume.all_own and run.strategy.num_replicas_in_sync == run.workers  # Each replica's own weights,
             and name == "average")  # (nesterov's outer momentum and anchor live in memory).
    periodic = [] if every is None else [local_sgd.PeriodicSync(
        run.strategy, every or steps, outer=name, outer_learning_rate=rate, outer_momentum=momentum,
        last_step=epochs * steps - offset, average_first=not (resume.step and exact), steps=stage_steps)]
    if periodic and resume.step and not exact:
        print(f"{run.task}: periodic sync resumed from backups that are not every replica's own (another layout, "
              "a peer's state, several replicas a worker) or with the nesterov outer step (its momentum is not "
              "backed up): the weights are averaged first; the run is not the uninterrupted one's exactly",
              flush=True)
    hide = user_view.HideOwnLogs()
    progbar = user_view.StageProgbar(epochs, steps)
    ours = [
        timer, *periodic,
        nonfinite.StopOnNonFinite(workers=list(run.replica_tasks), steps_per_epoch=steps,  # Before any other.
                                  steps=stage_steps, defer=options.on_nan == "stop" and any(
                                      isinstance(c, keras.callbacks.TerminateOnNaN) for c in callbacks or ())),
        *([] if periodic else [replica_state.AverageReplicaState()]),  # Moving statistics: one value, each step.
        progress.Progress(task=run.task, workers=list(run.replica_tasks), epochs=epochs,
                          steps_per_epoch=steps, global_batch_size=global_batch_size, fit=stage + 1),
        callbacks_lib.ScalarTensorBoard(os.path.join(run.model_dir, "logs"), write_graph=False),
    ]
    if not run.is_chief and cluster.speaks():  # DISTRIB_TF_VERBOSE=1: every worker says its epochs.
        ours.append(callbacks_lib.EpochLine(run.task, epochs))
    # The user's see each step after the NaN check and before its backup, which so holds their state.
    checkpoint = callbacks_lib.ChiefCheckpoint(run.model_dir, run_id, keep=options.keep_checkpoints, stage=stage)
    save_on_preemption = preemption.SaveOnPreemption(worker_backup)
    keep = ema.KeepWeightsUntilLast(lambda: users.last)  # Keras's EMA swap: at the stage's last fit only.
    every_callback = [stage_steps, keep.putting_back,  # The step first: every callback after it reads it.
                      preemption.EpochEndBegins(save_on_preemption),  # Where epoch ends begin.
                      *ours, hide, users, worker_backup, checkpoint, save_on_preemption,
                      *([pruning.PruneAtEpochEnd(worker_backup, is_chief=run.is_chief, fit=stage + 1)]
                        if trial.prunes() else []),
                      progbar, keep]
    if verbose == "auto":
        verbose = 1 if sys.stdout.isatty() else 2
    verbose = verbose if run.is_chief else 0  # The chief speaks for the job (`EpochLine` above for the rest).
    validation = None if validation_data is None else run.distribute(  # Keras reads it every epoch.
        validation_data, global_batch_size=validation_batch_size,
        one_pass=isinstance(validation_data, examples_lib.Batches))
    history = {}
    step, last_step = start_step, epochs * steps
    # Several steps an execution: one `fit` an epoch, on that epoch's batches alone, so that an
    # execution ends at the epoch's end as on Keras's own finite data (an endless stream with
    # `steps_per_epoch` runs whole executions past it: 12 steps an epoch of 10 in executions of 4).
    # A tf.data.Dataset is replayed to the stage's step once; each later epoch is one fresh pass
    # of it (`replayed`), one iterator an epoch as Keras's `fit` makes them.
    epochwise = (model.steps_per_execution or 1) > 1 and not isinstance(train, examples_lib.DatasetFn)
    replayed = False
    keras_fit = super(keras.Model, model).fit  # Keras's own: not a model library's `fit`, which called this one.
    model.stop_training = bool(meta.get("stopped"))  # A callback ended the stage there (EarlyStopping).
    held = None  # A tf.data.Dataset: one iterator for the stage (`inputs.OneIterator`).
    trained = False  # Whether a Keras fit ran here (else the stage came back finished, or at its end).
    while step < last_step and not model.stop_training:
        if held is None and getattr(train, "skips", False) and not epochwise:
            held = inputs.OneIterator(run.distribute(train, global_batch_size=global_batch_size, start_step=step,
                                                     one_pass=False))
        epoch, done = divmod(step, steps)
        until = epoch + 1 if done or epochwise else epochs  # A partial epoch alone, then the rest.
        users.last, users.skipped, progbar.skipped = until == epochs, done, done
        start, replayed = (step % steps if replayed else step), epochwise and getattr(train, "skips", False)
        stage_steps.begin(step - offset)
        try:
            fitted = keras_fit(
                held or run.distribute(train, global_batch_size=global_batch_size, start_step=start, shuffle=shuffle,
                                       one_pass=epochwise),
                initial_epoch=epoch, epochs=until, steps_per_epoch=None if epochwise else steps - done,
                validation_data=validation, validation_steps=val_steps, validation_freq=validation_freq,
                callbacks=every_callback, verbose=verbose, shuffle=False,  # The pipeline shuffles.
            )
        except nonfinite.NonFiniteLoss as e:
            worker_backup.flush()
            if isinstance(train, examples_lib.Examples):
                nonfinite.name_input_culprits(e, run.strategy, run.replica_tasks, run.distribute(
                    train, global_batch_size=global_batch_size, start_step=offset + e.step - 1, shuffle=shuffle,
                    one_pass=False))
            if e.where == "input batch" and options.on_nan == "rollback":
                print(f"{run.task}: the NaN or Inf is in the input batch of step {e.step}: a rollback would "
                      "train into it again; stopping (fix or filter the data)", flush=True)
            if options.on_nan == "stop" or len(rollbacks) == options.max_rollbacks or e.where == "input batch":
                run.step = e.step
                raise
            step = offset + roll_back(run, model, e)
            held, replayed = None, False  # Replayed from the step rolled back to.
            rollbacks.append({"at_step": e.step, "to_step": step,
                              "learning_rate": float(keras.ops.convert_to_numpy(model.optimizer.learning_rate))})
            worker_backup.history = [h for h in worker_backup.history if h["epoch"] * steps <= step]
            worker_backup.saved_step, worker_backup.step = None, step - offset
            worker_backup.save()  # The step rolled back to, with the rollback: a restart goes on from it.
            continue
        except Exception as e:  # In an epoch's end, a peer that left at once fails the collectives still ahead.
            if isinstance(e, preemption.Preempted) or save_on_preemption.kept is None or not sigterm.requested():
                raise
            worker_backup.flush()
            raise preemption.Preempted(save_on_preemption.kept) from e
        step, trained = (fitted.epoch[-1] + 1) * steps if fitted.epoch else until * steps, True
        if model.stop_training and not users.last:  # Stopped by a callback in a partial epoch.
            users.last = True
            users.on_train_end()
    users.restore()  # A stage that came back finished: its callbacks' state all the same.
    run.step = step
    _back_up_the_end(worker_backup, model, step - offset, again=trained)
    for record in worker_backup.history:
        for key, value in record.items():
            if key != "epoch":  # A metric of several values is an array, as in Keras's History.
                history.setdefault(key, []).append(np.asarray(value, "float32") if isinstance(value, list) else value)
    epochs_done = [record["epoch"] - 1 for record in worker_backup.history]
    run.summary.update({
        "run_id": run_id,
        "strategy": run.strategy_name,
        "workers": run.workers,
        "replicas": run.strategy.num_replicas_in_sync,
        "resumed_at_step": start_step,
        **({"params": trial.seen()} if trial.seen() else {}),  # The script's `distrib_tf.params`.
        "rollbacks": rollbacks,
        "epochs": _every_epoch(worker_backup.history, hide.epochs),
        "examples_per_second": timer.steady_rate(),
        "first_step_unix_time": timer.first_step_at,
        "epoch_end_unix_times": timer.ended_at, "epoch_step_seconds": timer.seconds,
        "weights_sha256": export.weights_fingerprint(model),
        "backups": {"count": len(worker_backup.blocked_seconds),  # What they cost the steps, and the writer.
                    "blocked_seconds": sum(worker_backup.blocked_seconds),
                    "in_background": options.backup_in_background,
                    "write_seconds": backup.WRITER.write_seconds},
        "periodic_sync": {"syncs": periodic[0].syncs, "bytes_per_worker": periodic[0].bytes_per_worker}
        if periodic else None,
    })
    if stage:
        run.summary.setdefault("stages", []).append({k: run.summary[k] for k in ("run_id", "resumed_at_step",
                                                                                   "epochs", "rollbacks")})
    result = keras.callbacks.History()
    result.set_model(model)
    result.history, result.epoch = history, epochs_done
    result.params = {"epochs": epochs, "steps": steps, "verbose": verbose}
    model.history = result
    return result

def identity(run, model, train, global_batch_size: int, steps: int) -> str:
    """What a backup must match to be resumed: whatever changes the arithmetic."""
    described = {
        "variables": [(v.path, tuple(v.shape), str(v.dtype)) for v in model.variables],
        "optimizer": [type(model.optimizer).__name__, _config(model.optimizer)],
        "data": getattr(train, "fingerprint", "") or train.name, "global_batch_size": global_batch_size,
        "steps_per_epoch": steps, "seed": run.options.seed, "sync": run.options.sync,
        "outer": run.options.outer(), "allreduce_dtype": run.options.allreduce_dtype,
    }
    held = held_optimizers.held(model)  # A GAN's own optimizers (none: the identity as before).
    if held:
        described["held_optimizers"] = [[name, type(o).__name__, _config(o)] for name, o in held]
    return hashlib.sha256(json.dumps(described, sort_keys=True, default=str).encode()).hexdigest()[:16]

def _config(optimizer) -> dict:
    """An optimizer's configuration, its name aside (Keras numbers it)."""
    config = optimizer.get_config()
    config.pop("name", None)
    return config


def _back_up_the_end(worker_backup, model, step: int, *, again: bool) -> None:
    """The stage's last backup holds the state Keras's `fit` returned, after its end
    (`finalize_variable_values`'s EMA swap, `on_train_end`: EarlyStopping's best weights), for
    a rerun of the same script to return; `again`: the epoch end's backup of that step, taken
    before, is taken again. Else one is taken only if this worker holds none of the step (its
    state came from a peer's backup)."""
    if not again and any(b["step"] == step for b in backup.list_backups(worker_backup.directory)):
        return
    worker_backup.set_model(model)
    worker_backup.step, worker_backup.saved_step = step, None  # (`saved_step`: the variables are taken again.)
    worker_backup.save()
    worker_backup.flush()


def roll_back(run, model, error) -> int:
    """Restores the newest backup and halves the learning rate."""
    optimizer = model.optimizer
    rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate)) / 2  # Before the backup restores it.
    step = resume_lib.agree_on_resume(model, run._stages[-1][0], run=run.run_id, task=run.task, include_start=True).step
    if not schedules.halve(model):
        optimizer.learning_rate = rate
    print(f"{run.task} {error} Rolled back to step {step}; learning rate halved to "
          f"{float(keras.ops.convert_to_numpy(optimizer.learning_rate)):.3g}.", flush=True)
    return step



def _say_replay(run, train, start_step: int, meta: dict) -> None:
    """One line: a tf.data.Dataset is replayed to the step; and what a new layout changes."""
    print(f"{run.task} replays {train.name} to step {start_step} (reading its {start_step} batches): the "
          "uninterrupted run's batches when its randomness is seeded", flush=True)
    layout = meta.get("layout")
    if layout is not None and len(set(layout)) != len(set(run.replica_tasks)):
        print(f"{run.task}: the backup is of {len(set(layout))} worker(s), this run has "
              f"{len(set(run.replica_tasks))}: each worker's pipeline replays this layout's shard of "
              f"{train.name}, so the batches from step {start_step} on are this layout's, not the "
              "uninterrupted run's", flush=True)


def _described(source: str | None, tasks) -> str:
    """Where a resumed state came from, for the line that says so."""
    if source is None:
        return "a peer (none here: the state came from a worker that holds it)"
    if os.path.basename(source) not in {backup.task_dirname(t) for t in tasks}:
        return f"{source} (a task this layout does not have)"
    return source


def _every_epoch(history: list, measured: list) -> list:
    """`summary.json`'s epochs: every epoch of the stage (the user's logs, kept in the backups
    across restarts), with distrib_tf's figures for those this process trained."""
    ours = {record["epoch"]: record for record in measured}
    return [{**ours.get(record["epoch"], {}), **record} for record in history]
