"""`EngineConfig` with shape.

* Every field carries its help and group in `field(metadata=...)`; enumerations are `Literal`s;
  `serve.py` builds its flags from that metadata (argument groups, defaults shown) and no longer
  reads the source's comments.
* Wrong types and unknown names are clear errors that name the field.
* `eplb_record`, a benchmark's control, is not a field any more: the bench turns recording off
  on the engine's balancer (`ExpertBalancer.set_recording`).
"""
import dataclasses
import typing
from pathlib import Path

import pytest

from nanodspark import LLM, SamplingParams
from nanodspark.config import GROUPS, EngineConfig
from test_server import _load_serve

ROOT = Path(__file__).resolve().parents[1]
HINTS = typing.get_type_hints(EngineConfig)
ENUMS = {"dtype": {"auto", "float32", "bfloat16", "float16"}, "attention_backend": {"auto", "torch", "triton"},
         "verify_mode": {"static", "compact", "cap-accept"}, "dist_backend": {"auto", "gloo", "nccl"},
         "eplb_policy": {"auto", "hierarchical", "global"}, "load_format": {"safetensors", "dummy"}}


def test_every_field_has_one_line_of_help_and_a_group():
    for f in dataclasses.fields(EngineConfig):
        help_, group = f.metadata.get("help"), f.metadata.get("group")
        assert help_ and "\n" not in help_ and len(help_) <= 200, f.name
        assert group in GROUPS, f.name
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    assert "eplb_record" not in names
    assert {f.metadata["group"] for f in dataclasses.fields(EngineConfig)} == set(GROUPS)


def test_enumerations_are_literals_and_become_choices():
    serve = _load_serve()
    by_dest = {a.dest: a for a in serve.build_parser()._actions}
    for name, values in ENUMS.items():
        assert typing.get_origin(HINTS[name]) is typing.Literal and set(typing.get_args(HINTS[name])) == values, name
        assert set(by_dest[name].choices) == values, name
        for v in values:
            EngineConfig(**{name: v})
        with pytest.raises(ValueError, match=name):
            EngineConfig(**{name: "bogus"})
    assert set(serve.DTYPE_CHOICES) == ENUMS["dtype"]


def test_serve_help_is_built_from_the_metadata_in_groups_with_defaults():
    serve = _load_serve()
    source = (ROOT / "serve.py").read_text()
    assert "getsource" not in source and "_field_help" not in source
    ap = serve.build_parser()
    titles = [g.title for g in ap._action_groups]
    assert [t for t in titles if t.startswith("engine: ")] == [f"engine: {g}" for g in GROUPS]
    for f in dataclasses.fields(EngineConfig):
        if not f.metadata["cli"]:
            continue
        group = next(g for g in ap._action_groups if g.title == f"engine: {f.metadata['group']}")
        action = next(a for a in group._group_actions if a.dest == f.name)
        assert action.help.startswith(f.metadata["help"]) and "(default: " in action.help, f.name
    text = ap.format_help()
    assert "--max-num-seqs INT" in text and "(default: 64)" in text
    assert "--swa-replay-tokens {INT,auto}" in text


def test_wrong_types_and_names_are_clear_errors():
    for kw, err, words in (
            ({"max_model_len": "x"}, TypeError, ("max_model_len", "integer", "'x'")),
            ({"max_num_seqs": True}, TypeError, ("max_num_seqs", "integer")),
            ({"gamma": 2.5}, TypeError, ("gamma",)),
            ({"kv_cache_memory_gb": "lots"}, TypeError, ("kv_cache_memory_gb", "number")),
            ({"enable_prefix_cache": "yes"}, TypeError, ("enable_prefix_cache", "bool")),
            ({"graph_batch_sizes": "1,2"}, TypeError, ("graph_batch_sizes", "list of integers")),
            ({"graph_batch_sizes": [1, "2"]}, TypeError, ("graph_batch_sizes",)),
            ({"drafter_path": 5}, TypeError, ("drafter_path", "string or None")),
            ({"swa_replay_tokens": 1.5}, TypeError, ("swa_replay_tokens", "'auto'")),
            ({"swa_replay_tokens": "most"}, ValueError, ("swa_replay_tokens", "'auto'")),
            ({"kv_memory_fraction": 1.5}, ValueError, ("kv_memory_fraction",))):
        with pytest.raises(err) as e:
            EngineConfig.from_kwargs(**kw)
        for w in words:
            assert w in str(e.value), (kw, str(e.value))
    with pytest.raises(TypeError, match="did you mean 'max_num_seqs'"):
        EngineConfig.from_kwargs(max_num_seq=4)
    with pytest.raises(TypeError, match="max_model_len"):
        LLM(max_model_len="x")
    # lenient where nothing is lost
    cfg = EngineConfig(kv_cache_memory_gb=1, graph_batch_sizes=[1, 2], drafter_path=Path("/x"), swa_replay_tokens="140")
    assert (cfg.kv_cache_memory_gb, cfg.graph_batch_sizes, cfg.drafter_path, cfg.swa_replay_tokens) == (1.0, (1, 2),
                                                                                                       "/x", 140)
    assert isinstance(cfg.kv_cache_memory_gb, float)


def test_recording_off_is_the_benchs_hook_on_the_balancer(tiny_dir):
    """Turned off after construction, the MoE layers still map to replicas but count nothing
    (CPU: no graph to capture again); greedy output is unchanged."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = LLM(str(tiny_dir), use_tqdm=False, eplb=True, eplb_interval=0, eplb_num_redundant_experts=2)
    bal = llm.engine.eplb
    want = llm.generate(prompts, params)
    assert bal.recording and int(bal.recorder.total.sum()) > 0
    bal.recorder.reset()
    bal.set_recording(False)
    got = llm.generate(prompts, params)
    assert not bal.recording and int(bal.recorder.total.sum()) == 0, "tokens were counted with recording off"
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    bal.set_recording(True)
    llm.generate(prompts, params)
    assert int(bal.recorder.total.sum()) > 0
