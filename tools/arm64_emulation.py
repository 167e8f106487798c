"""Run tests on an emulated ARM64 CPU, from an x86-64 Debian machine: the NEON build of the native kernels
(``custom_ops/native``, capability ``DEFAULT``) compiles anywhere with a cross compiler but runs only on ARM64.

    python tools/arm64_emulation.py setup                     # once; needs root (apt, binfmt_misc), ~1.5 GB
    python tools/arm64_emulation.py pytest tests/custom_ops   # the suite's arguments, run under ARM64
    python tools/arm64_emulation.py python -c "import torch; print(torch.randn(3))"

What ``setup`` makes, in ``--dir`` (default ``$XDG_CACHE_HOME/autodeploy-arm64``):

- ``qemu-user`` and the cross compiler ``g++-aarch64-linux-gnu``, from apt; Debian's arm64 Python of the host's
  version and the libraries it needs, unpacked into ``root/`` (``apt-get download`` and ``dpkg -x``: nothing
  is installed for arm64, though apt learns the arm64 architecture);
- torch (the host's version) and what the tests import, as aarch64 wheels from the package index, in ``site/``.
  The index's aarch64 torch is a CUDA build: ``stubs/`` holds a library of the same name for each CUDA library
  it links, whose every function fails, so torch imports and runs on the CPU;
- the ``/proc/cpuinfo`` and cpu sysfs files of a 2-core Neoverse N1 in ``root/``, which qemu shows the emulated
  process in place of the host's x86 ones (oneDNN's CPU detection crashes on those);
- a binfmt_misc entry that runs aarch64 executables through qemu, so pytest-xdist's workers and the tests'
  subprocesses run emulated too;
- ``python``, the emulated interpreter with the repository's ``src`` on its path. The kernels and Inductor's
  code are compiled by the cross compiler, which runs natively (``$CXX`` is ``bin/aarch64-g++``: it turns
  Inductor's ``-march=native`` into the emulated CPU's ``armv8.2-a+dotprod+fp16``).

Results are checked, not speed: emulated code runs 5-50x slower than on hardware, unevenly.
"""

from __future__ import annotations

import argparse
import collections
import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
PYTHON = f"python{sys.version_info.major}.{sys.version_info.minor}"
#: the arm64 packages the interpreter and torch need; apt adds their dependencies
ROOT_PACKAGES = [f"{PYTHON}-minimal", f"lib{PYTHON}-stdlib", f"lib{PYTHON}-dev", "libgomp1", "libstdc++6"]
#: what pip may install for the emulated interpreter: aarch64 wheels of the host's Python
WHEEL_TARGET = ["--platform", "manylinux_2_28_aarch64", "--platform", "manylinux_2_17_aarch64",
                "--platform", "manylinux2014_aarch64", "--platform", "linux_aarch64", "--only-binary=:all:",
                "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}", "--implementation", "cp"]
#: torch's own dependencies (its wheel is installed without them: they include the CUDA libraries) and the test runner
TORCH_DEPENDENCIES = ["filelock", "typing-extensions", "sympy", "networkx", "jinja2", "fsspec", "setuptools", "numpy",
                      "pytest", "pytest-xdist"]
CPU = "neoverse-n1"
#: ``midr_el1`` of a Neoverse N1 r3p1 and the features its /proc/cpuinfo lists
MIDR = "0x00000000413fd0c1"
FEATURES = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm lrcpc dcpop asimddp"
CORES = 2
BINFMT = Path("/proc/sys/fs/binfmt_misc")
#: ELF header of an aarch64 executable and the mask of its bytes that identify one (Debian's qemu-user-binfmt entry)
BINFMT_ENTRY = (r":qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:"
                r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:"
                "{qemu}:")


class SetupError(RuntimeError):
    """A step of the set-up failed; the message names it."""


def run(command: list[str], **kwargs) -> str:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise SetupError(f"{' '.join(command[:4])} ... failed: {(result.stderr or result.stdout).strip()[-1500:]}")
    return result.stdout


def step(message: str) -> None:
    print(f"[arm64] {message}", flush=True)


def install_host_tools() -> None:
    """qemu-user and the aarch64 cross compilers, and apt's list of arm64 packages."""
    if not (shutil.which("qemu-aarch64") and shutil.which("aarch64-linux-gnu-g++")):
        step("installing qemu-user and g++-aarch64-linux-gnu")
        run(["apt-get", "update", "-qq"])
        run(["apt-get", "install", "-y", "-qq", "qemu-user", "g++-aarch64-linux-gnu"],
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    if "arm64" not in run(["dpkg", "--print-foreign-architectures"]).split():
        step("adding the arm64 architecture to apt (for its package lists)")
        run(["dpkg", "--add-architecture", "arm64"])
        run(["apt-get", "update", "-qq"])


def unpack_root(root: Path, debs: Path) -> None:
    """Debian's arm64 interpreter and the libraries it and torch load, unpacked into ``root``."""
    step(f"unpacking Debian's arm64 {PYTHON} into {root}")
    listing = run(["apt-cache", "depends", "--recurse", "--no-recommends", "--no-suggests", "--no-conflicts",
                   "--no-breaks", "--no-replaces", "--no-enhances", *(f"{p}:arm64" for p in ROOT_PACKAGES)])
    packages = sorted({line for line in listing.splitlines() if line.endswith(":arm64") and line[0].isalnum()})
    debs.mkdir(parents=True, exist_ok=True)
    run(["apt-get", "download", "-qq", *packages], cwd=debs)
    for deb in sorted(debs.glob("*_arm64.deb")):
        run(["dpkg", "-x", str(deb), str(root)])


def fake_cpu(root: Path) -> None:
    """A /proc/cpuinfo and cpu sysfs of a Neoverse N1 where qemu looks first (its -L prefix)."""
    cpus = "".join(f"processor\t: {c}\nBogoMIPS\t: 50.00\nFeatures\t: {FEATURES}\nCPU implementer\t: 0x41\n"
                   "CPU architecture: 8\nCPU variant\t: 0x3\nCPU part\t: 0xd0c\nCPU revision\t: 1\n\n"
                   for c in range(CORES))
    (root / "proc").mkdir(exist_ok=True)
    (root / "proc/cpuinfo").write_text(cpus)
    sysfs = root / "sys/devices/system/cpu"
    for name in ("online", "possible", "present"):
        sysfs.mkdir(parents=True, exist_ok=True)
        (sysfs / name).write_text(f"0-{CORES - 1}\n")
    caches = [(1, "Data", "64K", False), (1, "Instruction", "64K", False), (2, "Unified", "1024K", False),
              (3, "Unified", "32768K", True)]
    for c in range(CORES):
        ident = sysfs / f"cpu{c}/regs/identification"
        ident.mkdir(parents=True, exist_ok=True)
        (ident / "midr_el1").write_text(MIDR + "\n")
        for index, (level, kind, size, shared) in enumerate(caches):
            cache = sysfs / f"cpu{c}/cache/index{index}"
            cache.mkdir(parents=True, exist_ok=True)
            for name, value in (("level", level), ("type", kind), ("size", size), ("coherency_line_size", 64),
                                ("shared_cpu_list", f"0-{CORES - 1}" if shared else c)):
                (cache / name).write_text(f"{value}\n")


def install_wheels(site: Path) -> None:
    """torch (without its CUDA dependencies) and the project's dependencies, aarch64 wheels, into ``site``."""
    version = torch.__version__.split("+")[0]
    step(f"installing the aarch64 wheels of torch {version} and the project's dependencies into {site}")
    pip = [sys.executable, "-m", "pip", "install", "-q", "--target", str(site), *WHEEL_TARGET]
    run([*pip, "--no-deps", f"torch=={version}"])
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    run([*pip, *(r for r in project if not r.startswith("torch")), *TORCH_DEPENDENCIES])


def is_elf(path: Path) -> bool:
    """Whether ``path`` is a shared library (not a linker script, nor a -dev package's link to one left out)."""
    try:
        with path.open("rb") as file:
            return file.read(4) == b"\x7fELF"
    except OSError:
        return False


def elf_symbols(library: Path) -> list[tuple[str, str, str, str]]:
    """(type, binding, section, name) of each dynamic symbol of ``library``."""
    lines = (line.split() for line in run(["readelf", "-W", "--dyn-syms", str(library)]).splitlines())
    return [(f[3], f[4], f[6], f[7]) for f in lines if len(f) >= 8 and f[0].endswith(":")]


def cuda_stubs(site: Path, root: Path, stubs: Path) -> None:
    """For each library torch's libraries need that neither the wheel nor ``root`` has (CUDA's), a library of that
    name defining what they import from it: functions that return an error (100, CUDA's "no device"), error
    strings, zeroed data, under the symbol versions they ask for."""
    step("making stub libraries for the CUDA libraries the aarch64 torch links")
    libraries = [p for p in (site / "torch").rglob("*.so*") if is_elf(p)]
    system = [p for d in ("lib/aarch64-linux-gnu", "usr/lib/aarch64-linux-gnu") for p in (root / d).glob("*.so*")
              if is_elf(p)]
    have = {p.name for p in libraries + system}
    needed = {name for lib in libraries for name in re.findall(r"NEEDED.*\[(.*)\]", run(["readelf", "-d", str(lib)]))}
    missing = sorted(needed - have)
    symbols = {lib: elf_symbols(lib) for lib in libraries + system}  # read once: torch's libraries are large
    defined = {name.split("@")[0] for table in symbols.values() for _, _, section, name in table if section != "UND"}
    version_file = {}  # symbol version -> the library that defines it
    for lib in libraries:
        current = None
        for line in run(["readelf", "-V", str(lib)]).splitlines():
            if match := re.search(r"File: (\S+)", line):
                current = match.group(1)
            elif (match := re.search(r"Name: (\S+)", line)) and current:
                version_file[match.group(1)] = current
    imports = collections.defaultdict(dict)  # missing library -> symbol -> (type, version)
    for lib in libraries:
        for kind, binding, section, name in symbols[lib]:
            if section != "UND" or binding == "WEAK":
                continue
            symbol, _, version = name.partition("@")
            version = version.split()[0] if version else ""
            if version_file.get(version) in missing:
                imports[version_file[version]][symbol] = (kind, version)
            elif not version and symbol not in defined:  # unversioned and defined nowhere: a CUDA library's
                imports[missing[0]].setdefault(symbol, (kind, None))
    stubs.mkdir(parents=True, exist_ok=True)
    for soname in missing:
        source = ['static const char message[] = "no CUDA: a stub library (tools/arm64_emulation.py)";']
        versions = collections.defaultdict(list)
        for symbol, (kind, version) in sorted(imports[soname].items()):
            if kind == "OBJECT":
                source.append(f"char {symbol}[4096];")
            elif "ErrorString" in symbol or "ErrorName" in symbol or symbol.endswith("GetString"):
                source.append(f"const char* {symbol}(void) {{ return message; }}")
            else:
                source.append(f"long {symbol}(void) {{ return 100; }}")
            versions[version or soname].append(symbol)
        versions.setdefault(soname, [])
        (stubs / f"{soname}.c").write_text("\n".join(source) + "\n")
        (stubs / f"{soname}.map").write_text("".join(
            f"{version} {{ global: {' '.join(s + ';' for s in symbols) or 'message;'} }};\n"
            for version, symbols in versions.items()))
        run(["aarch64-linux-gnu-g++", "-x", "c", "-shared", "-fPIC", "-w", "-o", str(stubs / soname),
             str(stubs / f"{soname}.c"), f"-Wl,-soname,{soname}", f"-Wl,--version-script,{stubs / f'{soname}.map'}"])


def register_binfmt() -> None:
    """Run aarch64 executables through qemu-aarch64 (child processes of the emulated interpreter too)."""
    if not (BINFMT / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)])
    if not (BINFMT / "qemu-aarch64").exists():
        (BINFMT / "register").write_text(BINFMT_ENTRY.format(qemu=shutil.which("qemu-aarch64")))


def write_launchers(home: Path) -> None:
    bin_dir = home / "bin"
    bin_dir.mkdir(exist_ok=True)
    compiler = bin_dir / "aarch64-g++"
    compiler.write_text(f"""#!/bin/sh
# the cross compiler, run natively by the emulated interpreter: the emulated CPU's ISA for -march=native, and the
# arm64 Python headers (root/usr/include) for Inductor's code
for a in "$@"; do
  if [ "$a" = "-march=native" ]; then set -- "$@" "-march=armv8.2-a+dotprod+fp16"; else set -- "$@" "$a"; fi
  shift
done
exec aarch64-linux-gnu-g++ "$@" -idirafter {home}/root/usr/include
""")
    python = home / "python"
    python.write_text(f"""#!/bin/sh
# {PYTHON} on an emulated {CPU} (tools/arm64_emulation.py)
export QEMU_LD_PREFIX={home}/root QEMU_CPU={CPU} LD_LIBRARY_PATH={home}/stubs PYTHONNOUSERSITE=1
export PYTHONPATH={REPO}/src:{home}/site${{PYTHONPATH:+:$PYTHONPATH}}
export CXX={compiler} TORCHINDUCTOR_CACHE_DIR={home}/inductor
exec {home}/root/usr/bin/{PYTHON} "$@"
""")
    for script in (compiler, python):
        script.chmod(0o755)


def once(home: Path, part: str, make) -> None:
    """``make()`` the part ``home / part`` unless a finished one is there (a part left half-made is made again)."""
    stamp = home / f"{part}.done"
    if stamp.exists():
        return
    shutil.rmtree(home / part, ignore_errors=True)
    make()
    stamp.touch()


def setup(home: Path) -> None:
    if platform.machine() not in ("x86_64", "AMD64"):
        raise SetupError(f"this tool emulates ARM64 on x86-64; this machine is {platform.machine()}")
    if os.geteuid() != 0:
        raise SetupError("setup needs root: it installs qemu-user with apt and registers it with binfmt_misc")
    home.mkdir(parents=True, exist_ok=True)
    install_host_tools()
    once(home, "root", lambda: unpack_root(home / "root", home / "debs"))
    fake_cpu(home / "root")
    once(home, "site", lambda: install_wheels(home / "site"))
    once(home, "stubs", lambda: cuda_stubs(home / "site", home / "root", home / "stubs"))
    register_binfmt()
    write_launchers(home)
    check = subprocess.run([str(home / "python"), "-c", "import platform, torch; print(platform.machine(), "
                            "torch.__version__, float(torch.ones(4, 4).matmul(torch.ones(4)).sum()))"],
                           capture_output=True, text=True)
    if check.returncode != 0 or not check.stdout.startswith("aarch64"):
        raise SetupError(f"the emulated interpreter does not run torch: {(check.stderr or check.stdout)[-1500:]}")
    step(f"ready: {home / 'python'} ({check.stdout.strip()})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autodeploy-arm64"
    parser.add_argument("--dir", type=Path, default=default, help=f"where the set-up lives [{default}]")
    parser.add_argument("command", choices=["setup", "pytest", "python"])
    parser.add_argument("args", nargs=argparse.REMAINDER, help="pytest's or python's arguments")
    args = parser.parse_args()
    home = args.dir.resolve()
    if args.command == "setup":
        try:
            setup(home)
        except (SetupError, OSError) as err:
            print(f"arm64 emulation: {err}", file=sys.stderr)
            return 1
        return 0
    python = home / "python"
    if not python.is_file():
        print(f"arm64 emulation: no set-up in {home}; run `python {sys.argv[0]} setup` first", file=sys.stderr)
        return 1
    command = [str(python), *(["-m", "pytest", "-p", "no:cacheprovider"] if args.command == "pytest" else []),
               *args.args]
    return subprocess.run(command, cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
