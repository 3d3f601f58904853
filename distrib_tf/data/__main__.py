"""`python -m distrib_tf.data`: see `distrib_tf.data.cli`."""

import sys

from distrib_tf.data.cli import main

sys.exit(main())
