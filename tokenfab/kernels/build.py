"""Building the C library: the sources in csrc/, the compiler flags of each ISA variant, the CPU's flags,
and the build cache keyed on all of them (the package docstring says how they fit). Which variant is loaded,
and whether the kernels are on, is the package's state (__init__.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

log = logging.getLogger("tokenfab.kernels")

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")   # the C sources: *.c + common.h
# -Bsymbolic: each variant's own calls bind inside it, so two variants loaded in one process (set_isa) never mix
FLAGS = ["-O3", "-fopenmp", "-fPIC", "-shared", "-fno-math-errno", "-Wl,-Bsymbolic"]
# variant -> (compiler flags, /proc/cpuinfo flags it needs); lowest first. x86-64-v3 is AVX2+FMA+F16C,
# x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL. -mtune=native keeps this CPU's scheduling and vector-width choice.
ISA_VARIANTS = {
    "avx2": (["-march=x86-64-v3", "-mtune=native"], {"avx2", "fma", "f16c"}),
    "avx_vnni": (["-march=x86-64-v3", "-mavxvnni", "-mtune=native"], {"avx2", "fma", "f16c", "avx_vnni"}),
    "avx512": (["-march=x86-64-v4", "-mtune=native"],
               {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}),
    "avx512_vnni": (["-march=x86-64-v4", "-mavx512vnni", "-mtune=native"],
                    {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_vnni"}),
}
NATIVE = "native"                   # non-x86 machines, or x86 without AVX2: -march=native, whatever it has
ISA_BITS = {1: "avx2", 2: "avx512", 4: "avx512_vnni", 8: "avx_vnni"}   # tf_isa()'s mask (csrc/qdot.c)

_P, _I, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "tf_rms_norm": [_P, _P, _P, _I, _I, _F],
    "tf_rms_norm_bf16": [_P, _P, _P, _I, _I, _F],
    "tf_add_rms_norm": [_P, _P, _P, _P, _P, _I, _I, _F, _I, _I],
    "tf_rope_write_kv": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
    "tf_decode_attention": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F],
    "tf_decode_attention_window": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    "tf_paged_decode_attention": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    "tf_paged_decode_attention_f16": [_P, _P, _I, _P, _P, _P, _I, _P, _I, _I, _I, _I, _I, _F, _I],
    "tf_rope_write_kv_f16": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P],
    "tf_silu_mul": [_P, _P, _I, _I],
    "tf_argmax_rows": [_P, _P, _I, _I, _I],
    "tf_silu_mul_bf16": [_P, _P, _I, _I],
    "tf_gelu_tanh_mul": [_P, _P, _I, _I],
    "tf_qgemm": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_kgemm": [_P, _P, _I, _I, _I, _P, _I],
    "tf_kdequant": [_P, _P, _I, _I, _I],
    "tf_kdequant_bf16": [_P, _P, _I, _I, _I],
    "tf_qdot": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_qtile": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_qtile_ref": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_qtile_vnni": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_qbf16": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_qmadd": [_P, _P, _I, _I, _I, _P, _P, _P, _I, _I],
    "tf_decode_layers": [_P, _I, _I, _I, _P, _I, _I, _I, _I, _F, _I, _P, _I, _F],
    "tf_pool_stats": [_P],
    "tf_pool_config": [_I, _I, _I],
    "tf_pool_threads": [_I],
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_dir() -> str:
    root = os.environ.get("TOKENFAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "tokenfab")
    return os.path.join(root, "kernels")


def cpu_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it can't be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def available_isas() -> list[str]:
    """The ISA variants this CPU can run, lowest first (["native"] off x86-64 or without AVX2)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return [NATIVE]
    have = cpu_flags()
    ok = [name for name, (_, needs) in ISA_VARIANTS.items() if needs <= have]
    return ok or [NATIVE]


def sources() -> list[str]:
    """The library's C files (csrc/*.c, sorted by name), compiled in one gcc command into one shared library."""
    return [os.path.join(SOURCE_DIR, name) for name in sorted(os.listdir(SOURCE_DIR)) if name.endswith(".c")]


def source_digest() -> bytes:
    """sha256 of every source and header file in csrc/ (each one's name and contents, sorted by name): any
    edit, added, removed or renamed file changes it (the build cache's key, the kernel table's too)."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(SOURCE_DIR)):
        if name.endswith((".c", ".h")):
            with open(os.path.join(SOURCE_DIR, name), "rb") as f:
                data = f.read()
            h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.digest()


def build_library(isa: str) -> ctypes.CDLL | None:
    """The `isa` variant of the library, compiled (or taken from the cache) and loaded; None when it can't be."""
    cc = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        log.warning("no C compiler found: tokenfab's CPU kernels are off, the torch path runs instead")
        return None
    srcs, digest = sources(), source_digest()
    flags = FLAGS + (ISA_VARIANTS[isa][0] if isa in ISA_VARIANTS else ["-march=native"])
    key = hashlib.sha256(digest + " ".join([cc] + flags).encode() + _cpu_model().encode()).hexdigest()[:16]
    path = os.path.join(_cache_dir(), f"cpu-{isa}-{key}.so")
    if not os.path.exists(path):
        os.makedirs(_cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=_cache_dir())
        os.close(fd)
        proc = subprocess.run([cc, *flags, *srcs, "-o", tmp, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            os.unlink(tmp)
            log.warning("building tokenfab's CPU kernels failed, the torch path runs instead:\n%s",
                        proc.stderr.strip()[-2000:])
            return None
        os.replace(tmp, path)        # atomic: concurrent builders never load a half-written file
    lib = ctypes.CDLL(path)
    for name, args in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, None
    lib.tf_isa.argtypes, lib.tf_isa.restype = [], ctypes.c_int64
    lib.tf_amx_available.argtypes, lib.tf_amx_available.restype = [], ctypes.c_int64
    lib.tf_qtile_vnni.restype = ctypes.c_int64
    lib.tf_amx_bf16_available.argtypes, lib.tf_amx_bf16_available.restype = [], ctypes.c_int64
    return lib
