"""The package stands on its own: a wheel built from the repository, installed into an empty directory, runs
the commands a user types from any other directory (configs resolved from the copy packaged inside the
wheel); the wheel holds the library and its commands, not the studies beside it (experiments/), which the
library never imports; and no import graph has cycles."""
import ast
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = REPO / "tests" / "fixtures" / "moc_pt_paper_small.npz"
SOURCES = ("setup.py", "setup.cfg", "pyproject.toml", "README.md", "moc_jax", "kernels_pallas", "configs")
PAPER_FORWARD_FLOPS = 459_171_802_488  # MoC-PT's estimator, the paper model, one 1024-token sequence


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
  """(site directory holding only the installed wheel, an unrelated working directory)."""
  source, build, site, elsewhere = (tmp_path_factory.mktemp(n) for n in ("source", "wheel", "site", "elsewhere"))
  for name in SOURCES:  # a copy: building leaves build/ and *.egg-info beside the sources
    if (REPO / name).is_dir():
      shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    else:
      shutil.copy(REPO / name, source / name)
  pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
  subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(build), str(source)], check=True,
                 capture_output=True, timeout=600)
  wheel, = build.glob("moc_jax-*.whl")
  subprocess.run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], check=True, capture_output=True,
                 timeout=600)
  return site, elsewhere, wheel


STUDIES = ("experiments", "sweeps", "sweep_report", "routing_evidence", "retention", "bench")


def test_wheel_holds_the_library_not_the_studies(installed):
  """The wheel's packages are moc_jax (with its configs) and kernels_pallas; no module of the studies tree
  (sweeps, reports, harnesses, benchmarks) is among its files, under any package."""
  names = zipfile.ZipFile(installed[2]).namelist()
  tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
  assert tops == {"moc_jax", "kernels_pallas"}, tops
  parts = {p.removesuffix(".py") for n in names for p in n.split("/")}
  assert not parts & set(STUDIES), sorted(parts & set(STUDIES))
  assert "moc_jax/main.py" in names and "moc_jax/configs/moc.py" in names


def _run(installed, *args):
  site, elsewhere, _ = installed
  env = {**os.environ, "PYTHONPATH": str(site)}  # before the environment's own (editable) moc_jax
  return subprocess.run([sys.executable, *args], cwd=elsewhere, env=env, capture_output=True, text=True, timeout=900)


def test_wheel_imports_itself_with_its_configs(installed):
  out = _run(installed, "-c", "import moc_jax, moc_jax.configs as c; print(moc_jax.__file__); print(c.__file__)")
  assert out.returncode == 0, out.stderr
  files = out.stdout.split()
  assert all(f.startswith(str(installed[0])) for f in files), files
  packaged = pathlib.Path(files[1]).parent
  assert {"moc.py", "vanilla.py", "mocpt.py"} <= {p.name for p in packaged.glob("*.py")}
  assert list((packaged / "mocpt_examples").glob("*.yaml"))


def test_wheel_flops_from_another_directory(installed):
  out = _run(installed, "-m", "moc_jax.flops", "--config=configs/moc.py:262k", "--batch=1", "--seq_len=1024",
             "--json")
  assert out.returncode == 0, out.stderr
  assert json.loads(out.stdout)["forward"]["total"] == PAPER_FORWARD_FLOPS


def test_wheel_missing_config_is_one_line(installed):
  out = _run(installed, "-m", "moc_jax.flops", "--config=configs/nope.py:tiny")
  assert out.returncode == 2
  assert out.stderr.strip().startswith("error: config file 'configs/nope.py' not found") and "\n" not in out.stderr.strip()


def test_wheel_parity_from_another_directory(installed):
  out = _run(installed, "-m", "moc_jax.parity", str(FIXTURE))
  assert out.returncode == 0, out.stdout + out.stderr
  assert "PASS" in out.stdout


def _module_name(path: pathlib.Path) -> str:
  return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: pathlib.Path, modules: set[str]) -> set[str]:
  """Which of `modules` `path` imports, at module level or inside functions: `from pkg import sub` is an
  import of the submodule `pkg.sub`; `from pkg import name` of anything else is an import of `pkg`."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom):
      assert not node.level, f"{path}: relative import"
      subs = {f"{node.module}.{a.name}" for a in node.names}
      found |= subs & modules
      if subs - modules:
        found.add(node.module)
  return found & modules


@pytest.mark.parametrize("package", ["moc_jax", "kernels_pallas", "experiments"])
def test_no_import_cycles(package):
  """Every import between the package's modules (function-level ones too) points one way."""
  files = {_module_name(p): p for p in (REPO / package).rglob("*.py")}
  graph = {m: _imports(p, set(files)) - {m} for m, p in files.items()}
  cycles, state = [], {}

  def visit(m, stack):
    state[m] = "open"
    for n in sorted(graph[m]):
      if state.get(n) == "open":
        cycles.append(stack[stack.index(n):] + [n])
      elif n not in state:
        visit(n, stack + [n])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_library_reads_no_config_files_by_path():
  """moc_jax never edits sys.path nor names the repository's configs/ directory on disk."""
  offenders = [str(p.relative_to(REPO)) for p in (REPO / "moc_jax").rglob("*.py")
               if re.search(r"sys\.path\.(insert|append)|REPO_ROOT", p.read_text())]
  assert not offenders


@pytest.mark.parametrize("package", ["moc_jax", "kernels_pallas"])
def test_library_imports_no_study(package):
  """Imports point down: the studies import the library, never the other way (function-level imports too)."""
  offenders = []
  for path in (REPO / package).rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
               [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      offenders += [f"{path.relative_to(REPO)}: {n}" for n in names if n.split(".")[0] in ("experiments", "launch")]
  assert not offenders, offenders
