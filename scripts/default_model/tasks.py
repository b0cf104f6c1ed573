"""The default model's task: synthetic GSM8K-style arithmetic word problems.

Each generated problem is a short story (one of several templates) whose answer
is a chain of 2-4 dependent calculator lines followed by a GSM8K final line::

    tickets 2 * 3 = 6
    snacks 6 + 5 = 11
    hall 11 - 10 = 1
    goal 7 - 1 = 6
    #### 6

Every line after the first uses the result of the previous line, so a decoder
that fills many answer tokens in parallel without conditioning on earlier
results tends to make mistakes. Each line starts with a word of the question's
sentence that holds its new number (as GSM8K solutions restate what they count):
the model finds an operand by matching that word, not by counting numbers.
Numbers are kept small (every number of a question and every result in
[1, MAX_VALUE] = [1, 20]) so that a tiny model can learn the arithmetic in an
hour of CPU training: with results up to 50 an earlier shipped model got 41% of
result digits right and 8% of problems.
Answers are scored with ``psd_jax.scoring`` (GSM8K's conventions); this module
only makes problems, and is what ``make_dataset``, ``make_tokenizer`` and
``train`` of this package build the shipped model's files from.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NamedTuple

TEST_SEED = 12345  # seed of the shipped held-out set (models/default/test.jsonl)
MAX_VALUE = 20  # largest number of a problem (small enough for a tiny model to learn in an hour)

__all__ = [
    "MAX_VALUE",
    "TEMPLATES",
    "STEP_LINE",
    "TEST_SEED",
    "calculate",
    "generate_problem",
    "make_dataset",
    "parse_steps",
    "save_jsonl",
]


def save_jsonl(examples: Iterable[dict], path: str | Path) -> None:
    """Write examples as one JSON object per line."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for ex in examples:
            f.write(json.dumps(ex, ensure_ascii=False) + "\n")


STEP_LINE = re.compile(r"^(?:[a-z]+ )?(\d+) ([-+*/]) (\d+) = (\d+)$")


def calculate(a: int, op: str, b: int) -> int | None:
    """The value of the calculator line ``a op b``; None for a division that is not exact."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a // b if b and a % b == 0 else None
    raise ValueError(f"unknown operator {op!r}")


def parse_steps(answer: str) -> list[tuple[int, str, int, int]]:
    """The ``[label] a op b = c`` lines of a generated answer, as ``(a, op, b, c)``."""
    steps = []
    for line in answer.splitlines():
        m = STEP_LINE.match(line.strip())
        if m:
            steps.append((int(m[1]), m[2], int(m[3]), int(m[4])))
    return steps


# --------------------------------------------------------------------------- #
# Problem generator
# --------------------------------------------------------------------------- #


class _Retry(Exception):
    """Sampled numbers violate a constraint; the problem is re-drawn."""


class _Person(NamedTuple):
    name: str
    sub: str  # she / he
    obj: str  # her / him
    pos: str  # her / his

    @property
    def Sub(self) -> str:  # noqa: N802 - capitalized pronoun
        return self.sub.capitalize()


_FEMALE = [
    "Mia",
    "Emma",
    "Olivia",
    "Ava",
    "Sofia",
    "Lily",
    "Grace",
    "Chloe",
    "Nora",
    "Zoe",
    "Hannah",
    "Ella",
    "Ruby",
    "Lucy",
    "Sara",
    "Julia",
    "Maya",
    "Anna",
    "Rosa",
    "Kate",
]
_MALE = [
    "Tom",
    "Jack",
    "Liam",
    "Noah",
    "Ben",
    "Sam",
    "Leo",
    "Max",
    "Ryan",
    "Adam",
    "Owen",
    "Luke",
    "Eli",
    "Omar",
    "Carlos",
    "David",
    "Henry",
    "Paul",
    "Ivan",
    "Mark",
]
_PEOPLE = [_Person(n, "she", "her", "her") for n in _FEMALE] + [_Person(n, "he", "him", "his") for n in _MALE]


def _people(rng: random.Random, k: int) -> list[_Person]:
    return rng.sample(_PEOPLE, k)


class _Steps:
    """Records calculator lines ``label a op b = c``, enforces the value limits and
    samples operands that keep the next result valid."""

    def __init__(self, rng: random.Random, max_value: int = MAX_VALUE) -> None:
        self.rng = rng
        self.max_value = max_value
        self.lines: list[str] = []
        self.value: int | None = None

    def __call__(self, label: str, a: int, op: str, b: int) -> int:
        if op == "/" and b <= 1:
            raise _Retry
        c = calculate(a, op, b)
        if c is None or not 1 <= c <= self.max_value:
            raise _Retry
        self.lines.append(f"{label} {a} {op} {b} = {c}")
        self.value = c
        return c

    def part(self, x: int, hi: int = 40) -> int:
        """An amount to take away from ``x`` that leaves at least 1."""
        hi = min(hi, x - 1)
        if hi < 2:
            raise _Retry
        return self.rng.randint(2, hi)

    def divisor(self, x: int, lo: int = 2, hi: int = 9) -> int:
        """A divisor of ``x`` in [lo, hi] (smaller than ``x``)."""
        options = [d for d in range(lo, hi + 1) if x % d == 0 and d < x]
        if not options:
            raise _Retry
        return self.rng.choice(options)

    def factor(self, x: int, lo: int = 2, hi: int = 9) -> int:
        """A multiplier in [lo, hi] keeping ``x * f`` within the value limit."""
        hi = min(hi, self.max_value // x)
        if hi < lo:
            raise _Retry
        return self.rng.randint(lo, hi)

    def above(self, x: int, spread: int = 12) -> int:
        """A round-ish total larger than ``x`` (for 'how much more' questions)."""
        t = x + self.rng.randint(2, spread)
        if self.rng.random() < 0.5:
            t = (t + 9) // 10 * 10
        if t > self.max_value:
            raise _Retry
        return t


def _middles(rng: random.Random, k: int, n: int) -> list[int]:
    """Which of the ``n`` optional middle events to use (``k - 2`` of them, in order)."""
    return sorted(rng.sample(range(n), k - 2))


# Each template builds the question text for a ``k``-step problem (first step,
# k-2 optional middle steps, a final step) and records the steps in ``st``.
_Template = Callable[[random.Random, int, _Steps], str]


def _shopping(rng: random.Random, k: int, st: _Steps) -> str:
    (p,) = _people(rng, 1)
    item = rng.choice(
        ["notebooks", "pens", "apples", "candles", "mugs", "toy cars", "comic books", "socks", "plates", "plants"]
    )
    thing = rng.choice(["bag", "hat", "lamp", "scarf", "book", "clock"])
    a, price = rng.randint(2, 5), rng.randint(2, 6)
    x = st("buys", a, "*", price)
    text = [f"{p.name} buys {a} {item} for ${price} each."]
    for m in _middles(rng, k, 2):
        if m == 0:
            extra = rng.randint(2, 10)
            x = st("also", x, "+", extra)
            text.append(f"{p.Sub} also buys a {thing} for ${extra}.")
        else:
            off = st.part(x, 20)
            x = st("coupon", x, "-", off)
            text.append(f"{p.Sub} has a coupon for ${off} off.")
    if rng.random() < 0.5:
        bills = [b for b in (20, 50, 100, 200, 500) if b > x]
        if not bills:
            raise _Retry
        bill = bills[0]
        st("change", bill, "-", x)
        text.append(f"{p.Sub} pays with a ${bill} bill. How much change does {p.sub} get?")
    else:
        n = st.divisor(x, 2, 5)
        st("splits", x, "/", n)
        text.append(f"{p.Sub} splits the cost equally among {n} people. How much does each person pay?")
    return " ".join(text)


def _ages(rng: random.Random, k: int, st: _Steps) -> str:
    p, q, r, s = _people(rng, 4)
    a, b = rng.randint(2, 12), rng.randint(2, 8)
    x = st("older", a, "+", b)
    text = [f"{p.name} is {a} years old. {q.name} is {b} years older than {p.name}."]
    cur = q
    for m in _middles(rng, k, 2):
        if m == 0:
            f = rng.choice([2, 3])
            x = st("times", x, "*", f)
            text.append(f"{r.name} is {f} times as old as {cur.name}.")
            cur = r
        else:
            d = st.part(x, 10)
            x = st("younger", x, "-", d)
            text.append(f"{s.name} is {d} years younger than {cur.name}.")
            cur = s
    y = rng.randint(2, 8)
    st("will", x, "+", y)
    text.append(f"How old will {cur.name} be in {y} years?")
    return " ".join(text)


def _travel(rng: random.Random, k: int, st: _Steps) -> str:
    vehicle = rng.choice(["train", "bus", "truck", "car", "boat", "van"])
    speed, hours = rng.randint(2, 10), rng.randint(2, 4)
    x = st("hour", speed, "*", hours)
    text = [f"A {vehicle} travels at {speed} miles per hour for {hours} hours."]
    for m in _middles(rng, k, 2):
        if m == 0:
            d = rng.randint(2, 10)
            x = st("stop", x, "+", d)
            text.append(f"After a stop, it travels {d} more miles.")
        else:
            x = st("back", x, "*", 2)
            text.append("Then it makes the same trip back.")
    if rng.random() < 0.5:
        per = st.divisor(x, 2, 9)
        st("fuel", x, "/", per)
        text.append(f"It uses 1 liter of fuel every {per} miles. How many liters of fuel does it use?")
    else:
        t = st.above(x)
        st("route", t, "-", x)
        text.append(f"The whole route is {t} miles long. How many miles are left?")
    return " ".join(text)


def _baking(rng: random.Random, k: int, st: _Steps) -> str:
    (p,) = _people(rng, 1)
    item = rng.choice(["cookies", "muffins", "cupcakes", "rolls", "brownies", "tarts"])
    b, c = rng.randint(2, 4), rng.randint(2, 8)
    x = st("batches", b, "*", c)
    text = [f"{p.name} bakes {b} batches of {item} with {c} {item} in each batch."]
    for m in _middles(rng, k, 2):
        if m == 0:
            e = st.part(x, 12)
            x = st("eats", x, "-", e)
            text.append(f"{p.pos.capitalize()} family eats {e} of them.")
        else:
            f = rng.randint(2, 10)
            x = st("more", x, "+", f)
            text.append(f"Then {p.sub} bakes {f} more.")
    if rng.random() < 0.5:
        n = st.divisor(x, 2, 9)
        st("friends", x, "/", n)
        text.append(f"{p.Sub} shares them equally among {n} friends. How many {item} does each friend get?")
    else:
        price = st.factor(x, 2, 5)
        st("sells", x, "*", price)
        text.append(f"{p.Sub} sells them for ${price} each. How much money does {p.sub} make?")
    return " ".join(text)


def _savings(rng: random.Random, k: int, st: _Steps) -> str:
    p, q = _people(rng, 2)
    s, w = rng.randint(2, 9), rng.randint(2, 5)
    x = st("saves", s, "*", w)
    text = [f"{p.name} saves ${s} every week for {w} weeks."]
    for m in _middles(rng, k, 2):
        if m == 0:
            g = rng.randint(2, 10)
            x = st("birthday", x, "+", g)
            text.append(f"{q.name} gives {p.obj} ${g} for {p.pos} birthday.")
        else:
            spent = st.part(x, 40)
            x = st("spends", x, "-", spent)
            thing = rng.choice(["game", "book", "ball", "kite", "puzzle"])
            text.append(f"{p.Sub} spends ${spent} on a {thing}.")
    if rng.random() < 0.5:
        t = st.above(x)
        st("costs", t, "-", x)
        thing = rng.choice(["bike", "guitar", "tablet", "camera"])
        text.append(f"{p.Sub} wants a {thing} that costs ${t}. How much more money does {p.sub} need?")
    else:
        n = st.divisor(x, 2, 6)
        st("jars", x, "/", n)
        text.append(f"{p.Sub} puts the money equally into {n} jars. How much money is in each jar?")
    return " ".join(text)


def _workers(rng: random.Random, k: int, st: _Steps) -> str:
    place, item = rng.choice(
        [
            ("factory", "toys"),
            ("bakery", "pies"),
            ("workshop", "chairs"),
            ("farm", "baskets"),
            ("shop", "shirts"),
            ("studio", "vases"),
        ]
    )
    w, m_ = rng.randint(2, 5), rng.randint(2, 9)
    x = st("workers", w, "*", m_)
    text = [f"A {place} has {w} workers. Each worker makes {m_} {item} a day."]
    for m in _middles(rng, k, 2):
        if m == 0:
            d = st.factor(x, 2, 6)
            x = st("days", x, "*", d)
            text.append(f"They work for {d} days.")
        else:
            bad = st.part(x, 20)
            x = st("broken", x, "-", bad)
            text.append(f"{bad} of the {item} are broken.")
    if rng.random() < 0.5:
        n = st.divisor(x, 2, 9)
        st("boxes", x, "/", n)
        text.append(f"The {item} are packed in boxes of {n}. How many boxes do they fill?")
    else:
        old = rng.randint(2, 10)
        st("already", x, "+", old)
        text.append(f"The {place} already had {old} {item}. How many {item} does it have now?")
    return " ".join(text)


def _packing(rng: random.Random, k: int, st: _Steps) -> str:
    item = rng.choice(["oranges", "pencils", "lemons", "candies", "batteries", "eggs"])
    n, per = rng.randint(2, 4), rng.randint(2, 9)
    x = st("boxes", n, "*", per)
    text = [f"A store gets {n} boxes of {item}. Each box holds {per} {item}."]
    for m in _middles(rng, k, 2):
        if m == 0:
            sold = st.part(x, 40)
            x = st("morning", x, "-", sold)
            text.append(f"The store sells {sold} {item} in the morning.")
        else:
            more = rng.randint(2, 10)
            x = st("truck", x, "+", more)
            text.append(f"Then a truck brings {more} more {item}.")
    if rng.random() < 0.5:
        b = st.divisor(x, 2, 9)
        st("bags", x, "/", b)
        text.append(f"The {item} are put into bags of {b}. How many bags are there?")
    else:
        price = st.factor(x, 2, 4)
        st("sells", x, "*", price)
        text.append(f"Each one sells for ${price}. How much money can the store make?")
    return " ".join(text)


def _garden(rng: random.Random, k: int, st: _Steps) -> str:
    (p,) = _people(rng, 1)
    plant, crop = rng.choice(
        [
            ("tomato", "tomatoes"),
            ("pepper", "peppers"),
            ("bean", "beans"),
            ("melon", "melons"),
            ("corn", "ears of corn"),
        ]
    )
    r, c = rng.randint(2, 5), rng.randint(2, 8)
    x = st("rows", r, "*", c)
    text = [f"{p.name} plants {r} rows of {plant} plants with {c} plants in each row."]
    for m in _middles(rng, k, 2):
        if m == 0:
            e = st.part(x, 15)
            x = st("rabbits", x, "-", e)
            text.append(f"Rabbits eat {e} of the plants.")
        else:
            f = rng.randint(2, 10)
            x = st("later", x, "+", f)
            text.append(f"Later {p.sub} plants {f} more.")
    if rng.random() < 0.5:
        t = st.factor(x, 2, 8)
        st("gives", x, "*", t)
        text.append(f"Each plant gives {t} {crop}. How many {crop} does {p.name} pick?")
    else:
        g = st.divisor(x, 2, 9)
        st("neighbors", x, "/", g)
        text.append(f"{p.Sub} gives the plants equally to {g} neighbors. How many plants does each neighbor get?")
    return " ".join(text)


def _reading(rng: random.Random, k: int, st: _Steps) -> str:
    p, q = _people(rng, 2)
    r, d = rng.randint(2, 8), rng.randint(2, 4)
    x = st("every", r, "*", d)
    text = [f"{p.name} reads {r} pages every day for {d} days."]
    for m in _middles(rng, k, 2):
        z = rng.randint(2, 6)
        if m == 0:
            x = st("weekend", x, "+", z)
            text.append(f"On the weekend {p.sub} reads {z} more pages.")
        else:
            x = st("train", x, "+", z)
            text.append(f"Then {p.sub} reads {z} pages on the train.")
    if rng.random() < 0.5:
        t = st.above(x)
        st("book", t, "-", x)
        text.append(f"The book has {t} pages. How many pages are left to read?")
    else:
        f = st.factor(x, 2, 3)
        st("times", x, "*", f)
        text.append(f"{q.name} reads {f} times as many pages as {p.name}. How many pages does {q.name} read?")
    return " ".join(text)


def _school(rng: random.Random, k: int, st: _Steps) -> str:
    c, s = rng.randint(2, 4), rng.randint(3, 9)
    x = st("classes", c, "*", s)
    text = [f"A school has {c} classes with {s} students in each class."]
    for m in _middles(rng, k, 2):
        if m == 0:
            a = st.part(x, 25)
            x = st("absent", x, "-", a)
            text.append(f"Today {a} students are absent.")
        else:
            v = rng.randint(2, 10)
            x = st("visit", x, "+", v)
            text.append(f"{v} students from another school come to visit.")
    if rng.random() < 0.5:
        t = st.divisor(x, 2, 9)
        st("teams", x, "/", t)
        text.append(f"The students form teams of {t}. How many teams are there?")
    else:
        b = st.factor(x, 2, 4)
        st("pencils", x, "*", b)
        text.append(f"Each student gets {b} pencils. How many pencils are needed?")
    return " ".join(text)


def _eggs(rng: random.Random, k: int, st: _Steps) -> str:
    h, e = rng.randint(2, 6), rng.randint(2, 5)
    x = st("hens", h, "*", e)
    text = [f"A farmer has {h} hens. Each hen lays {e} eggs a week."]
    for m in _middles(rng, k, 2):
        if m == 0:
            f = st.part(x, 15)
            x = st("eats", x, "-", f)
            text.append(f"The family eats {f} eggs.")
        else:
            g = rng.randint(2, 10)
            x = st("neighbor", x, "+", g)
            text.append(f"A neighbor brings {g} more eggs.")
    if rng.random() < 0.5:
        c = st.divisor(x, 2, 9)
        st("cartons", x, "/", c)
        text.append(f"The eggs are sold in cartons of {c}. How many cartons are sold?")
    else:
        q = st.factor(x, 2, 3)
        st("sells", x, "*", q)
        text.append(f"Each egg sells for ${q}. How much money does the farmer make?")
    return " ".join(text)


def _parking(rng: random.Random, k: int, st: _Steps) -> str:
    r, c = rng.randint(2, 4), rng.randint(2, 9)
    x = st("rows", r, "*", c)
    text = [f"A parking lot has {r} rows with {c} cars in each row."]
    for m in _middles(rng, k, 2):
        if m == 0:
            gone = st.part(x, 30)
            x = st("leave", x, "-", gone)
            text.append(f"Then {gone} cars leave.")
        else:
            new = rng.randint(2, 10)
            x = st("arrive", x, "+", new)
            text.append(f"Later {new} more cars arrive.")
    if rng.random() < 0.5:
        st("wheels", x, "*", 4)
        text.append("Each car has 4 wheels. How many wheels are in the lot?")
    else:
        t = st.above(x)
        st("room", t, "-", x)
        text.append(f"The lot has room for {t} cars. How many more cars can park?")
    return " ".join(text)


def _marbles(rng: random.Random, k: int, st: _Steps) -> str:
    p, q = _people(rng, 2)
    item = rng.choice(["marbles", "stickers", "shells", "cards", "coins", "stamps"])
    a, b = rng.randint(3, 15), rng.randint(2, 8)
    x = st("gives", a, "+", b)
    text = [f"{p.name} has {a} {item}. {q.name} gives {p.obj} {b} more."]
    for m in _middles(rng, k, 2):
        if m == 0:
            c = st.part(x, 20)
            x = st("loses", x, "-", c)
            text.append(f"{p.Sub} loses {c} of them.")
        else:
            f = st.factor(x, 2, 3)
            times = "doubles" if f == 2 else "triples"
            x = st(times, x, "*", f)
            text.append(f"Then {p.sub} {times} {p.pos} collection.")
    if rng.random() < 0.5:
        j = st.divisor(x, 2, 9)
        st("jars", x, "/", j)
        text.append(f"{p.Sub} puts them equally into {j} jars. How many {item} are in each jar?")
    else:
        d = st.part(x, 30)
        st("left", x, "-", d)
        text.append(f"{p.Sub} gives {d} to {q.name}. How many {item} does {p.name} have left?")
    return " ".join(text)


def _tickets(rng: random.Random, k: int, st: _Steps) -> str:
    event, people = rng.choice(
        [
            ("concert", "band members"),
            ("school play", "classes"),
            ("charity race", "charities"),
            ("movie night", "clubs"),
        ]
    )
    t, price = rng.randint(2, 9), rng.randint(2, 5)
    x = st("tickets", t, "*", price)
    text = [f"A {event} sells {t} tickets for ${price} each."]
    for m in _middles(rng, k, 2):
        if m == 0:
            d = rng.randint(2, 10)
            x = st("snacks", x, "+", d)
            text.append(f"It also makes ${d} from snacks.")
        else:
            c = st.part(x, 60)
            x = st("hall", x, "-", c)
            text.append(f"It pays ${c} for the hall.")
    if rng.random() < 0.5:
        n = st.divisor(x, 2, 9)
        st("shared", x, "/", n)
        text.append(f"The money is shared equally among {n} {people}. How much does each get?")
    else:
        goal = st.above(x)
        st("goal", goal, "-", x)
        text.append(f"The goal was ${goal}. How much more money is needed?")
    return " ".join(text)


def _stickers(rng: random.Random, k: int, st: _Steps) -> str:
    p, q = _people(rng, 2)
    item = rng.choice(["stickers", "photos", "stamps", "cards"])
    n, per = rng.randint(2, 4), rng.randint(2, 8)
    if n * per > st.max_value:
        raise _Retry
    x = st("albums", n * per, "/", n)
    text = [f"{p.name} has {n * per} {item} and puts them equally into {n} albums."]
    for m in _middles(rng, k, 2):
        if m == 0:
            a = rng.randint(2, 10)
            x = st("adds", x, "+", a)
            text.append(f"{p.Sub} adds {a} more {item} to the first album.")
        else:
            r = st.part(x, 15)
            x = st("takes", x, "-", r)
            text.append(f"Then {p.sub} takes {r} {item} out of that album.")
    if rng.random() < 0.5:
        f = st.factor(x, 2, 4)
        st("times", x, "*", f)
        text.append(f"{q.name} has {f} times as many {item} as the first album. How many {item} does {q.name} have?")
    else:
        c = rng.randint(2, 10)
        st("gives", x, "+", c)
        text.append(f"{q.name} gives {p.obj} {c} more for that album. How many {item} are in it now?")
    return " ".join(text)


def _pizza(rng: random.Random, k: int, st: _Steps) -> str:
    (p,) = _people(rng, 1)
    n, s = rng.randint(2, 4), rng.choice([2, 4, 6, 8])
    x = st("pizzas", n, "*", s)
    text = [f"{p.name} orders {n} pizzas for a party. Each pizza is cut into {s} slices."]
    for m in _middles(rng, k, 2):
        if m == 0:
            d = rng.randint(2, 10)
            x = st("friend", x, "+", d)
            text.append(f"A friend brings {d} more slices.")
        else:
            e = st.part(x, 20)
            x = st("eaten", x, "-", e)
            text.append(f"{e} slices are eaten before the guests arrive.")
    g = st.divisor(x, 2, 9)
    st("guests", x, "/", g)
    text.append(f"The slices are shared equally by {g} guests. How many slices does each guest get?")
    return " ".join(text)


TEMPLATES: dict[str, _Template] = {
    "shopping": _shopping,
    "ages": _ages,
    "travel": _travel,
    "baking": _baking,
    "savings": _savings,
    "workers": _workers,
    "packing": _packing,
    "garden": _garden,
    "reading": _reading,
    "school": _school,
    "eggs": _eggs,
    "parking": _parking,
    "marbles": _marbles,
    "tickets": _tickets,
    "stickers": _stickers,
    "pizza": _pizza,
}
_TEMPLATE_LIST = list(TEMPLATES.values())


def generate_problem(
    rng: random.Random, template: str | None = None, steps: int | None = None, max_value: int = MAX_VALUE
) -> dict:
    """One random problem ``{"question": str, "answer": str}``.

    The answer has 2-4 (or ``steps``) dependent lines ``a op b = c`` and ends
    with ``#### c``. ``template`` picks a story from TEMPLATES (default: random);
    every result lies in [1, max_value] (lower it for an easier task)."""
    fn = rng.choice(_TEMPLATE_LIST)
    k = rng.randint(2, 4)
    template = TEMPLATES[template] if template is not None else fn
    if steps is not None:
        if not 2 <= steps <= 4:
            raise ValueError("steps must be 2, 3 or 4")
        k = steps
    for _ in range(10_000):
        st = _Steps(rng, max_value)
        try:
            question = template(rng, k, st)
        except _Retry:
            continue
        assert len(st.lines) == k, (template, k, st.lines)
        return {"question": question, "answer": "\n".join(st.lines) + f"\n#### {st.value}"}
    raise RuntimeError(f"template {template.__name__} failed to produce a {k}-step problem")


def make_dataset(
    n: int, seed: int, exclude: Iterable[str] = (), unique: bool = False, max_value: int = MAX_VALUE
) -> list[dict]:
    """``n`` problems, deterministic given ``seed``.

    Problems whose question is in ``exclude`` (e.g. the questions of a held-out
    set) are skipped; ``unique=True`` also drops repeated questions;
    ``max_value`` bounds every intermediate result (see generate_problem)."""
    rng = random.Random(seed)
    skip = set(exclude)
    out: list[dict] = []
    while len(out) < n:
        ex = generate_problem(rng, max_value=max_value)
        if ex["question"] in skip:
            continue
        if unique:
            skip.add(ex["question"])
        out.append(ex)
    return out
