"""Structured outputs through the official openai client against a live server on 127.0.0.1: SmolLM2-135M-Instruct
answers a JSON schema of nested objects, arrays and enums with JSON that validates, streamed and whole; the other
fields (structured_outputs, guided_*) and every refusal (a 400 naming the field) on the test checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from test_openai_server import Live, _chat_checkpoint  # noqa: E402

from engine import Engine  # noqa: E402
from engine.api.options import Limits, SpeculationConfig  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "structured"
PRODUCT = json.loads((EXAMPLES / "product.schema.json").read_text(encoding="utf-8"))  # the bench's schema
ASKS = (EXAMPLES / "product_asks.txt").read_text(encoding="utf-8").splitlines()[:6]  # and its first asks
FORMAT = {"type": "json_schema", "json_schema": {"name": "product", "schema": PRODUCT, "strict": True}}


@pytest.fixture(scope="module")
def smol_live(smollm_dir):
    spec = SpeculationConfig(drafter="ngram", k=4, k_policy="constant")
    srv = Live(Engine.from_pretrained(smollm_dir, speculation=spec, limits=Limits(max_batch=4)))
    yield srv
    srv.close()


@pytest.mark.parametrize("stream", [False, True])
def test_smollm_json_schema_output_always_validates(smol_live, stream):
    for ask in ASKS:
        kw = dict(model="m", messages=[{"role": "user", "content": ask}], max_tokens=220, temperature=0)
        if stream:
            chunks = list(smol_live.client.chat.completions.create(stream=True, response_format=FORMAT, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        else:
            r = smol_live.client.chat.completions.create(response_format=FORMAT, **kw)
            text, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert finish == "stop", (ask, text)
        jsonschema.validate(json.loads(text), PRODUCT)


@pytest.fixture(scope="module")
def chat_ckpt(ckpt_dir, tmp_path_factory):
    return _chat_checkpoint(ckpt_dir, tmp_path_factory.mktemp("chat") / "ckpt")


@pytest.fixture(scope="module")
def tiny_live(chat_ckpt, draft_dir):
    spec = SpeculationConfig(k=3, k_policy="constant")
    srv = Live(Engine.from_pretrained(chat_ckpt, draft_dir, speculation=spec, limits=Limits(max_batch=4)))
    yield srv
    srv.close()


MSG = [{"role": "user", "content": "The quick brown fox"}]


def test_every_field_constrains_both_endpoints(tiny_live):
    c = tiny_live.client
    choices = ["yes it is", "no", "maybe later"]
    chat = c.chat.completions.create(
        model="m", messages=MSG, max_tokens=30, temperature=0, extra_body={"structured_outputs": {"choice": choices}}
    )
    assert chat.choices[0].message.content in choices and chat.choices[0].finish_reason == "stop"
    done = c.completions.create(
        model="m", prompt="The quick", max_tokens=30, temperature=0.8, seed=3, extra_body={"guided_choice": choices}
    )
    assert done.choices[0].text in choices
    rx = c.completions.create(
        model="m", prompt="The", max_tokens=30, temperature=0, extra_body={"guided_regex": "[a-c]{3} [x-z]{2}"}
    )
    assert rx.choices[0].text[:3].strip("abc") == "" and rx.choices[0].finish_reason == "stop"
    obj = c.chat.completions.create(
        model="m", messages=MSG, max_tokens=20, temperature=0, response_format={"type": "json_object"}
    )
    assert obj.choices[0].message.content.startswith("{")
    long = {
        "type": "object",
        "properties": {"a_rather_long_key_name": {"type": "string"}},
        "required": ["a_rather_long_key_name"],
    }
    cut = c.chat.completions.create(
        model="m", messages=MSG, max_tokens=3, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "cut", "schema": long}},
    )  # fmt: skip
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 3  # cut mid-structure


@pytest.mark.parametrize(
    "body,field",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "(["}, "guided_regex"),
        ({"guided_json": {"type": "object", "not": {}}}, "guided_json"),
        ({"guided_grammar": "start: foo"}, "guided_grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"yaml": "a"}}, "structured_outputs"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex"),
    ],
)  # fmt: skip
def test_bad_structured_fields_are_400_naming_the_field(tiny_live, body, field):
    with pytest.raises(openai.BadRequestError) as e:
        tiny_live.client.chat.completions.create(model="m", messages=MSG, max_tokens=5, extra_body=body)
    assert e.value.body["param"] == field, e.value.body
    ok = tiny_live.client.chat.completions.create(model="m", messages=MSG, max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("length", "stop")  # the server keeps serving


def test_bench_structured_tool(chat_ckpt, tmp_path, capsys):
    from engine.cli.bench_structured import main

    asks = tmp_path / "asks.txt"
    asks.write_text("one\ntwo\nthree\n", encoding="utf-8")
    schema = tmp_path / "s.json"
    obj = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "yy"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    schema.write_text(json.dumps(obj))
    out = tmp_path / "rows.json"
    argv = ["--target", str(chat_ckpt), "--asks", str(asks), "--schema", str(schema), "--batch", "1,3"]
    assert main(argv + ["--repeats", "1", "--max-tokens", "24", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["mode"]) for r in rows] == [(1, "plain"), (1, "ngram"), (3, "plain"), (3, "ngram")]
    assert all(r["valid"] == 1.0 and r["forced_share"] > 0 for r in rows if r["mode"] == "ngram")
    assert "x plain" in capsys.readouterr().out
    schema.write_text("{not json")
    assert main(argv) == 2 and "bench_structured: --schema" in capsys.readouterr().err
