"""fbn's TF1 graph behaviour against the real TensorFlow: variable names and scopes, reuse,
layer names, collections (GLOBAL_VARIABLES, TRAINABLE_VARIABLES, UPDATE_OPS,
REGULARIZATION_LOSSES) and the errors of misuse. Each scenario runs the same code on both
through a small adapter."""
import os

os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import contextlib  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import fbn  # noqa: E402

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf_keras")
tf1 = tf.compat.v1


class TFApi:
    def __init__(self):
        self.graph = tf.Graph()

    @contextlib.contextmanager
    def context(self):
        with self.graph.as_default(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield

    def x(self, shape):
        return tf.constant(np.ones(shape, np.float32))

    def flag(self):
        return tf1.placeholder(tf.bool, [])

    def bn(self, x, **kw):
        return tf1.layers.batch_normalization(x, **kw)

    def BN(self, **kw):
        return tf1.layers.BatchNormalization(**kw)

    def scope(self, name, reuse=None, default_name=None):
        if reuse == "auto":
            reuse = tf1.AUTO_REUSE
        return tf1.variable_scope(name, default_name=default_name, reuse=reuse)

    def names(self, key):
        return [v.name for v in tf1.get_collection(key)]

    def count(self, key):
        return len(tf1.get_collection(key))

    keys = dict(g=tf1.GraphKeys.GLOBAL_VARIABLES, t=tf1.GraphKeys.TRAINABLE_VARIABLES,
                u=tf1.GraphKeys.UPDATE_OPS, r=tf1.GraphKeys.REGULARIZATION_LOSSES)


class FbnApi:
    def __init__(self):
        self.graph = fbn.Graph()

    @contextlib.contextmanager
    def context(self):
        with self.graph.as_default():
            yield

    def x(self, shape):
        return np.ones(shape, np.float32)

    def flag(self):
        return fbn.TrainingFlag(False)

    def bn(self, x, **kw):
        return fbn.layers.batch_normalization(x, **kw)

    def BN(self, **kw):
        return fbn.layers.BatchNormalization(**kw)

    def scope(self, name, reuse=None, default_name=None):
        if reuse == "auto":
            reuse = fbn.graph.AUTO_REUSE
        return fbn.variable_scope(name, default_name=default_name, reuse=reuse)

    def names(self, key):
        return [v.name for v in self.graph.get_collection(key)]

    def count(self, key):
        return len(self.graph.get_collection(key))

    keys = dict(g=fbn.GraphKeys.GLOBAL_VARIABLES, t=fbn.GraphKeys.TRAINABLE_VARIABLES,
                u=fbn.GraphKeys.UPDATE_OPS, r=fbn.GraphKeys.REGULARIZATION_LOSSES)


def _error_text(e):
    # TensorFlow appends the creation traceback of a ref variable; the rest must match.
    return type(e).__name__, str(e).split(" Originally defined at")[0]


def run(scenario, api):
    log = []
    with api.context():
        def record(label, fn):
            try:
                value = fn()
                log.append((label, value))
            except Exception as e:  # noqa: BLE001
                log.append((label, _error_text(e)))
        scenario(api, record)
        log.append(("global", api.names(api.keys["g"])))
        log.append(("trainable", api.names(api.keys["t"])))
        log.append(("updates", api.count(api.keys["u"])))
        log.append(("losses", api.count(api.keys["r"])))
    return log


def s_unnamed_calls(api, record):
    x = api.x([2, 3])
    api.bn(x, training=True)
    api.bn(x)
    api.bn(x, training=api.flag())
    api.bn(x, training=None)  # the learning phase: a runtime flag


def s_named_twice_without_reuse(api, record):
    x = api.x([2, 3, 4, 5])
    api.bn(x, name="bn", training=True)
    record("second", lambda: api.bn(x, name="bn") is not None)


def s_named_reuse(api, record):
    x = api.x([2, 3, 4, 5])
    api.bn(x, name="bn", training=True)
    api.bn(x * 2, name="bn", reuse=True, training=True)
    record("missing", lambda: api.bn(x, name="other", reuse=True) is not None)


def s_reuse_from_scope(api, record):
    x = api.x([5, 4, 3])
    with api.scope("scope"):
        api.bn(x, axis=1)
    with api.scope("scope", reuse=True):
        api.bn(x, axis=1)
    with api.scope("scope", reuse="auto"):
        api.bn(x, axis=1, name="auto")
        api.bn(x, axis=1, name="auto")


def s_nested_scopes(api, record):
    x = api.x([4, 3])
    with api.scope("outer"):
        api.bn(x)
        with api.scope("inner"):
            api.bn(x, name="bn")
            api.bn(x)
        api.bn(x)
    with api.scope("outer"):
        # Unique names restart in a re-entered scope: this collides with the first layer.
        record("reentered", lambda: api.bn(x) is not None)
        api.bn(x, name="second")
    with api.scope(None, default_name="block"):
        api.bn(x)
    with api.scope(None, default_name="block"):
        api.bn(x)
    api.bn(x)


def s_object_names(api, record):
    x = api.x([2, 3])
    a, b = api.BN(), api.BN()
    c, d = api.BN(name="bn"), api.BN(name="bn")
    for layer in (a, b, c, d):
        layer(x, training=True)
    a(x, training=True)
    record("names", lambda: [layer.name for layer in (a, b, c, d)])
    record("variables", lambda: [[v.name for v in layer.variables] for layer in (a, b, c, d)])
    record("updates", lambda: [len(layer.updates) for layer in (a, b, c, d)])


def s_options(api, record):
    x = api.x([4, 3, 2, 2])
    api.bn(x, renorm=True, training=True)
    api.bn(x, center=False, training=True, name="nocenter")
    api.bn(x, scale=False, trainable=False, training=True, name="frozen")
    api.bn(x, gamma_regularizer="l2", beta_regularizer="l1", training=True, name="reg")
    api.bn(x, axis=[1, 2], virtual_batch_size=2, training=True, name="ghost")
    layer = api.BN(trainable=False)
    layer(x, training=True)
    record("frozen", lambda: ([v.name for v in layer.trainable_variables],
                              [v.name for v in layer.non_trainable_variables],
                              len(layer.updates)))


def s_errors(api, record):
    x = api.x([2, 3, 4])
    record("axis", lambda: api.bn(x, axis=3) is not None)
    record("dup", lambda: api.bn(x, axis=[1, -2]) is not None)
    record("vbs", lambda: api.bn(x, virtual_batch_size=0) is not None)
    record("vbs_axis", lambda: api.bn(x, axis=0, virtual_batch_size=1) is not None)
    record("clip", lambda: api.bn(x, renorm=True, renorm_clipping={"r": 1}) is not None)
    layer = api.BN(axis=1)
    layer(x)
    record("rank", lambda: layer(api.x([2, 3])) is not None)
    record("dim", lambda: layer(api.x([2, 5, 4])) is not None)


SCENARIOS = [s_unnamed_calls, s_named_twice_without_reuse, s_named_reuse, s_reuse_from_scope,
             s_nested_scopes, s_object_names, s_options, s_errors]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_graph_behaviour_matches_tensorflow(scenario):
    assert run(scenario, FbnApi()) == run(scenario, TFApi())


def test_functional_form_without_graph_raises_value_error():
    with pytest.raises(ValueError, match="BatchNormalization"):
        fbn.layers.batch_normalization(np.ones((2, 3), np.float32), training=True)


def _signature(fn):
    import inspect
    params = inspect.signature(fn).parameters.values()
    # Initializer defaults are objects of each library; their kinds are compared by name.
    return [(p.name, p.kind, type(p.default).__name__ if "initializer" in p.name else p.default)
            for p in params]


def test_keyword_arguments_and_defaults_match_tensorflow():
    assert _signature(fbn.layers.batch_normalization) == \
        [(n, k, d.replace("Zeros", "Initializer").replace("Ones", "Initializer")
          if isinstance(d, str) else d)
         for n, k, d in _signature(tf1.layers.batch_normalization)]
    tf_init = _signature(tf1.layers.BatchNormalization.__init__)
    ours = _signature(fbn.layers.BatchNormalization.__init__)
    assert ours == [(n, k, d.replace("Zeros", "Initializer").replace("Ones", "Initializer")
                     if isinstance(d, str) else d) for n, k, d in tf_init]


# `training`: TensorFlow accepts a bool or a value equal to 1 or 0 (the Keras V2 layer first turns
# a Python int into a bool) and raises TypeError for anything else. fbn raises before the layer
# is built (TensorFlow builds it first), so only the outcome is compared.
_TRAINING_VALUES = ["no", "", "True", 2, -1, 1, 0, 1.0, 0.0, 0.5, np.True_, np.int64(0),
                    np.float32(1), None, object(), [True], np.array(True)]


@pytest.mark.parametrize("form", ["V1 layer", "V1 function", "V2 layer"])
def test_training_argument_types_match_tensorflow(form):
    def outcomes(api, make_call):
        result = []
        with api.context():
            x = api.x([4, 3])
            for value in _TRAINING_VALUES:
                try:
                    make_call(api)(x, value)
                    result.append((repr(value), "ok"))
                except TypeError:
                    result.append((repr(value), "TypeError"))
        return result

    def make_call(api):
        if form == "V1 layer":
            return lambda x, value: api.BN()(x, training=value)
        if form == "V1 function":
            return lambda x, value: api.bn(x, training=value)
        v2 = tf.keras.layers.BatchNormalization if isinstance(api, TFApi) else \
            fbn.layers.BatchNormalizationV2
        return lambda x, value: v2()(x, training=value)

    assert outcomes(FbnApi(), make_call) == outcomes(TFApi(), make_call)
