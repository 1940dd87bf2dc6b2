"""TableConfig and SparseOptimizerConfig refuse bad arguments with errors naming them."""

import math

import numpy as np
import pytest

from neorec.config import load_config
from neorec.embedding.config import SparseOptimizerConfig, TableConfig


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"beta1": 1.0}, r"beta1 must be in \[0, 1\), got 1.0"),
        ({"beta1": -0.1}, r"beta1 must be in \[0, 1\), got -0.1"),
        ({"beta2": 1.0}, r"beta2 must be in \[0, 1\), got 1.0"),
        ({"beta2": 1.5}, r"beta2 must be in \[0, 1\), got 1.5"),
        ({"eps": -1e-8}, "eps must be >= 0, got -1e-08"),
        ({"weight_decay": -0.01}, "weight_decay must be >= 0, got -0.01"),
        ({"kind": "adagrad", "initial_accumulator_value": -0.1}, "initial_accumulator_value must be >= 0, got -0.1"),
        ({"kind": "rowwise_adagrad", "initial_accumulator_value": -1.0}, "initial_accumulator_value must be >= 0"),
        ({"learning_rate": -0.1}, "learning_rate must be > 0, got -0.1"),
        ({"learning_rate": 0.0}, "learning_rate must be > 0, got 0.0"),
        ({"learning_rate": math.inf}, "learning_rate must be finite, got inf"),
        ({"learning_rate": math.nan}, "learning_rate must be finite, got nan"),
        ({"eps": math.nan}, "eps must be finite, got nan"),
        ({"weight_decay": math.inf}, "weight_decay must be finite, got inf"),
    ],
)
def test_sparse_optimizer_refuses_bad_hyperparameters(kwargs, message):
    with pytest.raises(ValueError, match="sparse optimizer " + message):
        SparseOptimizerConfig(**{"kind": "adam", **kwargs})


def test_sparse_optimizer_type_errors_and_edges():
    with pytest.raises(TypeError, match="sparse optimizer learning_rate must be a number, got '0.1'"):
        SparseOptimizerConfig(learning_rate="0.1")
    with pytest.raises(TypeError, match="sparse optimizer beta1 must be a number, got True"):
        SparseOptimizerConfig(beta1=True)
    # the edges torch.optim allows (and ints, numpy floats) still work; eps = 0 only where it divides
    # nothing (test_config: a row looked up with a zero gradient would be stepped by 0 / 0)
    config = SparseOptimizerConfig("adam", learning_rate=1, eps=1e-30, beta1=0.0, beta2=0.0, weight_decay=0)
    assert config.beta1 == 0.0
    assert SparseOptimizerConfig("sgd", eps=0.0).eps == 0.0
    SparseOptimizerConfig("adagrad", learning_rate=np.float32(0.1), initial_accumulator_value=0.1)


@pytest.mark.parametrize(
    "override, message",
    [
        ("embedding.optimizer.beta1=1.0", r"beta1 must be in \[0, 1\), got 1.0 \(from --set embedding.optimizer.beta1=1.0\)"),
        ("embedding.optimizer.initial_accumulator_value=-1", "initial_accumulator_value must be >= 0"),
        ("embedding.optimizer.learning_rate=inf", "learning_rate must be finite"),
    ],
)
def test_config_layer_reports_bad_hyperparameters(override, message):
    with pytest.raises(ValueError, match=message):
        load_config(None, [override])


def test_table_config_refuses_a_string_of_feature_names():
    with pytest.raises(TypeError, match=r"table 'a': feature_names must be a list of strings, got 'user'"):
        TableConfig("a", 10, 4, "user")
    with pytest.raises(TypeError, match="feature_names must be a list of strings"):
        TableConfig("a", 10, 4, ["user", 3])
    assert TableConfig("a", 10, 4, ("user", "item")).feature_names == ["user", "item"]
    assert TableConfig("a", 10, 4).feature_names == ["a"]
    assert TableConfig("a", 10, 4, []).feature_names == ["a"]


@pytest.mark.parametrize(
    "args, error, message",
    [
        ((10.0, 4), TypeError, "table 'a': num_embeddings must be an int, got 10.0"),
        ((10, 4.0), TypeError, "table 'a': embedding_dim must be an int, got 4.0"),
        ((10, True), TypeError, "table 'a': embedding_dim must be an int, got True"),
        ((True, 4), TypeError, "table 'a': num_embeddings must be an int, got True"),
        (("10", 4), TypeError, "table 'a': num_embeddings must be an int, got '10'"),
        ((0, 4), ValueError, "table 'a': num_embeddings must be > 0, got 0"),
        ((10, -1), ValueError, "table 'a': embedding_dim must be > 0, got -1"),
    ],
)
def test_table_config_refuses_bad_sizes(args, error, message):
    with pytest.raises(error, match=message):
        TableConfig("a", *args)


def test_table_config_accepts_numpy_ints_as_ints():
    table = TableConfig("a", np.int64(10), np.int32(4))
    assert type(table.num_embeddings) is int and type(table.embedding_dim) is int
    with pytest.raises(TypeError, match="table name must be a string, got 3"):
        TableConfig(3, 10, 4)
