#!/usr/bin/env bash
# The GPU check, for one H200 (sm_90) with torch 2.11+ and CUDA 13, no network, no expecttest or
# scikit-learn (no test it runs needs them). One command, within 8 minutes:
#   prereq  checks its prerequisites and names what is missing;
#   build   installs cafin (`pip install --no-deps --no-build-isolation -e .`,
#           TORCH_CUDA_ARCH_LIST=9.0) from a clean build and checks the CUDA kernels are there;
#   tests   every test marked `cuda` in every test file (`pytest -m cuda`), each file in exactly
#           one group (see `groups`; `--groups` lists them), the groups in two lanes at once;
#   models  `python -m bench.gpu_models`: every member on a torchvision ResNet-18 and a
#           HuggingFace GPT-2, eager and captured in a CUDA graph, against AdamW(fused), with the
#           captured-vs-eager error and finiteness per row (models.json, its table in summary.txt);
#   bench   `python -m bench --quick --device cuda`, alone, with `--published PATH` when the
#           published AdaFisher.py is given (the CAFIN paper's comparison; bench.json).
# Each step's limit is cut to what is left of a total budget (460 s by default), so the check
# ends within 8 minutes. LOGDIR ends with four files: summary.txt, models.json, bench.json and
# logs.tar.gz (one log per step, the JUnit XML, the table as text).
#
#   bash tools/gpu_check.sh LOGDIR [PUBLISHED_ADAFISHER_PY]
#   bash tools/gpu_check.sh --groups      (lists the test groups and their files; needs no GPU)
# Environment: GPU_CHECK_PUBLISHED=PATH (the same as the second argument), GPU_CHECK_BUDGET=seconds,
# PYTHON (default python3), MAX_JOBS (default 16).
set -u
invoked=$PWD  # relative paths given are relative to here
cd "$(dirname "$0")/.." || exit 2
absolute() { case $1 in /*) echo "$1" ;; *) echo "$invoked/$1" ;; esac; }

# groups: prints "GROUP FILE" for every test file; each file is in exactly one group (a case per
# file), so every cuda-marked test runs once. ops: small kernel tests and generated opcheck tests.
# mixed: short training runs. graphs: captures and cold reduce-overhead compiles. members: every
# member's step captured and compiled with reduce-overhead. compile: cold compiles of steps and of
# a model's forward and backward. others: every other file.
groups() {
  local f
  for f in tests/test_*.py; do
    case $f in
      tests/test_ops.py) echo "ops $f" ;;
      tests/test_adafisher_mixed_precision.py) echo "mixed $f" ;;
      tests/test_compile.py) echo "compile $f" ;;
      tests/test_cuda_graphs_members.py) echo "members $f" ;;
      tests/*cuda_graphs*.py) echo "graphs $f" ;;
      *) echo "others $f" ;;
    esac
  done
}

files_of() { groups | awk -v g="$1" '$1 == g { print $2 }'; }

if [[ ${1:-} == --groups ]]; then
  groups
  exit 0
fi

logs=${1:?usage: tools/gpu_check.sh LOGDIR [PUBLISHED_ADAFISHER_PY]   (or --groups)}
published=${2:-${GPU_CHECK_PUBLISHED:-}}
if [[ -n $published ]]; then
  published=$(absolute "$published")
  if [[ ! -f $published ]]; then
    echo "tools/gpu_check.sh: the published AdaFisher file $published does not exist" >&2
    exit 2
  fi
fi
logs=$(absolute "$logs")
mkdir -p "$logs" || exit 2
logs=$(cd "$logs" && pwd)
work=$logs/logs  # every step's log until the end packs them into logs.tar.gz
rm -rf "$work" "$logs/logs.tar.gz" "$logs/summary.txt" "$logs/bench.json" "$logs/models.json"
mkdir -p "$work" || exit 2
export PYTHONUNBUFFERED=1 TORCH_CUDA_ARCH_LIST=9.0 FORCE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} HF_HUB_OFFLINE=1
py=${PYTHON:-python3}
begin=$(date +%s)
deadline=$((begin + ${GPU_CHECK_BUDGET:-460}))
order=()  # step names, in the order the summary lists them

now() { date +%s; }

note() {  # note NAME RESULT SECONDS DETAIL: one line in $work/NAME.result
  printf '%s\t%s\t%s\n' "$2" "$3" "$4" >"$work/$1.result"
}

# run NAME LIMIT CMD...: runs CMD, its output in $work/NAME.log, under LIMIT seconds or what is left
# of the budget; sets rc (124: out of time, 125: not started, the budget being spent) and elapsed.
run() {
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - $(now)))
  ((left < limit)) && limit=$left
  elapsed=0
  if ((limit < 15)); then
    echo "not run: the budget is spent" >"$work/$name.log"
    rc=125
    return
  fi
  local start
  start=$(now)
  timeout --kill-after=10 "$limit" "$@" >"$work/$name.log" 2>&1
  rc=$?
  elapsed=$(($(now) - start))
  if ((rc == 124 || rc == 137)); then
    echo "TIMEOUT after ${limit} s" >>"$work/$name.log"
    rc=124
  fi
}

# pytest_step NAME LIMIT: the cuda-marked tests of the group NAME's files.
pytest_step() {
  local name=$1 limit=$2 files
  mapfile -t files < <(files_of "$name")
  if ((${#files[@]} == 0)); then
    note "$name" ok 0 "no test files in this group"
    return
  fi
  run "$name" "$limit" "$py" -m pytest -q -p no:cacheprovider -m cuda -rfEs \
    --junitxml="$work/$name.xml" "${files[@]}"
  local line skips
  line=$(grep -E "^(=+ )?[0-9]+ (passed|failed|skipped|deselected|error)|no tests ran" "$work/$name.log" |
         tail -n 1 | sed -E 's/=//g; s/^ +| +$//g')
  skips=$(grep -c "^SKIPPED" "$work/$name.log")
  case $rc in
    0) if ((skips > 0)); then note "$name" WARN "$elapsed" "$line (a GPU is here: nothing should skip)"
       else note "$name" ok "$elapsed" "$line"; fi ;;
    5) note "$name" ok "$elapsed" "no cuda-marked tests" ;;
    124) note "$name" TIMEOUT "$elapsed" "${line:-no result} (limit reached)" ;;
    125) note "$name" "NOT RUN" 0 "budget spent" ;;
    *) note "$name" FAIL "$elapsed" "${line:-exit $rc, see $name.log}" ;;
  esac
}

passed() { [[ -f $work/$1.result && $(cut -f1 "$work/$1.result") == ok ]]; }

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
for module, rows in (("torchvision", "ResNet-18"), ("transformers", "GPT-2")):
    if importlib.util.find_spec(module) is None:
        print(f"NOTE: {module} is missing: the models table's {rows} rows will say so")
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
} >"$work/prereq.log" 2>&1
prereq_rc=$?
if ((prereq_rc == 0)); then
  note prereq ok $(($(now) - begin)) "$(grep '^found:' "$work/prereq.log" | cut -c8-)"
else
  note prereq FAIL $(($(now) - begin)) "$(grep -E '^MISSING' "$work/prereq.log" || tail -n 1 "$work/prereq.log")"
fi
order+=(prereq)

# ------------------------------------------------------------------------------- build
if passed prereq; then
  order+=(build)
  # A clean build: an extension left in place (a CPU-only one, say) looks up to date to setuptools.
  stale=""
  for path in build cafin/_C*.so; do [[ -e $path ]] && stale+="$path "; done
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
    if ((rc == 0)); then note build ok "$build_time" "$(tail -n 1 "$work/kernels.log")"
    else note build FAIL "$build_time" "$(tail -n 1 "$work/kernels.log")"; fi
  else
    note build "$( ((build_rc == 124)) && echo TIMEOUT || echo FAIL)" "$build_time" \
         "$(grep -m 1 -E 'error:|ERROR:' "$work/build.log" || tail -n 1 "$work/build.log")"
  fi
fi

# ------------------------------------------------------------------------------- tests, models, bench
if passed build; then
  groups >"$work/groups.log"
  order+=(ops mixed others graphs members compile)
  # Two lanes of about two minutes each on one H200 (limits: about twice what a group takes).
  # Inductor compiles use the CPU cores, the other groups mostly wait on small kernels.
  (pytest_step ops 150
   pytest_step mixed 150
   pytest_step others 120
   pytest_step graphs 200) &
  (pytest_step members 240
   pytest_step compile 180) &
  wait

  order+=(models)
  # Alone: its timings need an idle GPU. The table stops starting rows 40 s before the limit (its
  # longest row, DyKAF on the GPT-2, takes about 30 s), so it ends with its JSON written.
  limit=180 left=$((deadline - $(now)))
  ((left < limit)) && limit=$left
  run models "$limit" "$py" -m bench.gpu_models --device cuda --out "$logs/models.json" \
    --budget-s $((limit > 60 ? limit - 40 : 20))
  table=$(grep -E "^table: " "$work/models.log" | tail -n 1)
  case $rc in
    0) if [[ $table =~ [1-9][0-9]*\ not\ run ]]; then note models WARN "$elapsed" "$table"
       else note models ok "$elapsed" "$table"; fi ;;
    1) note models FAIL "$elapsed" "${table:-no table}: see the table below" ;;
    124) note models TIMEOUT "$elapsed" "limit reached; models.json has the rows done" ;;
    125) note models "NOT RUN" 0 "budget spent" ;;
    *) note models FAIL "$elapsed" "$(tail -n 1 "$work/models.log")" ;;
  esac

  order+=(bench)
  # Alone, so that its timings see an idle machine.
  bench_args=(--quick --device cuda --json "$logs/bench.json")
  [[ -n $published ]] && bench_args+=(--published "$published")
  run bench 140 "$py" -m bench "${bench_args[@]}"
  with=${published:+, published AdaFisher: $published}
  case $rc in
    0) note bench ok "$elapsed" "bench.json written${with}" ;;
    124) note bench TIMEOUT "$elapsed" "limit reached" ;;
    125) note bench "NOT RUN" 0 "budget spent" ;;
    *) note bench FAIL "$elapsed" "$(tail -n 1 "$work/bench.log")${with}" ;;
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
  grep -m 1 "^env:" "$work/prereq.log"
  for name in "${order[@]}"; do
    if [[ -f $work/$name.result ]]; then
      IFS=$'\t' read -r result seconds detail <"$work/$name.result"
    else
      result="NO RESULT" seconds=0 detail="see $name.log"
    fi
    printf '%-8s %-8s %4ss  %s\n' "$name" "$result" "$seconds" "${detail:0:110}"
  done
  problems=$(grep -h -E "^(FAILED|ERROR|SKIPPED) " "$work"/*.log 2>/dev/null | cut -c1-160)
  if [[ -n $problems ]]; then
    echo "-- failing (or, with a GPU here, skipped) tests, the first of $(echo "$problems" | wc -l) lines:"
    echo "$problems" | head -n 10
  fi
  if [[ -f $logs/models.json ]]; then
    echo "-- the models table (models.json):"
    "$py" -m bench.gpu_models --print "$logs/models.json" 2>&1 | cut -c1-150
  fi
  if [[ -f $logs/bench.json ]]; then
    echo "-- the bench's whole training step (bench.json):"
    "$py" - "$logs/bench.json" <<'EOF' 2>&1 | cut -c1-150
import json, sys
run = json.load(open(sys.argv[1]))
for r in run.get("whole_step", []):
    over = r.get("overhead_vs_adamw")
    print(f"  {r['optimizer']:<10} {r['variant']:<15} cycle {r['cycle_ms'] or float('nan'):9.2f} ms"
          f"  vs AdamW {'-' if over is None else f'{over:+.1%}'}")
for s in run.get("skipped", []):
    if s.get("error") or s.get("variant") == "published":
        print(f"  {'error' if s.get('error') else 'note'}: {s['optimizer']} {s['variant']} "
              f"({s['phase']}): {s['reason']}")
EOF
  fi
  echo "logs: $logs/logs.tar.gz (<step>.log, <group>.xml, groups.log); models.json, bench.json"
} >"$work/summary.txt"
cp "$work/summary.txt" "$logs/summary.txt"
# At most a handful of files come back from a GPU machine: the logs go in one archive.
if tar -czf "$logs/logs.tar.gz" -C "$logs" logs 2>"$logs/tar.err"; then
  rm -rf "$work" "$logs/tar.err"
else
  echo "could not pack the logs ($(head -c 200 "$logs/tar.err")): they are in $work" >>"$logs/summary.txt"
fi
cat "$logs/summary.txt"
((${#failed[@]} == 0))
