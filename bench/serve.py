"""Load benchmark of `specrt serve`: concurrency 1, 4, 16, 64, speculation on and off.

    python bench/serve.py --quick --out bench/results/serve            # built-in pair (if present)
    python bench/serve.py --tiny --quick --out /tmp/serve-bench          # a tiny random pair it creates
    python bench/serve.py --target-model T --draft-model D --concurrency 1,8

For each mode (speculative, autoregressive) it starts the server as a subprocess on a free
loopback port (warm-up happens before the port opens; we wait for /health), then for each
concurrency level sends the same prompts as streaming completions (greedy, ignore_eos so
every request emits exactly --max-tokens tokens) with at most `c` in flight, and measures
requests/s, output tokens/s, end-to-end latency and time to first token (p50/p90/p99).
Greedy outputs of the two modes are compared token by token (they must be identical).
Bounded: a fixed number of requests per level and a wall-clock cap per level.
Writes serve.json and serve.md into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


def _prompts(n: int, tiny: bool, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    if not tiny:
        try:
            from specrt.training.corpus import heldout_prompts

            got = [t for _, t in heldout_prompts(n)]
            if got:
                return (got * (n // len(got) + 1))[:n]
        except Exception:   # the corpus helper is optional: fall back to synthetic code prompts
            pass
        return [f"def function_{i}(x, y):\n    \"\"\"Return the {rng.choice(['sum', 'product', 'maximum'])} "
                f"of x and y.\"\"\"\n" for i in range(n)]
    return [" ".join(f"w{rng.randint(3, 95)}" for _ in range(rng.randint(4, 24))) for _ in range(n)]


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, ready_timeout: float):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "w")
        cmd = [sys.executable, "-m", "specrt.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--log-level", "warning", *args]
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT))
        t0 = time.time()
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() - t0 > ready_timeout:
                self.close()
                raise RuntimeError(f"the server was not ready after {ready_timeout:.0f}s; see {log_path}")
            time.sleep(0.25)
        self.startup_s = time.time() - t0
        self.model = httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.log.close()


async def _one(client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, temperature: float,
               seed: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "specrt": {"return_token_ids": True, "tag": "bench"}}
    t0 = time.perf_counter()
    ttft = None
    ids: list[int] = []
    usage, stats = None, {}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            ev = json.loads(data)
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev["choices"]:
                if ch.get("token_ids"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    ids += ch["token_ids"]
            if ev.get("specrt"):
                stats = ev["specrt"]
    latency = time.perf_counter() - t0
    return {"latency": latency, "ttft": ttft if ttft is not None else latency, "ids": ids,
            "completion_tokens": usage["completion_tokens"] if usage else len(ids),
            "tau": stats.get("tokens_per_target_forward", 1.0)}


async def _level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, temperature: float,
                 time_cap: float) -> dict:
    sem = asyncio.Semaphore(concurrency)
    results: list[dict | None] = [None] * len(prompts)
    deadline = time.perf_counter() + time_cap
    skipped = 0

    async def run(i: int, client):
        nonlocal skipped
        async with sem:
            if time.perf_counter() > deadline:
                skipped += 1
                return
            results[i] = await _one(client, model, prompts[i], max_tokens, temperature, seed=1000 + i)

    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=max(60.0, time_cap * 2), limits=limits) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(run(i, client) for i in range(len(prompts))))
        wall = time.perf_counter() - t0
    done = [r for r in results if r is not None]
    lat = [r["latency"] for r in done]
    ttft = [r["ttft"] for r in done]
    toks = sum(r["completion_tokens"] for r in done)
    return {
        "concurrency": concurrency, "requests": len(done), "skipped_after_time_cap": skipped,
        "wall_s": wall, "requests_per_s": len(done) / wall, "output_tokens_per_s": toks / wall,
        "latency_p50_s": _pct(lat, 50), "latency_p90_s": _pct(lat, 90), "latency_p99_s": _pct(lat, 99),
        "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90), "ttft_p99_s": _pct(ttft, 99),
        "mean_tokens_per_target_forward": sum(r["tau"] for r in done) / max(len(done), 1),
        "_ids": {i: r["ids"] for i, r in enumerate(results) if r is not None},
    }


def _markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [f"# specrt serve load benchmark ({report['date']})", "",
             f"target `{cfg['target_model']}`, draft `{cfg['draft_model']}`, K={cfg['draft_length']}, "
             f"max_tokens={cfg['max_tokens']}, temperature={cfg['temperature']}, streaming, loopback; "
             f"machine: {report['machine']}", "",
             "| mode | conc | reqs | req/s | out tok/s | p50 s | p90 s | p99 s | TTFT p50 s | TTFT p99 s | tok/fwd |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for mode, levels in report["results"].items():
        for r in levels:
            lines.append(f"| {mode} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']:.2f} | "
                         f"{r['output_tokens_per_s']:.1f} | {r['latency_p50_s']:.3f} | {r['latency_p90_s']:.3f} | "
                         f"{r['latency_p99_s']:.3f} | {r['ttft_p50_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                         f"{r['mean_tokens_per_target_forward']:.2f} |")
    if "speedup" in report:
        lines += ["", "speculative / autoregressive output tokens/s: " +
                  ", ".join(f"c={c}: {s:.2f}x" for c, s in report["speedup"].items())]
    if report.get("greedy_outputs_identical") is not None:
        lines.append(f"greedy outputs identical across modes: {'yes' if report['greedy_outputs_identical'] else 'NO'}")
    return "\n".join(lines) + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target-model", default=None, help="default: 'builtin' when the built-in pair exists")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--tiny", action="store_true", help="create and serve a tiny random pair (tests/_engine_utils)")
    p.add_argument("--concurrency", default="1,4,16,64")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per level (default max(8, 2c); quick: max(4, c))")
    p.add_argument("--max-tokens", type=int, default=None, help="default 64 (quick: 32)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--draft-length", type=int, default=4)
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--modes", default="speculative,autoregressive")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--time-cap", type=float, default=None, help="seconds per level (default 120; quick: 45)")
    p.add_argument("--ready-timeout", type=float, default=600)
    p.add_argument("--threads", type=int, default=None, help="server torch threads")
    p.add_argument("--device", default=None)
    p.add_argument("--server-arg", action="append", default=[], help="extra `specrt serve` argument (repeatable)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "serve"))
    return p


def _models(args, p: argparse.ArgumentParser):
    """(target, draft, temporary folder to clean up or None) from the arguments."""
    tmp = None
    target, draft = args.target_model, args.draft_model
    if args.tiny:
        sys.path.insert(0, str(ROOT / "tests"))
        from _engine_utils import make_pair

        tmp = tempfile.TemporaryDirectory(prefix="specrt-serve-bench-")
        tdir, ddir = make_pair(Path(tmp.name))
        target, draft = str(tdir), str(ddir)
    if target is None:
        if (ROOT / "specrt" / "builtin" / "target" / "config.json").is_file():
            target, draft = "builtin", draft or "builtin"
        else:
            p.error("the built-in pair is not installed: pass --target-model/--draft-model or --tiny")
    if draft is None and target == "builtin":
        draft = "builtin"
    if draft is None:
        p.error("--draft-model is needed for the speculative mode")
    return target, draft, tmp


def _requests_at(args, c: int) -> int:
    return args.requests or (max(4, c) if args.quick else max(8, 2 * c))


def _run_mode(args, srv: "ServerProcess", mode: str, levels: list[int], prompts: list[str], max_tokens: int,
              time_cap: float, ids: dict) -> list[dict]:
    """Every concurrency level against one server; each request's token ids into ``ids``."""
    res = []
    for c in levels:
        r = asyncio.run(_level(srv.url, srv.model, prompts[:_requests_at(args, c)], c, max_tokens,
                               args.temperature, time_cap))
        ids.update({(c, i): v for i, v in r.pop("_ids").items()})
        res.append(r)
        print(f"[{mode}] c={c:<3} {r['requests']:>3} reqs  {r['requests_per_s']:.2f} req/s  "
              f"{r['output_tokens_per_s']:.1f} tok/s  p50 {r['latency_p50_s']:.3f}s  "
              f"p99 {r['latency_p99_s']:.3f}s  TTFT p50 {r['ttft_p50_s']:.3f}s", flush=True)
    return res


def _compare_modes(report: dict, ids_by_mode: dict, levels: list[int], temperature: float) -> None:
    """Speculative / autoregressive tokens/s per level, and (greedy) whether outputs agree."""
    if not {"speculative", "autoregressive"} <= set(report["results"]):
        return
    spec = {r["concurrency"]: r for r in report["results"]["speculative"]}
    ar = {r["concurrency"]: r for r in report["results"]["autoregressive"]}
    report["speedup"] = {c: spec[c]["output_tokens_per_s"] / ar[c]["output_tokens_per_s"]
                         for c in levels if c in spec and c in ar and ar[c]["output_tokens_per_s"] > 0}
    if temperature == 0:
        a, b = ids_by_mode["speculative"], ids_by_mode["autoregressive"]
        common_keys = set(a) & set(b)
        report["greedy_outputs_identical"] = all(a[k] == b[k] for k in common_keys)
        report["greedy_outputs_compared"] = len(common_keys)


def main(argv: list[str] | None = None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft, tmp = _models(args, p)
    levels = [int(c) for c in args.concurrency.split(",")]
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    time_cap = args.time_cap or (45.0 if args.quick else 120.0)
    prompts_all = _prompts(max(_requests_at(args, c) for c in levels), tiny=args.tiny)
    common = ["--target-model", target, "--max-batch-size", str(args.max_batch_size), "--seed", "0",
              *args.server_arg]
    if args.threads:
        common += ["--threads", str(args.threads)]
    if args.device:
        common += ["--device", args.device]
    mode_args = {"speculative": ["--speculative-decoding", "--draft-model", draft, "--max-draft-length",
                                 str(args.draft_length)],
                 "autoregressive": []}
    report = {"date": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, "
              f"{args.device or 'default device'}",
              "config": {"target_model": "tiny random pair" if args.tiny else target,
                         "draft_model": "tiny random pair (layer-init)" if args.tiny else draft,
                         "draft_length": args.draft_length, "max_tokens": max_tokens, "temperature": args.temperature,
                         "concurrency": levels, "quick": args.quick, "time_cap_s": time_cap},
              "results": {}}
    ids_by_mode = {}
    try:
        for mode in args.modes.split(","):
            srv = ServerProcess(common + mode_args[mode], out / f"server-{mode}.log", args.ready_timeout)
            print(f"[{mode}] server ready in {srv.startup_s:.1f}s at {srv.url}", flush=True)
            try:
                ids_by_mode[mode] = {}
                report["results"][mode] = _run_mode(args, srv, mode, levels, prompts_all, max_tokens, time_cap,
                                                    ids_by_mode[mode])
                report.setdefault("server_metrics", {})[mode] = [
                    ln for ln in srv.metrics().splitlines()
                    if ln.startswith(("specrt_tokens_per_target_forward{tag=", "specrt_acceptance_rate{tag="))]
            finally:
                srv.close()
    finally:
        if tmp is not None:
            tmp.cleanup()
    _compare_modes(report, ids_by_mode, levels, args.temperature)
    (out / "serve.json").write_text(json.dumps(report, indent=2, default=str))
    md = _markdown(report)
    (out / "serve.md").write_text(md)
    print("\n" + md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
