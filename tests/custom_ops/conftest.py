"""``kernels``: runs a test once per native kernel build (AVX512, AVX2 on x86, DEFAULT/NEON on ARM64) that
this CPU runs, with the ops calling that build's kernels; the builds it cannot run are skipped with the
reason. So an AVX-512 machine tests the AVX2 kernels as an AVX2-only machine runs them."""

import pytest

from autodeploy.custom_ops import native

BUILDS = ("AVX512", "AVX2", "DEFAULT")


@pytest.fixture(params=BUILDS)
def kernels(request) -> str:
    if native.library() is None:
        pytest.skip("the native kernels do not build or load here")
    if request.param not in native.runnable_capabilities():
        pytest.skip(f"this CPU does not run the {request.param} kernels")
    with native.use_kernels(request.param):
        yield request.param
