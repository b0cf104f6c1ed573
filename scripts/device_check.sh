#!/usr/bin/env bash
# One prepared run for a GPU machine whose time is short (at most 9.25 minutes on one NVIDIA H200):
# LLaDA-8B's forward MFU, the decoders' speed in JAX, the same decodes in PyTorch eager and
# torch.compile, and int8 weights against bfloat16 (scripts/device/check.py says what each step
# measures and how long it should take; docs/device-check.md how to read the output). Run it from
# the repository root.
#
#   OUT=/tmp/dc bash scripts/device_check.sh            # the GPU run (the steps' limits add up to 575 s)
#   OUT=/tmp/dc TINY=1 bash scripts/device_check.sh     # the same steps on a toy model on the CPU
#   OUT=/tmp/dc STEPS="serve" bash scripts/device_check.sh   # env, then only the listed steps
#
# The steps after env (STEPS, default all but serve): forward jax_decode torch torch_compile int8, and
# serve: the server under load on the 8B shape (scripts/device/serve_check.py, its own table
# $OUT/serve_check.md; limit 150 s), left out by default so that the default run fits its budget.
#
# Every step is a process of its own with its own time limit and log, so one slow or failing step
# does not lose the others; after each step $OUT/device_check.json and $OUT/device_check.md are
# rewritten with every step finished so far (a step writes its rows to $OUT/parts/ as it goes),
# and the step's log is appended to $OUT/device_check.log. The table is printed at the end.
#
# If the machine's flax cannot run the engine (the env step's smoke test fails), a flax wheel carried
# in .whl/ is installed and the env step repeated (`pip download --no-deps flax==0.12.8 -d .whl`).
set -u
OUT=${OUT:-/tmp/device_check}
PY=${PY:-python3}
mkdir -p "$OUT/parts"
: >"$OUT/device_check.log"
LOGS=$(mktemp -d)
# JAX programs compiled by one step are read back by the later ones.
export DEVICE_CHECK_CACHE=${DEVICE_CHECK_CACHE:-$LOGS/jax-cache}
export DEVICE_CHECK_COMMIT=${DEVICE_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1  # JAX and torch share the GPU

if [ -n "${TINY:-}" ]; then
  export TINY
  LIMITS="env=60 forward=60 jax_decode=120 torch=90 torch_compile=60 int8=60 serve=90"
else
  LIMITS="env=45 forward=75 jax_decode=200 torch=130 torch_compile=50 int8=75 serve=150"
fi
STEPS=${STEPS:-forward jax_decode torch torch_compile int8}

step() {  # step NAME LIMIT: one step, its own limit and log; the report rewritten when it ends
  local name=$1 limit=$2 start=$SECONDS code
  timeout -k 5 "$limit" $PY -m scripts.device.check "$name" --out "$OUT" --deadline $((limit * 9 / 10)) \
    >"$LOGS/$name.log" 2>&1
  code=$?
  echo "[$name] exit $code after $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/device_check.log"
  cat "$LOGS/$name.log" >>"$OUT/device_check.log"
  $PY -m scripts.device.report --out "$OUT" --step "$name" --exit "$code" --seconds $((SECONDS - start))
  return $code
}

limit() { local pair; for pair in $LIMITS; do [ "${pair%%=*}" = "$1" ] && echo "${pair#*=}"; done; }

if ! step env "$(limit env)"; then
  tail -5 "$LOGS/env.log"
  if ls .whl/*.whl >/dev/null 2>&1; then
    echo "smoke test failed with the machine's packages; installing the carried flax" | tee -a "$OUT/device_check.log"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    step env "$(limit env)" || { tail -30 "$LOGS/env.log"; exit 1; }
  else
    exit 1
  fi
fi
for name in $STEPS; do
  if [ "$name" = serve ]; then  # the server under load: a script and a table of its own
    start=$SECONDS
    timeout -k 5 "$(limit serve)" $PY -m scripts.device.serve_check --out "$OUT" --deadline $(($(limit serve) * 8 / 10)) \
      >"$LOGS/serve.log" 2>&1
    echo "[serve] exit $? after $((SECONDS - start)) s (limit $(limit serve) s)" | tee -a "$OUT/device_check.log"
    cat "$LOGS/serve.log" >>"$OUT/device_check.log"
    continue
  fi
  step "$name" "$(limit "$name")"
done
cat "$OUT/device_check.md"
if [ -f "$OUT/serve_check.md" ]; then cat "$OUT/serve_check.md"; fi
