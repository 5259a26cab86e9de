"""TensorFlow's own batch-norm tests, ported to fbn (shared/spec/tf-tests.md sections A, B, D, G).

The data, seeds, reference formulas and tolerances are TensorFlow's; the references are NumPy
re-implementations, so this file needs no TensorFlow. Departures from the originals:
- bfloat16 runs on CPU too (TF skips it there).
- TF differentiates through the fused op with its gradient registry; here the Jacobians come from
  fbn's own FusedBatchNormGradV3 (with the forward's reserve spaces in training and the population
  statistics in inference). In inference fbn takes NCHW/NCDHW directly; TF transposes to NHWC.
- Grad-grad configs are reduced to first-order properties of the ops: the gradients against TF's
  Python reference ``_BatchNormGrad``, their Jacobians w.r.t. grad_y (the op is linear in it), and
  for float32 the numeric Jacobians w.r.t. x and scale against the reference's. fbn has no
  second-order gradient function to compare with symbolically.
- The non-fused ops have no gradients in fbn, so section G's gradient tests are not ported.
"""
import numpy as np
import pytest

import fbn
import bn_reference as ref
from bn_reference import BF16, COUNTS, F16, F32

DTYPES_16_32 = [np.float16, np.float32, BF16.type]
DTYPE_IDS = ["float16", "float32", "bfloat16"]

SHAPES = {
    1: [1, 1, 6, 1],
    2: [1, 1, 6, 2],
    3: [1, 2, 1, 6],
    4: [27, 131, 127, 6],
    5: [0, 131, 127, 6],
    6: [1, 1, 1, 1],
    7: [1, 2, 6, 1, 3],
}
GRAD_SHAPES = {
    1: [1, 1, 6, 1],
    2: [1, 1, 6, 2],
    3: [1, 2, 1, 6],
    4: [5, 7, 11, 4],
    5: [0, 7, 11, 4],
    6: [1, 1, 1, 1],
    7: [1, 2, 6, 1, 3],
}


def _runtests_params(shapes):
    """_runtests: formats by rank, factors {1.0, 0.6}, x dtypes {f16, f32, bf16}, U float32."""
    params = []
    for sid, shape in shapes.items():
        formats = ref.FORMATS_4D if len(shape) == 4 else ("NCDHW", "NDHWC")
        for dtype, did in zip(DTYPES_16_32, DTYPE_IDS):
            for fmt in formats:
                for factor in (1.0, 0.6):
                    params.append(pytest.param(shape, dtype, fmt, factor,
                                               id=f"Shape{sid}-{did}-{fmt}-f{factor}"))
    return params


def scale_shape_for(x_shape, data_format):
    return x_shape[-1:] if ref.channels_last(data_format) else x_shape[1:2]


def _assert_all_close(expected, actual, atol, rtol=1e-6):
    """TF's assertAllClose: |a - b| <= atol + rtol * |b|, NaNs equal, shapes equal."""
    a = np.asarray(actual).astype(np.float64)
    b = np.asarray(expected).astype(np.float64)
    assert a.shape == b.shape
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


def _count():
    COUNTS["ported TF test cases passed (test_tf_ported)"] += 1


# ----------------------------------------------------------------------------------------------
# Helpers that play TF's gradient machinery with fbn's ops.
# ----------------------------------------------------------------------------------------------
def _empty_stats():
    return np.zeros((0,), np.float32)


def fwd_v3(x, scale, offset, mean, var, epsilon, factor, data_format, is_training):
    return fbn.raw_ops.FusedBatchNormV3(
        x=x, scale=scale, offset=offset, mean=_empty_stats() if mean is None else mean,
        variance=_empty_stats() if var is None else var, epsilon=epsilon,
        exponential_avg_factor=factor, data_format=data_format, is_training=is_training)


def grad_v3(dy, x, scale, fwd, mean, var, epsilon, data_format, is_training):
    """The first-order gradient TF registers for FusedBatchNormV3 (nn_grad.py)."""
    if is_training:
        rs1, rs2 = fwd.reserve_space_1, fwd.reserve_space_2
    else:
        rs1, rs2 = mean, var
    return fbn.raw_ops.FusedBatchNormGradV3(
        y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
        reserve_space_3=fwd.reserve_space_3, epsilon=epsilon, data_format=data_format,
        is_training=is_training)


def _gradient_error(theoretical, numerical):
    if theoretical.size == 0 and numerical.size == 0:
        return 0.0
    return float(np.abs(theoretical - numerical).max())


# ----------------------------------------------------------------------------------------------
# A. nn_fused_batchnorm_test.py
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("x_shape,x_dtype,data_format,factor", _runtests_params(SHAPES))
def test_inference(x_shape, x_dtype, data_format, factor):
    """_test_inference (testInferenceShape1..7)."""
    scale_shape = scale_shape_for(x_shape, data_format)
    rs = np.random.RandomState(1)
    x_val = rs.random_sample(x_shape).astype(x_dtype)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    mean_val = rs.random_sample(scale_shape).astype(np.float32)
    var_val = rs.random_sample(scale_shape).astype(np.float32)
    epsilon = 0.001
    y, _, _ = fbn.nn.fused_batch_norm(x_val, scale_val, offset_val, mean=mean_val,
                                      variance=var_val, epsilon=epsilon,
                                      exponential_avg_factor=factor, data_format=data_format,
                                      is_training=False)
    assert y.dtype == np.dtype(x_dtype)
    y_ref = ref.tf_inference_ref(x_val, scale_val, offset_val, mean_val, var_val, epsilon,
                                 data_format)
    atol = 2e-3 if ref.is16(x_dtype) else 1e-3
    _assert_all_close(y_ref, y, atol=atol)
    _count()


@pytest.mark.parametrize("x_shape,x_dtype,data_format,factor", _runtests_params(SHAPES))
def test_training(x_shape, x_dtype, data_format, factor):
    """_test_training (testTrainingShape1..7): y, running mean and Bessel-corrected variance."""
    scale_shape = scale_shape_for(x_shape, data_format)
    rs = np.random.RandomState(1)
    x_val = rs.random_sample(x_shape).astype(x_dtype)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    if factor == 1.0:
        old_mean_val = old_var_val = None
    else:
        old_mean_val = rs.random_sample(scale_shape).astype(np.float32)
        old_var_val = rs.random_sample(scale_shape).astype(np.float32)
    epsilon = 0.001
    y, mean, var = fbn.nn.fused_batch_norm(x_val, scale_val, offset_val, mean=old_mean_val,
                                           variance=old_var_val, epsilon=epsilon,
                                           exponential_avg_factor=factor,
                                           data_format=data_format, is_training=True)
    y_ref, mean_ref, var_ref = ref.tf_training_ref(x_val, scale_val, offset_val, old_mean_val,
                                                   old_var_val, factor, epsilon, data_format)
    y_atol = {np.dtype(np.float16): 2e-3, BF16: 1e-2}.get(np.dtype(x_dtype), 1e-3)
    _assert_all_close(y_ref, y, atol=y_atol)
    _assert_all_close(mean_ref, mean, atol=1e-3)
    _assert_all_close(var_ref, var, atol=1e-3)
    if np.prod(x_shape) == 0:  # testTrainingShape5: statistics of an empty batch are NaN
        assert np.isnan(mean).all() and np.isnan(var).all()
    _count()


def _gradient_errors(x_shape, x_dtype, data_format, factor, is_training):
    """_test_gradient: max |theoretical - numerical| Jacobian entries for x, scale and offset."""
    scale_shape = scale_shape_for(x_shape, data_format)
    rs = np.random.RandomState(1)
    x_val = rs.random_sample(x_shape).astype(x_dtype)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    if is_training and factor == 1.0:
        pop_mean = pop_var = None
    else:
        pop_mean = rs.random_sample(scale_shape).astype(np.float32)
        pop_var = rs.random_sample(scale_shape).astype(np.float32)
    eps = 0.001  # fused_batch_norm's default, as in TF's test
    x_size = int(np.prod(x_shape))
    c = int(np.prod(scale_shape))

    def y_of(x, scale, offset):
        return fbn.nn.fused_batch_norm(x, scale, offset, mean=pop_mean, variance=pop_var,
                                       epsilon=eps, data_format=data_format,
                                       is_training=is_training,
                                       exponential_avg_factor=factor)[0]

    def theo(x, scale, offset, which, in_size):
        """Rows of d y / d input from fbn's gradient op at (x, scale, offset)."""
        fwd = fwd_v3(x, scale, offset, pop_mean, pop_var, eps, factor, data_format, is_training)
        return ref.theoretical_jacobian(
            lambda dy: grad_v3(dy, x, scale, fwd, pop_mean, pop_var, eps, data_format,
                               is_training)[which], in_size, x_shape, x.dtype)

    if not ref.is16(x_dtype):
        t_x = theo(x_val, scale_val, offset_val, 0, x_size)
        n_x = ref.numeric_jacobian(lambda v: y_of(v, scale_val, offset_val), x_val, 1e-3)
        t_s = theo(x_val, scale_val, offset_val, 1, c)
        n_s = ref.numeric_jacobian(lambda v: y_of(x_val, v, offset_val), scale_val, 1e-3)
        t_o = theo(x_val, scale_val, offset_val, 2, c)
        n_o = ref.numeric_jacobian(lambda v: y_of(x_val, scale_val, v), offset_val, 1e-3)
    else:
        # _compute_gradient_error_float16: fresh 16-bit values; symbolic Jacobian of the 16-bit
        # graph against the numeric one of the same graph built on float32 x.
        x32_val = x_val.astype(np.float32)
        x_init = rs.random_sample(x_shape).astype(x_dtype)
        t_x = theo(x_init, scale_val, offset_val, 0, x_size)
        n_x = ref.numeric_jacobian(lambda v: y_of(v, scale_val, offset_val),
                                   x_init.astype(np.float32), 1e-3)
        s_init = rs.random_sample(scale_shape).astype(x_dtype).astype(np.float32)
        t_s = theo(x_val, s_init, offset_val, 1, c)
        n_s = ref.numeric_jacobian(lambda v: y_of(x32_val, v, offset_val), s_init, 1e-3)
        o_init = rs.random_sample(scale_shape).astype(x_dtype).astype(np.float32)
        t_o = theo(x_val, scale_val, o_init, 2, c)
        n_o = ref.numeric_jacobian(lambda v: y_of(x32_val, scale_val, v), o_init, 1e-3)
    return _gradient_error(t_x, n_x), _gradient_error(t_s, n_s), _gradient_error(t_o, n_o)


@pytest.mark.parametrize("is_training", [False, True], ids=["Inference", "Training"])
@pytest.mark.parametrize("x_shape,x_dtype,data_format,factor", _runtests_params(GRAD_SHAPES))
def test_batch_norm_grad(x_shape, x_dtype, data_format, factor, is_training):
    """testBatchNormGradInferenceShape1..7 / testBatchNormGradTrainingShape1..7."""
    err_x, err_scale, err_offset = _gradient_errors(x_shape, x_dtype, data_format, factor,
                                                    is_training)
    # TF's thresholds; its `elif dtypes.bfloat16.as_numpy_dtype:` is always true, so float32 gets
    # 2e-2 as well. test_numerics.py checks float32 gradients far more tightly.
    x_err_tolerance = 2e-3 if np.dtype(x_dtype) == F16 else 2e-2
    assert err_x < x_err_tolerance
    assert err_scale < 1e-3
    assert err_offset < 1e-3
    _count()


GRAD_GRAD_CONFIGS = {
    1: ([2, 3, 4, 5], 1e-2, np.float32),
    2: ([2, 3, 2, 2], 1e-3, np.float32),
    3: ([2, 3, 4, 5], 2e-2, np.float16),
    4: ([2, 3, 2, 2], 2e-3, np.float16),
    5: ([2, 3, 2, 2, 2], 2e-3, np.float32),
    6: ([2, 3, 2, 2, 2], 3e-3, np.float16),
}


def _grad_grad_params():
    params = []
    for cid, (shape, tol, dtype) in GRAD_GRAD_CONFIGS.items():
        formats = ref.FORMATS_4D if len(shape) == 4 else ref.FORMATS_5D
        for is_training in (True, False):
            for fmt in formats:
                params.append(pytest.param(shape, tol, dtype, fmt, is_training,
                                           id=f"Config{cid}-{fmt}-"
                                              f"{'train' if is_training else 'infer'}"))
    return params


@pytest.mark.parametrize("x_shape,err_tolerance,x_dtype,data_format,is_training",
                         _grad_grad_params())
def test_batch_norm_grad_grad_first_order(x_shape, err_tolerance, x_dtype, data_format,
                                          is_training):
    """testBatchNormGradGradConfig1..6, reduced to the first-order parts (see module doc)."""
    scale_shape = [ref.num_channels(x_shape, data_format)]
    rs = np.random.RandomState(1)
    x_val = rs.random_sample(x_shape).astype(x_dtype)
    grad_y_val = rs.random_sample(x_shape).astype(x_dtype)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    if is_training:
        pop_mean = pop_var = None
    else:
        pop_mean = rs.random_sample(scale_shape).astype(np.float32)
        pop_var = rs.random_sample(scale_shape).astype(np.float32)
    eps = 0.001  # y.op's epsilon attr: fused_batch_norm's default

    def grads(dy, x, scale):
        fwd = fwd_v3(x, scale, offset_val, pop_mean, pop_var, eps, 1.0, data_format, is_training)
        return grad_v3(dy, x, scale, fwd, pop_mean, pop_var, eps, data_format, is_training)[:3]

    def ref_grads(dy, x, scale):
        return ref.tf_python_batch_norm_grad(dy, x, scale, pop_mean, pop_var, eps, data_format,
                                             is_training)

    # 1. The gradients against TF's Python reference _BatchNormGrad (TF checks this in training;
    #    the reference covers inference too).
    got = grads(grad_y_val, x_val, scale_val)
    want = ref_grads(grad_y_val, x_val, scale_val)
    for g, w in zip(got, want):
        _assert_all_close(w, g, atol=err_tolerance)

    # 2. d grad_{x,scale,offset} / d grad_y: the op is linear in grad_y, so applying it to unit
    #    vectors gives its exact Jacobian; the float64 reference gives the expected one.
    x64 = x_val.astype(np.float64)
    for k in range(3):
        t = ref.unit_response(lambda dy, k=k: grads(dy, x_val, scale_val)[k], x_shape, x_dtype)
        r = ref.unit_response(
            lambda dy, k=k: ref.tf_python_batch_norm_grad(dy, x64, scale_val.astype(np.float64),
                                                          pop_mean, pop_var, eps, data_format,
                                                          is_training)[k],
            x_shape, np.float64)
        assert _gradient_error(t, r) < err_tolerance, f"d grad[{k}] / d grad_y"

    # 3. float32: numeric Jacobians of fbn's gradients w.r.t. x (statistics recomputed by the
    #    forward) and scale, against the float64 reference's.
    if np.dtype(x_dtype) == F32:
        s64 = scale_val.astype(np.float64)
        dy64 = grad_y_val.astype(np.float64)
        checks = [(1, "x")] + ([(0, "x")] if is_training else []) + [(0, "scale")]
        for k, wrt in checks:
            if wrt == "x":
                num = ref.numeric_jacobian(lambda v, k=k: grads(grad_y_val, v, scale_val)[k],
                                           x_val, 1e-3)
                exp = ref.numeric_jacobian(lambda v, k=k: ref_grads(dy64, v, s64)[k], x64, 1e-6)
            else:
                num = ref.numeric_jacobian(lambda v, k=k: grads(grad_y_val, x_val, v)[k],
                                           scale_val, 1e-3)
                exp = ref.numeric_jacobian(lambda v, k=k: ref_grads(dy64, x64, v)[k], s64, 1e-6)
            assert _gradient_error(num, exp) < err_tolerance, f"d grad[{k}] / d {wrt}"
    _count()


def test_5d_batch_norm_followed_by_relu():
    """test5dBatchNormFollowedByRelu: NCDHW inference, then ReLU."""
    rs = np.random.RandomState(1)
    x = rs.random_sample((2, 3, 2, 2, 3)).astype(np.float32)
    scale = rs.random_sample((3,)).astype(np.float32)
    offset = rs.random_sample((3,)).astype(np.float32)
    mean = rs.random_sample((3,)).astype(np.float32)
    var = rs.random_sample((3,)).astype(np.float32)
    epsilon = 0.001
    y, _, _ = fbn.nn.fused_batch_norm(x, scale, offset, mean=mean, variance=var, epsilon=epsilon,
                                      data_format="NCDHW", is_training=False)
    y = np.maximum(y, 0.0)
    y_ref = np.maximum(ref.tf_inference_ref(x, scale, offset, mean, var, epsilon, "NCDHW"), 0.0)
    _assert_all_close(y_ref, y, atol=1e-3)
    _count()


def _ones(*shape):
    return np.ones(shape, np.float32)


@pytest.mark.parametrize("kwargs,regex", [
    (dict(scale=_ones(3), offset=_ones(2)), "scale must have the same number of elements"),
    (dict(scale=_ones(2), offset=_ones(3)), "offset must have the same number of elements"),
    (dict(scale=_ones(2), offset=_ones(2), mean=_ones(0), variance=_ones(2), is_training=False),
     "When is_training=false, mean must have the same number of elements"),
    (dict(scale=_ones(2), offset=_ones(2), mean=_ones(2), variance=_ones(0), is_training=False),
     "When is_training=false, variance must have the same number of elements"),
    (dict(scale=_ones(2), offset=_ones(2), mean=_ones(0), variance=_ones(2),
          exponential_avg_factor=0.5),
     "When exponential_avg_factor != 1, mean must have the same number of elements"),
    (dict(scale=_ones(2), offset=_ones(2), mean=_ones(2), variance=_ones(0),
          exponential_avg_factor=0.5),
     "When exponential_avg_factor != 1, variance must have the same number of elements"),
], ids=["scale", "offset", "infer-mean", "infer-variance", "eaf-mean", "eaf-variance"])
def test_eager_shape_errors(kwargs, regex):
    """testEagerShapeErrors."""
    with pytest.raises(fbn.errors.InvalidArgumentError, match=regex):
        fbn.nn.fused_batch_norm(_ones(2, 2, 2, 2), **kwargs)
    COUNTS["error cases checked (test_tf_ported)"] += 1
    _count()


@pytest.mark.parametrize("shapes,regex", [
    (((2, 2, 2, 3), (2, 2, 2, 2), 2, 2, 2), "x and y_backprop must have same shape,"),
    (((2, 2, 2, 2), (2, 2, 2, 2), 3, 2, 2), "scale must have the same number of elements"),
    (((2, 2, 2, 2), (2, 2, 2, 2), 2, 3, 2),
     "reserve_space_1 must have the same number of elements"),
    (((2, 2, 2, 2), (2, 2, 2, 2), 2, 2, 3),
     "reserve_space_2 must have the same number of elements"),
], ids=["shape", "scale", "reserve_space_1", "reserve_space_2"])
def test_eager_shape_grad_errors(shapes, regex):
    """testEagerShapeGradErrors (gen_nn_ops.fused_batch_norm_grad_v2 with its defaults)."""
    dy, x, s, r1, r2 = shapes
    with pytest.raises(fbn.errors.InvalidArgumentError, match=regex):
        fbn.raw_ops.FusedBatchNormGradV2(y_backprop=_ones(*dy), x=_ones(*x), scale=_ones(s),
                                         reserve_space_1=_ones(r1), reserve_space_2=_ones(r2))
    COUNTS["error cases checked (test_tf_ported)"] += 1
    _count()


# ----------------------------------------------------------------------------------------------
# B. fused_batch_norm_op_test.cc: golden values, ExpectTensorNear(..., 0.01)
# ----------------------------------------------------------------------------------------------
def _two_channels(values):
    """[1, 1, 6, 2] with both channels equal to `values`."""
    return np.repeat(np.asarray(values, np.float32)[:, None], 2, axis=1).reshape(1, 1, 6, 2)


FORWARD_OPS = ["FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3"]
GRAD_OPS = ["FusedBatchNormGrad", "FusedBatchNormGradV2", "FusedBatchNormGradV3"]
GOLDEN_Y = [-3.86, -1.51, 0.83, 3.17, 5.51, 7.86]


def _near(actual, expected):
    np.testing.assert_allclose(np.asarray(actual, np.float64), np.asarray(expected, np.float64),
                               rtol=0, atol=0.01)


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_golden_training(op):
    """FusedBatchNormOpTest.Training."""
    out = getattr(fbn.raw_ops, op)(x=_two_channels([5, 7, 9, 11, 13, 15]), scale=[4.0, 4.0],
                                   offset=[2.0, 2.0], mean=_ones(0), variance=_ones(0),
                                   epsilon=0.001, exponential_avg_factor=1.0, is_training=True)
    _near(out.y, _two_channels(GOLDEN_Y))
    _near(out.batch_mean, [10, 10])
    _near(out.batch_variance, [14, 14])
    _count()


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_golden_training_running_mean(op):
    """FusedBatchNormOpTest.TrainingRunningMean."""
    out = getattr(fbn.raw_ops, op)(x=_two_channels([5, 7, 9, 11, 13, 15]), scale=[4.0, 4.0],
                                   offset=[2.0, 2.0], mean=[6.0, 6.0], variance=[16.0, 16.0],
                                   epsilon=0.001, exponential_avg_factor=0.5, is_training=True)
    _near(out.y, _two_channels(GOLDEN_Y))
    _near(out.batch_mean, [8, 8])
    _near(out.batch_variance, [15, 15])
    _count()


@pytest.mark.parametrize("factor", [1.0, 0.5], ids=["Inference", "InferenceIgnoreAvgFactor"])
@pytest.mark.parametrize("op", FORWARD_OPS)
def test_golden_inference(op, factor):
    """FusedBatchNormOpTest.Inference and InferenceIgnoreAvgFactor."""
    out = getattr(fbn.raw_ops, op)(x=_two_channels([5, 7, 9, 11, 13, 15]), scale=[4.0, 4.0],
                                   offset=[2.0, 2.0], mean=[10.0, 10.0], variance=[11.67, 11.67],
                                   epsilon=0.001, exponential_avg_factor=factor,
                                   is_training=False)
    _near(out.y, _two_channels(GOLDEN_Y))
    _count()


@pytest.mark.parametrize("op", FORWARD_OPS)
def test_golden_empty_input(op):
    """FusedBatchNormOpTest.EmptyInput: x [1,1,0,0] runs and y keeps its shape."""
    out = getattr(fbn.raw_ops, op)(x=np.zeros((1, 1, 0, 0), np.float32), scale=_ones(0),
                                   offset=_ones(0), mean=_ones(0), variance=_ones(0),
                                   epsilon=0.001, is_training=True)
    assert out.y.shape == (1, 1, 0, 0)
    _count()


@pytest.mark.parametrize("op", GRAD_OPS)
def test_golden_grad_simple(op):
    """FusedBatchNormGradOpTest.Simple."""
    kwargs = dict(y_backprop=_two_channels([2, 9, -4, 5, 8, 7]),
                  x=_two_channels([1, 7, 4, -3, -11, 13]), scale=[4.0, 4.0],
                  reserve_space_1=[1.833, 1.833], reserve_space_2=[57.472, 57.472], epsilon=0.001)
    if op.endswith("V3"):
        kwargs["reserve_space_3"] = _ones(0)
    out = getattr(fbn.raw_ops, op)(**kwargs)
    _near(out.x_backprop, _two_channels([-1.34, 2.47, -4.44, 0.17, 1.60, 1.53]))
    _near(out.scale_backprop, [-1.6488, -1.6488])
    _near(out.offset_backprop, [27, 27])
    _count()


# ----------------------------------------------------------------------------------------------
# D. compiler/tests/fused_batchnorm_test.py (XLA): x [2, 2, 6, 3], eps 0.001
# ----------------------------------------------------------------------------------------------
XLA_FORMATS = ["NHWC", "NCHW"]
XLA_FORMATS_AND_FACTORS = [("NHWC", 1.0), ("NHWC", 0.6), ("NCHW", 1.0), ("NCHW", 0.6)]


@pytest.mark.parametrize("data_format", XLA_FORMATS)
def test_xla_inference(data_format):
    """testInference: is_training=False with the batch's own (biased) statistics."""
    rs = np.random.RandomState(3)
    x_shape, scale_shape = [2, 2, 6, 3], [3]
    x_val = rs.random_sample(x_shape).astype(np.float32)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    epsilon = 0.001
    y_ref, mean_ref, var_ref, _ = ref.xla_reference_training(x_val, scale_val, offset_val, None,
                                                             None, epsilon, 1.0)
    y, _, _ = fbn.nn.fused_batch_norm(ref.convert_format(x_val, "NHWC", data_format), scale_val,
                                      offset_val, mean=mean_ref.astype(np.float32),
                                      variance=var_ref.astype(np.float32), epsilon=epsilon,
                                      data_format=data_format, is_training=False)
    _assert_all_close(ref.convert_format(y_ref, "NHWC", data_format), y, atol=1e-3)
    _count()


def _xla_learning(data_format, factor, use_gradient_checker):
    rs = np.random.RandomState(4)
    x_shape, scale_shape = [2, 2, 6, 3], [3]
    x_val = rs.random_sample(x_shape).astype(np.float32)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    offset_val = rs.random_sample(scale_shape).astype(np.float32)
    mean_val = rs.random_sample(scale_shape).astype(np.float32)
    var_val_corr = rs.random_sample(scale_shape).astype(np.float32)
    epsilon = 0.001
    y_ref, mean_ref, _, var_ref_corr = ref.xla_reference_training(
        x_val, scale_val, offset_val, mean_val, var_val_corr, epsilon, factor)
    x_conv = ref.convert_format(x_val, "NHWC", data_format)
    old_mean, old_var = (None, None) if factor == 1.0 else (mean_val, var_val_corr)

    def run(x):
        return fbn.nn.fused_batch_norm(x, scale_val, offset_val, mean=old_mean, variance=old_var,
                                       epsilon=epsilon, exponential_avg_factor=factor,
                                       data_format=data_format, is_training=True)
    if use_gradient_checker:
        fwd = fwd_v3(x_conv, scale_val, offset_val, old_mean, old_var, epsilon, factor,
                     data_format, True)
        theo = ref.theoretical_jacobian(
            lambda dy: grad_v3(dy, x_conv, scale_val, fwd, old_mean, old_var, epsilon,
                               data_format, True).x_backprop, x_conv.size, x_conv.shape,
            np.float32)
        num = ref.numeric_jacobian(lambda v: run(v)[0], x_conv, 1e-3)
        assert _gradient_error(theo, num) < 1e-3
    y, mean, var = run(x_conv)
    _assert_all_close(ref.convert_format(y_ref, "NHWC", data_format), y, atol=1e-3)
    _assert_all_close(mean_ref, mean, atol=1e-3)
    _assert_all_close(var_ref_corr, var, atol=1e-3)


@pytest.mark.parametrize("data_format,factor", XLA_FORMATS_AND_FACTORS)
def test_xla_learning(data_format, factor):
    """testLearning: y, running mean and corrected variance."""
    _xla_learning(data_format, factor, use_gradient_checker=False)
    _count()


@pytest.mark.parametrize("data_format,factor", XLA_FORMATS_AND_FACTORS)
def test_xla_learning_with_gradient_checker(data_format, factor):
    """testLearningWithGradientChecker: plus compute_gradient_error(x -> y) < 1e-3."""
    _xla_learning(data_format, factor, use_gradient_checker=True)
    _count()


def _xla_grad_data(seed):
    rs = np.random.RandomState(seed)
    x_shape, scale_shape = [2, 2, 6, 3], [3]
    grad_val = rs.random_sample(x_shape).astype(np.float32)
    x_val = rs.random_sample(x_shape).astype(np.float32)
    scale_val = rs.random_sample(scale_shape).astype(np.float32)
    mean_val = rs.random_sample(scale_shape).astype(np.float32)
    var_val = rs.random_sample(scale_shape).astype(np.float32)
    return grad_val, x_val, scale_val, mean_val, var_val


@pytest.mark.parametrize("data_format", XLA_FORMATS)
def test_xla_gradient_training(data_format):
    """testGradientTraining: FusedBatchNormGrad with rs1 = mean, rs2 = variance (CPU meaning)."""
    grad_val, x_val, scale_val, mean_val, var_val = _xla_grad_data(5)
    epsilon = 0.001
    gx_ref, gs_ref, go_ref = ref.xla_reference_grad(x_val, grad_val, scale_val, mean_val, var_val,
                                                    epsilon)
    out = fbn.raw_ops.FusedBatchNormGrad(
        y_backprop=ref.convert_format(grad_val, "NHWC", data_format),
        x=ref.convert_format(x_val, "NHWC", data_format), scale=scale_val,
        reserve_space_1=mean_val, reserve_space_2=var_val, epsilon=epsilon,
        data_format=data_format, is_training=True)
    _assert_all_close(ref.convert_format(gx_ref, "NHWC", data_format), out.x_backprop, atol=1e-2)
    _assert_all_close(gs_ref, out.scale_backprop, atol=1e-2)
    _assert_all_close(go_ref, out.offset_backprop, atol=1e-3)
    _count()


@pytest.mark.parametrize("data_format", XLA_FORMATS)
def test_xla_gradient_inference(data_format):
    """testGradientInference: XLA against TF's kernel; here fbn against that kernel's formula
    (tf-semantics.md §5.4), which fbn applies to NCHW directly."""
    grad_val, x_val, scale_val, mean_val, var_val = _xla_grad_data(6)
    epsilon = 0.0001  # the op's default, as in the XLA test
    g = ref.convert_format(grad_val, "NHWC", data_format)
    x = ref.convert_format(x_val, "NHWC", data_format)
    out = fbn.raw_ops.FusedBatchNormGrad(y_backprop=g, x=x, scale=scale_val,
                                         reserve_space_1=mean_val, reserve_space_2=var_val,
                                         data_format=data_format, is_training=False)
    gx_ref, gs_ref, go_ref = ref.grad_ref(g, x, scale_val, mean_val, var_val, epsilon,
                                          data_format, is_training=False)
    _assert_all_close(gx_ref, out.x_backprop, atol=1e-2)
    _assert_all_close(gs_ref, out.scale_backprop, atol=1e-2)
    _assert_all_close(go_ref, out.offset_backprop, atol=1e-3)
    _count()


# ----------------------------------------------------------------------------------------------
# G. nn_batchnorm_test.py: tf.nn.batch_normalization and tf.nn.moments
# ----------------------------------------------------------------------------------------------
def _np_batch_norm(x, m, v, beta, gamma, epsilon, scale_after, shift_after):
    y = (x - m) / np.sqrt(v + epsilon)
    y = y * gamma if scale_after else y
    return y + beta if shift_after else y


SCALE_SHIFT = [(True, True), (True, False), (False, True), (False, False)]


@pytest.mark.parametrize("scale_after,shift_after", SCALE_SHIFT)
def test_batch_norm(scale_after, shift_after):
    """BatchNormalizationTest.testBatchNorm (x [3,5,4,2], atol 1e-5)."""
    rs = np.random.RandomState(7)
    x_shape, param_shape = [3, 5, 4, 2], [2]
    x, m, v, beta, gamma = (rs.random_sample(s).astype(np.float32)
                            for s in (x_shape, param_shape, param_shape, param_shape, param_shape))
    epsilon = 0.001
    y = fbn.nn.batch_normalization(x, m, v, beta if shift_after else None,
                                   gamma if scale_after else None, epsilon)
    assert y.dtype == np.float32
    np_bn = _np_batch_norm(x, m, v, beta, gamma, epsilon, scale_after, shift_after)
    _assert_all_close(np_bn, y, atol=1e-5)
    _count()


@pytest.mark.parametrize("scale_after,shift_after", SCALE_SHIFT)
def test_batch_norm_keep_dims(scale_after, shift_after):
    """testBatchNormKeepDims: parameters of shape (2,) and (1,1,1,2) give the same result."""
    rs = np.random.RandomState(8)
    x = rs.random_sample((3, 5, 4, 2)).astype(np.float32)
    m, v, beta, gamma = (rs.random_sample(2).astype(np.float32) for _ in range(4))
    k = lambda a: a.reshape(1, 1, 1, 2)  # noqa: E731
    epsilon = 0.001
    bn = fbn.nn.batch_normalization(x, m, v, beta if shift_after else None,
                                    gamma if scale_after else None, epsilon)
    bn_k = fbn.nn.batch_normalization(x, k(m), k(v), k(beta) if shift_after else None,
                                      k(gamma) if scale_after else None, epsilon)
    assert bn.shape == bn_k.shape == (3, 5, 4, 2)
    _assert_all_close(bn, bn_k, atol=1e-6)
    _count()


@pytest.mark.parametrize("x_shape,param_shape,atol", [
    ((3, 3), (1, 3), 1e-4),
    ((3, 3), (3, 1), 1e-4),
    ((3, 2, 4, 5), (1, 2, 1, 1), 1e-4),
    ((2, 3, 2, 4, 5), (1, 1, 1, 4, 5), 5e-3),
])
@pytest.mark.parametrize("scale_after,shift_after", SCALE_SHIFT)
def test_batch_norm_arbitrary_shapes(x_shape, param_shape, atol, scale_after, shift_after):
    """testBatchNormArbitraryShapes."""
    rs = np.random.RandomState(9)
    x = rs.random_sample(x_shape).astype(np.float32)
    m, v, beta, gamma = (rs.random_sample(param_shape).astype(np.float32) for _ in range(4))
    epsilon = 0.001
    y = fbn.nn.batch_normalization(x, m, v, beta if shift_after else None,
                                   gamma if scale_after else None, epsilon)
    np_bn = _np_batch_norm(x, m, v, beta, gamma, epsilon, scale_after, shift_after)
    assert y.shape == np_bn.shape == x_shape
    _assert_all_close(np_bn, y, atol=atol)
    _count()


def test_batch_norm_float16():
    """testBatchNorm's data in float16 (TF's non-fused op computes 16-bit in its own dtype);
    half tolerances of assertAllCloseAccordingToType (1e-3)."""
    rs = np.random.RandomState(10)
    x = rs.random_sample((3, 5, 4, 2)).astype(np.float16)
    m, v, beta, gamma = (rs.random_sample(2).astype(np.float16) for _ in range(4))
    y = fbn.nn.batch_normalization(x, m, v, beta, gamma, 0.001)
    assert y.dtype == np.float16
    np_bn = _np_batch_norm(*(a.astype(np.float64) for a in (x, m, v, beta, gamma)), 0.001,
                           True, True)
    _assert_all_close(np_bn, y, atol=1e-3, rtol=1e-3)
    _count()


def _moment_tolerance(dtype):
    """assertAllCloseAccordingToType: float32 1e-6, half 1e-3."""
    return 1e-3 if np.dtype(dtype) == F16 else 1e-6


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("keep_dims", [False, True])
@pytest.mark.parametrize("axes", [[0], [0, 1, 2], [1, 2, 3]],
                         ids=["Basic", "GlobalNormalization", "Axes"])
def test_moments(axes, keep_dims, dtype):
    """MomentsTest.testBasic / testGlobalNormalization / testAxes (RunMomentTest): x normal,
    expected values in extended precision from E[x²] - E[x]²."""
    shape = [2, 3, 5, 4]
    rs = np.random.RandomState(11)
    x_numpy = rs.normal(size=shape).astype(np.float32)
    x = x_numpy.astype(dtype)
    mean, var = fbn.nn.moments(x, axes, keep_dims=keep_dims)
    assert mean.dtype == np.dtype(dtype) and var.dtype == np.dtype(dtype)
    xl = x_numpy.astype(np.longdouble)
    ax = tuple(axes)
    n = np.prod([shape[i] for i in axes])
    expected_mean = np.sum(xl, axis=ax, keepdims=keep_dims) / n
    expected_variance = (np.sum(xl * xl, axis=ax, keepdims=keep_dims) / n
                         - expected_mean * expected_mean)
    tol = _moment_tolerance(dtype)
    assert mean.shape == expected_mean.shape
    _assert_all_close(expected_mean.astype(np.float64), mean, atol=tol, rtol=tol)
    _assert_all_close(expected_variance.astype(np.float64), var, atol=tol, rtol=tol)
    _count()


@pytest.mark.parametrize("keepdims_arg", ["keep_dims", "keepdims"])
def test_moments_keepdims_spellings(keepdims_arg):
    """tf.nn.moments accepts both keep_dims (v1) and keepdims."""
    x = np.random.RandomState(12).normal(size=(2, 3, 5, 4)).astype(np.float32)
    mean, var = fbn.nn.moments(x, [0, 2], **{keepdims_arg: True})
    assert mean.shape == var.shape == (1, 3, 1, 4)
    _assert_all_close(x.astype(np.float64).mean(axis=(0, 2), keepdims=True), mean, atol=1e-6)
    _count()
