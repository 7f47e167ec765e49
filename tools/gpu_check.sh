#!/usr/bin/env bash
# The GPU check: build cafin for sm_90, run the CUDA tests (ops vs reference, opcheck, compile,
# CUDA-graph capture and replay under sync-debug "error", reduce-overhead) and the bench's quick
# mode on CUDA. Full logs go to the directory given as the first argument; a short summary is
# printed last. For one H200 with torch 2.11 + CUDA 13 and no network; well under 8 minutes.
#
#   bash tools/gpu_check.sh LOGDIR
set -u
logs=${1:?usage: tools/gpu_check.sh LOGDIR}
mkdir -p "$logs"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=${MAX_JOBS:-16}
py=${PYTHON:-python3}
summary=()
run() {  # run NAME TIMEOUT CMD...: log to $logs/NAME.log, remember the exit status
  local name=$1 limit=$2
  shift 2
  local start=$SECONDS
  timeout "$limit" "$@" >"$logs/$name.log" 2>&1
  local rc=$?
  summary+=("$(printf '%-8s rc=%-3s %4ss  %s' "$name" "$rc" "$((SECONDS - start))" "$(tail -n 1 "$logs/$name.log")")")
  return $rc
}

{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nvcc --version | tail -n 2
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } >"$logs/env.log" 2>&1

if run build 300 $py -m pip install --no-deps --no-build-isolation -v -e .; then
  run kernels 20 $py -c "import cafin, torch; assert cafin.cuda_kernels_built(), 'no CUDA kernels'; print('CUDA kernels built; device', torch.cuda.get_device_name())"
  run ops 150 $py -m pytest -q -x -p no:cacheprovider tests/test_ops.py -k "cuda or CUDA"
  run graphs 150 $py -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py
  run bench 150 $py -m bench --quick --device cuda --json "$logs/bench.json"
fi

echo
echo "== cafin GPU check (logs in $logs) =="
cat "$logs/env.log"
printf '%s\n' "${summary[@]}"
grep -h -E "passed|failed|error" "$logs"/ops.log "$logs"/graphs.log 2>/dev/null | tail -n 4
