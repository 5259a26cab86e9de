"""fbn.layers against the real TensorFlow (tf.compat.v1.layers in graph mode, Eigen CPU kernels)
over many random configurations covering every layer parameter: outputs, gradients
(tf.gradients), moving statistics after several steps with the update ops run, variable names
and collections.

TensorFlow's V1 layers live in the tf_keras package and are reached with TF_USE_LEGACY_KERAS=1;
both must be importable (scripts/setup.sh installs them), otherwise the module is skipped.
"""
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")  # the Eigen kernels are the reference
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import random  # noqa: E402
import warnings  # noqa: E402

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fbn  # noqa: E402

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")
tf1 = tf.compat.v1

NUM_CONFIGS = 200
STEPS = 3

_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16, "float32": np.float32,
           "float64": np.float64}
_TF_DTYPES = {"float16": tf.float16, "bfloat16": tf.bfloat16, "float32": tf.float32,
              "float64": tf.float64}


def random_config(seed):
    """One random layer configuration; every parameter varies across seeds."""
    rng = random.Random(seed)
    rank = rng.choice([2, 3, 4, 4, 4, 5, 5])
    batch = rng.choice([2, 4, 6, 8])
    shape = [batch] + [rng.randint(1, 4) for _ in range(rank - 1)]
    if rng.random() < 0.65:
        if rank in (4, 5) and rng.random() < 0.85:
            axis = rng.choice([1, rank - 1, -1, -rank + 1])  # channel axis: fused eligible
        else:
            axis = rng.randrange(-rank, rank)
    else:
        k = rng.randint(2, max(2, rank - 1))
        axis = sorted(rng.sample(range(rank), k))
        if rng.random() < 0.3:
            axis = [a - rank for a in axis]
    dtype = rng.choice(["float32"] * 5 + ["float64", "float16", "bfloat16"])
    cfg = dict(
        shape=shape, dtype=dtype, axis=axis,
        momentum=rng.choice([0.99, 0.9, 0.5, 0.0]),
        epsilon=rng.choice([1e-3, 1e-2, 0.1, 1e-5]),
        center=rng.random() < 0.8, scale=rng.random() < 0.8,
        fused=rng.choice([None, None, True, False]),
        trainable=rng.random() < 0.8,
        training=rng.choice([True, True, False, "flag"]),
        renorm=False, renorm_clipping=None, renorm_momentum=0.99,
        virtual_batch_size=None, adjustment=None,
        gamma_regularizer=None, beta_regularizer=None,
    )
    # TensorFlow's renorm fails for float64 (a float32 sqrt(epsilon) meets float64 statistics);
    # fbn's float64 renorm is checked against NumPy in test_layer_numpy.py.
    if rng.random() < 0.25 and dtype != "float64":
        cfg["renorm"] = True
        cfg["renorm_momentum"] = rng.choice([0.99, 0.8, 0.5])
        clip = {}
        for key, values in (("rmax", [1.1, 1.5, 3.0]), ("rmin", [0.9, 0.5, 0.3]),
                            ("dmax", [0.1, 0.5, 2.0])):
            if rng.random() < 0.6:
                clip[key] = rng.choice(values)
        cfg["renorm_clipping"] = clip if clip or rng.random() < 0.5 else None
    axes = [axis] if isinstance(axis, int) else axis
    norm_axes = [a % rank for a in axes]
    if 0 not in norm_axes and rng.random() < 0.2:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        cfg["virtual_batch_size"] = rng.choice(divisors)
        if rng.random() < 0.7:
            cfg["training"] = True  # ghost batches exist only for a static training=True
    elif rng.random() < 0.2:
        cfg["adjustment"] = rng.choice(["param", "full", "last"])
    if rng.random() < 0.2:
        cfg["gamma_regularizer"] = rng.choice(["l2", "l1"])
    if rng.random() < 0.2:
        cfg["beta_regularizer"] = "l1_l2"
    cfg["seed"] = seed
    return cfg


def _adjustment_arrays(cfg, rng):
    """Deterministic (scale, bias) arrays for the configured adjustment broadcast pattern."""
    shape = cfg["shape"]
    rank = len(shape)
    axes = [cfg["axis"]] if isinstance(cfg["axis"], int) else cfg["axis"]
    axes = sorted(a % rank for a in axes)
    kind = cfg["adjustment"]
    if kind == "full":
        adj_shape = list(shape)
    elif kind == "last":
        adj_shape = shape[-1:]
    else:
        adj_shape = [shape[a] if a in axes else 1 for a in range(rank)]
    # TensorFlow multiplies them with gamma: they must have the parameter dtype.
    pdt = np.float64 if cfg["dtype"] == "float64" else np.float32
    scale = rng.uniform(0.5, 1.5, adj_shape).astype(pdt)
    bias = rng.uniform(-0.2, 0.2, adj_shape).astype(pdt)
    return scale, bias


def _data(cfg):
    rng = np.random.RandomState(cfg["seed"])
    dt = _DTYPES[cfg["dtype"]]
    xs = [(rng.randn(*cfg["shape"]) * rng.uniform(0.5, 3) + rng.uniform(-2, 2)).astype(dt)
          for _ in range(STEPS)]
    dys = [rng.randn(*cfg["shape"]).astype(dt) for _ in range(STEPS)]
    rank = len(cfg["shape"])
    axes = [cfg["axis"]] if isinstance(cfg["axis"], int) else cfg["axis"]
    axes = sorted(a % rank for a in axes)
    if len(axes) == 1 and not cfg["virtual_batch_size"]:
        pshape = [cfg["shape"][axes[0]]]
    else:
        pshape = [cfg["shape"][a] if a in axes else 1 for a in range(rank)]
        if cfg["virtual_batch_size"]:
            pshape.insert(1, 1)
    pdt = np.float64 if cfg["dtype"] == "float64" else np.float32
    init = dict(gamma=rng.uniform(0.5, 2, pshape).astype(pdt),
                beta=rng.uniform(-1, 1, pshape).astype(pdt),
                mean=rng.uniform(-1, 1, pshape).astype(pdt),
                var=rng.uniform(0.5, 2, pshape).astype(pdt))
    adj = _adjustment_arrays(cfg, rng) if cfg["adjustment"] else None
    training_values = [bool(rng.randint(2)) if cfg["training"] == "flag" else None
                       for _ in range(STEPS)]
    return xs, dys, init, adj, training_values


def _kwargs(cfg, init, adj, for_tf):
    kw = dict(axis=cfg["axis"], momentum=cfg["momentum"], epsilon=cfg["epsilon"],
              center=cfg["center"], scale=cfg["scale"], fused=cfg["fused"],
              trainable=cfg["trainable"], renorm=cfg["renorm"],
              renorm_clipping=cfg["renorm_clipping"], renorm_momentum=cfg["renorm_momentum"],
              virtual_batch_size=cfg["virtual_batch_size"],
              gamma_regularizer=cfg["gamma_regularizer"],
              beta_regularizer=cfg["beta_regularizer"])
    if for_tf:
        kw.update(gamma_initializer=tf1.constant_initializer(init["gamma"]),
                  beta_initializer=tf1.constant_initializer(init["beta"]),
                  moving_mean_initializer=tf1.constant_initializer(init["mean"]),
                  moving_variance_initializer=tf1.constant_initializer(init["var"]))
        if adj is not None:
            kw["adjustment"] = lambda shape: (tf.constant(adj[0]), tf.constant(adj[1]))
    else:
        kw.update(gamma_initializer=lambda shape, dtype: init["gamma"],
                  beta_initializer=lambda shape, dtype: init["beta"],
                  moving_mean_initializer=lambda shape, dtype: init["mean"],
                  moving_variance_initializer=lambda shape, dtype: init["var"])
        if adj is not None:
            kw["adjustment"] = lambda shape: adj
    return kw


def run_tf(cfg):
    xs, dys, init, adj, training_values = _data(cfg)
    out = dict(steps=[])
    graph = tf.Graph()
    with graph.as_default(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dt = _TF_DTYPES[cfg["dtype"]]
        x = tf1.placeholder(dt, cfg["shape"])
        dy = tf1.placeholder(dt, cfg["shape"])
        if cfg["training"] == "flag":
            training = tf1.placeholder(tf.bool, [])
        else:
            training = cfg["training"]
        layer = tf1.layers.BatchNormalization(**_kwargs(cfg, init, adj, for_tf=True))
        y = layer(x, training=training)
        params = [v for v in (layer.gamma, layer.beta) if v is not None]
        grads = tf.gradients(y, [x] + params, grad_ys=dy)
        updates = tf1.get_collection(tf1.GraphKeys.UPDATE_OPS)
        stats = [v for v in layer.variables if v not in (layer.gamma, layer.beta)]
        losses = tf1.get_collection(tf1.GraphKeys.REGULARIZATION_LOSSES)
        out["fused"] = layer.fused
        out["variables"] = [v.name for v in layer.variables]
        out["trainable"] = [v.name for v in layer.trainable_variables]
        out["global"] = [v.name for v in tf1.global_variables()]
        out["trainable_collection"] = [v.name for v in tf1.trainable_variables()]
        out["num_updates"] = len(updates)
        out["num_losses"] = len(losses)
        with tf1.Session(graph=graph) as sess:
            sess.run(tf1.global_variables_initializer())
            out["losses"] = [float(v) for v in sess.run(losses)]
            for k in range(STEPS):
                feed = {x: xs[k], dy: dys[k]}
                if cfg["training"] == "flag":
                    feed[training] = training_values[k]
                res = sess.run([y] + grads, feed)
                if updates:
                    sess.run(updates, feed)
                out["steps"].append(dict(
                    y=res[0], dx=res[1], dparams=res[2:],
                    stats={v.name: val for v, val in zip(stats, sess.run(stats))}))
    return out


def run_fbn(cfg):
    xs, dys, init, adj, training_values = _data(cfg)
    out = dict(steps=[])
    graph = fbn.Graph()
    with graph.as_default():
        flag = fbn.TrainingFlag(False) if cfg["training"] == "flag" else None
        layer = fbn.layers.BatchNormalization(**_kwargs(cfg, init, adj, for_tf=False))
        for k in range(STEPS):
            if flag is not None:
                flag.value = training_values[k]
            y = layer(xs[k], training=flag if flag is not None else cfg["training"])
            params = [v for v in (layer.gamma, layer.beta) if v is not None]
            dx, dparams = layer.backward(dys[k], variables=params)
            if k == 0:
                out["fused"] = layer.fused
                out["variables"] = [v.name for v in layer.variables]
                out["trainable"] = [v.name for v in layer.trainable_variables]
                out["global"] = [v.name for v in graph.global_variables()]
                out["trainable_collection"] = [v.name for v in graph.trainable_variables()]
                out["num_updates"] = len(graph.get_collection(fbn.GraphKeys.UPDATE_OPS))
                losses = graph.get_collection(fbn.GraphKeys.REGULARIZATION_LOSSES)
                out["num_losses"] = len(losses)
                out["losses"] = [float(l.numpy()) for l in losses]
            new_ops = layer.updates[-2:] if layer.updates else []
            graph.run(new_ops)
            stats = [v for v in layer.variables if v.name not in
                     {p.name for p in params}]
            out["steps"].append(dict(y=y, dx=dx, dparams=dparams,
                                     stats={v.name: v.numpy() for v in stats}))
    return out


def _tol(cfg):
    return {"float64": 1e-9, "float32": 2e-4, "float16": 2e-2, "bfloat16": 8e-2}[cfg["dtype"]]


def _close(a, b, tol, what):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} vs {b.shape}"
    scale = max(1.0, float(np.nanmax(np.abs(b))) if b.size else 1.0)
    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale, err_msg=what)


def compare(cfg):
    ref = run_tf(cfg)
    got = run_fbn(cfg)
    for key in ("fused", "variables", "trainable", "global", "trainable_collection",
                "num_updates", "num_losses"):
        assert got[key] == ref[key], f"{key}: fbn {got[key]} vs tf {ref[key]}"
    tol = _tol(cfg)
    # Statistics and losses are float32 (float64) whatever the input dtype.
    stat_tol = 1e-9 if cfg["dtype"] == "float64" else 2e-4
    for a, b in zip(got["losses"], ref["losses"]):
        _close(a, b, stat_tol, "regularization loss")
    for k, (g, r) in enumerate(zip(got["steps"], ref["steps"])):
        _close(g["y"], r["y"], tol, f"step {k} y")
        _close(g["dx"], r["dx"], tol, f"step {k} dx")
        for i, (gp, rp) in enumerate(zip(g["dparams"], r["dparams"])):
            # Parameter gradients sum over the batch: scale the tolerance with it.
            _close(gp, rp, max(tol, stat_tol) * 4, f"step {k} dparam {i}")
        assert sorted(g["stats"]) == sorted(r["stats"])
        for name in r["stats"]:
            _close(g["stats"][name], r["stats"][name], max(stat_tol, tol / 4),
                   f"step {k} {name}")


def test_configurations_cover_every_parameter():
    counts = {}

    def count(key, cond=True):
        counts[key] = counts.get(key, 0) + bool(cond)

    for seed in range(NUM_CONFIGS):
        cfg = random_config(seed)
        rank = len(cfg["shape"])
        axes = [cfg["axis"]] if isinstance(cfg["axis"], int) else cfg["axis"]
        for r in (2, 3, 4, 5):
            count(f"rank{r}", rank == r)
        for dt in _DTYPES:
            count(dt, cfg["dtype"] == dt)
        count("multi-axis", len(axes) > 1)
        count("negative axis", any(a < 0 for a in axes))
        for fused in (None, True, False):
            count(f"fused={fused}", cfg["fused"] is fused)
        for training in (True, False, "flag"):
            count(f"training={training}", cfg["training"] == training)
        fusable = (rank in (4, 5) and len(axes) == 1 and axes[0] % rank in (1, rank - 1) and
                   not cfg["renorm"] and not cfg["virtual_batch_size"] and
                   not cfg["adjustment"] and cfg["dtype"] != "float64" and
                   cfg["fused"] is not False)
        count("fused path", fusable)
        count("fused path, runtime flag", fusable and cfg["training"] == "flag")
        count("fused path, 16-bit", fusable and cfg["dtype"] in ("float16", "bfloat16"))
        count("renorm with clipping", cfg["renorm"] and cfg["renorm_clipping"])
        count("ghost batches", cfg["virtual_batch_size"] and cfg["training"] is True and
              cfg["virtual_batch_size"] < cfg["shape"][0])
        count("adjustment while training", cfg["adjustment"] and cfg["training"] is not False)
        count("trainable=False", not cfg["trainable"])
        count("center=False", not cfg["center"])
        count("scale=False", not cfg["scale"])
        count("regularizers", cfg["gamma_regularizer"] or cfg["beta_regularizer"])
        count("momentum", cfg["momentum"] != 0.99)
        count("epsilon", cfg["epsilon"] != 1e-3)
    thin = {k: v for k, v in counts.items() if v < 4}
    assert not thin, thin


@pytest.mark.parametrize("seed", range(NUM_CONFIGS))
def test_random_configuration_matches_tensorflow(seed):
    compare(random_config(seed))


if __name__ == "__main__":
    import sys
    import traceback
    failures = 0
    seeds = range(int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else range(NUM_CONFIGS)
    for s in seeds:
        cfg = random_config(s)
        try:
            compare(cfg)
        except Exception as e:  # noqa: BLE001
            failures += 1
            print("FAIL", s, {k: v for k, v in cfg.items() if v is not None})
            print("   ", str(e).splitlines()[0][:300] if str(e) else traceback.format_exc())
    print(f"{len(seeds) - failures} passed, {failures} failed")
