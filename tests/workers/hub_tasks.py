"""keras-hub task models as a user fine-tunes them: each from a small config with random
weights (no download), with `preprocessor=None` (the user's arrays are the model's inputs)
or with a preprocessor built in memory (a tokenizer from a small vocabulary, an image
converter), which the model's own `fit` maps over the dataset it builds.

- `build(task, preprocessor=False)`: `(model, x, y)`, compiled;
- as a script, a Keras user's fine-tuning script under a `distrib_tf.Run` (run it with
  `tests/workers/run_example.py`, which prints its weights and History):

    python tests/workers/run_example.py tests/workers/hub_tasks.py --task=causal_lm [--preprocessor]
"""

import argparse

import keras
import numpy as np

ROWS, BATCH, EPOCHS = 128, 16, 3  # 8 steps an epoch.
WORDS = ["the", "a", "cat", "dog", "sat", "ran", "on", "mat", "far", "away", "and", "then"]


def _sentences(rows: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.array([" ".join(rng.choice(WORDS, size=rng.integers(3, 9))) for _ in range(rows)])


def _causal_lm(keras_hub, preprocessor: bool):
    if preprocessor:  # GPT-2's byte-pair tokenizer from an in-memory vocabulary: each word one token.
        words = [*WORDS, *("\u0120" + w for w in WORDS)]  # "\u0120" (Ġ): a word after a space.
        pieces = dict.fromkeys([*(c for w in words for c in w),  # Characters, then what the merges make.
                                *(w[:i] for w in words for i in range(2, len(w) + 1))])
        vocabulary = {"<|endoftext|>": 0, **{piece: i + 1 for i, piece in enumerate(pieces)}}
        merges = list(dict.fromkeys(f"{w[:i]} {w[i]}" for w in words for i in range(1, len(w))))
        tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocabulary, merges=merges)
        preprocess = keras_hub.models.GPT2CausalLMPreprocessor(tokenizer=tokenizer, sequence_length=16)
        vocabulary_size = len(vocabulary)
    else:
        preprocess, vocabulary_size = None, 50
    backbone = keras_hub.models.GPT2Backbone(vocabulary_size=vocabulary_size, num_layers=1, num_heads=2,
                                             hidden_dim=8, intermediate_dim=16, max_sequence_length=16,
                                             dropout=0.1)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=preprocess)
    if preprocessor:
        return model, _sentences(ROWS), None  # The preprocessor makes the targets (the next tokens).
    tokens = np.random.default_rng(0).integers(1, 50, size=(ROWS, 17)).astype("int32")
    x = {"token_ids": tokens[:, :-1], "padding_mask": np.ones((ROWS, 16), "int32")}
    return model, x, tokens[:, 1:]


def _text_classifier(keras_hub, preprocessor: bool):
    if preprocessor:  # BERT's WordPiece tokenizer from an in-memory vocabulary.
        vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
        tokenizer = keras_hub.models.BertTokenizer(vocabulary=vocabulary)
        preprocess = keras_hub.models.BertTextClassifierPreprocessor(tokenizer=tokenizer, sequence_length=16)
        vocabulary_size = len(vocabulary)
    else:
        preprocess, vocabulary_size = None, 50
    backbone = keras_hub.models.BertBackbone(vocabulary_size=vocabulary_size, num_layers=1, num_heads=2,
                                             hidden_dim=8, intermediate_dim=16, max_sequence_length=16)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2, preprocessor=preprocess)
    if preprocessor:
        sentences = _sentences(ROWS)
        return model, sentences, np.array([("cat" in s) for s in sentences], "int32")
    tokens = np.random.default_rng(0).integers(1, 50, size=(ROWS, 16)).astype("int32")
    x = {"token_ids": tokens, "segment_ids": np.zeros_like(tokens), "padding_mask": np.ones_like(tokens)}
    return model, x, (tokens[:, 0] > 25).astype("int32")


def _image_classifier(keras_hub, preprocessor: bool):
    backbone = keras_hub.models.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3], stackwise_num_filters=[64], stackwise_num_blocks=[1],
        stackwise_num_strides=[1], block_type="basic_block", image_shape=(16, 16, 3))
    preprocess = keras_hub.models.ResNetImageClassifierPreprocessor(  # Resizes and scales the user's images.
        image_converter=keras_hub.layers.ResNetImageConverter(image_size=(16, 16), scale=1 / 255)
    ) if preprocessor else None
    model = keras_hub.models.ImageClassifier(backbone=backbone, num_classes=2, preprocessor=preprocess)
    rng = np.random.default_rng(0)
    if preprocessor:  # Raw 24x24 pixels in [0, 255].
        images = rng.integers(0, 256, size=(ROWS, 24, 24, 3)).astype("float32")
        return model, images, (images[:, :, :, 0].mean(axis=(1, 2)) > 127.5).astype("int32")
    images = rng.normal(size=(ROWS, 16, 16, 3)).astype("float32")
    return model, images, (images[:, :, :, 0].mean(axis=(1, 2)) > 0).astype("int32")


TASKS = {"causal_lm": _causal_lm, "text_classifier": _text_classifier, "image_classifier": _image_classifier}


def build(task: str, preprocessor: bool = False):
    """`(model, x, y)` of `task`, compiled as a user fine-tunes it."""
    import keras_hub  # pylint: disable=import-outside-toplevel  (an optional extra)

    model, x, y = TASKS[task](keras_hub, preprocessor)
    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  jit_compile=False)  # Keras's "auto" compiles with XLA alone, not under a strategy.
    return model, x, y


if __name__ == "__main__":
    import distrib_tf

    parser = argparse.ArgumentParser()
    parser.add_argument("--task", choices=sorted(TASKS), required=True)
    parser.add_argument("--preprocessor", action="store_true")
    args = parser.parse_args()
    run = distrib_tf.Run("runs/hub", backup_every_steps=5)
    model, x, y = build(args.task, args.preprocessor)
    model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=2)
