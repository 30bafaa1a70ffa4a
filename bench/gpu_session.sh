#!/usr/bin/env bash
# Every GPU check of issue 21 in one call on a lent CUDA machine (about 8 minutes on an H200), for a session
# whose device time is short. On the machine, from the repository root:
#
#     bash bench/gpu_session.sh            # results also under $OUT (or ./gpu_session_out)
#
# The machine's image has torch, numba, Triton, pyarrow and scipy; zarr, numcodecs, google-crc32c, donfig,
# dp-accounting and faiss-cpu travel as wheels in ./.whl (fetched here beforehand, for the machine's Python 3.12):
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 donfig==0.8.1.post1 dp-accounting==0.6.0 faiss-cpu==1.15.1 \
#       dask==2026.7.1 distributed==2026.7.1 cloudpickle==3.1.3 toolz==1.2.0 partd==1.4.2 fsspec==2026.9.0 locket==1.0.0 \
#       msgpack==1.2.4 psutil==7.2.2 sortedcontainers==2.4.0 tblib==3.2.2 zict==3.0.0 tornado==6.6.1 click==8.5.1 \
#       PyYAML==6.0.4 importlib_metadata==10.2.0 zipp urllib3==2.8.0
#
# Steps: the fused kernels' probe (with its traceback if it raises); the CPU-vs-GPU tests; the bench's figures
# at N = 1M, d = 384 (steady queries/s after the first batch against the target of 50,000), with the fused kernels
# and without; the profile of one
# serve and one pass (bench/gpu_profile.py); the Dask run of issue 19 with 1, 2, 4, 8, 16 workers on the
# machine's cores. Each step has its own time limit; a failed step does not stop the next.
set -u
OUT="${OUT:-gpu_session_out}"
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; uptime
  python3 -c "import numba, torch, numpy, triton; print('numba', numba.__version__, 'torch', torch.__version__, 'numpy', numpy.__version__, 'triton', triton.__version__)"
} 2>&1 | tee "$OUT/machine.log"
timeout 90 python3 - <<'PY' 2>&1 | tee "$OUT/probe.log"
import time, traceback, torch
from indknn_cli import gpu_fused
t = time.time()
try:
    print("fused probe d=384:", gpu_fused._probe(torch.device("cuda"), 384), f"({time.time() - t:.1f} s, compiles included)")
except Exception:
    traceback.print_exc()
PY
timeout 240 python3 -m pytest -m cuda tests/test_cuda.py -q -p no:cacheprovider 2>&1 | tail -25 | tee "$OUT/tests.log"
uptime | tee -a "$OUT/machine.log"
timeout 240 python3 -m indknn_cli bench serve-speed --device cuda --n 1000000 --d 384 --queries 139264 \
  --batch-size 8192 --tau 0.59 2>&1 | tail -4 | tee "$OUT/bench.log"
uptime | tee -a "$OUT/machine.log"
# The same with the fused kernels off, on the same machine. On 2026-11-28 (06:13-06:31 UTC, one H200) the steady
# figure was bimodal whatever the code (about 27,000 or 51,000-60,000 queries/s): read in_process_queries_per_s and
# part_interval_ms (each part timed inside the process, since 2026-11-28) beside it.
INDKNN_GPU_FUSED=0 timeout 200 python3 -m indknn_cli bench serve-speed --device cuda --n 1000000 --d 384 \
  --queries 139264 --batch-size 8192 --tau 0.59 2>&1 | tail -4 | tee "$OUT/bench_unfused.log"
uptime | tee -a "$OUT/machine.log"
timeout 180 python3 bench/gpu_profile.py 2>&1 | tail -32 | tee "$OUT/profile.log"
uptime | tee -a "$OUT/machine.log"
# Issue 19: the Dask candidate phase with 1, 2, 4, 8, 16 worker processes on the machine's cores (distributed and its
# dependencies travel in .whl too); the 2-core runs in docs/SCALING.md used 2,048 and 8,192 queries.
# 8 batches: a worker's first task of a run opens the store and reads its rows (with 2 batches, 30-40 % of
# the run on 2 cores). The steps' limits add up to more than one call's 600 s; their times on 2026-11-28 (probe
# 11 s, tests 49 s, each bench about 80 s, profile 55 s, this step about 150 s) fit one call.
timeout 200 python3 -m indknn_cli bench serve-speed --n 200000 --d 384 --queries 8192 --tau 0.59 \
  --scheduler local --workers 1,2,4,8,16 --device cpu 2>&1 | tail -7 | tee "$OUT/dask.log"
uptime | tee -a "$OUT/machine.log"
