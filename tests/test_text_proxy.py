"""The natural-text proxy (nanodspark/lab/text_proxy.py), run as train_heads.py's `proxy` phase."""
import lzma

import torch

import train_heads
from nanodspark.drafter import Drafter, DrafterConfig
from nanodspark.loader import Tokenizer, load_model
from nanodspark.lab.text_proxy import TOKEN_CLASSES, proxy_tau, punct_misses, text_documents, token_classes


def test_text_proxy_scores_every_drafter_on_held_out_text(tiny_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = {"val_math": "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
                        "Two plus two is four. Four is the answer, so the answer is four.",
            "val_poetry": "The sea is calm tonight,\nthe tide is full, the moon lies fair\n" * 3}
    for name, d in docs.items():
        with lzma.open(corpus / f"{name}.txt.xz", "wt") as f:
            f.write(("<|endoftext|>".join([d] * 3)) + "<|endoftext|>")
    target = load_model(tiny_dir)
    cfg = DrafterConfig.for_target(target.config, gamma=3, num_layers=1, intermediate_size=32, markov_rank=8)
    Drafter(cfg, target.model.embed_tokens, target.lm_head).save(tmp_path / "run" / "dspark")
    rep = train_heads.main(["--target", str(tiny_dir), "--corpus", str(corpus), "--out", str(tmp_path / "run"),
                            "--phases", "proxy", "--proxy-n", "2", "--anchors", "4"])["text_proxy"]
    assert rep["documents"] == {"math": 2, "poetry": 2}
    # the logit lens: one share per target layer, the last one 1 (it *is* the final argmax)
    L = target.config.num_hidden_layers
    assert set(rep["logit_lens"]) == {"math", "poetry"}
    assert all(len(v) == L and v[-1] == 1.0 and all(0 <= x <= 1 for x in v) for v in rep["logit_lens"].values())
    for wl in ("math", "poetry"):
        r = rep["dspark"][wl]
        assert r["anchors"] > 0 and len(r["alpha_by_position"]) == len(r["greedy_by_position"]) == 3
        assert all(0 <= a <= 1 for a in r["alpha_by_position"] + r["greedy_by_position"])
        assert 1 <= r["tau_T0"] <= 4 and 1 <= r["tau_T1"] <= 4 and 0 < r["target_top1_prob"] <= 1
        punct = r["slot1_punct_tokens"]                # the most frequent punctuation next tokens
        assert sum(t["n"] for t in punct) <= round(by_share(r, "punct") * r["anchors"]) + 1
        by = r["slot1_by_class"]                       # slot 1 split by the target's next token
        assert set(by) == set(TOKEN_CLASSES) and abs(sum(v["share"] for v in by.values()) - 1) < 1e-3
        # the split is a partition of slot 1's anchors: share-weighted agreement is slot 1's agreement
        assert abs(sum(v["share"] * (v["greedy"] or 0) for v in by.values()) - r["greedy_by_position"][0]) < 2e-3
    # the math document's prompt ends at the assistant header: anchors only inside the answer
    math_doc = text_documents(corpus, "val_math", Tokenizer(str(tiny_dir)), 1, 384, 0)[0]
    assert Tokenizer(str(tiny_dir)).decode(math_doc["prompt"]).endswith("assistant\n")


def by_share(r, name):
    return r["slot1_by_class"][name]["share"]


def test_proxy_tau():
    # 1 + sum of prefix products, averaged over anchors
    assert proxy_tau(torch.tensor([[1, 1, 0], [1, 0, 1]])) == 2.5
    assert abs(proxy_tau(torch.tensor([[0.5, 0.5, 0.5]])) - 1.875) < 1e-6


def test_token_classes(tiny_dir):
    tok = Tokenizer(str(tiny_dir))
    classes = token_classes(tok, tok.vocab_size)
    name = {i: TOKEN_CLASSES[int(c)] for i, c in enumerate(classes)}
    checked = 0
    for text, want in (("\n", "space"), ("    ", "space"), ("(", "punct"), ("):", "punct"), ("the", "word"),
                       ("x1", "word")):
        ids = tok.encode(text)
        if len(ids) == 1:                              # all but "x1" are one token in our 8k BPE
            assert name[ids[0]] == want, (text, name[ids[0]])
            checked += 1
    assert checked >= 4
    assert {"space", "punct", "word", "special"} <= set(name.values())
    assert name[tok.tok.token_to_id("<|im_end|>")] == "special"      # not "space": it decodes to nothing


def test_logit_lens_of_a_model_whose_layers_do_nothing(tiny_dir):
    """With every layer's residual branch zeroed, each layer's output is the embedding, so every
    layer's lens already gives the final argmax (share 1.0 everywhere); the real tiny model's
    early layers do not (a share below 1 somewhere)."""
    from nanodspark.lab.text_proxy import logit_lens
    target = load_model(tiny_dir)
    docs = [{"prompt": [5, 6, 7], "response": list(range(10, 40))}]
    assert min(logit_lens(target, docs, "cpu")[:-1]) < 1.0
    with torch.no_grad():
        for layer in target.model.layers:
            for name, p in layer.named_parameters():
                if name.startswith(("self_attn.o_proj", "mlp.")) and ("down" in name or "o_proj" in name):
                    p.zero_()
    assert logit_lens(target, docs, "cpu") == [1.0] * target.config.num_hidden_layers


def test_punct_misses_counts_agreement_and_the_usual_substitute(tiny_dir):
    tok = Tokenizer(str(tiny_dir))
    colon, dot, comma = (tok.encode(x)[0] for x in (":", ".", ","))
    pairs = torch.tensor([[colon, dot], [colon, dot], [colon, colon], [colon, comma], [comma, comma]])
    got = punct_misses(pairs, tok)
    assert got[0] == {"token": ":", "n": 4, "greedy": 0.25, "drafter_instead": "."}
    assert got[1] == {"token": ",", "n": 1, "greedy": 1.0, "drafter_instead": None}
    assert punct_misses(pairs, tok, top=1) == got[:1] and punct_misses(pairs[:0], tok) == []
