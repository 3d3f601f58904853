"""A small transformer encoder classifier over token ids."""

import keras


@keras.saving.register_keras_serializable(package="distrib_tf")
class TokenAndPositionEmbedding(keras.layers.Layer):
    """Sum of a token embedding and a learned position embedding."""

    def __init__(self, vocab_size: int, seq_len: int, width: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab_size, self.seq_len, self.width = vocab_size, seq_len, width
        self.tokens = keras.layers.Embedding(vocab_size, width)
        self.positions = keras.layers.Embedding(seq_len, width)

    def call(self, ids):
        positions = keras.ops.arange(keras.ops.shape(ids)[-1])
        return self.tokens(ids) + self.positions(positions)

    def get_config(self):
        return {**super().get_config(), "vocab_size": self.vocab_size,
                "seq_len": self.seq_len, "width": self.width}


def _encoder_block(x, *, width: int, heads: int, mlp_dim: int):
    attention = keras.layers.MultiHeadAttention(heads, width // heads)(x, x)
    x = keras.layers.LayerNormalization(epsilon=1e-6)(x + attention)
    hidden = keras.layers.Dense(mlp_dim, activation="gelu")(x)
    return keras.layers.LayerNormalization(epsilon=1e-6)(x + keras.layers.Dense(width)(hidden))


def build_transformer(
    *,
    vocab_size: int,
    seq_len: int,
    num_classes: int,
    depth: int = 2,
    width: int = 64,
    heads: int = 4,
    mlp_dim: int = 128,
) -> keras.Model:
    """Embeddings, `depth` encoder blocks, mean pooling and a dense classifier head.

    Example:

        >>> build_transformer(vocab_size=100, seq_len=16, num_classes=2, depth=1,
        ...                   width=8, heads=2, mlp_dim=16).count_params()
        1546
    """
    if width % heads:
        raise ValueError(
            f"Invalid value for `heads`. Received: heads={heads} with width={width}. "
            "Expected a divisor of `width`."
        )
    ids = keras.Input((seq_len,), dtype="int32")
    x = TokenAndPositionEmbedding(vocab_size, seq_len, width)(ids)
    for _ in range(depth):
        x = _encoder_block(x, width=width, heads=heads, mlp_dim=mlp_dim)
    x = keras.layers.GlobalAveragePooling1D()(x)
    # Logits in the variables' type: float32 under mixed precision, float64 in float64.
    outputs = keras.layers.Dense(num_classes, dtype=keras.config.dtype_policy().variable_dtype)(x)
    return keras.Model(ids, outputs, name="transformer")
