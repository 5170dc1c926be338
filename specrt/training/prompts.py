"""A built-in, varied set of chat and code instructions for on-policy distillation data.

Prompts are built combinatorially from templates (coding tasks in ten languages,
explanations, lists, emails, math word problems, stories, factual Q&A, comparisons,
advice, rewriting). Every filler list is split in two by position: the HELD-OUT prompts
use only fillers (topics, tasks, names) that no training prompt contains, so acceptance
measured on them is acceptance on instructions the draft never saw.

    python -m specrt.training.prompts --split heldout --n 8   # print a few
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

LANGUAGES = ["Python", "JavaScript", "C", "C++", "Rust", "Go", "Java", "TypeScript", "Bash", "Ruby",
             "Kotlin", "C#", "Swift", "PHP", "Haskell"]
CODE_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number",
    "reverses a linked list", "counts the words in a text file", "removes duplicates from a list",
    "finds the largest element in an array", "sorts a list of numbers with merge sort",
    "converts Celsius to Fahrenheit", "checks whether a number is prime", "computes the factorial of n",
    "merges two sorted arrays", "parses a CSV line into fields", "computes the average of a list",
    "implements binary search", "validates an email address", "counts vowels in a string",
    "flattens a nested list", "computes the greatest common divisor of two numbers",
    "transposes a matrix", "returns the most frequent character in a string",
    "implements a stack with push and pop", "reads a JSON file and prints its keys",
    "generates all permutations of a string", "checks if two strings are anagrams",
    "rotates an array by k positions", "computes the sum of digits of an integer",
    "implements a simple queue", "finds the longest common prefix of a list of strings",
    "converts a decimal number to binary", "checks whether parentheses are balanced",
    "computes the dot product of two vectors", "capitalizes the first letter of each word",
    "implements bubble sort", "returns the intersection of two lists", "counts the lines of a file",
    "computes the power set of a set", "implements a binary search tree insert",
    "finds the second largest number in a list", "checks whether a year is a leap year",
    "computes the running total of a list", "splits a list into chunks of size n",
    "reverses the words in a sentence", "computes the median of a list of numbers",
    "finds all pairs in an array that sum to a target", "implements a least recently used cache",
]
CODE_FORMS = [
    "Write a {lang} function that {task}.",
    "Write a {lang} program that {task}. Add comments.",
    "How do I write code in {lang} that {task}?",
    "Show me a {lang} implementation of a function that {task}, with an example call.",
    "Write a short {lang} snippet that {task} and explain how it works.",
]
SNIPPETS = [
    ("Python", "def f(xs):\n    return [x * x for x in xs if x % 2 == 0]"),
    ("Python", "for i in range(1, 16):\n    print('Fizz' * (i % 3 == 0) + 'Buzz' * (i % 5 == 0) or i)"),
    ("JavaScript", "const add = (a) => (b) => a + b;\nconsole.log(add(2)(3));"),
    ("Python", "import collections\ncounts = collections.Counter(open('a.txt').read().split())\nprint(counts.most_common(3))"),
    ("C", "int sum(int *a, int n) {\n  int s = 0;\n  for (int i = 0; i < n; i++) s += a[i];\n  return s;\n}"),
    ("Python", "def g(n):\n    if n < 2:\n        return n\n    return g(n - 1) + g(n - 2)"),
    ("SQL", "SELECT name, COUNT(*) FROM orders GROUP BY name HAVING COUNT(*) > 5;"),
    ("Python", "with open('data.txt') as fh:\n    lines = [l.strip() for l in fh if l.strip()]"),
    ("Rust", "fn main() {\n    let v: Vec<i32> = (1..=10).filter(|x| x % 2 == 1).collect();\n    println!(\"{:?}\", v);\n}"),
    ("Java", "public static int max(int[] a) {\n    int m = a[0];\n    for (int x : a) if (x > m) m = x;\n    return m;\n}"),
    ("Python", "d = {k: v for k, v in zip('abc', range(3))}\nprint(sorted(d.items(), key=lambda kv: -kv[1]))"),
    ("Go", "func double(xs []int) []int {\n\tout := make([]int, len(xs))\n\tfor i, x := range xs {\n\t\tout[i] = 2 * x\n\t}\n\treturn out\n}"),
]
SNIPPET_FORMS = ["Explain what this {lang} code does:\n```\n{code}\n```",
                 "Is there a bug in this {lang} code? How would you improve it?\n```\n{code}\n```",
                 "Add comments to this {lang} code:\n```\n{code}\n```"]
CONCEPTS = [
    "photosynthesis", "gravity", "inflation", "machine learning", "the water cycle", "black holes",
    "recursion", "compound interest", "vaccines", "climate change", "the stock market", "DNA",
    "electricity", "the internet", "democracy", "supply and demand", "evolution", "blockchain",
    "the immune system", "plate tectonics", "the greenhouse effect", "neural networks",
    "the theory of relativity", "encryption", "photosynthesis in algae", "volcanoes", "the moon's phases",
    "a hash table", "object-oriented programming", "the scientific method", "rainbows", "tides",
    "cloud computing", "antibiotics", "the French Revolution", "quantum computing", "solar panels",
    "operating systems", "the human heart", "sleep", "probability", "time zones", "version control",
    "the Pythagorean theorem", "nuclear energy", "caching", "the Roman Empire", "how airplanes fly",
]
CONCEPT_FORMS = ["Explain {c} in simple terms.", "Explain {c} to a 10 year old.",
                 "What is {c}? Give an example.", "Write a short paragraph about {c}.",
                 "What are the most important facts about {c}?"]
LIST_THINGS = [
    "tips for learning a new language", "healthy breakfast ideas", "ways to save money",
    "books every programmer should read", "benefits of regular exercise", "ideas for a rainy day",
    "ways to reduce stress", "tips for a job interview", "things to pack for a beach trip",
    "common mistakes beginners make in Python", "ways to improve sleep", "fun facts about space",
    "houseplants that are easy to care for", "tips for writing clean code", "ways to be more productive",
    "questions to ask a new manager", "cheap date ideas", "tips for public speaking",
    "uses of baking soda", "reasons to learn to cook", "skills every developer needs",
    "ways to stay motivated", "tips for traveling on a budget", "indoor hobbies",
    "ways to reduce plastic waste", "tips for remote work", "study techniques for exams",
    "features of a good website", "ways to make friends in a new city", "board games for families",
]
LIST_FORMS = ["List {n} {t}.", "Give me {n} {t}.", "What are {n} {t}? Explain each briefly."]
RECIPIENTS = ["my landlord", "my manager", "a customer", "my teacher", "a colleague", "a new client",
              "the school principal", "my neighbor", "a hiring manager", "the support team",
              "my team", "a supplier", "my professor", "the city council", "a friend"]
EMAIL_TOPICS = ["a broken heater", "taking a day off next Friday", "a delayed delivery",
                "the project deadline", "a meeting next week", "a refund request", "a job application",
                "a noisy party", "a price increase", "feedback on a presentation", "a lost package",
                "rescheduling an appointment", "a thank-you for their help", "a new office policy",
                "an invoice that was paid twice", "joining the team", "a missed call", "a conference invitation"]
EMAIL_FORMS = ["Write a short email to {r} about {t}.", "Write a polite email to {r} regarding {t}.",
               "Draft a brief, friendly message to {r} about {t}."]
CHARACTERS = ["a robot", "a young wizard", "a lonely dragon", "a detective", "a cat", "an astronaut",
              "a baker", "a lighthouse keeper", "a little girl", "an old fisherman", "a time traveler",
              "a squirrel", "a pirate", "a student", "a knight", "a musician", "an inventor", "a ghost"]
SITUATIONS = ["finds a mysterious map", "learns to fly", "gets lost in a city", "makes a new friend",
              "discovers a hidden door", "loses their memory", "wins a competition", "saves a village",
              "travels to the moon", "opens a small shop", "meets their hero", "is afraid of the dark",
              "builds a machine", "finds a talking tree", "must solve a riddle", "goes on a road trip"]
STORY_FORMS = ["Write a short story about {c} who {s}.", "Tell me a bedtime story about {c} who {s}.",
               "Write a poem about {c} who {s}."]
QUESTIONS = [
    "Why is the sky blue?", "What is the capital of Australia?", "How many planets are in the solar system?",
    "Who wrote Romeo and Juliet?", "What is the boiling point of water?", "How do bees make honey?",
    "What causes earthquakes?", "Why do leaves change color in autumn?", "How does a refrigerator work?",
    "What is the largest ocean on Earth?", "How do vaccines work?", "Why do we have seasons?",
    "What is the speed of light?", "Who painted the Mona Lisa?", "How do computers store data?",
    "What is the difference between weather and climate?", "Why do cats purr?", "How is glass made?",
    "What is the tallest mountain in the world?", "How do birds migrate?", "Why is the ocean salty?",
    "What does a CPU do?", "How do plants grow?", "What is the population of Japan?",
    "Who invented the telephone?", "How does GPS work?", "What is an atom?", "Why do we dream?",
    "How do magnets work?", "What is the longest river in Africa?", "How does the heart pump blood?",
    "What is a prime number?", "Why do stars twinkle?", "How are rainbows formed?",
    "What is the difference between a virus and a bacterium?", "How does a compiler work?",
    "What is HTTP?", "How do solar eclipses happen?", "Why is exercise good for the brain?",
    "What language is spoken in Brazil?",
]
PAIRS = [("Python", "JavaScript"), ("a list", "a tuple in Python"), ("cats", "dogs as pets"),
         ("TCP", "UDP"), ("renting", "buying a house"), ("SQL", "NoSQL databases"), ("tea", "coffee"),
         ("a virus", "a bacterium"), ("weather", "climate"), ("RAM", "storage"), ("Linux", "Windows"),
         ("stocks", "bonds"), ("git merge", "git rebase"), ("a process", "a thread"),
         ("electric cars", "gasoline cars"), ("frontend", "backend development"), ("a crocodile", "an alligator"),
         ("HTTP", "HTTPS"), ("classes", "functions"), ("summer", "winter")]
PAIR_FORMS = ["What are the differences between {a} and {b}?", "Compare {a} and {b}.",
              "Which is better, {a} or {b}? Give pros and cons."]
GOALS = ["get better at chess", "start running", "learn to code", "write a good resume", "keep a plant alive",
         "cook rice properly", "improve my handwriting", "learn to play guitar", "organize my closet",
         "prepare for a marathon", "focus while studying", "start a small business", "learn to draw",
         "make my code faster", "debug a program", "save for retirement", "speak more confidently",
         "plan a birthday party", "train my dog", "reduce screen time"]
GOAL_FORMS = ["How can I {g}?", "Give me a step-by-step plan to {g}.", "What is the best way to {g}?"]
SENTENCES = ["hey can u send me the report asap thx", "The meeting got moved cause the boss is sick.",
             "I think maybe we should probably consider changing the plan.", "dont forget the milk and eggs",
             "Our product is good and people like it.", "The movie was long and kind of boring but ok.",
             "We was late because the bus dont come.", "This function is slow and nobody knows why.",
             "Thanks for the thing yesterday, it helped a lot.", "the weather today is really really nice"]
SENTENCE_FORMS = ["Rewrite this sentence to be more formal: {s}", "Fix the grammar: {s}",
                  "Make this sound more friendly: {s}", "Translate to French: {s}"]
NAMES = ["Anna", "Ben", "Carlos", "Dana", "Emeka", "Fatima", "George", "Hana", "Ivan", "Julia",
         "Kofi", "Lena", "Marco", "Nina", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tara"]
ITEMS = ["apples", "pencils", "books", "cookies", "stickers", "marbles", "tickets", "oranges", "cards", "shirts"]
MATH_FORMS = [
    "{name} has {a} {item} and buys {b} more. Then {name} gives away {c}. How many {item} are left?",
    "A shop sells {item} for ${p} each. {name} buys {a} of them and pays with a ${bill} bill. How much change does {name} get?",
    "{name} reads {a} pages a day. How many days does it take to finish a book with {n} pages?",
    "A train travels at {s} km/h for {h} hours. How far does it go?",
    "{name} splits {n} {item} equally among {k} friends. How many does each friend get, and how many are left over?",
    "A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "{name} saves ${a} every week. How many weeks until {name} has ${n}?",
    "If {a} workers build a wall in {h} days, how long would {k} workers take?",
    "What is {a}% of {n}? Show your steps.",
    "Solve for x: {a}x + {b} = {n}.",
]
CODE_COMPLETIONS = [  # raw (no chat template) code prompts
    "def is_prime(n):\n", "def quicksort(arr):\n", "import os\n\ndef list_files(path):\n",
    "class Stack:\n    def __init__(self):\n", "function debounce(fn, ms) {\n",
    "#include <stdio.h>\n\nint main(void) {\n", "def word_count(text):\n    \"\"\"Count words.\"\"\"\n",
    "fn fibonacci(n: u64) -> u64 {\n", "SELECT customers.name,", "def read_config(path):\n",
    "class Matrix:\n    def __init__(self, rows):\n", "async function fetchJson(url) {\n",
    "def binary_search(xs, target):\n", "public class Point {\n", "def moving_average(xs, k):\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n",
]


@dataclass(frozen=True)
class Prompt:
    kind: str  # "code" | "chat" (chat template) or "completion" (raw text)
    text: str  # the user message (or the raw prompt for "completion")


def _half(xs: list, heldout: bool) -> list:
    """Every 5th filler (offset 2) is held out; the rest are for training."""
    return [x for i, x in enumerate(xs) if (i % 5 == 2) == heldout]


def _math(rng: random.Random, names: list[str]) -> str:
    form = rng.choice(MATH_FORMS)
    a, b = rng.randint(2, 40), rng.randint(2, 30)
    return form.format(name=rng.choice(names), item=rng.choice(ITEMS), a=a, b=b, c=rng.randint(1, a),
                       p=rng.randint(2, 9), bill=rng.choice([20, 50, 100]), n=rng.randint(50, 400),
                       s=rng.randint(40, 160), h=rng.randint(2, 9), k=rng.randint(2, 8))


def _one(rng: random.Random, heldout: bool) -> Prompt:
    h = lambda xs: _half(xs, heldout)  # noqa: E731 - the split applies to every filler list
    kind = rng.choices(["code", "snippet", "concept", "list", "email", "story", "qa", "compare", "advice",
                        "rewrite", "math", "completion"], weights=[22, 6, 10, 7, 7, 7, 9, 5, 6, 4, 10, 7])[0]
    if kind == "code":
        return Prompt("code", rng.choice(CODE_FORMS).format(lang=rng.choice(h(LANGUAGES)), task=rng.choice(h(CODE_TASKS))))
    if kind == "snippet":
        lang, code = rng.choice(h(SNIPPETS))
        return Prompt("code", rng.choice(SNIPPET_FORMS).format(lang=lang, code=code))
    if kind == "completion":
        return Prompt("completion", rng.choice(h(CODE_COMPLETIONS)))
    if kind == "concept":
        text = rng.choice(CONCEPT_FORMS).format(c=rng.choice(h(CONCEPTS)))
    elif kind == "list":
        text = rng.choice(LIST_FORMS).format(n=rng.choice([3, 4, 5, 5, 7, 10]), t=rng.choice(h(LIST_THINGS)))
    elif kind == "email":
        text = rng.choice(EMAIL_FORMS).format(r=rng.choice(h(RECIPIENTS)), t=rng.choice(h(EMAIL_TOPICS)))
    elif kind == "story":
        text = rng.choice(STORY_FORMS).format(c=rng.choice(h(CHARACTERS)), s=rng.choice(h(SITUATIONS)))
    elif kind == "qa":
        text = rng.choice(h(QUESTIONS))
    elif kind == "compare":
        a, b = rng.choice(h(PAIRS))
        text = rng.choice(PAIR_FORMS).format(a=a, b=b)
    elif kind == "advice":
        text = rng.choice(GOAL_FORMS).format(g=rng.choice(h(GOALS)))
    elif kind == "rewrite":
        text = rng.choice(SENTENCE_FORMS).format(s=rng.choice(h(SENTENCES)))
    else:
        text = _math(rng, h(NAMES))
    return Prompt("chat", text)


def build_prompts(split: str, n: int, seed: int = 0) -> list[Prompt]:
    """``n`` distinct prompts of a split ("train" or "heldout"), deterministic for a seed.
    Held-out prompts use only fillers no training prompt uses (see module docstring)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    rng = random.Random(f"{split}:{seed}")
    seen: set[Prompt] = set()
    out: list[Prompt] = []
    for _ in range(50 * n):
        p = _one(rng, split == "heldout")
        if p not in seen:
            seen.add(p)
            out.append(p)
            if len(out) == n:
                return out
    raise ValueError(f"only {len(out)} distinct {split} prompts could be built, {n} requested")


def render(prompt: Prompt, tokenizer) -> list[int]:
    """Token ids of a prompt: the chat template with a generation prompt, or the raw text."""
    if prompt.kind == "completion" or not getattr(tokenizer, "chat_template", None):
        return tokenizer.encode(prompt.text)
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}], add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specrt.training.prompts", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--split", choices=["train", "heldout"], default="train")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for p in build_prompts(args.split, args.n, args.seed):
        print(f"[{p.kind}] {p.text}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
