"""The native product kernels (autodeploy.custom_ops.native): the library builds where the machine can build
it, and the loader falls back cleanly (disabled, no compiler, compile errors). The int8 kernel's products
match a float64 reference to its 16-bit activation rounding, the float32 one's to float32 rounding, on every
tile and pass shape."""

import ctypes
import os
import platform
import subprocess
import sys

import pytest
import torch

import autodeploy.custom_ops  # noqa: F401  (registers the ops)
from autodeploy.custom_ops import native
from autodeploy.custom_ops.quant_linear import quantize_per_channel_int8

HAS_COMPILER = native._compiler() is not None  # $CXX, as the loader reads it
CAN_LOAD = HAS_COMPILER and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64")


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """library() loading from scratch (nothing loaded in this process) out of a temporary cache; the
    process's loaded library is restored afterwards (an operator registers once per process)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(native, "_loaded", None)
    monkeypatch.setattr(native, "_kernel_libraries", {})
    native.library.cache_clear()
    yield tmp_path
    native.library.cache_clear()


@pytest.mark.skipif(not HAS_COMPILER, reason="needs a C++ compiler")
def test_build_is_cached_per_source_and_flags(fresh_library):
    build = lambda flags: native._build(native._compiler(), "ops", native._OP_SOURCE, flags)  # noqa: E731
    path = build([])
    assert path.is_file() and path.parent == fresh_library / "autodeploy" / "native"
    assert list(path.parent.iterdir()) == [path]  # no scratch files left
    mtime = path.stat().st_mtime_ns
    assert build([]) == path and path.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert build(["-DAUTODEPLOY_OTHER_FLAGS"]) != path  # other flags, another build


def test_library_is_available_where_the_machine_can_build_it():
    runs = native.runnable_capabilities()
    assert (native.library() is not None) == (CAN_LOAD and bool(runs))
    assert native.int8_gemv_available() == (native.library() is not None)
    if runs:
        assert native.capability() == runs[0]  # the best build this CPU runs


def test_the_build_follows_torchs_cpu_capability(monkeypatch):
    """The kernels' build is the one torch picks for its own kernels (ATEN_CPU_CAPABILITY lowers it)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("x86 capabilities")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert native.runnable_capabilities() == ("AVX2",)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    assert native.runnable_capabilities() == ()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert native.runnable_capabilities() == ("AVX512", "AVX2")


def test_use_kernels_rejects_a_build_this_cpu_does_not_run():
    if native.library() is None:
        pytest.skip("no native kernels here")
    with pytest.raises(ValueError, match="do not run here"):
        with native.use_kernels("NO_SUCH_BUILD"):
            pass


def test_disabled_by_environment(fresh_library, monkeypatch):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.library() is None
    assert not (fresh_library / "autodeploy" / "native").exists()


def test_compile_error_falls_back_with_a_warning(fresh_library, monkeypatch, tmp_path, capsys):
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native, "_OP_SOURCE", broken)
    assert native.library() is None
    err = capsys.readouterr().err
    assert "native kernels unavailable" in err and "failed" in err
    # the failed build leaves no partial file behind
    assert list((fresh_library / "autodeploy" / "native").glob("*")) == []


def test_missing_compiler_falls_back(fresh_library, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert native.library() is None


def _reference(x, q, scale):
    return x.double() @ (q.double() * scale.double()[:, None]).T


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("n, k", [(4, 64), (7, 128), (37, 192)])  # tile tails: N not a multiple of 4
def test_int8_gemv_against_float64(rows, n, k, kernels):
    gen = torch.Generator().manual_seed(rows * 100 + n)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    q, scale = quantize_per_channel_int8(weight)
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    out = torch.ops.auto_deploy.int8_gemv(x, q, scale)
    ref = _reference(x, q, scale)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # each activation is off by at most half a 16-bit step of its row's largest value; float32 output
    step = x.abs().amax(1, keepdim=True).double() / 32767
    bound = k * 0.5 * step * (q.double().abs() * scale.double()[:, None]).amax() + 1e-6 * ref.abs()
    assert bool(((out.double() - ref).abs() <= bound).all())
    # the bound is tight enough to reject a mis-scaled or a transposed result
    assert bool(((_reference(x, q, scale.flip(0)) - ref).abs() > bound).any())
    assert bool(((_reference(x.flip(1), q, scale) - ref).abs() > bound).any())


def test_int8_gemv_keeps_leading_dims_and_zero_rows(kernels):
    q, scale = quantize_per_channel_int8(torch.randn(8, 64))
    x = torch.randn(2, 3, 64)
    x[0, 1] = 0  # an all-zero row must give zeros, not NaN
    out = torch.ops.auto_deploy.int8_gemv(x, q, scale)
    assert out.shape == (2, 3, 8)
    assert torch.equal(out[0, 1], torch.zeros(8))
    torch.testing.assert_close(out.reshape(6, 8), torch.ops.auto_deploy.int8_gemv(x.reshape(6, 64), q, scale),
                               atol=0, rtol=0)


def test_takes_only_supported_inputs():
    q, scale = quantize_per_channel_int8(torch.randn(8, 64))
    x = torch.randn(1, 64)
    assert native.int8_gemv_takes(x, q, scale)
    assert not native.int8_gemv_takes(x.bfloat16(), q, scale)  # float32 activations only
    assert not native.int8_gemv_takes(x, q, scale.float())  # bfloat16 scales
    q96, s96 = quantize_per_channel_int8(torch.randn(8, 96))
    assert not native.int8_gemv_takes(torch.randn(1, 96), q96, s96)  # K a multiple of 64
    assert not native.int8_gemv_takes(x, q.t().contiguous().t(), scale)  # contiguous weight


def test_int8_gemv_no_rows(kernels):
    q, scale = quantize_per_channel_int8(torch.randn(8, 64))
    assert torch.ops.auto_deploy.int8_gemv(torch.randn(0, 64), q, scale).shape == (0, 8)


def test_operator_takes_what_the_kernel_does_not_with_the_same_arithmetic(kernels):
    """Inputs the kernel cannot take (bf16 activations, K not a multiple of 64) run the plain-torch
    implementation's arithmetic in ATen: the op runs everywhere."""
    from autodeploy.custom_ops.quant_linear import int8_gemv_reference

    native.library()
    q, scale = quantize_per_channel_int8(torch.randn(8, 96))
    for x, w in ((torch.randn(3, 96).bfloat16(), q), (torch.randn(3, 32), q[:, :32].contiguous())):
        torch.testing.assert_close(torch.ops.auto_deploy.int8_gemv(x, w, scale), int8_gemv_reference(x, w, scale),
                                   atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="needs x"):
        torch.ops.auto_deploy.int8_gemv(torch.randn(1, 32), q, scale)
    torch.library.opcheck(torch.ops.auto_deploy.int8_gemv.default, (torch.randn(2, 96), q, scale))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 16, 17, 40])  # passes of 4 rows and their tails; groups
# of 16 (18 on AVX2)
@pytest.mark.parametrize("n, k", [(1, 16), (7, 48), (61, 96), (200, 768), (13, 1040)])  # tile tails; prefetch past
# the end; K in chunks of 512 and a tail chunk of 16
def test_f32_linear_against_float64(rows, n, k, kernels):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    weight = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 3, rows)[:, None]
    out = torch.ops.auto_deploy.f32_linear(x, weight)
    ref = x.double() @ weight.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    # float32 sums of k products: each off by at most a few ulps of the sum of magnitudes
    bound = 4 * k * 2**-24 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((out.double() - ref).abs() <= bound).all())
    # tight enough to reject a product that drops the last 16 columns of k, or a shifted output row
    assert bool(((x[:, :-16].double() @ weight[:, :-16].double().T - ref).abs() > bound).any())
    if n > 1:
        assert bool(((ref.roll(1, dims=1) - ref).abs() > bound).any())


def test_f32_linear_bias_shapes_and_large_batches(kernels):
    weight, bias = torch.randn(10, 32), torch.randn(10)
    x = torch.randn(2, 3, 32)
    out = torch.ops.auto_deploy.f32_linear(x, weight)
    assert out.shape == (2, 3, 10)
    torch.testing.assert_close(out.reshape(6, 10), torch.ops.auto_deploy.f32_linear(x.reshape(6, 32), weight),
                               atol=0, rtol=0)
    torch.testing.assert_close(torch.ops.auto_deploy.f32_linear(x, weight, bias), out + bias, atol=0, rtol=0)
    assert torch.ops.auto_deploy.f32_linear(torch.randn(0, 32), weight).shape == (0, 10)
    strided = torch.randn(32, 4).t()  # rows of x need not be contiguous
    torch.testing.assert_close(torch.ops.auto_deploy.f32_linear(strided, weight), strided @ weight.T,
                               atol=1e-5, rtol=1e-5)
    # past the build's f32_max_rows rows the operator is torch's fastest float32 GEMM, bit for bit: oneDNN's
    # linear on x86 (where torch has oneDNN), torch's linear elsewhere
    limit = native.f32_max_rows()
    assert limit >= 16  # decode batches take the kernels on every build
    big = torch.randn(limit + 1, 32)
    x86 = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkldnn.is_available()
    dense = (torch.ops.mkldnn._linear_pointwise(big, weight, bias, "none", [], "") if x86
             else torch.nn.functional.linear(big, weight, bias))
    assert torch.equal(torch.ops.auto_deploy.f32_linear(big, weight, bias), dense)
    torch.testing.assert_close(dense, big.double().matmul(weight.double().T).add(bias).float(), atol=1e-5, rtol=1e-5)
    three_d = torch.randn(2, limit, 32)  # a batch of prompts
    torch.testing.assert_close(torch.ops.auto_deploy.f32_linear(three_d, weight),
                               three_d.double().matmul(weight.double().T).float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_product_does_not_depend_on_the_rows_beside_it(dtype, kernels):
    """Continuous batching puts a sequence's decode row beside any number of others: the float32 and 16-bit
    products give each row the same float32 result, bit for bit, whether it runs alone (one weight row after
    the other), in a tiled pass of a few rows, or in a batch of up to the build's kernel rows (40 here on x86:
    groups of 16 rows, 18 on AVX2, partial sums kept between chunks of K; 16 on NEON, whose kernels take decode
    batches only)."""
    gen = torch.Generator().manual_seed(11)
    weight = torch.randn(37, 1536, generator=gen).to(dtype)  # K = 1536: three chunks of 512
    limit = native.f32_max_rows() if dtype == torch.float32 else native.gemm_max_rows()
    x = torch.randn(min(40, limit), 1536, generator=gen)
    product = (torch.ops.auto_deploy.f32_linear if dtype == torch.float32 else torch.ops.auto_deploy.half_linear)
    together = product(x, weight)
    for rows in (1, 3, 5, 16, 17):
        assert torch.equal(product(x[:rows], weight), together[:rows]), rows
    alone = torch.stack([product(x[i : i + 1], weight)[0] for i in range(len(x))])
    assert torch.equal(alone, together)


def test_f32_linear_takes_only_supported_inputs():
    weight, x = torch.randn(8, 32), torch.randn(1, 32)
    assert native.f32_linear_takes(x, weight) and native.f32_linear_takes(x, weight, torch.randn(8))
    assert not native.f32_linear_takes(x.bfloat16(), weight.bfloat16())  # float32 only
    assert not native.f32_linear_takes(x, weight, torch.randn(8).bfloat16())
    assert not native.f32_linear_takes(torch.randn(1, 18), torch.randn(8, 18))  # K in whole vectors
    assert not native.f32_linear_takes(x, torch.randn(32, 8).t())  # contiguous weight
    assert not native.f32_linear_takes(torch.randn(1, 16), weight)  # K matches


def test_f32_linear_operator_is_linear_for_any_input(kernels):
    """Inputs the kernel does not take (float64, K not in whole vectors, a strided weight) go to torch's
    linear: the op runs everywhere."""
    native.library()
    weight = torch.randn(8, 32)
    cases = [(torch.randn(1, 32).double(), weight.double()), (torch.randn(1, 18), torch.randn(8, 18)),
             (torch.randn(1, 32), torch.randn(32, 8).t())]
    for x, w in cases:
        assert torch.equal(torch.ops.auto_deploy.f32_linear(x, w), torch.nn.functional.linear(x, w))
    for args in ((torch.randn(3, 32), weight), (torch.randn(3, 32), weight, torch.randn(8))):
        torch.library.opcheck(torch.ops.auto_deploy.f32_linear.default, args)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 41])  # passes of 2 or 4 rows and their tails; x86 builds
# take more than 16 rows through the pair products
@pytest.mark.parametrize("n, k", [(5, 64), (9, 8256), (70, 320)])  # tile tails (70: two and five tiles of
# the pair products, the last partial); k past one int32 flush of every build; 320: a partial chunk
def test_int8_gemv_is_its_reference_bit_for_bit(rows, n, k, kernels):
    """Every build's integer sums are exact: the kernel equals the plain-torch reference bit for bit, even
    for rows long enough that int32 lanes would overflow without widening (largest activations and
    weights everywhere)."""
    from autodeploy.custom_ops.quant_linear import int8_gemv_reference

    gen = torch.Generator().manual_seed(rows * 7 + n)
    q, scale = quantize_per_channel_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(rows, k, generator=gen)
    q[0] = 127  # one weight row of the largest magnitudes against
    x[0] = 1.0  # an activation row of the largest 16-bit values: the sums that overflow int32 first
    assert torch.equal(torch.ops.auto_deploy.int8_gemv(x, q, scale), int8_gemv_reference(x, q, scale))


def _float32_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 sums of k products: each off by at most a few ulps of the sum of magnitudes."""
    return 4 * x.shape[-1] * 2**-24 * (x.double().abs() @ weight.double().abs().T) + 1e-30


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 40, 300])  # 17, 40: groups of rows over a widened tile; 300:
# past AVX2's gemm_max_rows, the blockwise product
@pytest.mark.parametrize("n, k", [(7, 64), (61, 768)])
def test_half_linear_against_float64(dtype, rows, n, k, kernels):
    gen = torch.Generator().manual_seed(rows * 31 + n)
    weight = (torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]).to(dtype)
    x = torch.randn(rows, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    out = torch.ops.auto_deploy.half_linear(x, weight, bias)
    exact = x.double() @ weight.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    bound = _float32_bound(x, weight.float()) + 2**-24 * bias.double().abs()
    assert bool(((out.double() - exact - bias.double()).abs() <= bound).all())
    # tight enough to reject the weight read in the other 16-bit format
    other = weight.view(torch.float16 if dtype == torch.bfloat16 else torch.bfloat16)
    assert bool(((x.double() @ other.double().nan_to_num().T - exact).abs() > bound).any())


def _amx_expected() -> bool:
    """Whether this machine should run the AMX prompt products: AMX in the CPU, torch's oneDNN on, no lower ISA
    asked for."""
    return (torch.cpu._is_amx_tile_supported() and torch.backends.mkldnn.enabled
            and "ONEDNN_MAX_CPU_ISA" not in os.environ and native.library() is not None)


def test_amx_products_run_where_the_cpu_has_amx():
    assert (native.amx_products() == frozenset({"bf16", "int8"})) == _amx_expected()


def test_vnni_products_run_where_the_avx512_build_finds_vnni():
    wanted = os.environ.get("AUTODEPLOY_NATIVE_VNNI", "1").lower() not in ("0", "false", "no", "off")
    expected = wanted and native.capability() == "AVX512" and torch.cpu._is_vnni_supported()
    assert native.vnni_products() == expected


@pytest.mark.parametrize("setting", ["AUTODEPLOY_NATIVE_VNNI=0", "ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI"])
def test_int4_products_are_the_same_sums_on_every_path(setting, tmp_path):
    """The 4-bit products give the same bits whichever instructions sum their blocks: with AVX512-VNNI
    (vpdpbusd) or without (vpmaddubsw and vpmaddwd), and for 32 rows or more on AMX's int8 tiles or on the vector
    passes (the same exact int32 sums per block, scaled and added in the same order). A process with
    AUTODEPLOY_NATIVE_VNNI=0 runs the passes without VNNI; one with ONEDNN_MAX_CPU_ISA below AMX, no tiles.
    (test_int4_decode_is_the_integer_arithmetic checks this process's paths against int4_decode_reference.)"""
    name, value = setting.split("=")
    if name == "AUTODEPLOY_NATIVE_VNNI" and not native.vnni_products():
        pytest.skip("no VNNI products here")
    if name == "ONEDNN_MAX_CPU_ISA" and (native.capability() != "AVX512" or "int8" not in native.amx_products()):
        pytest.skip("the AVX-512 build does not run AMX here")
    from autodeploy.custom_ops.int4_linear import quantize_int4

    gen = torch.Generator().manual_seed(5)
    qweight, scale = quantize_int4(torch.randn(70, 768, generator=gen), 32)
    rows = (1, 4, 17, 40, 130)  # decode rows; the vector passes; tiles of 16 rows, the last one padded
    xs = [torch.randn(m, 768, generator=gen) * torch.logspace(-2, 2, m)[:, None] for m in rows]
    torch.save({"xs": xs, "qweight": qweight, "scale": scale}, tmp_path / "inputs.pt")
    script = (
        "import sys, torch\n"
        "import autodeploy.custom_ops\n"
        "from autodeploy.custom_ops import native\n"
        f"a = torch.load({str(tmp_path / 'inputs.pt')!r})\n"
        "assert native.library() is not None\n"
        f"assert not native.vnni_products() if {name == 'AUTODEPLOY_NATIVE_VNNI'} else not native.amx_products()\n"
        "torch.save([torch.ops.auto_deploy.int4_linear(x, a['qweight'], a['scale'], 32) for x in a['xs']],"
        " sys.argv[1])\n"
    )
    env = {**os.environ, name: value}
    subprocess.run([sys.executable, "-c", script, str(tmp_path / "out.pt")], env=env, check=True, timeout=300)
    for x, theirs in zip(xs, torch.load(tmp_path / "out.pt")):
        ours = torch.ops.auto_deploy.int4_linear(x, qweight, scale, 32)
        assert torch.equal(ours, theirs), x.shape


@pytest.mark.parametrize("rows", [64, 65, 300])
def test_bf16_prompts_on_amx_carry_16_significant_bits(rows, kernels):
    """More than 64 rows of bf16 weights on AMX: each activation as two bfloat16 halves (16 significant bits),
    multiplied on AMX into float32. An activation of 21 significant bits tells the paths apart: 1 + 2^-10 + 2^-20
    loses its 2^-20 there, and keeps it on the native kernel's float32 arithmetic (up to 64 rows, or without AMX)."""
    x = torch.zeros(rows, 32)
    x[:, 0] = 1 + 2**-10 + 2**-20
    weight = torch.zeros(3, 32, dtype=torch.bfloat16)
    weight[:, 0] = 1
    out = torch.ops.auto_deploy.half_linear(x, weight)
    split = rows > 64 and "bf16" in native.amx_products()
    assert torch.equal(out, torch.full((rows, 3), 1 + 2**-10 if split else 1 + 2**-10 + 2**-20))


@pytest.mark.parametrize("rows", [1, 5, 17, 40, 300])  # 300: past AVX2's gemm_max_rows, torch's GEMM over blocks
@pytest.mark.parametrize("n, k", [(7, 64), (61, 768)])
def test_int8_mm_against_float64(rows, n, k, kernels):
    """The prompt product of int8 weights without VNNI: float32 arithmetic over the dequantized weights."""
    gen = torch.Generator().manual_seed(rows * 17 + n)
    q, scale = quantize_per_channel_int8(torch.randn(n, k, generator=gen))
    weight = q.float() * scale.float()[:, None]
    x = torch.randn(rows, k, generator=gen)
    out = torch.ops.auto_deploy.int8_mm(x, q, scale)
    exact = x.double() @ weight.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    bound = _float32_bound(x, weight)
    assert bool(((out.double() - exact).abs() <= bound).all())
    # tight enough to reject each row's scale applied to its neighbour
    shifted = q.double() * scale.double().roll(1)[:, None]
    assert bool(((x.double() @ shifted.T - exact).abs() > bound).any())


@pytest.mark.parametrize("rows", [0, 1, 17, 130])
@pytest.mark.parametrize("n, k", [(7, 37), (61, 768)])  # K = 37: a multiple of no vector width
def test_int8_split_mm_is_its_plain_torch_arithmetic_bit_for_bit(rows, n, k, kernels):
    """The prompt product of int8 weights with VNNI: the native passes around the int8 GEMM (15-bit rows split
    into two int8 halves, the products rescaled) give the plain-torch implementation's float32 results
    exactly, rows spanning six orders of magnitude and an all-zero row included."""
    from autodeploy.custom_ops.quant_linear import _split_activation_mm, int8_gemm_is_fast

    if not int8_gemm_is_fast():  # prompts take this op only with VNNI: with oneDNN held to AVX2 its products were off
        pytest.skip("torch's int8 GEMM is exact only with VNNI (or AMX)")

    gen = torch.Generator().manual_seed(rows * 13 + n)
    q, scale = quantize_per_channel_int8(torch.randn(n, k, generator=gen))
    x = torch.randn(1, rows, k, generator=gen) * torch.logspace(-3, 3, rows)[None, :, None]
    if rows > 1:
        x[0, rows // 2] = 0
    out = torch.ops.auto_deploy.int8_split_mm(x, q, scale)
    assert out.shape == (1, rows, n) and out.dtype == torch.float32
    assert torch.equal(out, _split_activation_mm(x, q, scale))
    if rows:  # and that is the 15-bit product: within half a step of each row's largest value per term
        exact = x.double() @ (q.double() * scale.double()[:, None]).T
        bound = k * x.abs().amax(-1, keepdim=True).double() / 32766 * (q.abs().double().amax() * scale.double().amax())
        assert bool(((out.double() - exact).abs() <= bound).all())
        assert not torch.equal(out, torch.ops.auto_deploy.int8_split_mm(x, q, scale.roll(1)))


#: kernels.cpp's kInt4GemvMaxRows: up to this many rows the 4-bit products take the decode rows' arithmetic on every
#: build
INT4_GEMV_MAX_ROWS = 16


def _int4_integer_rows(rows: int, kernels: str) -> bool:
    """Whether int4_linear takes the 8-bit activation blocks' integer arithmetic for this many rows in this build
    (kernels.cpp: up to 16 rows on every build; on x86 builds more rows too, up to the build's gemm_max_rows)."""
    return rows <= INT4_GEMV_MAX_ROWS or (kernels in native.PAIR_PRODUCT_BUILDS and rows <= native.gemm_max_rows())


def _dequantized_blocks8(x: torch.Tensor) -> torch.Tensor:
    """x as the integer arithmetic sees it: each block of 32 rounded to 8 bits, times its scale."""
    from autodeploy.custom_ops.int4_linear import DECODE_BLOCK, round_blocks8

    q, sa = round_blocks8(x)
    return (q * sa.repeat_interleave(DECODE_BLOCK, dim=-1)).reshape(x.shape)


@pytest.mark.parametrize("group_size", [32, 64, 96, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])  # up to 16 rows: the decode kernel on every build (in
# passes of 3 rows on AVX2, 4 elsewhere); more: the quad products on x86 builds
@pytest.mark.parametrize("n, k", [(7, 384), (37, 768), (70, 320), (5, 2080)])  # 320, 2080: a last, partial step
def test_int4_decode_is_the_integer_arithmetic(group_size, rows, n, k, kernels):
    """Decode rows of int4_linear, and on x86 builds every row count: the activations rounded to 8 bits per
    block of 32, exact integer sums per block (int4_decode_reference), to float32 rounding. An outlier
    activation coarsens the rounding of its block, so the bound tells this arithmetic apart from the float32
    product over the dequantized weights."""
    from autodeploy.custom_ops.int4_linear import dequantize_int4, int4_decode_reference, quantize_int4

    if not _int4_integer_rows(rows, kernels):
        pytest.skip(f"the {kernels} build's products of {rows} rows are float32")
    if k % group_size:
        pytest.skip("k is not a multiple of the group size")
    gen = torch.Generator().manual_seed(rows * 7 + n + group_size)
    qweight, scale = quantize_int4(torch.randn(n, k, generator=gen), group_size)
    weight = dequantize_int4(qweight, scale, group_size).double()
    x = torch.randn(rows, k, generator=gen)
    x[:, 5] = 3000.0
    out = torch.ops.auto_deploy.int4_linear(x, qweight, scale, group_size)
    reference = int4_decode_reference(x, qweight, scale, group_size)
    seen = _dequantized_blocks8(x).double()
    # float32 sums of k / 32 scaled block sums (exact integers) and the vector's lanes
    bound = 4 * (k // 32 + 16) * 2**-24 * (seen.abs() @ weight.abs().T) + 1e-30
    assert out.shape == (rows, n) and bool(((out.double() - reference.double()).abs() <= bound).all())
    assert bool(((x.double() @ weight.T - reference.double()).abs() > bound).any())
    # an offset of -7 instead of -8 is far outside the bound
    off_by_one = reference.double() + seen @ (scale.double().repeat_interleave(group_size, 1)).T
    assert bool(((out.double() - off_by_one).abs() > bound).all())


def test_int4_rows_do_not_depend_on_their_batch(kernels):
    """Up to 16 rows, each row's product is the same, bit for bit, whichever rows share its call (one row's
    sums in one order): a sequence decodes to the same tokens alone or in a batch of up to 16."""
    from autodeploy.custom_ops.int4_linear import quantize_int4

    gen = torch.Generator().manual_seed(5)
    qweight, scale = quantize_int4(torch.randn(37, 320, generator=gen), 32)
    x = torch.randn(INT4_GEMV_MAX_ROWS, 320, generator=gen)
    batch = torch.ops.auto_deploy.int4_linear(x, qweight, scale, 32)
    for start, stop in [(0, 1), (5, 6), (0, 3), (3, 7), (9, 16)]:
        assert torch.equal(torch.ops.auto_deploy.int4_linear(x[start:stop], qweight, scale, 32), batch[start:stop])
    # and the rows are not all alike: a row's product differs from its neighbour's
    assert not torch.equal(batch[0], batch[1])


@pytest.mark.parametrize("group_size", [32, 64, 96, 128])  # 96: groups that straddle the kernels' K chunks
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 17, 40, 600])  # 600: two slabs of rows (ops.cpp)
@pytest.mark.parametrize("n, k", [(7, 384), (37, 768)])
def test_int4_linear_against_float64(group_size, rows, n, k, kernels):
    from autodeploy.custom_ops.int4_linear import dequantize_int4, quantize_int4

    gen = torch.Generator().manual_seed(rows * 13 + n + group_size)
    qweight, scale = quantize_int4(torch.randn(n, k, generator=gen), group_size)
    weight = dequantize_int4(qweight, scale, group_size)
    x = torch.randn(rows, k, generator=gen)
    out = torch.ops.auto_deploy.int4_linear(x, qweight, scale, group_size)
    # the integer paths see x rounded to 8 bits per block of 32; the others x itself
    seen = _dequantized_blocks8(x) if _int4_integer_rows(rows, kernels) else x
    exact = seen.double() @ weight.double().T
    assert out.shape == (rows, n) and out.dtype == torch.float32
    bound = _float32_bound(seen, weight)
    assert bool(((out.double() - exact).abs() <= bound).all())
    # tight enough to reject swapped nibbles (odd and even elements exchanged)
    swapped = weight.view(n, k // 2, 2).flip(-1).reshape(n, k)
    assert bool(((seen.double() @ swapped.double().T - exact).abs() > bound).any())


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 16, 17, 40, 600])  # passes of 4 rows and their tails; the prompts'
# path (AVX-512: the quad products over the tiles, AMX's from 32 rows); 600: two slabs of rows (ops.cpp)
# a single partial tile; tiles and a tail; 13 blocks of 32 (the one-row pass takes two at a time: its last alone)
@pytest.mark.parametrize("n, k", [(7, 384), (37, 768), (70, 320), (9, 416)])
def test_int4_packed_linear_is_int4_linears_arithmetic(group_size, rows, n, k, kernels):
    """int4_packed_linear over the weight packed in this build's tiles: at every row count the integer arithmetic
    (int4_decode_reference) to float32 rounding; past 16 rows the same bits as int4_linear where that takes it too
    (the prompt products sum in the packed passes' order); up to 16, each row's product the same whichever rows
    share its call."""
    from autodeploy.custom_ops.int4_linear import int4_decode_reference, pack_int4_tiles, quantize_int4

    if k % group_size:
        pytest.skip("k is not a multiple of the group size")
    if native.int4_pack_rows() == 0:
        pytest.skip(f"the {kernels} build reads no packed layout")
    gen = torch.Generator().manual_seed(rows * 3 + n + group_size)
    qweight, scale = quantize_int4(torch.randn(n, k, generator=gen), group_size)
    words, tile_scale = pack_int4_tiles(qweight, scale, native.int4_pack_rows())
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-2, 2, rows)[:, None]
    out = torch.ops.auto_deploy.int4_packed_linear(x, words, tile_scale, group_size, n)
    assert out.shape == (rows, n)
    reference = int4_decode_reference(x, qweight, scale, group_size).double()
    seen = _dequantized_blocks8(x).double()
    w_abs = 8 * scale.double().abs().repeat_interleave(group_size, 1)  # |w| <= 8 |scale|
    bound = 4 * (k // 32 + 16) * 2**-24 * (seen.abs() @ w_abs.T) + 1e-30
    assert bool(((out.double() - reference).abs() <= bound).all())
    if rows > INT4_GEMV_MAX_ROWS:
        if _int4_integer_rows(rows, kernels):
            assert torch.equal(out, torch.ops.auto_deploy.int4_linear(x, qweight, scale, group_size))
    else:
        for start in range(rows):
            one = torch.ops.auto_deploy.int4_packed_linear(x[start:start + 1], words, tile_scale, group_size, n)
            assert torch.equal(one[0], out[start])


def test_int4_packed_linear_of_another_layout_unpacks_it(kernels):
    """Tiles of another row count than this build's (a graph packed under another build) still give int4_linear's
    product, the same bits: the operator unpacks them."""
    from autodeploy.custom_ops.int4_linear import pack_int4_tiles, quantize_int4

    gen = torch.Generator().manual_seed(11)
    qweight, scale = quantize_int4(torch.randn(37, 256, generator=gen), 32)
    words, tile_scale = pack_int4_tiles(qweight, scale, 4)
    for rows in (1, 5, 40):
        x = torch.randn(rows, 256, generator=gen)
        assert torch.equal(torch.ops.auto_deploy.int4_packed_linear(x, words, tile_scale, 32, 37),
                           torch.ops.auto_deploy.int4_linear(x, qweight, scale, 32))


def test_greedy_steps_pick_the_first_largest_logit_as_argmax_does():
    """decode_loop.h's pick of a greedy token (blocks of 16, then one value at a time) against numpy's argmax:
    ties go to the first, a NaN counts as the largest (the first one wins), and every length's tail is read."""
    lib = native.library()
    if lib is None:
        pytest.skip("no native library on this machine")
    lib.autodeploy_first_largest.restype = ctypes.c_int64
    lib.autodeploy_first_largest.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in [*range(1, 70), 32000]:
        for _ in range(6):
            values = torch.randint(-3, 4, (n,), generator=gen).float()  # few distinct values: ties everywhere
            kind = int(torch.randint(0, 4, (1,), generator=gen))
            where = torch.randint(0, n, (2,), generator=gen)
            if kind == 1:
                values[where] = float("nan")
            elif kind == 2:
                values[:] = float("-inf")
            elif kind == 3:
                values[where[0]] = float("inf")
            cases.append(values)
    cases += [torch.randn(32000, generator=gen) for _ in range(4)]
    for values in cases:
        picked = lib.autodeploy_first_largest(values.data_ptr(), values.numel())
        assert picked == int(values.numpy().argmax()), values
