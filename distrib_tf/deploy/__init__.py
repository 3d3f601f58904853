"""The same job on an engine people already run: Kubernetes (`kubernetes`), Slurm (`slurm`)
and Ray Train (`ray_train`).

`distrib-tf-export` (`distrib_tf.deploy.cli`) writes the files of the first two;
`distrib-tf-ray` runs the job under Ray. No TensorFlow here.
"""

GRACE_MARGIN_SECONDS = 10


def launcher_grace(engine_grace_seconds: int) -> int:
    """The launcher's `--grace_period` inside an engine's: the workers agree a step, back
    it up and exit 75 within it, and the launcher still has `GRACE_MARGIN_SECONDS` to kill
    stragglers and report before the engine's SIGKILL. Pure.

    Example:

        >>> launcher_grace(120)
        110
    """
    return max(engine_grace_seconds - GRACE_MARGIN_SECONDS, 1)
