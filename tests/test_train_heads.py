"""A two-step training smoke run of train_heads.py writes a drafter the engine loads and uses."""
import argparse
import json
import lzma

import pytest
import torch

import train_heads
from nanodspark import LLM, SamplingParams
from nanodspark.drafter import Drafter
from nanodspark.loader import load_model


def test_two_step_training_writes_a_loadable_drafter(tiny_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = ["<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\nIt is four, of course.",
            "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 3]
    for name, d in (("chat", docs[0]), ("code", docs[1]), ("val_math", docs[0]), ("val_code", docs[1])):
        with lzma.open(corpus / f"{name}.txt.xz", "wt") as f:
            f.write(("<|endoftext|>".join([d] * 6)) + "<|endoftext|>")
    out = tmp_path / "run"
    report = train_heads.main(["--target", str(tiny_dir), "--corpus", str(corpus), "--out", str(out),
                               "--phases", "data,train", "--n-prompts", "6", "--gen-tokens", "10",
                               "--gen-batch", "6", "--seconds", "60",
                               "--max-steps", "2", "--batch", "2", "--anchors", "4", "--gamma", "3",
                               "--layers", "1", "--markov-rank", "8", "--intermediate", "32"])
    assert report["data"]["sequences"] > 0
    curve = report["dspark"]["curve"]
    assert curve and all(torch.isfinite(torch.tensor(c["loss"])) for c in curve)
    cfg = json.loads((out / "dspark" / "config.json").read_text())
    assert cfg["gamma"] == 3 and cfg["markov_rank"] == 8
    # the DFlash ablation is step-matched by default and has neither Markov head nor confidence
    assert report["dspark"]["steps"] == report["dflash"]["steps"] == 2
    fcfg = json.loads((out / "dflash" / "config.json").read_text())
    assert fcfg["markov_rank"] == 0 and not fcfg["confidence"]
    assert json.loads((out / "report.json").read_text())["dflash"]["steps"] == 2
    d = Drafter.load(out / "dspark", load_model(tiny_dir))
    assert d.config.gamma == 3
    llm = LLM(str(tiny_dir), drafter_path=str(out / "dspark"), use_tqdm=False)
    o = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    assert len(o.token_ids) == 6 and o.spec["steps"] > 0
    # calibrate: STS temperatures shipped in the checkpoint, offsets with prompt-level intervals
    rep = train_heads.main(["--target", str(tiny_dir), "--out", str(out), "--phases", "calibrate",
                            "--calib-n", "2", "--calib-tokens", "8"])
    cal = rep["calibration"]
    fit = cal[cal["shipped"]]
    assert len(cal["temperatures"]) == 3 and len(fit["swapped_halves"]["temperatures"]) == 3
    assert len(fit["offset_after_90pct_prompt_bootstrap"]) == 3 and cal["held_out_prompts"] == 4
    for gap, lo, hi in fit["offset_after_90pct_prompt_bootstrap"] + cal["plain"]["offset_after_90pct_prompt_bootstrap"]:
        assert gap != gap or lo <= gap <= hi          # nan where a position was never verified
    assert cal["shipped"] == "shifted" and cal["shifts"] == cal["shifted"]["shifts"] and cal["plain"]["shifts"] is None
    shipped = Drafter.load(out / "dspark", load_model(tiny_dir))
    assert torch.allclose(shipped.sts_temperature, torch.tensor(cal["temperatures"]), rtol=1e-3)
    assert torch.allclose(shipped.sts_shift, torch.tensor(cal["shifts"]), atol=1e-3)
    assert (out / "reliability.png").read_bytes()[:4] == b"\x89PNG"
    # refit from the saved records, shipping plain STS: same records, so the same plain fit
    import shutil
    shutil.copytree(out / "dspark", tmp_path / "refit" / "dspark")
    plain = train_heads.main(["--target", str(tiny_dir), "--out", str(tmp_path / "refit"), "--phases", "calibrate",
                              "--calib-records", str(out / "calibration_records.safetensors"), "--sts", "plain"])
    refit = plain["calibration"]
    assert refit["held_out_proposals"] == cal["held_out_proposals"]
    assert (refit["plain"]["temperatures"], refit["plain"]["mean_ece_after"]) == (
        cal["plain"]["temperatures"], cal["plain"]["mean_ece_after"])
    assert refit["temperatures"] == cal["plain"]["temperatures"] and refit["shifts"] is None


def test_domains_and_init_options(tiny_dir, tmp_path):
    """--domains picks the prompt domains; --init fine-tunes from a checkpoint (lr 0: unchanged)."""
    from safetensors.torch import load_file
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, d in (("chat", "<|im_start|>user\nhello there, how are you?<|im_end|>\n<|im_start|>assistant\nfine"),
                    ("code", "def add(a, b):\n    return a + b\n" * 8)):
        with lzma.open(corpus / f"{name}.txt.xz", "wt") as f:
            f.write(("<|endoftext|>".join([d] * 6)) + "<|endoftext|>")
    common = ["--target", str(tiny_dir), "--corpus", str(corpus), "--gamma", "3", "--layers", "1",
              "--markov-rank", "8", "--intermediate", "32", "--batch", "2", "--anchors", "4", "--dflash", "off",
              "--ckpt-every", "0"]
    base = tmp_path / "base"
    train_heads.main(common + ["--out", str(base), "--phases", "data,train", "--domains", "code", "--n-prompts", "4",
                               "--gen-tokens", "8", "--gen-batch", "4", "--max-steps", "2"])
    assert not (base / "dflash").exists()
    # the ablation, trained later in its own call, matches the DSpark run on record
    no_dflash_off = [a for a in common if a not in ("--dflash", "off")]   # the phase, not the flag, asks for it
    later = train_heads.main(no_dflash_off + ["--out", str(base), "--phases", "dflash"])
    assert later["dflash"]["steps"] == later["dspark"]["steps"] == 2 and (base / "dflash" / "config.json").exists()
    assert len(later["commands"]) == 2 and "dflash" in later["commands"][1]
    (tmp_path / "nothing").mkdir()
    (tmp_path / "nothing" / "data.json").write_text((base / "data.json").read_text())
    with pytest.raises(SystemExit, match="DSpark run on record"):
        train_heads.main(common + ["--out", str(tmp_path / "nothing"), "--phases", "dflash"])
    tok = train_heads.Tokenizer(str(tiny_dir))
    prompts = [tok.decode(d["prompt"]) for d in json.loads((base / "data.json").read_text())]
    assert prompts and all(p.startswith("def add") for p in prompts)
    ft = tmp_path / "ft"
    ft.mkdir()
    (ft / "data.json").write_text((base / "data.json").read_text())
    train_heads.main(common + ["--out", str(ft), "--phases", "train", "--init", str(base / "dspark"),
                               "--max-steps", "2", "--lr", "0"])
    a, b = load_file(str(base / "dspark" / "model.safetensors")), load_file(str(ft / "dspark" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # --target-layers: which target layers the drafter reads (never the last one)
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "data.json").write_text((base / "data.json").read_text())
    train_heads.main(common + ["--out", str(wide), "--phases", "train", "--max-steps", "1", "--target-layers", "2,0,1"])
    from nanodspark.drafter import Drafter
    from nanodspark.loader import load_model
    d = Drafter.load(wide / "dspark", load_model(str(tiny_dir)))
    assert d.config.target_layer_ids == [0, 1, 2] and d.fc.in_features == 3 * d.config.hidden_size
    with pytest.raises(SystemExit, match="target-layers"):
        train_heads.main(common + ["--out", str(wide), "--phases", "train", "--max-steps", "1", "--target-layers", "3"])
    with pytest.raises(ValueError, match="gamma"):            # the checkpoint's block size must match
        train_heads.main(common + ["--gamma", "4", "--out", str(ft), "--phases", "train", "--init", str(base / "dspark"),
                                   "--max-steps", "1"])


def test_repeated_ngram_fraction():
    assert train_heads.repeated_ngram_fraction([([1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 4])]) == 5 / 8
    assert train_heads.repeated_ngram_fraction([([9, 8, 7, 6], [1, 2, 3, 4, 5])]) == 0.0


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(tiny_dir, tmp_path):
    """Pre-empt training at step 2 of 4, resume, and get the very weights of a 4-step run
    (weights, AdamW moments, LR schedule, batches and anchor RNG are all restored)."""
    from safetensors.torch import load_file
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    doc = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x: int = 0\n    y: int = 0\n"
    with lzma.open(corpus / "code.txt.xz", "wt") as f:
        f.write("<|endoftext|>".join(doc * (i % 3 + 1) for i in range(8)) + "<|endoftext|>")
    common = ["--target", str(tiny_dir), "--corpus", str(corpus), "--n-prompts", "20", "--gen-tokens", "12",
              "--gen-batch", "8", "--max-steps", "4", "--batch", "2", "--anchors", "3", "--gamma", "3",
              "--layers", "1", "--markov-rank", "8", "--intermediate", "32", "--dflash", "off"]
    a, b = tmp_path / "a", tmp_path / "b"
    train_heads.main(common + ["--out", str(a), "--phases", "data"])
    b.mkdir()
    (b / "data.json").write_text((a / "data.json").read_text())
    train_heads.main(common + ["--out", str(a), "--phases", "train"])
    train_heads.main(common + ["--out", str(b), "--phases", "train", "--stop-at-step", "2"])
    assert json.loads((b / "dspark" / "train_state.json").read_text())["step"] == 2
    at2 = load_file(str(b / "dspark" / "train_state.safetensors"))
    rep = train_heads.main(common + ["--out", str(b), "--phases", "train", "--resume"])
    assert rep["dspark"]["steps"] == 4
    wa, wb = load_file(str(a / "dspark" / "train_state.safetensors")), load_file(str(b / "dspark" / "train_state.safetensors"))
    assert wa.keys() == wb.keys() and any(k.startswith("adam.exp_avg.") for k in wa)
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=0, atol=0, msg=k)
    assert any(not torch.equal(wa[k], at2[k]) for k in wa if k.startswith("param."))   # steps 3-4 did train


def test_code_prompts_end_before_the_bare_newline():
    """The code workload strips HumanEval's trailing newline; --code-prompts-as-shipped puts it
    back. Chat prompts are the same either way."""
    from nanodspark.loader import DEFAULT_MODEL_DIR
    tok = train_heads.Tokenizer(str(DEFAULT_MODEL_DIR))
    stripped = train_heads.workload_prompts(tok, "code", 3, None)
    shipped = train_heads.workload_prompts(tok, "code", 3, None, as_shipped=True)
    newline = tok.encode("\n")
    for a, s in zip(shipped, stripped):
        assert a[-1:] == newline and s[-1:] != newline and tok.decode(a).rstrip() == tok.decode(s)
    assert (train_heads.workload_prompts(tok, "chat", 2, None, as_shipped=True)
            == train_heads.workload_prompts(tok, "chat", 2, None))


def test_prompt_corpus_keeps_the_first_documents_cut_short(tmp_path):
    """--write-prompt-corpus keeps, per domain, the first N documents longer than 80 characters,
    each cut to C characters, and training prompts can be drawn from the copy."""
    src, out, eot = tmp_path / "src", tmp_path / "small", train_heads.EOT
    src.mkdir()
    docs = {"chat": [f"user {i} " * 30 for i in range(6)], "math": ["short"] + [f"sum {i} " * 40 for i in range(5)]}
    for dom, ds in docs.items():
        with lzma.open(src / f"{dom}.txt.xz", "wt", encoding="utf-8") as f:
            f.write(eot.join(ds))
    kept = train_heads.main(["--corpus", str(src), "--write-prompt-corpus", str(out), "--domains", "chat,math",
                             "--prompt-corpus-docs", "3", "--prompt-corpus-chars", "100"])
    assert kept == {"chat": 3, "math": 3}
    for dom, ds in docs.items():
        with lzma.open(out / f"{dom}.txt.xz", "rt", encoding="utf-8") as f:
            got = f.read().split(eot)
        assert got == [d[:100] for d in ds if len(d) > 80][:3]       # "short" is skipped, order kept
    prompts = train_heads.training_prompts(out, 4, 0, ("chat", "math"))
    assert len(prompts) == 4 and all(any(d.startswith(p) for ds in docs.values() for d in ds) for p in prompts)


def test_a_fresh_clone_without_a_corpus_gets_one_line_that_says_how_to_build_it(tmp_path, monkeypatch, capsys):
    """The documented command on a fresh clone (no .carry/corpus, no build/corpus) and an empty
    --corpus fail before loading anything, with the command that builds the corpus; a train phase
    without data names the data phase. (Before: RuntimeError deep in training on 0 sequences.)"""
    from nanodspark.lab import prompt_corpus
    monkeypatch.setattr(prompt_corpus, "CORPUS_DIRS", (tmp_path / "no" / "corpus",))
    for argv in (["--out", str(tmp_path / "run")], ["--out", str(tmp_path / "run"), "--corpus", str(tmp_path)],
                 ["--out", str(tmp_path / "run"), "--phases", "proxy"]):
        with pytest.raises(SystemExit) as e:
            train_heads.main(argv)
        msg = str(e.value)
        assert "\n" not in msg and "python -m nanodspark.lab.recipes.corpus --out build/corpus" in msg, msg
    with pytest.raises(SystemExit, match="run the data phase first"):
        train_heads.main(["--out", str(tmp_path / "run"), "--phases", "train"])
    with pytest.raises(SystemExit, match="unknown phase"):
        train_heads.main(["--out", str(tmp_path / "run"), "--phases", "data,trian"])
    ap = train_heads.build_parser()
    assert ap.formatter_class is argparse.ArgumentDefaultsHelpFormatter
    assert all(a.help for a in ap._actions), [a.dest for a in ap._actions if not a.help]
    with pytest.raises(SystemExit) as e:
        train_heads.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert e.value.code == 0 and "(default: 150)" in out and "(default: data,train,calibrate,eval)" in out
