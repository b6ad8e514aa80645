"""Building and registering this package's C++ CPU kernels (XLA FFI custom calls).

Each kernel is one C++ source (beside this module: ``cpu_matmul.cc``, ``cpu_matmul_amx.cc``,
``cpu_matmul_bf16.cc``, ``cpu_attention.cc``; the training loss's ``training/cpu_vocab_loss.cc``)
that includes the headers here (``cpu_parallel.h``: work items on XLA's threads; ``cpu_lanes.h``:
masks and exp of 16 lanes; ``cpu_matmul_handlers.h``: the matmul kernels' FFI handlers).
:func:`register` compiles a source with the host's C++ compiler (``$CXX``, else ``c++``;
``-O3 -mavx512f`` and the source's own instruction-set flags) into :func:`storage.cache_dir` on
first use (a few seconds, once per source, header, flags and jaxlib version; atomically, so
concurrent processes never load a partial library), loads it and registers its handlers with
XLA for the CPU platform.
:func:`usable` says whether a kernel may run here at all: it is switched on (its environment
variable is not "0"), JAX's default backend is the CPU (a TPU VM's host has AVX-512, but its
programs run on the TPU) and the host has AVX-512; :func:`has_cpu_flags` and
:func:`allow_amx` check what a kernel needs beyond that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax

from dspark_jax import storage

HERE = Path(__file__).parent
HEADERS = (HERE / "cpu_parallel.h", HERE / "cpu_lanes.h",  # in each build's key
           HERE / "cpu_matmul_handlers.h")
FLAGS = ("-O3", "-mavx512f", "-mfma", "-std=c++17", "-fPIC", "-shared")
log = logging.getLogger(__name__)
_REGISTERED: dict[str, str] = {}  # source file name -> its library's file name (with the build key)


def has_cpu_flags(*names: str) -> bool:
    """Whether this host is x86-64 and its CPU lists every flag of ``names`` in /proc/cpuinfo
    (e.g. "avx512f", "amx_bf16")."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines()
                  if line.startswith("flags")), [])
    return all(name in flags for name in names)


ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA, SYS_ARCH_PRCTL = 0x1023, 18, 158  # Linux x86-64


@functools.cache
def allow_amx() -> bool:
    """Asks Linux for this process's permission to use the AMX tile registers (``arch_prctl
    (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``, process-wide, once); whether it was given."""
    if platform.system() != "Linux" or not has_cpu_flags("amx_tile"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        log.info("the AMX tile data state was refused (errno %d)", ctypes.get_errno())
        return False
    return True


def usable(switch: str, what: str) -> bool:
    """Whether a kernel switched by the environment variable ``switch`` may run here (its
    reason logged when not); ``what`` names the work that otherwise stays XLA's."""
    if os.environ.get(switch, "1") == "0" or jax.default_backend() != "cpu":
        return False
    if not has_cpu_flags("avx512f"):
        log.info("no AVX-512 on this host; %s stay XLA's", what)
        return False
    return True


def unsharded() -> bool:
    """Whether the program being traced runs on one device: no mesh of several devices is set.
    A custom call has no sharding rule, so under such a mesh XLA would gather its operands to
    every device; the callers then take XLA's own (partitioned) ops instead."""
    mesh = jax.sharding.get_abstract_mesh()
    return mesh.empty or mesh.size == 1


def build(source: Path, flags: tuple[str, ...] = ()) -> Path:
    """The shared library of ``source``, compiled (with :data:`FLAGS` and ``flags``) into the
    cache if not there yet (a temporary file renamed into place)."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        raise RuntimeError("no C++ compiler ($CXX, c++ or g++)")
    include = jax.ffi.include_dir()
    text = b"".join(p.read_bytes() for p in (source, *HEADERS))
    flags = (*FLAGS, *flags)
    key = hashlib.sha256(text + " ".join(flags).encode() + jax.__version__.encode()
                         + include.encode()).hexdigest()[:16]
    folder = storage.cache_dir() / "kernels"
    library = folder / f"{source.stem}-{key}.so"
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        fd, partial = tempfile.mkstemp(dir=folder, suffix=".so.partial")
        os.close(fd)
        try:
            subprocess.run([compiler, *flags, f"-I{include}", f"-I{HERE}", str(source),
                            "-o", partial], check=True, capture_output=True, text=True)
            os.replace(partial, library)
        except subprocess.CalledProcessError as e:
            raise RuntimeError(f"{compiler} failed on {source.name}:\n{e.stderr[-2000:]}") from e
        except OSError as e:
            raise RuntimeError(f"cannot run the C++ compiler {compiler!r}: {e}") from e
        finally:
            if os.path.exists(partial):
                os.remove(partial)
    return library


def register(source: Path, handlers: dict[str, str], what: str,
             flags: tuple[str, ...] = ()) -> bool:
    """Builds (with ``flags`` beside :data:`FLAGS`) and loads ``source`` and registers its
    handler symbols as FFI targets (``handlers``: target name -> symbol) on the CPU; False,
    with the reason logged, where that fails (``what`` names the work that then stays XLA's)."""
    try:
        path = build(source, flags)
        library = ctypes.cdll.LoadLibrary(str(path))
    except (OSError, RuntimeError) as e:
        log.warning("%s: the kernel is unavailable (%s); %s stay XLA's", source.name, e, what)
        return False
    for target, symbol in handlers.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                    platform="cpu")
    _REGISTERED[source.name] = path.name
    return True


def registered() -> tuple[str, ...]:
    """The kernel libraries registered in this process so far, each named with its build key
    (the hash of its source, headers, flags and jaxlib): a program's StableHLO names a custom
    call only by its target, so what measures a program's speed (a steps/s profile's cache
    key) adds these."""
    return tuple(sorted(_REGISTERED.values()))
