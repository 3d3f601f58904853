"""Datasets by name: what each one is, checked before anything trains.

- offline defaults, drawn by numpy from fixed seeds, no download (`distrib_tf.data.offline`):
  `shapes` (28x28 images of 10 kinds of shape, the CNN's) and `tokens` (sequences of 64
  tokens, the transformer's); held in memory, they are small;
- TFDS datasets `mnist`, `fashion_mnist`, `cifar10` and `imdb_reviews`, prepared
  beforehand as ArrayRecord in `data_dir` (`file_format='array_record'`, or
  `tfds convert_format`) and read by index through `tfds.data_source`;
- `array_record:DIR`: ArrayRecord shards written by `python -m distrib_tf.data prepare`
  (`distrib_tf.data.records`), from a registered dataset, TFRecord files or an image folder.

TFRecord files (`tfrecord:DIR`) and image folders (`images:DIR`) have no random access:
`prepare` converts them once.
"""

import dataclasses
import os

from distrib_tf.data import offline
from distrib_tf.data import records

IMAGE_DATASETS = ("mnist", "fashion_mnist", "cifar10")
TEXT_DATASETS = ("imdb_reviews",)
TFDS_DATASETS = IMAGE_DATASETS + TEXT_DATASETS
OFFLINE_DATASETS = ("shapes", "tokens")
DATASETS = OFFLINE_DATASETS + TFDS_DATASETS
TEXT_VOCAB_SIZE = 8192
TEXT_SEQ_LEN = 128
PREPARED = "array_record:"
CONVERTIBLE = ("tfrecord:", "images:")  # Sources of `prepare`, not of training.


@dataclasses.dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know of a dataset.

    Attributes:
        name: registered name, or `array_record:DIR`.
        kind: `"image"` or `"text"`.
        num_classes: number of labels.
        input_shape: one example's shape (for text: `(seq_len,)` of token ids).
        vocab_size: token ids are below this (text only; 0 for images).
        num_examples: examples per split, e.g. `{"train": 8192, "test": 2048}`.
        data_dir: where TFDS data or ArrayRecord shards live, if anywhere.
    """

    name: str
    kind: str
    num_classes: int
    input_shape: tuple[int, ...]
    vocab_size: int = 0
    num_examples: dict = dataclasses.field(default_factory=dict)
    data_dir: str | None = None


OFFLINE = {
    "shapes": (offline.make_shapes, DatasetInfo(
        "shapes", "image", 10, (offline.SHAPES_SIZE, offline.SHAPES_SIZE, 1),
        num_examples=offline.SHAPES_SPLITS)),
    "tokens": (offline.make_tokens, DatasetInfo(
        "tokens", "text", len(offline.TOKENS_MARKERS), (offline.TOKENS_LEN,),
        vocab_size=offline.TOKENS_VOCAB, num_examples=offline.TOKENS_SPLITS)),
}


def _prepare_hint(name: str) -> str:
    return (f"`python -m distrib_tf.data prepare --dataset={name} --out=DIR` converts it once to ArrayRecord; "
            "then train with --dataset=array_record:DIR")


def check_dataset_name(name: str) -> None:
    """Raises `ValueError` unless `name` can be trained on; reads nothing."""
    if name in DATASETS or name.startswith(PREPARED):
        return
    if name.startswith(CONVERTIBLE):
        raise ValueError(f"Invalid value for `--dataset`. Received: {name!r}, which has no random access. "
                         f"Expected a dataset read by index: {_prepare_hint(name)}.")
    raise ValueError(
        f"Invalid value for `--dataset`. Received: {name!r}. Expected one of "
        f"{', '.join(DATASETS)}, or array_record:DIR (written by "
        "`python -m distrib_tf.data prepare`)."
    )


def prepared_info(directory: str) -> DatasetInfo:
    meta = records.load_meta(directory)
    return DatasetInfo(f"{PREPARED}{directory}", meta["kind"], meta["num_classes"], tuple(meta["input_shape"]),
                       vocab_size=meta.get("vocab_size", 0), num_examples=meta["num_examples"],
                       data_dir=os.path.abspath(directory))


def check_global_batch_size(global_batch_size: int, num_replicas: int) -> int:
    """Returns the per-replica batch size, or raises if the global one does not divide."""
    if isinstance(global_batch_size, bool) or not isinstance(global_batch_size, int) or global_batch_size < 1:
        raise ValueError(
            f"Invalid value for `--global_batch_size`. Received: {global_batch_size!r}. "
            "Expected a positive integer."
        )
    if global_batch_size % num_replicas:
        raise ValueError(
            f"Invalid value for `--global_batch_size`. Received: {global_batch_size}. "
            f"Expected a multiple of the {num_replicas} replicas, such as "
            f"{max(global_batch_size // num_replicas, 1) * num_replicas}."
        )
    return global_batch_size // num_replicas


def steps_per_epoch(info: DatasetInfo, split: str, global_batch_size: int) -> int:
    """Full global batches in one pass over `split`: the same on every worker."""
    steps = info.num_examples[split] // global_batch_size
    if steps < 1:
        raise ValueError(
            f"Invalid value for `--global_batch_size`. Received: {global_batch_size}. "
            f"Expected at most the {info.num_examples[split]} examples of "
            f"{info.name} {split}."
        )
    return steps
