"""The one argument parser of the argparse command lines: one-line errors, exit 2, defaults in help.

The launcher, export, sweep and data-preparation CLIs take a command after `--`
(`nargs=REMAINDER`) and are also called as libraries (a notebook builds launcher command
lines; a sweep starts launchers), so they use argparse, which keeps no global state;
the main job, a TensorFlow program, uses absl flags like TensorFlow's own tools.
This module imports no TensorFlow.
"""

import argparse
import sys

from distrib_tf import exit_codes

REMAINDER = argparse.REMAINDER


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` where there is a default to show (not for None or a switch)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An `ArgumentParser` whose errors are one line on stderr and exit code 2."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        sys.exit(exit_codes.USAGE)


def command_after(remainder: list[str]) -> list[str]:
    """The command of a `nargs=REMAINDER` argument, without its leading `--`."""
    return remainder[1:] if remainder[:1] == ["--"] else remainder
