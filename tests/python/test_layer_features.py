"""fbn.layers features beyond TensorFlow's own tests: gradients of every path by finite
differences, Python callables (initializers, regularizers, constraints, adjustment), the SGD
optimizer, runtime training flags, dtypes, failed calls, update-op semantics and error texts."""
import ml_dtypes
import numpy as np
import pytest

import fbn

BN = fbn.layers.BatchNormalization


def _fd_check(kw, shape, training, dtype, h, tol, check_every=1):
    """Central differences of sum(y * w) against layer.backward, under a graph so the layer's
    state stays fixed between calls."""
    rng = np.random.RandomState(0)
    x = (rng.randn(*shape) * 1.5 + 0.5).astype(dtype)
    w = rng.randn(*shape).astype(dtype)
    with fbn.Graph().as_default():
        layer = BN(**kw)
        layer(x, training=training)
        params = [v for v in (layer.gamma, layer.beta) if v is not None]
        dx, grads = layer.backward(w, variables=params)

        def loss(xv):
            return float(np.sum(layer(xv, training=training).astype(np.float64) * w))

        flat = x.reshape(-1)
        for i in range(0, flat.size, check_every):
            xp, xm = flat.copy(), flat.copy()
            xp[i] += h
            xm[i] -= h
            fd = (loss(xp.reshape(shape)) - loss(xm.reshape(shape))) / (2 * h)
            assert abs(dx.reshape(-1)[i] - fd) <= tol, (i, dx.reshape(-1)[i], fd)
        for v, g in zip(params, grads):
            v0 = v.numpy().copy()
            for i in range(v0.size):
                vp, vm = v0.copy().reshape(-1), v0.copy().reshape(-1)
                vp[i] += h
                vm[i] -= h
                v.assign(vp.reshape(v0.shape))
                lp = loss(x)
                v.assign(vm.reshape(v0.shape))
                lm = loss(x)
                v.assign(v0)
                assert abs(g.reshape(-1)[i] - (lp - lm) / (2 * h)) <= tol * 10, (v.name, i)


INIT = dict(gamma_initializer=fbn.layers.initializers.random_uniform(0.5, 1.5, seed=1),
            beta_initializer=fbn.layers.initializers.random_uniform(-1, 1, seed=2),
            moving_mean_initializer=fbn.layers.initializers.constant(0.3),
            moving_variance_initializer=fbn.layers.initializers.constant(1.7))


@pytest.mark.parametrize("axis,shape", [(-1, (3, 2, 2, 4)), (1, (3, 4, 2, 2)),
                                        (-1, (2, 2, 1, 3, 3)), (1, (2, 3, 2, 1, 2))])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("center,scale", [(True, True), (False, True), (True, False)])
def test_fused_path_gradients_by_finite_differences(axis, shape, training, center, scale):
    kw = dict(INIT, axis=axis, center=center, scale=scale)
    layer = BN(**kw)
    layer(np.zeros(shape, np.float32), training=training)
    assert layer.fused is True
    # float32 only: a loose tolerance for the finite differences.
    _fd_check(kw, shape, training, np.float32, h=1e-2, tol=3e-3, check_every=3)


@pytest.mark.parametrize("extra,shape", [
    (dict(axis=[1, 2]), (4, 3, 2)),
    (dict(axis=0), (3, 4)),
    (dict(axis=2, virtual_batch_size=2), (6, 2, 3)),
    (dict(axis=-1, adjustment=lambda s: (np.linspace(0.5, 1.5, int(np.prod(s))).reshape(s),
                                         np.array([0.1, -0.2, 0.3]))), (4, 2, 3)),
    (dict(axis=1, renorm=True, renorm_clipping={"rmin": 1.3, "rmax": 1.3, "dmax": 0.2},
          moving_mean_initializer=fbn.layers.initializers.constant(50.0)), (5, 3)),
    (dict(axis=1, center=False, scale=False), (4, 3, 2)),
])
@pytest.mark.parametrize("training", [True, False])
def test_general_path_gradients_by_finite_differences(extra, shape, training):
    kw = dict(INIT)
    kw.update(extra)
    _fd_check(kw, shape, training, np.float64, h=1e-5, tol=1e-6)


def test_float64_renorm_matches_numpy():
    # TensorFlow's own renorm fails for float64; fbn computes it in double.
    rng = np.random.RandomState(3)
    bn = BN(axis=1, renorm=True, renorm_momentum=0.8, momentum=0.9,
            renorm_clipping={"rmax": 1.5, "rmin": 0.7, "dmax": 0.5})
    rm, rs, mm, ms, eps = 0.0, 1.0, 0.0, 1.0, 1e-3
    for _ in range(4):
        x = rng.randn(6, 3) * 2 + 1
        y = bn(x, training=True)
        assert y.dtype == np.float64 and bn.moving_mean.dtype == "float64"
        mean, sd = x.mean(0), np.sqrt(x.var(0) + eps)
        r = np.clip(sd / np.maximum(rs, np.sqrt(eps)), 0.7, 1.5)
        d = np.clip((mean - rm) / np.maximum(rs, np.sqrt(eps)), -0.5, 0.5)
        np.testing.assert_allclose(y, (x - mean) / sd * r + d, atol=1e-6)
        rm, rs = rm + (mean - rm) * 0.2, rs + (sd - rs) * 0.2
        mm, ms = mm + (mean - mm) * 0.1, ms + (sd - ms) * 0.1
        np.testing.assert_allclose(bn.renorm_mean.numpy(), rm, atol=1e-6)
        np.testing.assert_allclose(bn.moving_stddev.numpy(), ms, atol=1e-6)
        np.testing.assert_allclose(bn.moving_variance.numpy(), np.maximum(ms ** 2 - eps, 0),
                                   atol=1e-6)


def test_renorm_dependency_runs_once_per_group_run():
    x = np.random.RandomState(4).randn(8, 3).astype(np.float32)
    values = []
    for together in (True, False):
        graph = fbn.Graph()
        with graph.as_default():
            bn = BN(renorm=True, renorm_momentum=0.5)
            bn(x, training=True)
            ops = bn.updates
            if together:
                graph.run(ops)
            else:
                for op in ops:
                    op.run()  # two "session runs": the renorm updates run twice, as in TF
            values.append(bn.renorm_mean.numpy())
    np.testing.assert_allclose(values[0], 0.5 * x.mean(0), rtol=1e-5)
    np.testing.assert_allclose(values[1], 0.75 * x.mean(0), rtol=1e-5)


def test_training_flag_is_read_at_call_time():
    x = np.random.RandomState(5).randn(6, 2).astype(np.float32) + 3
    flag = fbn.TrainingFlag(False)
    bn = BN(momentum=0.5)
    y = bn(x, training=flag)  # eager, flag false: inference, the update does nothing
    np.testing.assert_allclose(y, x / np.sqrt(1 + 1e-3), rtol=1e-5)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.0)
    flag.value = True
    y = bn(x, training=flag)
    np.testing.assert_allclose(y.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(bn.moving_mean.numpy(), 0.5 * x.mean(0), rtol=1e-5)
    with fbn.Graph().as_default() as g:
        layer = BN()
        layer(x)  # training defaults to False: no update ops
        assert g.get_collection(fbn.GraphKeys.UPDATE_OPS) == []
        layer(x, training=None)  # the graph's learning phase: a runtime flag, False
        assert len(g.get_collection(fbn.GraphKeys.UPDATE_OPS)) == 2


def test_python_initializers_regularizers_constraints_and_sgd():
    calls = []

    def init(shape, dtype):
        calls.append((shape, np.dtype(dtype)))
        return np.full(shape, 2.0)

    def reg(w):
        return 0.5 * np.sum(w ** 2)
    reg.gradient = lambda w: w

    def clip(w):
        return np.minimum(w, 1.5)

    graph = fbn.Graph()
    with graph.as_default():
        bn = BN(axis=1, gamma_initializer=init, gamma_regularizer=reg, gamma_constraint=clip,
                beta_initializer="glorot_uniform", beta_regularizer=fbn.layers.regularizers.l2(0.1),
                beta_constraint=fbn.layers.constraints.non_neg())
        x = np.random.RandomState(6).randn(4, 3, 2).astype(np.float32)
        bn(x, training=True)
        assert calls == [((3,), np.dtype(np.float32))]
        limit = np.sqrt(6.0 / 6.0)
        assert np.all(np.abs(bn.beta.numpy()) <= limit)
        losses = graph.get_collection(fbn.GraphKeys.REGULARIZATION_LOSSES)
        assert [l.variable.name for l in losses] == ["batch_normalization/gamma:0",
                                                     "batch_normalization/beta:0"]
        np.testing.assert_allclose(losses[0].numpy(), 0.5 * 4 * 3, rtol=1e-6)
        beta0 = bn.beta.numpy()
        np.testing.assert_allclose(losses[1].gradient(), 0.2 * beta0, rtol=1e-6)
        # SGD with momentum, then the constraints (Keras's order).
        opt = fbn.train.SGD(learning_rate=0.1, momentum=0.9)
        grads = [l.gradient() for l in losses]
        opt.apply_gradients(zip(grads, [bn.gamma, bn.beta]))
        np.testing.assert_allclose(bn.gamma.numpy(), 1.5)  # 2 - 0.1 * 2 = 1.8 -> clipped
        np.testing.assert_allclose(bn.beta.numpy(), np.maximum(beta0 - 0.02 * beta0, 0),
                                   rtol=1e-6)
        np.testing.assert_allclose(losses[0].numpy(), 0.5 * 1.5 ** 2 * 3, rtol=1e-6)
        assert opt.iterations == 1


def test_seeded_initializers_repeat():
    v1 = BN(gamma_initializer=fbn.layers.initializers.he_normal(seed=7))
    v2 = BN(gamma_initializer=fbn.layers.initializers.he_normal(seed=7))
    v1(np.ones((2, 50), np.float32))
    v2(np.ones((2, 50), np.float32))
    np.testing.assert_array_equal(v1.gamma.numpy(), v2.gamma.numpy())
    std = np.sqrt(2.0 / 50) / 0.87962566103423978
    assert np.all(np.abs(v1.gamma.numpy()) <= 2 * std)


def test_failed_call_leaves_state_untouched():
    def broken(shape):
        raise KeyError("adjustment failed")

    x = np.random.RandomState(8).randn(4, 3).astype(np.float32)
    bn = BN(adjustment=broken)
    with pytest.raises(KeyError, match="adjustment failed"):
        bn(x, training=True)
    np.testing.assert_array_equal(bn.moving_mean.numpy(), 0.0)
    np.testing.assert_array_equal(bn.moving_variance.numpy(), 1.0)
    ok = BN(axis=1)
    ok(x, training=True)
    mm = ok.moving_mean.numpy()
    with pytest.raises(ValueError, match="expected axis 1 of input shape to have value 3"):
        ok(np.ones((4, 5), np.float32), training=True)
    np.testing.assert_array_equal(ok.moving_mean.numpy(), mm)


def test_dtypes():
    rng = np.random.RandomState(9)
    x = rng.randn(4, 3, 2, 2)
    for dtype, param in ((np.float64, "float64"), (np.float16, "float32"),
                         (ml_dtypes.bfloat16, "float32"), (np.float32, "float32")):
        bn = BN()
        y = bn(x.astype(dtype), training=True)
        assert y.dtype == np.dtype(dtype) and bn.gamma.dtype == param
        dx, _ = bn.backward(np.ones_like(y))
        assert dx.dtype == np.dtype(dtype)
    bn = BN()
    bn(x.astype(np.float32), training=True)
    y = bn(x, training=True)  # float64 input cast to the layer's float32
    assert y.dtype == np.float32
    dx, _ = bn.backward(np.ones_like(y))
    assert dx.dtype == np.float64


def test_error_texts():
    with pytest.raises(TypeError, match="Expected an int or a list/tuple of ints"):
        BN(axis="x")
    with pytest.raises(ValueError, match=r"Received invalid keys for `renorm_clipping`"):
        BN(renorm=True, renorm_clipping={"rmaxx": 1})
    with pytest.raises(ValueError, match=r"Expected 0 <= axis < inputs.rank \(with "
                                         r"inputs.rank=2\). Received: axis=\(2,\)"):
        BN(axis=2)(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"Duplicate axis: \(1, 1\)"):
        BN(axis=[1, -1])(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="Input has undefined rank"):
        BN()(np.float32(1.0))
    bn = BN()
    bn(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match="expected ndim=2, found ndim=3"):
        bn(np.ones((2, 3, 1), np.float32))
    with pytest.raises(ValueError, match="variable scope|default graph"):
        with fbn.variable_scope("s"):
            pass
    with pytest.raises(TypeError, match="Keyword argument not understood"):
        BN(dtype="float32")


def test_graph_get_variable_scopes_and_collections():
    g = fbn.Graph()
    with g.as_default():
        with fbn.variable_scope("a") as scope:
            v = g.get_variable("w", [2, 3], initializer="ones")
            assert (v.name, v.shape, v.dtype) == ("a/w:0", (2, 3), "float32")
        with fbn.variable_scope(scope, reuse=True):
            assert g.get_variable("w", [2, 3]).name == "a/w:0"
            with pytest.raises(ValueError, match="but specified shape"):
                g.get_variable("w", [3, 2])
        with pytest.raises(ValueError, match="already exists, disallowed"):
            with fbn.variable_scope("a"):
                g.get_variable("w", [2, 3])
        with fbn.variable_scope("b", reuse=fbn.graph.AUTO_REUSE):
            z = g.get_variable("z", [1], dtype=np.float64, initializer=lambda s, d: np.full(s, 3.))
            assert g.get_variable("z", [1], dtype=np.float64).numpy().tolist() == [3.0]
            assert z.dtype == "float64"
        assert [x.name for x in g.get_collection(fbn.GraphKeys.GLOBAL_VARIABLES, "a/")] == \
            ["a/w:0"]
        assert len(g.trainable_variables()) == 2
    assert fbn.graph.get_default_graph() is None
