#!/usr/bin/env bash
# The GPU check, for one H200 (sm_90) with torch 2.11+ and CUDA 13, no network, no expecttest or
# scikit-learn (no test it runs needs them). It checks its prerequisites, installs cafin
# (`pip install --no-deps --no-build-isolation -e .`, TORCH_CUDA_ARCH_LIST=9.0), runs every test
# marked `cuda` in every test file (`pytest -m cuda`, in groups whose time limits are sized for what
# they run, cold inductor compiles included; two lanes at once: the compiling groups, and the rest),
# then the bench's quick mode on CUDA alone, and ends with a summary. Each step's limit is cut to
# what is left of a total budget (460 s by default), so the check ends within 8 minutes.
# Logs (one per step), JUnit XML, the bench JSON and the summary go to LOGDIR.
#
#   bash tools/gpu_check.sh LOGDIR        (GPU_CHECK_BUDGET=seconds to change the budget)
set -u
logs=${1:?usage: tools/gpu_check.sh LOGDIR}
mkdir -p "$logs"
logs=$(cd "$logs" && pwd)
rm -f "$logs"/*.result
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
py=${PYTHON:-python3}
begin=$(date +%s)
deadline=$((begin + ${GPU_CHECK_BUDGET:-460}))
order=()  # step names, in the order the summary lists them

now() { date +%s; }

note() {  # note NAME RESULT SECONDS DETAIL: one line in $logs/NAME.result
  printf '%s\t%s\t%s\n' "$2" "$3" "$4" >"$logs/$1.result"
}

# run NAME LIMIT CMD...: runs CMD, its output in $logs/NAME.log, under LIMIT seconds or what is left
# of the budget; sets rc (124: out of time, 125: not started, the budget being spent) and elapsed.
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(now)))
  ((left < limit)) && limit=$left
  elapsed=0
  if ((limit < 15)); then
    echo "not run: the budget is spent" >"$logs/$name.log"
    rc=125
    return
  fi
  local start
  start=$(now)
  timeout --kill-after=10 "$limit" "$@" >"$logs/$name.log" 2>&1
  rc=$?
  elapsed=$(($(now) - start))
  if ((rc == 124 || rc == 137)); then
    echo "TIMEOUT after ${limit} s" >>"$logs/$name.log"
    rc=124
  fi
}

# pytest_step NAME LIMIT FILES...: the cuda-marked tests of FILES.
pytest_step() {
  local name=$1 limit=$2
  shift 2
  run "$name" "$limit" "$py" -m pytest -q -p no:cacheprovider -m cuda -rfEs \
    --junitxml="$logs/$name.xml" "$@"
  local line skips
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran" "$logs/$name.log" |
         tail -n 1 | sed -E 's/=//g; s/^ +| +$//g')
  skips=$(grep -c "^SKIPPED" "$logs/$name.log")
  case $rc in
    0) if ((skips > 0)); then note "$name" WARN "$elapsed" "$line (a GPU is here: nothing should skip)"
       else note "$name" ok "$elapsed" "$line"; fi ;;
    5) note "$name" ok "$elapsed" "no cuda-marked tests" ;;
    124) note "$name" TIMEOUT "$elapsed" "${line:-no result} (limit reached)" ;;
    125) note "$name" "NOT RUN" 0 "budget spent" ;;
    *) note "$name" FAIL "$elapsed" "${line:-exit $rc, see $name.log}" ;;
  esac
}

passed() { [[ -f $logs/$1.result && $(cut -f1 "$logs/$1.result") == ok ]]; }

# ------------------------------------------------------------------------------- prerequisites
{
  $py - <<'EOF'
import importlib.util, os, re, shutil, subprocess, sys, warnings
warnings.simplefilter("ignore")
missing, found = [], []
def need(ok, what, have=None):
    if not ok:
        missing.append(what)
    elif have:
        found.append(have)
try:
    import setuptools
    version = tuple(int(p) for p in re.findall(r"\d+", setuptools.__version__)[:2])
    need(version >= (64,), f"setuptools >= 64 (have {setuptools.__version__})", f"setuptools {setuptools.__version__}")
    # setuptools before 70.1 builds the editable wheel with the separate `wheel` package.
    need(version >= (70, 1) or importlib.util.find_spec("wheel") is not None,
         f"wheel (setuptools {setuptools.__version__} < 70.1 needs it for pip install -e)")
except ImportError:
    need(False, "setuptools >= 64")
try:
    import torch
    import torch.utils.cpp_extension as cpp
except ImportError:
    print("MISSING: torch"); sys.exit(2)
found.append(f"torch {torch.__version__}")
need(torch.version.cuda is not None, "a CUDA build of torch (torch.version.cuda is None)", f"CUDA {torch.version.cuda}")
need(cpp.is_ninja_available(), "ninja (pip install ninja, or on PATH)", "ninja")
home = cpp.CUDA_HOME
nvcc = os.path.join(home, "bin", "nvcc") if home else None
if nvcc and os.path.exists(nvcc) and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout
    release = re.search(r"release (\d+)\.(\d+)", out)
    found.append(f"nvcc {'.'.join(release.groups()) if release else '?'} ({home})")
    # torch refuses to build with a toolkit of another major version than its own.
    need(not (release and torch.version.cuda) or release.group(1) == torch.version.cuda.split(".")[0],
         f"nvcc of CUDA {torch.version.cuda.split('.')[0] if torch.version.cuda else '?'}.x "
         f"(torch's CUDA; {home} has {'.'.join(release.groups()) if release else '?'})")
else:
    need(False, f"a CUDA toolkit with nvcc and headers (torch found CUDA_HOME={home}; set CUDA_HOME)")
count = torch.cuda.device_count() if torch.version.cuda else 0
need(count > 0, "a visible GPU (torch.cuda.device_count() == 0)",
     f"{count} GPU ({torch.cuda.get_device_name(0)})" if count else None)
for module in ("pytest", "pip"):
    need(importlib.util.find_spec(module) is not None, module, module)
if importlib.util.find_spec("rich") is None:
    print("NOTE: rich is missing: the bench step will fail")
gpu = "no GPU"
if shutil.which("nvidia-smi"):
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip().replace("\n", "; ") or gpu
print(f"env: {gpu} | torch {torch.__version__} (CUDA {torch.version.cuda}) | python {sys.version.split()[0]}")
print("found: " + ", ".join(found))
if missing:
    print("MISSING: " + "; ".join(missing))
    sys.exit(2)
EOF
} >"$logs/prereq.log" 2>&1
prereq_rc=$?
if ((prereq_rc == 0)); then
  note prereq ok $(($(now) - begin)) "$(grep '^found:' "$logs/prereq.log" | cut -c8-)"
else
  note prereq FAIL $(($(now) - begin)) "$(grep -E '^MISSING' "$logs/prereq.log" || tail -n 1 "$logs/prereq.log")"
fi
order+=(prereq)

# ------------------------------------------------------------------------------- build
if passed prereq; then
  order+=(build)
  # A clean build: an extension left in place (a CPU-only one, say) looks up to date to setuptools.
  stale=$(ls -d build cafin/_C*.so 2>/dev/null | tr '\n' ' ')
  [[ -n $stale ]] && rm -rf build cafin/_C*.so
  # Cold: the .cu files (about a minute each) and the C++ files, compiled in parallel.
  run build 300 bash -c "echo 'removed stale build outputs: ${stale:-none}'; \
    exec $py -m pip install --no-deps --no-build-isolation -v -e ."
  build_rc=$rc build_time=$elapsed
  if ((build_rc == 0)); then
    run kernels 60 "$py" -c "
import torch, cafin
assert cafin.cuda_kernels_built(), 'cafin was built without its CUDA kernels'
print('CUDA kernels built, from', cafin.__file__, 'on', torch.cuda.get_device_name())"
    if ((rc == 0)); then note build ok "$build_time" "$(tail -n 1 "$logs/kernels.log")"
    else note build FAIL "$build_time" "$(tail -n 1 "$logs/kernels.log")"; fi
  else
    note build "$( ((build_rc == 124)) && echo TIMEOUT || echo FAIL)" "$build_time" \
         "$(grep -m 1 -E 'error:|ERROR:' "$logs/build.log" || tail -n 1 "$logs/build.log")"
  fi
fi

# ------------------------------------------------------------------------------- tests
if passed build; then
  # Limits, about twice what a group takes on one H200. ops: some 220 small kernel tests and the
  # generated opcheck tests (AOT tracing, no inductor). mixed: some 80 short training runs. graphs:
  # 2 captures and 2 cold reduce-overhead compiles. compile: 2 cold compiles of a step and one of a
  # model's forward and backward. others: whatever any other test file marks cuda.
  others=()
  for f in tests/test_*.py; do
    case $f in
      tests/test_ops.py | tests/test_cuda_graphs.py | tests/test_mixed_precision.py | tests/test_compile.py) ;;
      *) others+=("$f") ;;
    esac
  done
  order+=(ops mixed others graphs compile)
  # Two lanes: inductor compiles use the CPU cores, the other groups mostly wait on small kernels.
  (pytest_step ops 150 tests/test_ops.py
   pytest_step mixed 150 tests/test_mixed_precision.py
   pytest_step others 90 "${others[@]}") &
  (pytest_step graphs 150 tests/test_cuda_graphs.py
   pytest_step compile 180 tests/test_compile.py) &
  wait
  order+=(bench)
  # Alone, so that its timings see an idle machine.
  run bench 120 "$py" -m bench --quick --device cuda --json "$logs/bench.json"
  case $rc in
    0) note bench ok "$elapsed" "bench.json written" ;;
    124) note bench TIMEOUT "$elapsed" "limit reached" ;;
    125) note bench "NOT RUN" 0 "budget spent" ;;
    *) note bench FAIL "$elapsed" "$(tail -n 1 "$logs/bench.log")" ;;
  esac
fi

# ------------------------------------------------------------------------------- summary
failed=()
for name in "${order[@]}"; do passed "$name" || failed+=("$name"); done
total=$(($(now) - begin))
{
  echo
  if ((${#failed[@]} == 0)); then
    echo "== cafin GPU check: PASS (${total} s) =="
  else
    echo "== cafin GPU check: FAIL in ${failed[*]} (${total} s) =="
  fi
  grep -m 1 "^env:" "$logs/prereq.log"
  for name in "${order[@]}"; do
    if [[ -f $logs/$name.result ]]; then
      IFS=$'\t' read -r result seconds detail <"$logs/$name.result"
    else
      result="NO RESULT" seconds=0 detail="see $name.log"
    fi
    printf '%-8s %-8s %4ss  %s\n' "$name" "$result" "$seconds" "${detail:0:110}"
  done
  problems=$(grep -h -E "^(FAILED|ERROR|SKIPPED) " "$logs"/*.log 2>/dev/null | cut -c1-160)
  if [[ -n $problems ]]; then
    echo "-- failing (or, with a GPU here, skipped) tests, the first of $(echo "$problems" | wc -l) lines:"
    echo "$problems" | head -n 10
  fi
  echo "logs: $logs/<step>.log"
} | tee "$logs/summary.txt"
((${#failed[@]} == 0))
