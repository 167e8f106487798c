"""tools/arm64_emulation.py: the files its set-up writes for qemu and the compiler (the set-up itself, with apt,
pip and qemu, runs in .ci/run)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "arm64_emulation.py"
spec = importlib.util.spec_from_file_location("arm64_emulation", TOOL)
arm64 = importlib.util.module_from_spec(spec)
spec.loader.exec_module(arm64)


def test_the_cpu_qemu_shows_is_a_neoverse_n1(tmp_path):
    arm64.fake_cpu(tmp_path)
    cpuinfo = (tmp_path / "proc/cpuinfo").read_text()
    assert cpuinfo.count("processor\t:") == arm64.CORES
    assert cpuinfo.count("CPU part\t: 0xd0c") == arm64.CORES and "asimd " in cpuinfo
    cpus = tmp_path / "sys/devices/system/cpu"
    assert (cpus / "online").read_text() == f"0-{arm64.CORES - 1}\n"
    for c in range(arm64.CORES):
        assert (cpus / f"cpu{c}/regs/identification/midr_el1").read_text().strip() == "0x00000000413fd0c1"
        assert (cpus / f"cpu{c}/cache/index2/level").read_text() == "2\n"
        assert (cpus / f"cpu{c}/cache/index0/shared_cpu_list").read_text() == f"{c}\n"
    arm64.fake_cpu(tmp_path)  # again over its own files (every set-up writes them)


def test_the_compiler_wrapper_gives_the_emulated_cpu_for_native(tmp_path, monkeypatch):
    """Inductor asks for -march=native, which a cross compiler cannot know: the wrapper names the N1's ISA and
    keeps every other argument as it was, spaces included."""
    arm64.write_launchers(tmp_path)
    fake = tmp_path / "fake-bin"
    fake.mkdir()
    (fake / "aarch64-linux-gnu-g++").write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    (fake / "aarch64-linux-gnu-g++").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:/usr/bin:/bin")
    out = subprocess.run([str(tmp_path / "bin/aarch64-g++"), "-O3", "-march=native", "-DNAME=a b", "x.cpp"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out == ["-O3", "-march=armv8.2-a+dotprod+fp16", "-DNAME=a b", "x.cpp", "-idirafter",
                   f"{tmp_path}/root/usr/include"]


def test_the_interpreter_launcher_runs_the_arm64_python_under_qemu(tmp_path):
    arm64.write_launchers(tmp_path)
    launcher = (tmp_path / "python").read_text()
    assert f"QEMU_LD_PREFIX={tmp_path}/root" in launcher and f"QEMU_CPU={arm64.CPU}" in launcher
    assert f"LD_LIBRARY_PATH={tmp_path}/stubs" in launcher  # the CUDA stubs
    assert f"CXX={tmp_path}/bin/aarch64-g++" in launcher
    assert launcher.rstrip().endswith(f'exec {tmp_path}/root/usr/bin/{arm64.PYTHON} "$@"')


def test_setup_refuses_a_machine_it_cannot_emulate_on(monkeypatch, tmp_path):
    monkeypatch.setattr(arm64.platform, "machine", lambda: "aarch64")
    with pytest.raises(arm64.SetupError, match="x86-64; this machine is aarch64"):
        arm64.setup(tmp_path)


def test_running_before_the_setup_says_what_to_run(tmp_path):
    result = subprocess.run([sys.executable, str(TOOL), "--dir", str(tmp_path / "none"), "pytest", "tests/custom_ops"],
                            capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().endswith("setup` first") and f"no set-up in {tmp_path / 'none'}" in result.stderr
