"""Shared pytest setup for fbn's Python suites.

TensorFlow is the reference for conformance. Its Eigen CPU kernels define the semantics; the
oneDNN kernels it uses by default differ in messages and placeholder shapes, so they are switched
off before any test module can import TensorFlow.
"""
import os

os.environ["TF_ENABLE_ONEDNN_OPTS"] = "0"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import pytest  # noqa: E402

from bn_reference import COUNTS, import_tensorflow, tensorflow_import_error  # noqa: E402


@pytest.fixture(scope="session")
def tf():
    """TensorFlow (Eigen CPU kernels); tests that need it skip when it is not importable."""
    module = import_tensorflow()
    if module is None:
        pytest.skip(f"tensorflow is not importable: {tensorflow_import_error()}")
    return module


@pytest.fixture(autouse=True)
def _restore_threads():
    """Tests may change fbn's global thread count; put the default back afterwards."""
    import fbn  # pylint: disable=import-outside-toplevel
    yield
    fbn.set_num_threads(0)


def pytest_terminal_summary(terminalreporter):
    if COUNTS:
        terminalreporter.write_sep("-", "fbn test tallies")
        for key in sorted(COUNTS):
            terminalreporter.write_line(f"{key}: {COUNTS[key]}")
