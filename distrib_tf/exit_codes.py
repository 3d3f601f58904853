"""Every exit code of distrib_tf's commands, and what it tells a scheduler.

The main job (`python -m distrib_tf.train`), the launcher, the sweep and the exporters
all exit with these; the launcher forwards a task's, the Kubernetes and Slurm files that
`distrib-tf-export` writes act on them:

- 0 `OK`: every task succeeded.
- 1 `FAILED`: a task failed and no restarts remain; a scheduler may retry.
- 2 `USAGE`: bad input (a flag, a spec, a dataset), nothing lost; a retry fails again.
- 3 `PRUNED`: a sweep pruned the trial after an epoch; every worker backed up that step
  (a larger budget can continue it). Not retried.
- 65 `NONFINITE` (`EX_DATAERR`): a NaN or Inf loss stopped every worker at one step; a
  retry resumes into it again.
- 75 `PREEMPTED` (`EX_TEMPFAIL`): SIGTERM, every worker backed up one agreed step; start
  the job again and it resumes there (the Slurm script requeues, the Kubernetes Job
  recreates the pod without counting a failure).
- 130 `INTERRUPTED`: Ctrl-C, or SIGTERM to a job that did not save.

No TensorFlow here.
"""

OK = 0
FAILED = 1
USAGE = 2
PRUNED = 3
NONFINITE = 65
PREEMPTED = 75
INTERRUPTED = 130

RETRYABLE_FROM = 128  # Kubeflow Training Operator's `ExitCode` policy: 128 and up restart the pod.


def for_tfjob(code: int) -> int:
    """`code` as the Training Operator's `ExitCode` restart policy should read it: what a
    retry can cure (1, a crash or a dead peer; 75, preempted with state saved; 130) becomes
    128 + code, retryable; 0, 2 (bad input), 3 (pruned) and 65 (NaN stop) stay. Pure.

    Example:

        >>> [for_tfjob(c) for c in (OK, FAILED, USAGE, PRUNED, NONFINITE, PREEMPTED, 137)]
        [0, 129, 2, 3, 65, 203, 137]
    """
    if code in (OK, USAGE, PRUNED, NONFINITE) or code >= RETRYABLE_FROM:
        return code
    return RETRYABLE_FROM + code
