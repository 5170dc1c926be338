"""The workloads of bench/agentic.py, built offline and deterministically (seeded) as token ids
with the target's chat template.

- ``edit``: multi-turn "edit this file" sessions over small Python standard-library files (a
  40-80 line slice read from the running interpreter's stdlib). Turn 1: the file and a small
  change (rename a function, add a comment line, change a constant), asking for the WHOLE file
  back; turn k+1: the conversation so far, with the model's own turn-k answer as the assistant
  message, and another small change. The answers are generated during the run, so a session's
  prompts are built turn by turn (``Session.prompt(codec, answers)``).
- ``tools``: one-turn requests under a shared system prompt that describes three tools with
  JSON schemas and a strict one-line JSON output format (one example call); each answer starts
  with the forced prefix ``{"name": "``. The requests share nothing but that format (what an
  index over earlier requests' outputs can draft from).
- ``chat``: held-out chat prompts of specrt's built-in prompt set (bench.smollm2_pair's, the
  chat-template ones): nothing repeats, the no-regression check.

Builders take a ``ChatCodec`` (chat template as text, text -> ids), so a test can run them with a
trivial tokenizer. An earlier answer enters the history as the exact ids the engine generated
(spliced into the rendered template), as an agent that keeps token-level history sends it.
"""
from __future__ import annotations

import json
import os
import random
import re
import sysconfig
from dataclasses import dataclass
from typing import Callable, Sequence

WORKLOADS = ("edit", "tools", "chat")

# small stdlib modules with several top-level functions (the edit sessions' files)
EDIT_FILES = ("bisect.py", "colorsys.py", "genericpath.py", "fnmatch.py", "sched.py", "reprlib.py",
              "textwrap.py", "keyword.py")


# ----------------------------------------------------------------------------- rendering
@dataclass(frozen=True)
class ChatCodec:
    """What the builders need from a tokenizer: the chat template (messages -> text, generation
    prompt included) and text -> token ids (no special tokens added)."""

    template: Callable[[list[dict]], str]
    encode: Callable[[str], list[int]]

    @classmethod
    def from_tokenizer(cls, tok) -> "ChatCodec":
        """specrt's (or an HF) tokenizer with a chat template."""
        return cls(lambda msgs: tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False),
                   lambda text: list(tok.encode(text, add_special_tokens=False)))


@dataclass(frozen=True)
class Message:
    role: str                        # system | user | assistant
    content: str | tuple[int, ...]   # text, or (an earlier answer) the token ids the model generated


_SENTINEL = "\x00ANSWER{}\x00"       # stands in for an answer's ids while the template renders
_SPLIT = re.compile("\x00ANSWER(\\d+)\x00")


def render(codec: ChatCodec, messages: Sequence[Message]) -> list[int]:
    """Token ids of a conversation with a generation prompt: the template renders text, each
    answer given as ids goes in verbatim (its text is never re-tokenized)."""
    answers = [m.content for m in messages if not isinstance(m.content, str)]
    msgs, i = [], 0
    for m in messages:
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
        else:
            msgs.append({"role": m.role, "content": _SENTINEL.format(i)})
            i += 1
    pieces = _SPLIT.split(codec.template(msgs))     # text, answer index, text, ...
    if len(pieces) != 2 * len(answers) + 1:
        raise ValueError("the chat template dropped or repeated an assistant message")
    ids: list[int] = []
    for j, piece in enumerate(pieces):
        if j % 2:
            ids += list(answers[int(piece)])
        elif piece:
            ids += codec.encode(piece)
    return ids


def strip_stop(output: Sequence[int], stop_ids) -> tuple[int, ...]:
    """An answer as it enters the history: the output without its end-of-turn token (the
    template closes the turn itself)."""
    out = list(output)
    while out and out[-1] in stop_ids:
        out.pop()
    return tuple(out)


# ----------------------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Session:
    """One conversation: a system prompt (or the template's default) and the user message of
    each turn, in order. Turn k's prompt holds every earlier turn with the model's answer."""

    label: str
    users: tuple[str, ...]
    system: str | None = None
    prefix: str = ""                 # each answer starts with this text (a framework's forced prefix),
                                     # part of the prompt; the model continues it

    def prompt(self, codec: ChatCodec, answers: Sequence[Sequence[int]]) -> list[int]:
        """Turn ``len(answers)``'s prompt, after the answers (ids) of the turns before it."""
        k = len(answers)
        if k >= len(self.users):
            raise IndexError(f"session {self.label} has {len(self.users)} turns, asked for turn {k + 1}")
        lead = tuple(codec.encode(self.prefix)) if self.prefix else ()
        msgs = [Message("system", self.system)] if self.system else []
        for user, answer in zip(self.users, answers):
            msgs += [Message("user", user), Message("assistant", lead + tuple(answer))]
        return render(codec, msgs + [Message("user", self.users[k])]) + list(lead)


@dataclass(frozen=True)
class Workload:
    name: str
    sessions: tuple[Session, ...]
    notes: dict                      # what it was built from (files, seeds), for the report

    @property
    def requests(self) -> int:
        return sum(len(s.users) for s in self.sessions)


# -- edit
@dataclass(frozen=True)
class SourceSlice:
    file: str
    first_line: int                  # 1-based, in the interpreter's copy
    text: str


def stdlib_slice(name: str, rng: random.Random, codec: ChatCodec | None, min_lines: int = 40,
                 max_lines: int = 80, max_tokens: int = 700) -> SourceSlice:
    """A slice of a stdlib file starting at a top-level def/class, ``min_lines``..``max_lines``
    lines, cut back (never below 10 lines) until it encodes to at most ``max_tokens``."""
    path = os.path.join(sysconfig.get_paths()["stdlib"], name)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(("def ", "class "))] or [0]
    fits = [i for i in starts if len(lines) - i >= min_lines] or starts[:1]
    start = rng.choice(fits)
    n = min(rng.randint(min_lines, max_lines), len(lines) - start)
    while n > 10 and codec is not None and len(codec.encode("\n".join(lines[start:start + n]))) > max_tokens:
        n -= 5
    return SourceSlice(name, start + 1, "\n".join(lines[start:start + n]))


_DEF = re.compile(r"^\s*def (\w+)\(", re.M)
_CONST = re.compile(r"^(\s*)([A-Za-z_]\w*) = (\d+(?:\.\d+)?)\s*$", re.M)


def edit_instructions(code: str, turns: int, rng: random.Random) -> list[str]:
    """``turns`` small, distinct changes to ``code``: renames, comment lines, constant changes
    (each function named at most once, so an earlier rename never invalidates a later one)."""
    funcs = [f for f in dict.fromkeys(_DEF.findall(code)) if not f.startswith("__")]
    rng.shuffle(funcs)
    consts = list(dict.fromkeys((m.group(2), m.group(3)) for m in _CONST.finditer(code)))
    out = []
    for k in range(turns):
        kinds = [x for x, ok in (("rename", funcs), ("comment", funcs), ("constant", consts)) if ok]
        kind = rng.choice(kinds) if kinds else "header"
        if kind == "rename":
            f = funcs.pop()
            out.append(f"Rename the function `{f}` to `{f}_v{k + 2}` and update every call to it.")
        elif kind == "comment":
            f = funcs.pop()
            out.append(f"Add the comment line `# checked: {f}` directly above `def {f}`.")
        elif kind == "constant":
            name, value = consts.pop(rng.randrange(len(consts)))
            new = str(int(value) + 1) if value.isdigit() else f"{float(value) + 0.5:g}"
            out.append(f"Change the value assigned to `{name}` from {value} to {new}.")
        else:
            out.append(f"Add the comment line `# revision {k + 2}` as the first line of the file.")
    return out


def edit_workload(codec: ChatCodec | None, sessions: int, turns: int, seed: int,
                  files: Sequence[str] = EDIT_FILES, max_file_tokens: int = 700) -> Workload:
    """``sessions`` sessions of ``turns`` turns, each on a slice of one of ``files`` (in a seeded
    order). ``codec`` (optional) caps the slice at ``max_file_tokens`` tokens."""
    rng = random.Random(f"edit:{seed}")
    order = list(files)
    rng.shuffle(order)
    out, notes = [], []
    for s in range(sessions):
        src = stdlib_slice(order[s % len(order)], rng, codec, max_tokens=max_file_tokens)
        asks = edit_instructions(src.text, turns, rng)
        first = (f"Here is the file `{src.file}`:\n```python\n{src.text}\n```\n{asks[0]} Reply with the WHOLE "
                 "updated file in one ```python code block and nothing else.")
        rest = [f"{a} Again reply with the WHOLE updated file in one ```python code block and nothing else."
                for a in asks[1:]]
        out.append(Session(f"edit-{s}:{src.file}", (first, *rest)))
        notes.append({"file": src.file, "first_line": src.first_line, "lines": src.text.count("\n") + 1,
                      "instructions": asks})
    return Workload("edit", tuple(out), {"seed": seed, "sessions": notes})


# -- tools
def _obj(required: list[str], **props) -> dict:
    return {"type": "object", "properties": props, "required": required}


_STR = {"type": "string"}
TOOLS = {   # name -> (description, JSON schema of its arguments)
    "get_weather": ("current weather in a city.",
                    _obj(["city", "unit"], city=_STR, unit={"type": "string", "enum": ["celsius", "fahrenheit"]})),
    "convert_currency": ("convert an amount of money.",
                         _obj(["amount", "from_currency", "to_currency"], amount={"type": "number"},
                              from_currency={"type": "string", "description": "ISO 4217 code"},
                              to_currency={"type": "string", "description": "ISO 4217 code"})),
    "search_flights": ("one-way flights between two cities on a date.",
                       _obj(["origin", "destination", "date"], origin=_STR, destination=_STR,
                            date={"type": "string", "description": "YYYY-MM-DD"})),
}
TOOLS_SYSTEM = ("You are a tool-calling assistant. You can call these tools:\n\n" +
                "".join(f"{name}: {desc}\n  parameters: {json.dumps(schema)}\n"
                        for name, (desc, schema) in TOOLS.items()) +
                """
Answer every request with exactly one tool call and nothing else: one line of JSON of the form
{"name": "<tool name>", "arguments": {<argument name>: <value>, ...}}
For example, for "How warm is it in Rome? In celsius." answer:
{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}""")

# the answer starts as a tool call (a small model ignores the format otherwise; frameworks that
# force JSON output do the same)
TOOLS_PREFIX = '{"name": "'

CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Krakow", "Hanoi", "Denver", "Tunis", "Perth",
          "Montreal", "Bergen", "Porto", "Seville", "Quito", "Tallinn", "Cebu", "Adelaide", "Valencia", "Accra")
CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "SEK", "INR", "BRL", "MXN", "NOK")
WEATHER = ("What's the weather like in {city} right now? Give it in {unit}.",
           "Is it cold in {city} today? I want the temperature in {unit}.",
           "Check the current weather for {city}, in {unit} please.")
CURRENCY = ("Convert {amount} {a} to {b}.", "How much is {amount} {a} in {b}?",
            "I have {amount} {a}. What is that in {b}?")
FLIGHTS = ("Find me a flight from {a} to {b} on {date}.", "Are there flights from {a} to {b} on {date}?",
           "Search one-way flights {a} -> {b}, departing {date}.")


def tool_request(rng: random.Random) -> str:
    kind = rng.choice(("weather", "currency", "flights"))
    if kind == "weather":
        return rng.choice(WEATHER).format(city=rng.choice(CITIES), unit=rng.choice(("celsius", "fahrenheit")))
    if kind == "currency":
        a, b = rng.sample(CURRENCIES, 2)
        return rng.choice(CURRENCY).format(amount=rng.choice((20, 75, 120, 250, 1000, 3500)), a=a, b=b)
    a, b = rng.sample(CITIES, 2)
    date = f"2025-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    return rng.choice(FLIGHTS).format(a=a, b=b, date=date)


def tools_workload(requests: int, seed: int) -> Workload:
    """``requests`` independent one-turn conversations under TOOLS_SYSTEM."""
    rng = random.Random(f"tools:{seed}")
    users = [tool_request(rng) for _ in range(requests)]
    sessions = tuple(Session(f"tools-{i}", (u,), TOOLS_SYSTEM, TOOLS_PREFIX) for i, u in enumerate(users))
    return Workload("tools", sessions,
                    {"seed": seed, "requests": users, "answer_prefix": TOOLS_PREFIX})


# -- chat
def chat_workload(prompts: int, seed: int) -> Workload:
    """``prompts`` held-out chat prompts of specrt.training.prompts (its completion prompts,
    raw text without a template, left out)."""
    from specrt.training.prompts import build_prompts

    chats = [p.text for p in build_prompts("heldout", 4 * prompts + 8, seed) if p.kind != "completion"][:prompts]
    return Workload("chat", tuple(Session(f"chat-{i}", (t,)) for i, t in enumerate(chats)),
                    {"seed": seed, "prompts": chats})


@dataclass(frozen=True)
class Sizes:
    edit_sessions: int = 2
    edit_turns: int = 3
    tool_requests: int = 6
    chat_prompts: int = 4
    max_file_tokens: int = 700


def build_workloads(names: Sequence[str], codec: ChatCodec | None, sizes: Sizes, seed: int) -> list[Workload]:
    """The named workloads, in the order given."""
    make = {"edit": lambda: edit_workload(codec, sizes.edit_sessions, sizes.edit_turns, seed,
                                          max_file_tokens=sizes.max_file_tokens),
            "tools": lambda: tools_workload(sizes.tool_requests, seed),
            "chat": lambda: chat_workload(sizes.chat_prompts, seed)}
    if bad := [n for n in names if n not in make]:
        raise ValueError(f"unknown workload(s) {bad}; expected some of {', '.join(WORKLOADS)}")
    return [make[n]() for n in names]
