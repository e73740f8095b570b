"""Structured outputs under speculation: refusals name the problem; greedy constrained output is token-identical to
plain constrained decoding with every drafter; the sampled joint equals the masked target's exact joint
(chi-square); forced tokens are drafted without a drafter and accepted."""

from __future__ import annotations

import itertools
import json
import re

import numpy as np
import pytest
import torch
from test_heads import random_head
from test_sampling_controls import pooled_pvalue
from test_suffix import HAVE_ARCTIC
from test_trees import FixedTree

from engine import Engine, SamplingParams
from engine.api.options import Limits, SpeculationConfig
from engine.core.errors import InvalidRequestError
from engine.spec_decode.registry import DRAFTERS, DrafterEntry
from engine.spec_decode.structured.grammar import unpack
from engine.spec_decode.structured.spec import StructuredOutput

pytest.importorskip("llguidance")

ALPHA = 1e-4
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]},
    },
    "required": ["name", "kind", "tags", "home"],
    "additionalProperties": False,
}
REGEX = r"[a-e]{2,6}( [a-e]{1,4}){1,3}\."
CHOICES = ["alpha beta", "gamma", "delta epsilon zeta"]


@pytest.mark.parametrize(
    "make,field",
    [
        (lambda: StructuredOutput("yaml", "x"), "kind"),
        (lambda: StructuredOutput.json("{not json"), "json"),
        (lambda: StructuredOutput.json([1, 2]), "json"),
        (lambda: StructuredOutput.choice([]), "choice"),
        (lambda: StructuredOutput.choice(["a", ""]), "choice"),
        (lambda: StructuredOutput.choice("ab"), "choice"),
        (lambda: StructuredOutput.regex(""), "regex"),
        (lambda: StructuredOutput.regex("a\ud800"), "regex"),
        (lambda: StructuredOutput.grammar("x" * 70_000), "grammar"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(make, field):
    with pytest.raises(InvalidRequestError, match=rf"SamplingParams\.structured\.{field}"):
        make()


@pytest.mark.parametrize(
    "so,why",
    [
        (StructuredOutput.json({"type": "strin"}), "strin"),
        (StructuredOutput.json({"type": "object", "not": {}}), "not"),  # an unsupported keyword
        (StructuredOutput.json({"type": "string", "format": "zzz"}), "zzz"),
        (StructuredOutput.regex("(["), "regex"),
        (StructuredOutput.grammar("start: foo"), "foo"),
        (StructuredOutput.regex("[^\\x00-\\U0010FFFF]"), "accepts no text"),  # a grammar of no string
    ],
)
def test_engine_refuses_constraints_that_do_not_compile(ckpt_dir, so, why):
    eng = Engine.from_pretrained(ckpt_dir)
    with pytest.raises(InvalidRequestError, match=re.escape(why)):
        eng.submit([5, 6, 7], SamplingParams(max_new_tokens=4, structured=so))
    assert eng.generate([[5, 6]], SamplingParams(max_new_tokens=3))[0].token_ids  # it keeps serving


def _requests() -> list[tuple[list[int], SamplingParams]]:
    """Constrained rows of every kind beside an unconstrained one, greedy."""
    sos = [
        StructuredOutput.json(SCHEMA),
        StructuredOutput.regex(REGEX),
        StructuredOutput.choice(CHOICES),
        StructuredOutput.json_object(),
        None,
    ]
    prompts = [[5, 6, 7], [9, 9, 9, 9], [100, 20, 30, 40, 50], [7, 8], [11, 12, 13]]
    return [(p, SamplingParams(max_new_tokens=64, structured=so)) for p, so in zip(prompts, sos)]


def _check_structure(out, so: StructuredOutput | None) -> None:
    if so is None or out.finish_reason != "stop":
        return
    if so.kind == "json":
        import jsonschema

        jsonschema.validate(json.loads(out.text), SCHEMA)
    elif so.kind == "json_object":
        assert isinstance(json.loads(out.text), dict)
    elif so.kind == "regex":
        assert re.fullmatch(REGEX, out.text), out.text
    else:
        assert out.text in CHOICES


@pytest.fixture(scope="module")
def constrained_plain(ckpt_dir):
    eng = Engine.from_pretrained(ckpt_dir)
    reqs = _requests()
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    for o, (_, sp) in zip(outs, reqs):
        _check_structure(o, sp.structured)
    assert sum(o.finish_reason == "stop" for o in outs[:4]) >= 2  # grammars completed (a random model loops in JSON)
    free = eng.generate([p for p, _ in reqs], SamplingParams(max_new_tokens=64))
    assert [o.token_ids for o in outs[:4]] != [o.token_ids for o in free[:4]]  # the masks changed the output
    return [o.token_ids for o in outs]


CASES = {
    "model": dict(drafter="model"),
    "ngram": dict(drafter="ngram"),
    "ngram-tree": dict(drafter="ngram", tree_branches=3),
    "early-exit": dict(drafter="early-exit"),
    "medusa": dict(drafter="medusa"),
    "eagle": dict(drafter="eagle"),
    "eagle-tree": dict(drafter="eagle", tree_branches=3),
    "model+lookup": dict(drafter="model", prompt_lookup_min=1),
    "model-tree": dict(drafter="model", tree_branches=2),
    "medusa-tree": dict(drafter="medusa", tree_branches=3),
    "suffix-tree": dict(drafter="suffix", tree_branches=3),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_constrained_speculation_is_token_identical(ckpt_dir, draft_dir, constrained_plain, name, tmp_path):
    kw = CASES[name]
    if kw["drafter"] == "suffix" and not HAVE_ARCTIC:
        pytest.skip("needs the suffix extra: pip install 'specmix[suffix]'")
    draft = {"model": draft_dir, "medusa": None, "eagle": None}.get(kw["drafter"])
    if kw["drafter"] in ("medusa", "eagle"):
        draft = random_head(ckpt_dir, tmp_path / "head", kw["drafter"])
    spec = SpeculationConfig(k=4, k_policy="constant", **kw)
    eng = Engine.from_pretrained(ckpt_dir, draft, speculation=spec)
    reqs = _requests()
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert [o.token_ids for o in outs] == constrained_plain
    st = eng.stats()
    assert st["drafted"] > 0
    structured = st["structured"]
    assert structured["forced_drafts"] > 0 and structured["forced_accepted"] > 0  # JSON keys and punctuation
    assert structured["requests"] == 4


def test_forced_tokens_are_drafted_without_a_drafter_and_accepted(ckpt_dir):
    """A schema of one fixed string: every round's drafts are the grammar's, always accepted."""
    so = StructuredOutput.json({"const": {"answer": "abcdefghij klmnopqrst"}})
    eng = Engine.from_pretrained(ckpt_dir, speculation=SpeculationConfig(drafter="ngram", k=6, k_policy="constant"))
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=64, structured=so))[0]
    assert json.loads(out.text) == {"answer": "abcdefghij klmnopqrst"} and out.finish_reason == "stop"
    st = out.stats
    assert st["forced_drafts"] > 0 and st["forced_accepted"] == st["forced_drafts"] == st["accepted"]
    assert st["target_passes"] < len(out.token_ids)


# ---------------------------------------------------------------- sampled: the masked target's exact joint
def _branching(prefix: tuple[int, ...]) -> list[int]:
    """The oracle of REGEXES["branching"] over the 8-token vocabulary (1..7 are the bytes ! " # $ % & ')."""
    if not prefix:
        return [1, 2, 3]
    if len(prefix) == 1:
        return [6, 7] if prefix[0] == 1 else [3, 4, 5]
    return list(range(1, 8))


def _forced(prefix: tuple[int, ...]) -> list[int]:
    """The oracle of REGEXES["forced"]: the second token is forced (a free draft), the third drawn."""
    return [[1, 2], [3], [4, 5, 6]][len(prefix)]


REGEXES = {"branching": ("(![&']|[\"#][#$%])[!-']+", _branching), "forced": ('[!"]#[$%&]+', _forced)}


def _masked_joint(eng: Engine, prompt: list[int], temperature: float, allowed=None) -> np.ndarray:
    V, q = eng.vocab, {}
    with torch.no_grad():
        for n in range(3):
            prefixes = list(itertools.product(range(V), repeat=n))
            logits = eng.logits([prompt + list(p) for p in prefixes])[:, -1].double()
            for p, row in zip(prefixes, logits):
                if allowed is not None:
                    keep = torch.full_like(row, float("-inf"))
                    keep[allowed(p)] = 0.0
                    row = row + keep
                q[p] = (row / temperature).softmax(-1).numpy()
    joint = np.zeros((V, V, V))
    for a, b in itertools.product(range(V), repeat=2):
        joint[a, b] = q[()][a] * q[(a,)][b] * q[(a, b)]
    return joint.ravel()


@pytest.mark.parametrize(
    "drafter,regex", [("model", "branching"), ("ngram", "branching"), ("fixed-tree", "branching"), ("model", "forced")]
)
def test_sampled_constrained_joint_equals_the_masked_target(pair8, drafter, regex):
    """fixed-tree: 7-node trees of distinct tokens, pruned per branch by the grammar; forced: a forced token in
    the middle drafted by the grammar, then a drawn one."""
    pattern, allowed = REGEXES[regex]
    reg = DRAFTERS.extended(DrafterEntry("fixed-tree", "a test tree", lambda ctx: FixedTree(8, False)))
    k = 7 if drafter == "fixed-tree" else 4
    spec = SpeculationConfig(drafter=drafter, k=k, k_policy="constant", registry=reg)
    models = pair8 if drafter == "model" else pair8[:1]
    eng = Engine.from_pretrained(*models, speculation=spec, limits=Limits(max_batch=1000))
    prompt, V = [1, 2, 3], eng.vocab
    sp = SamplingParams(max_new_tokens=3, temperature=1.0, structured=StructuredOutput.regex(pattern))
    exact = _masked_joint(eng, prompt, 1.0, allowed)
    counts = np.zeros(V**3)
    for _ in range(6):
        for o in eng.generate([prompt] * 2000, sp):
            t = o.token_ids
            counts[(t[0] * V + t[1]) * V + t[2]] += 1
    assert counts[exact == 0].sum() == 0, "a sequence the grammar forbids was produced"
    st = eng.stats()
    assert st["drafted"] > 0 and (regex != "forced" or st["structured"]["forced_accepted"] > 0)
    assert pooled_pvalue(counts, exact) > ALPHA
    assert pooled_pvalue(counts, _masked_joint(eng, prompt, 1.0)) < ALPHA  # power: the unmasked joint


def test_bitmask_unpacks_token_by_token():
    """Bit i of word w is token 32 w + i (llguidance's layout), cut to the vocabulary."""
    g = torch.Generator().manual_seed(0)
    bm = torch.randint(-(2**31), 2**31 - 1, (2, 3, 4), dtype=torch.int32, generator=g)
    got = unpack(bm, 100)
    for idx in itertools.product(range(2), range(3)):
        want = [bool((int(bm[idx][t // 32]) >> (t % 32)) & 1) for t in range(100)]
        assert got[idx].tolist() == want
