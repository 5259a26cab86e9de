"""fbn's batch-norm ops at work: a training step and inference on a random batch, checked against
a float64 NumPy reference, in every layout and element type, and TensorFlow's error texts."""
import time

import ml_dtypes
import numpy as np

import fbn


def reference_training(x, scale, offset, eps, channels_last):
    axes = tuple(i for i in range(x.ndim) if i != (x.ndim - 1 if channels_last else 1))
    shape = [1] * x.ndim
    shape[x.ndim - 1 if channels_last else 1] = -1
    x64 = x.astype(np.float64)
    mean, var = x64.mean(axis=axes), x64.var(axis=axes)
    y = (x64 - mean.reshape(shape)) / np.sqrt(var.reshape(shape) + eps) * scale.reshape(shape) \
        + offset.reshape(shape)
    n = x.size // x.shape[x.ndim - 1 if channels_last else 1]
    return y, mean, var * n / max(n - 1, 1)


def main():
    rng = np.random.default_rng(0)
    fbn.set_num_threads(2)
    print(f"fbn {fbn.__version__}, {fbn.get_num_threads()} threads\n")
    print(f"{'layout':7} {'dtype':9} {'shape':18} {'max|y-ref|':>11} {'mean err':>9} {'var err':>9} {'ms':>7}")
    for fmt, shape in [("NHWC", (32, 28, 28, 64)), ("NCHW", (32, 64, 28, 28)),
                       ("NDHWC", (4, 8, 14, 14, 32)), ("NCDHW", (4, 32, 8, 14, 14))]:
        channels_last = fmt.endswith("C")
        c = shape[-1] if channels_last else shape[1]
        x32 = rng.normal(5.0, 2.0, size=shape).astype(np.float32)
        scale = rng.uniform(0.5, 1.5, c).astype(np.float32)
        offset = rng.normal(size=c).astype(np.float32)
        ref_y, ref_mean, ref_var = reference_training(x32, scale, offset, 1e-3, channels_last)
        for dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
            x = x32.astype(dtype)
            t0 = time.perf_counter()
            y, mean, var = fbn.nn.fused_batch_norm(x, scale, offset, epsilon=1e-3, data_format=fmt)
            ms = (time.perf_counter() - t0) * 1e3
            print(f"{fmt:7} {np.dtype(dtype).name:9} {str(shape):18} "
                  f"{np.abs(y.astype(np.float64) - ref_y).max():11.2e} "
                  f"{np.abs(mean - ref_mean).max():9.1e} {np.abs(var - ref_var).max():9.1e} {ms:7.2f}")

    x = rng.normal(size=(16, 7, 7, 8)).astype(np.float32)
    scale, offset = np.ones(8, np.float32), np.zeros(8, np.float32)
    y, mean, var = fbn.nn.fused_batch_norm(x, scale, offset)
    dx, dscale, doffset, _, _ = fbn.raw_ops.FusedBatchNormGradV3(
        y_backprop=y, x=x, scale=scale, reserve_space_1=x.mean(axis=(0, 1, 2)),
        reserve_space_2=x.var(axis=(0, 1, 2)), reserve_space_3=np.zeros(0, np.float32),
        epsilon=1e-3)
    print(f"\ngradient of 0.5*|y|^2: |dx| = {np.linalg.norm(dx):.3e} (≈ 0: y is orthogonal to "
          f"what the normalization can change), d scale = {dscale[:3]}")
    y_inf, _, _ = fbn.nn.fused_batch_norm(x, scale, offset, mean=mean, variance=var,
                                          is_training=False)
    print(f"inference with the running statistics: mean(y) = {y_inf.mean():.4f}")

    print("\nTensorFlow's error texts:")
    for kwargs in [dict(x=x[0]), dict(scale=np.ones(3, np.float32)),
                   dict(is_training=False, mean=np.zeros(0, np.float32))]:
        args = dict(x=x, scale=scale, offset=offset, mean=mean, variance=var)
        args.update(kwargs)
        try:
            fbn.raw_ops.FusedBatchNormV3(**args)
        except fbn.errors.InvalidArgumentError as e:
            print("  InvalidArgumentError:", e)


if __name__ == "__main__":
    main()
