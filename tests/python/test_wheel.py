"""The distributable wheel: `pip wheel .` builds exactly one platform wheel holding the Python
package and ortbridge._C, the module links no ONNX Runtime, torch or CUDA library, and the wheel,
installed into a fresh virtualenv, runs examples/quickstart.py.

SLOW (about a minute on a 2-core machine): the module fixture compiles the C++ library from scratch, in a
build folder of its own under pytest's temporary directory, so the editable install's
build/{wheel_tag} is left alone and no earlier build is reused. The quickstart then runs once.

The virtualenv has no system site-packages of its own: torch, onnxruntime and the other
requirements come from this interpreter's site-packages through a plain path line in a .pth file,
added after the wheel is installed. A path line puts the folder on sys.path without processing
the .pth files inside it, so the editable install's finder (scikit-build-core's
_editable_skbc_ortbridge.pth, which would take `import ortbridge` to the source tree) never loads,
and the venv's own site-packages, first on sys.path, supplies the wheel's ortbridge."""

import os
import re
import shutil
import site
import subprocess
import sys
import sysconfig
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python" / "ortbridge"
# (one wheel: under pytest-xdist's --dist loadgroup these tests share one worker, and its fixtures)
pytestmark = pytest.mark.xdist_group("wheel")
EXT_SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")  # e.g. .cpython-311-x86_64-linux-gnu.so
PY_TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"
PLATFORM_TAG = sysconfig.get_platform().replace("-", "_").replace(".", "_")  # e.g. linux_x86_64
# What the module may link: the C/C++ runtime (the system libraries every manylinux policy allows).
SYSTEM_LIBS = re.compile(
    r"^(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|ld-linux-x86-64|"
    r"ld-linux-aarch64)\.so(\.\d+)*$"
)
FORBIDDEN = ("libonnxruntime", "libtorch", "libc10", "libcudart", "libcuda", "libpython")


def _tail(text: str, n: int = 60) -> str:
    return "\n".join(text.splitlines()[-n:])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Runs `pip wheel .` from the repository root; returns (wheel folder, wheel paths)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel_dir, build_dir = tmp / "dist", tmp / "build"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-build-isolation",
        "--no-deps",
        "--no-index",
        "-w",
        str(wheel_dir),
        f"--config-settings=build-dir={build_dir}",
    ]
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    took = time.monotonic() - start
    assert done.returncode == 0, (
        f"`pip wheel .` failed (exit {done.returncode}):\n{_tail(done.stdout)}\n{_tail(done.stderr)}"
    )
    # the build ran in the folder given, not in the editable install's build/{wheel_tag}
    assert (build_dir / "CMakeCache.txt").is_file(), f"no CMake build in {build_dir}:\n{_tail(done.stdout)}"
    print(f"\n`pip wheel .` took {took:.0f} s")
    return wheel_dir, sorted(wheel_dir.glob("*.whl"))


@pytest.fixture(scope="module")
def wheel(built):
    _, wheels = built
    assert len(wheels) == 1, f"expected one wheel, got {[w.name for w in wheels]}"
    return wheels[0]


def test_one_platform_wheel(built):
    wheel_dir, wheels = built
    names = [w.name for w in wheels]
    assert len(wheels) == 1, f"expected exactly one wheel, got {names}"
    assert sorted(p.name for p in wheel_dir.iterdir()) == names, "`pip wheel --no-deps` wrote more than the wheel"
    m = re.fullmatch(r"ortbridge-([^-]+)-(cp3\d+)-(cp3\d+)-([a-z0-9_]+)\.whl", names[0])
    assert m, f"not a CPython platform wheel name: {names[0]}"
    assert m.group(2) == m.group(3) == PY_TAG, names[0]  # an extension module: not py3-none, not abi3
    assert m.group(4) == PLATFORM_TAG, names[0]
    with zipfile.ZipFile(wheels[0]) as z:
        meta = z.read(f"ortbridge-{m.group(1)}.dist-info/WHEEL").decode()
    assert "Root-Is-Purelib: false" in meta, meta
    assert re.findall(r"^Tag: (.+)$", meta, re.M) == [f"{PY_TAG}-{PY_TAG}-{PLATFORM_TAG}"], meta


def test_wheel_holds_the_package_and_the_module(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        metadata = z.read(f"{dist_info}/METADATA").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
    module = f"ortbridge/_C{EXT_SUFFIX}"
    assert module in names, (
        f"{module} missing from the wheel: {sorted(n for n in names if n.startswith('ortbridge/_C'))}"
    )
    assert [n for n in names if re.fullmatch(r"ortbridge/_C.*\.so", n)] == [module]
    sources = {
        "ortbridge/" + p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts
    }
    assert "ortbridge/__init__.py" in sources
    assert not sources - names, f"package files missing from the wheel: {sorted(sources - names)}"
    stray = sorted(n for n in names if not n.startswith(("ortbridge/", f"{dist_info}/")) or "__pycache__" in n)
    assert not stray, f"the wheel holds files outside the package: {stray}"
    # one wheel for CPU and GPU ONNX Runtime: the runtime comes from an extra, never unconditionally
    requires = re.findall(r"^Requires-Dist: (.+)$", metadata, re.M)
    ort = [r for r in requires if re.match(r"onnxruntime(-gpu)?\b", r)]
    assert ort and all("extra ==" in r for r in ort), f"onnxruntime must come from an extra: {requires}"
    assert "torch_dynamo_backends" in entry_points and "ortbridge.training.backend:ortbridge" in entry_points


def test_module_links_no_runtime_library(wheel, tmp_path):
    readelf = shutil.which("readelf")
    assert readelf, "readelf (binutils) is needed to read the module's NEEDED entries"
    with zipfile.ZipFile(wheel) as z:
        so = Path(z.extract(f"ortbridge/_C{EXT_SUFFIX}", tmp_path))
    dyn = subprocess.run([readelf, "-d", str(so)], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dyn)
    print("\nNEEDED:", ", ".join(needed))
    assert needed, f"readelf found no NEEDED entries:\n{dyn}"
    bad = [n for n in needed if n.startswith(FORBIDDEN)]
    assert not bad, f"ortbridge._C links {bad}: the wheel must serve every torch and ORT build"
    assert all(SYSTEM_LIBS.match(n) for n in needed), f"ortbridge._C links more than the C/C++ runtime: {needed}"
    assert not re.search(r"\((RPATH|RUNPATH)\)", dyn), f"ortbridge._C carries a search path:\n{dyn}"


def test_quickstart_runs_from_the_wheel_in_a_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "--no-deps",
            "--no-index",
            "--no-cache-dir",
            str(wheel),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, f"installing the wheel failed:\n{install.stdout}\n{install.stderr}"
    purelib = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    assert (purelib / "ortbridge" / f"_C{EXT_SUFFIX}").is_file(), f"the wheel did not install into {purelib}"
    # The requirements (torch, onnxruntime, onnx, ...) from this interpreter, as plain path lines
    # (see the module docstring); written after the install, so pip saw an empty venv.
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    (purelib / "_ortbridge_test_requirements.pth").write_text("".join(f"{d}\n" for d in dirs))

    examples = tmp_path / "examples"
    shutil.copytree(ROOT / "examples", examples, ignore=shutil.ignore_patterns("*.onnx", "__pycache__"))
    driver = (
        "import runpy, sys\n"
        "sys.argv = ['quickstart.py']\n"
        "runpy.run_path('quickstart.py', run_name='__main__')\n"
        "import ortbridge, ortbridge._C\n"
        "print('ORTBRIDGE_FILE', ortbridge.__file__)\n"
        "print('ORTBRIDGE_C_FILE', ortbridge._C.__file__)\n"
        "print('FINDERS', [f.__module__ + '.' + (f if isinstance(f, type) else type(f)).__qualname__ for f in sys.meta_path])\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    start = time.monotonic()
    run = subprocess.run(
        [str(python), "-s", "-c", driver], cwd=examples, env=env, capture_output=True, text=True, timeout=600
    )
    took = time.monotonic() - start
    assert run.returncode == 0, f"the quickstart failed (exit {run.returncode}):\n{run.stdout}\n{_tail(run.stderr)}"
    print(f"\nquickstart from the wheel took {took:.0f} s:\n{run.stdout}")
    found = dict(re.findall(r"^(ORTBRIDGE_FILE|ORTBRIDGE_C_FILE) (.+)$", run.stdout, re.M))
    for key in ("ORTBRIDGE_FILE", "ORTBRIDGE_C_FILE"):
        assert Path(found[key]).resolve().is_relative_to(purelib.resolve()), (
            f"ortbridge was not imported from the venv: {key} {found[key]} (venv: {purelib})"
        )
    assert "_editable" not in run.stdout.split("FINDERS", 1)[1], f"the editable install's finder loaded:\n{run.stdout}"
    assert "OrtModule" in run.stdout and "max abs diff" in run.stdout, run.stdout
    assert (examples / "quickstart.onnx").is_file()
