"""The benchmark workload (tools/make_workload.py, examples/workload/workload.jsonl) and tools/bench.py --workload:
the generator is deterministic and gives four categories of valid chat messages, the committed file is what it
builds, a bad line is refused naming its number and field, and a tiny run reports every mode per category."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli.bench_workload import load_workload
from engine.cli.make_workload import BUILT_WITH, CATEGORIES, build, to_jsonl
from engine.core.errors import InvalidConfigError

REPO = Path(__file__).resolve().parent.parent
COMMITTED = REPO / "examples" / "workload" / "workload.jsonl"
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


def test_the_generator_is_deterministic_with_four_categories_of_chat_messages():
    records = build(seed=0)
    assert to_jsonl(records) == to_jsonl(build(seed=0))
    assert to_jsonl(build(seed=1)) != to_jsonl(records)
    by_cat = {c: [r for r in records if r["category"] == c] for c in CATEGORIES}
    assert [r["category"] for r in records] == [c for c in CATEGORIES for _ in by_cat[c]]
    assert all(len(rs) == 8 for rs in by_cat.values())
    for r in records:
        msgs = r["messages"]
        assert set(r) == {"category", "messages"} and msgs[-1]["role"] == "user"
        assert all(set(m) == {"role", "content"} and m["content"].strip() for m in msgs)
    assert all(len(r["messages"]) >= 3 for r in by_cat["chat"])  # multi-turn: a follow-up after an answer
    assert all("```python\ndef " in r["messages"][-1]["content"] or len(r["messages"]) > 1 for r in by_cat["code-edit"])
    assert all("JSON" in r["messages"][-1]["content"] for r in by_cat["json"])


def test_the_committed_workload_is_the_generators_output(tmp_path):
    items = load_workload(COMMITTED)
    assert [it.category for it in items] == [c for c in CATEGORIES for _ in range(8)]
    assert COMMITTED.stat().st_size < 200 * 1024
    if platform.python_version() != BUILT_WITH:
        pytest.skip(f"the stdlib text differs by version: the file was built with Python {BUILT_WITH}")
    assert COMMITTED.read_text(encoding="utf-8") == to_jsonl(build(seed=0))
    out = tmp_path / "w.jsonl"  # the tool writes the same bytes
    from engine.cli.make_workload import main

    assert main(["--out", str(out)]) == 0
    assert out.read_bytes() == COMMITTED.read_bytes()


GOOD = {"category": "qa", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    ("bad", "names"),
    [
        ("{not json", "is not JSON"),
        ({**GOOD, "category": ""}, "category"),
        ({**GOOD, "extra": 1}, "unknown field 'extra'"),
        ({"category": "qa", "messages": []}, "messages"),
        ({"category": "qa", "messages": [{"role": "bot", "content": "x"}]}, "messages[0].role='bot'"),
        ({"category": "qa", "messages": [{"role": "user", "content": 3}]}, "messages[0].content=3"),
        (
            {"category": "qa", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
            "messages[1].role='assistant'",
        ),
    ],
)
def test_a_bad_line_is_refused_naming_the_line_and_field(tmp_path, bad, names):
    f = tmp_path / "w.jsonl"
    bad_line = bad if isinstance(bad, str) else json.dumps(bad)
    f.write_text(json.dumps(GOOD) + "\n\n" + bad_line + "\n", encoding="utf-8")
    with pytest.raises(InvalidConfigError, match="line 3") as e:
        load_workload(f)
    assert names in str(e.value)


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    from util import make_checkpoint

    d = make_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", "llama")
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


def test_the_tool_refuses_a_bad_workload_and_a_target_without_a_template(ckpt_dir, chat_ckpt, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(GOOD) + "\n" + json.dumps({**GOOD, "messages": "hi"}) + "\n", encoding="utf-8")
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps(GOOD) + "\n", encoding="utf-8")
    for target, workload, says in ((chat_ckpt, bad, "line 2: messages="), (ckpt_dir, good, str(ckpt_dir))):
        r = subprocess.run(
            [sys.executable, str(REPO / "tools" / "bench.py"), "--target", str(target), "--workload", str(workload)],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
        )
        assert r.returncode == 2 and says in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_bench_workload_reports_every_mode_per_category(chat_ckpt, tmp_path, capsys):
    from engine.cli.bench import main

    f = tmp_path / "w.jsonl"
    lines = []
    for cat, text in (("chat", "the quick brown fox"), ("code-edit", "def f(x):\n    return x * 2"), ("qa", "why?")):
        msgs = [{"role": "user", "content": text}, {"role": "assistant", "content": text}]
        lines += [{"category": cat, "messages": [*msgs, {"role": "user", "content": f"again: {text}"}]}] * 2
    f.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    argv = ["--target", str(chat_ckpt), "--workload", str(f), "--repeats", "1", "--max-new-tokens", "4"]
    argv += ["--no-hf", "--modes", "plain,specmix-ngram", "--threads", "1", "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert [m["name"] for m in result["modes"]] == ["plain", "specmix-ngram"]
    assert result["settings"]["workload"]["categories"] == {"chat": 2, "code-edit": 2, "qa": 2}
    cats = result["categories"]
    assert list(cats) == ["chat", "code-edit", "qa"]
    for cat in cats.values():
        assert cat["prompts"] == 2 and [m["name"] for m in cat["modes"]] == ["plain", "specmix-ngram"]
        plain, ngram = cat["modes"]
        assert plain["speedup_vs_plain"] == 1.0 and plain["mean_accepted_length"] is None
        assert ngram["tokens_per_s"] > 0 and len(ngram["repeats"]) == 1
        assert ngram["mean_accepted_length"] is None or ngram["mean_accepted_length"] >= 1
    assert result["modes"][1]["match_vs_plain"]["identical"] == 1.0  # the categories' outputs, joined in order
    assert "code-edit (2)" in printed and "accept by position" in printed
