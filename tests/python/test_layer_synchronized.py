"""Synchronized batch normalization from Python, over mpi4py.

Run it plainly (one process: the synchronized layer must be the plain layer bit for bit) and under
mpirun (several processes, each holding part of one batch)::

    mpirun -np 3 python -m pytest -q tests/python/test_layer_synchronized.py

Every rank builds the same global batch from a seed, calls the synchronized layer on its part
(equal, unequal and empty parts) and compares outputs, dx, the rank-order sum of the parameter
gradients and the moving statistics with the unsynchronized layer on the whole batch. Checks are
collected and asserted at the end of each test, after its last collective call, so that a failing
rank never leaves the others waiting.
"""
import numpy as np
import pytest

import fbn

try:
    from mpi4py import MPI
except ImportError:  # the single-process tests that need no MPI still run
    MPI = None

needs_mpi4py = pytest.mark.skipif(MPI is None, reason="mpi4py is not installed")
COMM = MPI.COMM_WORLD if MPI is not None else None
RANK = COMM.Get_rank() if COMM is not None else 0
SIZE = COMM.Get_size() if COMM is not None else 1
# A build without MPI synchronizes groups of one only.
needs_mpi_build = pytest.mark.skipif(SIZE > 1 and not fbn._fbn._with_mpi,
                                     reason="fbn was built without MPI (FBN_WITH_MPI=OFF)")

BN = fbn.layers.BatchNormalization
BN2 = fbn.layers.BatchNormalizationV2
INIT = dict(gamma_initializer=fbn.layers.initializers.random_normal(1.0, 0.3, seed=11),
            beta_initializer=fbn.layers.initializers.random_normal(0.2, 0.3, seed=12),
            momentum=0.9)

# name, layer class, keyword arguments, per-sample shape, dtype, tolerance
CASES = [
    ("fused_nhwc_f32", BN, dict(axis=-1), (3, 2, 5), np.float32, 2e-5),
    ("fused_nchw_f32", BN, dict(axis=1), (4, 3, 2), np.float32, 2e-5),
    ("fused_nhwc_f16", BN, dict(axis=-1), (2, 2, 3), np.float16, 1e-2),
    ("general_rank2_f32", BN, dict(axis=-1), (6,), np.float32, 2e-5),
    ("general_rank3_axis1_f64", BN, dict(axis=1), (4, 3), np.float64, 1e-11),
    ("keras_v2_f32", BN2, dict(axis=-1), (2, 2, 4), np.float32, 2e-5),
    ("renorm_f32", BN, dict(axis=-1, renorm=True, renorm_momentum=0.8,
                            renorm_clipping=dict(rmax=3.0, rmin=1 / 3, dmax=1.0)),
     (5,), np.float32, 2e-5),
    ("wide_general_f32", BN, dict(axis=-1), (300,), np.float32, 2e-5),
]
SPLITS = ["equal", "unequal", "empty_part"]


def part_sizes(split, size):
    if split == "equal":
        return [4] * size
    if split == "unequal":
        return [1 + (2 * r + 1) % 5 for r in range(size)]
    empty = 1 if size > 1 else 0
    return [0 if r == empty else 3 + r for r in range(size)]


def global_batch(shape, dtype, seed, mean, std):
    return np.random.default_rng(seed).normal(mean, std, size=shape).astype(dtype)


def close(a, b, tol):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)  # an empty global batch gives NaN statistics
    return bool(np.all(both_nan | (np.abs(a - b) <= tol * (1 + np.abs(b)))))


def statistics(layer):
    names = ["moving_mean", "moving_variance", "moving_stddev", "renorm_mean", "renorm_stddev"]
    return {n: getattr(layer, n).numpy() for n in names if getattr(layer, n) is not None}


class Checks:
    """Failed checks, asserted once every collective call of a test is done."""

    def __init__(self, what):
        self.what, self.failures = what, []

    def __call__(self, ok, message):
        if not ok:
            self.failures.append(message)

    def done(self):
        assert not self.failures, f"{self.what} (rank {RANK}/{SIZE}): " + "; ".join(
            self.failures[:5])


def plain_kwargs(cls, kwargs):
    # The synchronized Keras V2 layer is never fused (as in Keras): compare on the same path.
    return dict(kwargs, fused=False) if cls is BN2 else dict(kwargs)


@needs_mpi4py
@needs_mpi_build
@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_synchronized_layer_matches_the_whole_batch(case, split):
    name, cls, kwargs, features, dtype, tol = case
    check = Checks(f"{name}/{split}")
    parts = part_sizes(split, SIZE)
    n_global, row0, n = sum(parts), sum(parts[:RANK]), parts[RANK]
    shape = (n_global,) + features
    plain = cls(**plain_kwargs(cls, kwargs), **INIT)
    sync = cls(**kwargs, **INIT, synchronized=True, communicator=COMM)
    for step in range(2):
        xg = global_batch(shape, dtype, 100 + step, 3.0, 2.0)
        dyg = global_batch(shape, dtype, 200 + step, 0.5, 1.0)
        want_y = plain(xg, training=True)
        want_dx, want_grads = plain.backward(dyg)
        y = sync(xg[row0:row0 + n], training=True)
        dx, grads = sync.backward(dyg[row0:row0 + n])
        check(close(y, want_y[row0:row0 + n], tol), f"step {step}: y")
        check(close(dx, want_dx[row0:row0 + n], tol), f"step {step}: dx")
        for g, w in zip(grads, want_grads):
            total = np.sum(np.asarray(COMM.allgather(g), np.float64), axis=0)  # rank order
            check(close(total, w, tol), f"step {step}: sum of the parameter gradients")
        want_stats = statistics(plain)
        for key, value in statistics(sync).items():
            check(close(value, want_stats[key], tol), f"step {step}: {key}")
            everywhere = COMM.allgather(value.tobytes())
            check(all(b == everywhere[0] for b in everywhere), f"{key} differs between ranks")
    xg = global_batch(shape, dtype, 300, 3.0, 2.0)
    check(close(sync(xg[row0:row0 + n], training=False), plain(xg, training=False)[row0:row0 + n],
                tol), "inference y")
    check(sync.synchronized and sync.communicator is COMM, "layer attributes")
    check.done()


@needs_mpi4py
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_group_of_one_is_the_plain_layer_bit_for_bit(case):
    name, cls, kwargs, features, dtype, _ = case
    plain = cls(**plain_kwargs(cls, kwargs), **INIT)
    sync = cls(**kwargs, **INIT, synchronized=True, communicator=MPI.COMM_SELF)
    for step in range(2):
        x = global_batch((4,) + features, dtype, 40 + step, 3.0, 2.0)
        dy = global_batch((4,) + features, dtype, 50 + step, 0.5, 1.0)
        assert plain(x, training=True).tobytes() == sync(x, training=True).tobytes(), name
        (dx_a, g_a), (dx_b, g_b) = plain.backward(dy), sync.backward(dy)
        assert dx_a.tobytes() == dx_b.tobytes()
        assert [g.tobytes() for g in g_a] == [g.tobytes() for g in g_b]
        for key, value in statistics(plain).items():
            assert value.tobytes() == statistics(sync)[key].tobytes(), key
    assert sync.fused == plain.fused


@needs_mpi4py
@needs_mpi_build
def test_default_communicator_is_mpi4py_comm_world():
    x = global_batch((3, 2, 2, 4), np.float32, 7 + RANK, 1.0, 2.0)
    by_default = BN(synchronized=True)
    explicit = BN(synchronized=True, communicator=MPI.COMM_WORLD)
    check = Checks("default communicator")
    check(by_default.communicator is MPI.COMM_WORLD, "communicator attribute")
    check(by_default(x, training=True).tobytes() == explicit(x, training=True).tobytes(), "y")
    check(by_default.moving_mean.numpy().tobytes() == explicit.moving_mean.numpy().tobytes(),
          "moving_mean")
    check.done()


@needs_mpi4py
@pytest.mark.skipif(SIZE < 2, reason="needs mpirun with at least 2 processes")
@needs_mpi_build
def test_mismatch_between_ranks_is_an_error_on_every_rank():
    check = Checks("mismatch")
    channels = 4 if RANK == 0 else 5
    bn = BN(synchronized=True, communicator=COMM)
    try:
        bn(np.ones((2, 2, 2, channels), np.float32), training=True)
        check(False, "no error for a channel mismatch")
    except ValueError as e:
        check("the ranks disagree" in str(e) and "channels" in str(e), str(e))
    # A failure on one rank before its exchange reaches every other rank.
    last = SIZE - 1
    bn = BN(synchronized=True, communicator=COMM)
    bn(np.ones((2, 3), np.float32), training=True)
    try:
        bn(np.ones((2, 4 if RANK == last else 3), np.float32), training=True)
        check(False, "no error for a failed rank")
    except ValueError as e:
        want = "expected axis 1" if RANK == last else f"rank {last} failed"
        check(want in str(e), str(e))
    # The group goes on working.
    y = BN(synchronized=True, communicator=COMM)(np.arange(6.0).reshape(3, 2), training=True)
    check(y.shape == (3, 2), "the group works afterwards")
    check.done()


@needs_mpi4py
@pytest.mark.skipif(SIZE < 2 or fbn._fbn._with_mpi, reason="for a build without MPI under mpirun")
def test_build_without_mpi_refuses_a_group_of_several():
    with pytest.raises(ValueError, match="built without MPI"):
        BN(synchronized=True, communicator=COMM)


@needs_mpi4py
def test_keras_v2_rules():
    with pytest.raises(ValueError, match="not supported when `synchronized=True`"):
        BN2(synchronized=True, fused=True, communicator=MPI.COMM_SELF)
    assert BN2(synchronized=True, communicator=MPI.COMM_SELF).fused is False
    assert BN(synchronized=True, communicator=MPI.COMM_SELF).fused is True


def test_communicator_needs_synchronized():
    with pytest.raises(ValueError, match="only used with synchronized=True"):
        BN(communicator=object())


def test_communicator_must_be_an_mpi4py_communicator():
    with pytest.raises(TypeError, match="mpi4py communicator"):
        BN(synchronized=True, communicator=object())


def test_fbn_communicator_object_is_accepted():
    comm = fbn._fbn._single_process_communicator()
    assert (comm.rank, comm.size) == (0, 1)
    bn = BN(synchronized=True, communicator=comm)
    x = global_batch((4, 3), np.float32, 5, 1.0, 2.0)
    assert bn(x, training=True).tobytes() == BN()(x, training=True).tobytes()
