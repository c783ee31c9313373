"""Writes ``prompts.jsonl`` beside it: the prompt set ``python -m nanospec.train`` runs the target over.

    python -m nanospec.train.prompts          # rewrites nanospec/train/prompts.jsonl

Templates times topics, seeded, plus real code and prose from the Python standard library this runs on (short
functions, docstrings: varied material no template list matches; another Python version gives another file, so
the shipped file is the reference), over the kinds of task ``benchmarks/prompts.jsonl``
has (summarize / rewrite, edit code, write code, answer from a context, chat, arithmetic word problems,
translation, extraction to JSON) but none of its content: that file, and Spec-Bench's questions, stay held
out for measuring the speculator. Each line: ``{"category": ..., "prompt": ...}``.
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from functools import lru_cache
from pathlib import Path

from nanospec.train.prompt_templates import (
    CHAT, CODE_FORMS, CODE_TASKS, COMPANIES, EDITS, EXTRACT, FILL, FUNCTIONS, ITEMS, LANGUAGES, LIST_ITEMS,
    LIST_TASKS, MATH, MONTHS, OTHER_CODE, PASSAGES, PEOPLE, PER_CATEGORY, PRODUCTS, QA_CONTEXTS, QA_FORMS, SEED,
    SENTENCES, STDLIB_MODULES, STD_CODE, STD_EXTRACT, STD_QA, STD_SUMMARY, SUMMARY_TASKS, TARGET_LANGUAGES, TITLES,
    TOWNS, TRANSLATE_FORMS, WEEKDAYS)


@lru_cache(maxsize=1)
def stdlib_material() -> tuple[list[str], list[tuple[str, str]]]:
    """(short functions' source, (name, docstring paragraph) pairs) from the standard library's own files."""
    root = Path(sysconfig.get_paths()["stdlib"])
    functions, paragraphs = [], []
    for module in STDLIB_MODULES:
        path = root / f"{module}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8", errors="replace")
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("__"):
                continue
            length = node.end_lineno - node.lineno + 1
            if 4 <= length <= 16:
                code = textwrap.dedent("\n".join(lines[node.lineno - 1:node.end_lineno]))
                if len(code) < 700 and "\t" not in code:
                    functions.append(code)
            doc = ast.get_docstring(node)
            if doc:
                paragraph = " ".join(doc.split("\n\n")[0].split())
                if 120 <= len(paragraph) <= 600:
                    paragraphs.append((node.name, paragraph))
        doc = ast.get_docstring(tree)
        if doc:
            for part in doc.split("\n\n"):
                paragraph = " ".join(part.split())
                if 150 <= len(paragraph) <= 700 and not paragraph.startswith(("-", "*", ">>>")):
                    paragraphs.append((module.split("/")[0], paragraph))
    return functions, paragraphs


def _slots(rng: random.Random) -> dict:
    towns = rng.sample(TOWNS, 3)
    people = rng.sample(PEOPLE, 3)
    animals = rng.sample(FILL["animal"] + ["horse", "duck", "squirrel", "deer"], 3)
    items = rng.sample(ITEMS, 3)
    m1, m2 = sorted(rng.sample(range(12), 2))
    year = rng.randint(1950, 1995)
    return dict(town=towns[0], town2=towns[1], town3=towns[2], person=people[0], person2=people[1],
                person3=people[2], company=rng.choice(COMPANIES), month=MONTHS[m1], month2=MONTHS[m2],
                day=rng.randint(1, 28), weekday=rng.choice(WEEKDAYS), pct=rng.randint(3, 40),
                n=rng.randint(12, 400), n2=rng.randint(20, 90), mins=rng.choice([10, 15, 20, 30]),
                price=rng.choice([2, 3, 4, 5, 8, 12, 15, 25]), price2=rng.choice([30, 40, 49, 60]),
                score=rng.choice(["2-1", "3-2", "1-0", "4-2"]), age=rng.randint(7, 70), hour=rng.randint(8, 11),
                year=year, year2=year + rng.randint(20, 30), depth=rng.randint(20, 300),
                name=rng.choice(["Moor", "Silver", "Eden", "Stillwater", "Heron"]), product=rng.choice(PRODUCTS),
                item1=items[0], item2=items[1], item3=items[2].rstrip("s"), a=rng.randint(2, 9), b=rng.randint(2, 6),
                domain=rng.choice(["brightmail", "harwickshop", "oakridge-club", "greenvale"]),
                phone=rng.randint(100000000, 999999999), animal=animals[0], animal2=animals[1], animal3=animals[2],
                title=rng.choice(TITLES))


def summarization(rng: random.Random) -> str:
    paragraphs = stdlib_material()[1]
    if paragraphs and rng.random() < 0.4:
        return rng.choice(STD_SUMMARY) + "\n\n" + rng.choice(paragraphs)[1]
    if rng.random() < 0.2:
        task, _ = rng.choice(LIST_TASKS)
        return task + "\n\n" + "\n".join(f"- {x}" for x in rng.sample(LIST_ITEMS, rng.randint(4, 7)))
    return rng.choice(SUMMARY_TASKS) + "\n\n" + rng.choice(PASSAGES).format(**_slots(rng))


def code_edit(rng: random.Random) -> str:
    functions = stdlib_material()[0]
    if functions and rng.random() < 0.6:
        return f"{rng.choice(EDITS + STD_CODE)}\n\n```python\n{rng.choice(functions)}\n```"
    lang, code = rng.choice(FUNCTIONS)
    return f"{rng.choice(EDITS)}\n\n```{lang}\n{code}\n```"


def code_write(rng: random.Random) -> str:
    paragraphs = stdlib_material()[1]
    if paragraphs and rng.random() < 0.35:
        name, text = rng.choice(paragraphs)
        return f"Write a Python function `{name}` that does what this describes:\n\n{text}"
    if rng.random() < 0.15:
        return rng.choice(OTHER_CODE)
    return rng.choice(CODE_FORMS).format(lang=rng.choice(LANGUAGES), task=rng.choice(CODE_TASKS))


def rag_qa(rng: random.Random) -> str:
    paragraphs = stdlib_material()[1]
    if paragraphs and rng.random() < 0.4:
        name, text = rng.choice(paragraphs)
        return rng.choice(QA_FORMS).format(ctx=text, q=rng.choice(STD_QA).format(name=name))
    context, questions = rng.choice(QA_CONTEXTS)
    return rng.choice(QA_FORMS).format(ctx=context.format(**_slots(rng)), q=rng.choice(questions))


def chat(rng: random.Random) -> str:
    form = rng.choice(CHAT)
    return form.format(**{k: rng.choice(v) for k, v in FILL.items()})


def math(rng: random.Random) -> str:
    h = rng.randint(2, 5)
    values = dict(a=rng.randint(2, 9), b=rng.randint(3, 8), c=rng.choice([120, 150, 240, 300, 360, 450, 600]),
                  d=rng.choice([36, 48, 64, 80, 96, 120, 150, 180, 250, 320]), e=rng.randint(10, 24),
                  p=rng.choice([5, 10, 12, 20, 25, 30, 40, 75]), h=h, w=rng.randint(2, 12),
                  t1=f"{rng.randint(6, 20)}:{rng.choice(['05', '20', '35', '50'])}", m=rng.choice([45, 70, 95, 130]))
    return rng.choice(MATH).format(**values)


def translation(rng: random.Random) -> str:
    return rng.choice(TRANSLATE_FORMS).format(lang=rng.choice(TARGET_LANGUAGES), s=rng.choice(SENTENCES))


def extraction(rng: random.Random) -> str:
    functions = stdlib_material()[0]
    if functions and rng.random() < 0.3:
        return f"{rng.choice(STD_EXTRACT)}\n\n```python\n{rng.choice(functions)}\n```"
    form, _ = rng.choice(EXTRACT)
    return form.format(**_slots(rng))


CATEGORIES = {"summarization": summarization, "code_edit": code_edit, "code_write": code_write, "rag_qa": rag_qa,
              "chat": chat, "math": math, "translation": translation, "extraction": extraction}


def make_prompts(per_category: int = PER_CATEGORY, seed: int = SEED) -> list[dict]:
    """``per_category`` distinct prompts of every category, interleaved (category by category, round robin)."""
    rng = random.Random(seed)
    by_category = {}
    for name, make in CATEGORIES.items():
        seen: dict[str, None] = {}
        for _ in range(per_category * 50):
            if len(seen) == per_category:
                break
            seen[make(rng)] = None
        by_category[name] = list(seen)
    return [{"category": name, "prompt": by_category[name][i]}
            for i in range(per_category) for name in CATEGORIES if i < len(by_category[name])]


if __name__ == "__main__":
    out = Path(__file__).with_name("prompts.jsonl")
    rows = make_prompts()
    out.write_text("".join(json.dumps(row) + "\n" for row in rows))
    print(f"wrote {len(rows)} prompts to {out}")
