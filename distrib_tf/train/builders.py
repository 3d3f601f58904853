"""The main job's model and data by name: built-in ones, or a user's `package.module:function`.

- `--model=cnn|transformer`, or `--model=package.module:function`: `function(info)` returns
  a Keras model, built under the strategy's scope. `info` is the training data's
  `DatasetInfo` where it has one (registered datasets, `array_record:DIR`, `images:DIR`),
  else its `distrib_tf.data.Examples`. A model it returns compiled keeps its own
  optimizer, loss and metrics; else the main job compiles it (Adam at `--learning_rate`,
  sparse categorical cross-entropy on logits, accuracy).
- `--dataset=NAME` (see `distrib_tf.data.registry`), `images:DIR`, or
  `--dataset=package.module:function`: `function()` returns the splits, a dict of
  `distrib_tf.data.Examples` with a `train` key (and `validation` or `test`, evaluated at
  every epoch end), or a `(train, validation)` pair.

Example:

    >>> build = load_function("tests.workers.my_models:build", flag="model")
"""

import importlib

from distrib_tf.train.config import _is_function_spec as is_function_spec  # noqa: F401  (named here too)
from distrib_tf.train.config import invalid_flag


def load_function(spec: str, *, flag: str):
    """The function `package.module:function` names; one line (`ValueError`) if it cannot be had."""
    module_name, _, name = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        invalid_flag(flag, spec, f"an importable package.module:function ({type(e).__name__}: {e}; is its "
                     "folder on PYTHONPATH?)")
    function = getattr(module, name, None)
    if not callable(function):
        invalid_flag(flag, spec, f"a function {name!r} in {module_name}")
    return function


def load_splits(spec: str) -> tuple:
    """`(train, validation)` from a user's `--dataset=package.module:function`."""
    from distrib_tf.data import examples  # pylint: disable=import-outside-toplevel

    splits = load_function(spec, flag="dataset")()
    if isinstance(splits, dict):
        train, validation = splits.get("train"), splits.get("validation", splits.get("test"))
    elif isinstance(splits, (tuple, list)) and len(splits) == 2:
        train, validation = splits
    else:
        train = validation = None
    if not isinstance(train, examples.Examples) or not isinstance(validation, (examples.Examples, type(None))):
        invalid_flag("dataset", spec, "a function returning {'train': Examples, 'validation': Examples} or a "
                     "(train, validation) pair of distrib_tf.data examples")
    return train, validation
