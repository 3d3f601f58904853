"""Experiments on top of the launcher: notebook jobs (`notebook`) and Optuna sweeps (`sweep`)."""
