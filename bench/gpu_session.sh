#!/usr/bin/env bash
# Every GPU check of issue 21 in one call on a lent CUDA machine (about 5 minutes on an H200), for a session
# whose device time is short. On the machine, from the repository root:
#
#     bash bench/gpu_session.sh            # results also under $OUT (or ./gpu_session_out)
#
# The machine's image has torch, numba, Triton, pyarrow and scipy; zarr, numcodecs, google-crc32c, donfig,
# dp-accounting and faiss-cpu travel as wheels in ./.whl (fetched here beforehand, for the machine's Python 3.12):
#
#     python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#       zarr==3.1.6 numcodecs==0.16.6 google-crc32c==1.9.0 donfig==0.8.1.post1 dp-accounting==0.6.0 faiss-cpu==1.15.1
#
# Steps: the fused kernels' probe (with its traceback if it raises); the CPU-vs-GPU tests; the profile of one
# serve and one pass (bench/gpu_profile.py); the bench's figures at N = 1M, d = 384 (steady queries/s after
# the first batch against the target of 50,000). Each step has its own time limit; a failed step does not
# stop the next.
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
timeout 180 python3 bench/gpu_profile.py 2>&1 | tail -32 | tee "$OUT/profile.log"
uptime | tee -a "$OUT/machine.log"
timeout 240 python3 -m indknn_cli bench serve-speed --device cuda --n 1000000 --d 384 --queries 139264 \
  --batch-size 8192 --tau 0.59 2>&1 | tail -4 | tee "$OUT/bench.log"
uptime | tee -a "$OUT/machine.log"
