"""TensorFlow's Keras batch-normalization layer tests (tf_keras
layers/normalization/batch_normalization_test.py) that apply to fbn's layers, ported with their
expected values. Keras models and fit() become direct layer calls and fbn.train.SGD steps.
Masking and cross-replica (synchronized) statistics are not part of fbn's layer."""
import numpy as np
import pytest

import fbn

BN = fbn.layers.BatchNormalization
BN2 = fbn.layers.BatchNormalizationV2


def test_batchnorm_weights():
    layer = BN(scale=False, center=False)
    layer(np.ones((2, 3, 4), np.float32))
    assert len(layer.trainable_weights) == 0
    assert len(layer.weights) == 2
    layer = BN()
    layer(np.ones((2, 3, 4), np.float32))
    assert len(layer.trainable_weights) == 2
    assert len(layer.weights) == 4


def test_batchnorm_regularization():
    layer = BN(gamma_regularizer="l1", beta_regularizer="l1")
    layer(np.ones((2, 3, 4), np.float32))
    assert len(layer.losses) == 2
    max_norm = fbn.layers.constraints.max_norm
    layer = BN(gamma_constraint=max_norm, beta_constraint=max_norm)
    layer(np.ones((2, 3, 4), np.float32))
    assert layer.gamma_constraint is max_norm
    assert layer.beta_constraint is max_norm


def test_v1_fused_attribute():
    norm = BN()
    norm(np.ones((2, 4, 4, 4), np.float32))
    assert norm.fused is True
    norm = BN(fused=False)
    assert norm.fused is False
    norm(np.ones((2, 4, 4, 4), np.float32))
    assert norm.fused is False
    norm = BN(virtual_batch_size=2)
    assert norm.fused is True
    norm(np.ones((2, 4, 4, 4), np.float32))
    assert norm.fused is False


def test_v2_fused_attribute():
    for shape, want in (((2, 4, 4, 4), True), ((2, 4, 4, 4, 4), True), ((2, 4, 4), False)):
        norm = BN2()
        assert norm.fused is None
        norm(np.ones(shape, np.float32))
        assert norm.fused is want
    norm = BN2(virtual_batch_size=2)
    assert norm.fused is False
    norm = BN2(fused=False)
    norm(np.ones((2, 4, 4, 4), np.float32))
    assert norm.fused is False
    norm = BN2(fused=True, axis=[3])
    norm(np.ones((2, 4, 4, 4), np.float32))
    assert norm.fused is True
    with pytest.raises(ValueError, match="fused.*renorm"):
        BN2(fused=True, renorm=True)
    with pytest.raises(ValueError, match="fused.*when axis is 1 or 3"):
        BN2(fused=True, axis=2)
    with pytest.raises(ValueError, match="fused.*when axis is 1 or 3"):
        BN2(fused=True, axis=[1, 3])
    with pytest.raises(ValueError, match="fused.*virtual_batch_size"):
        BN2(fused=True, virtual_batch_size=2)
    with pytest.raises(ValueError, match="fused.*adjustment"):
        BN2(fused=True, adjustment=lambda shape: (1, 0))
    norm = BN2(fused=True)
    with pytest.raises(ValueError, match="4D or 5D input tensors"):
        norm(np.ones((2, 4, 4), np.float32))
    with pytest.raises(ValueError, match="not supported when `synchronized=True`"):
        BN2(synchronized=True, fused=True)


def test_v2_virtual_batch_size_needs_a_divisible_batch_only_when_training():
    norm = BN2(virtual_batch_size=8)
    norm(np.ones((1, 28, 28), np.float32))  # inference: no reshape into virtual batches
    with pytest.raises(ValueError, match="Reshape"):
        norm(np.ones((1, 28, 28), np.float32), training=True)


@pytest.mark.parametrize("rank", [4, 5])
def test_bessels_correction(rank):
    x = np.array([0.0, 2.0], np.float32).reshape((2,) + (1,) * (rank - 1))
    layer = BN(momentum=0.5, moving_variance_initializer="zeros")
    layer(x, training=True)
    assert layer.fused is True
    assert layer.moving_variance.numpy().tolist() == [1.0]


@pytest.mark.parametrize("fused", [True, False])
def test_batchnorm_float16_does_not_overflow(fused):
    x = np.array([-1000.0, 1000.0], np.float16).reshape((2, 1, 1, 1))
    y = BN(fused=fused)(x, training=True)
    assert y.dtype == np.float16
    np.testing.assert_allclose(y.astype(np.float32).reshape(2), [-1.0, 1.0], atol=1e-3)


def test_eager_batchnorm_updates_in_each_call():
    layer = BN(momentum=0.99)
    x = np.array([[0.5]], np.float32)
    for _ in range(10):
        layer(x, training=True)
    np.testing.assert_allclose(layer.moving_mean.numpy(), [0.047], atol=3e-3)
    np.testing.assert_allclose(layer.moving_variance.numpy(), [0.9], atol=3e-2)
    assert layer.updates == []


@pytest.mark.parametrize("cls", [BN, BN2])
def test_batchnorm_trainable_uses_batch_statistics(cls):
    layer = cls()
    val_a = np.expand_dims(np.arange(10.0), axis=1).astype(np.float32)
    layer(val_a, training=False)
    for v, value in zip(layer.variables, ([1.0], [0.0], [0.5], [100.0])):
        v.assign(value)
    out = layer(val_a, training=True)
    np.testing.assert_allclose((val_a - np.mean(val_a)) / np.std(val_a), out, atol=1e-3)


@pytest.mark.parametrize("cls,dtype", [(BN, np.float32), (BN2, np.float32), (BN, np.float16)])
def test_batchnorm_correctness(cls, dtype):
    # _run_batchnorm_correctness_test: fit a lone BN layer to the identity on N(5, 10^2) data
    # (mse, SGD 0.01, batch 32, 4 epochs), then the normalized prediction is standard.
    rng = np.random.RandomState(0)
    x = rng.normal(loc=5.0, scale=10.0, size=(1000, 2, 2, 2)).astype(dtype)
    layer = cls(momentum=0.8, fused=False)
    opt = fbn.train.SGD(0.01)
    for _ in range(4):
        for start in range(0, 1000, 32):
            xb = x[start:start + 32]
            y = layer(xb, training=True)
            dy = 2.0 * (y.astype(np.float32) - xb.astype(np.float32)) / y.size
            _, grads = layer.backward(dy.astype(dtype))
            opt.apply_gradients(zip(grads, layer.trainable_variables))
    out = layer(x, training=False).astype(np.float32)
    out -= layer.beta.numpy()
    out /= layer.gamma.numpy()
    np.testing.assert_allclose(out.mean(), 0.0, atol=2e-1)
    np.testing.assert_allclose(out.std(), 1.0, atol=2e-1)


@pytest.mark.parametrize("cls", [BN, BN2])
def test_that_trainable_disables_updates(cls):
    # Graph mode: a non-trainable layer contributes no update ops (V1 and V2); a V2 layer that is
    # not trainable also runs in inference mode.
    graph = fbn.Graph()
    rng = np.random.RandomState(1)
    val_a = rng.random_sample((10, 4)).astype(np.float32)
    with graph.as_default():
        layer = cls()
        x0 = layer(val_a, training=False)
        layer.trainable = False
        layer(val_a, training=True)
        assert layer.updates == []
        graph.run(graph.get_collection(fbn.GraphKeys.UPDATE_OPS))
        np.testing.assert_allclose(x0, layer(val_a, training=False), atol=1e-7)
        layer.trainable = True
        layer(val_a, training=True)
        graph.run(graph.get_collection(fbn.GraphKeys.UPDATE_OPS))
        assert np.abs(x0 - layer(val_a, training=False)).max() > 1e-4


def test_v2_frozen_layer_runs_in_inference_mode():
    x = np.random.RandomState(2).random_sample((8, 3)).astype(np.float32)
    layer = BN2(trainable=False)
    y_train = layer(x, training=True)
    np.testing.assert_allclose(y_train, layer(x, training=False), atol=1e-7)
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.0)
    v1 = BN(trainable=False)  # V1: a frozen layer still normalizes with batch statistics
    np.testing.assert_allclose(np.mean(v1(x, training=True), axis=0), 0.0, atol=1e-5)
