"""`load_format="dummy"`: an engine on a model directory with only config.json (and a tokenizer),
random weights allocated on the device, and a drafter from its config or DSpark's default; the
`--shape` profiles built on it (lab/shapes.py). Nothing here is timed: the tables' numbers only
mean something on the GPU."""
import json

import pytest
import torch

from nanodspark import LLM, SamplingParams
from nanodspark.config import EngineConfig, ModelConfig
from nanodspark.drafter import DrafterConfig
from nanodspark.lab.shapes import SHAPES, materialize, shape_config
from nanodspark.loader import DUMMY_STD, dummy_model, load_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = ["The quick brown fox", "2 + 2 ="]
SMALL = dict(device="cpu", max_model_len=256, num_kv_blocks=64, use_tqdm=False)


@pytest.mark.parametrize("shape", ["tiny-dense", "tiny"])
def test_dummy_pair_generates_greedily_the_same_twice_and_as_the_target_alone(shape, tmp_path):
    """A shape's directory has no weight file; the dummy pair generates, the same tokens for the
    same seed (the weights are drawn from it), and greedy speculation is lossless against the
    dummy target alone, which is the same model at the same seed."""
    model = materialize(shape, tmp_path / shape)
    assert not list(model.rglob("*.safetensors")) and (model / "drafter" / "config.json").exists()
    runs = []
    for _ in range(2):
        llm = LLM(str(model), load_format="dummy", seed=0, **SMALL)
        assert llm.engine.drafter is not None and llm.engine.gamma == 7
        runs.append([o.token_ids for o in llm.generate(PROMPTS, GREEDY)])
    assert runs[0] == runs[1] and all(len(t) == 10 for t in runs[0])
    alone = LLM(str(model), load_format="dummy", seed=0, drafter_path="none", **SMALL)
    assert alone.engine.drafter is None
    assert [o.token_ids for o in alone.generate(PROMPTS, GREEDY)] == runs[0]
    if shape == "tiny":                       # a dense layer, then a MoE layer with its load buffer zeroed
        moe = llm.engine.model.moe_layers()
        assert len(moe) == 1 and int(moe[0].expert_load.sum()) == 0


def test_dummy_weights_follow_one_rule_and_the_seed(tmp_path):
    """normal(0, 0.02) for every weight, 1 for every norm, a tied head shared after allocation;
    another seed draws other weights; the drafter's STS is the identity."""
    cfg = ModelConfig.from_dict(dict(shape_config("tiny-dense"), tie_word_embeddings=True))
    m = dummy_model(cfg, seed=3)
    norms = [p for n, p in m.named_parameters() if n.endswith("norm.weight")]
    assert norms and all(bool((p == 1).all()) for p in norms)
    w = m.model.embed_tokens.weight
    assert m.lm_head.weight is w and abs(w.std().item() - DUMMY_STD) < 0.002 and abs(w.mean().item()) < 0.002
    assert torch.equal(dummy_model(cfg, seed=3).model.embed_tokens.weight, w)
    assert not torch.equal(dummy_model(cfg, seed=4).model.embed_tokens.weight, w)
    model = materialize("tiny", tmp_path / "m")
    d = LLM(str(model), load_format="dummy", **SMALL).engine.drafter
    assert bool((d.sts_temperature == 1).all()) and bool((d.sts_shift == 0).all())
    assert abs(d.fc.weight.std().item() - DUMMY_STD) < 0.005 and bool((d.norm.weight == 1).all())


def test_dummy_needs_only_config_json_and_takes_the_drafters_config(tmp_path):
    """Without a tokenizer the engine takes token ids; without drafter/ the dummy pair gets DSpark's
    default drafter, with one it takes its config (here gamma 3, 1 layer); `gamma` sets the
    block size of a dummy drafter, which has no trained one to keep."""
    (tmp_path / "config.json").write_text(json.dumps(shape_config("tiny-dense")))
    llm = LLM(str(tmp_path), load_format="dummy", **SMALL)
    assert llm.tokenizer is None and llm.engine.drafter.config == DrafterConfig.dspark_default(llm.engine.model_config)
    assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 10
    assert LLM(str(tmp_path), load_format="dummy", gamma=4, **SMALL).engine.gamma == 4
    dcfg = DrafterConfig.for_target(llm.engine.model_config, num_layers=1, gamma=3, target_layer_ids=[0])
    (tmp_path / "drafter").mkdir()
    (tmp_path / "drafter" / "config.json").write_text(json.dumps(dcfg.__dict__))
    d = LLM(str(tmp_path), load_format="dummy", **SMALL).engine.drafter
    assert d.config == dcfg and len(d.layers) == 1
    with pytest.raises(ValueError, match="no safetensors weights.*load_format='dummy'"):   # the default reads them
        LLM(str(tmp_path), **SMALL)


def test_dspark_default_drafter_for_the_paper_shapes():
    """DeepSpec's released Qwen3-8B drafter: 5 layers of the target's shape, gamma 7, Markov rank
    256, target layers [1, 9, 17, 25, 33], Qwen3's mask id; Qwen3-30B-A3B gets the same rule
    (layers spread over its 48, a dense MLP of its intermediate_size)."""
    d8 = DrafterConfig.dspark_default(ModelConfig.from_dict(shape_config("qwen3-8b")))
    assert (d8.num_layers, d8.gamma, d8.markov_rank, d8.target_layer_ids, d8.mask_token_id) == (
        5, 7, 256, [1, 9, 17, 25, 33], 151669)
    assert (d8.hidden_size, d8.num_attention_heads, d8.num_key_value_heads, d8.head_dim, d8.intermediate_size) == (
        4096, 32, 8, 128, 12288)
    moe = ModelConfig.from_dict(shape_config("qwen3-30b-a3b"))
    d30 = DrafterConfig.dspark_default(moe)
    assert d30.target_layer_ids == [1, 12, 23, 34, 45] and d30.intermediate_size == 6144
    d30.check_target(moe)
    assert set(SHAPES) >= {"qwen3-8b", "qwen3-30b-a3b", "tiny", "tiny-dense"}


def test_a_bad_load_format_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="load_format must be one of 'safetensors', 'dummy'"):
        EngineConfig(load_format="pt")
    with pytest.raises(ValueError, match="load_format"):
        LLM(str(tmp_path), load_format="random")
    (tmp_path / "config.json").write_text(json.dumps(shape_config("tiny-dense")))
    with pytest.raises(ValueError, match="load_format"):
        load_model(tmp_path, load_format="npz")


def _notes(path):
    (entry,) = json.loads(path.read_text()).values()
    return entry


def test_profile_and_profile_plain_on_a_shape_say_random_weights(tmp_path, capsys):
    """`bench profile --shape` and `profile-plain --shape` run end to end from a shape alone, and
    their tables (and output) say the weights are random and which shape they had."""
    from nanodspark.lab.bench import main
    spec, plain = tmp_path / "spec.json", tmp_path / "plain.json"
    assert main(["profile", "--shape", "tiny", "--batch-sizes", "1", "2", "--context", "16", "--repeats", "1",
                 "--k-points", "2", "--prompts", "random", "--out", str(spec)]) == 0
    assert main(["profile-plain", "--shape", "tiny-dense", "--batch-sizes", "1", "2", "--context", "16",
                 "--repeats", "2", "--out", str(plain)]) == 0
    out = capsys.readouterr().out
    assert "RANDOM WEIGHTS, shape tiny:" in out and "RANDOM WEIGHTS (tiny-dense)" in out and "memory: " in out
    s, p = _notes(spec), _notes(plain)
    assert s["model_name"] == "tiny (random weights)" and p["model_name"] == "tiny-dense (random weights) (no drafter)"
    for t, shape in ((s, "tiny"), (p, "tiny-dense")):
        n = t["notes"]
        assert n["random_weights"] is True and n["shape"] == shape and n["kv_blocks"] >= n["kv_blocks_needed"]
        assert t["measurements"]
    assert {m[0] for m in s["measurements"]} == {1, 2} and {m[1] for m in p["measurements"]} == {0}


def test_profile_refuses_a_shape_with_a_model_and_a_kv_cache_too_small(tmp_path, capsys):
    from nanodspark.lab.bench import build_parser, main
    with pytest.raises(SystemExit):
        build_parser().parse_args(["profile", "--shape", "tiny", "--model", str(tmp_path)])
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="raise --kv-gb"):
        main(["profile-plain", "--shape", "tiny-dense", "--batch-sizes", "64", "--context", "512",
              "--kv-gb", "0.0005", "--out", str(tmp_path / "p.json")])


def test_the_smollm2_shape_has_the_drafter_train_heads_trains_for_it():
    """`smollm2-135m` is the pretrained pair's target (a tied Llama of 134.5M parameters) with the
    drafter `train_heads.py` trains by default, not DSpark's: 2 layers, gamma 5, MLP 640, Markov
    rank 64, target layers about n/4, n/2, n-2 (the trained drafter had 11,272,449 parameters)."""
    from nanodspark.drafter import Drafter
    from nanodspark.lab.shapes import describe, drafter_config
    cfg = ModelConfig.from_dict(shape_config("smollm2-135m"))
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size, cfg.tie_word_embeddings) == ("llama", 30, 576, True)
    d = drafter_config("smollm2-135m", cfg)
    assert (d.num_layers, d.gamma, d.intermediate_size, d.markov_rank, d.target_layer_ids) == (2, 5, 640, 64, [7, 15, 28])
    assert drafter_config("qwen3-8b", ModelConfig.from_dict(shape_config("qwen3-8b"))).gamma == 7
    with torch.device("meta"):                # the embedding and head are the target's, shared
        shared = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size), torch.nn.Linear(cfg.hidden_size, cfg.vocab_size)
        assert sum(p.numel() for p in Drafter(d, *shared).parameters()) == 11_272_449
    assert "drafter 2 layers, gamma 5" in describe("smollm2-135m")


def test_bench_engine_runs_a_shape_with_and_without_its_drafter_under_a_law(tmp_path):
    """`bench engine --shape`: random weights, the shape's drafter beside the target alone, and a
    synthetic law that makes the random drafts accepted (tau > 1); the JSON says so. The law is
    refused without a shape, and transformers' systems with one."""
    from nanodspark.lab.bench import main
    out = tmp_path / "e.json"
    assert main(["engine", "--shape", "tiny-dense", "--synthetic-acceptance", "0.6:0.9", "--systems", "eager",
                 "--batches", "2", "--max-tokens", "12", "--repeats", "1", "--profile-steps", "0", "--kv-gb", "0.05",
                 "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["random_weights"] and r["synthetic_acceptance"] == "0.6:0.9" and r["model"].startswith("tiny-dense shape")
    rows = {row["drafter"] is not None: row for row in r["rows"]}
    assert rows[True]["tau"] > 1.5 and rows[False]["tau"] is None and rows[True]["tokens"] == rows[False]["tokens"] == 24
    with pytest.raises(SystemExit, match="needs --shape"):
        main(["engine", "--synthetic-acceptance", "0.5:0.6", "--systems", "eager", "--batches", "1"])
    with pytest.raises(SystemExit, match="hf-"):
        main(["engine", "--shape", "tiny-dense", "--systems", "hf-static", "eager", "--batches", "1"])
