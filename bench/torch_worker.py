"""PyTorch side of the side-by-side benchmark (run by run_bench.py under Debian's /usr/bin/python3,
which has python3-torch; never in a process that imports TensorFlow).

    forward : torch.nn.functional.batch_norm(x, running_mean, running_var, weight, bias,
                                              training, momentum=0.1, eps)
    gradient: torch.ops.aten.native_batch_norm_backward, the op autograd runs for F.batch_norm
              (train: saved mean/invstd of a training forward; eval: running statistics)

NCHW cases use contiguous tensors, NHWC cases channels_last ones; bf16 activations with float32
weight, bias and statistics (mixed dtype, as fbn and oneDNN take them). torch.set_num_threads(2).
This PyTorch (1.13) has no CPU out= variant of native_batch_norm, so outputs are allocated per
call, as for any PyTorch user.

    python3 torch_worker.py CONFIG.json   then one JSON request per stdin line
"""

import os
import sys
import traceback

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402

TDT = {"f32": torch.float32, "bf16": torch.bfloat16}


def to_layout(flat, n, c, h, w, layout):
    """A logical NCHW tensor over `flat`, contiguous (nchw) or channels_last (nhwc)."""
    if layout == "nchw":
        return flat.view(n, c, h, w)
    return flat.view(n, h, w, c).permute(0, 3, 1, 2)


class Inputs:
    def __init__(self):
        self.key = None

    def get(self, case):
        key = (case["n"], case["c"], case["h"], case["w"], case["dtype"])
        if key != self.key:
            self.key = None
            self.flat_x = self.flat_dy = None
            n = case["n"] * case["c"] * case["h"] * case["w"]
            c = case["c"]
            g = torch.Generator().manual_seed(1)
            self.flat_x = torch.empty(n).uniform_(-2.0, 3.0, generator=g).to(TDT[case["dtype"]])
            self.flat_dy = torch.empty(n).uniform_(-1.0, 1.0, generator=g).to(TDT[case["dtype"]])
            self.weight = torch.empty(c).uniform_(0.5, 1.5, generator=g)
            self.bias = torch.empty(c).uniform_(-0.5, 0.5, generator=g)
            self.rmean = torch.empty(c).uniform_(0.0, 1.0, generator=g)
            self.rvar = torch.empty(c).uniform_(1.0, 3.0, generator=g)
            self.key = key
        dims = (case["n"], case["c"], case["h"], case["w"], case["layout"])
        return to_layout(self.flat_x, *dims), to_layout(self.flat_dy, *dims)


def build_call(case, x, dy, w, b, rm, rv, saved=None):
    p = case["pass"]
    if p == "fwd_train":
        return lambda: (F.batch_norm(x, rm, rv, w, b, True, 0.1, bc.EPSILON),)
    if p == "fwd_infer":
        return lambda: (F.batch_norm(x, rm, rv, w, b, False, 0.1, bc.EPSILON),)
    mask = [True, True, True]
    if p == "grad_train":
        if saved is None:
            _, sm, si = torch.ops.aten.native_batch_norm(x, w, b, rm.clone(), rv.clone(), True,
                                                         0.1, bc.EPSILON)
        else:
            sm, si = saved
        return lambda: torch.ops.aten.native_batch_norm_backward(dy, x, w, rm, rv, sm, si, True,
                                                                 bc.EPSILON, mask)
    return lambda: torch.ops.aten.native_batch_norm_backward(dy, x, w, rm, rv, None, None, False,
                                                             bc.EPSILON, mask)


def run_parity(job, result):
    d = job["parity"]["dir"]
    n, c, h, w = job["parity"]["shape"]
    lib = job["lib"]
    rd = lambda name: torch.from_numpy(np.fromfile(os.path.join(d, name), dtype=np.float32))
    scale, offset, mean, var = rd("scale.bin"), rd("offset.bin"), rd("mean.bin"), rd("var.bin")
    smean, svar = rd("smean.bin"), rd("svar.bin")
    for dtype in bc.DTYPES:
        for layout in bc.LAYOUTS:
            def load(what):
                path = bc.parity_in(d, dtype, layout, what)
                if dtype == "f32":
                    flat = torch.from_numpy(np.fromfile(path, dtype=np.float32))
                else:
                    flat = torch.from_numpy(np.fromfile(path, dtype=np.int16)).view(torch.bfloat16)
                return to_layout(flat, n, c, h, w, layout)

            x, dy = load("x"), load("dy")
            for p in bc.PASSES:
                key = "%s_%s_%s" % (p, dtype, layout)
                try:
                    if p == "fwd_train":
                        y, sm, si = torch.ops.aten.native_batch_norm(
                            x, scale, offset, mean.clone(), var.clone(), True, 0.1, bc.EPSILON)
                        outs = {"y": y, "mean": sm, "var": 1.0 / (si.double() ** 2) - bc.EPSILON}
                    elif p == "fwd_infer":
                        outs = {"y": build_call({"pass": p}, x, dy, scale, offset, mean.clone(),
                                                var.clone())()[0]}
                    else:
                        saved = (smean, 1.0 / torch.sqrt(svar + bc.EPSILON))
                        dx, dw, db = build_call({"pass": p}, x, dy, scale, offset, mean, var,
                                                saved)()
                        outs = {"dx": dx, "dscale": dw, "doffset": db}
                    for what, t in outs.items():
                        if t.dim() == 4:  # back to the layout's memory order
                            t = t.permute(0, 2, 3, 1) if layout == "nhwc" else t
                        t.float().contiguous().numpy().astype(np.float32).tofile(
                            bc.parity_out(d, lib, p, dtype, layout, what))
                    result["parity"][key] = "ok"
                except Exception as e:  # noqa: BLE001
                    result["parity"][key] = "error: " + str(e).splitlines()[0][:300]


class Worker:
    def __init__(self, job):
        self.job = job
        torch.set_num_threads(job["threads"])
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:
            pass
        self.flusher = bc.Flusher(job["flush_lib"]) if job.get("flush_lib") else None
        cap = [line.split(":", 1)[1].strip() for line in torch.__config__.show().splitlines()
               if "CPU capability" in line]
        self.versions = {
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "torch_cpu_capability": cap[0] if cap else "",
        }
        one = torch.ones(1)
        self.versions["dispatch_overhead_us"] = 1e6 * sorted(
            bc.time_callable(lambda: one + 1.0, 5, 0.02)[0])[2]

    def handle(self, req):
        result = {"lib": self.job["lib"], "versions": self.versions, "results": [], "parity": {}}
        if req.get("parity"):
            self.job["parity"] = req["parity"]
            run_parity(self.job, result)
        inputs = Inputs()
        flusher = self.flusher
        with torch.no_grad():
            for case in req.get("cases", []):
                rec = {"name": bc.bench_name(self.job["lib"], case), "status": "ok"}
                try:
                    x, dy = inputs.get(case)
                    call = build_call(case, x, dy, inputs.weight, inputs.bias, inputs.rmean,
                                      inputs.rvar)
                    operands = [x, dy] if case["pass"].startswith("grad") else [x]

                    def flush(outs, operands=operands):
                        for t in operands + [inputs.weight, inputs.bias, inputs.rmean,
                                             inputs.rvar]:
                            flusher.flush(t.data_ptr(), t.numel() * t.element_size())
                        for t in outs or ():
                            if t is not None and t.numel():
                                flusher.flush(t.data_ptr(), t.numel() * t.element_size())

                    rec["samples"], rec["min"] = bc.time_callable(
                        call, case["reps"], case["min_time"], cold=case["cache"] == "cold",
                        flush=flush if flusher else None)
                except Exception as e:  # noqa: BLE001
                    rec["status"] = "error"
                    rec["error"] = str(e).splitlines()[0][:300]
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
