"""Shared pieces of the side-by-side benchmark: shapes, cases, byte counts, the timing loop and the
parity-file layout. Imported by run_bench.py (project venv) and by the TensorFlow and PyTorch
workers (the torch one runs under Debian's /usr/bin/python3), so only the standard library and
numpy are used here.
"""

import ctypes
import json
import math
import os
import time

EPSILON = 1e-3  # the same epsilon in every library (their defaults differ)
PASSES = ("fwd_train", "fwd_infer", "grad_train", "grad_infer")
DTYPES = ("f32", "bf16")
LAYOUTS = ("nhwc", "nchw")
DTYPE_SIZE = {"f32": 4, "bf16": 2}

# Minimum (compulsory) activation traffic per pass, in units of T = N*C*H*W*sizeof(dtype), from
# performance.md §5.1: forward 1R+1W, gradient 2R+1W. Per-channel vectors are ignored (at most
# 8*C*4 bytes, < 0.2% of T for every shape here except the 'tiny' overhead probe).
MIN_TRAFFIC_T = {"fwd_train": 2, "fwd_infer": 2, "grad_train": 3, "grad_infer": 3}

# ResNet-50 v1.5 (torchvision), the 53 BN layers of one step as 12 unique (C, H=W) shapes with
# their occurrence counts: shared/bench/shapes_bnorm.txt section C (a real framework trace).
RESNET50 = [
    (64, 112, 1), (64, 56, 6), (256, 56, 4), (128, 56, 1), (128, 28, 7), (512, 28, 5),
    (256, 28, 1), (256, 14, 11), (1024, 14, 7), (512, 14, 1), (512, 7, 5), (2048, 7, 4),
]
# GoogLeNet v3 at minibatch 96: odd spatial sizes and C not a multiple of 16 (section D).
GOOGLENET_V3 = [
    (32, 149), (32, 147), (64, 147), (80, 73), (192, 71), (64, 35), (48, 35), (96, 35), (32, 35),
    (384, 17), (96, 17), (192, 17), (128, 17), (160, 17), (320, 8), (192, 8), (384, 8), (448, 8),
]

# In run order: small first, so that an interrupted full run still covers most shapes.
SHAPE_SETS = ("tiny", "r50_mb1", "r50_mb32", "gnv3_mb96", "r50_mb128")

# --quick: four shapes (3 MB, 13 MB, 23 MB in f32, and the 1 KB overhead probe), every
# pass/dtype/layout/cache.
QUICK_SHAPES = {
    "r50_mb1": [(256, 56)],
    "r50_mb32": [(128, 28)],
    "gnv3_mb96": [(48, 35)],
    "tiny": [(64, 2)],
}


def shapes_of(set_name, only=None):
    """[(case_id, set, N, C, H, W, weight)] for a shape set; `only` limits to (C, H) pairs."""
    out = []
    if set_name.startswith("r50_mb"):
        n = int(set_name[len("r50_mb"):])
        for c, hw, k in RESNET50:
            out.append((n, c, hw, k))
    elif set_name == "gnv3_mb96":
        for c, hw in GOOGLENET_V3:
            out.append((96, c, hw, 1))
    elif set_name == "tiny":
        # Fixed-overhead probe: 256 elements, every library's per-call cost dominates.
        out.append((1, 64, 2, 1))
    else:
        raise ValueError("unknown shape set " + set_name)
    rows = []
    for n, c, hw, k in out:
        if only is not None and (c, hw) not in only:
            continue
        rows.append(("%s_n%dc%dh%dw%d" % (set_name, n, c, hw, hw), set_name, n, c, hw, hw, k))
    return rows


def tensor_bytes(case):
    return case["n"] * case["c"] * case["h"] * case["w"] * DTYPE_SIZE[case["dtype"]]


def min_bytes(case):
    return MIN_TRAFFIC_T[case["pass"]] * tensor_bytes(case)


def bench_name(lib, case):
    """The Google Benchmark name the C++ programs give a case (also the key in every result)."""
    return "/".join([lib, case["id"], case["pass"], case["dtype"], case["layout"], case["cache"]])


def case_key(case):
    return (case["id"], case["pass"], case["dtype"], case["layout"], case["cache"])


# ---------------------------------------------------------------------------------------------
# Timing loop of the Python workers: the same protocol as the C++ programs' Google Benchmark
# settings (repetitions of at least min_time each, per-call mean per repetition; the driver takes
# the median over repetitions). Cold: every call is preceded by an untimed flush of its operands.


def time_callable(fn, reps, min_time, cold=False, flush=None, max_calls_per_rep=100000):
    """Times fn() call by call. Returns (per-repetition median call seconds, fastest call).

    fn() runs one call and returns its outputs. flush(outputs) evicts the call's inputs and the
    given outputs (None: inputs only) from the caches; used only when cold. The median call of a
    repetition (not the mean) is its value, as in the C++ programs: on a shared 2-core machine one
    preempted call must not decide a repetition.
    """
    t0 = time.perf_counter()
    out = fn()  # warm-up: tracing, allocation, thread start-up
    one = time.perf_counter() - t0
    del out
    if one < 0.25:  # a second warm-up, timed to size the repetitions (big tensors skip it)
        t0 = time.perf_counter()
        out = fn()
        one = time.perf_counter() - t0
        del out
    one = max(one, 1e-7)
    calls = max(1, min(max_calls_per_rep, int(math.ceil(min_time / one)) if min_time > 0 else 1))
    samples, fastest = [], float("inf")
    clock = time.perf_counter
    # A repetition also ends after 4x min_time of wall time: when the machine is oversubscribed a
    # call can be 1000x slower than the calibration call, and a fixed call count would then run
    # for minutes.
    budget = 4 * min_time
    for _ in range(max(1, reps)):
        times = []
        prev = None
        rep_start = clock()
        for _ in range(calls):
            if cold:
                # The previous call's outputs leave the cache too: the allocator hands their
                # memory to this call.
                flush(prev)
                prev = None
            t0 = clock()
            prev = fn()
            t1 = clock()
            times.append(t1 - t0)
            if t1 - rep_start > budget:
                break
        del prev
        times.sort()
        samples.append(times[len(times) // 2] if len(times) % 2 else
                       0.5 * (times[len(times) // 2 - 1] + times[len(times) // 2]))
        fastest = min(fastest, times[0])
    return samples, fastest


class Flusher:
    """clflush of raw buffers through build-bench/bench/libfbn_bench_flush.so."""

    def __init__(self, lib_path):
        self.lib = ctypes.CDLL(lib_path)
        self.lib.fbn_bench_flush.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.lib.fbn_bench_flush.restype = None

    def flush(self, ptr, nbytes):
        if ptr and nbytes:
            self.lib.fbn_bench_flush(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))


# ---------------------------------------------------------------------------------------------
# Parity files (written by run_bench.py, read by every program; see fbn_bench.cc):
#   in_<dtype>_<layout>_x.bin, in_<dtype>_<layout>_dy.bin   activations in that layout and dtype
#                                                           (bf16 as raw uint16)
#   scale.bin offset.bin mean.bin var.bin smean.bin svar.bin  float32 [C]
# and each library writes out_<lib>_<pass>_<dtype>_<layout>_<what>.f32 (float32, the layout's
# order), what = y, mean, var (fwd_train: saved batch mean and biased variance), dx, dscale,
# doffset.


def parity_in(dirname, dtype, layout, what):
    return os.path.join(dirname, "in_%s_%s_%s.bin" % (dtype, layout, what))


def parity_out(dirname, lib, pas, dtype, layout, what):
    return os.path.join(dirname, "out_%s_%s_%s_%s_%s.f32" % (lib, pas, dtype, layout, what))


def serve(handler):
    """Worker loop: one JSON request per stdin line, one JSON response per line on the original
    stdout. Everything else the process prints (TF's C++ logging included) goes to stderr, so
    that the protocol channel stays clean."""
    import sys
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        req = json.loads(line)
        if req.get("quit"):
            break
        proto.write(json.dumps(handler(req)) + "\n")
        proto.flush()


def read_job(path):
    with open(path) as f:
        return json.load(f)


def write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
