"""Test-only build of the kernels with SIMDe emulating AVX-512: engine.kernels._kernels_simde.

The product module (engine.kernels._kernels, setup.py) compiled once more from the same sources
and flags (setup.kernel_extension) with -DRQ_SIMDE_AVX512: engine/kernels/simd.h then compiles
the AVX-512 (and AVX-VNNI) functions for AVX2 + FMA + F16C with SIMDe's emulation of the 512-bit
intrinsics, and the module's avx512 path runs on any CPU with AVX2 + FMA + F16C. So the AVX-512
kernels are tested on machines without AVX-512 (tests/test_kernels.py's "avx512-simde" path),
and on machines with it the two builds must agree bit for bit. Never imported by the product.

Built on demand by the `kernels_simde` session fixture (tests/conftest.py) into
$RQLLM_SIMDE_CACHE (default ~/.cache/rqllm/simde-kernels)/<hash of the kernel sources, this
file, SIMDe, the compiler and Python>, so a run builds it at most once (about two minutes, in the
background from the start of the session: tests/conftest.py) and later runs reuse it until a source
changes. Prebuild: python -m tests.simde_build
Needs SIMDe's headers (Debian: libsimde-dev; .ci/run installs it), else the tests skip; another
location: RQLLM_SIMDE_INCLUDE=<dir holding simde/>.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "engine" / "kernels"
MODULE = "engine.kernels._kernels_simde"
MACRO = "RQ_SIMDE_AVX512"


class Unavailable(Exception):
    """This machine cannot build or run the SIMDe module (the tests skip with this reason)."""


def simde_include_dir() -> Path | None:
    """The directory holding simde/x86/avx512.h, or None."""
    dirs = [os.environ["RQLLM_SIMDE_INCLUDE"]] if os.environ.get("RQLLM_SIMDE_INCLUDE") else []
    for d in dirs + ["/usr/include", "/usr/local/include"]:
        if (Path(d) / "simde" / "x86" / "avx512.h").is_file():
            return Path(d)
    return None


def _inputs(root: Path) -> list[Path]:
    """Files of the checkout `root` that decide the build: the kernel sources (not Cython's
    generated C), the parts quants.c includes (engine/kernels/quants/) and setup.py."""
    kdir = root / "engine" / "kernels"
    return [p for p in sorted(kdir.iterdir())
            if p.suffix in (".c", ".h", ".pyx", ".pxi") and not (p.suffix == ".c" and p.name.startswith("_"))] + \
        sorted((kdir / "quants").glob("*.c")) + [root / "setup.py"]


def build_key(root: Path, include: Path) -> str:
    h = hashlib.sha256()
    for p in _inputs(root) + [Path(__file__).resolve()]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update((include / "simde" / "simde-common.h").read_bytes())
    try:
        cc = subprocess.run([os.environ.get("CC", "cc"), "--version"], capture_output=True, text=True).stdout
    except OSError:
        cc = ""
    h.update(cc.encode())
    h.update(f"{sys.version} {sysconfig.get_config_var('EXT_SUFFIX')} {platform.machine()}".encode())
    return h.hexdigest()[:20]


def cache_root() -> Path:
    return Path(os.environ.get("RQLLM_SIMDE_CACHE") or Path.home() / ".cache" / "rqllm" / "simde-kernels")


def _built(dest: Path) -> Path | None:
    found = sorted(dest.glob("_kernels_simde*.so"))
    return found[0] if found else None


def build(log=None) -> Path:
    """Path of the built module's shared object, building it if this key has none yet."""
    if platform.machine() not in ("x86_64", "AMD64", "i386", "i686"):
        raise Unavailable(f"the SIMDe build emulates x86 AVX-512 on AVX2; this is {platform.machine()}")
    include = simde_include_dir()
    if include is None:
        raise Unavailable("SIMDe headers not found (/usr/include/simde: apt-get install libsimde-dev, "
                          "or RQLLM_SIMDE_INCLUDE=<dir holding simde/>)")
    dest = cache_root() / build_key(ROOT, include)
    so = _built(dest)
    if so:
        return so
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / (dest.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)          # another process may be building the same key
        so = _built(dest)
        if so:
            return so
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(dir=dest.parent, prefix="tmp-") as tmp:
            # compile a copy, so the key names what was compiled even if a file changes meanwhile
            src = Path(tmp) / "src"
            for p in _inputs(ROOT):
                (src / p.relative_to(ROOT)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, src / p.relative_to(ROOT))
            dest = dest.parent / build_key(src, include)
            if _built(dest):
                return _built(dest)
            cmd = [sys.executable, str(Path(__file__).resolve()), "--build-into", tmp, "--include", str(include)]
            proc = subprocess.run(cmd, cwd=str(src), capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"building {MODULE} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-12000:]}")
            if _built(Path(tmp) / "out") is None:
                raise RuntimeError(f"building {MODULE} made no module:\n{proc.stdout[-4000:]}")
            os.replace(Path(tmp) / "out", dest)
        if log:
            log(f"built {MODULE} in {time.monotonic() - t0:.0f} s: {dest}")
    _prune(dest)
    return _built(dest)


def start_in_background() -> subprocess.Popen | None:
    """Start the build in a child process when this key has none yet (None otherwise), so that a
    test session runs other tests during its ~2 minutes; build() then waits for it on the lock."""
    include = simde_include_dir()
    if platform.machine() not in ("x86_64", "AMD64") or include is None or _built(cache_root() / build_key(ROOT, include)):
        return None
    return subprocess.Popen([sys.executable, "-m", "tests.simde_build"], cwd=str(ROOT),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _prune(keep: Path, newest: int = 3, minutes: float = 30.0) -> None:
    """Drop builds of other sources (~200 MB each, one per change of the kernels): all but the
    newest few, once they are half an hour old (another checkout's run may still be loading one)."""
    builds = sorted((d for d in keep.parent.iterdir() if d.is_dir() and not d.name.startswith("tmp-") and d != keep),
                    key=lambda d: d.stat().st_mtime, reverse=True)
    for d in builds[newest - 1:]:
        if time.time() - d.stat().st_mtime > minutes * 60:
            shutil.rmtree(d, ignore_errors=True)
            with contextlib.suppress(OSError):
                (d.parent / (d.name + ".lock")).unlink()


def load(log=None):
    """The SIMDe module (built if needed), imported from the cache."""
    so = build(log)
    spec = importlib.util.spec_from_file_location(MODULE, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if not mod.cpu_supports("avx512"):
        raise Unavailable("this CPU lacks AVX2 + FMA + F16C, which the emulated AVX-512 path needs")
    return mod


def _build_into(tmp: Path, include: Path) -> None:
    """(In a child process.) Cython + compile the copy of the sources in tmp/src into tmp/out."""
    import runpy

    from Cython.Build import cythonize
    from setuptools import setup

    src = tmp / "src"
    kdir = src / "engine" / "kernels"
    cfg = runpy.run_path(str(src / "setup.py"))       # kernel_extension(); setup() runs only as a script
    pyx = tmp / "_kernels_simde.pyx"
    pyx.write_text((kdir / "_kernels.pyx").read_text())   # its `include`s resolve to kdir
    ext = cfg["kernel_extension"](name=MODULE, pyx=str(pyx), root=str(src), define_macros=[(MACRO, "1")])
    ext.extra_compile_args.append("-Wno-psabi")   # SIMDe passes 512-bit vectors to AVX2 functions by value
    # -O1 and no debug info: quants.c with SIMDe's emulation inlined compiles in ~110 s of one core
    # instead of ~510 s at the product's -O3 (GCC 12, Zen 3): most of a fresh CI run's CPU, beside the
    # suite. The float results do not depend on it: the kernels' float operations are intrinsics, and
    # GCC reorders no float sum at any level without -ffast-math. -fexpensive-optimizations keeps one
    # thing -O2/-O3 do to plain C: contracting a * b + c into an FMA (GCC's widening-mul pass). All the
    # avx512-simde tests (bit for bit against the AVX2 path) pass with it, as with -O3.
    ext.extra_compile_args += ["-O1", "-fexpensive-optimizations", "-g0"]
    if include not in (Path("/usr/include"), Path("/usr/local/include")):
        ext.include_dirs.append(str(include))
    exts = cythonize([ext], language_level=3, compiler_directives=cfg["CYTHON_DIRECTIVES"],
                     include_path=[str(kdir)], build_dir=str(tmp / "cython"), quiet=True)
    setup(name="rqllm-kernels-simde", ext_modules=exts, cmdclass={"build_ext": cfg["ParallelBuildExt"]}, script_args=[
        "-q", "build_ext", "--build-lib", str(tmp / "lib"), "--build-temp", str(tmp / "obj")])
    (tmp / "out").mkdir()
    for so in (tmp / "lib").rglob("_kernels_simde*.so"):
        shutil.copy2(so, tmp / "out" / so.name)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--build-into" and sys.argv[3] == "--include":
        _build_into(Path(sys.argv[2]), Path(sys.argv[4]))
    else:
        with contextlib.suppress(KeyboardInterrupt):
            try:
                print(build(log=print))
            except Unavailable as e:
                sys.exit(f"not built: {e}")
