"""Chunked prefill: the pause a long prompt puts into a request that is already streaming.

    PYTHONPATH=. python -m bench.prefill_gap --chunks 0,256,512 --long-tokens 7000 --threads 1

A chat request streams (greedy, SmolLM2-135M bf16 by default); after ``--lead`` of its tokens a
second request with a ``--long-tokens``-token prompt arrives. Reported per ``SpecConfig.
prefill_chunk`` (0: every prompt whole in one step): the streaming request's longest and median
gap between tokens while the long prompt is fed, the long request's time to its first token, and
whether both requests' tokens equal those of the first run (chunks are separate GEMMs, so a
half-precision prompt's K/V may round differently; speculative and plain decoding always feed a
prompt in the same chunks, so their agreement never depends on it). Writes a JSON.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.runner import write_json


def long_prompt(tokenizer, n: int) -> list[int]:
    """A ~n-token prompt of numbered notes to summarise."""
    text, i = "Summarize the following notes.", 0
    while len(tokenizer.encode(text)) < n:
        text += " " + " ".join(f"Item {j}: widget {j} weighs {j * 7 % 13} grams." for j in range(i, i + 50))
        i += 50
    return tokenizer.encode(text)[:n]


def run(llm, short_ids: list[int], long_ids: list[int], lead: int, max_tokens: int) -> dict:
    from specrt import SamplingParams

    eng = llm.engine
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    (sid,) = eng.add_requests([short_ids], [greedy])
    times, tokens, lid, t0 = [], {}, None, time.perf_counter()
    while eng.has_unfinished():
        outs = eng.step()
        now = time.perf_counter() - t0
        for o in outs:
            if o.request_id == sid and o.new_token_ids:
                times.append(now)
            if o.finished:
                tokens[o.request_id] = o.token_ids
        if lid is None and len(times) >= lead:
            (lid,) = eng.add_requests([long_ids], [SamplingParams(max_tokens=8, temperature=0.0)])
            arrived = now
        if lid is not None and lid not in tokens and any(o.request_id == lid and o.new_token_ids for o in outs):
            first = now - arrived
        if sid in tokens and lid in tokens:
            break
    during = [b - a for a, b in zip(times, times[1:]) if b > arrived and a < arrived + first]
    return {"max_gap_s": round(max(during, default=0.0), 4),
            "median_gap_ms": round(1e3 * statistics.median(during), 2) if during else None,
            "long_first_token_s": round(first, 3), "tokens": [tokens[sid], tokens[lid]]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--draft", default="none", help="a draft for the speculative runs ('none': plain decoding)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--chunks", default="0,256,512")
    ap.add_argument("--long-tokens", type=int, default=7000)
    ap.add_argument("--lead", type=int, default=8, help="streamed tokens before the long prompt arrives")
    ap.add_argument("--max-tokens", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import specrt
    from specrt import SpecConfig

    torch.set_num_threads(args.threads)
    rows, base = [], None
    for chunk in [int(c) for c in args.chunks.split(",")]:
        llm = specrt.LLM(target=args.target, draft=args.draft, dtype=getattr(torch, args.dtype),
                         spec=SpecConfig(prefill_chunk=chunk))
        tok = llm.tokenizer
        short = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a long story about a "
                                                     "robot who learns to paint, with many details."}]))
        r = run(llm, short, long_prompt(tok, args.long_tokens), args.lead, args.max_tokens)
        base = base or r["tokens"]
        r.update(chunk=chunk, same_tokens_as_first=r.pop("tokens") == base)
        rows.append(r)
        print(f"prefill_chunk {chunk:5d}: streaming request's longest gap {r['max_gap_s']:.3f} s, median "
              f"{r['median_gap_ms']} ms while the {args.long_tokens}-token prompt is fed; its first token after "
              f"{r['long_first_token_s']:.2f} s; same tokens {r['same_tokens_as_first']}", flush=True)
    if args.out:
        write_json({"args": vars(args), "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
