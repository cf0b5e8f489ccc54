"""spec's CPU kernels build wherever the CPU can run them, in both variants: the other tests skip where the build
fails (a machine without a compiler), so a build broken for one variant would only show as slowness."""

import shutil
import subprocess
import sysconfig

import pytest

from spec_cli.exec import native


def test_the_kernels_build_on_every_cpu_that_runs_them():
    if not native.wanted() or native.variant() is None or shutil.which("c++") is None:
        pytest.skip("no variant of spec's kernels for this machine, or no compiler")
    assert native.int4() is not None, native.status()
    assert native.status() == native.NAMES[native.variant()]


@pytest.mark.slow
@pytest.mark.parametrize("target", ("avx512", "avx2"))
@pytest.mark.parametrize("source", native.SOURCES, ids=lambda path: path.name)
def test_each_kernel_file_compiles_alone(source, target):
    """Each file says what it uses (kernels.h, simd.h): it compiles as its own translation unit, though the build
    puts them all in one, with the build's own flags, for AVX2 too, behind avx2.h (whatever this CPU runs). Compiled,
    not only parsed: an intrinsic the flags do not enable fails only where GCC inlines it."""
    from torch.utils import cpp_extension

    if shutil.which("c++") is None:
        pytest.skip("no compiler")
    includes = [f"-I{path}" for path in cpp_extension.include_paths() + [sysconfig.get_paths()["include"]]]
    flags = ["-std=c++17", "-c", "-O1", "-o", "/dev/null", "-fopenmp", "-DTORCH_EXTENSION_NAME=alone",
             *native.compile_flags(target),
             *(["-include", str(source.with_name("avx2.h"))] if target == "avx2" else [])]
    done = subprocess.run(["c++", *flags, *includes, str(source)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
