"""TFDS datasets: their description, and their examples by index through `tfds.data_source`.

Random access needs the dataset prepared as ArrayRecord (`tfds.load(name,
download_and_prepare_kwargs={"download_config": tfds.download.DownloadConfig(
file_format="array_record")})`, or `tfds convert_format`), or converted once by
`python -m distrib_tf.data prepare --dataset=NAME --out=DIR`. Images are normalized and
text is tokenized in the graph, a batch at a time.
"""

import numpy as np
import tensorflow as tf

from distrib_tf.data import records
from distrib_tf.data import registry


def _not_prepared(name: str, data_dir: str | None, error: Exception) -> FileNotFoundError:
    where = data_dir or "~/tensorflow_datasets"
    return FileNotFoundError(
        f"Dataset {name!r} is not prepared in data_dir={where} ({type(error).__name__}). "
        f"Prepare it where there is internet: python -c \"import tensorflow_datasets as "
        f"tfds; tfds.load('{name}', data_dir='{where}')\", then copy {where} here."
    )


def _tfds():
    """tensorflow-datasets, an extra: only a TFDS dataset needs it."""
    try:
        import tensorflow_datasets as tfds  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise ValueError("Missing tensorflow-datasets, which a TFDS dataset is read with. Expected it "
                         "installed: pip install 'distrib_tf[tfds]'.") from e
    return tfds


def load_info(name: str, data_dir: str | None) -> registry.DatasetInfo:
    tfds = _tfds()

    try:
        builder_info = tfds.builder(name, data_dir=data_dir).info
        num_examples = {split: builder_info.splits[split].num_examples
                        for split in ("train", "test") if split in builder_info.splits}
        if len(num_examples) < 2:  # Not prepared, or mocked (`tfds.testing.mock_data`): ask tfds.load.
            for split in ("train", "test"):
                dataset, builder_info = tfds.load(name, split=split, data_dir=data_dir, download=False,
                                                  with_info=True)
                num_examples[split] = int(dataset.cardinality())
    except Exception as e:  # pylint: disable=broad-except
        raise _not_prepared(name, data_dir, e) from e
    features = builder_info.features
    if name in registry.TEXT_DATASETS:
        return registry.DatasetInfo(name, "text", features["label"].num_classes, (registry.TEXT_SEQ_LEN,),
                                    vocab_size=registry.TEXT_VOCAB_SIZE, num_examples=num_examples,
                                    data_dir=data_dir)
    return registry.DatasetInfo(name, "image", features["label"].num_classes, tuple(features["image"].shape),
                                num_examples=num_examples, data_dir=data_dir)


def data_source(info: registry.DatasetInfo, split: str):
    """The split's examples by index, or a one-line error saying how to get random access."""
    tfds = _tfds()

    try:
        return tfds.data_source(info.name, split=split, data_dir=info.data_dir, download=False)
    except Exception as e:  # pylint: disable=broad-except
        where = info.data_dir or "~/tensorflow_datasets"
        raise ValueError(
            f"Dataset {info.name!r} in data_dir={where} cannot be read by index ({type(e).__name__}: "
            f"{next(iter(str(e).splitlines()), '')[:120]}). Expected it prepared as ArrayRecord: "
            f"`python -m distrib_tf.data prepare --dataset={info.name} --data_dir={where} --out=DIR` converts "
            "it once; then train with --dataset=array_record:DIR.") from e


def make_reader(info: registry.DatasetInfo, split: str):
    """`read(ids) -> (x, y)` for `tf.data`: the examples of a batch of ids, decoded."""
    source = data_source(info, split)
    feature = "text" if info.kind == "text" else "image"
    guard = records.ExitGuard()

    def fetch(ids):
        with guard.call():
            examples = [source[int(i)] for i in ids]
        labels = np.array([e["label"] for e in examples], np.int64)
        if feature == "text":
            return np.array([e["text"] for e in examples], dtype=object), labels
        return np.stack([e["image"] for e in examples]).astype(np.uint8), labels

    def read(ids):
        x, y = tf.numpy_function(fetch, [ids], (tf.string if feature == "text" else tf.uint8, tf.int64),
                                 stateful=False)
        y.set_shape([None])
        if feature == "text":
            x.set_shape([None])
            return tokenize(x), y
        x.set_shape([None, *info.input_shape])
        return tf.cast(x, tf.float32) / 255.0, y

    return read


def tokenize(text: tf.Tensor) -> tf.Tensor:
    """Lower-case words hashed into `TEXT_VOCAB_SIZE - 1` ids (0 pads), `[batch, TEXT_SEQ_LEN]` int32."""
    text = tf.strings.regex_replace(tf.strings.lower(text), r"[^a-z0-9' ]", " ")
    words = tf.strings.split(text)[:, :registry.TEXT_SEQ_LEN]
    ids = tf.strings.to_hash_bucket_fast(words, registry.TEXT_VOCAB_SIZE - 1) + 1
    return tf.cast(ids.to_tensor(shape=[None, registry.TEXT_SEQ_LEN]), tf.int32)


def load(info: registry.DatasetInfo, split: str) -> tf.data.Dataset:
    """All `(x, y)` examples of `split` in TFDS's order, decoded: what `prepare` converts."""
    tfds = _tfds()

    try:
        read = make_reader(info, split)
    except ValueError:  # Prepared as TFRecord: streamed by tfds.load.
        pass
    else:
        return tf.data.Dataset.range(info.num_examples[split]).batch(256).map(read).unbatch()
    try:
        dataset = tfds.load(info.name, split=split, data_dir=info.data_dir, as_supervised=True,
                            download=False, shuffle_files=False)
    except Exception as e:  # pylint: disable=broad-except
        raise _not_prepared(info.name, info.data_dir, e) from e
    if info.kind == "text":
        return dataset.batch(256).map(lambda x, y: (tokenize(x), y)).unbatch()
    return dataset.map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y), num_parallel_calls=tf.data.AUTOTUNE)
