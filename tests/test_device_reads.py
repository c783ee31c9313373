"""A decode or verify step reads the device once: the emitted tokens, after verification.

Counted on the path a GPU runs (the Triton backend, interpreted on this CPU): every call by nanospec's own code
(not the torch references, not Triton's interpreter) that brings tensor values into Python (``tolist``,
``item``, ``bool(tensor)``, ...). On a GPU each is a host-device synchronisation.
"""

import contextlib
import sys
from pathlib import Path

import pytest
import torch

import nanospec
from nanospec import LLM, SamplingParams
from nanospec.kernels.backend import backend
from nanospec.model.mlp_speculator import save_mlp_speculator
from tiny import make_tiny_llama, successor_speculator

READS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero")
PACKAGE = str(Path(nanospec.__file__).parent)


@contextlib.contextmanager
def count_device_reads():
    """Yields a list that collects ``file:line function method`` for every read made by nanospec code."""
    reads: list[str] = []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code
            if caller.co_filename.startswith(PACKAGE) and not caller.co_name.endswith("_ref"):
                where = Path(caller.co_filename).relative_to(PACKAGE)
                reads.append(f"{where}:{sys._getframe(1).f_lineno} {caller.co_name} {name}")
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    target = tmp_path_factory.mktemp("reads_target")
    make_tiny_llama(target, seed=3, layers=2, hidden=32, num_heads=4, num_kv_heads=2, head_dim=8, ffn=48)
    draft = tmp_path_factory.mktemp("reads_draft")
    make_tiny_llama(draft, seed=4, layers=1, hidden=32, num_heads=2, num_kv_heads=1, head_dim=16, ffn=48)
    speculator = save_mlp_speculator(successor_speculator({t: (t + 1) % 320 for t in range(320)}, 32, 320),
                                     tmp_path_factory.mktemp("reads_mlp"))
    return target, draft, speculator


CONFIGS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
    "ngram_tree": {"method": "ngram", "num_speculative_tokens": 3, "max_candidates": 2, "adaptive": False},
    "lookahead": {"method": "lookahead", "window_size": 2, "ngram_size": 3, "guess_set_size": 2, "adaptive": False},
    "draft_coupled": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False, "acceptance": "coupled"},
    "draft": {"method": "draft", "num_speculative_tokens": 3, "adaptive": False},
    "draft_tree": {"method": "draft", "num_speculative_tokens": 2, "tree_top_k": 2, "tree_budget": 4,
                   "adaptive": False},
    "mlp": {"method": "mlp_speculator", "num_speculative_tokens": 3, "adaptive": False},
    "mlp_tree_lookup": {"method": "mlp_speculator", "tree_top_k": 2, "prompt_lookup": True},
}
# A draft model reads its guesses once, after its last draft step (they stay on the device between draft
# steps), and a draft tree once per level; every other method reads once, the verdicts (the MLP speculator's
# next guesses are computed on the device during verification and come back in that read).
READS_PER_STEP = {"draft": 2, "draft_coupled": 2, "draft_tree": 3}


CASES = [(name, 0.0) for name in sorted(CONFIGS)] + [(name, 0.8) for name in ("plain", "ngram", "draft",
                                                                                "draft_coupled", "mlp")]


def with_model(config: dict | None, paths) -> dict | None:
    """The config with its model path: the draft's or the MLP speculator's."""
    if config is not None and config["method"] == "draft":
        return {**config, "model": str(paths[1])}
    if config is not None and config["method"] == "mlp_speculator":
        return {**config, "model": str(paths[2])}
    return config


@pytest.mark.parametrize("name, temperature", CASES, ids=[f"{n}-{'greedy' if t == 0 else 'sampled'}" for n, t in CASES])
def test_one_device_read_per_decode_step(paths, name, temperature, device):
    config = with_model(CONFIGS[name], paths)
    llm = LLM(str(paths[0]), num_blocks=32, block_size=4, device=device, speculative_config=config)
    params = SamplingParams(temperature=temperature, max_tokens=6, seed=1, ignore_eos=True)
    with backend("triton"):
        for prompt in ([5, 9, 33, 5, 9, 33, 5], [40, 41, 42, 43, 44, 40, 41, 42]):
            llm.engine.add_request(prompt, params)
        llm.engine.step()  # the prefill
        for _ in range(2):
            with count_device_reads() as reads:
                llm.engine.step()
            assert len(reads) == READS_PER_STEP.get(name, 1), reads


@pytest.mark.parametrize("name", ["plain", "ngram_tree", "draft", "mlp"])
def test_logprobs_and_penalties_keep_one_read(paths, name):
    """Log-probabilities and penalties ride along in the verdicts' read."""
    config = with_model(CONFIGS[name], paths)
    llm = LLM(str(paths[0]), num_blocks=32, block_size=4, speculative_config=config)
    params = SamplingParams(temperature=0.8, max_tokens=6, seed=1, ignore_eos=True, logprobs=2,
                            repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=-0.1)
    with backend("triton"):
        for prompt in ([5, 9, 33, 5, 9, 33, 5], [40, 41, 42, 43, 44, 40, 41, 42]):
            llm.engine.add_request(prompt, params)
        llm.engine.step()
        with count_device_reads() as reads:
            outputs = llm.engine.step()
        assert len(reads) == READS_PER_STEP.get(name, 1), reads
        assert all(len(o.logprobs) == len(o.token_ids) for o in outputs)
