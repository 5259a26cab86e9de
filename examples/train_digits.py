"""Trains a small network with fbn's batch normalization on scikit-learn's handwritten digits, then
infers with the moving statistics.

    64 pixels -> dense 256 -> batch norm -> ReLU -> dense 128 -> batch norm -> ReLU -> dense 10

The dense layers, softmax cross-entropy and their gradients are NumPy; batch norm's forward pass,
backward pass and moving statistics are fbn's layer (``fbn.layers.BatchNormalization``), whose
gamma and beta fbn's optimizer (``fbn.train.SGD``, which applies the layer's constraints: here
gamma >= 0) updates. The same network is also trained without batch norm, with batch
renormalization and with ghost batches, and each is evaluated on the held-out digits in inference
mode (``training=False``: the moving statistics).

Training: standardized pixels, He initialization, SGD with momentum 0.9 and a cosine learning-rate
decay, batches of 32, training images shifted by up to one pixel (augmentation), fixed seeds.

    python examples/train_digits.py [--epochs 25] [--seed 0] [--plot build/train_digits.png]
                                    [--export-csv build/digits.csv] [--only-bn]

Exits with status 1 when the batch-norm network's test accuracy is below --min-accuracy (97%).
"""
import argparse
import os
import sys
import time

# The matrices are small (32 x 256): BLAS threads would only contend with each other.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

import fbn  # noqa: E402

CLASSES = 10
HIDDEN = (256, 128)


# ----------------------------------------------------------------------------- data

def load_data(split_seed):
    """Digits as float32 pixels (0..16) and int labels, split 80/20 (stratified) into train and
    test; the split depends on split_seed only."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    digits = load_digits()
    x = digits.data.astype(np.float32)
    y = digits.target.astype(np.int64)
    return train_test_split(x, y, test_size=0.2, stratify=y, random_state=split_seed)


def export_csv(path, x_train, y_train, x_test, y_test):
    """The split as CSV for examples/train_digits.cc: a header, then one row per image:
    split (train/test), label, 64 raw pixel values (0..16)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("split,label," + ",".join(f"pixel{i}" for i in range(x_train.shape[1])) + "\n")
        for name, xs, ys in (("train", x_train, y_train), ("test", x_test, y_test)):
            for row, label in zip(xs, ys):
                f.write(f"{name},{label}," + ",".join(str(int(v)) for v in row) + "\n")
    os.replace(tmp, path)


def shift_images(x, rng, max_shift=1):
    """Each 8x8 image moved by a random whole number of pixels in -max_shift..max_shift along
    each axis, with background (0) filling in: the training-time augmentation."""
    n, side = len(x), 8
    pad = np.pad(x.reshape(n, side, side), ((0, 0), (max_shift,) * 2, (max_shift,) * 2))
    oy, ox = rng.integers(0, 2 * max_shift + 1, size=(2, n))
    rows = (oy[:, None] + np.arange(side))[:, :, None]
    cols = (ox[:, None] + np.arange(side))[:, None, :]
    return pad[np.arange(n)[:, None, None], rows, cols].reshape(n, side * side)


def pixel_statistics(x_train, max_shift):
    """Per-pixel mean and standard deviation over the training images in every shifted position
    (standard deviations below one grey level are raised to one)."""
    side = 8
    pad = np.pad(x_train.reshape(-1, side, side), ((0, 0), (max_shift,) * 2, (max_shift,) * 2))
    views = [pad[:, i:i + side, j:j + side].reshape(len(x_train), -1)
             for i in range(2 * max_shift + 1) for j in range(2 * max_shift + 1)]
    all_x = np.concatenate(views)
    return all_x.mean(axis=0), np.maximum(all_x.std(axis=0), 1.0)


# ----------------------------------------------------------------------------- progress

class Progress:
    """A one-line progress bar. On a terminal it redraws in place; otherwise (CI logs, pipes) it
    prints only finished lines, so a log holds one line per finished bar."""

    def __init__(self, total, prefix, width=24, stream=None):
        stream = sys.stdout if stream is None else stream
        self.total, self.prefix, self.width, self.stream = total, prefix, width, stream
        self.tty = stream.isatty()

    def _line(self, done, suffix):
        filled = int(self.width * done / max(self.total, 1))
        bar = "#" * filled + "-" * (self.width - filled)
        return f"{self.prefix} [{bar}] {suffix}"

    def update(self, done, suffix=""):
        if self.tty:
            self.stream.write("\r\033[K" + self._line(done, suffix))
            self.stream.flush()

    def finish(self, suffix=""):
        line = self._line(self.total, suffix)
        self.stream.write(("\r\033[K" if self.tty else "") + line + "\n")
        self.stream.flush()


# ----------------------------------------------------------------------------- the network

class Dense:
    """y = x @ w (+ b), He-initialized (truncated normal, as Keras's he_normal), with an SGD
    momentum update written as tf.keras.optimizers.SGD's (velocity = m * velocity - lr * g)."""

    def __init__(self, fan_in, fan_out, use_bias, rng):
        stddev = np.sqrt(2.0 / fan_in) / 0.87962566103423978  # Keras's truncation correction
        w = rng.standard_normal((fan_in, fan_out))
        while np.any(bad := np.abs(w) > 2):
            w[bad] = rng.standard_normal(np.count_nonzero(bad))
        self.params = [(w * stddev).astype(np.float32)]
        if use_bias:
            self.params.append(np.zeros(fan_out, np.float32))
        self.velocity = [np.zeros_like(p) for p in self.params]

    def __call__(self, x):
        self.x = x
        y = x @ self.params[0]
        return y + self.params[1] if len(self.params) == 2 else y

    def backward(self, dy):
        self.grads = [self.x.T @ dy] + ([dy.sum(axis=0)] if len(self.params) == 2 else [])
        return dy @ self.params[0].T

    def step(self, lr, momentum):
        for p, v, g in zip(self.params, self.velocity, self.grads):
            v *= momentum
            v -= lr * g
            p += v


class Network:
    """Dense -> [batch norm] -> ReLU blocks, then a dense softmax classifier. `bn_args` None means
    no batch norm (the dense layers then have biases); otherwise the keyword arguments of each
    fbn.layers.BatchNormalization."""

    def __init__(self, bn_args, seed, lr, momentum):
        rng = np.random.default_rng(seed)
        sizes = (64,) + HIDDEN
        self.dense = [Dense(a, b, bn_args is None, rng) for a, b in zip(sizes, sizes[1:])]
        self.out = Dense(sizes[-1], CLASSES, True, rng)
        # The dense bias before a batch norm would be cancelled by its mean: beta replaces it.
        self.bn = [] if bn_args is None else [fbn.layers.BatchNormalization(**bn_args)
                                              for _ in HIDDEN]
        self.relu_mask = [None] * len(self.dense)
        self.lr, self.momentum = lr, momentum
        # fbn's optimizer for the layers' variables: the same update as Dense.step, then each
        # variable's constraint (here gamma >= 0).
        self.optimizer = fbn.train.SGD(learning_rate=lr, momentum=momentum)

    def forward(self, x, training):
        for i, dense in enumerate(self.dense):
            x = dense(x)
            if self.bn:
                # training=True: normalize with the batch's statistics and update the moving
                # mean and variance; training=False: normalize with the moving statistics.
                x = self.bn[i](x, training=training)
            self.relu_mask[i] = x > 0
            x = np.where(self.relu_mask[i], x, np.float32(0))
        return self.out(x)

    def backward(self, dlogits, lr):
        """Backpropagates and updates every parameter with learning rate `lr`."""
        dx = self.out.backward(dlogits)
        grads_and_vars = []
        for i in reversed(range(len(self.dense))):
            dx = np.where(self.relu_mask[i], dx, np.float32(0))
            if self.bn:
                dx, grads = self.bn[i].backward(dx)  # d/dx, [d/dgamma, d/dbeta]
                grads_and_vars += zip(grads, self.bn[i].trainable_variables)
            dx = self.dense[i].backward(dx)
        for layer in self.dense + [self.out]:
            layer.step(lr, self.momentum)
        if grads_and_vars:
            # fbn.train.SGD's learning rate is fixed at construction; scaling the gradients by
            # lr / lr0 makes its update exactly Keras's with learning rate lr.
            scale = np.float32(lr / self.lr)
            self.optimizer.apply_gradients([(g * scale, v) for g, v in grads_and_vars])

    def predict(self, x):
        return np.argmax(self.forward(x, training=False), axis=1)


def softmax_cross_entropy(logits, labels):
    """Mean loss and its gradient with respect to the logits."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    n = len(labels)
    loss = -np.mean(np.log(p[np.arange(n), labels] + 1e-12))
    p[np.arange(n), labels] -= 1
    return float(loss), (p / n).astype(np.float32)


def train(name, bn_args, data, args, verbose):
    """Trains one network; returns its per-epoch history, final test accuracy and train time."""
    x_train, y_train, x_test, y_test = data
    # Standardized pixels: each pixel's mean and standard deviation over the training set.
    mean, std = pixel_statistics(x_train, args.max_shift)
    x_test = ((x_test - mean) / std).astype(np.float32)
    net = Network(bn_args, args.seed, args.lr, args.momentum)
    shuffle = np.random.default_rng(args.seed + 1)
    steps = len(x_train) // args.batch_size  # the last partial batch is dropped
    history = {"loss": [], "train_acc": [], "test_acc": []}
    bar = None
    seconds = 0.0
    for epoch in range(1, args.epochs + 1):
        if verbose:
            bar = Progress(steps, f"  epoch {epoch:2d}/{args.epochs}")
        elif bar is None:
            bar = Progress(args.epochs, f"  {name:<26}")
        start = time.perf_counter()
        order = shuffle.permutation(len(x_train))
        loss_sum, correct = 0.0, 0
        for step in range(steps):
            idx = order[step * args.batch_size:(step + 1) * args.batch_size]
            x = shift_images(x_train[idx], shuffle, args.max_shift) if args.max_shift else \
                x_train[idx]
            x = ((x - mean) / std).astype(np.float32)
            logits = net.forward(x, training=True)
            loss, dlogits = softmax_cross_entropy(logits, y_train[idx])
            t = ((epoch - 1) * steps + step) / (args.epochs * steps)
            net.backward(dlogits, args.lr * 0.5 * (1 + np.cos(np.pi * t)))  # cosine decay
            loss_sum += loss
            correct += int(np.sum(np.argmax(logits, axis=1) == y_train[idx]))
            if verbose and (step % 4 == 3 or step == steps - 1):
                bar.update(step + 1, f"loss {loss_sum / (step + 1):.4f}  "
                                     f"acc {correct / ((step + 1) * args.batch_size):6.2%}")
        seconds += time.perf_counter() - start
        test_acc = float(np.mean(net.predict(x_test) == y_test))
        history["loss"].append(loss_sum / steps)
        history["train_acc"].append(correct / (steps * args.batch_size))
        history["test_acc"].append(test_acc)
        stats = (f"loss {history['loss'][-1]:.4f}  acc {history['train_acc'][-1]:6.2%}  "
                 f"test acc (inference) {test_acc:6.2%}")
        if verbose:
            bar.finish(stats)
        elif epoch < args.epochs:
            bar.update(epoch, f"epoch {epoch:2d}/{args.epochs}  {stats}")
        else:
            bar.finish(f"epoch {epoch:2d}/{args.epochs}  {stats}  ({seconds:.1f} s)")
    if bn_args is not None and min(float(bn.gamma.numpy().min()) for bn in net.bn) < 0:
        raise RuntimeError("fbn.train.SGD did not apply gamma's non_neg constraint")
    return history, history["test_acc"][-1], seconds


def plot(path, histories, epochs):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    x = np.arange(1, epochs + 1)
    for name, h in histories.items():
        line, = ax_loss.plot(x, h["loss"], label=name)
        ax_acc.plot(x, h["test_acc"], color=line.get_color(), label=f"{name} (test)")
        ax_acc.plot(x, h["train_acc"], color=line.get_color(), linestyle=":", alpha=0.6)
    ax_loss.set(title="training loss (softmax cross-entropy)", xlabel="epoch", yscale="log")
    ax_acc.axhline(0.97, color="grey", linewidth=0.8, linestyle="--", label="97%")
    ax_acc.set(title="accuracy: test in inference mode (solid), train (dotted)",
               xlabel="epoch", ylim=(0.85, 1.0))
    ax_acc.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    for ax in (ax_loss, ax_acc):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("fbn batch normalization on scikit-learn digits (64-256-128-10 dense network)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--epochs", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--max-shift", type=int, default=1,
                   help="training images move by up to this many pixels (0: no augmentation)")
    p.add_argument("--seed", type=int, default=0, help="initialization and shuffling")
    p.add_argument("--split-seed", type=int, default=0, help="the train/test split")
    p.add_argument("--virtual-batch-size", type=int, default=16,
                   help="ghost-batch size of the ghost-batches variant")
    p.add_argument("--threads", type=int, default=2, help="fbn's thread count")
    p.add_argument("--plot", default="build/train_digits.png", help="training curves (PNG)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--export-csv", metavar="PATH",
                   help="also write the split to PATH for examples/train_digits.cc")
    p.add_argument("--only-bn", action="store_true", help="train the batch-norm network only")
    p.add_argument("--min-accuracy", type=float, default=0.97,
                   help="exit with status 1 if the batch-norm network's test accuracy is lower")
    args = p.parse_args()
    if args.batch_size % args.virtual_batch_size:
        p.error("--batch-size must be a multiple of --virtual-batch-size")

    fbn.set_num_threads(args.threads)
    x_train, x_test, y_train, y_test = load_data(args.split_seed)
    if args.export_csv:
        export_csv(args.export_csv, x_train, y_train, x_test, y_test)
    data = (x_train, y_train, x_test, y_test)

    where = os.path.relpath(os.path.dirname(fbn.__file__))
    print(f"fbn {fbn.__version__} from {where}, {fbn.get_num_threads()} threads")
    print(f"scikit-learn digits: {len(x_train)} training and {len(x_test)} held-out test images "
          f"of 8x8 pixels")
    if args.export_csv:
        print(f"dataset for the C++ example written to {args.export_csv}")
    print(f"network 64-{'-'.join(map(str, HIDDEN))}-{CLASSES} dense, He init; SGD lr {args.lr} "
          f"(cosine decay) momentum {args.momentum}, batch {args.batch_size}, {args.epochs} "
          f"epochs, images shifted by up to {args.max_shift} pixel, seed {args.seed}\n")

    bn = dict(momentum=0.99, epsilon=1e-3, gamma_constraint=fbn.layers.constraints.non_neg())
    variants = [("batch norm", bn),
                ("no batch norm", None),
                ("batch renorm", dict(bn, renorm=True, renorm_momentum=0.99,
                                      renorm_clipping={"rmax": 3.0, "rmin": 1 / 3.0,
                                                       "dmax": 5.0})),
                (f"ghost batches of {args.virtual_batch_size}",
                 dict(bn, virtual_batch_size=args.virtual_batch_size))]
    if args.only_bn:
        variants = variants[:1]

    histories, results = {}, []
    start = time.perf_counter()
    for i, (name, bn_args) in enumerate(variants):
        if i == 0:
            print("Training with batch norm (dense -> fbn.layers.BatchNormalization -> ReLU):")
        elif i == 1:
            print("\nThe same network, for comparison:")
        history, acc, seconds = train(name, bn_args, data, args, verbose=i == 0)
        histories[name] = history
        results.append((name, acc, seconds))
    total = time.perf_counter() - start

    n = len(y_test)
    print(f"\nTest accuracy in inference mode (training=False: batch norm uses its moving "
          f"statistics), {n} held-out digits:")
    print(f"  {'network':<26} {'test accuracy':>13} {'errors':>7} {'train time':>11}")
    for name, acc, seconds in results:
        print(f"  {name:<26} {acc:>13.2%} {round((1 - acc) * n):>7d} {seconds:>9.1f} s")
    print(f"  (all {len(results)} trained and evaluated in {total:.1f} s)")
    if not args.no_plot:
        plot(args.plot, histories, args.epochs)
        print(f"\nTraining curves: {args.plot}")
    bn_acc = results[0][1]
    if bn_acc < args.min_accuracy:
        print(f"FAILED: batch-norm test accuracy {bn_acc:.2%} < {args.min_accuracy:.0%}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
