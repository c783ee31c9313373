"""Test setup: Triton kernels run in the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.
"""

import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# A shell that starts the suite in the background ignores SIGINT for it; the tests of Ctrl-C assume a
# terminal's behaviour (KeyboardInterrupt), so restore it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_backend():
    """Run the ops of a test through their Triton kernels (interpreted on CPU)."""
    from nanospec.kernels.backend import backend

    with backend("triton"):
        yield
