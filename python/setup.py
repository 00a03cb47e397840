"""Builds libweft (weftcc's C ABI, the Rust crate weftcc-bindings) with cargo and bundles it in
the package as weftcc/libweft.so. `WEFTCC_LIBWEFT=/path/libweft.so` bundles an existing build
instead; CARGO_TARGET_DIR is honoured."""

import os
import shutil
import subprocess
import sys

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def say(line: str) -> None:
    """One line the user sees while pip builds: pip shows a build's own output only with -v, so
    the line also goes to the terminal when there is one."""
    print(line, file=sys.stderr, flush=True)
    try:
        with open("/dev/tty", "w") as tty:
            # On a line of its own: pip's progress spinner leaves the cursor mid-line.
            tty.write("\n" + line + "\n")
    except OSError:
        pass


def libweft() -> str:
    given = os.environ.get("WEFTCC_LIBWEFT")
    if given:
        if not os.path.isfile(given):
            raise SystemExit(f"WEFTCC_LIBWEFT={given}: no such file")
        return given
    if not os.path.isfile(os.path.join(REPO, "bindings", "Cargo.toml")):
        raise SystemExit(
            f"weftcc: the Rust workspace is not at {REPO}; install from the repository "
            "(pip install ./python) or set WEFTCC_LIBWEFT to a built libweft.so"
        )
    cargo = shutil.which("cargo") or os.path.expanduser("~/.cargo/bin/cargo")
    say(
        "weftcc: building libweft with cargo (cargo build --release -p weftcc-bindings): a few "
        "minutes on a fresh checkout; pip install -v shows cargo's progress"
    )
    subprocess.check_call(
        [cargo, "build", "--release", "--locked", "-p", "weftcc-bindings"], cwd=REPO
    )
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(REPO, "target")
    return os.path.join(target, "release", "libweft.so")


class BuildWithLibweft(build_py):
    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "weftcc")
        os.makedirs(dest, exist_ok=True)
        out = os.path.join(dest, "libweft.so")
        shutil.copy2(libweft(), out)
        # The release profile keeps debug info (tens of MB); the package needs none of it.
        strip = shutil.which("strip")
        if strip:
            subprocess.check_call([strip, "--strip-debug", out])


class PlatformDistribution(Distribution):
    """The wheel holds a native library: tag it for this platform, not as pure Python."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildWithLibweft}, distclass=PlatformDistribution)
