"""Write the shipped `code-math-640` prompts (polybasic/data/files/code_math/code_math_640.json): 400 programming
requests made from the documentation of Python's standard library (its docstrings' first sentences, PSF-2.0) and
240 arithmetic, algebra, calculus and probability questions from templates with seeded random numbers. Prompt-only
Alpaca records, for a drafter head's self-distillation (`distill.more_data`); nothing comes from a benchmark, and
no prompt equals one of work-mix-48's (the profile's prompts) or Spec-Bench's.

    python -m experiments.code_math_prompts [--check]

Deterministic for one Python minor version (the docstrings are its standard library's); --check compares with the
shipped file instead of writing it.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "polybasic" / "data" / "files" / "code_math" / "code_math_640.json"
N_CODE, N_MATH, SEED = 400, 240, 0
MODULES = ["string", "textwrap", "itertools", "functools", "collections", "heapq", "bisect", "statistics", "math",
           "fractions", "os.path", "shutil", "json", "csv", "re", "datetime", "calendar", "random", "hashlib",
           "base64", "urllib.parse", "html", "difflib", "fnmatch", "glob", "pathlib", "operator", "copy", "pprint",
           "zlib", "gzip", "tempfile", "secrets", "uuid", "ipaddress", "shlex", "graphlib", "contextlib",
           "dataclasses", "enum", "decimal", "colorsys", "filecmp", "keyword", "mimetypes", "numbers", "sched",
           "struct", "tarfile", "zipfile", "unicodedata", "email.utils", "configparser", "argparse", "logging",
           "sqlite3", "array", "weakref", "cmath", "binascii", "codecs", "reprlib", "ast", "inspect", "linecache",
           "queue", "threading", "timeit", "typing", "io", "os", "time", "platform", "getpass", "locale", "gettext",
           "warnings", "traceback", "types", "abc", "zoneinfo", "http.client", "smtplib", "socket",
           "selectors", "signal", "subprocess", "sys", "tomllib", "xml.etree.ElementTree"]
CODE_STYLES = [
    "Write a Python function `{name}{sig}` that does what `{qual}` does, without importing `{mod}`: {doc}",
    "Explain what `{qual}` does in Python and give a short example of using it. Its documentation says: \"{doc}\"",
    "Write pytest unit tests for `{qual}`, whose documentation says: \"{doc}\"",
    "Show how to use `{qual}` in a small Python script, with comments on each step.",
    "Implement `{name}{sig}` in plain Python. It should behave like this: {doc}",
    "A colleague wrote code that calls `{qual}`. Explain when to use it and one mistake people make with it.",
]
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jonas", "Kemi", "Lucia", "Mateo",
         "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Viktor", "Wen", "Yusuf", "Zoe"]
ITEMS = ["notebooks", "apples", "pens", "tickets", "plants", "mugs", "books", "candles", "batteries", "stickers"]


def _summary(obj) -> str | None:
    """The docstring's first sentence, on one line, or None where there is no usable one."""
    doc = inspect.getdoc(obj) or ""
    paras = [p for p in doc.split("\n\n") if p.strip()]
    if not paras:
        return None
    first = " ".join(paras[0].split())
    if re.match(r"^[\w.]+\(.*\)", first):  # a C function's signature line: take the next paragraph
        first = " ".join(paras[1].split()) if len(paras) > 1 else ""
    first = re.split(r"(?<=[.!?])\s", first)[0].strip()
    if len(first) < 20 or len(first) > 220 or not first[0].isalpha():
        return None
    return first if first.endswith((".", "!", "?")) else first + "."


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    return sig if len(sig) <= 80 and " at 0x" not in sig else "(...)"  # no object addresses: they change per run


def documented() -> list[tuple[str, str, str, str]]:
    """(module, name, signature, docstring sentence) of the standard library's documented public functions and
    classes in MODULES."""
    found = []
    for mod_name in MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        public = getattr(mod, "__all__", None) or [n for n in dir(mod) if not n.startswith("_")]
        for name in sorted(set(public)):
            obj = getattr(mod, name, None)
            if not (inspect.isfunction(obj) or inspect.isbuiltin(obj) or inspect.isclass(obj)):
                continue
            if inspect.isclass(obj) and (issubclass(obj, BaseException) or mod_name == "ast"):
                continue  # exceptions and syntax-tree nodes make poor programming requests
            home = (getattr(obj, "__module__", None) or mod_name).split(".")[0]
            if home not in (mod_name.split(".")[0], "_" + mod_name, "posixpath", "builtins"):
                continue
            doc = _summary(obj)
            if doc:
                found.append((mod_name, name, _signature(obj), doc))
    return found


def code_prompts(rng: random.Random) -> list[str]:
    found = documented()
    rng.shuffle(found)
    return [rng.choice(CODE_STYLES).format(name=name, sig=sig, qual=f"{mod}.{name}", mod=mod, doc=doc)
            for mod, name, sig, doc in found[:N_CODE]]


def _math(rng: random.Random) -> str:
    r, n, item = rng.randint, rng.choice(NAMES), rng.choice(ITEMS)
    a, b, c = r(2, 9), r(2, 12), r(3, 40)
    pick = r(0, 17)
    if pick == 0:
        k, p = r(3, 12), r(2, 15)
        return f"{n} buys {k} {item} at ${p} each and pays with a ${(k * p // 50 + 1) * 50} bill. How much change " \
               f"does {n} get? Show your steps."
    if pick == 1:
        return f"A recipe needs {a} cups of flour for {b * 6} cookies. How many cups are needed for " \
               f"{b * 6 * r(2, 5)} cookies? Explain your reasoning."
    if pick == 2:
        return f"A car uses {r(5, 9)}.{r(0, 9)} liters of fuel per 100 km. How much fuel does a {r(12, 90) * 10} km " \
               f"trip need, and what does it cost at ${r(1, 2)}.{r(10, 99)} per liter?"
    if pick == 3:
        return f"{n} saves ${r(15, 60)} every week. How many weeks until {n} has at least ${r(8, 40) * 50}? " \
               "Show the calculation."
    if pick == 4:
        return f"A shop takes {r(1, 6) * 5}% off a ${r(40, 250)} jacket and then adds {r(4, 12)}% sales tax. " \
               "What is the final price? Work it out step by step."
    if pick == 5:
        m = rng.choice([x for x in NAMES if x != n])
        d = r(2, 15)
        return f"The ages of {n} and {m} add up to {2 * r(20, 40) + d} years, and {n} is {d} years older. " \
               "How old is each? Set up equations."
    if pick == 6:
        w, ln = r(3, 20), r(21, 45)
        return f"A rectangle has a perimeter of {2 * (w + ln)} cm and a length of {ln} cm. What is its area?"
    if pick == 7:
        return f"One pipe fills a tank in {a} hours and another in {a + r(1, 6)} hours. How long do they take " \
               "together? Give the answer in hours and minutes."
    if pick == 8:
        return f"Two trains start {r(20, 80) * 10} km apart and travel toward each other at {r(6, 12) * 10} km/h " \
               f"and {r(5, 11) * 10} km/h. After how many hours do they meet?"
    if pick == 9:
        x0, d = r(-9, 12), r(2, 7)
        lhs = f"{a + d}x - {b}"
        return f"Find x if {lhs} = {a}x + {(a + d) * x0 - b - a * x0}. Show the algebra."
    if pick == 10:
        x0, y0 = r(-5, 6), r(-5, 6)
        e, f = r(1, 7), r(1, 7)
        return f"Solve the system of equations {a}x + {b}y = {a * x0 + b * y0} and {e}x - {f}y = {e * x0 - f * y0}. " \
               "Explain the method you use."
    if pick == 11:
        p, q = r(-9, 9), r(-9, 9)
        return f"Factor the quadratic x^2 {'+' if -(p + q) >= 0 else '-'} {abs(p + q)}x " \
               f"{'+' if p * q >= 0 else '-'} {abs(p * q)} and give its roots."
    if pick == 12:
        k, m = r(3, 6), r(2, 4)
        return f"Differentiate f(x) = {a}x^{k} - {b}x^{m} + {c}x - {r(1, 30)} and find f'(1)."
    if pick == 13:
        k = r(1, 4)
        return f"Compute the definite integral of {a}x^{k} + {b} from x = 0 to x = {r(2, 5)}. Show each step."
    if pick == 14:
        return f"Find the maximum value of f(x) = -{a}x^2 + {b * 2}x + {c} and the x where it occurs."
    if pick == 15:
        u, v = r(12, 99) * r(2, 9), r(12, 99) * r(2, 9)
        return f"What is the greatest common divisor of {u} and {v}? Use the Euclidean algorithm."
    if pick == 16:
        red, blue = r(3, 9), r(2, 9)
        return f"A bag holds {red} red and {blue} blue marbles. Two are drawn without replacement. What is the " \
               "probability that both are red?"
    k, m = r(2, 6), r(6, 12)
    return f"What is the probability of getting exactly {k} heads in {m} flips of a fair coin? Explain."


def math_prompts(rng: random.Random, avoid: set[str]) -> list[str]:
    out: list[str] = []
    while len(out) < N_MATH:
        p = _math(rng)
        if p not in avoid and p not in out:
            out.append(p)
    return out


def kept_apart() -> set[str]:
    """The prompts no self-distillation prompt may equal: work-mix-48's (the profile's) and Spec-Bench's."""
    from polybasic.data import catalog

    avoid = {r["instruction"] for r in json.loads(catalog.shipped_path("work-mix-48").read_text())}
    return avoid | {t for line in catalog.shipped_path("spec-bench").read_text().splitlines() if line.strip()
                    for t in json.loads(line).get("turns", [])}


def interleave(groups: list[tuple[list[str], int]]) -> list[str]:
    """[(prompts, n), ...] -> n of the first group's, n of the next's, ... in turn until all are out, so that any
    first N records hold every kind."""
    out, at = [], [0] * len(groups)
    while any(i < len(g) for i, (g, _) in zip(at, groups)):
        for j, (g, n) in enumerate(groups):
            out += g[at[j]:at[j] + n]
            at[j] += n
    return out


def records() -> list[dict]:
    avoid = kept_apart()
    rng = random.Random(SEED)
    code = [p for p in code_prompts(rng) if p not in avoid]
    math = math_prompts(rng, avoid)
    return as_records(interleave([(code, 5), (math, 3)]))  # 5 code, 3 math, ...


def as_records(prompts: list[str]) -> list[dict]:
    return [{"instruction": p, "input": "", "output": ""} for p in prompts]


def write_or_check(out: Path, records: list[dict], argv: list[str] | None, doc: str) -> None:
    """The drivers' command line: write `records` to `out` (--out moves it), or with --check compare them with it
    (exit 1: differs)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    ap.add_argument("--out", type=Path, default=out, help=f"the file (default {out})")
    a = ap.parse_args(argv)
    out = a.out
    text = json.dumps(records, indent=1, ensure_ascii=False) + "\n"
    if a.check:
        same = out.read_text(encoding="utf-8") == text
        print(f"{out}: {'identical' if same else 'differs'} (Python {sys.version_info.major}.{sys.version_info.minor})")
        raise SystemExit(0 if same else 1)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out}: {len(records)} records")


def main(argv: list[str] | None = None) -> None:
    write_or_check(OUT, records(), argv, __doc__)


if __name__ == "__main__":
    main()
