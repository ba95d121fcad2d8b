"""What `pip install .` puts in site-packages: one top-level package, `deepinfer`, holding the repo's
`kernels/`, `audit/`, `harness/` and `reports/` folders as subpackages, under a distribution name that
is not DeepSeek's `deepinfer`; and in this venv nothing of ours answers to Hugging Face's `kernels`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MAPPED = {"deepinfer": "deepinfer", "kernels": "deepinfer/kernels", "audit": "deepinfer/audit",
          "harness": "deepinfer/harness", "reports": "deepinfer/reports"}


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory) -> list[str]:
    """The file list of a wheel built from the tracked files (a copy: the build leaves nothing in the repo)."""
    source, dist = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("dist")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            (source / name).write_bytes((REPO / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                    str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = dist.glob("*.whl")
    return zipfile.ZipFile(wheel).namelist()


def test_the_wheel_installs_one_top_level_package_under_a_name_of_its_own(wheel_names):
    top = {name.split("/")[0] for name in wheel_names}
    info = next(name for name in top if name.endswith(".dist-info"))
    assert top == {"deepinfer", info}
    assert info.startswith("deepinfer_repro-")


def test_every_module_of_the_repo_folders_is_in_the_wheel_where_its_namespace_says(wheel_names):
    shipped = set(wheel_names)
    for folder, installed in MAPPED.items():
        for module in (REPO / folder).rglob("*.py"):
            relative = module.relative_to(REPO / folder).as_posix()
            assert f"{installed}/{relative}" in shipped, f"{folder}/{relative} is not in the wheel"
    for data in ("harness/suites/smoke.jsonl", "harness/suites/lm_eval/deepinfer_gen.yaml", "recipe/corpus.txt"):
        assert any(name.endswith(data) for name in shipped), data


def test_no_top_level_name_of_ours_shadows_another_package(tmp_path):
    """transformers (>= 5.25) depends on Hugging Face's `kernels` and imports it: our `kernels` folder
    is `deepinfer.kernels` once installed, so `kernels` is theirs (or absent) and their detection works.
    Checked outside the repo, where the working directory would put the source tree's folders on sys.path."""
    code = """
import importlib.metadata, importlib.util, json
import transformers.utils.import_utils as hub
origins = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in ("kernels", "audit", "harness", "reports")}
try:
    installed = importlib.metadata.version("kernels")
except importlib.metadata.PackageNotFoundError:
    installed = None
if installed:
    import kernels
    assert hasattr(kernels, "get_kernel"), kernels.__file__
print(json.dumps({"origins": origins, "installed": installed, "detected": hub.is_kernels_available()}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    assert all(origin != str(REPO / name / "__init__.py") for name, origin in found["origins"].items()), found
    if found["installed"] is None:
        assert found["detected"] is False, found


def test_reading_runs_and_rendering_reports_loads_no_torch(tmp_path):
    code = ("import sys, deepinfer.audit.store, deepinfer.audit.certificate, deepinfer.reports; "
            "print(sorted(m for m in ('torch', 'deepinfer.engine', 'deepinfer.kernels') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_python_dash_m_deepinfer_is_the_console_script(tmp_path):
    """One command line: `python -m deepinfer` has every command the `deepinfer` console script has."""
    commands = []
    for argv in ([sys.executable, "-m", "deepinfer", "--help"], [str(Path(sys.executable).parent / "deepinfer"), "--help"]):
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        commands.append(done.stdout.split("commands:", 1)[1])
    assert commands[0] == commands[1] and "audit" in commands[0] and "generate" in commands[0]


def test_the_durations_table_times_the_suite_as_make_test_runs_it():
    spec = importlib.util.spec_from_file_location("test_durations", REPO / "benchmarks" / "test_durations.py")
    durations = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(durations)
    makefile = (REPO / "Makefile").read_text()
    assert f"\t$(VENV)/bin/pytest {durations.MAKE_TEST_OPTIONS}\n" in makefile
