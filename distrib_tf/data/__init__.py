"""The main job's data: datasets by name and `tf.data` pipelines that give every worker its part.

What each dataset is and how the pipelines order and split it: `distrib_tf.data.pipeline`.
`python -m distrib_tf.data prepare` writes a dataset as shards (`distrib_tf.data.cli`).
"""

from distrib_tf.data.cli import main
from distrib_tf.data.pipeline import DATASETS
from distrib_tf.data.pipeline import TEXT_SEQ_LEN
from distrib_tf.data.pipeline import TEXT_VOCAB_SIZE
from distrib_tf.data.pipeline import DatasetInfo
from distrib_tf.data.pipeline import check_dataset_name
from distrib_tf.data.pipeline import check_global_batch_size
from distrib_tf.data.pipeline import load_info
from distrib_tf.data.pipeline import load_source
from distrib_tf.data.pipeline import make_dataset_fn
from distrib_tf.data.pipeline import steps_per_epoch
from distrib_tf.data.pipeline import write_tfrecords

__all__ = [
    "DATASETS",
    "TEXT_SEQ_LEN",
    "TEXT_VOCAB_SIZE",
    "DatasetInfo",
    "check_dataset_name",
    "check_global_batch_size",
    "load_info",
    "load_source",
    "main",
    "make_dataset_fn",
    "steps_per_epoch",
    "write_tfrecords",
]
