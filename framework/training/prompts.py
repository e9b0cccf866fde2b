"""The prompt sets that training and acceptance evaluation read: original short prompts in four
categories (chat, code, math, summarization), built deterministically from templates and topic
lists written for this repository (no downloads, nothing read from outside the package).

``prompt_set("train")`` and ``prompt_set("held-out")`` never share a topic: every category's
topic list is split by index (every fifth topic is held out), so acceptance measured on the
held-out set is not measured on anything the head was trained on.

The train split is then grown to ``TRAIN_PER_CATEGORY`` prompts per category with train-only
topics and templates (``speculant.training.prompts_extra``), combinations drawn by a fixed seed;
the held-out split is the original 84 prompts, unchanged.

After those 1,500 the train split holds ``TRAIN_GROUNDED`` input-grounded prompts (category
``grounded``, train only): a given paragraph or function to summarize, answer a question about,
rewrite, copy, edit or explain (``speculant.training.passages``, text written for this
repository; none of it is the demo's). They teach a head what the target does with text in its
prompt, the demo's kind of request."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

from speculant.training import prompts_extra as extra

CATEGORIES = ("chat", "code", "math", "summarization")
SPLITS = ("train", "held-out")
TRAIN_PER_CATEGORY = 375  # 1,500 train prompts, the four categories balanced
GROUNDED = "grounded"  # the train-only category of input-grounded prompts
TRAIN_GROUNDED = 500  # input-grounded train prompts, after the 1,500


@dataclass(frozen=True)
class Prompt:
    category: str  # one of CATEGORIES
    text: str  # the user message


_CHAT_TOPICS = [
    "how rainbows form", "why the sky is blue", "how vaccines train the immune system",
    "what a black hole is", "how bees make honey", "why leaves change color in autumn",
    "how a bicycle stays upright", "what causes tides", "how airplanes fly",
    "why we dream", "how a refrigerator keeps food cold", "what inflation means",
    "how the internet sends a message", "why cats purr", "how volcanoes erupt",
    "what photosynthesis does", "how a compass works", "why the moon has phases",
    "how batteries store energy", "what a credit score is", "how to start a vegetable garden",
    "how to prepare for a job interview", "how to keep a houseplant alive",
    "how to learn a new language", "how to save money on groceries", "how to sleep better",
    "how to make a good cup of tea", "how to write a thank-you note", "how to plan a road trip",
    "how to stay focused while studying", "how earthquakes are measured",
    "what the water cycle is", "how a microwave heats food", "why salt melts ice",
    "how glaciers move", "what a solar eclipse is", "how a camera captures light",
    "why exercise improves mood", "how recycling plastic works", "what an atom is made of",
    "how birds migrate", "why bread rises", "how a thermostat works", "what a budget is for",
    "how to train a puppy", "how to run a first five kilometres", "how to organise a closet",
    "how to cook rice on a stove", "how clouds form", "why the ocean is salty",
]
_CHAT_TEMPLATES = [
    "Explain {t} in simple terms.", "Can you tell me {t}?", "Give me a short overview of {t}.",
    "I'm curious about {t}. What should I know?",
]

_CODE_TASKS = [
    "reverses a string", "checks whether a number is prime", "returns the factorial of n",
    "counts the vowels in a string", "finds the largest element of a list",
    "removes duplicates from a list while keeping order", "computes the nth Fibonacci number",
    "checks whether a string is a palindrome", "merges two sorted lists",
    "returns the sum of the digits of an integer", "converts Celsius to Fahrenheit",
    "flattens a nested list", "counts how often each word appears in a text",
    "returns the second smallest number in a list", "checks whether two strings are anagrams",
    "computes the greatest common divisor of two numbers", "transposes a matrix",
    "finds the index of a value with binary search", "rotates a list by k positions",
    "returns all even numbers from a list", "capitalises the first letter of every word",
    "computes the mean and median of a list", "checks whether brackets are balanced",
    "converts a decimal number to binary", "returns the longest word in a sentence",
    "sorts a list of tuples by their second element", "chunks a list into pieces of size n",
    "computes the running total of a list", "checks whether a year is a leap year",
    "finds the common elements of two lists", "counts the lines in a text file",
    "returns the n largest values of a list", "validates a simple email address",
    "computes the dot product of two vectors", "removes all whitespace from a string",
    "groups words by their first letter", "returns the prime factors of a number",
    "implements a stack with push and pop", "reads a CSV file into a list of dictionaries",
    "computes the power set of a list",
]
_CODE_LANGS = ["Python", "Python", "JavaScript", "C"]
_CODE_TEMPLATES = [
    "Write a {lang} function that {t}.", "Show me {lang} code that {t}, with a short explanation.",
]

_MATH_ITEMS = [
    "apples", "pencils", "books", "marbles", "stickers", "cookies", "coins", "cards", "shells",
    "stamps", "balloons", "oranges", "tickets", "flowers", "candles", "buttons", "eggs", "bottles",
    "blocks", "beads",
]
_MATH_NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo"]
_MATH_TEMPLATES = [
    "{n} has {a} {i}. They buy {b} more and then give away {c}. How many {i} are left? "
    "Explain step by step.",
    "A box holds {a} {i}. How many {i} are in {b} boxes? Show your work.",
    "{n} shares {a} {i} equally among {b} friends. How many does each friend get, and how many "
    "are left over?",
    "What is {a} plus {b} times {c}? Explain the order of operations.",
    "A shop sells {i} at {b} dollars each. How much do {a} of them cost?",
]

_SUMMARY_SUBJECTS = [
    ("a small town library", "opened a reading room for teenagers", "visits doubled"),
    ("a city council", "added protected bike lanes downtown", "cycling trips rose sharply"),
    ("a local bakery", "switched to solar panels", "its power bill fell by a third"),
    ("a high school", "started a weekly coding club", "forty students joined"),
    ("a hospital", "introduced online appointment booking", "waiting times dropped"),
    ("a farm cooperative", "planted drought-tolerant wheat", "harvests stayed stable"),
    ("a museum", "offered free entry on Sundays", "families visited more often"),
    ("a tech startup", "moved to a four-day work week", "staff turnover fell"),
    ("a river park", "removed invasive plants", "native birds returned"),
    ("a bus company", "bought electric buses", "noise complaints decreased"),
    ("a community garden", "shared tools among members", "more vegetables were grown"),
    ("a university", "recorded all its lectures", "exam pass rates improved slightly"),
    ("a zoo", "built a larger elephant enclosure", "the animals became more active"),
    ("a coffee chain", "stopped using plastic straws", "customers mostly approved"),
    ("a fishing village", "limited catches for two years", "fish stocks recovered"),
    ("a hotel", "trained staff in first aid", "guests felt safer"),
    ("a football club", "opened a youth academy", "three players reached the first team"),
    ("a newspaper", "launched a daily podcast", "younger readers subscribed"),
    ("a primary school", "served free breakfasts", "attendance went up"),
    ("a car factory", "installed new safety sensors", "accidents fell to zero"),
]
_SUMMARY_TEMPLATES = [
    "Summarize in one sentence: Last year {s} {a}. The change was debated at first, and some "
    "people worried about the cost. After twelve months, {r}, and most residents said they "
    "wanted the program to continue.",
    "Give a two-line summary of this note: {S} {a} after a long planning process. Early "
    "reports show that {r}. Organisers say they will publish a full review next spring.",
]


def _split(items: list, split: str) -> list:
    if split not in SPLITS:
        raise ValueError(f"unknown prompt split {split!r}; use one of {SPLITS}")
    held = split == "held-out"
    return [x for i, x in enumerate(items) if (i % 5 == 4) == held]


def prompt_set(split: str = "train") -> list[Prompt]:
    """Every prompt of ``split`` ("train" or "held-out"), in a fixed order (categories
    interleaved, so any prefix of the list covers all four)."""
    by_cat: dict[str, list[str]] = {c: [] for c in CATEGORIES}
    for t in _split(_CHAT_TOPICS, split):
        by_cat["chat"] += [tpl.format(t=t) for tpl in _CHAT_TEMPLATES]
    for i, t in enumerate(_split(_CODE_TASKS, split)):
        for j, tpl in enumerate(_CODE_TEMPLATES):
            by_cat["code"].append(tpl.format(t=t, lang=_CODE_LANGS[(i + j) % len(_CODE_LANGS)]))
    rng = random.Random(1234 if split == "train" else 4321)
    for item in _split(_MATH_ITEMS, split):
        for tpl in _MATH_TEMPLATES:
            a, b = rng.randint(12, 60), rng.randint(3, 11)
            by_cat["math"].append(tpl.format(n=rng.choice(_MATH_NAMES), i=item, a=a, b=b,
                                             c=rng.randint(2, a // 2)))
    for s, a, r in _split(_SUMMARY_SUBJECTS, split):
        for tpl in _SUMMARY_TEMPLATES:
            by_cat["summarization"].append(tpl.format(s=s, S=s[0].upper() + s[1:], a=a, r=r))
    if split == "train":
        _grow_train(by_cat)
    out: list[Prompt] = []
    for i in range(max(len(v) for v in by_cat.values())):
        out += [Prompt(c, by_cat[c][i]) for c in CATEGORIES if i < len(by_cat[c])]
    if split == "train":  # after the 1,500, so their distilled chunks stay what they were
        out += [Prompt(GROUNDED, t) for t in _grounded()]
    return out


_PASSAGE_TEMPLATES = [
    "Summarize this text in one sentence:\n\n{p}",
    "Write a short summary of the following paragraph:\n\n{p}",
    "{p}\n\nSummarize the paragraph above in two sentences.",
    "{p}\n\n{q}",
    "Read the text and answer the question.\n\nText: {p}\n\nQuestion: {q}",
    "Copy this paragraph exactly as it is:\n\n{p}",
    "Rewrite this paragraph in simpler words:\n\n{p}",
    "Turn this paragraph into three bullet points:\n\n{p}",
    "Fix any spelling or grammar mistakes in this paragraph and return it:\n\n{p}",
]
_SNIPPET_TEMPLATES = [
    "Rename {f} to {g} in this code and show the full result:\n\n{c}",
    "Change the name of the function {f} to {g}. Return the updated code.\n\n{c}",
    "Explain what this function does:\n\n{c}",
    "Add a docstring to this function and return it:\n\n{c}",
    "Add type hints to this Python function:\n\n{c}",
    "{c}\n\nAre there any bugs in this code? Explain briefly.",
]


def _grounded() -> list[str]:
    """``TRAIN_GROUNDED`` input-grounded prompts: every passage with every passage template and
    every snippet with every snippet template, a seeded sample."""
    from speculant.training import passages as ps

    questions = dict(ps.QUESTIONS)
    texts = [tpl.format(p=p, q=questions[i]) for i, p in enumerate(ps.PASSAGES)
             for tpl in _PASSAGE_TEMPLATES]
    texts += [tpl.format(f=f, g=g, c=c.strip()) for (f, c), g in zip(ps.SNIPPETS, ps.RENAMES)
              for tpl in _SNIPPET_TEMPLATES]
    return random.Random(77).sample(texts, TRAIN_GROUNDED)


def _fill(texts: list[str], candidates: list[str], rng: random.Random) -> None:
    """Append to ``texts`` candidates (in a seeded random order, skipping ones already there)
    until it holds ``TRAIN_PER_CATEGORY``."""
    seen = set(texts)
    fresh = [c for c in dict.fromkeys(candidates) if c not in seen]
    need = TRAIN_PER_CATEGORY - len(texts)
    if need > len(fresh):
        raise RuntimeError(f"only {len(fresh)} new prompts for {need} places: add topics or "
                           "templates to speculant.training.prompts_extra")
    texts += rng.sample(fresh, need)


def _grow_train(by_cat: dict[str, list[str]]) -> None:
    """The train split's extra prompts: every train topic (original and extra) with every
    template (original and extra), a seeded sample of the combinations."""
    rng = random.Random(2024)
    chat_topics = _split(_CHAT_TOPICS, "train") + extra.CHAT_TOPICS
    _fill(by_cat["chat"], [tpl.format(t=t) for t, tpl in itertools.product(
        chat_topics, _CHAT_TEMPLATES + extra.CHAT_TEMPLATES)], rng)
    tasks = _split(_CODE_TASKS, "train") + extra.CODE_TASKS
    _fill(by_cat["code"], [tpl.format(t=t, lang=extra.CODE_LANGS[(i + j) % len(extra.CODE_LANGS)])
                           for i, t in enumerate(tasks)
                           for j, tpl in enumerate(_CODE_TEMPLATES + extra.CODE_TEMPLATES)], rng)
    math = []
    for item, tpl in itertools.product(_split(_MATH_ITEMS, "train") + extra.MATH_ITEMS,
                                       _MATH_TEMPLATES + extra.MATH_TEMPLATES):
        a, b = rng.randint(12, 90), rng.randint(3, 11)
        math.append(tpl.format(n=rng.choice(_MATH_NAMES), i=item, a=a, b=b,
                               c=rng.randint(2, a // 2)))
    _fill(by_cat["math"], math, rng)
    _fill(by_cat["summarization"], [
        tpl.format(s=s, S=s[0].upper() + s[1:], a=a, r=r)
        for (s, a, r), tpl in itertools.product(_split(_SUMMARY_SUBJECTS, "train")
                                                + extra.SUMMARY_SUBJECTS,
                                                _SUMMARY_TEMPLATES + extra.SUMMARY_TEMPLATES)], rng)
