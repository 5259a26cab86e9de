#!/usr/bin/env python3
"""Side-by-side batch-norm benchmark: fbn against oneDNN, TensorFlow (oneDNN and Eigen kernels) and
PyTorch on the same machine, threads and shapes, in one run (performance.md §7.2).

    bench/run_bench.py [--quick] [--libs fbn,onednn,...] [--passes ...] [--dtypes f32,bf16]
                       [--layouts nhwc,nchw] [--sets r50_mb1,...] [--cache warm,cold]
                       [--shape REGEX] [--build-dir build-bench] [--out DIR]

Run from the project venv after building build-bench (scripts/bench.sh does both). Steps:
  1. copy_bench: the machine's read / copy (regular and NT stores) bandwidth, 2 threads;
  2. parity: every library computes every pass on one small shape from the same input files,
     compared with a float64 reference;
  3. timing: each library in its own process over the same case list, shape set by shape set
     (libraries interleaved so that drift in machine load spreads over all of them); beside the
     DRAM-sized warm forward inferences, a copy of the same tensor (copy_bench --cases) in the
     same rounds, for the bandwidth target;
  4. results: results.csv (one row per case and library), cases.csv (one row per case), summary.txt
     (what is printed), meta.json, bench.png, all under bench/results/<stamp>-<mode>/.
See bench/README.md for how to read them.
"""

import argparse
import datetime
import json
import math
import os
import platform
import re
import select
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench_common as bc  # noqa: E402

ALL_LIBS = ("fbn", "onednn", "tf_onednn", "tf_eigen", "torch")
ANCHORS = ("onednn", "tf_onednn", "tf_eigen", "torch")
PARITY_SHAPE = (3, 48, 5, 7)  # N, C, H, W: small, odd spatial size, C a multiple of 16

# Kernel targets of the issue "Kernels at the memory-bandwidth limit".
TARGETS = {
    "fwd_infer_share": 0.85,  # fwd inference >= 85% of copy BW on tensors > LLC
    "fwd_train_over_infer": {"nchw": 1.2, "nhwc": 1.75},
    "grad_train_over_infer": {"nchw": 1.6, "nhwc": 2.6},
    "bf16_over_f32": 0.6,
    "overhead_us": 3.0,
    "geomean_speedup": 1.3,
}


def log(msg=""):
    print(msg, flush=True)


# ---------------------------------------------------------------------------------------------
# Machine and versions.


def read_first(path, default=""):
    try:
        with open(path) as f:
            return f.readline().strip()
    except OSError:
        return default


def sysfs_caches():
    out = {}
    for i in range(8):
        d = "/sys/devices/system/cpu/cpu0/cache/index%d/" % i
        level = read_first(d + "level")
        if not level:
            break
        kind = read_first(d + "type")
        if kind == "Instruction":
            continue
        size = read_first(d + "size")
        m = re.match(r"(\d+)([KMG]?)", size)
        mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m.group(2)] if m else 0
        out["L%s%s" % (level, "d" if kind == "Data" else "")] = int(m.group(1)) * mult if m else 0
    return out


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    keep = ["avx2", "avx512f", "avx512bw", "avx512_bf16", "avx512_fp16",
                            "amx_bf16", "amx_tile"]
                    return " ".join(k for k in keep if k in flags)
    except OSError:
        pass
    return ""


def git_rev():
    try:
        rev = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--", "src",
                                "include"], capture_output=True, text=True,
                               timeout=10).stdout.strip()
        return rev + ("+dirty(src/include)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def built_time(path):
    try:
        return datetime.datetime.fromtimestamp(os.path.getmtime(path)).isoformat(
            timespec="seconds")
    except OSError:
        return "missing"


def fmt_bytes(b):
    for unit, div in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if b >= div:
            return "%.3g %s" % (b / div, unit)
    return "%d B" % b


# ---------------------------------------------------------------------------------------------
# Child processes.


def child_env(args, extra=None):
    env = dict(os.environ)
    env.update({
        "OMP_NUM_THREADS": str(args.threads),
        "FBN_NUM_THREADS": str(args.threads),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    })
    env.pop("ONEDNN_VERBOSE", None)
    env.pop("DNNL_VERBOSE", None)
    if extra:
        env.update(extra)
    return env


def run_proc(cmd, log_path, env, timeout):
    t0 = time.time()
    with open(log_path, "a") as logf:
        logf.write("$ %s\n" % " ".join(cmd))
        logf.flush()
        try:
            rc = subprocess.run(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env,
                                timeout=timeout, cwd=ROOT).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return rc, time.time() - t0


def gb_results(path):
    """{benchmark key: {median_s, min_s, cv, reps, label, error}} from Google Benchmark JSON."""
    out = {}
    if not os.path.exists(path):
        return out, {}
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return out, {}
    scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}
    for b in data.get("benchmarks", []):
        key = "/".join(b.get("run_name", b["name"]).split("/")[:6])
        rec = out.setdefault(key, {"status": "ok"})
        if b.get("error_occurred"):
            rec["status"] = "error"
            rec["error"] = b.get("error_message", "")
            continue
        # Per repetition the programs report the median call (call_med_us) and the fastest call
        # (call_min_us); Google Benchmark aggregates them over repetitions. real_time (the
        # per-repetition mean) is kept as gb_mean_s.
        t = b.get("real_time", 0.0) * scale[b.get("time_unit", "ns")]
        med = b.get("call_med_us")
        agg = b.get("aggregate_name")
        if agg == "median":
            rec["median_s"] = med * 1e-6 if med is not None else t
            rec["gb_mean_s"] = t
            rec["reps"] = b.get("repetitions", 0)
        elif agg == "min":
            rec["min_s"] = b["call_min_us"] * 1e-6 if "call_min_us" in b else t
        elif agg == "cv":
            rec["cv"] = med if med is not None else b.get("real_time", 0.0)  # a fraction
        elif agg is None:
            rec.setdefault("samples", []).append(med * 1e-6 if med is not None else t)
        if b.get("label"):
            rec["impl"] = b["label"]
    for rec in out.values():
        if "median_s" not in rec and rec.get("samples"):
            s = rec["samples"]
            rec["median_s"], rec["min_s"], rec["reps"] = statistics.median(s), min(s), len(s)
    return out, data.get("context", {})


def worker_results(data):
    """{bench name: result}, versions, parity from one worker response."""
    out = {}
    for r in data.get("results", []):
        rec = {"status": r["status"]}
        if r.get("error"):
            rec["error"] = r["error"]
        s = r.get("samples")
        if s:
            rec["median_s"] = statistics.median(s)
            rec["min_s"] = r.get("min", min(s))
            rec["reps"] = len(s)
            m = statistics.mean(s)
            rec["cv"] = statistics.pstdev(s) / m if len(s) > 1 and m > 0 else 0.0
        out[r["name"]] = rec
    return out, data.get("versions", {}), data.get("parity", {})


class Worker:
    """A persistent TF or PyTorch worker process (bench_common.serve protocol)."""

    def __init__(self, cmd, env, log_path, config_path):
        self.log = open(log_path, "a")
        self.log.write("$ %s\n" % " ".join(cmd + [config_path]))
        self.log.flush()
        self.proc = subprocess.Popen(cmd + [config_path], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=ROOT,
                                     text=True, bufsize=1)

    def request(self, req, timeout):
        """The response dict, or None if the worker died or timed out (it is then killed)."""
        if self.proc.poll() is not None:
            return None
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close(kill=True)
            return None
        return json.loads(line)

    def close(self, kill=False):
        if self.proc.poll() is None:
            try:
                if kill:
                    self.proc.kill()
                else:
                    self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                    self.proc.stdin.flush()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.log.close()


def write_case_file(path, cases):
    with open(path, "w") as f:
        f.write("# id pass dtype layout N C H W cache reps min_time\n")
        for c in cases:
            f.write("%s %s %s %s %d %d %d %d %s %d %g\n" % (
                c["id"], c["pass"], c["dtype"], c["layout"], c["n"], c["c"], c["h"], c["w"],
                c["cache"], c["reps"], c["min_time"]))


class Runner:
    """Runs one library over a list of cases and returns {bench name: result}. The C++ programs
    start once per call (a few ms); the TF and PyTorch workers stay up for the whole run."""

    def __init__(self, args, out_dir):
        self.args = args
        self.out = out_dir
        self.bin = os.path.join(args.build_dir, "bench")
        self.flush_lib = os.path.join(self.bin, "libfbn_bench_flush.so")
        self.versions = {}
        self.parity = {}
        self.available = {}
        self.workers = {}
        self.secs = {}
        self.placements = []  # (lib, tag, ns before, ns after, state) per timed batch

    def exe(self, name):
        return os.path.join(self.bin, name)

    def check_available(self, libs):
        for lib in libs:
            why = None
            if lib == "fbn" and not os.path.exists(self.exe("fbn_bench")):
                why = "fbn_bench not built"
            elif lib == "onednn" and not os.path.exists(self.exe("onednn_bench")):
                why = "onednn_bench not built (no usable oneDNN under FBN_ONEDNN_ROOT)"
            elif lib.startswith("tf_") and not self.args.tf_python:
                why = "no Python with TensorFlow"
            elif lib == "torch" and not (self.args.torch_python and shutil.which(
                    self.args.torch_python)):
                why = "no Python with torch (%s)" % self.args.torch_python
            self.available[lib] = why
        return {k: v for k, v in self.available.items() if v}

    def worker(self, lib):
        w = self.workers.get(lib)
        if w is not None and w.proc.poll() is None:
            return w
        if lib.startswith("tf_"):
            py = self.args.tf_python
            extra = {"TF_ENABLE_ONEDNN_OPTS": "1" if lib == "tf_onednn" else "0"}
            script = os.path.join(HERE, "tf_worker.py")
        else:
            py = self.args.torch_python
            extra = {}
            if self.args.torch_capability:
                extra["ATEN_CPU_CAPABILITY"] = self.args.torch_capability
            script = os.path.join(HERE, "torch_worker.py")
        config = os.path.join(self.out, "raw", "%s.config.json" % lib)
        bc.write_json(config, {"lib": lib, "threads": self.args.threads,
                               "flush_lib": self.flush_lib})
        w = Worker([py, script], child_env(self.args, extra),
                   os.path.join(self.out, "logs", "%s.log" % lib), config)
        self.workers[lib] = w
        return w

    def close(self):
        for w in self.workers.values():
            w.close()

    def round_trip_ns(self):
        """The CPU pair's cache-line round trip now (placement_probe), or None without it."""
        prog = self.exe("placement_probe")
        if self.args.no_placement or not os.path.exists(prog):
            return None
        try:
            out = subprocess.run([prog, "--ms=5"], capture_output=True, text=True, timeout=30)
            ns = json.loads(out.stdout)["round_trip_ns"]
        except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
            return None
        return ns if ns > 0 else None

    def placement_state(self, before, after):
        """'near' / 'far' when both probes around a batch agree, 'mixed' when the host moved the
        CPUs during it, 'busy' when a probe could not see the hardware's round trip (every
        sample preempted: over 2000 ns), None without probes."""
        if before is None or after is None:
            return None
        if max(before, after) > 2000:
            return "busy"
        near = [ns < self.args.placement_split_ns for ns in (before, after)]
        return "mixed" if near[0] != near[1] else ("near" if near[0] else "far")

    def run(self, lib, cases, tag, parity=None):
        """parity: None, or {"dir":..., "shape": [...]} to run the parity pass first. Each result
        of a timed batch carries the CPUs' placement around it (placement_state)."""
        before = self.round_trip_ns() if cases else None
        res, rc, secs = self.run_batch(lib, cases, tag, parity)
        if cases and before is not None:
            after = self.round_trip_ns()
            state = self.placement_state(before, after)
            self.placements.append((lib, tag, before, after, state))
            for rec in res.values():
                rec["placement"] = state
        return res, rc, secs

    def run_batch(self, lib, cases, tag, parity):
        logp = os.path.join(self.out, "logs", "%s.log" % lib)
        stem = os.path.join(self.out, "raw", "%s_%s" % (lib, tag))
        t0 = time.time()
        rc = 0
        if lib in ("fbn", "onednn", "copy"):
            prog = self.exe({"fbn": "fbn_bench", "onednn": "onednn_bench",
                             "copy": "copy_bench"}[lib])
            env = child_env(self.args)
            if parity:
                rc, _ = run_proc([prog, "--parity_dir=" + parity["dir"],
                                  "--parity_shape=" + ",".join(map(str, parity["shape"]))],
                                 logp, env, 600)
                self.parity[lib] = {"_rc": rc}
            res = {}
            if cases:
                case_file = stem + ".cases"
                write_case_file(case_file, cases)
                cmd = [prog, "--cases=" + case_file, "--benchmark_format=json",
                       "--benchmark_out=" + stem + ".json", "--benchmark_out_format=json",
                       "--benchmark_report_aggregates_only=true"]
                if lib in ("fbn", "copy"):
                    cmd.append("--threads=%d" % self.args.threads)
                rc, _ = run_proc(cmd, logp, env, self.args.timeout)
                res, ctx = gb_results(stem + ".json")
                for k in ("fbn_version", "fbn_threads", "onednn_version", "onednn_threads",
                          "onednn_cpu_runtime"):
                    if k in ctx:
                        self.versions[k] = ctx[k]
                lbt = ctx.get("library_build_type")
                if lbt:
                    self.versions["benchmark_library_build"] = lbt
        else:
            resp = self.worker(lib).request({"cases": cases, "parity": parity},
                                            self.args.timeout)
            if resp is None:
                rc = "worker died or timed out (see %s)" % logp
                res = {}
            else:
                res, vers, par = worker_results(resp)
                self.versions.update({("%s:%s" % (lib, k)): v for k, v in vers.items()})
                if parity:
                    self.parity[lib] = par
        secs = time.time() - t0
        self.secs[lib] = self.secs.get(lib, 0.0) + secs
        for c in cases:
            name = bc.bench_name(lib, c)
            if name not in res:
                res[name] = {"status": "error", "error": "no result (rc=%s)" % rc}
        return res, rc, secs


# ---------------------------------------------------------------------------------------------
# Copy bandwidth.


def run_copy(args, out_dir):
    path = os.path.join(out_dir, "raw", "copy_bench.json")
    cmd = [os.path.join(args.build_dir, "bench", "copy_bench"), "--benchmark_format=json",
           "--benchmark_out=" + path, "--benchmark_out_format=json",
           "--benchmark_repetitions=3", "--benchmark_report_aggregates_only=true",
           "--benchmark_min_time=%g" % (0.05 if args.quick else 0.1)]
    rc, secs = run_proc(cmd, os.path.join(out_dir, "logs", "copy_bench.log"), child_env(args),
                        900)
    bw = {}
    ref_bw = {}  # copy_bench's reference loops (ref/...), GB/s of their counted bytes
    dram_mb = None
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        log("copy_bench failed (rc=%s)" % rc)
        return None
    dram_mb = int(data.get("context", {}).get("dram_buffer_mb", 0))
    for b in data["benchmarks"]:
        if b.get("aggregate_name") != "median":
            continue
        m = re.match(r"mem/(\w+)/(\d+)MB/.*threads:(\d+)", b["run_name"])
        if m:
            bw[(m.group(1), int(m.group(2)), int(m.group(3)))] = b["bytes_per_second"] / 1e9
        m = re.match(r"ref/(\w+)/(\d+)MB/.*threads:2", b["run_name"])
        if m:
            ref_bw[m.group(1)] = b["bytes_per_second"] / 1e9
    copy = {"dram_mb": dram_mb, "table": bw, "secs": secs}
    copy["copy_nt"] = bw.get(("copy_nt", dram_mb, 2))
    copy["copy_regular"] = bw.get(("copy_regular", dram_mb, 2))
    copy["read"] = bw.get(("read", dram_mb, 2))
    copy["copy_nt_1t"] = bw.get(("copy_nt", dram_mb, 1))
    copy["ref_chunk_kb"] = data.get("context", {}).get("ref_chunk_kb")
    # The reference loops' time over the NT copy's for the same tensor (copy_bench.cc): what the
    # simplest loops with a training pass's traffic give on this machine, against inference.
    copy["ref_bw"] = ref_bw
    copy["ref_ratio"] = {}
    if copy["copy_nt"]:
        for name, counted in (("fwd_two_sweeps", 2), ("fwd_chunked", 2), ("grad_two_sweeps", 3),
                              ("grad_chunked", 3)):
            if ref_bw.get(name):
                copy["ref_ratio"][name] = (counted / ref_bw[name]) / (2 / copy["copy_nt"])
    # Reference for "% of copy BW": the better of the two 2-thread DRAM copies (normally NT).
    cands = [v for v in (copy["copy_nt"], copy["copy_regular"]) if v]
    copy["ref"] = max(cands) if cands else None
    # Effective LLC: the sizes up to the first whose read bandwidth is no longer clearly (1.3x)
    # above DRAM's. Not the largest size above it: on a shared host a single larger sweep can
    # read fast by chance (20261203-091909-full: 256 MB at 49.8 GB/s after 64 MB at 41.6 and
    # 128 MB at 31.9), which would leave no DRAM-sized shape to check the targets on.
    sizes = sorted({k[1] for k in bw if k[0] == "read" and k[2] == 2})
    llc = None
    if copy["read"]:
        for s in sizes:
            if s == dram_mb or bw[("read", s, 2)] <= 1.3 * copy["read"]:
                break
            llc = s
    copy["llc_eff_mb"] = llc
    # DRAM-sized: at or above the first sweep size whose read bandwidth is DRAM's.
    above = [x for x in sizes if llc is not None and x > llc]
    copy["dram_from_mb"] = above[0] if above else None
    return copy


# ---------------------------------------------------------------------------------------------
# Parity.


def bf16_round(a):
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def bf16_to_f32(u16):
    return (u16.astype(np.uint32) << 16).view(np.float32)


def make_parity_inputs(d):
    n, c, h, w = PARITY_SHAPE
    rng = np.random.default_rng(12345)
    x = rng.uniform(-2.0, 3.0, size=(n, c, h, w)).astype(np.float32) + \
        rng.uniform(-1, 1, size=(1, c, 1, 1)).astype(np.float32)
    dy = rng.uniform(-1.0, 1.0, size=(n, c, h, w)).astype(np.float32)
    params = {
        "scale": rng.uniform(0.5, 1.5, c), "offset": rng.uniform(-0.5, 0.5, c),
        "mean": rng.uniform(0.0, 1.0, c), "var": rng.uniform(1.0, 3.0, c),
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    refs = {}
    for dtype in bc.DTYPES:
        if dtype == "bf16":
            xq, dyq = bf16_to_f32(bf16_round(x)), bf16_to_f32(bf16_round(dy))
        else:
            xq, dyq = x, dy
        x64, dy64 = xq.astype(np.float64), dyq.astype(np.float64)
        axes = (0, 2, 3)
        m = x.shape[0] * x.shape[2] * x.shape[3]
        smean = x64.mean(axis=axes)
        svar = ((x64 - smean[None, :, None, None]) ** 2).mean(axis=axes)
        # Saved statistics are shared by all libraries (float32), taken from the f32 data.
        if dtype == "f32":
            params["smean"] = smean.astype(np.float32)
            params["svar"] = svar.astype(np.float32)
        sc = params["scale"].astype(np.float64)[None, :, None, None]
        of = params["offset"].astype(np.float64)[None, :, None, None]
        bshape = lambda v: v.astype(np.float64)[None, :, None, None]  # noqa: E731
        ref = {}
        ref[("fwd_train", "y")] = (x64 - smean[None, :, None, None]) / np.sqrt(
            svar[None, :, None, None] + bc.EPSILON) * sc + of
        ref[("fwd_train", "mean")] = smean
        ref[("fwd_train", "var")] = svar
        ref[("fwd_infer", "y")] = (x64 - bshape(params["mean"])) / np.sqrt(
            bshape(params["var"]) + bc.EPSILON) * sc + of
        # Gradients with the shared float32 saved stats (training) or population stats (frozen).
        for p, mu, var in (("grad_train", params["smean"], params["svar"]),
                           ("grad_infer", params["mean"], params["var"])):
            inv = 1.0 / np.sqrt(bshape(var) + bc.EPSILON)
            xhat = (x64 - bshape(mu)) * inv
            dscale = (dy64 * xhat).sum(axis=axes)
            doffset = dy64.sum(axis=axes)
            if p == "grad_train":
                dx = sc * inv * (dy64 - doffset[None, :, None, None] / m -
                                 xhat * dscale[None, :, None, None] / m)
            else:
                dx = dy64 * sc * inv
            ref[(p, "dx")], ref[(p, "dscale")], ref[(p, "doffset")] = dx, dscale, doffset
        refs[dtype] = ref
        for layout in bc.LAYOUTS:
            perm = (0, 2, 3, 1) if layout == "nhwc" else (0, 1, 2, 3)
            for what, arr in (("x", x), ("dy", dy)):
                a = np.ascontiguousarray(arr.transpose(perm))
                (bf16_round(a) if dtype == "bf16" else a).tofile(
                    bc.parity_in(d, dtype, layout, what))
    for k, v in params.items():
        v.tofile(os.path.join(d, k + ".bin"))
    return refs


def check_parity(d, refs, libs, runner):
    """{(lib, pass, dtype, layout): (status, max normalized error)}."""
    n, c, h, w = PARITY_SHAPE
    tol = {"f32": 1e-4, "bf16": 2e-2}
    out = {}
    for lib in libs:
        for dtype in bc.DTYPES:
            for layout in bc.LAYOUTS:
                for p in bc.PASSES:
                    whats = [k[1] for k in refs[dtype] if k[0] == p]
                    worst, status = 0.0, "ok"
                    lib_par = runner.parity.get(lib, {})
                    note = lib_par.get("%s_%s_%s" % (p, dtype, layout), "")
                    for what in whats:
                        path = bc.parity_out(d, lib, p, dtype, layout, what)
                        if not os.path.exists(path):
                            status = note if note.startswith("error") else "missing output"
                            break
                        got = np.fromfile(path, dtype=np.float32).astype(np.float64)
                        ref = refs[dtype][(p, what)]
                        if ref.ndim == 4:
                            perm = (0, 2, 3, 1) if layout == "nhwc" else (0, 1, 2, 3)
                            ref = ref.transpose(perm)
                        ref = ref.reshape(-1)
                        if got.size != ref.size:
                            status = "size %d != %d (%s)" % (got.size, ref.size, what)
                            break
                        # Error relative to the output's scale (max |ref|), per output.
                        err = float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-30))
                        if not np.isfinite(err):
                            err = float("inf")
                        worst = max(worst, err)
                        if err > tol[dtype]:
                            status = "MISMATCH %s err %.2e" % (what, err)
                    out[(lib, p, dtype, layout)] = (status, worst)
    return out


# ---------------------------------------------------------------------------------------------
# Cases.


def build_cases(args):
    only = None
    sets = args.sets
    if args.quick:
        sets = [s for s in sets if s in bc.QUICK_SHAPES]
    cases_by_set = {}
    for s in sets:
        only = bc.QUICK_SHAPES.get(s) if args.quick else None
        rows = []
        for cid, set_name, n, c, h, w, weight in bc.shapes_of(s, only):
            if args.shape and not re.search(args.shape, cid):
                continue
            for dtype in args.dtypes:
                tbytes = n * c * h * w * bc.DTYPE_SIZE[dtype]
                reps, min_time = rep_policy(args, n * c * h * w * 4)
                # A tensor beyond the LLC cannot stay cached between calls: warm is already
                # cold there, so the cold run is skipped.
                caches = [k for k in args.cache if k == "warm" or tbytes <= args.cold_max_bytes]
                for layout in args.layouts:
                    for p in args.passes:
                        for cache in caches:
                            rows.append({
                                "id": cid, "set": set_name, "n": n, "c": c, "h": h, "w": w,
                                "weight": weight, "dtype": dtype, "layout": layout, "pass": p,
                                "cache": cache, "reps": reps,
                                "min_time": min_time / 2 if cache == "cold" else min_time,
                                "tensor_bytes": tbytes,
                            })
        if rows:
            cases_by_set[s] = rows
    return cases_by_set


def paired_copy_case(c, args):
    """Whether a case gets a copy of its tensor timed beside it: the warm forward inferences of
    DRAM-sized tensors, which the bandwidth target holds against a copy."""
    return (not args.no_copy and c["pass"] == "fwd_infer" and c["cache"] == "warm" and
            c["n"] * c["c"] * c["h"] * c["w"] * 4 >= args.cold_max_bytes)


def round_reps(reps, rounds):
    """Repetitions per round: the total split over the rounds, at least one each."""
    return max(1, int(round(reps / float(rounds))))


def merge_rounds(recs):
    """One result from a case's rounds: the median of the rounds' medians, the fastest call of
    all, the repetitions added up. A round that failed is dropped while another succeeded."""
    ok = [r for r in recs if r.get("status") == "ok" and r.get("median_s")]
    if not ok:
        return recs[0]
    if len(ok) == 1:
        return dict(ok[0], by_placement=by_placement(ok))
    out = dict(ok[0])
    out["median_s"] = statistics.median(r["median_s"] for r in ok)
    mins = [r["min_s"] for r in ok if r.get("min_s")]
    if mins:
        out["min_s"] = min(mins)
    out["reps"] = sum(r.get("reps", 0) for r in ok)
    cvs = [r["cv"] for r in ok if r.get("cv") is not None]
    if cvs:
        out["cv"] = statistics.median(cvs)
    means = [r["gb_mean_s"] for r in ok if r.get("gb_mean_s")]
    if means:
        out["gb_mean_s"] = statistics.median(means)
    out["rounds"] = len(ok)
    out["by_placement"] = by_placement(ok)
    return out


def by_placement(recs):
    """{state: (median of the rounds' medians, rounds)} over the rounds that ran in one placement
    of the CPUs throughout ('near' or 'far'; mixed and busy rounds left out)."""
    out = {}
    for state in ("near", "far"):
        t = [r["median_s"] for r in recs if r.get("placement") == state]
        if t:
            out[state] = (statistics.median(t), len(t))
    return out


def matched(f, a):
    """fbn's speedup over an anchor from two merged results, compared within one placement of the
    CPUs: (speedup, state, fbn seconds, anchor seconds). The state is the one of the two (near,
    far) in which both have rounds, the one with more rounds of the two libraries together where
    both qualify; 'all' (medians over every round) where they share none."""
    fp, ap = f.get("by_placement") or {}, a.get("by_placement") or {}
    common = [st for st in ("near", "far") if st in fp and st in ap]
    if common:
        st = max(common, key=lambda x: fp[x][1] + ap[x][1])
        return ap[st][0] / fp[st][0], st, fp[st][0], ap[st][0]
    return a["median_s"] / f["median_s"], "all", f["median_s"], a["median_s"]


def ok_result(r):
    return r if r and r.get("status") == "ok" and r.get("median_s") else None


def case_speedup(c, results, libs):
    """{anchor: matched(...)} for every anchor with a result, and the best anchor (the one fbn is
    least ahead of), or ({}, None) without an fbn result."""
    f = ok_result(results.get(bc.bench_name("fbn", c)))
    if not f:
        return {}, None
    vs = {}
    for lib in libs:
        a = ok_result(results.get(bc.bench_name(lib, c))) if lib != "fbn" else None
        if a:
            vs[lib] = matched(f, a)
    best = min(vs, key=lambda lib: vs[lib][0]) if vs else None
    return vs, best


def alternate_rounds(runner, timed, cases_of, first, rounds, tag_of, round_recs, results):
    """Runs `rounds` rounds of every library in `timed` over cases_of(lib), in each round the
    libraries one after another, the starting one rotating from index `first`. Every round's
    records are appended to round_recs, and each key they touch gets in `results` the median over
    all its rounds (merge_rounds). Returns {lib: (seconds, last failing rc or 0)}."""
    secs_of = {}
    touched = set()
    for r in range(rounds):
        k = (first + r) % len(timed)
        for lib in timed[k:] + timed[:k]:
            res, rc, secs = runner.run(lib, cases_of(lib), tag_of(r))
            for key, rec in res.items():
                round_recs.setdefault(key, []).append(rec)
                touched.add(key)
            prev = secs_of.get(lib, (0.0, 0))
            secs_of[lib] = (prev[0] + secs, prev[1] if rc == 0 else rc)
    results.update({key: merge_rounds(round_recs[key]) for key in touched})
    return secs_of


# With the CPUs' placement probed, a case whose fbn and best anchor share no placement yet is a
# close call within this wider band: its extra rounds may give them one.
UNMATCHED_BAND = 1.5


def close_call_libs(c, results, libs, band, placement=False):
    """For a case where fbn and its best anchor are within `band` of each other (either way; the
    speedup compared within one placement where they share one, see matched; UNMATCHED_BAND
    where `placement` was probed and they share none): the libraries to re-time (fbn and every
    anchor within the band of fbn) and fbn's speedup. (None, None) otherwise."""
    vs, best = case_speedup(c, results, libs)
    if not best:
        return None, None
    speedup = vs[best][0]
    if placement and vs[best][1] == "all":
        band = max(band, UNMATCHED_BAND)
    if not (1.0 / band <= speedup <= band):
        return None, None
    return ["fbn"] + [lib for lib in libs if lib in vs and vs[lib][0] <= band], speedup


def recheck_close_calls(args, runner, libs, chunks, results, round_recs):
    """The close calls: cases where fbn and its best anchor ended the main rounds within
    --recheck-band of each other, on either side. On this shared host a library's median moves by
    10-30% from minute to minute, which decides such cases more than the code does. Each gets
    --recheck-rounds more rounds of fbn and of the anchors within the band of it, alternating as
    in the main rounds (shape by shape, the starting library rotating), and every library's result
    becomes the median over all its rounds, main and extra. Cases on both sides of parity are
    re-timed alike, so the extra rounds sharpen the estimate without choosing a side. Returns
    {bench name: speedup after the main rounds} for the re-timed cases."""
    before = {}
    t0 = time.time()
    for i, chunk in enumerate(chunks):
        todo = {}
        for c in chunk:
            who, speedup = close_call_libs(c, results, libs, args.recheck_band,
                                           bool(runner.placements))
            if not who:
                continue
            before[bc.bench_name("fbn", c)] = speedup
            for lib in who:
                todo.setdefault(lib, []).append(dict(c, reps=round_reps(c["reps"], args.rounds)))
        if not todo:
            continue
        timed = [lib for lib in libs if lib in todo]
        alternate_rounds(runner, timed, todo.get, i, args.recheck_rounds,
                         lambda r: "%s_recheck_r%d" % (chunk[0]["id"], r), round_recs, results)
        log("  recheck [%d/%d] %-26s %d close calls (%s)  (%.0f s so far)" % (
            i + 1, len(chunks), chunk[0]["id"], len(todo["fbn"]), ",".join(timed),
            time.time() - t0))
    return before


def rep_policy(args, f32_bytes):
    """(repetitions, min seconds per repetition) by tensor size: big shapes need few reps."""
    if args.reps:
        return args.reps, args.min_time if args.min_time is not None else 0.02
    if args.quick:
        reps, mt = 3, 0.005
    elif f32_bytes < (4 << 20):
        reps, mt = 5, 0.03
    elif f32_bytes < (64 << 20):
        reps, mt = 5, 0.02
    elif f32_bytes < (256 << 20):
        reps, mt = 3, 0.01
    else:
        reps, mt = 3, 1e-6  # one call per repetition
    if args.min_time is not None:
        mt = args.min_time
    return reps, mt


# ---------------------------------------------------------------------------------------------
# Report.


def geomean(v):
    v = [x for x in v if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def analyse(cases, results, copy, args, libs, parity):
    """Per-case rows with each library's median and fbn's speedup / bandwidth share."""
    ref_bw = copy["ref"] if copy and copy.get("ref") else None
    rows = []
    for c in cases:
        row = dict(c)
        row["min_traffic_bytes"] = bc.min_bytes(c)
        for lib in libs:
            row[lib] = results.get(bc.bench_name(lib, c))
        vs, best_lib = case_speedup(c, results, libs)
        row["vs"] = vs
        row["best_anchor"] = best_lib
        row["best_anchor_s"] = row[best_lib]["median_s"] if best_lib else None
        f = ok_result(row.get("fbn"))
        fbn_t = f["median_s"] if f else None
        row["fbn_s"] = fbn_t
        # Within one placement of the CPUs where fbn and the anchor share one (matched).
        row["speedup"] = vs[best_lib][0] if best_lib else None
        row["placement"] = vs[best_lib][1] if best_lib else None
        row["fbn_gbps"] = row["min_traffic_bytes"] / fbn_t / 1e9 if fbn_t else None
        row["fbn_share"] = row["fbn_gbps"] / ref_bw if (row["fbn_gbps"] and ref_bw) else None
        # Against a copy of the same tensor in the same rounds (it moves 2T, counted alike).
        cp = results.get(bc.bench_name("copy", c))
        copy_t = cp.get("median_s") if cp and cp.get("status") == "ok" else None
        row["copy_s"] = copy_t
        row["fbn_share_paired"] = (row["fbn_gbps"] / (2 * c["tensor_bytes"] / copy_t / 1e9)
                                   if (row["fbn_gbps"] and copy_t) else None)
        rows.append(row)
    return rows


def fmt_t(r):
    if not r:
        return "-"
    if r.get("status") != "ok" or not r.get("median_s"):
        return "n/a" if r.get("status") == "unsupported" else "err"
    return fmt_s(r["median_s"])


def fmt_s(t):
    """Seconds as microseconds, one decimal below 1 ms."""
    us = t * 1e6
    return "%.1f" % us if us < 1000 else "%.0f" % us


def report(rows, copy, args, libs, parity, versions, meta, out_dir):
    lines = []
    p = lines.append
    p("=" * 100)
    p("fbn side-by-side batch-norm benchmark  (%s mode, %s) %s" % (
        "quick" if args.quick else "full", meta["started"], meta.get("status", "")))
    p("=" * 100)
    p("machine: %s | %d vCPU | %s | caches %s | THP %s" % (
        meta["cpu_model"], os.cpu_count(), meta["cpu_flags"],
        " ".join("%s=%s" % (k, fmt_bytes(v)) for k, v in meta["caches"].items()), meta["thp"]))
    p("load average at start / end: %s / %s (2 cores shared with other work: timings are noisy;"
      " medians and ratios are quoted)" % (meta["load_start"], meta.get("load_end", "?")))
    p("threads: %d everywhere; epsilon %g everywhere; %d round(s): each library's repetitions of a"
      " shape split into rounds that alternate with the other libraries'" % (
          args.threads, bc.EPSILON, args.rounds))
    recheck = meta.get("recheck")
    if recheck:
        p("close calls: the %d cases whose fbn and best-anchor medians were within %.2fx of each"
          " other (either way; %.2fx where they shared no placement of the CPUs) after those"
          " rounds got %d more rounds of fbn and of the anchors within that of it, alternating"
          " alike; their medians are over all rounds" % (
              len(recheck["speedup_before"]), recheck["band"],
              max(recheck["band"], UNMATCHED_BAND), recheck["rounds"]))
    p("versions: " + ", ".join("%s=%s" % kv for kv in sorted(versions.items())))
    pl = meta.get("placement")
    if pl:
        p("placement of the 2 CPUs (placement_probe: cache-line round trip before and after each"
          " library's batch; near < %g ns <= far): %d batches near (median %.0f ns), %d far"
          " (%.0f ns), %d mixed or busy; speedups compare fbn and an anchor within one placement: %d"
          " cases near, %d far, %d with none shared ('all': medians over every round)" % (
              args.placement_split_ns, pl["near"], pl["near_ns"], pl["far"], pl["far_ns"],
              pl["mixed"], sum(1 for r in rows if r.get("placement") == "near"),
              sum(1 for r in rows if r.get("placement") == "far"),
              sum(1 for r in rows if r.get("placement") == "all")))
    if copy:
        p("")
        p("Memory bandwidth (copy_bench, 2 threads, median; copy counts read+write bytes):")
        sizes = sorted({k[1] for k in copy["table"]})
        p("  %-14s" % "size" + "".join("%10s" % ("%dMB" % s) for s in sizes))
        for kind in ("read", "copy_regular", "copy_nt"):
            p("  %-14s" % kind + "".join(
                "%10s" % ("%.1f" % copy["table"][(kind, s, 2)] if (kind, s, 2) in copy["table"]
                          else "-") for s in sizes))
        p("  reference copy BW (best 2-thread copy, src and dst of %d MB each): %.1f GB/s;"
          " NT copy 1 thread %.1f GB/s" % (copy["dram_mb"], copy["ref"] or 0,
                                           copy.get("copy_nt_1t") or 0))
        p("  effective LLC from the read sweep: ~%s MB (sysfs reports L3 %s, shared with the"
          " host's other tenants)" % (copy.get("llc_eff_mb"),
                                      fmt_bytes(meta["caches"].get("L3", 0))))
        rr = copy.get("ref_ratio") or {}
        if rr:
            p("  reference loops (copy_bench ref/, float, %d MB, time over the NT copy's): streaming"
              " stores alone %.1f GB/s; stats then apply, two sweeps %.2f, per %s KB chunk %.2f;"
              " gradient sums then dx, two sweeps %.2f, per chunk %.2f" % (
                  copy["dram_mb"], copy["ref_bw"].get("write_nt", 0),
                  rr.get("fwd_two_sweeps", 0), copy.get("ref_chunk_kb"),
                  rr.get("fwd_chunked", 0), rr.get("grad_two_sweeps", 0),
                  rr.get("grad_chunked", 0)))
    p("DRAM-sized below means T(f32) >= %s (%s); cold runs are skipped for tensors of that size"
      " or more (no cache can hold them between calls, warm is already cold)" % (
          fmt_bytes(meta["dram_bytes"]), meta.get("dram_source", "")))
    p("")
    p("Minimum traffic used for GB/s (performance.md §5.1, T = N*C*H*W*sizeof(dtype), per-channel"
      " vectors ignored): fwd_train 2T, fwd_infer 2T, grad_train 3T, grad_infer 3T.")
    p("Cold = operands (inputs, preallocated outputs, and for TF/PyTorch the previous call's"
      " outputs) clflushed before each timed call; library-internal scratch is not flushed.")

    # Parity.
    p("")
    p("Parity (small shape N,C,H,W=%s, vs a float64 reference; normalized max error; tolerance"
      " 1e-4 f32, 2e-2 bf16):" % (PARITY_SHAPE,))
    if parity:
        bad = [(k, v) for k, v in parity.items() if v[0] != "ok"]
        for dt in bc.DTYPES:
            worst = {}
            for (lib, ps, d, lay), (st, err) in parity.items():
                if st == "ok" and d == dt:
                    worst[lib] = max(worst.get(lib, 0.0), err)
            p("  %-4s worst error of the passing checks: " % dt + ", ".join(
                "%s %.1e" % kv for kv in worst.items()))
        p("  %d of %d (library, pass, dtype, layout) checks pass%s" % (
            len(parity) - len(bad), len(parity), "; the others:" if bad else ""))
        for (lib, ps, dt, lay), (st, err) in sorted(bad):
            p("  %-9s %-10s %-4s %-4s %s" % (lib, ps, dt, lay, st[:150]))
    else:
        p("  skipped")

    # Per-case table.
    p("")
    p("Per case: median us per call (with rounds > 1: the median over the rounds of each round's"
      " median); speedup = best anchor / fbn; GB/s = fbn min traffic / time; %copy = that /"
      " reference copy BW, or, marked *, / the BW of a copy of the same tensor in the same rounds")
    hdr = "%-26s %-10s %-4s %-4s %-4s" % ("case", "pass", "dt", "lay", "cache")
    hdr += "".join("%10s" % lib for lib in libs) + "  %-9s %7s %7s %6s" % (
        "best", "speedup", "GB/s", "%copy")
    p(hdr)
    for r in rows:
        s = "%-26s %-10s %-4s %-4s %-4s" % (r["id"][-26:], r["pass"], r["dtype"], r["layout"],
                                            r["cache"])
        s += "".join("%10s" % fmt_t(r.get(lib)) for lib in libs)
        s += "  %-9s %7s %7s %6s" % (
            r["best_anchor"] or "-", "%.2fx" % r["speedup"] if r["speedup"] else "-",
            "%.1f" % r["fbn_gbps"] if r["fbn_gbps"] else "-",
            "%.0f%%*" % (100 * r["fbn_share_paired"]) if r.get("fbn_share_paired") else
            "%.0f%%" % (100 * r["fbn_share"]) if r["fbn_share"] else "-")
        p(s)

    # Geomeans.
    real = [r for r in rows if r["set"] != "tiny"]
    p("")
    p("Geometric-mean speedup of fbn over the best anchor (network shapes; 'tiny' excluded):")
    p("  %-11s %10s %10s %10s   %s" % ("pass", "warm", "cold", "all", "target >= %.1fx" %
                                         TARGETS["geomean_speedup"]))
    for ps in args.passes:
        vals = {}
        for cache in ("warm", "cold", None):
            v = [r["speedup"] for r in real if r["pass"] == ps and (cache is None or
                                                                     r["cache"] == cache)]
            vals[cache] = (geomean(v), len([x for x in v if x]))
        g = vals[None][0]
        p("  %-11s %10s %10s %10s   %s" % (
            ps, *("%.2fx (%d)" % vals[k] if vals[k][1] else "-" for k in ("warm", "cold", None)),
            "PASS" if g >= TARGETS["geomean_speedup"] else "FAIL"))
    mins = []
    for ps in args.passes:
        v = []
        for r in real:
            if r["pass"] != ps or not (r.get("fbn") or {}).get("min_s"):
                continue
            best = [r[a]["min_s"] for a in libs if a != "fbn" and r.get(a) and
                    r[a].get("status") == "ok" and r[a].get("min_s")]
            if best:
                v.append(min(best) / r["fbn"]["min_s"])
        mins.append("%s %.2fx" % (ps, geomean(v)) if v else "%s -" % ps)
    p("  same on fastest calls (min, robust to preemption on a shared machine): " +
      ", ".join(mins))
    p("  per anchor (all passes, warm+cold): " + ", ".join(
        "%s %.2fx" % (a, geomean([r["vs"][a][0] for r in real if a in r["vs"]]))
        for a in libs if a != "fbn"))

    behind = [r for r in rows if r["speedup"] is not None and r["speedup"] < 1.0]
    p("")
    p("Cases where fbn is not ahead of the best anchor: %d of %d" % (
        len(behind), len([r for r in rows if r["speedup"] is not None])))
    before = (recheck or {}).get("speedup_before", {})
    if before:
        now = {bc.bench_name("fbn", r): r["speedup"] for r in rows if r["speedup"] is not None}
        main_behind = sum(1 for r in rows if r["speedup"] is not None and before.get(
            bc.bench_name("fbn", r), r["speedup"]) < 1.0)
        flips = [(b < 1.0, now[k] < 1.0) for k, b in before.items() if k in now]
        p("  after the main rounds alone: %d; of the %d close calls re-timed, %d went from behind"
          " to ahead and %d from ahead to behind (marked +r below: re-timed)" % (
              main_behind, len(flips), sum(1 for b, a in flips if b and not a),
              sum(1 for b, a in flips if a and not b)))
    if behind:
        p("  (times: medians of the rounds in the placement compared, shown last: near or far,"
          " 'all' where fbn and the anchor shared none)")
    for r in sorted(behind, key=lambda r: r["speedup"]):
        _, st, ft, at = r["vs"][r["best_anchor"]]
        p("  %-26s %-10s %-4s %-4s %-4s fbn %9s us  %-9s %9s us  %.2fx %-4s%s" % (
            r["id"][-26:], r["pass"], r["dtype"], r["layout"], r["cache"], fmt_s(ft),
            r["best_anchor"], fmt_s(at), r["speedup"], st,
            " +r" if bc.bench_name("fbn", r) in before else ""))
    missing = [r for r in rows if r["fbn_s"] is None]
    if missing:
        p("  fbn has no result for %d cases (errors: %s)" % (
            len(missing), "; ".join(sorted({(r["fbn"] or {}).get("error", "?")[:80]
                                            for r in missing}))[:400]))

    # Kernel targets.
    p("")
    p("Kernel targets (fbn only; warm; DRAM-sized = T(f32) >= %s):" % fmt_bytes(meta["dram_bytes"]))
    idx = {(r["id"], r["pass"], r["dtype"], r["layout"], r["cache"]): r for r in rows}
    dram_ids = sorted({r["id"] for r in rows if r["n"] * r["c"] * r["h"] * r["w"] * 4 >=
                       meta["dram_bytes"]})
    targets = []

    def t_of(cid, ps, dt, lay, cache="warm"):
        r = idx.get((cid, ps, dt, lay, cache))
        return r["fbn_s"] if r else None

    if not dram_ids:
        p("  no DRAM-sized shape in this run (use the full mode or --sets r50_mb128,gnv3_mb96)")
    for dt in args.dtypes:
        sel = [idx[(cid, "fwd_infer", dt, lay, "warm")] for cid in dram_ids for lay in args.layouts
               if (cid, "fwd_infer", dt, lay, "warm") in idx]
        paired = [r for r in sel if r.get("fbn_share_paired")]
        shares = [r["fbn_share"] for r in sel if r.get("fbn_share")]
        if paired:
            # Judged against the copy of the same tensor timed in the same rounds; the run's
            # reference copy (measured once, at the start) is printed beside it.
            ps_ = sorted(paired, key=lambda r: r["fbn_share_paired"])
            vals = [r["fbn_share_paired"] for r in ps_]
            ok = vals[0] >= TARGETS["fwd_infer_share"]
            p("  fwd_infer %-4s share of copy BW on DRAM shapes, against a copy of the same tensor"
              " in the same rounds: median %.0f%%, min %.0f%%  (target >= %.0f%%) %s" % (
                  dt, 100 * statistics.median(vals), 100 * vals[0],
                  100 * TARGETS["fwd_infer_share"], "PASS" if ok else "FAIL"))
            p("      lowest: " + ", ".join("%s %s %.0f%% (%.0f / %.0f us)" % (
                r["id"], r["layout"], 100 * r["fbn_share_paired"], r["fbn_s"] * 1e6,
                r["copy_s"] * 1e6) for r in ps_[:3]))
            if shares:
                p("      against the reference copy of the run's start (%.1f GB/s): median %.0f%%,"
                  " min %.0f%%" % (copy["ref"], 100 * statistics.median(shares),
                                   100 * min(shares)))
            targets.append(("fwd_infer_share_" + dt, vals[0], ok))
        elif shares:
            ok = min(shares) >= TARGETS["fwd_infer_share"]
            p("  fwd_infer %-4s share of copy BW on DRAM shapes: median %.0f%%, min %.0f%%"
              "  (target >= %.0f%%) %s" % (dt, 100 * statistics.median(shares),
                                          100 * min(shares), 100 * TARGETS["fwd_infer_share"],
                                          "PASS" if ok else "FAIL"))
            targets.append(("fwd_infer_share_" + dt, min(shares), ok))
    for ps, key in (("fwd_train", "fwd_train_over_infer"), ("grad_train", "grad_train_over_infer")):
        for lay in args.layouts:
            for dt in args.dtypes:
                ratios = []
                for cid in dram_ids:
                    a, b = t_of(cid, ps, dt, lay), t_of(cid, "fwd_infer", dt, lay)
                    if a and b:
                        ratios.append(a / b)
                if ratios:
                    lim = TARGETS[key][lay]
                    ok = max(ratios) <= lim
                    # The reference loop with this pass's traffic pattern: channels-first fuses
                    # per channel (chunked), channels-last streams two sweeps.
                    ref_name = "%s_%s" % ("fwd" if ps == "fwd_train" else "grad",
                                          "chunked" if lay == "nchw" else "two_sweeps")
                    ref = ((copy or {}).get("ref_ratio") or {}).get(ref_name)
                    p("  %s / fwd_infer  %-4s %-4s DRAM shapes: median %.2f, max %.2f  (target"
                      " <= %.2f) %s%s" % (ps, lay, dt, statistics.median(ratios), max(ratios), lim,
                                          "PASS" if ok else "FAIL",
                                          "  [reference loop %s here: %.2f]" % (ref_name, ref)
                                          if ref else ""))
                    targets.append(("%s_over_infer_%s_%s" % (ps, lay, dt), max(ratios), ok))
    for ps in args.passes:
        ratios = []
        for cid in dram_ids:
            for lay in args.layouts:
                a, b = t_of(cid, ps, "bf16", lay), t_of(cid, ps, "f32", lay)
                if a and b:
                    ratios.append(a / b)
        if ratios:
            ok = max(ratios) <= TARGETS["bf16_over_f32"]
            p("  bf16 / f32 time %-10s DRAM shapes: median %.2f, max %.2f  (target <= %.2f) %s" % (
                ps, statistics.median(ratios), max(ratios), TARGETS["bf16_over_f32"],
                "PASS" if ok else "FAIL"))
            targets.append(("bf16_over_f32_" + ps, max(ratios), ok))
    # Fixed per-call overhead on batch-1 shapes: the intercept of time = t0 + bytes / bw fitted
    # over the ResNet-50 mb1 shapes, and the time of the 256-element 'tiny' probe.
    for ps in args.passes:
        for dt in args.dtypes:
            for lay in args.layouts:
                pts = [(r["min_traffic_bytes"], r["fbn_s"]) for r in rows
                       if r["set"] == "r50_mb1" and r["pass"] == ps and r["dtype"] == dt and
                       r["layout"] == lay and r["cache"] == "warm" and r["fbn_s"]]
                tiny = [r["fbn_s"] for r in rows if r["set"] == "tiny" and r["pass"] == ps and
                        r["dtype"] == dt and r["layout"] == lay and r["cache"] == "warm" and
                        r["fbn_s"]]
                icpt = None
                if len(pts) >= 3:
                    xs, ys = np.array([a for a, _ in pts], float), np.array([b for _, b in pts])
                    icpt = float(np.polyfit(xs, ys, 1)[1])
                if icpt is None and not tiny:
                    continue
                est = tiny[0] if tiny else icpt
                ok = est * 1e6 <= TARGETS["overhead_us"]
                p("  overhead %-10s %-4s %-4s batch-1 fit intercept %s us, tiny (256 elem) %s us"
                  "  (target <= %.0f us) %s" % (
                      ps, dt, lay, "%.2f" % (icpt * 1e6) if icpt is not None else "-",
                      "%.2f" % (tiny[0] * 1e6) if tiny else "-", TARGETS["overhead_us"],
                      "PASS" if ok else "FAIL"))
                targets.append(("overhead_%s_%s_%s" % (ps, dt, lay), est * 1e6, ok))
    disp = {k: v for k, v in versions.items() if k.endswith("dispatch_overhead_us")}
    if disp:
        p("  framework dispatch overhead (empty op, reported, not subtracted): " + ", ".join(
            "%s %.1f us" % (k.split(":")[0], v) for k, v in sorted(disp.items())))
    if targets:
        p("  targets met: %d of %d" % (sum(1 for t in targets if t[2]), len(targets)))

    # Per-network totals (occurrence-weighted sum of per-layer medians).
    p("")
    p("ResNet-50 per-step totals (sum over the 53 BN layers of occurrence x median, ms, warm):")
    for s in ("r50_mb1", "r50_mb32", "r50_mb128"):
        for ps in args.passes:
            for dt in args.dtypes:
                for lay in args.layouts:
                    sel = [r for r in rows if r["set"] == s and r["pass"] == ps and
                           r["dtype"] == dt and r["layout"] == lay and r["cache"] == "warm"]
                    if len(sel) < len(bc.RESNET50) or args.quick:
                        continue
                    tot = []
                    for lib in libs:
                        ts = [r[lib]["median_s"] * r["weight"] for r in sel
                              if r.get(lib) and r[lib].get("median_s")]
                        tot.append("%s %.2f" % (lib, 1e3 * sum(ts)) if len(ts) == len(sel)
                                   else "%s -" % lib)
                    p("  %-9s %-10s %-4s %-4s %s" % (s, ps, dt, lay, ", ".join(tot)))
    return lines, targets


def write_csv(rows, libs, out_dir, meta, versions, copy, parity):
    import csv
    path = os.path.join(out_dir, "results.csv")
    with open(path, "w", newline="") as f:
        for k, v in sorted(meta.items()):
            f.write("# %s: %s\n" % (k, v))
        for k, v in sorted(versions.items()):
            f.write("# %s: %s\n" % (k, v))
        if copy:
            f.write("# copy_bw_ref_gbps: %s\n" % copy.get("ref"))
        w = csv.writer(f)
        w.writerow(["set", "case_id", "n", "c", "h", "w", "weight", "pass", "dtype", "layout",
                    "cache", "library", "status", "median_us", "min_us", "cv_pct", "reps",
                    "tensor_bytes", "min_traffic_bytes", "eff_gbps", "share_of_copy_bw",
                    "fbn_speedup_vs_this", "is_best_anchor", "impl", "parity", "load1", "error"])
        for r in rows:
            for lib in libs:
                x = r.get(lib) or {}
                med = x.get("median_s")
                par = parity.get((lib, r["pass"], r["dtype"], r["layout"])) if parity else None
                gbps = r["min_traffic_bytes"] / med / 1e9 if med else None
                w.writerow([
                    r["set"], r["id"], r["n"], r["c"], r["h"], r["w"], r["weight"], r["pass"],
                    r["dtype"], r["layout"], r["cache"], lib, x.get("status", "missing"),
                    "%.3f" % (med * 1e6) if med else "",
                    "%.3f" % (x["min_s"] * 1e6) if x.get("min_s") else "",
                    "%.1f" % (100 * x["cv"]) if x.get("cv") is not None else "",
                    x.get("reps", ""), r["tensor_bytes"], r["min_traffic_bytes"],
                    "%.2f" % gbps if gbps else "",
                    "%.3f" % (gbps / copy["ref"]) if (gbps and copy and copy.get("ref")) else "",
                    "%.3f" % r["vs"][lib][0] if lib in r["vs"] else "",
                    int(lib == r["best_anchor"]), x.get("impl", ""),
                    par[0] if par else "", r.get("load1", ""), x.get("error", "")])
    path2 = os.path.join(out_dir, "cases.csv")
    with open(path2, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["set", "case_id", "weight", "pass", "dtype", "layout", "cache",
                    "tensor_bytes"] + ["%s_us" % lib for lib in libs] +
                   ["best_anchor", "speedup", "fbn_gbps", "fbn_share_of_copy_bw", "copy_us",
                    "fbn_share_of_paired_copy", "speedup_main_rounds", "placement"])
        before = (meta.get("recheck") or {}).get("speedup_before", {})
        for r in rows:
            main = before.get(bc.bench_name("fbn", r))
            w.writerow([r["set"], r["id"], r["weight"], r["pass"], r["dtype"], r["layout"],
                        r["cache"], r["tensor_bytes"]] +
                       ["%.3f" % (r[lib]["median_s"] * 1e6) if r.get(lib) and
                        r[lib].get("median_s") else "" for lib in libs] +
                       [r["best_anchor"] or "", "%.3f" % r["speedup"] if r["speedup"] else "",
                        "%.2f" % r["fbn_gbps"] if r["fbn_gbps"] else "",
                        "%.3f" % r["fbn_share"] if r["fbn_share"] else "",
                        "%.3f" % (r["copy_s"] * 1e6) if r.get("copy_s") else "",
                        "%.3f" % r["fbn_share_paired"] if r.get("fbn_share_paired") else "",
                        "%.3f" % main if main else "", r.get("placement") or ""])
    return path, path2


def plot(rows, args, out_dir, copy):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not installed: no PNG (scripts/bench.sh installs it)")
        return None
    passes = list(args.passes)
    fig, axes = plt.subplots(2, len(passes), figsize=(4.6 * len(passes), 8.5), squeeze=False)
    style = {("f32", "nhwc"): ("tab:blue", "o"), ("f32", "nchw"): ("tab:orange", "s"),
             ("bf16", "nhwc"): ("tab:green", "^"), ("bf16", "nchw"): ("tab:red", "D")}
    for j, ps in enumerate(passes):
        for (dt, lay), (col, mk) in style.items():
            for cache in ("warm", "cold"):
                sel = [r for r in rows if r["pass"] == ps and r["dtype"] == dt and
                       r["layout"] == lay and r["cache"] == cache]
                kw = dict(marker=mk, s=18, alpha=0.8, linewidths=0.8)
                kw.update({"color": col} if cache == "warm" else {"facecolors": "none",
                                                                   "edgecolors": col})
                lab = "%s %s %s" % (dt, lay, cache)
                pts = [(r["tensor_bytes"], r["speedup"]) for r in sel if r["speedup"]]
                if pts:
                    axes[0][j].scatter(*zip(*pts), label=lab, **kw)
                pts = [(r["tensor_bytes"], 100 * r["fbn_share"]) for r in sel if r["fbn_share"]]
                if pts:
                    axes[1][j].scatter(*zip(*pts), label=lab, **kw)
        ax = axes[0][j]
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(TARGETS["geomean_speedup"], color="k", lw=0.8, ls="--")
        ax.set_title("%s: fbn speedup over best anchor" % ps, fontsize=9)
        ax.set_xlabel("tensor bytes")
        ax = axes[1][j]
        ax.set_xscale("log")
        ax.axhline(100, color="k", lw=0.8)
        if ps == "fwd_infer":
            ax.axhline(100 * TARGETS["fwd_infer_share"], color="k", lw=0.8, ls="--")
        ax.set_title("%s: fbn min-traffic GB/s as %% of copy BW" % ps, fontsize=9)
        ax.set_xlabel("tensor bytes")
    axes[0][0].legend(fontsize=6, loc="best")
    fig.suptitle("fbn vs oneDNN / TF (oneDNN, Eigen) / PyTorch, %d threads; copy BW %.1f GB/s" % (
        args.threads, (copy or {}).get("ref") or 0), fontsize=10)
    fig.tight_layout()
    path = os.path.join(out_dir, "bench.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def finish(args, meta, runner, libs, all_cases, results, copy, parity_cfg, refs, unavailable,
           out_dir, final):
    """Writes results.csv, cases.csv, summary.txt, meta.json and bench.png; prints the summary
    when final (partial reports are written after every chunk, marked as such)."""
    meta = dict(meta)
    meta["status"] = "complete" if final else "PARTIAL (run in progress or interrupted)"
    parity = check_parity(parity_cfg["dir"], refs, libs, runner) if parity_cfg else {}
    meta["load_end"] = " ".join(read_first("/proc/loadavg").split()[:3])
    meta["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    versions = dict(runner.versions)
    versions["fbn_git_at_run"] = meta["fbn_git_at_run"]
    versions["fbn_bench_built"] = meta["fbn_bench_built"]
    pl = runner.placements
    if pl:
        ns_of = lambda st: [x for b in pl if b[4] == st for x in b[2:4]]  # noqa: E731
        meta["placement"] = {
            "near": sum(1 for b in pl if b[4] == "near"),
            "far": sum(1 for b in pl if b[4] == "far"),
            "mixed": sum(1 for b in pl if b[4] in ("mixed", "busy")),
            "near_ns": statistics.median(ns_of("near")) if ns_of("near") else 0,
            "far_ns": statistics.median(ns_of("far")) if ns_of("far") else 0,
        }
        with open(os.path.join(out_dir, "placement.csv"), "w") as f:
            f.write("library,tag,round_trip_ns_before,round_trip_ns_after,state\n")
            for b in pl:
                f.write("%s,%s,%s,%s,%s\n" % b)

    if final:
        log("[4/4] report")
    rows = analyse(all_cases, results, copy, args, libs, parity)
    lines, targets = report(rows, copy, args, libs, parity, versions, meta, out_dir)
    csv_path, cases_path = write_csv(rows, libs, out_dir, meta, versions, copy, parity)
    png = plot(rows, args, out_dir, copy)
    with open(os.path.join(out_dir, "summary.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    meta_out = dict(meta)
    meta_out.update({
        "versions": versions, "libs": libs, "unavailable": unavailable,
        "copy": {k: v for k, v in (copy or {}).items() if k != "table"},
        "copy_table": {"%s/%dMB/t%d" % k: v for k, v in (copy or {}).get("table", {}).items()},
        "targets": [{"name": n, "value": v, "met": ok} for n, v, ok in targets],
        "args": vars(args),
    })
    bc.write_json(os.path.join(out_dir, "meta.json"), meta_out)
    if not final:
        return
    for line in lines:
        print(line)
    log("")
    log("outputs: %s, %s, %s, %s%s" % (
        csv_path, cases_path, os.path.join(out_dir, "summary.txt"),
        os.path.join(out_dir, "meta.json"), ", " + png if png else ""))


# ---------------------------------------------------------------------------------------------


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    csv_list = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--quick", action="store_true", help="a handful of shapes, few reps (< 3 min)")
    ap.add_argument("--libs", type=csv_list, default=list(ALL_LIBS))
    ap.add_argument("--passes", type=csv_list, default=list(bc.PASSES))
    ap.add_argument("--dtypes", type=csv_list, default=list(bc.DTYPES))
    ap.add_argument("--layouts", type=csv_list, default=list(bc.LAYOUTS))
    ap.add_argument("--sets", type=csv_list, default=list(bc.SHAPE_SETS),
                    help="shape sets: " + ",".join(bc.SHAPE_SETS))
    ap.add_argument("--cache", type=csv_list, default=["warm", "cold"])
    ap.add_argument("--shape", default="", help="regex on case ids, e.g. 'c256h56'")
    ap.add_argument("--reps", type=int, default=0, help="override repetitions")
    ap.add_argument("--min-time", type=float, default=None, help="override seconds per rep")
    ap.add_argument("--rounds", type=int, default=0,
                    help="rounds each library's repetitions are split into, alternating with the"
                         " other libraries' (default: 1 with --quick, else 3)")
    ap.add_argument("--recheck-rounds", type=int, default=-1,
                    help="extra alternating rounds for the close calls (see recheck_close_calls;"
                         " default: 0 with --quick, else 4)")
    ap.add_argument("--recheck-band", type=float, default=1.15,
                    help="a case is a close call when fbn and its best anchor are within this"
                         " factor of each other after the main rounds")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--build-dir", default=os.path.join(ROOT, "build-bench"))
    ap.add_argument("--out", default="", help="output dir (default bench/results/<stamp>-<mode>)")
    ap.add_argument("--tf-python", default=sys.executable)
    ap.add_argument("--torch-python", default="/usr/bin/python3")
    ap.add_argument("--torch-capability", default="",
                    help="ATEN_CPU_CAPABILITY for PyTorch (e.g. avx512); default: its own choice")
    ap.add_argument("--dram-bytes", type=float, default=0,
                    help="T(f32) above which a shape counts as DRAM-sized (default: sysfs L3)")
    ap.add_argument("--no-parity", action="store_true")
    ap.add_argument("--no-copy", action="store_true")
    ap.add_argument("--no-placement", action="store_true",
                    help="do not probe where the host put the CPUs (placement_probe); every"
                         " comparison then uses the medians over all rounds")
    ap.add_argument("--placement-split-ns", type=float, default=250.0,
                    help="CPU-pair cache-line round trips below this count as 'near' (one L3),"
                         " above as 'far'")
    ap.add_argument("--timeout", type=int, default=0, help="seconds per library process")
    args = ap.parse_args(argv)
    for name, allowed in (("libs", ALL_LIBS), ("passes", bc.PASSES), ("dtypes", bc.DTYPES),
                          ("layouts", bc.LAYOUTS), ("sets", bc.SHAPE_SETS),
                          ("cache", ("warm", "cold"))):
        bad = [x for x in getattr(args, name) if x not in allowed]
        if bad:
            ap.error("--%s: unknown %s (choose from %s)" % (name, bad, ",".join(allowed)))
    if not args.timeout:
        args.timeout = 600 if args.quick else 3600
    if args.rounds <= 0:
        args.rounds = 1 if args.quick else 3
    if args.recheck_rounds < 0:
        args.recheck_rounds = 0 if args.quick else 4
    if args.recheck_band < 1.0:
        ap.error("--recheck-band: a factor of at least 1 (got %g)" % args.recheck_band)
    return args


def main(argv=None):
    args = parse_args(argv if argv is not None else sys.argv[1:])
    started = datetime.datetime.now()
    out_dir = args.out or os.path.join(HERE, "results", "%s-%s" % (
        started.strftime("%Y%m%d-%H%M%S"), "quick" if args.quick else "full"))
    for sub in ("", "raw", "logs", "parity"):
        os.makedirs(os.path.join(out_dir, sub), exist_ok=True)
    caches = sysfs_caches()
    meta = {
        "started": started.isoformat(timespec="seconds"), "mode": "quick" if args.quick else "full",
        "cpu_model": cpu_model(), "cpu_flags": cpu_flags(), "caches": caches,
        "thp": read_first("/sys/kernel/mm/transparent_hugepage/enabled"),
        "kernel": platform.release(), "fbn_git_at_run": git_rev(),
        # What was measured is the fbn that build-bench holds, which may predate the tree.
        "fbn_bench_built": built_time(os.path.join(args.build_dir, "bench", "fbn_bench")),
        "load_start": " ".join(read_first("/proc/loadavg").split()[:3]),
        "dram_bytes": int(args.dram_bytes or caches.get("L3", 32 << 20)),
        "rounds": args.rounds,
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
    }
    log("fbn side-by-side benchmark -> %s" % out_dir)
    latest = os.path.join(HERE, "results", "latest")
    if os.path.dirname(os.path.abspath(out_dir)) == os.path.dirname(latest):
        try:
            if os.path.islink(latest):
                os.remove(latest)
            os.symlink(os.path.basename(os.path.abspath(out_dir)), latest)
        except OSError:
            pass
    runner = Runner(args, out_dir)
    unavailable = runner.check_available(args.libs)
    for lib, why in unavailable.items():
        log("  skipping %s: %s" % (lib, why))
    libs = [lib for lib in args.libs if lib not in unavailable]
    if "fbn" not in libs:
        log("fbn_bench is required (build build-bench first: scripts/bench.sh)")
        return 2

    copy = None
    if not args.no_copy:
        log("[1/4] copy bandwidth (copy_bench)")
        copy = run_copy(args, out_dir)
        if copy and copy.get("ref"):
            log("  reference copy BW %.1f GB/s (NT %.1f, regular %.1f, read %.1f); effective LLC"
                " ~%s MB" % (copy["ref"], copy["copy_nt"] or 0, copy["copy_regular"] or 0,
                             copy["read"] or 0, copy["llc_eff_mb"]))

    if not args.dram_bytes:
        if copy and copy.get("dram_from_mb"):
            meta["dram_bytes"] = copy["dram_from_mb"] << 20
            meta["dram_source"] = "measured (read sweep)"
        else:
            meta["dram_source"] = "sysfs L3"
    else:
        meta["dram_source"] = "--dram-bytes"
    args.cold_max_bytes = meta["dram_bytes"]
    cases_by_set = build_cases(args)
    all_cases = [c for rows in cases_by_set.values() for c in rows]
    log("[2/4] parity + [3/4] timing: %d cases x %d libraries (%s)" % (
        len(all_cases), len(libs), ",".join(libs)))
    parity_cfg = None
    refs = None
    if not args.no_parity:
        pdir = os.path.join(out_dir, "parity")
        refs = make_parity_inputs(pdir)
        parity_cfg = {"dir": pdir, "shape": list(PARITY_SHAPE)}

    results = {}
    if parity_cfg:
        for lib in libs:
            _, rc, secs = runner.run(lib, [], "parity", parity_cfg)
            log("  parity %-9s %5.1f s%s" % (lib, secs, "" if rc == 0 else "  rc=%s" % rc))
    # One chunk per shape; every library runs a chunk before the next chunk starts, the starting
    # library rotating, so that drifting machine load spreads over all libraries alike.
    chunks = []
    for rows in cases_by_set.values():
        by_id = {}
        for c in rows:
            by_id.setdefault(c["id"], []).append(c)
        chunks.extend(by_id.values())
    t_start = time.time()
    round_recs = {}  # every round's record per bench name (alternate_rounds)
    for i, chunk in enumerate(chunks):
        load1 = read_first("/proc/loadavg").split()[0]
        for c in chunk:
            c["load1"] = load1
        # Each library's repetitions are split into rounds that alternate with the other
        # libraries' (the starting library rotating per round), so that a slow stretch of the host
        # lands in one round of a library rather than in all of its repetitions; per case, the
        # median over the rounds is kept (merge_rounds).
        per_round = [dict(c, reps=round_reps(c["reps"], args.rounds)) for c in chunk]
        # The DRAM-sized warm forward inferences are also held against a copy of the same tensor,
        # timed in the same rounds (copy_bench --cases): a pseudo-library in the rotation.
        copy_cases = [c for c in per_round if paired_copy_case(c, args)]
        timed = libs + (["copy"] if copy_cases else [])
        secs_of = alternate_rounds(
            runner, timed, lambda lib: copy_cases if lib == "copy" else per_round, i, args.rounds,
            lambda r: chunk[0]["id"] + ("_r%d" % r if args.rounds > 1 else ""), round_recs,
            results)
        took = ["%s %.1fs%s" % (lib, t, "" if rc == 0 else "(rc=%s)" % rc)
                for lib, (t, rc) in secs_of.items()]
        log("  [%d/%d] %-26s load %s: %s  (%.0f s so far)" % (
            i + 1, len(chunks), chunk[0]["id"], load1, " ".join(took), time.time() - t_start))
        if i + 1 < len(chunks):  # keep a readable partial report on disk while the run goes on
            done = [c for ch in chunks[:i + 1] for c in ch]
            finish(args, meta, runner, libs, done, results, copy, parity_cfg, refs, unavailable,
                   out_dir, final=False)
    if args.recheck_rounds > 0 and "fbn" in libs:
        log("[3/4] close calls: %d more rounds where fbn and its best anchor are within %.2fx" % (
            args.recheck_rounds, args.recheck_band))
        meta["recheck"] = {"rounds": args.recheck_rounds, "band": args.recheck_band,
                           "speedup_before": recheck_close_calls(args, runner, libs, chunks,
                                                                 results, round_recs)}
    runner.close()

    finish(args, meta, runner, libs, all_cases, results, copy, parity_cfg, refs, unavailable,
           out_dir, final=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
