"""Incremental detokenization with stop strings: the text a request streams, step by step.

The idea: decoding a request's whole output every step costs O(length) per request per step
(at 256 requests of ~600 tokens, ~30 ms of an engine step). Instead a window is decoded from the
last text boundary, twice — without and with the new tokens — and the difference is the new
text. Both decodes start at the same token, so whatever a decoder does at a window's start
(a replacement character for a split byte sequence, a stripped leading space) cancels out.

Invariants: `req.text == decode(req.output_ids[:req.detok_read])` (up to a stop string); the
boundary `detok_read` only moves when the window does not end inside a UTF-8 character
("\ufffd"), or after DETOKENIZE_MAX_HOLD held tokens (invalid output); text up to `req.emitted`
has been streamed and never changes; streamed text holds back len(stop) - 1 characters so that
a stop string is never streamed. A step that commits several tokens (a verify step) ends, when a
stop string completes inside them, at the token that completes it, exactly as one token per step
would (`commit_text`): `output_ids` never holds tokens past a stop. Walkthrough chapter 01.
"""
from __future__ import annotations

from typing import NamedTuple

DETOKENIZE_MAX_HOLD = 64   # tokens the detokenizer may hold back waiting for a character to complete


def detokenize(tokenizer, req, new_ids: list[int], final: bool, end: int | None = None,
               decoded: tuple[str, str] | None = None) -> tuple[str, bool]:
    """Extend req.text with the new tokens and return (text to stream now, stop string hit).

    req: an engine `Request` (output_ids already include new_ids; text, emitted, detok_prefix,
    detok_read, params.stop are read and updated). final: the request finishes with these tokens.
    end: read only `output_ids[:end]` (default: all of it; `commit_text` replays a verify step
    one token at a time through this). decoded: the two window decodes, if already made.

    Incremental: decoding the whole output every step costs O(length) per request per step
    (at 256 requests of ~600 tokens, ~30 ms of a step). Only a window is decoded, from the
    previous boundary on, twice (without and with the new tokens); the difference is the
    new text. Both decodes start at the same token, so whatever the decoder does at the
    window's start cancels out. The boundary only moves when the window does not end in an
    incomplete UTF-8 sequence ("\ufffd"), so text is never cut inside a character.
    """
    if tokenizer is None or not new_ids:
        return "", False
    end = req.num_output if end is None else end
    window, old = decoded or _decode_window(tokenizer, req, end)
    # else wait for the rest of the character; bounded, so that a model emitting invalid
    # UTF-8 for ever cannot make the window (and each step's decode) grow without limit
    if final or not window.endswith("\ufffd") or end - req.detok_read > DETOKENIZE_MAX_HOLD:
        req.text += window[len(old):]
        req.detok_prefix, req.detok_read = req.detok_read, end
    text, stops = req.text, req.params.stop
    hit = False
    if stops:
        idx = _find_stop(text, req.emitted, stops)
        if idx >= 0:
            text, hit, final = text[:idx], True, True
            req.text = text
    hold = 0 if final else max([len(s) - 1 for s in stops] + [0])
    upto = max(req.emitted, len(text) - hold)
    delta, req.emitted = text[req.emitted:upto], upto
    return delta, hit


class TextCommit(NamedTuple):
    delta: str        # text to stream now
    stop_hit: bool    # a stop string completed: the request ends here
    keep: int         # how many of the new tokens stay committed (all of them unless stop_hit)


def commit_text(tokenizer, req, new_ids: list[int], final: bool) -> TextCommit:
    """Detokenize the tokens one step committed (several after a verify step) and apply stops.

    req.output_ids already ends with new_ids. The result equals committing the tokens one per
    step (target-only decoding), which is the reference: when a stop string completes at
    new_ids[j], the request keeps new_ids[:j + 1] -- the token that completes the stop stays in
    `output_ids` (its text is cut at the stop, as target-only decoding keeps it), and the tokens
    after it, accepted drafts the client never sees, are removed from `req.output_ids`, so token
    ids and usage count what the text shows.

    Cost: one `detokenize` call; a stop string can only complete inside these tokens if it is in
    their decoded text, so the token-by-token replay runs only on the step that stops. A request
    that streams no text (`req.stream_text` False) and has no stop string is not decoded until
    its final tokens: then one window from the last boundary, which is the whole output.
    """
    n = len(new_ids)
    if tokenizer is None or not new_ids or not (final or req.stream_text or req.params.stop):
        return TextCommit("", False, n)     # (text not streamed: decoded once, when it finishes)
    if n == 1 or not req.params.stop:
        return TextCommit(*detokenize(tokenizer, req, new_ids, final), n)
    end = req.num_output
    decoded = _decode_window(tokenizer, req, end)
    window, old = decoded
    if _find_stop(req.text + window[len(old):], req.emitted, req.params.stop) < 0:
        return TextCommit(*detokenize(tokenizer, req, new_ids, final, decoded=decoded), n)
    start, deltas = end - n, []
    for j in range(1, n + 1):   # replay: what target-only decoding would have done, token by token
        delta, hit = detokenize(tokenizer, req, new_ids[j - 1:j], final and j == n, end=start + j)
        deltas.append(delta)
        if hit:
            req.truncate_output(start + j)
            return TextCommit("".join(deltas), True, j)
    return TextCommit("".join(deltas), False, n)


def _decode_window(tokenizer, req, end: int) -> tuple[str, str]:
    """The decode window with and without the tokens since the last boundary."""
    window = req.output_slice(req.detok_prefix, end)
    return tokenizer.decode(window), tokenizer.decode(window[:req.detok_read - req.detok_prefix])


def _find_stop(text: str, emitted: int, stops: list[str]) -> int:
    """Index of the first stop string in text, -1 if none. Earlier text was searched on earlier
    steps (text up to `emitted` holds no stop): look only where a new match can start."""
    start = max(0, emitted - max(len(s) for s in stops))
    return min((i for i in (text.find(s, start) for s in stops) if i >= 0), default=-1)
