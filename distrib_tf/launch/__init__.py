"""The launcher: start the tasks of a cluster spec on this host and keep the job alive.

The manual is `distrib_tf.launch.cli`'s docstring (`python -m distrib_tf.launch --help`).
No TensorFlow in this package.
"""

from distrib_tf.launch.cli import command_line
from distrib_tf.launch.cli import config_from_args
from distrib_tf.launch.cli import main
from distrib_tf.launch.cli import main_job_command
from distrib_tf.launch.cli import parse_args
from distrib_tf.launch.supervise import LaunchConfig
from distrib_tf.launch.supervise import LaunchResult
from distrib_tf.launch.supervise import run
from distrib_tf.launch.supervise import task_env

__all__ = [
    "LaunchConfig",
    "LaunchResult",
    "command_line",
    "config_from_args",
    "main",
    "main_job_command",
    "parse_args",
    "run",
    "task_env",
]
