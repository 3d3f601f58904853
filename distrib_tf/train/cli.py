"""The main job's command line: flags, then `TrainConfig`, then `train_and_evaluate`.

Usage:

    python -m distrib_tf.train [--model=cnn|transformer] [--dataset=NAME] [--epochs=N]
        [--global_batch_size=N] [--model_dir=DIR] [--strategy=auto] ...

With no flags it trains the CNN on the offline `shapes` dataset; `--model=transformer`
uses the offline `tokens` dataset. It reads `TF_CONFIG` when set, so the same command
runs as every worker of a cluster (see `distrib_tf.launch`). What it writes under
`model_dir`: `distrib_tf.train.job`.

Bad flags print one line and exit with code 2 (`distrib_tf.exit_codes`). This module only
parses flags: the work is `train_and_evaluate(config, model_dir)`, which a notebook can
call too.
"""

import dataclasses
import os
import signal
import sys

from absl import app
from absl import flags
from absl import logging as absl_logging

import distrib_tf
from distrib_tf import cluster
from distrib_tf import events
from distrib_tf import exit_codes
from distrib_tf import lifeline
from distrib_tf import trial
from distrib_tf.train.config import MODELS
from distrib_tf.train.config import TrainConfig

FLAGS = flags.FLAGS


def define_flags():
    """Defines the job's flags; called by the command line only, so imports define none."""
    flags.DEFINE_string("model", "cnn", f"Model: {', '.join(MODELS)}, or package.module:function, a builder "
                        "taking the dataset's description (distrib_tf.train.builders).")
    flags.DEFINE_string("dataset", "", "Dataset: a registered name, array_record:DIR, images:DIR, or "
                        "package.module:function returning the splits (default: the model's offline default).")
    flags.DEFINE_string("data_dir", None, "Where TFDS data was prepared.")
    flags.DEFINE_integer("epochs", 3, "Epochs to train.")
    flags.DEFINE_integer("global_batch_size", 64, "Batch size over all replicas.")
    flags.DEFINE_float("learning_rate", 1e-3, "Adam learning rate.")
    flags.DEFINE_string("model_dir", None, "Output directory (default: runs/MODEL).")
    flags.DEFINE_string("strategy", "auto", "auto, one_device, mirrored or multi_worker.")
    flags.DEFINE_integer("cpu_replicas", None, "Split the CPU into this many replicas.")
    flags.DEFINE_string("mixed_precision", "off", "off, bfloat16 or float16.")
    flags.DEFINE_boolean("float64", False, "Train in float64 (slow): to tell arithmetic from a bug, e.g. "
                         "that results do not depend on the layout beyond float32 rounding.")
    flags.DEFINE_integer("seed", 0, "Random seed.")
    flags.DEFINE_integer("steps_per_epoch", None, "Steps per epoch (default: one pass).")
    flags.DEFINE_float("collective_timeout", None, "Seconds before a stuck all-reduce fails.")
    flags.DEFINE_integer("backup_every_steps", None,
                         "Back up every N global steps too (default: at epoch ends only).")
    flags.DEFINE_integer("keep_checkpoints", 3, "The chief keeps the last N epoch checkpoints "
                         "(checkpoints/epochNNN.weights.h5) and deletes older ones.")
    flags.DEFINE_boolean("backup_in_background", True, "Write backups in the background: a step waits only "
                         "while the state is copied into memory.")
    flags.DEFINE_string("on_nan", "stop", "On a NaN or Inf loss: stop, or rollback to the last backup "
                        "with half the learning rate.")
    flags.DEFINE_integer("max_rollbacks", 3, "With --on_nan=rollback: roll back at most this often.")
    flags.DEFINE_string("sync", "step", "step (all-reduce gradients every step), every:N (each worker "
                        "applies its own; average the weights every N steps) or epoch (average once an "
                        "epoch): distrib_tf.keras.local_sgd.")
    flags.DEFINE_enum("outer_optimizer", None, ["average", "nesterov"], "Periodic sync's outer step "
                      "(default average; nesterov: DiLoCo's, rate 0.7 and momentum 0.9 by default).")
    flags.DEFINE_float("outer_learning_rate", None, "With --outer_optimizer=nesterov.")
    flags.DEFINE_float("outer_momentum", None, "With --outer_optimizer=nesterov.")
    flags.DEFINE_enum("allreduce_dtype", "float32", ["float32", "bfloat16", "float16"],
                      "Type gradients travel in, with --sync=step.")
    flags.DEFINE_boolean("fresh_start", False, "Start at step 0 beside backups of this run in --model_dir (each "
                         "worker deletes its own, and says so); by default the job resumes from them, on any layout.")
    flags.DEFINE_float("evaluator_idle_seconds", 3600.0, "An evaluator task gives up (exit 0, training goes on) "
                       "after this long without a new checkpoint, or 3 times the longest wait between two seen.")
    flags.DEFINE_string("profile_steps", None, "A,B: a TensorBoard profile of steps A to B (1-based) on "
                        "every worker, in model_dir/logs/<task>/.")


def config_from_flags() -> TrainConfig:
    """The flags, with a sweep trial's values in place of those it sweeps (`distrib_tf.trial`)."""
    return TrainConfig(**trial.params(**{
        field.name: getattr(FLAGS, field.name) for field in dataclasses.fields(TrainConfig)
    }))


def _fail(message: str, code: int = exit_codes.USAGE, *, now: bool = False):
    print(f"distrib-tf-train: error: {message}", file=sys.stderr, flush=True)
    events.emit("failed", error=message)
    if now:  # Input pipelines that failed still have threads: tearing the interpreter down aborts.
        sys.stdout.flush()
        os._exit(code)
    sys.exit(code)


def _help() -> str:
    """`--help`: what the job does, then each of its flags with its text and default (absl's own
    help lists absl's flags too, and exits 1)."""
    return ("usage: distrib-tf-train [--flag=value ...]\n\nTrains a Keras model (the CNN on the offline `shapes` "
            "dataset by default) on this process, or on every worker of a cluster when TF_CONFIG is set.\n\n"
            + "\n".join(line for line in FLAGS.module_help(__name__).splitlines()
                        if line.strip() and line.strip() != f"{__name__}:"))


def _parse_flags(argv):
    if any(arg in ("-h", "--help", "--helpshort", "-?") for arg in argv[1:]):
        print(_help())
        sys.exit(exit_codes.OK)
    try:
        return FLAGS(argv)
    except flags.Error as e:
        _fail(str(e).splitlines()[0])


def main(argv):
    early_sigterm = []  # Until TensorFlow is imported; then `sigterm` takes over.
    signal.signal(signal.SIGTERM, lambda signum, frame: early_sigterm.append(signum))
    lifeline.die_with_parent()  # Started by a Ray worker: SIGTERM (a backup, exit 75) when it dies.
    absl_logging.set_verbosity(absl_logging.WARNING)  # TensorFlow's INFO lines drown the progress.
    distrib_tf.log_to_stderr()
    if len(argv) > 1:
        _fail(f"unexpected arguments {argv[1:]}; flags look like --epochs=3")
    try:  # The flags and TF_CONFIG first, without TensorFlow: a typo is answered in a moment.
        config = config_from_flags()
        tf_config = cluster.load_tf_config()
        if tf_config is not None and tf_config[1].type != "evaluator":
            config.check_replicas(tf_config[0].num_workers)
        config.check_replicas(config.cpu_replicas or 1)
    except ValueError as e:  # ClusterSpecError is a ValueError.
        _fail(str(e))
    # pylint: disable=import-outside-toplevel  (TensorFlow from here on)
    from distrib_tf.data import records
    from distrib_tf.keras import sigterm
    from distrib_tf.run import ending
    from distrib_tf.train import evaluator
    from distrib_tf.train.job import prepare_job
    from distrib_tf.train.job import run_job

    # SIGTERM exits 75 from here on, in any phase (`distrib_tf.keras.sigterm`).
    sigterm.install()
    sigterm.set_task(str(tf_config[1]) if tf_config else "chief:0")
    if early_sigterm:
        sigterm.request()
    try:
        with sigterm.saved(None):
            job = prepare_job(config, FLAGS.model_dir or os.path.join("runs", config.model))
    except (ValueError, FileNotFoundError) as e:
        _fail(str(e))
    except sigterm.Preempted as e:
        ending.exit_for(e, str(tf_config[1]) if tf_config else "chief:0", program="distrib-tf-train")
    if job.is_evaluator:  # It saves nothing: a SIGTERM ends it as usual.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        summary = run_job(job)
    except evaluator.EvaluatorTimeout as e:  # Its own loss: the training tasks go on (exit 0).
        print(f"distrib-tf-train: warning: {e}; the evaluator gives up, training goes on", file=sys.stderr,
              flush=True)
        events.emit("evaluator_gave_up", error=str(e))
        os._exit(exit_codes.OK)
    except Exception as e:  # 2, 65 and 75 with one line; else the root cause, then the traceback.
        if (message := records.data_error_in(e)) is not None:  # A shard changed after prepare.
            _fail(f"{job.task}: {message}", now=True)
        ending.exit_for(e, job.task, program="distrib-tf-train", strategy=job.strategy, is_chief=job.is_chief)
        raise
    if job.is_chief and os.environ.get(cluster.VERBOSE_ENV) != "1":  # Its figures were the last epoch's line.
        print(f"summary: {os.path.join(job.model_dir, 'summary.json')}", flush=True)
    elif job.is_chief and "accuracy" in summary.get("final", {}):
        chance = f" (chance {1 / job.info.num_classes:.4f})" if hasattr(job.info, "num_classes") else ""
        print(f"final accuracy {summary['final']['accuracy']:.4f}{chance} on {config.dataset} test; "
              f"summary: {os.path.join(job.model_dir, 'summary.json')}", flush=True)
    elif job.is_chief:
        print(f"final {summary.get('final', {})} on {config.dataset}; "
              f"summary: {os.path.join(job.model_dir, 'summary.json')}", flush=True)
    if job.strategy_name == "MultiWorkerMirroredStrategy" and not job.is_evaluator:
        ending.leave_together(job.strategy, job.is_chief, exit_now=True)


def run():
    """Console script `distrib-tf-train`."""
    define_flags()
    app.run(main, flags_parser=_parse_flags)

