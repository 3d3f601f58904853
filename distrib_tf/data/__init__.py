"""The main job's data: datasets by name, an order that no layout changes, readers by index.

- `registry`: the datasets and what each one is;
- `order`: which example ids each replica trains on at each global step;
- `readers`: any dataset's description (`load_info`) and its examples, read by index and
  decoded in the graph (`tfds_source` for TFDS);
- `pipeline`: `make_dataset_fn`, the three together for `tf.distribute`;
- `examples`: any user's data read by id (`from_arrays`, `from_source`, `from_images`,
  `load`), and the `tf.data` escape hatch (`from_dataset_fn`): what `distrib_tf.Run` trains on;
- `batches`: Keras's batched inputs as Keras's `fit` reads them (`from_dataset`,
  `from_py_dataset`, `from_generator`);
- `records`, `prepare`: ArrayRecord shards on disk, and `python -m distrib_tf.data prepare`.
"""

from distrib_tf.data.batches import from_dataset
from distrib_tf.data.batches import from_generator
from distrib_tf.data.batches import from_py_dataset
from distrib_tf.data.cli import main
from distrib_tf.data.examples import Batches
from distrib_tf.data.examples import DatasetFn
from distrib_tf.data.examples import Examples
from distrib_tf.data.examples import from_arrays
from distrib_tf.data.examples import from_dataset_fn
from distrib_tf.data.examples import from_images
from distrib_tf.data.examples import from_source
from distrib_tf.data.examples import load
from distrib_tf.data.pipeline import make_dataset_fn
from distrib_tf.data.pipeline import make_examples_fn
from distrib_tf.data.readers import check_random_access
from distrib_tf.data.readers import load_info
from distrib_tf.data.readers import load_source
from distrib_tf.data.records import DataError
from distrib_tf.data.registry import DATASETS
from distrib_tf.data.registry import TEXT_SEQ_LEN
from distrib_tf.data.registry import TEXT_VOCAB_SIZE
from distrib_tf.data.registry import DatasetInfo
from distrib_tf.data.registry import check_dataset_name
from distrib_tf.data.registry import check_global_batch_size
from distrib_tf.data.registry import steps_per_epoch

# A user's calls: their data as `distrib_tf.Run` reads it (the other names above are the main
# job's and the pipeline's, importable from here for them, and documented in their modules).
__all__ = [
    "DataError",
    "Examples",
    "from_arrays",
    "from_dataset",
    "from_dataset_fn",
    "from_images",
    "from_py_dataset",
    "from_source",
    "load",
]
