"""Model builders: pinned parameter counts (GroupNormalization: 2 weights a channel), shapes, bad arguments."""

import pytest

from distrib_tf.models import build_model


@pytest.mark.parametrize("kwargs, params", [
    ({"input_shape": (28, 28, 1), "num_classes": 10}, 33002),
    ({"input_shape": (32, 32, 3), "num_classes": 10}, 33578),
    ({"input_shape": (28, 28, 1), "num_classes": 10, "width": 8}, 2306),
])
def test_cnn_parameter_count(kwargs, params):
    model = build_model("cnn", **kwargs)
    assert model.count_params() == params
    assert model.output_shape == (None, kwargs["num_classes"])


@pytest.mark.parametrize("kwargs, params", [
    ({"vocab_size": 1000, "seq_len": 64, "num_classes": 4}, 135300),
    ({"vocab_size": 8192, "seq_len": 128, "num_classes": 2, "depth": 1}, 566082),
    ({"vocab_size": 100, "seq_len": 16, "num_classes": 2, "depth": 1, "width": 8, "heads": 2, "mlp_dim": 16}, 1546),
])
def test_transformer_parameter_count(kwargs, params):
    model = build_model("transformer", **kwargs)
    assert model.count_params() == params
    assert model.output_shape == (None, kwargs["num_classes"])


def test_bad_model_arguments():
    with pytest.raises(ValueError,
                       match=r"Invalid value for `--model`\. Received: 'resnet'\. Expected one of cnn, transformer"):
        build_model("resnet")
    with pytest.raises(ValueError, match=r"Received: heads=3 with width=64\. Expected a divisor of `width`"):
        build_model("transformer", vocab_size=10, seq_len=4, num_classes=2, heads=3)


def test_config_names_the_models_that_exist():
    from distrib_tf.models import MODELS  # pylint: disable=import-outside-toplevel
    from distrib_tf.train import config  # pylint: disable=import-outside-toplevel

    assert config.MODELS == tuple(MODELS)
