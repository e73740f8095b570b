"""tools/bench_int8.py's llama.cpp peer (engine/cli/gguf_peer.py): the same prompt ids as the engine's modes, and
one-line refusals of bad arguments."""

from __future__ import annotations

import importlib.util

import pytest

from engine import Engine
from engine.cli import bench_int8
from engine.cli.gguf_peer import PeerUnavailableError, peer_child, prompt_ids

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def chat_ckpt(tmp_path_factory):
    from util import make_checkpoint

    d = make_checkpoint(tmp_path_factory.mktemp("chat") / "ckpt", "llama")
    (d / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    return d


def test_the_peer_gets_the_prompt_ids_the_engine_renders(chat_ckpt, ckpt_dir):
    chat = Engine.from_pretrained(chat_ckpt)
    want = [chat.chat_prompt([{"role": "user", "content": p}]) for p in bench_int8.PROMPTS]
    assert prompt_ids(chat_ckpt, bench_int8.PROMPTS) == want
    plain = Engine.from_pretrained(ckpt_dir)  # no chat template: the text itself, as the engine's modes
    assert prompt_ids(ckpt_dir, bench_int8.PROMPTS) == [plain.tokenizer.encode(p) for p in bench_int8.PROMPTS]


def test_bad_arguments_print_one_line_and_exit_2(tmp_path, capsys):
    profile = str(tmp_path / "p.json")
    for argv, says in (
        (["--gguf", str(tmp_path / "missing.gguf")], "--gguf"),
        (["--modes", "fp32-plain,bf16"], "--modes 'bf16' is invalid"),
    ):
        assert bench_int8.main(["--profile", profile, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and says in err[0]


@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is not None, reason="llama-cpp-python is installed")
def test_the_peer_without_llama_cpp_says_what_to_install(ckpt_dir, tmp_path):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"GGUF")
    with pytest.raises(PeerUnavailableError, match="pip install llama-cpp-python"):
        peer_child(ckpt_dir, f, bench_int8.PROMPTS, 4)
