"""`specrt serve`: command line -> engine -> app -> uvicorn.

    specrt serve --target-model builtin --draft-model builtin --speculative-decoding --max-draft-length 5

On SIGTERM (or Ctrl-C) the app drains (see app.py): it stops admitting (503), gives the
requests in flight --drain-timeout seconds to finish, fails the rest with a final error
event (streams still end with `data: [DONE]`), then uvicorn exits. A second Ctrl-C exits at once.
Whatever still runs then (a parse, a stuck step, a thread), the process exits at the latest
HARD_EXIT_GRACE_S seconds after the drain time.

Connections (specrt.server.connections): a connection must send its request head within
--header-timeout seconds and is closed after --keep-alive-timeout idle seconds between requests;
idle connections make room for new ones (so /health and /metrics stay reachable), and one
client address holds at most --max-connections-per-client connections.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time

from specrt.server.connections import CONNECTION_HEADROOM, MIN_PER_CLIENT
from specrt.server.settings import DEFAULT_BODY_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, \
    DEFAULT_KEEP_ALIVE_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONNECTIONS, HARD_EXIT_GRACE_S, DeprecatedAlias, \
    parse_memory, read_prompts_file

logger = logging.getLogger("specrt.server")
INSTALL_HINT = 'pip install "specrt[serve]"'
# uvicorn waits this long past the drain time for the requests' tasks (the drain has failed
# what was left by then, so they end at once); the hard exit comes HARD_EXIT_GRACE_S after it
GRACEFUL_SHUTDOWN_EXTRA_S = 3


def _suffix_flags(draft: str | None, scoped: bool, history: int | None) -> str | None:
    """The draft string with --suffix-* folded into its suffix settings; ValueError if they are
    given without a suffix drafter (or a lookup after '+')."""
    if not scoped and history is None:
        return draft
    from specrt.drafters.spec import parse_draft

    extra = (["scoped=1"] if scoped else []) + ([f"global_tokens={history}"] if history is not None else [])
    spec = parse_draft(draft).with_suffix_settings(extra)
    if spec is None:
        raise ValueError(f"--suffix-scoped / --suffix-history-tokens need a suffix drafter "
                         f"(--draft-model suffix or MODEL+suffix), got {draft!r}")
    return spec.text


def build_parser() -> argparse.ArgumentParser:
    """The ``specrt serve`` command line: model, speculation, limits, auth and logging flags."""
    p = argparse.ArgumentParser(prog="specrt serve", description="OpenAI-compatible server for specrt.")
    p.add_argument("--target-model", required=True, help="HF model folder or 'builtin'")
    p.add_argument("--draft-model", default=None,
                   help="draft model folder, 'builtin', 'smollm2-135m-draft' (a reduced-vocabulary draft), 'ngram[:N[:M]]', "
                        "'self:N', 'suffix[:key=value,...]' (suffix drafting over each request's and earlier outputs), "
                        "or a draft model + a lookup 'MODEL+ngram' / 'MODEL+suffix' (used with --speculative-decoding)")
    p.add_argument("--suffix-scoped", action="store_true",
                   help="suffix drafting: one history per tenant (the request's OpenAI 'user' field); a request "
                        "never drafts from another tenant's outputs")
    p.add_argument("--suffix-history-tokens", type=int, default=None,
                   help="suffix drafting: tokens of earlier outputs kept (oldest evicted; 0: no shared history; "
                        "default 1,000,000, ~12 MB)")
    p.add_argument("--speculative-decoding", action="store_true",
                   help="decode speculatively with the draft (without it: plain autoregressive decoding)")
    p.add_argument("--max-draft-length", type=int, default=None,
                   help="the most draft tokens per request and step (SpecConfig.max_draft_length): K under "
                        "--draft-policy fixed, the cap of the adaptive policies, a token tree's depth (default: the "
                        "policy's, 4 fixed / budget, 8 confidence / head; 16 for suffix drafting)")
    p.add_argument("--draft-length", type=int, dest="max_draft_length", action=DeprecatedAlias,
                   new="--max-draft-length", help="deprecated spelling of --max-draft-length")
    p.add_argument("--min-draft-length", type=int, default=None,
                   help="the fewest draft tokens an adaptive policy drafts per step (SpecConfig.min_draft_length)")
    p.add_argument("--confidence-threshold", type=float, default=None,
                   help="stop threshold of the confidence / head policies (default 0.6)")
    p.add_argument("--acceptance-window", type=int, default=None,
                   help="drafted positions the adaptive threshold looks back over (default 100)")
    p.add_argument("--adaptive", dest="adaptive", action=argparse.BooleanOptionalAction, default=None,
                   help="adapt the stop threshold to each request's acceptance (with --draft-policy auto: "
                        "--adaptive picks the confidence policy)")
    p.add_argument("--draft-policy", default="auto", choices=["auto", "fixed", "confidence", "head", "budget"],
                   help="auto: confidence with --adaptive, else fixed")
    p.add_argument("--acceptance", default="rejection", choices=["rejection", "coupled"])
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=False,
                   help="pre-draft the next round while the target verifies")
    p.add_argument("--admission", default="fifo", choices=["fifo", "acceptance"],
                   help="when more requests wait than fit: first come first served, or group requests of "
                        "similar predicted acceptance (none waits more than 64 steps past its turn)")
    p.add_argument("--draft-kv-window", type=int, default=0,
                   help="long contexts: the draft attends to its first --draft-kv-sinks tokens plus the last N "
                        "(0: the whole context); the output stays exact")
    p.add_argument("--draft-kv-sinks", type=int, default=4)
    p.add_argument("--tree", default="auto", choices=["auto", "dynamic", "fixed", "chain"],
                   help="token trees: dynamic (sized per step by measured costs, off where they do not pay), "
                        "fixed (always --max-tree-nodes), chain; auto: dynamic where the drafter grows trees "
                        "(docs/trees.md)")
    p.add_argument("--max-tree-nodes", type=int, default=12, help="tree nodes per request and step (1..63)")
    p.add_argument("--tree-branching", type=int, default=4, help="children considered per expanded node")
    p.add_argument("--kv-cache-memory", default=None,
                   help="KV-cache budget: bytes ('2GiB', '512MB', '1000000') or a fraction of free device "
                        "memory ('0.5'); the log and /v1/models report how many tokens fit")
    p.add_argument("--warmup-prompts", default=None, metavar="FILE",
                   help="warm up (and calibrate the cost model) on typical prompts: a text file with one "
                        "prompt per line, or JSON lines of strings or {\"prompt\": ...}")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--prefill-chunk", type=int, default=None,
                   help="the most prompt tokens one step feeds (default 512): a longer prompt is fed over several "
                        "steps while other requests keep streaming; 0 feeds every prompt whole")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (also $SPECRT_API_KEY; an "
                                                   "empty key is refused, not taken as no key)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--target-quantize", default=None, choices=QUANT_CHOICES,
                   help="load the target with weight-only quantized layers that stay quantized")
    p.add_argument("--draft-quantize", default=None, choices=["auto", "none"] + QUANT_CHOICES,
                   help="the draft model's weight-only quantized layers (~1/4 (int8) to ~1/7 (q4) of fp32); default "
                        "auto: q8_0 with int8 activations on a CPU with AVX-512-VNNI, else none (full precision)")
    p.add_argument("--draft-dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"],
                   help="the draft model's dtype (default: --dtype)")
    p.add_argument("--int8-activations", action="store_true",
                   help="quantized layers quantize their inputs to int8 per block of 32, as llama.cpp does for "
                        "quantized weights (CPU; needs a quantized target, e.g. --target-quantize q4_1)")
    p.add_argument("--seed", type=int, default=None, help="seed for the seeds of unseeded requests")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
                   help="seconds a client has to send its whole request body (then 408, connection closed)")
    p.add_argument("--max-connections", type=int, default=DEFAULT_MAX_CONNECTIONS,
                   help="concurrent requests served; more get 503 (health and metrics are always served). Open "
                        f"connections are capped at this + {CONNECTION_HEADROOM}; idle ones are closed to make room "
                        "for new ones")
    p.add_argument("--max-connections-per-client", type=int, default=None,
                   help="open connections of one client address; beyond it that client's oldest idle connection "
                        f"is closed, or the new one refused (default: half of --max-connections, at least "
                        f"{MIN_PER_CLIENT})")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
                   help="seconds a connection has to send a complete request head (line and headers), from when it "
                        "opens or its previous response ends; then it is closed (408 if it had sent a part)")
    p.add_argument("--keep-alive-timeout", type=float, default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
                   help="seconds an idle keep-alive connection stays open between requests")
    p.add_argument("--allow-special-tokens-in-content", action="store_true",
                   help="tokenize special-token strings in chat messages ('<|im_end|>', '<|im_start|>system') as "
                        "the control tokens they name. Default: they are plain text, so a client cannot close its "
                        "turn and forge a system or assistant turn")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest prompt in characters, refused before tokenizing (default: 32 x max-model-len)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="on SIGTERM, seconds the requests in flight get to finish before they are failed")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads for the kernels (SpecConfig.threads; default: the physical cores this process "
                        "may run on). The engine drops to half of them while another process starves the pool")
    p.add_argument("--no-adaptive-threads", dest="adaptive_threads", action="store_false",
                   help="always run at --threads (SpecConfig.adaptive_threads=False)")
    p.add_argument("--lookup", default="suffix",
                   help="what drafts in front of a draft model where the history matches (SpecConfig.lookup): "
                        "'suffix[:key=value,...]' (default), 'ngram[:min[:max]]' or 'none'")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


QUANT_CHOICES = ["int8", "q8_0", "q4_0", "q4_1"]  # specrt.models.linear.KINDS (not imported: no torch here)


def engine_kwargs(args) -> dict:
    """argparse namespace -> LLMEngine arguments; raises ValueError with a clear message."""
    import torch

    from specrt.config import SpecConfig

    if args.tensor_parallel_size < 1:
        raise ValueError(f"--tensor-parallel-size must be >= 1, got {args.tensor_parallel_size}")
    draft = None
    if args.speculative_decoding:
        draft = args.draft_model
        if draft is None:
            if args.target_model != "builtin":
                raise ValueError("--speculative-decoding needs --draft-model "
                                 "(a folder, 'builtin', 'ngram' or 'self:N')")
            draft = "builtin"
    elif args.draft_model is not None:
        logger.warning("--draft-model is ignored without --speculative-decoding (serving plain decoding)")
    draft = _suffix_flags(draft, args.suffix_scoped, args.suffix_history_tokens)
    spec = SpecConfig(min_draft_length=args.min_draft_length, max_draft_length=args.max_draft_length,
                      confidence_threshold=args.confidence_threshold, acceptance_window=args.acceptance_window,
                      adaptive_enabled=args.adaptive, policy=args.draft_policy, acceptance=args.acceptance,
                      overlap=args.overlap, max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                      admission=args.admission, draft_kv_window=args.draft_kv_window,
                      draft_kv_sinks=args.draft_kv_sinks, tree=args.tree, max_tree_nodes=args.max_tree_nodes,
                      tree_branching=args.tree_branching, threads=args.threads,
                      adaptive_threads=args.adaptive_threads,
                      lookup=None if args.lookup in (None, "none") else args.lookup,
                      **({} if args.prefill_chunk is None else {"prefill_chunk": args.prefill_chunk}),
                      **({} if args.kv_cache_memory is None else
                         {"kv_cache_budget": parse_memory(args.kv_cache_memory, "--kv-cache-memory")}))
    dtype = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16,
             "float16": torch.float16}[args.dtype]
    kw = dict(target=args.target_model, draft=draft, spec=spec, device=args.device, dtype=dtype, seed=args.seed)
    for name in ("target_quantize", "draft_quantize", "draft_dtype"):  # only when given (LLMEngine options)
        if getattr(args, name, None) is not None:
            kw[name] = getattr(args, name)
    if kw.get("draft_quantize") == "auto":      # the engine's default
        del kw["draft_quantize"]
    elif kw.get("draft_quantize") == "none":    # a full-precision draft model
        kw["draft_quantize"] = None
    if getattr(args, "int8_activations", False):
        kw["int8_activations"] = True
    from specrt.drafters.spec import parse_draft

    if ("draft_quantize" in kw or "draft_dtype" in kw) and not parse_draft(draft).loads_model:
        raise ValueError("--draft-quantize / --draft-dtype need a draft model (--speculative-decoding with "
                         "--draft-model FOLDER or builtin)")
    return kw


def _check_args(args) -> str | None:
    if args.drain_timeout < 0:
        return f"--drain-timeout must be >= 0, got {args.drain_timeout}"
    for flag, value in (("--header-timeout", args.header_timeout), ("--keep-alive-timeout", args.keep_alive_timeout),
                        ("--body-timeout", args.body_timeout)):
        if not value > 0 or value == float("inf"):
            return f"{flag} must be a number of seconds > 0, got {value}"
    if args.max_connections < 1:
        return f"--max-connections must be >= 1, got {args.max_connections}"
    if args.max_connections_per_client is not None and args.max_connections_per_client < 1:
        return f"--max-connections-per-client must be >= 1, got {args.max_connections_per_client}"
    return None


def api_key_from(args, environ=os.environ) -> tuple[str | None, str | None]:
    """(the API key or None, a problem or None). --api-key wins over $SPECRT_API_KEY; an empty or
    blank one is an error (it used to turn authentication off without a word)."""
    if args.api_key is not None:
        key, source = args.api_key, "--api-key"
    elif "SPECRT_API_KEY" in environ:
        key, source = environ["SPECRT_API_KEY"], "$SPECRT_API_KEY"
    else:
        return None, None
    if not key.strip():
        return None, (f"{source} is empty; give a non-empty key, or leave {source} out to serve without "
                      "authentication")
    return key, None


def _missing_extras() -> str | None:
    """The name of a missing serve dependency, or None."""
    for name in ("fastapi", "uvicorn", "pydantic"):
        try:
            __import__(name)
        except ImportError:
            return name
    return None


def _build_app(args, api_key):
    """(app, engine we own or None); ValueError for bad arguments."""
    from specrt.server.app import create_app

    kw = engine_kwargs(args)
    warmup_prompts = read_prompts_file(args.warmup_prompts) if args.warmup_prompts else None
    options = {k: kw.pop(k) for k in ("target_quantize", "draft_quantize", "draft_dtype", "int8_activations")
               if k in kw}
    engine = built = None
    try:
        if args.tensor_parallel_size > 1:   # the server spawns its own workers: no external launcher
            from specrt.step.distributed import create_engine

            if options:
                raise ValueError(f"{', '.join('--' + k.replace('_', '-') for k in options)} not supported with "
                                 f"--tensor-parallel-size > 1")
            engine = create_engine(**kw, tensor_parallel_size=args.tensor_parallel_size)
        elif options:  # LLMEngine options create_app does not take: build the engine here
            from specrt.step.engine import LLMEngine

            built = LLMEngine(**kw, **options)
        given = engine or built
        app = create_app(given, **({"target": kw["target"]} if given is not None else kw),
                         model_name=args.served_model_name,
                         api_key=api_key, max_body_bytes=args.max_body_bytes, warmup=args.warmup,
                         body_timeout_s=args.body_timeout, max_connections=args.max_connections,
                         max_prompt_chars=args.max_prompt_chars, drain_timeout_s=args.drain_timeout,
                         warmup_prompts=warmup_prompts, header_timeout_s=args.header_timeout,
                         keep_alive_timeout_s=args.keep_alive_timeout,
                         max_connections_per_client=args.max_connections_per_client,
                         allow_special_tokens_in_content=args.allow_special_tokens_in_content)
    except ValueError:
        if engine is not None:
            engine.close()
        raise
    return app, engine


def _replayed_signal(signum, frame) -> None:
    """uvicorn re-raises the SIGTERM/SIGINT it handled once it has stopped; by then the server
    has drained and shut down, so main() returns (exit status 0) and closes the engine."""


def exit_watchdog(state, grace_s: float = HARD_EXIT_GRACE_S, poll_s: float = 0.2,
                  exit_fn=os._exit) -> threading.Event:
    """A daemon thread that ends the process (status 0) ``grace_s`` seconds after the drain time
    once a drain began (SIGTERM), if it is still alive then: a parse, a stuck engine step, a
    non-daemon thread or an exit handler cannot keep a stopping server up (issue 39).
    Returns the event that stops the watch (for a server that ends without a drain)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(poll_s):
            started = state.drain_started
            if started is not None and time.monotonic() >= started + state.settings.drain_timeout_s + grace_s:
                alive = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
                logger.warning("shutdown did not finish %.1f s after the drain time (threads still running: %s); "
                               "exiting now", grace_s, ", ".join(alive) or "none")
                for h in logging.getLogger().handlers + logger.handlers:
                    try:
                        h.flush()
                    except Exception:    # noqa: BLE001 - exiting anyway
                        pass
                sys.stdout.flush()
                sys.stderr.flush()
                exit_fn(0)
                return

    threading.Thread(target=watch, name="specrt-exit-watchdog", daemon=True).start()
    return stop


def _serve(app, args) -> None:
    import uvicorn

    from specrt.server.connections import uvicorn_options

    state = app.state.specrt
    main_thread = threading.current_thread() is threading.main_thread()
    saved = {sig: signal.signal(sig, _replayed_signal) for sig in (signal.SIGTERM, signal.SIGINT)} \
        if main_thread else {}
    watchdog = exit_watchdog(state) if main_thread else None
    try:
        # uvicorn waits this long for open requests after a signal; the app drains within it
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=math.ceil(args.drain_timeout) + GRACEFUL_SHUTDOWN_EXTRA_S,
                    access_log=args.log_level == "debug", **uvicorn_options(state.settings))
    finally:
        if watchdog is not None and state.drain_started is None:
            watchdog.set()        # ended without a drain (no signal): nothing to bound
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    """Run ``specrt serve`` until SIGTERM/SIGINT, then drain; returns the exit code (2: bad flags or
    a missing extra)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    missing = _missing_extras()
    if missing is not None:
        print(f"specrt serve: the server needs {missing}, which is not installed: {INSTALL_HINT}", file=sys.stderr)
        return 2
    api_key, key_problem = api_key_from(args)
    problem = "--max-body-bytes must be >= 1024" if args.max_body_bytes < 1024 else _check_args(args) or key_problem
    if problem:
        print(f"specrt serve: {problem}", file=sys.stderr)
        return 2
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    try:
        app, engine = _build_app(args, api_key)
    except ValueError as e:
        print(f"specrt serve: {e}", file=sys.stderr)
        return 2
    state = app.state.specrt
    eng = state.engine
    logger.info("engine ready in %.1fs (speculative=%s, draft=%s, K=%d, policy=%s, acceptance=%s); "
                "serving '%s' on http://%s:%d", time.perf_counter() - t0, eng.speculative, eng.draft_kind,
                eng.spec.max_draft_length, eng.spec.policy, eng.spec.acceptance, state.model_name,
                args.host, args.port)
    logger.info("KV cache: %d blocks of %d = %d tokens (all requests together; max_model_len %d)",
                eng.kv.num_blocks, eng.spec.block_size, eng.kv_cache_tokens, eng.max_model_len)
    if args.host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("binding to %s without --api-key: anyone who can reach this address can use the server",
                       args.host)
    try:
        _serve(app, args)
    finally:
        if engine is not None:
            engine.close()
    return 0
