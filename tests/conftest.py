"""Test setup: Triton kernels run in the CPU interpreter unless a GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here, at collection.

Devices: a test of a kernel or of the engine takes the ``device`` fixture ("cuda" when a GPU is present, else
"cpu") and builds every tensor it hands to a kernel, and every ``LLM``, on it. Tests marked ``gpu`` need CUDA
and are skipped, with that reason, where there is none. Where a GPU's numerics differ from the CPU's (compiled
kernels, cuBLAS), each test states its tolerance; fp32 comparisons on CUDA run without TF32 (below).
"""

import json
import os

if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"

# The forward-cost cache (nanospec.speculative.cost_cache) is off: each test's engine times its own model, and
# nothing is written to the user's cache; the cache's own tests point it at a temporary directory.
os.environ["NANOSPEC_CACHE_DIR"] = ""

import signal  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# A shell that starts the suite in the background ignores SIGINT for it; the tests of Ctrl-C assume a
# terminal's behaviour (KeyboardInterrupt), so restore it.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with a reason, on a machine without CUDA (never run, never passed)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device, and none is available here")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # a marker, not any keyword (a folder named gpu)
            item.add_marker(skip)


@pytest.fixture(scope="session")
def device():
    """The device the kernel and engine tests run on (session-wide, so module-scoped fixtures can take it)."""
    return DEVICE


@pytest.fixture(scope="session", autouse=True)
def no_tf32():
    """fp32 means fp32 on CUDA too: TF32 (a 10-bit mantissa, ~1e-3 relative error) would swamp the fp32
    tolerances of the tests (1e-4 and below) in every torch matmul (cuBLAS: the model's projections, the torch
    reference backend, transformers). PyTorch leaves TF32 off for matmuls but on for cuDNN by default; both are
    turned off for the session here and restored after. The Triton kernels ask for IEEE fp32 dots themselves
    (``input_precision="ieee"``). No effect on the CPU."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.fixture
def triton_backend():
    """Run the ops of a test through their Triton kernels (interpreted on CPU)."""
    from nanospec.kernels.backend import backend

    with backend("triton"):
        yield


@pytest.fixture(scope="module")
def prompts(request, tmp_path_factory):
    """The test module's PROMPTS as a trainer prompt file (one {"category", "prompt"} per line)."""
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"category": "test", "prompt": p}) + "\n" for p in request.module.PROMPTS))
    return path


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    """A trainer's recording cache, shared by a module's runs so that they record once."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="session")
def transformers_smollm2():
    """transformers' own reading of the embedded GGUF in fp32, the oracle of the real-model tests (read once for the
    session: dequantizing the file takes it about 20 s on a small CPU)."""
    from transformers import AutoModelForCausalLM

    from nanospec.model.embedded import embedded_model_path

    path = embedded_model_path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
