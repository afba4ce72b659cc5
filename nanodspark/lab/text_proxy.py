"""Teacher-forced acceptance on held-out natural text: what a drafter and its target can
predict on each kind of text, apart from what the target's own generations look like.

Speculative decoding measures acceptance on the target's *own* continuations, so a small
target that loops makes its loopiest workload look easiest. This proxy runs no generation: on
held-out real text of each workload (the corpus's validation files: GSM8K test solutions,
chit-chat conversations, held-out songs-poems, HumanEval solutions, and Shakespeare), the
drafter proposes a block at random anchors from the true prefix, and slot k is compared with
the target's distribution at the same true prefix:

    alpha_k  = sum_v min(p_draft, p_target)      acceptance probability at T = 1
    greedy_k = [argmax p_draft == argmax p_target] acceptance at T = 0
    tau      = mean over anchors of 1 + sum_k prod_{j<=k} (alpha or greedy)   (`proxy_tau`)

Per workload it also splits slot 1's greedy agreement by what the target's next token is
(whitespace only, punctuation only, a word piece, or a control token such as <|im_end|>:
`token_classes`), and lists the most frequent punctuation next tokens with the drafter's
agreement (`punct_misses`), to show *where* a drafter loses on a kind of text.

`logit_lens` asks the same of the target alone: at which layer is its next token decided? For
every response position it reads each layer's output through the final norm and the LM head
and counts how often that argmax is already the model's final one. A drafter reads a few
layers below the last (`target_layer_ids`); a kind of text whose next token is settled only in
the last layer gives it less to go on.

Invariants: only anchors whose whole block lies inside the text count; a document's anchors
start after its first assistant header (chat, math) or after its first PROXY_PREFIX_TOKENS tokens.
It ignores that a real step's later slots follow the drafts, not the text. Run by
`train_heads.py --phases proxy`; walkthrough chapter 06 §9 and 09 §4d.
"""
from __future__ import annotations

import lzma
import random
from pathlib import Path

import torch

from ..drafter import Drafter
from ..drafter_training import block_pass
from ..loader import EOT, load_model
from ..model import DenseAttentionContext
from .workloads import ASSISTANT_HEADER

PROXY_DOMAINS = {"math": "val_math", "chat": "val_chat", "poetry": "val_poetry", "code": "val_code",
                 "shakespeare": "val_shakespeare"}
PROXY_PREFIX_TOKENS = 16      # documents without an assistant turn: anchors start after this prefix
DEFAULT_DOCUMENTS = 100       # documents per workload
DEFAULT_MAX_TOKENS = 384      # tokens per document
DEFAULT_ANCHORS = 48          # random anchors per document
BATCH = 16                    # documents per forward
TOKEN_CLASSES = ("space", "punct", "word", "special")   # what the target's next token is (`token_classes`)
PUNCT_TOP = 12                # punctuation tokens listed per workload (`punct_misses`)


def proxy_tau(accept: torch.Tensor) -> float:
    """Mean over anchors of 1 + sum_k prod_{j<=k} accept[:, j]: the tokens one verify step would
    commit if slot k were accepted with probability accept[:, k] given the previous slots were."""
    return float((1 + accept.float().cumprod(-1).sum(-1)).mean()) if len(accept) else float("nan")


def token_classes(tok, vocab_size: int) -> torch.Tensor:
    """[vocab_size] class index into TOKEN_CLASSES of every token's decoded text: "special" (a
    control token such as <|im_end|>, which decodes to nothing as text), "space" (whitespace
    only: newlines, indentation), "word" (has a letter or digit), else "punct"."""
    out = []
    for i in range(vocab_size):
        text = tok.decode([i])
        if text == "" and tok.decode([i], skip_special_tokens=False) != "":
            out.append(3)
        else:
            out.append(0 if text.strip() == "" else 2 if any(c.isalnum() for c in text) else 1)
    return torch.tensor(out)


@torch.no_grad()
def logit_lens(target, docs: list[dict], device) -> list[float]:
    """Share of response positions whose argmax read off layer l's output (final norm + LM head)
    equals the model's own, for l = 0 .. L-1 (the last entry is 1 by construction)."""
    L = target.config.num_hidden_layers
    hits, count = torch.zeros(L), 0
    for d in docs:
        ids = torch.tensor(d["prompt"] + d["response"], device=device)
        S = len(ids)
        out = target(ids, torch.arange(S, device=device), DenseAttentionContext(1, S),
                     capture_layers=tuple(range(L - 1)))
        rows = slice(len(d["prompt"]) - 1, S - 1)        # positions whose next token is a response token
        final = target.compute_logits(out.hidden[rows]).argmax(-1)
        for layer, h in enumerate(out.captured):
            hits[layer] += (target.compute_logits(target.model.norm(h[rows])).argmax(-1) == final).sum().item()
        hits[L - 1] += len(final)
        count += len(final)
    return [round(float(x) / max(1, count), 4) for x in hits]


def punct_misses(pairs: torch.Tensor, tok, top: int = PUNCT_TOP) -> list[dict]:
    """The `top` most frequent next tokens of `pairs` ([n, 2]: the target's argmax, the drafter's
    argmax at slot 1), each with its count, the share where the drafter agrees, and what the
    drafter most often says instead."""
    out = []
    tokens, counts = pairs[:, 0].unique(return_counts=True) if len(pairs) else (torch.tensor([]), torch.tensor([]))
    for t in tokens[counts.argsort(descending=True)][:top].tolist():
        rows = pairs[pairs[:, 0] == t]
        wrong = rows[rows[:, 1] != t, 1]
        instead = int(wrong.mode().values) if len(wrong) else None
        out.append({"token": tok.decode([t], skip_special_tokens=False), "n": len(rows),
                    "greedy": round(float((rows[:, 1] == t).float().mean()), 4),
                    "drafter_instead": None if instead is None else tok.decode([instead], skip_special_tokens=False)})
    return out


def text_documents(corpus: Path, name: str, tok, n: int, max_tokens: int, seed: int) -> list[dict]:
    """n documents of a validation file as {prompt, response} token lists: the prompt ends at the
    first assistant header (chat, math) or after PROXY_PREFIX_TOKENS tokens (code, poems, plays)."""
    with lzma.open(corpus / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
        docs = [d for d in f.read().split(EOT) if len(d.strip()) > 80]
    out = []
    for d in random.Random(seed).sample(docs, min(n, len(docs))):
        if ASSISTANT_HEADER in d:
            cut = d.index(ASSISTANT_HEADER) + len(ASSISTANT_HEADER)
            prompt, response = tok.encode(d[:cut]), tok.encode(d[cut:])
        else:
            ids = tok.encode(d)
            prompt, response = ids[:PROXY_PREFIX_TOKENS], ids[PROXY_PREFIX_TOKENS:]
        response = response[:max(0, max_tokens - len(prompt))]
        if len(response) > 8:
            out.append({"prompt": prompt, "response": response})
    return out


@torch.no_grad()
def text_proxy(target_path, drafter_dirs: dict, tok, corpus, n: int = DEFAULT_DOCUMENTS,
               max_tokens: int = DEFAULT_MAX_TOKENS, anchors: int = DEFAULT_ANCHORS, seed: int = 0) -> dict:
    """Teacher-forced acceptance on held-out natural text, per workload (no generation).

    For random anchors of each document, the drafter proposes a block from the true prefix (the
    Markov head sees the true previous tokens) and is compared with the target's next-token
    distribution at the same true prefix: alpha_k = sum_v min(p_draft, p_target) = 1 - L1/2 is
    the acceptance probability of slot k at T = 1, greedy_k = [argmax p_draft == argmax
    p_target] at T = 0. tau = proxy_tau(per-anchor values). This isolates what the drafter
    and the target can predict on each kind of text from what the target's own generations
    look like (a small target repeats itself: chapter 09 §4). `drafter_dirs`: {name: checkpoint
    dir}; `corpus`: the folder with the val_*.txt.xz files."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target = load_model(target_path, dtype=torch.float32, device=device)
    corpus = Path(corpus)
    docs = {wl: text_documents(corpus, f, tok, n, max_tokens, seed)
            for wl, f in PROXY_DOMAINS.items() if (corpus / f"{f}.txt.xz").exists()}
    if not docs:
        raise FileNotFoundError(f"no validation text (val_*.txt.xz) in {corpus}: build the corpus first "
                                "(python -m nanodspark.lab.recipes.default_model corpus)")
    res: dict = {"documents": {wl: len(d) for wl, d in docs.items()}, "max_tokens": max_tokens}
    classes = token_classes(tok, target.config.vocab_size)
    res["logit_lens"] = {wl: logit_lens(target, seqs, device) for wl, seqs in docs.items()}
    for wl, lens in res["logit_lens"].items():
        print(f"logit lens {wl}: share of next tokens already the final argmax after layer 0..: {lens}", flush=True)
    for name, ddir in drafter_dirs.items():
        drafter = Drafter.load(ddir, target, device=device).eval()
        g = drafter.config.gamma
        for wl, seqs in docs.items():
            gen = torch.Generator().manual_seed(seed)
            alpha, greedy, top1, nll, nxt = [], [], [], [], []
            for i in range(0, len(seqs), BATCH):
                bp = block_pass(drafter, target, seqs[i:i + BATCH], g, anchors, device, gen)
                full = bp.valid.all(-1)                       # anchors whose whole block is inside the text
                p_d = torch.softmax(bp.logits[full], -1)
                p_t = bp.p_target[full]
                alpha.append((1 - 0.5 * (p_d - p_t).abs().sum(-1)).clamp(0, 1).cpu())
                greedy.append((p_d.argmax(-1) == p_t.argmax(-1)).cpu())
                # slot 1: what the target says next, and what the drafter says
                nxt.append(torch.stack([p_t[:, 0].argmax(-1), p_d[:, 0].argmax(-1)], -1).cpu())
                top1.append(p_t.max(-1).values.cpu())
                nll.append(-p_t.gather(-1, bp.labels[full][..., None]).squeeze(-1).clamp_min(1e-12).log().cpu())
            a, gr, pairs = torch.cat(alpha), torch.cat(greedy), torch.cat(nxt)
            c = classes[pairs[:, 0]]                          # the class of the target's next token
            res.setdefault(name, {})[wl] = {
                "anchors": len(a), "tau_T0": round(proxy_tau(gr), 4), "tau_T1": round(proxy_tau(a), 4),
                "greedy_by_position": [round(float(x), 4) for x in gr.float().mean(0)],
                "alpha_by_position": [round(float(x), 4) for x in a.mean(0)],
                "target_top1_prob": round(float(torch.cat(top1).mean()), 4),
                "target_nll": round(float(torch.cat(nll).mean()), 4),
                "slot1_by_class": {k: {"share": round(float((c == j).float().mean()), 4),
                                       "greedy": round(float(gr[c == j, 0].float().mean()), 4) if (c == j).any() else None}
                                   for j, k in enumerate(TOKEN_CLASSES)},
                "slot1_punct_tokens": punct_misses(pairs[c == TOKEN_CLASSES.index("punct")], tok)}
            r = res[name][wl]
            print(f"proxy {name} {wl}: tau T=0 {r['tau_T0']} T=1 {r['tau_T1']} "
                  f"(target top-1 prob {r['target_top1_prob']}, nll {r['target_nll']}); slot 1 by next token: "
                  + ", ".join(f"{k} {v['share']:.0%} of anchors, agreement {v['greedy']}"
                              for k, v in r["slot1_by_class"].items()), flush=True)
    return res
