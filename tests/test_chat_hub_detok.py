"""Chat templates from tokenizer_config.json, Hub ids from a local huggingface_hub cache, and incremental
detokenization of multi-byte UTF-8 split across tokens."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import Engine, SamplingParams
from engine.core.chat import ChatTemplate
from engine.core.errors import CheckpointError, InvalidRequestError
from engine.core.hub import resolve_model
from engine.core.tokenizer import Tokenizer


def test_template_from_tokenizer_config_list_and_sandbox(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<s>"},
                "chat_template": [
                    {"name": "tool_use", "template": "x"},
                    {
                        "name": "default",
                        "template": "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
                    },
                ],
            }
        )
    )
    t = ChatTemplate.from_dir(tmp_path)
    assert t.render([{"role": "user", "content": [{"type": "text", "text": "héllo"}]}]) == "<s>[user]héllo"
    with pytest.raises(InvalidRequestError, match="role"):
        t.render([{"role": "wizard", "content": "x"}])
    evil = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(Exception, match="unsafe|not safely|access"):  # jinja2's SecurityError
        evil.render([{"role": "user", "content": "x"}])
    boom = ChatTemplate("{{ raise_exception('no system role') }}")
    with pytest.raises(InvalidRequestError, match="no system role"):
        boom.render([{"role": "user", "content": "x"}])
    assert ChatTemplate.from_dir(tmp_path / "nothing") is None


def _fake_hub_cache(root, repo: str, src) -> None:
    """The huggingface_hub cache layout: models--owner--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    d = root / f"models--{repo.replace('/', '--')}"
    (d / "refs").mkdir(parents=True)
    (d / "refs" / "main").write_text(commit)
    shutil.copytree(src, d / "snapshots" / commit)


def test_hub_id_from_a_local_cache_offline(ckpt_dir, tmp_path):
    _fake_hub_cache(tmp_path, "acme/tiny-llama", ckpt_dir)
    path = resolve_model("acme/tiny-llama", cache_dir=tmp_path, offline=True)
    assert (path / "config.json").is_file()
    e = Engine.from_pretrained(path)
    ref = Engine.from_pretrained(ckpt_dir)
    sp = SamplingParams(max_new_tokens=5)
    assert e.generate([[1, 2, 3]], sp)[0].token_ids == ref.generate([[1, 2, 3]], sp)[0].token_ids
    with pytest.raises(CheckpointError, match="acme/missing.*offline"):
        resolve_model("acme/missing", cache_dir=tmp_path, offline=True)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        resolve_model(str(tmp_path / "not-there"))


def test_streaming_decoder_handles_multibyte_utf8(ckpt_dir):
    tok = Tokenizer(ckpt_dir)
    text = "naïve café — 東京 😀 ok"
    ids = tok.encode(text)
    assert len(ids) > len(text)  # byte-level: the multi-byte characters span several tokens
    stream, pieces = tok.decode_stream(), []
    for t in ids:
        piece = tok.step(stream, t)
        if piece is not None:
            assert "\ufffd" not in piece  # never half a character
            pieces.append(piece)
    assert "".join(pieces) == text == tok.decode(ids)


def test_weight_hash_record_spares_rereading_unchanged_files(tmp_path, monkeypatch):
    import os

    from engine.core import files

    f = tmp_path / "model.safetensors"
    f.write_bytes(b"a" * 4096)
    truth = files.sha256_file(f)
    reads = []
    real = files.sha256_file
    monkeypatch.setattr(files, "sha256_file", lambda p: reads.append(p) or real(p))
    assert files.verified_sha256(f) == truth and len(reads) == 1 and (tmp_path / files.HASH_RECORD).is_file()
    assert files.verified_sha256(f) == truth and len(reads) == 1  # unchanged: the record answers
    st = f.stat()
    with open(f, "r+b") as fh:  # same size, same inode, new bytes
        fh.write(b"b")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # (a coarse clock may not move the mtime)
    assert files.verified_sha256(f) != truth and len(reads) == 2  # the mtime moved: hashed again
    changed, stamp = files.sha256_file(f), f.stat().st_mtime_ns
    with open(f, "r+b") as fh:
        fh.write(b"c")
    os.utime(f, ns=(st.st_atime_ns, stamp))  # a forged mtime: the record still answers (documented) ...
    assert files.verified_sha256(f) == changed
    assert files.verified_sha256(f, full=True) == files.sha256_file(f) != changed  # ... a full check does not
