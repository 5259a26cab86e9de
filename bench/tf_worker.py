"""TensorFlow side of the side-by-side benchmark (run by run_bench.py in its own process).

tf.raw_ops.FusedBatchNormV3 / FusedBatchNormGradV3 inside tf.function, intra-op threads from the
job (2), inter-op 1. TF_ENABLE_ONEDNN_OPTS is set by the driver before this process starts: =1
(oneDNN kernels, TF's default on this CPU) or =0 (Eigen kernels).

    python tf_worker.py CONFIG.json   then one JSON request per stdin line (bench_common.serve)

Outputs cannot be preallocated in TensorFlow; every call allocates y (or dx) from TF's
allocator, as it does for any TF user.
"""

import os
import sys
import traceback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

FORMAT = {"nhwc": "NHWC", "nchw": "NCHW"}
TFDT = {"f32": tf.float32, "bf16": tf.bfloat16}


def make_fns():
    """One tf.function per (pass, layout); each traces once per input shape/dtype."""
    fns = {}
    for layout, fmt in FORMAT.items():
        def fwd(x, s, o, m, v, training, fmt=fmt):
            return tf.raw_ops.FusedBatchNormV3(
                x=x, scale=s, offset=o, mean=m, variance=v, epsilon=bc.EPSILON,
                exponential_avg_factor=1.0, data_format=fmt, is_training=training)

        def grad(dy, x, s, r1, r2, r3, training, fmt=fmt):
            return tf.raw_ops.FusedBatchNormGradV3(
                y_backprop=dy, x=x, scale=s, reserve_space_1=r1, reserve_space_2=r2,
                reserve_space_3=r3, epsilon=bc.EPSILON, data_format=fmt, is_training=training)

        fns[("fwd_train", layout)] = tf.function(lambda x, s, o, m, v, f=fwd: f(x, s, o, m, v, True))
        fns[("fwd_infer", layout)] = tf.function(lambda x, s, o, m, v, f=fwd: f(x, s, o, m, v, False))
        fns[("grad_train", layout)] = tf.function(
            lambda dy, x, s, r1, r2, r3, g=grad: g(dy, x, s, r1, r2, r3, True))
        fns[("grad_infer", layout)] = tf.function(
            lambda dy, x, s, r1, r2, r3, g=grad: g(dy, x, s, r1, r2, r3, False))
    return fns


def buffer_of(t):
    """(address, bytes) of an eager CPU tensor's buffer (bitcast shares it; bf16 as uint16)."""
    if t.dtype == tf.bfloat16:
        t = tf.bitcast(t, tf.uint16)
    a = t._numpy()  # shares the tensor's memory for CPU tensors
    if not isinstance(a, np.ndarray):  # a scalar (reserve_space_3): nothing worth flushing
        return 0, 0
    return a.ctypes.data, a.nbytes


class Inputs:
    """Random inputs for one shape and dtype, reused across passes and layouts (same bytes)."""

    def __init__(self):
        self.key = None

    def get(self, case):
        key = (case["n"], case["c"], case["h"], case["w"], case["dtype"])
        if key != self.key:
            self.key = None
            self.flat_x = self.flat_dy = None
            n = case["n"] * case["c"] * case["h"] * case["w"]
            c = case["c"]
            tf.random.set_seed(1)
            self.flat_x = tf.cast(tf.random.uniform([n], -2.0, 3.0), TFDT[case["dtype"]])
            self.flat_dy = tf.cast(tf.random.uniform([n], -1.0, 1.0), TFDT[case["dtype"]])
            self.scale = tf.random.uniform([c], 0.5, 1.5)
            self.offset = tf.random.uniform([c], -0.5, 0.5)
            self.mean = tf.random.uniform([c], 0.0, 1.0)
            self.var = tf.random.uniform([c], 1.0, 3.0)
            self.key = key
        n, c, h, w = case["n"], case["c"], case["h"], case["w"]
        shape = [n, h, w, c] if case["layout"] == "nhwc" else [n, c, h, w]
        return tf.reshape(self.flat_x, shape), tf.reshape(self.flat_dy, shape)


def build_call(fns, case, x, dy, scale, offset, mean, var, saved=None):
    """A no-argument callable running the case's op once; returns its outputs."""
    p, layout = case["pass"], case["layout"]
    f = fns[(p, layout)]
    if p in ("fwd_train", "fwd_infer"):
        return lambda: f(x, scale, offset, mean, var), (x,)
    if saved is None:
        train_fwd = fns[("fwd_train" if p == "grad_train" else "fwd_infer", layout)]
        out = train_fwd(x, scale, offset, mean, var)
        r1, r2, r3 = (out[3], out[4], out[5]) if p == "grad_train" else (mean, var, out[5])
    else:
        r1, r2, r3 = saved
    return lambda: f(dy, x, scale, r1, r2, r3), (x, dy)


def run_parity(job, fns, result):
    d = job["parity"]["dir"]
    n, c, h, w = job["parity"]["shape"]
    lib = job["lib"]
    rd = lambda name: tf.constant(np.fromfile(os.path.join(d, name), dtype=np.float32))
    scale, offset, mean, var = rd("scale.bin"), rd("offset.bin"), rd("mean.bin"), rd("var.bin")
    smean, svar = rd("smean.bin"), rd("svar.bin")
    for dtype in bc.DTYPES:
        for layout in bc.LAYOUTS:
            shape = [n, h, w, c] if layout == "nhwc" else [n, c, h, w]

            def load(what):
                if dtype == "f32":
                    a = np.fromfile(bc.parity_in(d, dtype, layout, what), dtype=np.float32)
                    return tf.reshape(tf.constant(a), shape)
                a = np.fromfile(bc.parity_in(d, dtype, layout, what), dtype=np.uint16)
                return tf.reshape(tf.bitcast(tf.constant(a), tf.bfloat16), shape)

            x, dy = load("x"), load("dy")
            for p in bc.PASSES:
                key = "%s_%s_%s" % (p, dtype, layout)
                case = {"pass": p, "layout": layout}
                try:
                    if p.startswith("fwd"):
                        call, _ = build_call(fns, case, x, dy, scale, offset, mean, var)
                        out = call()
                        outs = {"y": out[0]}
                        if p == "fwd_train":
                            outs["mean"], outs["var"] = out[3], out[4]
                    else:
                        r3 = fns[("fwd_train", layout)](x, scale, offset, mean, var)[5]
                        saved = (smean, svar, r3) if p == "grad_train" else (mean, var, r3)
                        call, _ = build_call(fns, case, x, dy, scale, offset, mean, var, saved)
                        out = call()
                        outs = {"dx": out[0], "dscale": out[1], "doffset": out[2]}
                    for what, t in outs.items():
                        np.asarray(tf.cast(t, tf.float32)).astype(np.float32).tofile(
                            bc.parity_out(d, lib, p, dtype, layout, what))
                    result["parity"][key] = "ok"
                except Exception as e:  # noqa: BLE001 - an unsupported combination is a result
                    result["parity"][key] = "error: " + first_line(e)


def first_line(e):
    s = str(e).strip().splitlines()
    msg = s[0] if s else type(e).__name__
    # TF wraps kernel errors in a graph-execution preamble; keep the kernel's own text.
    for line in s:
        if "only support" in line or "No registered" in line or "not supported" in line:
            msg = line.strip()
            break
    return msg[:300]


class Worker:
    def __init__(self, job):
        self.job = job
        tf.config.threading.set_intra_op_parallelism_threads(job["threads"])
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.flusher = bc.Flusher(job["flush_lib"]) if job.get("flush_lib") else None
        self.versions = {
            "tensorflow": tf.__version__,
            "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""),
            "intra_op": tf.config.threading.get_intra_op_parallelism_threads(),
            "inter_op": tf.config.threading.get_inter_op_parallelism_threads(),
        }
        self.fns = make_fns()
        # Framework dispatch overhead, reported apart (never subtracted): tf.function on a scalar.
        ident = tf.function(lambda a: a + 1.0)
        one = tf.constant(1.0)
        self.versions["dispatch_overhead_us"] = 1e6 * sorted(
            bc.time_callable(lambda: ident(one), 5, 0.02)[0])[2]

    def handle(self, req):
        result = {"lib": self.job["lib"], "versions": self.versions, "results": [], "parity": {}}
        if req.get("parity"):
            self.job["parity"] = req["parity"]
            run_parity(self.job, self.fns, result)
        inputs = Inputs()
        flusher = self.flusher
        for case in req.get("cases", []):
            rec = {"name": bc.bench_name(self.job["lib"], case), "status": "ok"}
            try:
                x, dy = inputs.get(case)
                call, operands = build_call(self.fns, case, x, dy, inputs.scale, inputs.offset,
                                            inputs.mean, inputs.var)

                def flush(outs, operands=operands):
                    for t in list(operands) + [inputs.scale, inputs.offset, inputs.mean,
                                               inputs.var]:
                        flusher.flush(*buffer_of(t))
                    for t in outs or ():
                        flusher.flush(*buffer_of(t))

                rec["samples"], rec["min"] = bc.time_callable(
                    call, case["reps"], case["min_time"], cold=case["cache"] == "cold",
                    flush=flush if flusher else None)
            except Exception as e:  # noqa: BLE001 - an unsupported combination is a result
                rec["status"] = "unsupported" if "only support" in str(e) else "error"
                rec["error"] = first_line(e)
            result["results"].append(rec)
        return result


def main():
    worker = Worker(bc.read_job(sys.argv[1]))
    bc.serve(worker.handle)


if __name__ == "__main__":
    try:
        main()
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        sys.exit(1)
