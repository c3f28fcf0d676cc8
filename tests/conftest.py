"""Shared pytest set-up: the ``gpu`` marker skips cleanly without CUDA; the ``seed``,
``triton_device``, ``backend`` and ``tune`` fixtures; no tqdm monitor thread, and a test that
leaves batch-invariant mode on fails."""

import os
import sys

import pytest
import torch


def pytest_configure(config):
    # tqdm's monitor thread (started by the first progress bar, e.g. inside torch.compile) outlives
    # the test that started it. The batch-invariant mode removes its kernel registrations only when
    # the process has one thread left, so a stray thread would make every later "registrations
    # removed" check depend on the monitor's timing.
    try:
        import tqdm  # type: ignore[import-untyped]
    except ImportError:
        return
    tqdm.tqdm.monitor_interval = 0


@pytest.fixture(autouse=True)
def _batch_invariant_mode_left_off():
    """After each test: the mode is off (a test that leaves it on fails here, and the switch is
    reset so that the tests after it run as written)."""
    yield
    invariance = sys.modules.get("rl_kernel_core.batch_invariant_mode.api")
    if invariance is not None and invariance.is_batch_invariant():
        invariance.set_batch_invariant_mode(False)
        pytest.fail("the test left batch-invariant mode on")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _draw_seed() -> int:
    """A fresh random seed, or ``$RL_KERNEL_TEST_SEED`` when set; seeds torch's generator and prints it."""
    pinned = os.environ.get("RL_KERNEL_TEST_SEED")
    if pinned is not None:
        try:
            s = int(pinned)
        except ValueError:
            raise pytest.UsageError(f"RL_KERNEL_TEST_SEED must be an integer, got {pinned!r}") from None
    else:
        s = int(torch.randint(0, 2**31 - 1, (1,), generator=torch.Generator().manual_seed(torch.seed() % 2**31)))
    torch.manual_seed(s)
    print(f"seed={s} (rerun with RL_KERNEL_TEST_SEED={s})")
    return s


@pytest.fixture
def seed():
    """A fresh random seed per test, or ``$RL_KERNEL_TEST_SEED`` when set (printed on failure)."""
    return _draw_seed()


@pytest.fixture(scope="module")
def module_seed():
    """The same for a module-scoped fixture (an engine run shared by a module's tests)."""
    return _draw_seed()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def triton_device(request, monkeypatch):
    """``cpu``: Triton kernels run in the interpreter (``TRITON_INTERPRET=1`` for this test; kernels
    built with ``launch_time_jit`` choose at launch); ``cuda``: they compile."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return torch.device(request.param)


@pytest.fixture
def backend(request, monkeypatch):
    """The ``op_backends.Backend`` (tests/core/op_backends.py) a test is parametrised with through
    ``op_backends.on_backends``: Triton on CPU runs in its interpreter (``TRITON_INTERPRET=1`` for
    this test), on CUDA it compiles."""
    chosen = request.param
    if chosen.interpreted:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    elif chosen.device == "cuda":
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    return chosen


@pytest.fixture
def tune():
    """``tune(**changes)``: run the rest of the test under
    :func:`rl_kernel_core.linear.chunks.tuned` with these changes (calls nest; all undone after)."""
    import contextlib

    from rl_kernel_core.linear import chunks as linear_chunks

    with contextlib.ExitStack() as stack:
        yield lambda **changes: stack.enter_context(linear_chunks.tuned(**changes))


# the op tests that run one backend's kernels (each family's folder under tests/core)
@pytest.fixture
def device(triton_device) -> torch.device:
    """``cpu`` runs the Triton kernels in the interpreter; ``cuda`` (``gpu`` marker) compiles them
    (see ``triton_device`` above)."""
    return triton_device


@pytest.fixture(params=("gemm", "chunked"))
def route(request, tune) -> str:
    """Run linear_logprob's and fused_linear_policy_loss's forward, backward and loss on one kernel
    route (``gemm``: ``tl.dot`` tiles in registers; ``chunked``: an fp32 logits chunk from cuBLAS)."""
    tune(route=request.param)
    return request.param
