"""The main job's data: datasets by name, an order that no layout changes, readers by index.

- `registry`: the datasets and what each one is;
- `order`: which example ids each replica trains on at each global step;
- `readers`: any dataset's description (`load_info`) and its examples, read by index and
  decoded in the graph (`tfds_source` for TFDS);
- `pipeline`: `make_dataset_fn`, the three together for `tf.distribute`;
- `records`, `prepare`: ArrayRecord shards on disk, and `python -m distrib_tf.data prepare`.
"""

from distrib_tf.data.cli import main
from distrib_tf.data.pipeline import make_dataset_fn
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

__all__ = [
    "DATASETS",
    "TEXT_SEQ_LEN",
    "TEXT_VOCAB_SIZE",
    "DataError",
    "DatasetInfo",
    "check_dataset_name",
    "check_global_batch_size",
    "check_random_access",
    "load_info",
    "load_source",
    "main",
    "make_dataset_fn",
    "steps_per_epoch",
]
