#!/usr/bin/env bash
# The GPU comparison of docs/xla-vs-pytorch.md as one prepared run (for an accelerator machine whose
# time is short): versions, a smoke test, then scripts/compare_backends.py on the larger random
# LLaDA-shaped model (8 layers, d_model 1024; bf16 and float32, eager torch) plus torch.compile and
# the shipped model. Run it from the repository root (it runs python -m scripts.compare_backends).
# Every step has its own time limit and log, so one slow or failing step does not lose the others.
# Results: $OUT/<step>.json per finished step and $OUT/all.log (every step's log and table, appended as
# each step ends, so that a run cut short keeps what it finished); the tables are printed at the end.
#
#   OUT=/tmp/gpu bash scripts/device_compare.sh            # the full run (the steps' limits add up to 10 minutes)
#   OUT=/tmp/gpu TINY=1 bash scripts/device_compare.sh     # the same steps on a toy model (CPU check)
#
# If the machine's flax cannot run the engine, a flax wheel carried in .whl/ is installed and the
# smoke test repeated (`pip download --no-deps flax==0.12.8 -d .whl`).
set -u
OUT=${OUT:-/tmp/device_compare}
LOGS=$(mktemp -d)  # per-step logs; the device tool brings back only a few files from $OUT
mkdir -p "$OUT"
PY=${PY:-python3}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # JAX and torch share the GPU

$PY - 2>&1 <<'EOF' | tee "$OUT/all.log"
import platform, jax, flax, torch, transformers, numpy
print("python", platform.python_version(), "jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, "numpy", numpy.__version__)
print("jax devices", jax.devices())
print("torch cuda", torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else "")
EOF

TOY="--layers 2 --d-model 128 --heads 4 --vocab 512 --gen-length 32 --block-length 16"  # smoke test and TINY=1
if [ -n "${TINY:-}" ]; then
  BIG="$TOY --prompts 2 --repeats 2"
  SHIPPED="--gen-length 32 --block-length 16 --prompts 2 --repeats 2"
else
  # 2 prompts: with 4, the bfloat16 (breakdown) and float32 steps run out of their limits on an
  # H200 (true-float32 compiles take 23-44 s per decoder there).
  BIG="--layers 8 --d-model 1024 --gen-length 256 --block-length 32 --prompts 2 --repeats 3"
  SHIPPED="--gen-length 64 --block-length 32 --prompts 16 --batch 8 --repeats 3"
fi
CMP="$PY -m scripts.compare_backends"  # from the repository root: no install needed
BIG="$BIG --random-dir $LOGS/random"  # one random model written once, shared by the steps

step() {  # step NAME SECONDS ARGS...: one compare_backends run with its own limit and log
  local name=$1 limit=$2; shift 2
  local start=$SECONDS
  timeout "$limit" $CMP "$@" --out "$OUT/$name.json" >"$LOGS/$name.md" 2>"$LOGS/$name.log"
  echo "[$name] exit $? after $((SECONDS - start)) s" | tee -a "$OUT/all.log"
  cat "$LOGS/$name.log" "$LOGS/$name.md" >>"$OUT/all.log"
}

smoke() {
  timeout 150 $CMP --no-default-model --random-llada $TOY --prompts 1 --repeats 1 --no-compile --decoders fixed,psd \
    >"$LOGS/smoke.log" 2>&1
}
if ! smoke; then
  echo "smoke test failed with the machine's packages; installing the carried flax"; tail -5 "$LOGS/smoke.log"
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  smoke || { echo "smoke test failed again"; tail -30 "$LOGS/smoke.log" | tee -a "$OUT/all.log"; exit 1; }
fi
echo "smoke test passed"

step big_bf16 150 --no-default-model --random-llada $BIG --dtype bfloat16 --no-compile --breakdown
step big_f32 200 --no-default-model --random-llada $BIG --dtype float32 --matmul-precision float32 --no-compile
step big_compile 90 --no-default-model --random-llada $BIG --dtype bfloat16 --decoders fixed,threshold
step big_batch8 60 --no-default-model --random-llada $BIG --prompts 8 --batch 8 --dtype bfloat16 --no-compile --decoders fixed,psd
step shipped 90 --model models/default $SHIPPED --no-compile

for name in big_bf16 big_f32 big_compile big_batch8 shipped; do
  echo "===== $name"
  if [ -s "$LOGS/$name.md" ]; then cat "$LOGS/$name.md"  # the finished run's table
  else grep -E "^\*\*|^\| [a-z]" "$LOGS/$name.log" | grep -v "^| decoder"; tail -2 "$LOGS/$name.log"  # rows it finished
  fi
done
