"""Build the project environment (``.venv``) from nothing, installing only what is missing.

Used by ``make test`` / ``make bench`` / ``make lint``; safe to run again (it only fills gaps).

Rules, in order:
1. Create the venv if it is absent. When the interpreter running this script already imports torch
   (a CUDA build on a GPU box, say), the venv sees that interpreter's packages: ``--system-site-packages``
   for a system interpreter, plus a ``.pth`` file naming the parent's site-packages when the interpreter
   is itself a virtual environment (``--system-site-packages`` alone would reach the base Python, not it).
2. Check every requirement of ``pyproject.toml`` (dependencies and the requested extras) inside the venv
   and install only those that are absent or whose installed version does not satisfy the specifier.
   A missing torch is installed as ``$SMPTK_TORCH_SPEC`` (default ``torch==2.13.0``, pinned so that a
   CPU machine takes the CPU build it has rather than the newest CUDA build).
   ``--pin SPEC`` requirements are installed before that check, so a second environment can hold another
   version of a dependency (``make compat-check``: Triton 3.6, the GPU image's version).
3. Make ``smptk`` importable from this checkout: an editable install when setuptools is present,
   otherwise a ``.pth`` file (no network needed either way).

Nothing is downloaded when everything is already there, so it works offline on a prepared machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TORCH_SPEC = "torch==2.13.0"

# Run inside the venv: prints the requirement strings that are not satisfied there.
_CHECK = r"""
import json, sys
from importlib import metadata
from pip._vendor.packaging.requirements import Requirement
missing = []
for line in json.loads(sys.argv[1]):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        version = metadata.version(req.name)
    except metadata.PackageNotFoundError:
        missing.append(line)
        continue
    if req.specifier and not req.specifier.contains(version, prereleases=True):
        missing.append(line)
print(json.dumps(missing))
"""


def torch_spec() -> str:
    """The torch requirement to install: ``$SMPTK_TORCH_SPEC`` read by :func:`smptk.settings.torch_spec`
    (blank counts as unset, surrounding spaces are dropped), else :data:`DEFAULT_TORCH_SPEC`.
    ``smptk.settings`` imports only the standard library, so this checkout's copy is read before
    anything is installed."""
    sys.path.insert(0, str(ROOT))
    try:
        from smptk import settings
    finally:
        sys.path.remove(str(ROOT))
    return settings.torch_spec() or DEFAULT_TORCH_SPEC


def _read_pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        from pip._vendor import tomli as tomllib
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def _venv_python(venv_dir: Path) -> Path:
    return venv_dir / "bin" / "python"


def _site_packages(python: Path | str) -> list[str]:
    out = subprocess.run(
        [str(python), "-c", "import json, site; print(json.dumps(site.getsitepackages()))"],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


def _imports_torch(python: str) -> bool:
    probe = subprocess.run([python, "-c", "import torch"], capture_output=True)
    return probe.returncode == 0


def create_venv(venv_dir: Path) -> None:
    parent = sys.executable
    reuse = _imports_torch(parent)
    print(f"[bootstrap] creating {venv_dir} (reusing {parent}'s packages: {reuse})")
    venv.EnvBuilder(with_pip=True, system_site_packages=reuse, symlinks=True).create(venv_dir)
    if reuse and sys.prefix != sys.base_prefix:
        # The parent is itself a venv: expose its site-packages explicitly. Entries of a .pth file come
        # after the venv's own site-packages, so anything installed into the venv still wins.
        site_dir = Path(_site_packages(_venv_python(venv_dir))[0])
        (site_dir / "_smptk_parent_env.pth").write_text("\n".join(_site_packages(parent)) + "\n")


def missing_requirements(python: Path, requirements: list[str]) -> list[str]:
    out = subprocess.run(
        [str(python), "-c", _CHECK, json.dumps(requirements)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def pip_install(python: Path, args: list[str], *, quiet_failure: bool = False) -> None:
    cmd = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q", *args]
    print("[bootstrap] " + " ".join(cmd[1:]))
    subprocess.run(cmd, check=True, capture_output=quiet_failure)


def install_smptk(python: Path) -> None:
    probe = subprocess.run(
        [str(python), "-c", "import smptk, pathlib; print(pathlib.Path(smptk.__file__).resolve())"],
        capture_output=True,
        text=True,
        cwd="/",
    )
    if probe.returncode == 0 and Path(probe.stdout.strip()).is_relative_to(ROOT):
        return
    has_setuptools = subprocess.run([str(python), "-c", "import setuptools"], capture_output=True)
    if has_setuptools.returncode == 0:
        try:
            pip_install(python, ["--no-deps", "--no-build-isolation", "-e", str(ROOT)], quiet_failure=True)
            return
        except subprocess.CalledProcessError:
            print("[bootstrap] no editable install (old setuptools?); linking the checkout with a .pth file")
    site_dir = Path(_site_packages(python)[0])
    (site_dir / "_smptk_checkout.pth").write_text(str(ROOT) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", default=str(ROOT / ".venv"), help="environment folder (default: .venv)")
    parser.add_argument("--extras", default="test", help="comma-separated extras of pyproject.toml")
    parser.add_argument(
        "--pin",
        action="append",
        default=[],
        metavar="SPEC",
        help="a requirement installed first and kept (e.g. triton==3.6.0 for the compat venv); repeatable",
    )
    parser.add_argument(
        "--optional-extras",
        default="",
        help="comma-separated extras installed best effort (a failure, e.g. no package index, is not fatal)",
    )
    args = parser.parse_args()

    venv_dir = Path(args.venv).resolve()
    python = _venv_python(venv_dir)
    if not python.exists():
        create_venv(venv_dir)

    pins_missing = missing_requirements(python, args.pin) if args.pin else []
    if pins_missing:  # first, so that the project's looser requirements find them satisfied
        pip_install(python, pins_missing)

    project = _read_pyproject()["project"]
    requirements = list(project["dependencies"])
    for extra in filter(None, args.extras.split(",")):
        requirements += project["optional-dependencies"][extra]
    requirements = list(dict.fromkeys(requirements))

    missing = missing_requirements(python, requirements)
    torch_missing = [r for r in missing if r.split(">")[0].split("=")[0].strip() == "torch"]
    if torch_missing:
        pip_install(python, [torch_spec()])
        missing = [r for r in missing if r not in torch_missing]
    if missing:
        pip_install(python, missing)
    install_smptk(python)
    optional = []
    for extra in filter(None, args.optional_extras.split(",")):
        optional += project["optional-dependencies"][extra]
    optional_missing = missing_requirements(python, list(dict.fromkeys(optional))) if optional else []
    if optional_missing:
        try:  # one quick try: a machine with no package index goes on without them
            pip_install(python, ["--retries", "0", "--timeout", "10", *optional_missing], quiet_failure=True)
        except subprocess.CalledProcessError:
            print(f"[bootstrap] optional, not installed (going on without): {optional_missing}")
    still = missing_requirements(python, requirements + args.pin)
    if still:
        print(f"[bootstrap] still missing after install: {still}", file=sys.stderr)
        return 1
    print(f"[bootstrap] environment ready: {venv_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
