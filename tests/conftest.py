import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One compute thread per worker (`make test` runs a worker per core): several workers' thread pools on the same
    # cores spin against each other (the PyTorch and TensorFlow QAT tests on 2 workers: 43.1 s pinned, 47.6 s on 2 threads).
    # Set before torch or TensorFlow is imported; the CLI and example subprocesses inherit it. A test that needs
    # more threads sets them itself.
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        os.environ.setdefault(_name, "1")
    # A test that sets 2 threads (tests/e2e/zoo/test_cnns.py trains on 2) leaves its OpenMP threads spinning between
    # parallel regions, on the core the other worker needs: idle threads sleep instead (tests/e2e/zoo/test_cnns.py on
    # 2 workers: 84.3 s spinning, 51.7 s passive).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# TensorFlow fixes its thread count when it starts, and the count decides the order of its sums, so the weights a
# Keras test trains: one thread in every run, so that a test run alone trains the model `make test` trains (a Keras
# MobileNetV2 trained on 2 threads and on 1 differed enough to pass alone and fail under `make test`).
for _name in ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
    os.environ.setdefault(_name, "1")
# Layer latencies a plan times (recal_onnx.timed_candidates) are kept in the run's own folder, not the user's cache.
if "RECAL_CACHE" not in os.environ:
    import tempfile

    os.environ["RECAL_CACHE"] = os.path.join(tempfile.gettempdir(), f"recal-test-cache-{os.getuid()}")
import pytest  # noqa: E402 - after the thread settings: they must precede any torch or TensorFlow import

from tests.support.paths import RECIPES  # noqa: E402



@pytest.fixture
def seed_recipe_text() -> str:
    return (RECIPES / "seed_prune_all.yaml").read_text()


def pytest_collection_modifyitems(config, items):
    """The slow tests first: under ``-n auto`` the workers start on the minutes-long ones and fill in with the
    short ones, instead of one worker running a long test alone at the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session", autouse=True)
def _one_onnxruntime_thread_per_worker():
    """In workers only, an onnxruntime session given no thread count gets one (tests/support/one_thread_sessions.py)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    from tests.support.one_thread_sessions import install

    restore = install()
    try:
        yield
    finally:
        restore()


@pytest.fixture(scope="session", autouse=True)
def _one_onnx_function_registry_per_opset():
    """torch's dynamo exporter builds its table of ONNX functions anew for every export (about 1 s; some 70 exports
    a run). The suite registers no custom op, so one table per opset serves every export in a worker. Only the
    table is shared: each export still runs the exporter in full. Without that torch internal, nothing changes."""
    try:
        from torch.onnx._internal.exporter import _registration
    except ImportError:
        yield
        return
    build = _registration.ONNXRegistry.__dict__.get("from_torchlib")
    if not isinstance(build, classmethod):
        yield
        return
    tables = {}

    def from_torchlib(cls, opset_version=None, **kwargs):
        key = (cls, opset_version, tuple(sorted(kwargs.items())))
        if key not in tables:
            args = () if opset_version is None else (opset_version,)
            tables[key] = build.__func__(cls, *args, **kwargs)
        return tables[key]

    _registration.ONNXRegistry.from_torchlib = classmethod(from_torchlib)
    try:
        yield
    finally:
        _registration.ONNXRegistry.from_torchlib = build
