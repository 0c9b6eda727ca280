#!/usr/bin/env bash
# The GPU check (issue 21): the `gpu`-marked tests, bench/codec with --device cuda and the compressed
# bench/loader with --device cuda, in at most 8 minutes, on a bare GPU machine without network access
# whose python3 has torch, triton, numba, h5py, mpi4py, xxhash and fsspec. Writes bench/gpu/results.json
# (and $OUT/results.json with the logs when $OUT is set: the device tool copies $OUT back).
#
#   bash scripts/gpu-check.sh --download   # `make gpu-wheels`: here, with network: the wheels SOLAR needs
#                                          # beyond that python3 (zstandard, lz4, tqdm, pytest ...) into
#                                          # .gpu-wheels/ (git-ignored; carry it to the GPU machine)
#   bash scripts/gpu-check.sh              # `make gpu-check`: installs from .gpu-wheels/ only what is
#                                          # missing (no network, never torch), SOLAR from this tree, runs
#
# Without CUDA it runs the same steps on the CPU (the CPU fallback: "device": "cpu" in the JSON), so the
# script itself is tested on machines without a GPU (tests/test_gpu_check.py).
# Environment: PYTHON (default .venv/bin/python if present, else python3); SOLAR_GPU_CHECK_QUICK=1 (tiny
# sizes, for the unit test; results go to the work folder unless SOLAR_GPU_CHECK_OUT names a file);
# SOLAR_GPU_CHECK_OUT (the results file); SOLAR_GPU_CHECK_BUDGET (seconds for all steps, default 420);
# SOLAR_GPU_WHEELS (default .gpu-wheels); SOLAR_GPU_CHECK_FORCE_INSTALL=1 (install every carried wheel,
# even over modules already there; to test the install path).
set -u -o pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
WHEELS=${SOLAR_GPU_WHEELS:-$ROOT/.gpu-wheels}
QUICK=${SOLAR_GPU_CHECK_QUICK:-0}
# module:distribution pairs SOLAR and its gpu tests need beyond torch/h5py/numpy (which must be there)
NEEDED="zstandard:zstandard lz4:lz4 tqdm:tqdm xxhash:xxhash fsspec:fsspec pytest:pytest pluggy:pluggy
iniconfig:iniconfig packaging:packaging hypothesis:hypothesis sortedcontainers:sortedcontainers attr:attrs
pytest_timeout:pytest-timeout"
PINS="zstandard==0.25.0 lz4==4.4.5 tqdm==4.70.1 xxhash==3.6.0 fsspec==2026.9.0 pytest==9.2.0 pluggy==1.7.0
iniconfig==2.3.1 packaging==26.3 hypothesis==6.170.17 sortedcontainers==2.4.0 attrs==26.1.0 pytest-timeout==2.4.0"

if [[ "${1:-}" == "--download" ]]; then
  mkdir -p "$WHEELS"
  for v in 3.11 3.12 3.13; do  # SOLAR needs Python >= 3.11
    # shellcheck disable=SC2086
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$v" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      --platform manylinux1_x86_64 --platform any -d "$WHEELS" $PINS || exit 1
  done
  echo "wheels in $WHEELS: $(ls "$WHEELS" | wc -l) files, $(du -sh "$WHEELS" | cut -f1)"
  exit 0
fi

T_START=$(date +%s)
BUDGET=${SOLAR_GPU_CHECK_BUDGET:-420}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/solar-gpu-check.XXXXXX")
if [[ -n "${SOLAR_GPU_CHECK_OUT:-}" ]]; then RESULT=$SOLAR_GPU_CHECK_OUT
elif [[ "$QUICK" == 1 ]]; then RESULT=$WORK/results.json
else RESULT=$ROOT/bench/gpu/results.json; fi
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# the codec's numba kernels (cpu-kernel decoder) cache their compiled code here, not in the tree;
# the quick mode (the CPU fallback that tests/test_gpu_check.py runs in a set-up tree) keeps numba's
# own cache, which `make setup` filled: a cold compile of the decoder is minutes on a loaded machine
[[ "$QUICK" == 1 ]] || export NUMBA_CACHE_DIR=$WORK/numba-cache
say() { echo "[gpu-check $(( $(date +%s) - T_START ))s] $*"; }
say "work folder $WORK, python $PYTHON, quick=$QUICK"

# --- 1. the wheels: install only what is missing, into $WORK/site, without network, never torch
TORCH_BEFORE=$("$PYTHON" -c "import torch; print(torch.__version__, torch.__file__)" 2>&1) || {
  echo "gpu-check: $PYTHON has no torch: $TORCH_BEFORE" >&2; exit 2; }
SITE=$WORK/site
mkdir -p "$SITE"
MISSING=()
for pair in $NEEDED; do
  mod=${pair%%:*} dist=${pair#*:}
  if [[ "${SOLAR_GPU_CHECK_FORCE_INSTALL:-0}" == 1 ]] || ! "$PYTHON" -c "import $mod" 2>/dev/null; then
    MISSING+=("$dist")
  fi
done
INSTALL_STATUS=nothing-missing
if (( ${#MISSING[@]} )); then
  say "installing from $WHEELS: ${MISSING[*]}"
  if [[ ! -d "$WHEELS" ]]; then
    INSTALL_STATUS="failed: no $WHEELS (run make gpu-wheels where there is network)"
  elif "$PYTHON" -m pip --version >/dev/null 2>&1; then
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
        --find-links "$WHEELS" --target "$SITE" "${MISSING[@]}" 2>&1 | tee "$WORK/install.log"; then
      INSTALL_STATUS="installed: ${MISSING[*]}"
    else INSTALL_STATUS="failed: pip install ${MISSING[*]} (see install.log)"; fi
  else  # no pip: unpack the wheels that fit this interpreter (a wheel is a zip of its site-packages files)
    if "$PYTHON" - "$WHEELS" "$SITE" "${MISSING[@]}" <<'EOF' 2>&1 | tee "$WORK/install.log"; then
import sys, zipfile, pathlib
wheels, site, names = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
for name in names:
    norm = name.replace("-", "_").lower()
    cands = [w for w in wheels.glob("*.whl") if w.name.split("-")[0].lower() == norm
             and (f"-{tag}-" in w.name or "-none-any" in w.name or "-abi3-" in w.name)]
    if not cands:
        sys.exit(f"no wheel of {name} for {tag} in {wheels}")
    zipfile.ZipFile(cands[0]).extractall(site)
    print("unpacked", cands[0].name)
EOF
      INSTALL_STATUS="unpacked (no pip): ${MISSING[*]}"
    else INSTALL_STATUS="failed: unpacking ${MISSING[*]} (see install.log)"; fi
  fi
  say "$INSTALL_STATUS"
fi

# --- 2. SOLAR from this tree: the tree on PYTHONPATH, and (pyproject's package-dir) solar.io_backends ->
# io_backends/, solar.cache -> cache/ by a finder that a generated sitecustomize installs, as setuptools'
# editable install does; it then runs the sitecustomize it shadows, if any. Whichever way Python finds
# solar/ (the tree on PYTHONPATH, or the working directory that `python -m pytest` puts first), the
# subpackages resolve, and nothing is written into the tree or the interpreter's site-packages.
mkdir -p "$WORK/boot"
cat > "$WORK/boot/sitecustomize.py" <<EOF
# generated by scripts/gpu-check.sh: SOLAR from the tree at $ROOT
import importlib.abc, importlib.machinery, importlib.util, os, sys

_MAP = {"solar.io_backends": os.path.join("$ROOT", "io_backends"), "solar.cache": os.path.join("$ROOT", "cache")}


class _SolarTree(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        d = _MAP.get(name)
        if d is None:
            return None
        return importlib.util.spec_from_file_location(name, os.path.join(d, "__init__.py"),
                                                      submodule_search_locations=[d])


sys.meta_path.insert(0, _SolarTree())
_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or ".") != _here])
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
EOF
export PYTHONPATH="$WORK/boot:$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
ENV_JSON=$WORK/env.json
if ! "$PYTHON" - "$ROOT" "$ENV_JSON" "$TORCH_BEFORE" <<'EOF'; then
import json, os, platform, sys
root, out, before = sys.argv[1:4]
import torch, solar, solar.io_backends, solar.cache, solar.codec  # noqa: F401
after = f"{torch.__version__} {torch.__file__}"
assert after == before, f"torch changed: {before} -> {after}"
where = os.path.realpath(solar.__file__)
for mod in (solar, solar.io_backends, solar.cache, solar.codec):
    here = os.path.realpath(mod.__file__)
    assert here.startswith(os.path.realpath(root) + os.sep), f"{mod.__name__} comes from {here}, not this tree"
cuda = torch.cuda.is_available()
mods = {}
for m in ("numpy", "h5py", "zstandard", "lz4", "xxhash", "fsspec", "tqdm", "triton", "pytest", "hypothesis"):
    try:
        mod = __import__(m)
        spec = mod.__spec__.origin or ""
        mods[m] = getattr(mod, "__version__", None) or getattr(mod, "VERSION", "?")
        if spec.startswith(os.path.join(os.path.dirname(out), "site") + os.sep):
            mods[m] += " (carried wheel)"
    except Exception as e:  # noqa: BLE001
        mods[m] = f"missing ({type(e).__name__})"
json.dump({"device": "cuda" if cuda else "cpu",
           "device_name": torch.cuda.get_device_name(0) if cuda else platform.processor() or platform.machine(),
           "torch": torch.__version__, "torch_cuda": torch.version.cuda, "python": platform.python_version(),
           "platform": platform.platform(), "cpu_count": os.cpu_count(), "solar_from": os.path.dirname(where),
           "packages": mods}, open(out, "w"), indent=1)
print(f"torch {torch.__version__} (unchanged), solar from {os.path.dirname(where)}, device "
      + (torch.cuda.get_device_name(0) if cuda else "cpu (no CUDA: the CPU fallback)"))
EOF
  echo "gpu-check: the environment check failed (above)" >&2
  "$PYTHON" -c "import json,sys; json.dump({'device': 'unknown', 'error': 'environment check failed'}, open(sys.argv[1],'w'))" "$ENV_JSON"
fi
DEV=$("$PYTHON" -c "import json,sys; print(json.load(open(sys.argv[1]))['device'])" "$ENV_JSON")
[[ "$DEV" == cuda ]] || DEV=cpu

# --- 3. the steps, each bounded with `timeout` and together by $BUDGET
declare -A RC SECS LIMIT
run_step() {  # name limit_s command...
  local name=$1 limit=$2; shift 2
  local left=$(( BUDGET - ($(date +%s) - T_START) ))
  (( limit > left )) && limit=$left
  LIMIT[$name]=$limit
  if (( limit < 10 )); then say "$name: skipped, the budget is spent"; RC[$name]=skipped; SECS[$name]=0; return; fi
  say "$name (limit ${limit}s): $*"
  local t0; t0=$(date +%s%N)
  timeout -k 10 "$limit" "$@" > >(tee "$WORK/$name.log") 2>&1
  RC[$name]=$?
  local t1; t1=$(date +%s%N)
  SECS[$name]=$(( (t1 - t0) / 1000000 ))  # milliseconds
  say "$name: exit ${RC[$name]}"
}
GPU_TESTS=$(grep -l "pytest.mark.gpu" tests/test_*.py | tr '\n' ' ')
if [[ "$QUICK" == 1 ]]; then
  PYTEST_FILES="tests/test_codec.py"
  CODEC_ARGS=(--rel 1e-2 --n 32 --reps 1 --no-batch --no-compiled --fields "smooth_sines_32^3")
  LOADER_ARGS=(--samples 64 --size 32 --epochs 2 --batch-size 16 --storage throttled --no-decode-compile)
  L_PYTEST=120 L_CODEC=120 L_LOADER=120
else
  PYTEST_FILES=$GPU_TESTS
  CODEC_ARGS=(--rel 1e-3 --n 128 --reps 5)
  LOADER_ARGS=(--samples 1024 --epochs 3 --storage throttled)
  L_PYTEST=120 L_CODEC=190 L_LOADER=110
fi
PT_TIMEOUT=()
"$PYTHON" -c "import pytest_timeout" 2>/dev/null && PT_TIMEOUT=(--timeout 120)
# shellcheck disable=SC2086
run_step pytest_gpu "$L_PYTEST" "$PYTHON" -m pytest -m gpu -p no:cacheprovider "${PT_TIMEOUT[@]}" \
  --junitxml="$WORK/junit.xml" $PYTEST_FILES
run_step codec "$L_CODEC" "$PYTHON" bench/codec/run.py "${CODEC_ARGS[@]}" --device "$DEV" --out "$WORK/codec.json"
run_step loader "$L_LOADER" "$PYTHON" bench/loader/run.py "${LOADER_ARGS[@]}" --device "$DEV" \
  --data "$WORK/loader.h5" --out "$WORK/loader.json"

# --- 4. bench/gpu/results.json
mkdir -p "$(dirname "$RESULT")"
"$PYTHON" - "$WORK" "$RESULT" "$QUICK" "$INSTALL_STATUS" "$(( $(date +%s) - T_START ))" "$BUDGET" \
  "pytest_gpu=${RC[pytest_gpu]}:${SECS[pytest_gpu]}:${LIMIT[pytest_gpu]}" \
  "codec=${RC[codec]}:${SECS[codec]}:${LIMIT[codec]}" "loader=${RC[loader]}:${SECS[loader]}:${LIMIT[loader]}" \
  "$PYTEST_FILES" <<'EOF'
import datetime, json, math, os, sys
import xml.etree.ElementTree as ET
work, result, quick, install, total, budget = sys.argv[1:7]
steps_arg, pytest_files = sys.argv[7:10], sys.argv[10]
env = json.load(open(os.path.join(work, "env.json")))
cuda = env.get("device") == "cuda"


def load(name):
    try:
        return json.load(open(os.path.join(work, name)))
    except (OSError, ValueError):
        return None


steps = {}
for a in steps_arg:
    name, rest = a.split("=", 1)
    rc, secs, limit = rest.split(":")
    st = {"rc": None if rc == "skipped" else int(rc), "seconds": round(int(secs or 0) / 1000, 1),
          "limit_s": int(limit) if limit else None}
    st["status"] = ("skipped (budget spent)" if rc == "skipped" else "passed" if rc == "0"
                    else "timeout" if rc in ("124", "137") else "failed")
    steps[name] = st

# pytest -m gpu: counts from its JUnit XML
p = steps["pytest_gpu"]
p["files"] = pytest_files.split()
try:
    root = ET.parse(os.path.join(work, "junit.xml")).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    p.update(tests=c["tests"], failed=c["failures"] + c["errors"], skipped=c["skipped"],
             passed=c["tests"] - c["failures"] - c["errors"] - c["skipped"])
    cases = [tc for s in suites for tc in s.iter("testcase")]
    p["cases"] = {f"{tc.get('classname')}::{tc.get('name')}":
                  ("failed" if tc.find("failure") is not None or tc.find("error") is not None
                   else "skipped" if tc.find("skipped") is not None else "passed") for tc in cases}
    if p["status"] == "passed" and p["tests"] and p["skipped"] == p["tests"]:
        p["status"] = "skipped (no CUDA)" if not cuda else "skipped"
except (OSError, ET.ParseError):
    pass

# bench/codec: CPU and GPU decode figures of solar ebq (zstd, the CPU default) and ebq/7's bitpack
# (decoded whole on the device: the GPU figure that counts the lossless stage)
codec = load("codec.json")
if codec:
    rows = codec["rows"]
    keys = ("field", "rel", "ratio", "max_err_over_bound", "dec_MBps", "gpu_dec_GBps", "gpu_dec_GBps_reference",
            "bound_ok")
    per = {name: [{k: r.get(k) for k in keys} for r in rows if r.get("compressor") == f"solar ebq ({name})"
                  and "batch" not in r] for name in ("zstd", "bitpack")}
    fields = per["zstd"]
    fig = {"device": codec.get("device"), "solar_ebq_zstd": fields, "solar_ebq_bitpack": per["bitpack"],
           "all_within_bound": all(r["bound_ok"] for r in rows)}
    for name, sfx in (("zstd", ""), ("bitpack", "_bitpack")):
        gpu = [f["gpu_dec_GBps"] for f in per[name] if f.get("gpu_dec_GBps")]
        if gpu:
            fig["gpu_decode_GBps_geomean" + sfx] = math.exp(sum(map(math.log, gpu)) / len(gpu))
            fig["gpu_decode_GBps_max" + sfx] = max(gpu)
    cpu = [f["dec_MBps"] for f in fields if f.get("dec_MBps")]
    if cpu:
        fig["cpu_decode_MBps_geomean"] = math.exp(sum(map(math.log, cpu)) / len(cpu))
    fig["batch"] = [{k: r.get(k) for k in ("field", "batch", "compressor", "device", "dec_MBps", "dec_GBps",
                                           "compile_s", "bound_ok", "equal_to_cpu")}
                    for r in rows if "batch" in r and r["compressor"].startswith("solar")]
    steps["codec"]["figures"] = fig

# bench/loader, compressed, decoded on the device
loader = load("loader.json")
if loader:
    fig = {"device": loader["config"].get("device"), "samples": loader["samples"],
           "compression": {k: loader.get("compression", {}).get(k) for k in ("ratio", "rel_error", "hit_rate_bound")}}
    for storage, run in loader["runs"].items():
        f = {k: run.get(k) for k in ("torch_steady_s", "solar_steady_s", "speedup_steady", "speedup_total")}
        for key in ("compressed", "compressed_compiled"):
            if key in run:
                f[key] = {k: run[key].get(k) for k in ("epoch_s", "steady_s", "speedup_steady_vs_torch",
                                                       "speedup_steady_vs_solar_raw", "decode_s", "decode_share",
                                                       "hit_rate_after_fill", "within_bound", "max_abs_error")}
        fig[storage] = f
    steps["loader"]["figures"] = fig

out = {"what": "scripts/gpu-check.sh (make gpu-check): pytest -m gpu, bench/codec --device, compressed "
               "bench/loader --device" + (" (quick sizes)" if quick == "1" else ""),
       "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
       "quick": quick == "1", **env, "wheels": install, "total_s": int(total), "budget_s": int(budget),
       "steps": steps,
       "ok": all(s["status"] in ("passed", "skipped (no CUDA)") for s in steps.values())}
open(result, "w").write(json.dumps(out, indent=1) + "\n")
print(json.dumps({k: out[k] for k in ("device", "device_name", "torch", "ok", "total_s")}))
for name, s in steps.items():
    print(f"  {name:11s} {s['status']:18s} {s['seconds']:7.1f} s")
if "codec" in steps and "figures" in steps["codec"]:
    f = steps["codec"]["figures"]
    for name in ("zstd", "bitpack"):
        for r in f[f"solar_ebq_{name}"]:
            g = f"  GPU {r['gpu_dec_GBps']:.2f} GB/s" if r.get("gpu_dec_GBps") else ""
            print(f"  codec {name:7s} {r['field']:22s} ratio {r['ratio']:6.2f}  CPU decode {r['dec_MBps']:7.0f} MB/s{g}")
    for r in f["batch"]:
        print(f"  codec batch {r['field']:18s} {r['compressor']:36s} {r['dec_MBps']:9.0f} MB/s")
if "loader" in steps and "figures" in steps["loader"]:
    for storage, f in steps["loader"]["figures"].items():
        if isinstance(f, dict) and "compressed" in f:
            c = f["compressed"]
            print(f"  loader [{storage}] solar {f['speedup_steady']:.2f}x torch; compressed "
                  f"{c['speedup_steady_vs_torch']:.2f}x torch, decode {c['decode_s']:.2f} s"
                  + (f"; compiled {f['compressed_compiled']['speedup_steady_vs_torch']:.2f}x torch"
                     if "compressed_compiled" in f else ""))
sys.exit(0 if out["ok"] else 1)
EOF
STATUS=$?
say "wrote $RESULT (exit $STATUS)"
if [[ -n "${OUT:-}" && -d "${OUT:-}" ]]; then
  cp "$RESULT" "$OUT/results.json"
  for f in pytest_gpu.log codec.log loader.log codec.json loader.json install.log; do
    [[ -f "$WORK/$f" ]] && cp "$WORK/$f" "$OUT/"
  done
fi
exit $STATUS
