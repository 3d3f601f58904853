"""`python -m distrib_tf.launch` is `distrib-tf-launch`."""

import sys

from distrib_tf.launch.cli import main

sys.exit(main())
