"""fbn against the real TensorFlow (Eigen CPU kernels), seeded.

Every fused op (V1/V2/V3 forward and gradient) over random shapes (odd C, C=1, n=1, tiny, 5-D,
empty batch, C=0), every layout, float16/bfloat16/float32 (float64 against the NumPy float64
reference, since TF has no double kernel), training and inference, several epsilons and
exponential_avg_factor in {1.0, 0.6, 0.0, 1.5}. Every output TF defines is compared: values,
dtypes and shapes. Not compared: inference reserve_space_1/2 and the reserve spaces of an empty
batch (TF leaves them uninitialized).

Tolerance (vs TF): element-wise with a floor, |fbn - tf| <= rtol·(|tf| + floor) [+ 1 ulp of a
16-bit output], rtol = bn_reference.tf_rtol(n) = 4e-6 + 8·eps32·sqrt(n) for n elements per
channel, because TF sums in float32; the floor is the quantity's magnitude without cancellation.

Intended differences that are tested as such: float64 x is accepted; FusedBatchNormGrad with
is_training=False takes NCHW/NCDHW and must equal TF computed on the NHWC transpose; the
"allowed values" list of an attr type error may add "double".

Error cases (tf-semantics.md §4.2, §5.1, bad data_format attrs, wrong dtype combinations): fbn
raises InvalidArgumentError and TF's message, stripped of its "{{function_node ...}} " prefix,
" [Op:...]" suffix and "; NodeDef" tail, contains fbn's message.
"""
import re
import zlib

import numpy as np
import pytest

import fbn
import bn_reference as ref
from bn_reference import BF16, COUNTS, F16, F32, F64

tf = ref.import_tensorflow()
if tf is None:
    pytest.skip(f"tensorflow is not importable: {ref.tensorflow_import_error()}",
                allow_module_level=True)

SEED = 20240611

SHAPES_4D = [
    (2, 3, 4, 5), (1, 1, 1, 1), (1, 1, 6, 1), (1, 2, 1, 6), (3, 5, 7, 17), (2, 4, 4, 33),
    (1, 1, 1, 7), (5, 1, 1, 3), (1, 3, 1, 1), (0, 3, 4, 5), (2, 3, 4, 0), (2, 0, 3, 4),
    (4, 9, 11, 31), (8, 16, 16, 24), (1, 1, 257, 3), (2, 2, 2, 1), (7, 1, 3, 2),
]
SHAPES_5D = [(2, 3, 4, 5, 6), (1, 2, 6, 1, 3), (1, 1, 1, 1, 1), (0, 2, 3, 4, 5), (2, 3, 1, 2, 17),
             (1, 2, 2, 2, 0)]
EPSILONS = [1e-4, 1e-3, 1e-5, 0.1, 1.0]
TRAIN_FACTORS = [1.0, 0.6, 0.0, 1.5]
INFER_FACTORS = [1.0, 0.6]
TF_DTYPES = {"float16": F16, "bfloat16": BF16, "float32": F32}

FWD_OPS = {1: "FusedBatchNorm", 2: "FusedBatchNormV2", 3: "FusedBatchNormV3"}
GRAD_OPS = {1: "FusedBatchNormGrad", 2: "FusedBatchNormGradV2", 3: "FusedBatchNormGradV3"}


def _rng(case_id):
    return np.random.default_rng([SEED, zlib.crc32(case_id.encode())])


def _formats(version, rank):
    if rank == 4:
        return ref.FORMATS_4D
    return ref.FORMATS_5D if version == 3 else ()


def _dtypes(version):
    return ["float32"] if version == 1 else list(TF_DTYPES)


def _tf_call(op, kwargs):
    args = {k: tf.constant(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    return [t.numpy() for t in getattr(tf.raw_ops, op)(**args)]


# ----------------------------------------------------------------------------------------------
# Case generation
# ----------------------------------------------------------------------------------------------
def _forward_cases():
    cases = []
    k = 0
    for version in (1, 2, 3):
        for shape in SHAPES_4D + SHAPES_5D:
            for fmt in _formats(version, len(shape)):
                for dname in _dtypes(version):
                    for is_training in (True, False):
                        for factor in (TRAIN_FACTORS if is_training else INFER_FACTORS):
                            eps = EPSILONS[k % len(EPSILONS)]
                            k += 1
                            cid = (f"V{version}-{dname}-{fmt}-{'x'.join(map(str, shape))}-"
                                   f"{'train' if is_training else 'infer'}-f{factor}-eps{eps}")
                            cases.append(pytest.param(version, shape, fmt, dname, is_training,
                                                      factor, eps, id=cid))
    return cases


def _make_forward_inputs(case_id, shape, fmt, x_dtype, is_training, factor, stats_dtype=F32):
    rng = _rng(case_id)
    c = ref.num_channels(shape, fmt)
    loc, spread = rng.uniform(-2, 2), rng.uniform(0.5, 3)
    x = (rng.standard_normal(shape) * spread + loc).astype(x_dtype)
    scale = rng.standard_normal(c).astype(stats_dtype)
    offset = rng.standard_normal(c).astype(stats_dtype)
    if is_training and factor == 1.0 and rng.random() < 0.5:
        mean = np.zeros(0, stats_dtype)  # ignored by the op: usually empty
        var = np.zeros(0, stats_dtype)
    else:
        mean = rng.standard_normal(c).astype(stats_dtype)
        var = rng.uniform(0.1, 2.0, c).astype(stats_dtype)
    return x, scale, offset, mean, var


FWD_NAMES = ["y", "batch_mean", "batch_variance", "reserve_space_1", "reserve_space_2",
             "reserve_space_3"]


@pytest.mark.parametrize("version,shape,fmt,dname,is_training,factor,eps", _forward_cases())
def test_forward_matches_tf(version, shape, fmt, dname, is_training, factor, eps, request):
    x_dtype = TF_DTYPES[dname]
    x, scale, offset, mean, var = _make_forward_inputs(request.node.callspec.id, shape, fmt,
                                                       x_dtype, is_training, factor)
    kwargs = dict(x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=eps,
                  exponential_avg_factor=factor, data_format=fmt, is_training=is_training)
    op = FWD_OPS[version]
    want = _tf_call(op, kwargs)
    got = getattr(fbn.raw_ops, op)(**kwargs)
    assert len(got) == len(want) == (6 if version == 3 else 5)
    assert list(got._fields) == FWD_NAMES[:len(got)]
    n = x.size // max(ref.num_channels(shape, fmt), 1)
    rtol = ref.tf_rtol(n)
    floors = ref.stat_scales(x, mean, var, factor, fmt, is_training)
    empty = x.size == 0
    for i, (name, g, w) in enumerate(zip(FWD_NAMES, got, want)):
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != TF {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != TF {w.shape}"
        if name in ("reserve_space_1", "reserve_space_2") and (empty or not is_training):
            continue  # uninitialized in TF
        if name == "reserve_space_3":
            assert g.shape == () and g == w == 0
        elif name == "y":
            floor = ref.y_floor(x, scale, offset, mean, var, eps, fmt, is_training)
            ref.check_close(g, w, rtol, floor, dtype=x_dtype, what=name)
        else:
            ref.check_close(g, w, rtol, floors[name], what=name)
    if empty:
        assert np.isnan(got.batch_mean).all() and np.isnan(got.batch_variance).all()
    COUNTS["cases compared with TF: forward"] += 1


def _forward_f64_cases():
    cases = []
    k = 0
    for version in (1, 2, 3):
        for shape in [(2, 3, 4, 5), (1, 1, 1, 1), (3, 5, 7, 17), (0, 3, 4, 5), (2, 3, 4, 0),
                      (1, 2, 6, 1, 3), (2, 3, 1, 2, 17)]:
            for fmt in _formats(version, len(shape)):
                for is_training in (True, False):
                    for factor in (TRAIN_FACTORS if is_training else INFER_FACTORS):
                        eps = EPSILONS[k % len(EPSILONS)]
                        k += 1
                        cid = (f"V{version}-float64-{fmt}-{'x'.join(map(str, shape))}-"
                               f"{'train' if is_training else 'infer'}-f{factor}-eps{eps}")
                        cases.append(pytest.param(version, shape, fmt, is_training, factor, eps,
                                                  id=cid))
    return cases


@pytest.mark.parametrize("version,shape,fmt,is_training,factor,eps", _forward_f64_cases())
def test_forward_float64_matches_reference(version, shape, fmt, is_training, factor, eps,
                                           request):
    """float64 x (an fbn extension): every tensor float64, compared with the float64 formulas."""
    x, scale, offset, mean, var = _make_forward_inputs(request.node.callspec.id, shape, fmt, F64,
                                                       is_training, factor, stats_dtype=F64)
    got = getattr(fbn.raw_ops, FWD_OPS[version])(
        x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=eps,
        exponential_avg_factor=factor, data_format=fmt, is_training=is_training)
    c = ref.num_channels(shape, fmt)
    for name, g in zip(FWD_NAMES, got):
        assert g.dtype == F64, name
        assert g.shape == (() if name == "reserve_space_3" else shape if name == "y" else (c,))
    want = ref.forward_ref(x, scale, offset, mean, var, eps, factor, fmt, is_training)
    floors = ref.stat_scales(x, mean, var, factor, fmt, is_training)
    floor_y = ref.y_floor(x, scale, offset, mean, var, eps, fmt, is_training)
    for name, w in want.items():
        floor = floor_y if name == "y" else floors[name]
        ref.check_close(getattr(got, name), w, 1e-12, floor, what=name)
    if version == 3:
        assert got.reserve_space_3 == 0
    COUNTS["cases compared with the float64 reference: forward"] += 1


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------
def _grad_cases(dtypes_for):
    cases = []
    k = 0
    for version in (1, 2, 3):
        for shape in SHAPES_4D + SHAPES_5D:
            for fmt in _formats(version, len(shape)):
                for dname in dtypes_for(version):
                    for is_training in (True, False):
                        eps = EPSILONS[k % len(EPSILONS)]
                        k += 1
                        cid = (f"V{version}-{dname}-{fmt}-{'x'.join(map(str, shape))}-"
                               f"{'train' if is_training else 'infer'}-eps{eps}")
                        cases.append(pytest.param(version, shape, fmt, dname, is_training, eps,
                                                  id=cid))
    return cases


def _make_grad_inputs(case_id, shape, fmt, x_dtype, is_training, stats_dtype=F32):
    rng = _rng(case_id)
    c = ref.num_channels(shape, fmt)
    loc, spread = rng.uniform(-2, 2), rng.uniform(0.5, 3)
    x = (rng.standard_normal(shape) * spread + loc).astype(x_dtype)
    dy = (rng.standard_normal(shape) * rng.uniform(0.1, 3)).astype(x_dtype)
    scale = rng.standard_normal(c).astype(stats_dtype)
    if is_training and x.size and rng.random() < 0.7:
        # What the forward saves: the batch mean and the biased batch variance.
        xh = ref.to_nhwc(x.astype(np.float64), fmt)
        axes = tuple(range(xh.ndim - 1))
        rs1 = xh.mean(axis=axes).astype(stats_dtype)
        rs2 = xh.var(axis=axes).astype(stats_dtype)
    else:
        # The kernels use whatever statistics they are given (as TF's XLA test does).
        rs1 = (rng.standard_normal(c) + loc).astype(stats_dtype)
        rs2 = rng.uniform(0.1, 2.0, c).astype(stats_dtype)
    rs3 = np.zeros(0, stats_dtype)
    return dy, x, scale, rs1, rs2, rs3


GRAD_OUT_NAMES = {1: ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_3",
                      "reserve_space_4"],
                  2: ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_3",
                      "reserve_space_4"],
                  3: ["x_backprop", "scale_backprop", "offset_backprop", "reserve_space_4",
                      "reserve_space_5"]}


def _grad_kwargs(version, dy, x, scale, rs1, rs2, rs3, eps, fmt, is_training):
    kwargs = dict(y_backprop=dy, x=x, scale=scale, reserve_space_1=rs1, reserve_space_2=rs2,
                  epsilon=eps, data_format=fmt, is_training=is_training)
    if version == 3:
        kwargs["reserve_space_3"] = rs3
    return kwargs


def _check_grads(got, want, dy, x, scale, rs1, rs2, eps, fmt, is_training, rtol, x_dtype):
    floors = ref.grad_scales(dy, x, rs1, rs2, eps, fmt)
    ref.check_close(got[0], want[0], rtol,
                    ref.dx_floor(dy, x, scale, rs1, rs2, eps, fmt, is_training), dtype=x_dtype,
                    what="x_backprop")
    ref.check_close(got[1], want[1], rtol, floors["scale_backprop"], what="scale_backprop")
    ref.check_close(got[2], want[2], rtol, floors["offset_backprop"], what="offset_backprop")


@pytest.mark.parametrize("version,shape,fmt,dname,is_training,eps", _grad_cases(_dtypes))
def test_grad_matches_tf(version, shape, fmt, dname, is_training, eps, request):
    x_dtype = TF_DTYPES[dname]
    dy, x, scale, rs1, rs2, rs3 = _make_grad_inputs(request.node.callspec.id, shape, fmt, x_dtype,
                                                    is_training)
    op = GRAD_OPS[version]
    got = getattr(fbn.raw_ops, op)(**_grad_kwargs(version, dy, x, scale, rs1, rs2, rs3, eps, fmt,
                                                  is_training))
    assert list(got._fields) == GRAD_OUT_NAMES[version]
    transposed = not is_training and not ref.channels_last(fmt)
    if transposed:
        # TF's CPU kernel rejects this (fbn's intended extension); TF's own gradient function
        # transposes to channels-last, which is what fbn must equal.
        nf = ref.nhwc_format(fmt)
        want = _tf_call(op, _grad_kwargs(version, ref.to_nhwc(dy, fmt), ref.to_nhwc(x, fmt), scale,
                                         rs1, rs2, rs3, eps, nf, is_training))
        want[0] = ref.from_nhwc(want[0], fmt)
    else:
        want = _tf_call(op, _grad_kwargs(version, dy, x, scale, rs1, rs2, rs3, eps, fmt,
                                         is_training))
    if x.size == 0 and x.ndim == 5:
        # TF quirk: its empty-input early return skips the 5-D -> 4-D reshape back, so its
        # x_backprop has the internal 4-D shape. fbn keeps x's shape.
        assert want[0].shape == ref.reshape_5d_to_4d(shape, fmt)
        want[0] = want[0].reshape(shape)
    for name, g, w in zip(GRAD_OUT_NAMES[version], got, want):
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype} != TF {w.dtype}"
        assert g.shape == w.shape, f"{name}: shape {g.shape} != TF {w.shape}"
    assert got[0].shape == shape and got[3].shape == got[4].shape == (0,)
    n = x.size // max(ref.num_channels(shape, fmt), 1)
    _check_grads(got, want, dy, x, scale, rs1, rs2, eps, fmt, is_training, ref.tf_rtol(n),
                 x_dtype)
    if x.size == 0:
        assert not got.scale_backprop.any() and not got.offset_backprop.any()
    COUNTS["cases compared with TF: gradient"] += 1
    if transposed:
        COUNTS["cases compared with TF: inference gradient in NCHW/NCDHW via NHWC"] += 1


@pytest.mark.parametrize("version,shape,fmt,dname,is_training,eps",
                         _grad_cases(lambda v: ["float64"]))
def test_grad_float64_matches_reference(version, shape, fmt, dname, is_training, eps, request):
    dy, x, scale, rs1, rs2, rs3 = _make_grad_inputs(request.node.callspec.id, shape, fmt, F64,
                                                    is_training, stats_dtype=F64)
    got = getattr(fbn.raw_ops, GRAD_OPS[version])(**_grad_kwargs(version, dy, x, scale, rs1, rs2,
                                                                 rs3, eps, fmt, is_training))
    for g in got:
        assert g.dtype == F64
    assert got[0].shape == shape and got[3].shape == got[4].shape == (0,)
    want = ref.grad_ref(dy, x, scale, rs1, rs2, eps, fmt, is_training)
    _check_grads(got, want, dy, x, scale, rs1, rs2, eps, fmt, is_training, 1e-12, F64)
    COUNTS["cases compared with the float64 reference: gradient"] += 1


# ----------------------------------------------------------------------------------------------
# Shapes TF accepts beyond the op's registered formats (the kernel only checks rank 4 or 5)
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("version,shape,fmt", [
    (1, (1, 2, 3, 2, 3), "NHWC"), (1, (2, 3, 1, 2, 2), "NCHW"), (2, (1, 2, 3, 2, 3), "NHWC"),
    (2, (2, 3, 1, 2, 2), "NCHW"), (3, (2, 2, 3, 5), "NDHWC"), (3, (2, 5, 3, 2), "NCDHW"),
    (3, (1, 2, 3, 2, 3), "NHWC"), (3, (2, 3, 1, 2, 2), "NCHW"),
])
@pytest.mark.parametrize("is_training", [True, False])
def test_rank_format_mismatch_matches_tf(version, shape, fmt, is_training, request):
    """The kernel maps NDHWC to NHWC and NCDHW to NCHW and accepts 4-D or 5-D x under either."""
    x, scale, offset, mean, var = _make_forward_inputs(request.node.callspec.id, shape, fmt, F32,
                                                       is_training, 0.5)
    kwargs = dict(x=x, scale=scale, offset=offset, mean=mean, variance=var, epsilon=0.001,
                  exponential_avg_factor=0.5, data_format=fmt, is_training=is_training)
    want = _tf_call(FWD_OPS[version], kwargs)
    got = getattr(fbn.raw_ops, FWD_OPS[version])(**kwargs)
    n = x.size // ref.num_channels(shape, fmt)
    ref.check_close(got.y, want[0], ref.tf_rtol(n),
                    ref.y_floor(x, scale, offset, mean, var, 0.001, fmt, is_training), what="y")
    floors = ref.stat_scales(x, mean, var, 0.5, fmt, is_training)
    for i, name in ((1, "batch_mean"), (2, "batch_variance")):
        ref.check_close(got[i], want[i], ref.tf_rtol(n), floors[name], what=name)
    gkw = _grad_kwargs(version, x[::-1].copy(), x, scale, want[3] if is_training else mean,
                       want[4] if is_training else var, np.zeros(0, np.float32), 0.001, fmt,
                       is_training)
    if is_training or ref.channels_last(fmt):
        gwant = _tf_call(GRAD_OPS[version], gkw)
        ggot = getattr(fbn.raw_ops, GRAD_OPS[version])(**gkw)
        _check_grads(ggot, gwant, gkw["y_backprop"], x, scale, gkw["reserve_space_1"],
                     gkw["reserve_space_2"], 0.001, fmt, is_training, ref.tf_rtol(n), F32)
    COUNTS["cases compared with TF: forward"] += 1


def test_grad_v3_ignores_reserve_space_3_shape():
    """reserve_space_3 is neither validated nor read on CPU: any shape is accepted."""
    rng = _rng("rs3")
    x = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    kwargs = dict(y_backprop=x[::-1].copy(), x=x, scale=np.ones(5, np.float32),
                  reserve_space_1=x.mean(axis=(0, 1, 2)), reserve_space_2=x.var(axis=(0, 1, 2)),
                  reserve_space_3=np.ones((3, 3), np.float32))
    want = _tf_call("FusedBatchNormGradV3", kwargs)
    got = fbn.raw_ops.FusedBatchNormGradV3(**kwargs)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    ref.check_close(got[0], want[0], ref.tf_rtol(24), what="x_backprop")
    COUNTS["cases compared with TF: gradient"] += 1


# ----------------------------------------------------------------------------------------------
# Error cases
# ----------------------------------------------------------------------------------------------
_PREFIX = re.compile(r"^\{\{function_node [^}]*\}\}\s*")
_SUFFIX = re.compile(r"\s*\[Op:[^\]]*\](\s*name:.*)?$", re.S)
_ATTR = re.compile(r"^Value for attr '(\w+)' of (\w+) is not in the list of allowed values: (.*)$")


def normalize_tf_message(message):
    text = message.split("\n")[0]
    text = _PREFIX.sub("", text)
    text = _SUFFIX.sub("", text)
    return text.strip()


def assert_messages_agree(fbn_msg, tf_msg):
    """TF's message contains fbn's; for attr type errors fbn's allowed list may add "double"."""
    tf_text = normalize_tf_message(tf_msg)
    m_f, m_t = _ATTR.match(fbn_msg), _ATTR.match(tf_text)
    if m_f and m_t and m_f.group(3) != m_t.group(3):
        assert m_f.group(1, 2) == m_t.group(1, 2), (fbn_msg, tf_text)
        fbn_list = [t.strip() for t in m_f.group(3).split(",") if t.strip() != "double"]
        tf_list = [t.strip() for t in m_t.group(3).split(",")]
        assert fbn_list == tf_list, f"allowed values differ: fbn {fbn_msg!r} vs TF {tf_text!r}"
        return
    assert fbn_msg in tf_text, f"fbn {fbn_msg!r} is not in TF's {tf_text!r}"


def _o(shape, dtype=np.float32):
    return np.ones(shape, dtype)


def _fwd_error(op, x=(2, 2, 2, 2), scale=(2,), offset=(2,), mean=(0,), variance=(0,),
               dtypes=None, **attrs):
    dt = dict(x=np.float32, scale=np.float32, offset=np.float32, mean=np.float32,
              variance=np.float32)
    dt.update(dtypes or {})
    kwargs = dict(x=_o(x, dt["x"]), scale=_o(scale, dt["scale"]), offset=_o(offset, dt["offset"]),
                  mean=_o(mean, dt["mean"]), variance=_o(variance, dt["variance"]))
    kwargs.update(attrs)
    return op, kwargs


def _grad_error(op, y_backprop=(2, 2, 2, 2), x=(2, 2, 2, 2), scale=(2,), rs1=(2,), rs2=(2,),
                rs3=(0,), dtypes=None, **attrs):
    dt = dict(y_backprop=np.float32, x=np.float32, scale=np.float32, rs1=np.float32,
              rs2=np.float32, rs3=np.float32)
    dt.update(dtypes or {})
    kwargs = dict(y_backprop=_o(y_backprop, dt["y_backprop"]), x=_o(x, dt["x"]),
                  scale=_o(scale, dt["scale"]), reserve_space_1=_o(rs1, dt["rs1"]),
                  reserve_space_2=_o(rs2, dt["rs2"]))
    if op.endswith("V3"):
        kwargs["reserve_space_3"] = _o(rs3, dt["rs3"])
    kwargs.update(attrs)
    return op, kwargs


H, D, B = np.float16, np.float64, BF16.type


def _error_cases():
    cases = {}
    for v, op in FWD_OPS.items():
        e = lambda **kw: _fwd_error(op, **kw)  # noqa: E731
        cases.update({
            f"{op}-x-rank3": e(x=(2, 2, 2)),
            f"{op}-x-rank2": e(x=(2, 2)),
            f"{op}-x-rank6": e(x=(1, 2, 1, 1, 1, 2)),
            f"{op}-x-rank3-and-scale-count": e(x=(2, 2, 3), scale=(3,)),
            f"{op}-scale-rank2": e(scale=(2, 1)),
            f"{op}-scale-rank0": e(scale=()),
            f"{op}-offset-rank2": e(offset=(1, 2)),
            f"{op}-offset-rank0": e(offset=()),
            f"{op}-mean-rank2-training": e(mean=(2, 1)),
            f"{op}-mean-rank0-training": e(mean=()),
            f"{op}-variance-rank2-inference": e(mean=(2,), variance=(2, 1), is_training=False),
            f"{op}-variance-rank0-training": e(variance=()),
            f"{op}-scale-count": e(scale=(3,)),
            f"{op}-offset-count": e(offset=(3,)),
            f"{op}-scale-count-nchw": e(x=(2, 3, 2, 2), scale=(2,), offset=(3,),
                                         data_format="NCHW"),
            f"{op}-inference-mean-count": e(mean=(0,), variance=(2,), is_training=False),
            f"{op}-inference-variance-count": e(mean=(2,), variance=(3,), is_training=False),
            f"{op}-eaf-mean-count": e(mean=(1,), variance=(2,), exponential_avg_factor=0.5),
            f"{op}-eaf-variance-count": e(mean=(2,), variance=(0,), exponential_avg_factor=0.5),
            f"{op}-eaf0-variance-count": e(mean=(2,), variance=(3,), exponential_avg_factor=0.0),
            f"{op}-empty-x-inference-mean-count": e(x=(0, 2, 2, 2), mean=(0,), variance=(2,),
                                                     is_training=False),
            f"{op}-format-NCWH": e(data_format="NCWH"),
            f"{op}-format-lowercase": e(data_format="nhwc"),
            f"{op}-format-NCHW_VECT_C": e(data_format="NCHW_VECT_C"),
        })
        if v != 3:
            cases[f"{op}-format-NDHWC"] = e(data_format="NDHWC")
            cases[f"{op}-format-NCDHW"] = e(data_format="NCDHW")
        if v == 1:
            cases.update({
                f"{op}-T-half": e(dtypes=dict(x=H)),
                f"{op}-T-bfloat16": e(dtypes=dict(x=B)),
                f"{op}-scale-half": e(dtypes=dict(scale=H)),
                f"{op}-offset-double": e(dtypes=dict(offset=D)),
                f"{op}-mean-half": e(dtypes=dict(mean=H)),
                f"{op}-variance-bfloat16": e(dtypes=dict(variance=B)),
            })
        else:
            cases.update({
                f"{op}-U-half": e(dtypes=dict(scale=H)),
                f"{op}-U-double": e(dtypes=dict(scale=D)),
                f"{op}-half-x-U-half": e(dtypes=dict(x=H, scale=H)),
                f"{op}-offset-half": e(dtypes=dict(offset=H)),
                f"{op}-mean-double": e(dtypes=dict(mean=D)),
                f"{op}-variance-bfloat16": e(dtypes=dict(variance=B)),
                f"{op}-bf16-x-offset-bf16": e(dtypes=dict(x=B, offset=B)),
            })
    for v, op in GRAD_OPS.items():
        g = lambda **kw: _grad_error(op, **kw)  # noqa: E731
        cases.update({
            f"{op}-y_backprop-rank3": g(y_backprop=(2, 2, 2)),
            f"{op}-x-rank3": g(x=(2, 2, 2)),
            f"{op}-both-rank6": g(y_backprop=(1, 1, 2, 1, 1, 2), x=(1, 1, 2, 1, 1, 2)),
            f"{op}-scale-rank2": g(scale=(2, 1)),
            f"{op}-scale-rank0": g(scale=()),
            f"{op}-rs1-rank0": g(rs1=()),
            f"{op}-rs1-rank2": g(rs1=(1, 2)),
            f"{op}-rs2-rank0": g(rs2=()),
            f"{op}-rs2-rank2": g(rs2=(2, 1)),
            f"{op}-shape-mismatch": g(y_backprop=(2, 2, 2, 3)),
            f"{op}-shape-mismatch-rank": g(y_backprop=(2, 2, 2, 2, 1)),
            f"{op}-shape-mismatch-and-scale-count": g(x=(2, 2, 3, 2), scale=(3,)),
            f"{op}-scale-count": g(scale=(3,)),
            f"{op}-rs1-count": g(rs1=(3,)),
            f"{op}-rs2-count": g(rs2=(3,)),
            f"{op}-rs1-count-inference": g(rs1=(1,), is_training=False),
            f"{op}-format-NCWH": g(data_format="NCWH"),
            f"{op}-format-NCHW_VECT_C": g(data_format="NCHW_VECT_C"),
        })
        if v != 3:
            cases[f"{op}-format-NDHWC"] = g(data_format="NDHWC")
        if v == 1:
            cases.update({
                f"{op}-T-half": g(dtypes=dict(y_backprop=H, x=H, scale=H, rs1=H, rs2=H)),
                f"{op}-x-half": g(dtypes=dict(x=H)),
                f"{op}-scale-half": g(dtypes=dict(scale=H)),
                f"{op}-rs1-double": g(dtypes=dict(rs1=D)),
                f"{op}-rs2-half": g(dtypes=dict(rs2=H)),
            })
        else:
            cases.update({
                f"{op}-y_backprop-half-x-float": g(dtypes=dict(y_backprop=H)),
                f"{op}-x-half-y_backprop-float": g(dtypes=dict(x=H)),
                f"{op}-y_backprop-bfloat16-x-half": g(dtypes=dict(y_backprop=B, x=H)),
                f"{op}-half-scale-half": g(dtypes=dict(y_backprop=H, x=H, scale=H)),
                f"{op}-rs1-half": g(dtypes=dict(rs1=H)),
                f"{op}-rs2-double": g(dtypes=dict(rs2=D)),
            })
            if v == 3:
                cases[f"{op}-rs3-half"] = g(dtypes=dict(rs3=H))
    return [pytest.param(op, kwargs, id=cid) for cid, (op, kwargs) in cases.items()]


@pytest.mark.parametrize("op,kwargs", _error_cases())
def test_error_matches_tf(op, kwargs):
    with pytest.raises(tf.errors.InvalidArgumentError) as tf_err:
        _tf_call(op, kwargs)
    with pytest.raises(fbn.errors.InvalidArgumentError) as fbn_err:
        getattr(fbn.raw_ops, op)(**kwargs)
    assert_messages_agree(str(fbn_err.value), str(tf_err.value))
    COUNTS["error cases compared with TF"] += 1


def test_message_normalization():
    """The TF message clean-up used above, on TF's real decorations."""
    raw = ("{{function_node __wrapped__FusedBatchNormV3_device_/job:localhost/replica:0/task:0/"
           "device:CPU:0}} scale must be 1-dimensional[2,1] [Op:FusedBatchNormV3] name: ")
    assert normalize_tf_message(raw) == "scale must be 1-dimensional[2,1]"
    attr = ("Value for attr 'T' of half is not in the list of allowed values: float\n\t; NodeDef: "
            "{{node FusedBatchNorm}}; Op<name=FusedBatchNorm; ...>")
    assert_messages_agree("Value for attr 'T' of half is not in the list of allowed values: "
                          "float, double", attr)
    with pytest.raises(AssertionError):
        assert_messages_agree("Value for attr 'T' of half is not in the list of allowed values: "
                              "half", attr)
    with pytest.raises(AssertionError):
        assert_messages_agree("scale must be 1-dimensional[2]", raw)


# ----------------------------------------------------------------------------------------------
# tf.nn.moments and tf.nn.batch_normalization
# ----------------------------------------------------------------------------------------------
MOMENT_CASES = [
    ((2, 3, 5, 4), [0, 1, 2]), ((2, 3, 5, 4), [1, 2, 3]), ((2, 3, 5, 4), [0]), ((7,), [0]),
    ((3, 1, 4), [1]), ((4, 6), [-1]), ((2, 3, 4, 5, 6), [0, 2, 4]), ((5, 4), []),
    ((3, 0, 2), [0]), ((1, 17, 33), [0, 1]),
]


@pytest.mark.parametrize("dname", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("keepdims", [False, True])
@pytest.mark.parametrize("shape,axes", MOMENT_CASES)
def test_moments_matches_tf(shape, axes, keepdims, dname):
    dtype = TF_DTYPES[dname]
    rng = _rng(f"moments-{shape}-{axes}-{keepdims}-{dname}")
    x = (rng.standard_normal(shape) * 2 + 1).astype(dtype)
    mean, var = fbn.nn.moments(x, axes, keepdims=keepdims)
    t_mean, t_var = (t.numpy() for t in tf.nn.moments(tf.constant(x), axes, keepdims=keepdims))
    n = max(int(np.prod([shape[a] for a in axes])), 1)
    # Floors: the data's magnitude (mean |x|, and its spread squared for the variance).
    x64 = x.astype(np.float64)
    floor_mean = float(np.abs(x64).mean()) if x.size else 0.0
    floor_var = float(x64.var()) if x.size else 0.0
    rtol = ref.tf_rtol(n)
    if np.dtype(dtype) == BF16:
        # tf.nn.moments upcasts only float16; for bfloat16 TF rounds the mean and every squared
        # difference to bfloat16 (fbn accumulates wider), so allow a few bfloat16 roundings.
        rtol += 4 * float(ref.finfo(BF16).eps)
    for g, w, what, floor in ((mean, t_mean, "mean", floor_mean),
                              (var, t_var, "variance", floor_var)):
        assert g.dtype == w.dtype and g.shape == w.shape, what
        ref.check_close(g, w, rtol, floor, dtype=dtype, what=what)
    COUNTS["cases compared with TF: moments"] += 1


BN_SHAPES = [
    ((3, 5, 4, 2), (2,)), ((3, 5, 4, 2), (1, 1, 1, 2)), ((3, 3), (1, 3)), ((3, 3), (3, 1)),
    ((3, 2, 4, 5), (1, 2, 1, 1)), ((2, 3, 2, 4, 5), (1, 1, 1, 4, 5)), ((4, 7), ()), ((6,), (6,)),
]


@pytest.mark.parametrize("dname", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("use_scale,use_offset", [(True, True), (False, True), (True, False),
                                                  (False, False)])
@pytest.mark.parametrize("x_shape,p_shape", BN_SHAPES)
def test_batch_normalization_matches_tf(x_shape, p_shape, use_scale, use_offset, dname):
    dtype = TF_DTYPES[dname]
    rng = _rng(f"bn-{x_shape}-{p_shape}-{use_scale}-{use_offset}-{dname}")
    x = (rng.standard_normal(x_shape) * 2).astype(dtype)
    m = rng.standard_normal(p_shape).astype(dtype)
    v = rng.uniform(0.2, 2.0, p_shape).astype(dtype)
    s = rng.standard_normal(p_shape).astype(dtype) if use_scale else None
    o = rng.standard_normal(p_shape).astype(dtype) if use_offset else None
    got = fbn.nn.batch_normalization(x, m, v, o, s, 0.001)
    conv = lambda a: None if a is None else tf.constant(a)  # noqa: E731
    want = tf.nn.batch_normalization(tf.constant(x), conv(m), conv(v), conv(o), conv(s),
                                     0.001).numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    # TF rounds inv and offset - mean·inv to the 16-bit type before the final multiply-add; fbn
    # keeps them wider, so allow a few 16-bit ulps of the operands there.
    rtol = 8 * float(ref.finfo(dtype).eps) if ref.is16(dtype) else 4e-6
    # Floor: |x·inv| + |mean·inv| + |offset|, the terms before they cancel.
    inv = 1.0 / np.sqrt(v.astype(np.float64) + 0.001)
    if s is not None:
        inv = inv * s.astype(np.float64)
    floor = (np.abs(x.astype(np.float64) * inv) + np.abs(m.astype(np.float64) * inv)
             + (0.0 if o is None else np.abs(o.astype(np.float64))))
    ref.check_close(got, want, rtol, floor, dtype=dtype, what="y")
    COUNTS["cases compared with TF: batch_normalization"] += 1


@pytest.mark.parametrize("axes", [[4], [-5], [0, 0], [1, -3]])
def test_moments_axis_errors_match_tf(axes):
    x = np.ones((2, 3, 4, 5), np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError) as tf_err:
        tf.nn.moments(tf.constant(x), axes)
    with pytest.raises(fbn.errors.InvalidArgumentError) as fbn_err:
        fbn.nn.moments(x, axes)
    assert_messages_agree(str(fbn_err.value), str(tf_err.value))
    COUNTS["error cases compared with TF"] += 1
