"""faiss is loaded with its bundled OpenBLAS told the CPU's kernel family (candidates.import_faiss, issue 21):
the wheel's OpenBLAS 0.3.15 takes recent Xeons for a 2004 "Prescott" and runs its products 4–6× slower."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from indknn_cli.candidates import _openblas_coretype

_PROBE = r"""
import ctypes, glob, json, os, sys
from indknn_cli.candidates import import_faiss
faiss = import_faiss()
libs = glob.glob(os.path.join(os.path.dirname(os.path.dirname(faiss.__file__)), "faiss_cpu.libs", "libopenblas*"))
core = None
if libs:
    f = ctypes.CDLL(libs[0]).openblas_get_corename
    f.restype = ctypes.c_char_p
    core = f().decode()
print(json.dumps({"core": core, "env": os.environ.get("OPENBLAS_CORETYPE")}))
"""


def _probe(env_core):
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    if env_core:
        env["OPENBLAS_CORETYPE"] = env_core
    out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("flags,want", [
    ("fpu sse sse2 avx avx2 fma avx512f avx512cd avx512bw avx512dq avx512vl", "SkylakeX"),
    ("fpu sse sse2 avx avx2 fma avx512f", "Haswell"),  # AVX-512 without BW/DQ/VL (Knights Landing)
    ("fpu sse sse2 avx avx2 fma", "Haswell"),
    ("fpu sse sse2 avx avx2", None),  # AVX2 without FMA: leave OpenBLAS to decide
    ("fpu sse sse2 ssse3", None),
])
def test_the_kernel_family_is_one_the_cpu_has(tmp_path, flags, want):
    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\nbugs\t\t: spectre_v1\n")
    assert _openblas_coretype(str(info)) == want
    assert _openblas_coretype(str(tmp_path / "absent")) is None


def test_faiss_openblas_runs_the_cpus_kernels_and_the_environment_is_restored():
    """On a CPU with AVX2 + FMA, faiss's OpenBLAS is not left on its SSE3 fallback; the variable is gone
    again after the import (numpy's OpenBLAS and child processes keep their own choice)."""
    want = _openblas_coretype()
    if want is None:
        pytest.skip("no /proc/cpuinfo AVX2 + FMA flags on this machine")
    got = _probe(None)
    if got["core"] is None:
        pytest.skip("this faiss-cpu wheel bundles no OpenBLAS")
    assert got["core"] == want
    assert got["env"] is None


def test_the_callers_openblas_coretype_wins():
    got = _probe("Prescott")
    if got["core"] is None:
        pytest.skip("this faiss-cpu wheel bundles no OpenBLAS")
    assert got["core"] == "Prescott" and got["env"] == "Prescott"
