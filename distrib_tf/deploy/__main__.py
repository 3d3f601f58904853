"""`python -m distrib_tf.deploy` is `distrib-tf-export`."""

import sys

from distrib_tf.deploy.cli import main

sys.exit(main())
