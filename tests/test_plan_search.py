"""Per-layer plans (ModelPlan.modules) and the planner's search on calibration text."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from engine.core.config import ModelConfig
from engine.core.errors import InvalidConfigError, ProfileError
from engine.core.model import Transformer
from quant.apply import apply_plan, model_weight_bytes, store_narrow
from quant.calibration import ALPHA_GRID, calib_kld, collect_calibration, module_errors
from quant.candidates import CHOICES, ordered_choices, paper_cost, read_rate
from quant.catalog import lookup_gpu
from quant.linear import Int8Linear
from quant.memory import weight_bytes
from quant.plan import make_plan, w8a16_family
from quant.plan_io import load_plan, plan_from_dict
from quant.plan_schema import FamilyPlan
from quant.search import search_ffn, search_plan_at


def tiny(seed: int, outliers: bool = False, layers: int = 3) -> tuple[ModelConfig, Transformer]:
    c = ModelConfig.from_hf_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        }
    )
    torch.manual_seed(seed)
    m = Transformer(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.1)
        m.lm_head.weight.mul_(4.0)  # peaked next-token distributions, as trained models have
        if outliers:
            # real LLMs' massive activations: down_proj input channels up to ~1000x the others on some
            # tokens and ~0 on others (their gate and up rows scaled), whose output contribution is
            # ordinary (the matching down_proj columns scaled down): no static smoothing fits them
            m.layers[1].mlp.gate_proj.weight[[7, 40]] *= 40.0
            m.layers[1].mlp.up_proj.weight[[7, 40]] *= 40.0
            m.layers[1].mlp.down_proj.weight[:, [7, 40]] /= 300.0
    return c, m


def windows(seed: int, n: int = 3, t: int = 48) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 96, (1, t), generator=g) for _ in range(n)]


def test_candidates_follow_the_catalog():
    a100, v100 = lookup_gpu("a100"), lookup_gpu("v100")
    # a 64-row verify pass on paper: W8A16 reads fewer bytes at a better rate than W8A8's quantize + _int_mm
    order = [c.label for c in ordered_choices(a100, 1536, 576)]
    assert order == ["w8a16", "w8a16/g128", "w8a16/g64", "w8a16/g32", "w8a8", "fp16"]
    assert "w8a8" not in [c.label for c in ordered_choices(v100, 1536, 576)]  # no INT8 tensor cores
    # on paper: an fp16 Linear moves twice the bytes of an int8 one when bandwidth-bound (1 row), which the
    # int8 GEMV reads at the rate measured on an H200
    fp16, w8 = (paper_cost(a100, 4096, 4096, c, rows=1) for c in (CHOICES[-1], CHOICES[1]))
    assert fp16 / w8 == pytest.approx(2 * read_rate(CHOICES[1], 1), rel=0.01)
    # compute-bound (many rows): w8a8 runs on the INT8 tensor cores, 2x the fp16 math
    big = {c.label: paper_cost(a100, 4096, 4096, c, rows=8192) for c in CHOICES}
    assert big["w8a8"] < big["w8a16"] <= big["fp16"]


def test_per_layer_plan_applies_round_trips_and_counts_bytes(tmp_path):
    tc, target = tiny(0)
    plan = make_plan(lookup_gpu("a100"), tc, None, device="cpu", int8_kernel="w8a16", group_size=32)
    plan.target.modules["layers.1.mlp.down_proj"] = FamilyPlan("fp32", "dense", {}, "kept: damage")
    plan.target.modules["layers.2.mlp.up_proj"] = w8a16_family(None, "per channel is enough here")
    p = tmp_path / "plan.json"
    plan.save(p)
    back = load_plan(p)
    assert back.to_dict() == plan.to_dict() and back.target.modules["layers.1.mlp.down_proj"].reason == "kept: damage"
    apply_plan(target, back.target)
    assert type(target.layers[1].mlp.down_proj) is torch.nn.Linear
    assert target.layers[2].mlp.up_proj.group_size is None and target.layers[2].mlp.up_proj.kernel == "w8a16"
    assert target.layers[0].mlp.down_proj.group_size == 32
    assert model_weight_bytes(target) == weight_bytes(tc, back.target)


def test_per_layer_plan_refuses_bad_modules():
    tc, _ = tiny(1)
    d = json.loads(make_plan(lookup_gpu("a100"), tc, None, device="cpu").to_json())
    for name, match in (
        ("layers.9.mlp.up_proj", "not a module of the model"),
        ("layers.0.mlp.wo", "not a module of the model"),
        ("lm_head", "not a module of the model"),
    ):
        bad = json.loads(json.dumps(d))
        bad["target"]["modules"] = {name: {"storage": "int8", "kernel": "w8a16", "scaling": {}}}
        with pytest.raises(ProfileError, match=match):
            plan_from_dict(bad)
    bad = json.loads(json.dumps(d))
    bad["target"]["modules"] = {
        "layers.0.mlp.up_proj": {"storage": "int8", "kernel": "w8a8", "scaling": {"group_size": 64}}
    }
    with pytest.raises(ProfileError, match="group_size=64 is invalid with kernel 'w8a8'"):
        plan_from_dict(bad)
    with pytest.raises(InvalidConfigError, match="group_size=64 is invalid with int8_kernel='w8a8'"):
        make_plan(lookup_gpu("a100"), tc, None, device="cpu", group_size=64)


def test_module_errors_rank_outlier_modules_and_search_alpha():
    _, m = tiny(2, outliers=True)
    calib = collect_calibration(m, windows(3), sample=96)
    assert calib.inputs["layers.0.mlp.down_proj"].shape == (96, 128)
    errs = module_errors(m, calib, list(CHOICES))
    for e in errs.values():
        assert e["fp16"] == (0.0, None)
        assert 0 < e["w8a16/g32"][0] and 0 < e["w8a16"][0]
        assert e["w8a8"][1] in ALPHA_GRID
    # the outlier layer's W8A8 error dwarfs the clean layers'; weight-only does not see activations
    # ... and the down_proj columns that carry them are too small for a per-row weight scale (AWQ's case):
    # weight-only INT8 loses them at any group size, W8A8 with SmoothQuant moves them into range
    bad = errs["layers.1.mlp.down_proj"]
    clean = max(e["w8a16/g32"][0] for n, e in errs.items() if n != "layers.1.mlp.down_proj")
    assert min(bad[c][0] for c in ("w8a16", "w8a16/g64", "w8a16/g32")) > 20 * clean
    assert bad["w8a8"][0] < bad["w8a16"][0] / 20
    # the searched alpha is the best of the grid: alpha 0.5 is never better
    name = "layers.1.mlp.down_proj"
    lin, x = m.layers[1].mlp.down_proj, calib.inputs[name]
    with torch.no_grad():
        y05 = Int8Linear.from_float(lin, "w8a8", act_absmax=calib.absmax[name], alpha=0.5)(x)
        e05 = float((y05 - lin(x)).norm() / lin(x).norm())
    assert bad["w8a8"][0] <= e05 + 1e-7


def test_search_steps_back_only_the_damaging_layers():
    _, m = tiny(4, outliers=True)
    calib = collect_calibration(m, windows(5), sample=96)
    plan = make_plan(lookup_gpu("a100"), m.config, None, device="cpu")
    # as the planner: fp16 attention, embeddings and LM head first
    assert store_narrow(m, plan.target) == 4 * m.config.num_hidden_layers + 2
    ref_logits = [m(w) for w in calib.windows]

    # costs that make W8A8 the fastest (as on a GPU whose W8A8 kernel reads its int8 bytes at fp16's rate)
    def cost(c, n, k, rows):
        return float(2 ** CHOICES.index(c))

    fast = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=1e9, cost=cost)  # anything passes: the fastest
    assert set(fast.counts) == {"w8a8"} and fast.trials[0]["threshold"] is None
    budget = fast.kld / 2
    res = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=budget, cost=cost)
    assert res.kld <= budget
    stepped = {n for n, p in res.modules.items() if p.kernel != "w8a8"}
    kept = set(res.modules) - stepped
    assert stepped and kept and "stepped back past w8a8" in res.modules[sorted(stepped)[0]].reason
    # only damaging modules step back: a module keeps W8A8 exactly when its W8A8 error is within the
    # threshold or W8A8 is its least-error INT8 candidate (its floor: nothing INT8 does better)
    errs = module_errors(m, calib, list(CHOICES))
    int8 = [c.label for c in CHOICES if c.kernel != "dense"]
    floor = {n: min(int8, key=lambda c: e[c][0]) for n, e in errs.items()}
    for n in res.modules:
        assert (n in kept) == (errs[n]["w8a8"][0] <= res.threshold or floor[n] == "w8a8"), n
    assert all(res.modules[n].scaling["smoothquant_alpha"] == errs[n]["w8a8"][1] for n in kept)
    assert res.fp16_modules == 0 and "fp16" not in res.counts  # INT8 alone met the budget
    for n in stepped:  # each stepped back to its fastest candidate within the threshold, or to its floor
        p = res.modules[n]
        label = "w8a16" if p.scaling["group_size"] is None else f"w8a16/g{p.scaling['group_size']}"
        assert errs[n][label][0] <= res.threshold or label == floor[n]
    # the search restored the unquantized model, and the recorded KLD is the plan's own
    assert all(
        type(getattr(layer.mlp, n)) is torch.nn.Linear
        for layer in m.layers
        for n in ("gate_proj", "up_proj", "down_proj")
    )
    for w, r in zip(calib.windows, ref_logits):
        torch.testing.assert_close(m(w), r)
    plan.target.families["ffn"] = res.family
    plan.target.modules.update(res.modules)
    from quant.calibration import Calibration

    apply_plan(m, plan.target, calib.absmax)
    kld, top1 = calib_kld(m, Calibration(calib.windows, calib.ref_logprobs, {}, {}))
    assert kld == pytest.approx(res.kld, rel=1e-4) and top1 == pytest.approx(res.top1)


def test_bisection_stops_within_its_resolution():
    _, m = tiny(4, outliers=True)
    calib = collect_calibration(m, windows(5), sample=96)
    budget = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=1e9).kld / 3
    full = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=budget, resolution=0)
    for r in (1, 3):
        res = search_ffn(m, calib, lookup_gpu("a100"), kld_budget=budget, resolution=r / len(full.modules))
        assert res.kld <= budget and len(res.trials) <= len(full.trials)
        # never bolder than the full bisection, and at most r modules more careful
        assert res.threshold <= full.threshold
        assert (
            sum(
                res.modules[n].kernel != full.modules[n].kernel or res.modules[n].scaling != full.modules[n].scaling
                for n in full.modules
            )
            <= r
        )


def test_fp16_only_past_the_int8_floor():
    _, m = tiny(4, outliers=True)
    calib = collect_calibration(m, windows(5), sample=96)
    gpu = lookup_gpu("a100")
    floor_kld = search_plan_at(m, calib, gpu, -math.inf, 0)[0]  # every module at its least-error INT8 choice
    assert floor_kld > 0
    # a budget the INT8 floor meets sends nothing to fp16, however tight
    res = search_ffn(m, calib, gpu, kld_budget=floor_kld * 1.001, resolution=0)
    assert res.fp16_modules == 0 and "fp16" not in res.counts and res.kld <= floor_kld * 1.001
    # below it, the modules of largest floor error go to fp16: as few as meet the budget
    budget = floor_kld / 4
    res = search_ffn(m, calib, gpu, kld_budget=budget, resolution=0)
    dense = {n for n, p in res.modules.items() if p.kernel == "dense"}
    assert res.kld <= budget and len(dense) == res.fp16_modules > 0 and res.counts["fp16"] == len(dense)
    errs = module_errors(m, calib, list(CHOICES))
    floor_err = {n: min(e[c.label][0] for c in CHOICES if c.kernel != "dense") for n, e in errs.items()}
    assert min(floor_err[n] for n in dense) >= max(floor_err[n] for n in set(errs) - dense)
    assert all("among the" in res.modules[n].reason for n in dense)
    fewer = search_plan_at(m, calib, gpu, -math.inf, res.fp16_modules - 1)[0]
    assert fewer > budget  # one module fewer in fp16 misses it


def test_search_refuses_bad_budget_and_empty_calibration():
    _, m = tiny(6)
    with pytest.raises(InvalidConfigError, match="calibration windows are empty"):
        collect_calibration(m, [])
    calib = collect_calibration(m, windows(7, n=1))
    with pytest.raises(InvalidConfigError, match="kld_budget=0"):
        search_ffn(m, calib, lookup_gpu("a100"), kld_budget=0)


# ------------------------------------------------------------------ the build's ladder on injected outliers


@pytest.fixture(scope="module")
def outlier_ckpts(tmp_path_factory):
    """A random 4-layer Llama and the same with outlier channels injected in layer 1's FFN (its gate and
    up rows 7 and 40 scaled 30x: down_proj inputs ~1000x the others on some tokens), plus texts."""
    from safetensors.torch import load_file, save_file
    from util import make_checkpoint

    from engine.demo.recipe import demo_texts

    root = tmp_path_factory.mktemp("outliers")
    clean = make_checkpoint(root / "clean", "llama", num_hidden_layers=4)
    hot = make_checkpoint(root / "outliers", "llama", num_hidden_layers=4)
    sd = load_file(hot / "model.safetensors")
    for leaf in ("gate_proj", "up_proj"):
        sd[f"model.layers.1.mlp.{leaf}.weight"][[7, 40]] *= 30.0
    save_file(sd, str(hot / "model.safetensors"), metadata={"format": "pt"})
    texts = demo_texts()
    (root / "eval.txt").write_text(texts["heldout"][:12000], encoding="utf-8")
    (root / "calib.txt").write_text(texts["calib"][:12000], encoding="utf-8")
    return clean, hot, root


def _build(target: Path, root: Path, out: Path, *extra: str) -> dict:
    from engine.cli.build_profile import main

    rc = main(
        [
            "--gpu",
            "a100",
            "--target",
            str(target),
            "--eval-text",
            str(root / "eval.txt"),
            "--calib-text",
            str(root / "calib.txt"),
            "--max-eval-tokens",
            "2048",
            "--max-kld",
            "0.002",
            "--max-drift",
            "5",
            "--device",
            "cpu",
            "--quiet",
            "--out",
            str(out),
            *extra,
        ]
    )
    assert rc == 0
    return json.loads(out.read_text())


def test_ladder_steps_back_on_injected_outliers(outlier_ckpts, tmp_path):
    clean, hot, root = outlier_ckpts
    # a KLD bound between the clean model's W8A8 (~6e-5) and the outlier model's (~2e-3)
    ok = _build(clean, root, tmp_path / "clean.json", "--no-search", "--max-kld", "0.001")
    assert [t["passed"] for t in ok["quality"]["attempts"]] == [True]  # W8A8 holds on the clean model
    p = _build(hot, root, tmp_path / "hot.json", "--no-search", "--max-kld", "0.001")
    tries = p["quality"]["attempts"]
    assert tries[0]["plan"] == "int8 w8a8 + SmoothQuant" and not tries[0]["passed"]
    assert tries[0]["kld_mean"] > 10 * ok["quality"]["kld_mean"]
    assert tries[-1]["passed"] and len(tries) >= 2
    assert p["speculation"]["drafter"] == "ngram" and p["models"]["draft"] is None


def test_planner_steps_back_only_the_outlier_layer(outlier_ckpts, tmp_path):
    _, hot, root = outlier_ckpts
    # a random model's flat distributions flip their argmax at any noise: the KLD budget alone decides here
    p = _build(hot, root, tmp_path / "planned.json", "--plan-kld-budget", "0.0003", "--plan-min-top1", "0")
    first = p["quality"]["attempts"][0]
    assert first["plan"] == "planner: per-layer search" and first["passed"]
    mods = p["plan"]["target"]["modules"]
    assert len(mods) == 12 and all(m["reason"] for m in mods.values())
    kept = {n for n, m in mods.items() if m["kernel"] == "w8a8"}
    assert kept
    assert any(n.startswith("layers.1.") for n in set(mods) - kept)  # the outlier layer stepped back
    assert all(m["scaling"]["smoothquant_alpha"] is not None for n, m in mods.items() if n in kept)
    assert first["search"]["kld"] <= first["search"]["kld_budget"]
    md = (tmp_path / "planned.md").read_text()
    assert "Per-layer choices" in md and "layers.1.mlp.down_proj" in md
