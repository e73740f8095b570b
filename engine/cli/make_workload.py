#!/usr/bin/env python
"""Build the benchmark workload: chat prompts that look like real use, as JSONL for tools/bench.py --workload.

    python tools/make_workload.py [--out examples/workload/workload.jsonl] [--seed 0] [--per-category 8]

Four categories, built only from text that ships with CPython (the documentation in ``pydoc_data.topics``,
the standard library's sources and docstrings; PSF License Version 2), never from an evaluation text:

- chat: multi-turn conversations whose later turns quote earlier ones (a pasted paragraph, an answer that
  quotes it, a follow-up quoting the answer or the paragraph);
- code-edit: rewrite or annotate a standard-library function given in full;
- qa: a question over a documentation passage that holds its answer (checked here);
- json: extract given fields as JSON from a passage or a record-like text.

Each line is ``{"category": ..., "messages": [{"role", "content"}, ...]}``, the last message the user's. The
same seed on the same Python gives the same bytes (``BUILT_WITH``: the version the committed file came from).
For benchmarking drafts only: the prompts measure speculation on realistic shapes, not answer quality.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import json
import random
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.core.cli import OneLineParser, run_tool

CATEGORIES = ("chat", "code-edit", "qa", "json")
BUILT_WITH = "3.11.7"  # the Python whose stdlib the committed examples/workload/workload.jsonl was built from
DEFAULT_OUT = Path("examples/workload/workload.jsonl")
Message = dict[str, str]


# ---------------------------------------------------------------------------------------------- the sources


def topic(name: str) -> str:
    """A documentation topic of ``pydoc_data.topics`` (what ``help("with")`` shows)."""
    from pydoc_data.topics import topics

    return topics[name].strip()


def passage(name: str, limit: int = 2600) -> str:
    """A topic's text cut at a paragraph boundary within ``limit`` characters."""
    out = []
    for para in topic(name).split("\n\n"):
        if out and sum(len(p) + 2 for p in out) + len(para) > limit:
            break
        out.append(para)
    return "\n\n".join(out)


def prose(text: str) -> list[str]:
    """The prose paragraphs of a documentation text (no grammar, code or headings), each on one line."""
    paras = []
    for para in text.split("\n\n"):
        lines = para.splitlines()
        if not lines or any(ln.startswith(" ") or set(ln) <= set("*=-") for ln in lines) or "::" in para:
            continue
        one = re.sub(r"(?<=\w)- (?=[a-z])", "-", " ".join(ln.strip() for ln in lines))  # "left-\nhand": left-hand
        if 160 <= len(one) <= 900 and one.endswith("."):
            paras.append(one)
    return paras


def sentences(text: str) -> list[str]:
    """The sentences of one line of prose (a period, then a space and a capital or a quote)."""
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z\"(])", text) if s.strip()]


def function_source(module: str, name: str) -> str:
    """A function's source text as its module's .py file has it (C-accelerated modules keep the Python
    definition in the file, so this never depends on which one is bound at import)."""
    path = inspect.getsourcefile(importlib.import_module(module))
    assert path is not None, module
    src = Path(path).read_text(encoding="utf-8")
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            seg = ast.get_source_segment(src, node)
            assert seg is not None
            return seg
    raise LookupError(f"{module}.{name} is not in {path}")


def _quote(s: str, words: int = 9) -> str:
    """The first ``words`` words of a sentence, as a user quotes it."""
    w = s.rstrip(".").split()
    return " ".join(w[:words]) + ("..." if len(w) > words else "")


# ---------------------------------------------------------------------------------------------- chat

CHAT_SOURCES = (
    ("topic", "with"),
    ("topic", "import"),
    ("topic", "try"),
    ("topic", "raise"),
    ("topic", "execmodel"),
    ("topic", "comparisons"),
    ("topic", "augassign"),
    ("topic", "customization"),
    ("topic", "typesmapping"),
    ("doc", "heapq.__about__"),
    ("doc", "json.__doc__"),
    ("topic", "exceptions"),
)
CHAT_OPENERS = (
    "I'm reading the Python documentation and got stuck on this part:",
    "Here is a paragraph from the Python reference:",
    "Can you help me understand this passage?",
    "A colleague sent me this from the Python docs:",
)
CHAT_ASKS = (
    "Can you summarise it in two sentences?",
    "What is the main point, in plain words?",
    "Explain it to someone who has just started with Python.",
    "What should I remember from this?",
)
CHAT_FOLLOWUPS = (
    'You said "{quote}". What does that mean in practice? Give a short example.',
    'About your answer: "{quote}" -- is that always true, or are there exceptions?',
    'The passage also says "{later}". How does that fit with what you wrote?',
    'I don\'t get this part: "{later}". Can you rephrase it?',
)


def _chat_text(kind: str, name: str) -> list[str]:
    if kind == "topic":
        return prose(topic(name))
    module, attr = name.split(".")
    return prose(inspect.cleandoc(getattr(importlib.import_module(module), attr)))


def chat(rng: random.Random, n: int) -> list[list[Message]]:
    out = []
    for kind, name in rng.sample(CHAT_SOURCES, n):
        paras = _chat_text(kind, name)
        start = rng.randrange(max(1, len(paras) - 1))
        pasted = paras[start : start + 2]
        sents = [s for p in pasted for s in sentences(p)]
        first, later = sents[0], sents[-1] if len(sents) > 1 else sents[0]
        opener, ask = rng.choice(CHAT_OPENERS), rng.choice(CHAT_ASKS)
        answer = f"In short: {first} " + (f"It also notes that {later[0].lower()}{later[1:]}" if later != first else "")
        msgs: list[Message] = [
            {"role": "user", "content": f"{opener}\n\n" + "\n\n".join(pasted) + f"\n\n{ask}"},
            {"role": "assistant", "content": answer.strip()},
        ]
        follow = rng.choice(CHAT_FOLLOWUPS).format(quote=_quote(first), later=_quote(later, 14))
        msgs.append({"role": "user", "content": follow})
        if rng.random() < 0.5:  # a third turn that quotes the second
            mid = sents[len(sents) // 2]
            msgs.append(
                {
                    "role": "assistant",
                    "content": f'Rephrased: {mid} In other words, "{_quote(first, 6)}" '
                    "holds whenever the conditions above are met.",
                }
            )
            msgs.append(
                {
                    "role": "user",
                    "content": f'Thanks. Last question: you wrote "{_quote(mid, 7)}". '
                    "Can you put the whole explanation together in one short paragraph?",
                }
            )
        out.append(msgs)
    return out


# ---------------------------------------------------------------------------------------------- code-edit

FUNCTIONS = (
    ("textwrap", "dedent"),
    ("textwrap", "indent"),
    ("shlex", "quote"),
    ("shlex", "split"),
    ("json.decoder", "py_scanstring"),
    ("heapq", "merge"),
    ("heapq", "_siftup"),
    ("bisect", "insort_right"),
    ("bisect", "bisect_left"),
    ("fnmatch", "translate"),
    ("string", "capwords"),
    ("posixpath", "normpath"),
    ("colorsys", "rgb_to_hls"),
    ("base64", "b64encode"),
)
EDITS = (
    "Add type hints to this function and rewrite its docstring in Google style. Return the whole function.",
    "Rewrite this function with clearer local variable names, without changing its behaviour. "
    "Show the complete rewritten function.",
    "Annotate this function: add a short comment above each non-trivial line saying what it does. "
    "Keep the code itself unchanged.",
    "Refactor this function to reduce nesting where you can, keeping its behaviour identical. Return only the code.",
    "Write pytest unit tests for this function, covering the normal case and two edge cases.",
    "Convert the docstring of this function to reStructuredText with :param: and :returns: fields, "
    "and return the full function.",
)


def code_edit(rng: random.Random, n: int) -> list[list[Message]]:
    out = []
    for module, name in rng.sample(FUNCTIONS, n):
        code = function_source(module, name)
        fenced = f"```python\n{code}\n```"
        where = f"This is `{name}` from CPython's `{module}` module."
        style = rng.randrange(3)
        if style == 0:
            msgs = [{"role": "user", "content": f"{where}\n\n{fenced}\n\n{rng.choice(EDITS)}"}]
        elif style == 1:
            system = "You are a careful Python reviewer. Answer with code in a single fenced block."
            msgs = [
                {"role": "system", "content": system},
                {"role": "user", "content": f"{rng.choice(EDITS)}\n\n{fenced}"},
            ]
        else:  # explain first, then edit what was explained
            doc = ast.get_docstring(ast.parse(code).body[0])  # type: ignore[arg-type]
            summary = (doc or f"It is {module}.{name}.").split("\n\n")[0].replace("\n", " ")
            msgs = [
                {"role": "user", "content": f"What does this function do?\n\n{fenced}"},
                {"role": "assistant", "content": f"`{name}` comes from `{module}`. Its docstring says: {summary}"},
                {"role": "user", "content": f"Good. Now: {rng.choice(EDITS)}"},
            ]
        out.append(msgs)
    return out


# ---------------------------------------------------------------------------------------------- qa

QUESTIONS = (  # (topic, question, words of the passage that answer it)
    ("assert", "What is the simple form of the assert statement equivalent to?", "if not expression: raise"),
    ("assert", "When does the code generator emit no code for an assert statement?", "optimization is requested"),
    ("del", "What happens when you delete a name that is unbound?", '"NameError" exception will be raised'),
    ("while", "When is the else clause of a while loop not executed?", "terminates the loop without executing"),
    ("with", "What happens when __exit__() returns a true value after an exception?", "the exception is suppressed"),
    ("global", "Where must the names listed in a global statement not be used?", "textually preceding"),
    ("return", "What does a return statement do in a generator function?", '"StopIteration" to be raised'),
    ("truth", "Which constants are defined to be false?", 'constants defined to be false: "None" and "False"'),
    ("for", "Are the names in a for loop's target list deleted when the loop finishes?", "are not deleted"),
    ("break", "What value does the loop variable have after a for loop ends with break?", "keeps its current value"),
    ("nonlocal", "How do names in a nonlocal statement differ from names in a global one?", "pre-existing bindings"),
    ("booleans", "What does the expression x or y return?", "if *x* is true, its value is returned"),
    ("lambda", "What can a function created by a lambda expression not contain?", "statements or annotations"),
    ("yield", "What turns a function definition into a generator function?", "Using yield in a function definition"),
)
QA_FORMATS = (
    "Read the passage and answer the question.\n\nPassage:\n{passage}\n\nQuestion: {question}",
    "{passage}\n\nUsing only the text above, answer: {question}",
    "Question: {question}\n\nAnswer from this excerpt of the Python language reference, and quote the sentence "
    "that supports your answer:\n\n{passage}",
)


def _flat(s: str) -> str:
    return " ".join(s.split())


def qa(rng: random.Random, n: int) -> list[list[Message]]:
    out = []
    for name, question, evidence in rng.sample(QUESTIONS, n):
        text = passage(name)
        if _flat(evidence) not in _flat(text):
            raise LookupError(f"qa: the passage of topic {name!r} no longer holds {evidence!r}")
        content = rng.choice(QA_FORMATS).format(passage=text, question=question)
        msgs: list[Message] = [{"role": "user", "content": content}]
        if rng.random() < 0.25:
            msgs.insert(0, {"role": "system", "content": "Answer briefly and only from the given text."})
        out.append(msgs)
    return out


# ---------------------------------------------------------------------------------------------- json


def _signature_record(module: str, name: str) -> tuple[str, str]:
    fn = getattr(importlib.import_module(module), name)
    doc = inspect.cleandoc(fn.__doc__ or "").split("\n\n")[0]
    record = f"module: {module}\nfunction: {name}\nsignature: {name}{inspect.signature(fn)}\ndescription: {doc}"
    fields = (
        '{"module": string, "function": string, "required_parameters": [string], '
        '"optional_parameters": [string], "summary": string}'
    )
    return record, fields


def _statement_record(name: str) -> tuple[str, str]:
    fields = (
        '{"statement": string, "grammar_rule": string, "exceptions_mentioned": [string], '
        '"other_statements_mentioned": [string]}'
    )
    return passage(name, 1800), fields


def _keywords_record(rng: random.Random) -> tuple[str, str]:
    import pydoc

    kws = [k for k, v in pydoc.Helper.keywords.items() if isinstance(v, tuple)]
    picked = sorted(rng.sample(kws, 10))
    lines = [f"{k} -> topic {v[0]!r}; related: {v[1] or 'none'}" for k in picked for v in [pydoc.Helper.keywords[k]]]
    return "\n".join(lines), '[{"keyword": string, "topic": string, "related": [string]}]'


def _module_record(module: str) -> tuple[str, str]:
    mod = importlib.import_module(module)
    public = sorted(n for n in getattr(mod, "__all__", dir(mod)) if not n.startswith("_"))
    funcs = [n for n in public if inspect.isfunction(getattr(mod, n, None)) or inspect.isbuiltin(getattr(mod, n, None))]
    classes = [n for n in public if inspect.isclass(getattr(mod, n, None))]
    first = inspect.cleandoc(mod.__doc__ or "").split("\n\n")[0].replace("\n", " ")
    record = f"Module {module}\n  about: {first}\n  functions: {', '.join(funcs)}\n  classes: {', '.join(classes)}"
    return record, '{"module": string, "about": string, "function_count": number, "classes": [string]}'


JSON_SOURCES: tuple[tuple[str, Callable[[random.Random], tuple[str, str]]], ...] = (
    ("the function record", lambda r: _signature_record("textwrap", "shorten")),
    ("the function record", lambda r: _signature_record("json", "dumps")),
    ("the function record", lambda r: _signature_record("shlex", "split")),
    ("the function record", lambda r: _signature_record("heapq", "nlargest")),
    ("the passage", lambda r: _statement_record("raise")),
    ("the passage", lambda r: _statement_record("return")),
    ("the passage", lambda r: _statement_record("del")),
    ("the keyword table", _keywords_record),
    ("the module record", lambda r: _module_record("textwrap")),
    ("the module record", lambda r: _module_record("bisect")),
)
JSON_ASKS = (
    "Extract the following fields from {what} below and output them as JSON matching this shape:\n{fields}\n"
    "Output only the JSON.\n\n{text}",
    "{text}\n\nFrom the {what_bare} above, output a JSON value with exactly these fields: {fields}. "
    "No explanation, just JSON.",
    "Convert {what} into JSON.\nSchema: {fields}\nUse null for anything the text does not say.\n\n---\n{text}\n---",
)


def json_extraction(rng: random.Random, n: int) -> list[list[Message]]:
    out = []
    for what, make in rng.sample(JSON_SOURCES, n):
        text, fields = make(rng)
        ask = rng.choice(JSON_ASKS).format(what=what, what_bare=what.split(" ", 1)[1], fields=fields, text=text)
        msgs: list[Message] = [{"role": "user", "content": ask}]
        if rng.random() < 0.5:
            msgs.insert(0, {"role": "system", "content": "You are a data extraction service. Reply with valid JSON."})
        out.append(msgs)
    return out


BUILDERS: dict[str, Callable[[random.Random, int], list[list[Message]]]] = {
    "chat": chat,
    "code-edit": code_edit,
    "qa": qa,
    "json": json_extraction,
}


def build(seed: int = 0, per_category: int = 8) -> list[dict[str, Any]]:
    """The workload's records in category order, ``per_category`` each (a seeded choice and phrasing)."""
    records = []
    for cat in CATEGORIES:
        rng = random.Random(f"{seed}:{cat}")  # each category its own stream: one category's pool never moves another
        records += [{"category": cat, "messages": m} for m in BUILDERS[cat](rng, per_category)]
    return records


def to_jsonl(records: list[dict[str, Any]]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"the JSONL file to write (default {DEFAULT_OUT})")
    p.add_argument("--seed", type=int, default=0)
    pool = min(len(CHAT_SOURCES), len(FUNCTIONS), len(QUESTIONS), len(JSON_SOURCES))
    p.add_argument("--per-category", type=int, default=8, help=f"prompts per category, 1 to {pool} (default 8)")
    a = p.parse_args(argv)
    if not 1 <= a.per_category <= pool:
        p.error(f"--per-category={a.per_category} is invalid: allowed 1 to {pool}")
    return a


def _write(a: argparse.Namespace) -> int:
    from engine.core.files import write_bytes_atomic

    records = build(a.seed, a.per_category)
    data = to_jsonl(records).encode("utf-8")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(a.out, data)
    print(f"wrote {a.out}: {len(records)} prompts ({', '.join(CATEGORIES)}), {len(data) / 1024:.0f} KiB")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_tool("make_workload", lambda: _write(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
