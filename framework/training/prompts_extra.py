"""Train-only vocabularies and templates that grow the training prompt set to ~1,500 prompts
(``speculant.training.prompts``). Nothing here is ever used for the held-out split: the topics
below are new ones (none is a held-out topic; tests/test_training.py checks), and the extra
templates are applied to train topics only."""

from __future__ import annotations

CHAT_TOPICS = [
    "how a lighthouse guides ships", "why onions make people cry", "how a zipper works",
    "what a food chain is", "how soap removes grease", "why some animals hibernate",
    "how a piano makes sound", "what causes thunder", "how coral reefs grow",
    "why ice floats on water", "how a lock and key work", "what a dictionary is for",
    "how trains switch tracks", "why people get hiccups", "how a hot-air balloon rises",
    "what the greenhouse effect is", "how mushrooms grow", "why metal feels cold to touch",
    "how a library organises books", "what a leap year is", "how to make a simple omelette",
    "how to write a short cover letter", "how to keep a daily journal",
    "how to clean a laptop keyboard", "how to pack a suitcase efficiently",
    "how to prepare for a long hike", "how to take care of a cast iron pan",
    "how to give a short presentation", "how to fix a flat bicycle tyre",
    "how to start running in the morning", "how to choose a good book to read",
    "how to make friends in a new city", "how to water succulents", "how to brew coffee at home",
    "how to set goals for the new year", "how to teach a child to tie shoelaces",
    "how fireflies glow", "why the desert gets cold at night", "how a dam produces electricity",
    "what a museum curator does", "how penguins stay warm", "why maps use different projections",
    "how a clock keeps time", "what a noun and a verb are", "how seeds know which way is up",
    "how to host a small dinner party", "how to remember names better",
    "how to reduce food waste at home", "how to write a clear email",
    "how to read a nutrition label",
]
CHAT_TEMPLATES = [
    "What is the simplest way to understand {t}?", "Please describe {t} for a ten-year-old.",
    "Write a short paragraph about {t}.", "List three key facts about {t}.",
    "My friend asked me about {t}. How would you explain it?",
    "In a few sentences, tell me {t}.",
]

CODE_TASKS = [
    "counts the words in a sentence", "checks whether a list is sorted",
    "returns the minimum and maximum of a list", "converts a string to title case",
    "computes the area of a circle from its radius", "reverses the order of words in a sentence",
    "finds the first repeated character in a string", "computes the average of a list of numbers",
    "checks whether a number is a perfect square", "removes negative numbers from a list",
    "counts the uppercase letters in a string", "returns the last n elements of a list",
    "converts minutes to hours and minutes", "zips two lists into a dictionary",
    "computes the factorial of n iteratively", "finds the missing number in a range",
    "checks whether a string contains only digits", "returns the squares of numbers 1 to n",
    "computes simple interest", "swaps the keys and values of a dictionary",
    "counts the occurrences of a character in a string", "splits a sentence into words",
    "returns the median of three numbers", "checks whether a number is even or odd",
    "prints a multiplication table for a number", "computes the sum of a list recursively",
    "returns the unique characters of a string", "finds the longest common prefix of strings",
    "converts a binary string to an integer", "replaces every vowel in a string with a star",
    "computes the length of the hypotenuse of a right triangle",
    "returns the indices of all occurrences of a value in a list",
]
CODE_LANGS = ["Python", "JavaScript", "C", "Rust", "Go", "Java", "TypeScript", "C++"]
CODE_TEMPLATES = [
    "Implement a {lang} function that {t}.", "In {lang}, write code that {t}.",
    "Write a short {lang} program that {t} and explain how it works.",
    "How would I write a function in {lang} that {t}?",
]

MATH_ITEMS = [
    "pens", "plates", "cupcakes", "toy cars", "notebooks", "seashells", "bananas", "crayons",
    "postcards", "puzzles", "socks", "muffins", "kites", "jars of jam", "paper cups", "lemons",
]
MATH_TEMPLATES = [
    "{n} reads {b} pages a day. How many pages does {n} read in {a} days? Show your work.",
    "A train travels {a} kilometres in {b} hours. What is its average speed? Explain.",
    "{n} buys {b} packs of {i} with {a} in each pack. How many {i} does {n} have in total?",
    "There are {a} {i} in a basket. {n} takes {c}. How many are left? Explain your answer.",
    "A rectangle is {a} centimetres long and {b} centimetres wide. What are its area and "
    "perimeter?",
    "{n} saves {b} dollars every week. How many weeks until {n} has {a} dollars? Explain.",
    "What is {a} minus {c}, multiplied by {b}? Show each step.",
]

SUMMARY_SUBJECTS = [
    ("a public swimming pool", "extended its opening hours", "more swimmers came in the evening"),
    ("a regional airport", "added direct flights to the coast", "tourism grew in the area"),
    ("a children's hospital", "painted murals in its wards", "young patients felt calmer"),
    ("a village council", "installed street lights on the main road", "night-time "
     "accidents fell"),
    ("a software company", "let staff work from home two days a week", "productivity held "
     "steady"),
    ("a theatre group", "performed in local parks", "audiences grew younger"),
    ("a grocery store", "started selling local produce", "sales of fresh food rose"),
    ("a recycling centre", "accepted old electronics", "less waste went to landfill"),
    ("a dance school", "offered classes for seniors", "classes were fully booked"),
    ("a cycling club", "organised monthly group rides", "membership tripled"),
    ("a charity", "opened a second food bank", "twice as many families were helped"),
    ("a ski resort", "invested in snow machines", "the season lasted longer"),
    ("a science centre", "launched a summer camp", "local children took part"),
    ("a railway line", "reopened after repairs", "commuters returned quickly"),
    ("a city park", "added outdoor gym equipment", "more adults exercised there"),
    ("a small airline", "replaced its older planes", "fuel use dropped"),
    ("a language school", "introduced evening courses", "working adults enrolled"),
    ("a dairy farm", "switched to robotic milking", "the cows produced more milk"),
    ("a public radio station", "added a local news hour", "listener numbers rose"),
    ("a bookshop", "hosted weekly author talks", "book sales increased"),
    ("a police department", "began foot patrols downtown", "residents reported feeling safer"),
    ("a water utility", "fixed hundreds of leaking pipes", "water losses fell by half"),
    ("a cinema", "showed classic films on Mondays", "quiet nights filled up"),
    ("a secondary school", "banned phones during lessons", "teachers noticed better focus"),
    ("a garden centre", "gave free workshops on composting", "compost bin sales rose"),
    ("a national park", "limited daily visitor numbers", "trails recovered from erosion"),
    ("a shipping port", "automated its cranes", "ships were unloaded faster"),
    ("an animal shelter", "ran weekend adoption fairs", "more pets found homes"),
    ("a nursing home", "brought in therapy dogs", "residents smiled more"),
    ("a town market", "moved to a covered hall", "traders stayed open in the rain"),
    ("a research lab", "shared its data openly", "other teams reused it"),
    ("a ferry service", "added a night crossing", "island residents travelled more easily"),
    ("a sports centre", "offered cheaper student memberships", "student visits doubled"),
    ("a clothing brand", "started repairing worn garments", "customers kept clothes longer"),
    ("a local radio club", "taught teenagers to build antennas", "a new youth team formed"),
    ("a mountain village", "built a small hydro plant", "it now makes its own electricity"),
    ("a pharmacy", "offered free blood pressure checks", "several patients were referred early"),
    ("a city zoo", "started a breeding program for frogs", "a rare species recovered"),
    ("a kindergarten", "spent more time outdoors", "children got sick less often"),
    ("a call centre", "shortened its phone menus", "complaints went down"),
]
SUMMARY_TEMPLATES = [
    "Summarize this in one sentence: {S} {a}. Supporters said the idea was overdue, while "
    "critics asked who would pay for it. A year later, {r}.",
    "Write a short summary of the following report. {S} {a} in the spring. Staff needed a few "
    "weeks to adjust, but by the autumn {r}. A follow-up study is planned.",
    "TL;DR this paragraph: After months of discussion, {s} {a}. The first results are in: {r}. "
    "Local leaders hope other places will copy the idea.",
    "Summarize the key point of this news item in plain words: {S} {a}, according to a "
    "statement released this week. Officials added that {r}, and more changes may follow.",
    "Read the text and give a one-line summary. {S} {a}. At the start, only a handful of people "
    "noticed the change. Now {r}, and the budget for next year has been approved.",
    "Condense this into two sentences: When {s} {a}, few expected much. Yet within a year, "
    "{r}. The team behind the change credits careful planning and patient volunteers.",
]
