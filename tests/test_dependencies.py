"""pyproject.toml declares what the code imports and imports what it declares, and requirements.lock (`make lock`)
satisfies pyproject.toml on every platform it pins for, with a hash for every file and no index address."""

from __future__ import annotations

import ast
import functools
import json
import re
import sys
import tomllib
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.helpers import ROOT

LOCK = ROOT / "requirements.lock"

# Imported without being declared, and why.
UNDECLARED_IMPORTS = {
    "triton": "core/hardware.py probes for it (torch.compile's GPU kernels); torch's own dependency where it has one",
}
# Declared, imported nowhere, and why each is needed all the same.
NOT_IMPORTED = {
    "python-multipart": "FastAPI's parser of the multipart forms that imgcls serve takes (LitServe's server)",
    "onnx": "torch.onnx's exporter imports it (imgcls export --format onnx)",
    "onnxscript": "torch.onnx's exporter builds its graph with it (imgcls export --format onnx)",
    "pytest-timeout": "the per-test `timeout` of pyproject.toml's pytest settings",
    "pytest-xdist": "the `-n` of pyproject.toml's pytest addopts: test files in parallel",
    "ipykernel": "the notebooks' kernel, which tests/test_notebooks.py starts",
    "ruff": "the linter: tests/test_style.py, make lint",
}


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def declared() -> dict[str, list[Requirement]]:
    """Each dependency group of pyproject.toml (`base` and every extra) as requirements, the extras' references to
    imgcls's own extras left out."""
    project = pyproject()["project"]
    groups = {"base": project["dependencies"], **project["optional-dependencies"]}
    return {group: [Requirement(r) for r in reqs if canonicalize_name(Requirement(r).name) != project["name"]]
            for group, reqs in groups.items()}


def declared_names() -> set[str]:
    return {canonicalize_name(r.name) for reqs in declared().values() for r in reqs}


def our_packages() -> set[str]:
    return {p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file()}


def code_sources() -> dict[str, str]:
    """The Python source of our packages and of the notebooks' code cells, by file (a notebook's shell and magic
    lines left out)."""
    sources = {str(p.relative_to(ROOT)): p.read_text() for package in sorted(our_packages())
               for p in sorted((ROOT / package).rglob("*.py"))}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        sources[str(notebook.relative_to(ROOT))] = "\n".join(
            line for cell in cells if cell["cell_type"] == "code"
            for line in "".join(cell["source"]).splitlines() if not line.lstrip().startswith(("%", "!")))
    return sources


@functools.cache
def imported_top_levels() -> dict[str, set[str]]:
    """Each top-level module that our code imports (and that a shipped config names by class_path), with where."""
    found: dict[str, set[str]] = {}
    for where, source in code_sources().items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.partition(".")[0], set()).add(where)
    for config in sorted((ROOT / "configs").rglob("*.yaml")):
        for path in re.findall(r"class_path:\s*([\w.]+)", config.read_text()):
            found.setdefault(path.partition(".")[0], set()).add(str(config.relative_to(ROOT)))
    return found


def third_party_imports() -> dict[str, set[str]]:
    ours = our_packages()
    return {name: where for name, where in imported_top_levels().items()
            if name not in ours and name not in sys.stdlib_module_names and name not in ("__future__", "__main__")}


@functools.cache
def providers() -> dict[str, list[str]]:
    """Each installed top-level module with the distributions that install it."""
    return metadata.packages_distributions()


def test_every_imported_package_is_declared():
    declared_here = declared_names()
    problems = []
    for name, where in sorted(third_party_imports().items()):
        if name in UNDECLARED_IMPORTS:
            continue
        dists = {canonicalize_name(d) for d in providers().get(name, [])}
        files = ", ".join(sorted(where)[:3]) + (f" and {len(where) - 3} more" if len(where) > 3 else "")
        if not dists:
            problems.append(f"{name} (imported in {files}) is installed by no distribution here")
        elif not dists & declared_here:
            problems.append(f"{name} (imported in {files}) comes from {', '.join(sorted(dists))}, which "
                            "pyproject.toml does not declare")
    assert not problems, "\n".join(problems)


def test_every_declared_package_is_imported_or_listed_with_why():
    imported = set(third_party_imports())
    provides: dict[str, set[str]] = {}
    for top, dists in providers().items():
        for dist in dists:
            provides.setdefault(canonicalize_name(dist), set()).add(top)
    problems = []
    for name in sorted(declared_names()):
        if name not in provides:
            problems.append(f"{name} is declared but not installed here (make install)")
        elif provides[name] & imported and name in NOT_IMPORTED:
            problems.append(f"{name} is imported now: take it out of NOT_IMPORTED")
        elif not provides[name] & imported and name not in NOT_IMPORTED:
            problems.append(f"{name} is declared in pyproject.toml and imported nowhere")
    problems += [f"NOT_IMPORTED lists {name}, which pyproject.toml does not declare"
                 for name in sorted(set(NOT_IMPORTED) - declared_names())]
    problems += [f"UNDECLARED_IMPORTS lists {name}, which nothing imports"
                 for name in sorted(set(UNDECLARED_IMPORTS) - imported)]
    assert not problems, "\n".join(problems)


def test_the_scan_sees_imports_configs_and_notebooks():
    """The two tests above read what they should: a module's imports (nested ones too), a config's class_path and a
    notebook's cells."""
    found = imported_top_levels()
    assert "deploy/serve.py" in found["litserve"]  # at the top of a module
    assert "training/sweeps/command.py" in found["optuna"]  # inside a function
    assert "configs/recipes/rsb_a3.yaml" in found["timm"]
    assert "notebooks/02_results.ipynb" in found["optuna"]
    assert "tests/test_notebooks.py" in found["nbclient"]
    assert {"core", "training", "tests"} <= our_packages() and not {"core", "tests"} & set(third_party_imports())


# ---- the lock -------------------------------------------------------------------------------------------------

# The environments the lock is resolved for (uv's universal resolution, Python 3.11 on): Linux, macOS and Windows.
PLATFORMS = {"linux": ("Linux", "x86_64"), "darwin": ("Darwin", "arm64"), "win32": ("Windows", "AMD64")}
PYTHONS = ("3.11.9", "3.12.9", "3.13.5")


def environments() -> list[dict[str, str]]:
    here = default_environment()
    return [{**here, "sys_platform": platform, "platform_system": system, "platform_machine": machine,
             "os_name": "nt" if platform == "win32" else "posix", "python_full_version": python,
             "python_version": python.rpartition(".")[0], "implementation_name": "cpython",
             "platform_python_implementation": "CPython"}
            for platform, (system, machine) in PLATFORMS.items() for python in PYTHONS]


def locked() -> list[tuple[Requirement, list[str]]]:
    """The lock's pins, each with its hashes."""
    entries = re.split(r"\n(?=\S)", LOCK.read_text())
    pins = []
    for entry in entries:
        if entry.startswith(("#", "-")) or not entry.strip():  # a comment, an option (the last test refuses those)
            continue
        pin = Requirement(entry.split("\\", 1)[0].strip())
        pins.append((pin, re.findall(r"--hash=sha256:([0-9a-f]{64})", entry)))
    return pins


def pinned_in(env: dict[str, str]) -> dict[str, Version]:
    versions = {}
    for pin, _ in locked():
        if pin.marker is None or pin.marker.evaluate(env):
            (spec,) = pin.specifier
            assert canonicalize_name(pin.name) not in versions, f"{pin.name} is pinned twice where {env}"
            versions[canonicalize_name(pin.name)] = Version(spec.version)
    return versions


def test_the_lock_satisfies_pyproject_on_every_platform():
    problems: dict[str, list[str]] = {}  # what is wrong -> where
    for env in environments():
        versions = pinned_in(env)
        for group, requirements in declared().items():
            for req in requirements:
                if req.marker is not None and not req.marker.evaluate({**env, "extra": group}):
                    continue
                version = versions.get(canonicalize_name(req.name))
                if version is None or not req.specifier.contains(version, prereleases=True):
                    pinned = f"pins {version}" if version else "has no pin"
                    where = f"{env['sys_platform']} {env['python_version']}"
                    problems.setdefault(f"{req} ({group}): {LOCK.name} {pinned}", []).append(where)
    assert not problems, "\n".join(f"{what} on {', '.join(where)}" for what, where in problems.items()) + \
        "\n(make lock renews it)"


def test_the_lock_pins_exact_versions_with_hashes_and_names_no_index():
    text = LOCK.read_text()
    pins = locked()
    assert len(pins) > 100
    for pin, hashes in pins:
        (spec,) = pin.specifier
        assert spec.operator == "==" and hashes, f"{pin}: not an exact pin with its hashes"
    options = [line for line in text.splitlines() if line.lstrip().startswith("-") and not
               line.lstrip().startswith("--hash=")]
    assert not options, options  # no --index-url, --extra-index-url or --find-links: the lock names no source
    assert "://" not in text and "file:" not in text
    assert not any(canonicalize_name(pin.name) == "imgcls" for pin, _ in pins)
