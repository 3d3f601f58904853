"""`python -m distrib_tf.train` is `distrib-tf-train`."""

from distrib_tf.train.cli import run

run()
