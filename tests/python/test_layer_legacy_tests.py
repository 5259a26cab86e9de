"""TensorFlow's tf.compat.v1.layers batch-normalization tests (tf_keras
legacy_tf_layers/normalization_test.py, class BNTest), ported to fbn with their NumPy references.
Graph-mode session runs become layer calls under an fbn.Graph followed by running the call's
update ops; a boolean placeholder becomes an fbn.TrainingFlag."""
import numpy as np
import pytest

import fbn

EPS = 1e-3


def _train_and_check(shape, axis, reduce_axes, steps=100, fused=None, dtype=np.float32):
    """The common pattern of the "normalization" tests: train on a fixed input of mean ~100,
    check each output is normalized, then that the moving statistics reached the input's
    (biased) statistics, and that inference normalizes too."""
    rng = np.random.RandomState(1)
    x = (rng.random_sample(shape) + 100).astype(dtype)
    graph = fbn.Graph()
    flag = fbn.TrainingFlag(True)
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(axis=axis, epsilon=EPS, momentum=0.9, fused=fused)
        call = lambda: bn(x, training=flag)  # noqa: E731
        for _ in range(steps):
            y = call()
            graph.run(graph.get_collection(fbn.GraphKeys.UPDATE_OPS)[-2:])
            # As TensorFlow's test: the whole output's mean and std, to one decimal place.
            y64 = np.asarray(y, np.float64)
            assert abs(np.mean(y64)) < 0.05 and abs(np.std(y64) - 1) < 0.05
        names = {v.name.split("/")[-1]: v for v in graph.global_variables()}
        keep = len(names["moving_mean:0"].shape) > 1
        np.testing.assert_allclose(names["moving_mean:0"].numpy(),
                                   np.mean(x, axis=reduce_axes, keepdims=keep), atol=1e-2)
        np.testing.assert_allclose(names["moving_variance:0"].numpy(),
                                   np.var(x.astype(np.float64), axis=reduce_axes, keepdims=keep),
                                   atol=1e-2)
        flag.value = False
        y = np.asarray(call(), np.float64)
        assert abs(np.mean(y)) < 0.05 and abs(np.std(y) - 1) < 0.05


def test_create_bn():
    graph = fbn.Graph()
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(axis=1)
        x = np.random.RandomState(0).uniform(size=(5, 4, 3)).astype(np.float32)
        y = bn(x, training=fbn.TrainingFlag(True))
        assert y.shape == (5, 4, 3)
        assert len(bn.updates) == 2
        assert len(bn.variables) == 4
        assert len(bn.trainable_variables) == 2
        assert len(bn.non_trainable_variables) == 2
        assert [o.name for o in graph.get_collection(fbn.GraphKeys.UPDATE_OPS)] == \
            [o.name for o in bn.updates]
        assert [v.name for v in graph.get_collection(fbn.GraphKeys.TRAINABLE_VARIABLES)] == \
            [v.name for v in bn.trainable_variables]


def test_create_fused_bn_float16():
    graph = fbn.Graph()
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(axis=1, fused=True)
        x = np.random.RandomState(0).uniform(size=(5, 4, 3, 3)).astype(np.float16)
        y = bn(x, training=fbn.TrainingFlag(True))
        assert y.shape == (5, 4, 3, 3) and y.dtype == np.float16
        assert bn.fused is True
        assert len(bn.updates) == 2
        assert len(bn.variables) == 4 and len(bn.trainable_variables) == 2
        assert all(v.dtype == "float32" for v in bn.variables)  # float16 -> float32 parameters


@pytest.mark.parametrize("shape,axis,reduce_axes,fused", [
    ((5, 4, 3), 1, (0, 2), None),          # test3DInputAxis1
    ((5, 4, 3), 2, (0, 1), None),          # test3DInputAxis2
    ((5, 4, 3, 6), 1, (0, 2, 3), None),    # test4DInputAxis1 (CPU NCHW is supported here)
    ((5, 4, 3, 6), 2, (0, 1, 3), None),    # test4DInputAxis2
    ((5, 4, 3, 6), 3, (0, 1, 2), None),    # test4DInputAxis3
    ((5, 4, 3, 6), 3, (0, 1, 2), True),    # test4DInputAxis3Fused
    ((5, 4, 3, 6), 1, (0, 2, 3), True),    # test4DInputAxis1Fused
    ((5, 4, 3, 6), -1, (0, 1, 2), None),   # testNegativeAxis
    ((5, 4, 3), [1, 2], (0,), None),       # test3DInputMultiAxis12
    ((5, 3, 4, 4, 3), [1, 2, 3], (0, 4), None),  # test5DInputMultiAxis123
])
def test_normalization(shape, axis, reduce_axes, fused):
    _train_and_check(shape, axis, reduce_axes, fused=fused)


def test_functional_no_reuse():
    x = (np.random.RandomState(2).random_sample((5, 4, 3, 6)) + 100).astype(np.float32)
    graph = fbn.Graph()
    flag = fbn.TrainingFlag(True)
    with graph.as_default():
        y = fbn.layers.batch_normalization(x, axis=-1, momentum=0.9, epsilon=EPS, training=flag,
                                           name="bn")
        names = [v.name for v in graph.global_variables()]
        for want in ("bn/moving_mean:0", "bn/moving_variance:0", "bn/beta:0", "bn/gamma:0"):
            assert want in names
        np.testing.assert_allclose(np.mean(y, axis=(0, 1, 2)), 0, atol=0.05)
        for _ in range(100):
            graph.run(graph.get_collection(fbn.GraphKeys.UPDATE_OPS))
        mm = graph.get_collection(fbn.GraphKeys.GLOBAL_VARIABLES, "bn/moving_mean")[0]
        np.testing.assert_allclose(mm.numpy(), np.mean(x, axis=(0, 1, 2)), atol=1e-2)


def test_functional_reuse():
    rng = np.random.RandomState(3)
    x1 = (rng.random_sample((5, 4, 3, 6)) + 100).astype(np.float32)
    x2 = (rng.random_sample((5, 4, 3, 6)) + 100).astype(np.float32)
    graph = fbn.Graph()
    with graph.as_default():
        fbn.layers.batch_normalization(x1, axis=-1, momentum=0.9, epsilon=EPS, training=True,
                                       name="bn")
        y2 = fbn.layers.batch_normalization(x2, axis=-1, momentum=0.9, epsilon=EPS,
                                            training=True, name="bn", reuse=True)
        assert len(graph.global_variables()) == 4
        ops = graph.get_collection(fbn.GraphKeys.UPDATE_OPS)[-2:]
        for _ in range(100):
            graph.run(ops)
        mm, mv = graph.global_variables()[2:4]
        np.testing.assert_allclose(mm.numpy(), np.mean(x2, axis=(0, 1, 2)), atol=1e-2)
        # The fused path tracks the Bessel-corrected variance: n = 60 here.
        np.testing.assert_allclose(mv.numpy(), np.var(x2, axis=(0, 1, 2)) * 60 / 59, atol=1e-3)
        np.testing.assert_allclose(np.mean(y2, axis=(0, 1, 2)), 0, atol=0.05)


def test_functional_reuse_from_scope():
    graph = fbn.Graph()
    x = np.ones((5, 4, 3), np.float32)
    with graph.as_default():
        with fbn.variable_scope("scope"):
            fbn.layers.batch_normalization(x, axis=1)
        assert len(graph.global_variables()) == 4
        with fbn.variable_scope("scope", reuse=True):
            fbn.layers.batch_normalization(x, axis=1)
        assert len(graph.global_variables()) == 4


def test_boolean_learning_phase():
    x = (np.random.RandomState(4).random_sample((5, 4, 3)) + 100).astype(np.float32)
    bn = fbn.layers.BatchNormalization(axis=1, epsilon=EPS)
    y_train = bn(x, training=True)
    y_test = bn(x, training=False)
    np.testing.assert_allclose(np.mean(y_train, axis=(0, 2)), 0, atol=0.01)
    assert not np.allclose(y_test, y_train)  # inference uses the (barely moved) moving stats


@pytest.mark.parametrize("kw", [dict(center=False), dict(scale=False)])
def test_no_center_no_scale(kw):
    graph = fbn.Graph()
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(axis=1, **kw)
        bn(np.ones((5, 4, 3), np.float32), training=fbn.TrainingFlag(True))
        assert len(bn.updates) == 2
        assert len(bn.variables) == 3
        assert len(bn.trainable_variables) == 1
        assert len(bn.non_trainable_variables) == 2


def test_regularizers():
    reg = lambda x: 0.1 * np.sum(x)  # noqa: E731
    for kw in (dict(beta_regularizer=reg), dict(gamma_regularizer=reg)):
        graph = fbn.Graph()
        with graph.as_default():
            bn = fbn.layers.BatchNormalization(axis=1, **kw)
            bn(np.ones((5, 4, 3), np.float32), training=True)
            assert len(bn.losses) == 1
            assert len(graph.get_collection(fbn.GraphKeys.REGULARIZATION_LOSSES)) == 1
            # beta starts at 0 (loss 0), gamma at 1 (loss 0.1 * 4).
            want = 0.4 if "gamma_regularizer" in kw else 0.0
            np.testing.assert_allclose(bn.losses[0].numpy(), want, rtol=1e-6)


def test_constraints():
    g = lambda x: x / 10.  # noqa: E731
    b = lambda x: x * 3.  # noqa: E731
    bn = fbn.layers.BatchNormalization(axis=1, gamma_constraint=g, beta_constraint=b)
    bn(np.ones((5, 4, 3), np.float32))
    assert bn.gamma_constraint is g
    assert bn.beta_constraint is b


def _renorm_layer(**kw):
    return fbn.layers.BatchNormalization(
        axis=1, gamma_initializer=fbn.layers.initializers.constant(2.),
        beta_initializer=fbn.layers.initializers.constant(3.), epsilon=EPS, renorm=True, **kw)


def test_renorm():
    shape, momentum, renorm_momentum = (4, 3), 0.99, 0.8
    rmax, rmin, dmax, gamma, beta = 1.1, 0.9, 0.1, 2., 3.
    graph = fbn.Graph()
    flag = fbn.TrainingFlag()
    rng = np.random.RandomState(5)
    with graph.as_default():
        bn = _renorm_layer(momentum=momentum, renorm_momentum=renorm_momentum,
                           renorm_clipping={"rmax": rmax, "rmin": rmin, "dmax": dmax})
        moving_mean, moving_stddev, renorm_mean, renorm_stddev = 0., 1., 0., 1.
        for _ in range(5):
            x = rng.random_sample(shape).astype(np.float32)
            mean, variance = x.mean(0), x.var(0)
            stddev = np.sqrt(variance + EPS)
            r = np.clip(stddev / renorm_stddev, rmin, rmax)
            d = np.clip((mean - renorm_mean) / renorm_stddev, -dmax, dmax)
            y_train = ((x - mean) / stddev * r + d) * gamma + beta
            renorm_mean += (mean - renorm_mean) * (1. - renorm_momentum)
            renorm_stddev += (stddev - renorm_stddev) * (1. - renorm_momentum)
            moving_mean += (mean - moving_mean) * (1. - momentum)
            moving_stddev += (stddev - moving_stddev) * (1. - momentum)
            y_test = ((x - moving_mean) / (moving_stddev * moving_stddev) ** 0.5 * gamma) + beta
            flag.value = True
            yt_train = bn(x, training=flag)
            graph.run(bn.updates[-2:])
            flag.value = False
            yt_test = bn(x, training=flag)
            np.testing.assert_allclose(yt_train, y_train, atol=1e-5)
            np.testing.assert_allclose(yt_test, y_test, atol=1e-5)


def test_renorm_no_clipping_same_momentum_gives_same_test_train():
    shape, momentum, gamma, beta = (4, 3), 0.9, 2., 3.
    graph = fbn.Graph()
    flag = fbn.TrainingFlag()
    rng = np.random.RandomState(6)
    with graph.as_default():
        bn = _renorm_layer(momentum=momentum, renorm_momentum=momentum)
        moving_mean, moving_stddev = 0., 1.
        for step in range(6):
            x = rng.random_sample(shape).astype(np.float32)
            mean, variance = x.mean(0), x.var(0)
            stddev = np.sqrt(variance + EPS)
            r = stddev / moving_stddev
            d = (mean - moving_mean) / moving_stddev
            y_test = ((x - moving_mean) / moving_stddev * gamma) + beta
            y_train = ((x - mean) / stddev * r + d) * gamma + beta
            moving_mean += (mean - moving_mean) * (1. - momentum)
            moving_stddev += (stddev - moving_stddev) * (1. - momentum)
            flag.value = False
            yt_test = bn(x, training=flag)
            flag.value = True
            yt_train = bn(x, training=flag)
            graph.run(bn.updates[-2:])
            atol = EPS * 1.5 if step == 0 else 1e-5
            np.testing.assert_allclose(yt_train, y_train, atol=atol)
            np.testing.assert_allclose(yt_test, y_test, atol=atol)
            np.testing.assert_allclose(yt_train, yt_test, atol=atol)


def _adjustment_run(renorm):
    shape, momentum, gamma, beta = (4, 3), 0.99, 2., 3.
    rmax, rmin, dmax = 1.1, 0.9, 0.1
    rng = np.random.RandomState(7)
    adj = {}

    def adjustment(input_shape):
        assert list(input_shape) == list(shape)
        adj["scale"] = rng.uniform(0.5, 1.5, 3).astype(np.float32)
        adj["bias"] = rng.uniform(-0.2, 0.2, 3).astype(np.float32)
        return adj["scale"], adj["bias"]

    graph = fbn.Graph()
    flag = fbn.TrainingFlag()
    kw = dict(axis=1, gamma_initializer=fbn.layers.initializers.constant(gamma),
              beta_initializer=fbn.layers.initializers.constant(beta), epsilon=EPS,
              momentum=momentum, adjustment=adjustment)
    if renorm:
        kw.update(renorm=True, renorm_momentum=0.8,
                  renorm_clipping={"rmax": rmax, "rmin": rmin, "dmax": dmax})
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(**kw)
        moving_mean, moving_variance = 0., 1.
        moving_stddev, renorm_mean, renorm_stddev = 1., 0., 1.
        for _ in range(5):
            x = rng.random_sample(shape).astype(np.float32)
            flag.value = True
            yt_train = bn(x, training=flag)
            graph.run(bn.updates[-2:])
            adj_scale, adj_bias = adj["scale"], adj["bias"]
            mean, variance = x.mean(0), x.var(0)
            if renorm:
                stddev = np.sqrt(variance + EPS)
                r = np.clip(stddev / renorm_stddev, rmin, rmax)
                d = np.clip((mean - renorm_mean) / renorm_stddev, -dmax, dmax)
                y_train = (((x - mean) / stddev * r + d) * adj_scale + adj_bias) * gamma + beta
                renorm_mean += (mean - renorm_mean) * 0.2
                renorm_stddev += (stddev - renorm_stddev) * 0.2
                moving_mean += (mean - moving_mean) * (1. - momentum)
                moving_stddev += (stddev - moving_stddev) * (1. - momentum)
                y_test = (x - moving_mean) / moving_stddev * gamma + beta
            else:
                y_train = (((x - mean) / (variance + EPS) ** 0.5) * adj_scale + adj_bias) * \
                    gamma + beta
                moving_mean += (mean - moving_mean) * (1. - momentum)
                moving_variance += (variance - moving_variance) * (1. - momentum)
                y_test = (x - moving_mean) / (moving_variance + EPS) ** 0.5 * gamma + beta
            flag.value = False
            yt_test = bn(x, training=flag)
            np.testing.assert_allclose(yt_train, y_train, atol=1e-5)
            np.testing.assert_allclose(yt_test, y_test, atol=1e-5)


def test_adjustment():
    _adjustment_run(renorm=False)


def test_renorm_with_adjustment():
    _adjustment_run(renorm=True)


def test_ghost_bn_negative_virtual_batch():
    with fbn.Graph().as_default():
        with pytest.raises(ValueError, match="virtual_batch_size"):
            fbn.layers.batch_normalization(np.ones((6, 5, 4, 3), np.float32),
                                           virtual_batch_size=-1)


def test_ghost_bn_virtual_batch_full():
    x = np.random.RandomState(8).random_sample((6, 5, 4, 3)).astype(np.float32)
    y1 = fbn.layers.BatchNormalization()(x, training=True)
    y2 = fbn.layers.BatchNormalization(virtual_batch_size=6)(x, training=True)
    assert y2.shape == x.shape
    np.testing.assert_allclose(y1, y2, atol=1e-5)


def test_ghost_bn_input_output_shapes_match():
    x = np.ones((6, 4, 3), np.float32)
    assert fbn.layers.BatchNormalization(virtual_batch_size=3)(x, training=True).shape == x.shape


def test_ghost_bn_unknown_batch_size():
    bn = fbn.layers.BatchNormalization(virtual_batch_size=2)
    assert bn(np.ones((10, 5, 4), np.float32), training=True).shape == (10, 5, 4)


def _ghost_reference(x, vbs, reduce_axes, mm, mv, momentum, gamma, beta):
    """TensorFlow's reshape [vbs, N/vbs, ...]: virtual batch j is the strided set j, j + N/vbs,
    ...; statistics per virtual batch, moving statistics from their mean."""
    shape = x.shape
    sub = x.reshape((vbs, shape[0] // vbs) + shape[1:])
    means = sub.mean(axis=reduce_axes, keepdims=True)
    variances = sub.var(axis=reduce_axes, keepdims=True)
    mm = mm * momentum + means.mean(axis=1, keepdims=True) * (1 - momentum)
    mv = mv * momentum + variances.mean(axis=1, keepdims=True) * (1 - momentum)
    y_train = ((sub - means) / np.sqrt(variances + EPS) * gamma + beta).reshape(shape)
    xe = x.reshape((1, shape[0]) + shape[1:])
    y_test = ((xe - mm) / np.sqrt(mv + EPS) * gamma + beta).reshape(shape)
    return y_train, y_test, mm, mv


# reduce_axes index the reshaped [vbs, N / vbs, ...] input.
@pytest.mark.parametrize("shape,axis,vbs,reduce_axes,atol", [
    ((6, 2), -1, 3, (0,), 1e-5),                          # testGhostBN2Dims
    ((6, 10, 10, 3), 3, 2, (0, 2, 3), 1e-2),              # testGhostBN4DimsAxis3
    ((6, 3, 10, 10), 1, 2, (0, 3, 4), 1e-2),              # testGhostBN4DimsAxis1
    ((6, 3, 10, 10, 4), [1, 4], 3, (0, 3, 4), 1e-2),      # testGhostBN5DimsMultiAxis14
])
def test_ghost_bn(shape, axis, vbs, reduce_axes, atol):
    momentum, gamma, beta = 0.8, 3., 2.
    rank = len(shape)
    axes = [a % rank for a in ([axis] if isinstance(axis, int) else axis)]
    pshape = [1, 1] + [shape[a] if a in axes else 1 for a in range(1, rank)]
    mm, mv = np.zeros(pshape), np.ones(pshape)
    graph = fbn.Graph()
    flag = fbn.TrainingFlag()
    rng = np.random.RandomState(9)
    with graph.as_default():
        bn = fbn.layers.BatchNormalization(
            axis=axis, momentum=momentum, epsilon=EPS, virtual_batch_size=vbs, fused=False,
            gamma_initializer=fbn.layers.initializers.constant(gamma),
            beta_initializer=fbn.layers.initializers.constant(beta))
        for _ in range(5):
            x = rng.random_sample(shape).astype(np.float32)
            # A runtime flag disables ghost batching in TensorFlow 2; a static True is used.
            yt_train = bn(x, training=True)
            graph.run(bn.updates[-2:])
            y_train, y_test, mm, mv = _ghost_reference(x.astype(np.float64), vbs, reduce_axes,
                                                       mm, mv, momentum, gamma, beta)
            flag.value = False
            yt_test = bn(x, training=flag)
            np.testing.assert_allclose(yt_train, y_train, atol=atol)
            np.testing.assert_allclose(yt_test, y_test, atol=atol)
            assert bn.moving_mean.shape == tuple(pshape)


def test_multi_axis_invalid():
    x = np.ones((6, 5, 4, 3), np.float32)
    for axis in ([1, 4], [-5, 1], [1, 2, 1]):
        with pytest.raises(ValueError):
            fbn.layers.BatchNormalization(axis=axis)(x, training=True)
