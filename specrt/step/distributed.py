"""Tensor-parallel serving: one driver, N ranks, each running the same LLMEngine step.

    engine = create_engine(target, draft, spec, tensor_parallel_size=2)   # LLMEngine when N == 1
    rid = engine.add_request("def fib(n):", SamplingParams(max_tokens=32))
    while engine.has_unfinished():
        outs = engine.step()
    engine.close()

``TPEngine`` runs rank 0 in this process and spawns ranks 1..N-1 itself (torch.multiprocessing
"spawn", rendezvous on 127.0.0.1 and a free port; no external launcher). Every rank owns a
``RankEngine`` — an LLMEngine whose model loader hook shards the TARGET over the N ranks
(specrt.models.tp: column/row-parallel linears, vocabulary-parallel embedding and head, the
logit shards all-gathered so every rank holds the full logits) and gives it a per-rank KV
cache (this rank's kv heads only). The DRAFT model is replicated on every rank (it is small:
sharding it would add 2 all_reduces per layer per draft step, which costs more than it saves).

What is broadcast (rank 0 -> all, one ``broadcast_object_list`` per step on a gloo group):
the requests added since the last step WITH THEIR RESOLVED SEEDS and request ids, and the
aborts, in the order they happened; then every rank runs the same ``LLMEngine.step()``.
Why the ranks agree without broadcasting tokens: their engines hold identical state
(same requests, same seeds, same KV block allocation: the block count is agreed as the
minimum over ranks at start-up), the target's logits are all-gathered so they are
identical on every rank, the replicated draft computes identical numbers (same code, same
thread count), and every random number is a pure function of (seed, position, purpose,
index) — so every rank drafts, accepts and emits the same tokens. Two safety nets: the
"budget" draft policy decides K from measured (per-rank) timings, so rank 0's K are
broadcast for it; and each step command carries a digest of rank 0's previous outputs,
which every worker checks against its own (a divergence stops the worker with a clear error
instead of silently desynchronising the collectives).

Lifetime: workers are daemon processes, watch their parent, and exit on ``close()`` (also
registered with atexit). Collectives time out after ``timeout_s``; a dead or failed rank
turns into a RuntimeError on the driver, never a hang. One TPEngine per process at a time
(rank 0 uses the default torch.distributed process group).
"""
from __future__ import annotations

import atexit
import dataclasses
import datetime
import os
import sys
import threading
import time
import traceback
import zlib

import torch
import torch.distributed as dist

from specrt.config import SpecConfig
from specrt.models import ModelConfig, load_model
from specrt.models.attention import AttentionMetadata
from specrt.models.kv_cache import allocate_kv_cache
from specrt.models.sources import resolve_model_path
from specrt.models.tp import check_tp_divisible, shard_model_
from specrt.step.engine import LLMEngine

__all__ = ["TPEngine", "create_engine"]

_IDLE_TIMEOUT = datetime.timedelta(days=365)   # workers wait for the next step command this long


def create_engine(target, draft=None, spec: SpecConfig | None = None, device=None, dtype=None,
                  seed: int | None = None, tensor_parallel_size: int = 1, **options):
    """An LLMEngine when ``tensor_parallel_size == 1`` (no processes, no cost; ``options`` are its
    keyword hooks), else a TPEngine (``options``: timeout_s, num_threads)."""
    if not isinstance(tensor_parallel_size, int) or tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tensor_parallel_size!r}")
    if tensor_parallel_size == 1:
        return LLMEngine(target, draft, spec, device, dtype, seed, **options)
    return TPEngine(target, draft, spec, device, dtype, seed, tensor_parallel_size=tensor_parallel_size,
                    **options)


def _rank_device(device, rank: int) -> torch.device:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


@dataclasses.dataclass
class RankEngine:
    """One rank's LLMEngine (the target sharded for (tp_rank, tp_size), the draft replicated)."""

    engine: LLMEngine
    tp_rank: int
    tp_size: int
    ctrl: object            # the gloo group the control messages use

    @staticmethod
    def build(target, draft, spec, device, dtype, seed, *, tp_rank: int, tp_size: int, ctrl_group) -> "RankEngine":
        def load(path, role, dtype, device):
            # the target reads only this rank's slices of the checkpoint (memory ~ 1/N); the draft is replicated
            return load_model(path, dtype=dtype, device=device, tp=(tp_rank, tp_size, None) if role == "target" else None)

        def rank0_ks(ks: list[int]) -> list[int]:   # K from per-rank timings: every rank uses rank 0's
            obj = [ks if tp_rank == 0 else None]
            dist.broadcast_object_list(obj, src=0, group=ctrl_group)
            return obj[0]
        spec = spec or SpecConfig()
        engine = LLMEngine(target, draft, spec, device, dtype, seed, model_loader=load,
                           agree_ks=rank0_ks if spec.policy == "budget" else None)
        return RankEngine(engine, tp_rank, tp_size, ctrl_group)

    def agree_num_blocks(self) -> None:
        """Every rank must allocate (and so preempt) identically: use the minimum block count."""
        n = torch.tensor([self.engine.kv.num_blocks], dtype=torch.int64)
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=self.ctrl)
        if int(n) != self.engine.kv.num_blocks:
            self.engine.resize_kv_cache(int(n))


def _digest(outs) -> int:
    """Deterministic (not Python's salted hash) digest of one step's outputs."""
    return zlib.crc32(repr([(o.request_id, o.new_token_ids, o.finished, o.finish_reason) for o in outs]).encode())


def prefill_logits(model, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Logits [T, V] (on the host) of one prefill of ``token_ids`` through ``model`` on a scratch cache."""
    T, dev = len(token_ids), model.device
    nb = -(-T // block_size)
    cache = allocate_kv_cache(model.config, nb, block_size, model.dtype, dev)
    meta = AttentionMetadata.build([T], [T], [list(range(nb))], block_size, dev)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=dev)
    logits, _ = model(ids, torch.arange(T, device=dev), meta, cache)
    return logits.cpu()


def _calibrate(rank: RankEngine, args: tuple, kwargs: dict) -> None:
    rank.engine.calibrate(*args, **kwargs)


def _probe_forward(rank: RankEngine, token_ids: list[int], model_path=None) -> torch.Tensor:
    """Full logits of a prefill through the sharded target (or through ``model_path`` loaded and
    sharded the same way on every rank: a test of the sharding itself)."""
    engine = rank.engine
    model = engine.target
    if model_path is not None:
        if rank.tp_rank == 0:   # also the post-hoc path: full load, then shard_model_ in place
            model = shard_model_(load_model(model_path, device=engine.device), 0, rank.tp_size)
        else:
            model = load_model(model_path, device=engine.device, tp=(rank.tp_rank, rank.tp_size, None))
    return prefill_logits(model, token_ids, engine.spec.block_size)


def _apply_ops(engine: LLMEngine, ops: list) -> None:
    for op in ops:
        if op[0] == "add":
            _, prompt, params, rid, tag = op
            engine.add_request(prompt, params, request_id=rid, tag=tag)
        else:
            engine.abort_request(op[1])


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(3)   # orphaned: the driver is gone


def _worker_main(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float,
                 engine_args: tuple, num_threads: int, parent_pid: int, conn) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    torch.set_num_threads(num_threads)
    conn.send(("alive", None))   # imports done: the driver may now join the rendezvous
    try:
        host, port = init_method.removeprefix("tcp://").rsplit(":", 1)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, int(port), world_size, False, timeout=timeout)   # rank 0's, already listening
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        ctrl = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
        target, draft, spec, device, dtype, seed = engine_args
        device = _rank_device(device, rank)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        rank_engine = RankEngine.build(target, draft, spec, device, dtype, seed, tp_rank=rank, tp_size=world_size,
                                       ctrl_group=ctrl)
        engine = rank_engine.engine
    except BaseException:  # noqa: BLE001 - report any start-up failure to the driver
        conn.send(("error", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("ready", None))
    try:
        rank_engine.agree_num_blocks()
        last = None
        while True:
            obj = [None]
            dist.broadcast_object_list(obj, src=0, group=ctrl)
            cmd = obj[0]
            if cmd[0] == "stop":
                break
            if cmd[0] == "step":
                _, ops, digest = cmd
                if digest != last:
                    raise RuntimeError(f"tensor-parallel rank {rank} diverged from rank 0 (its last step's "
                                       f"outputs differ): the ranks no longer compute identical numbers")
                _apply_ops(engine, ops)
                last = _digest(engine.step())
            elif cmd[0] == "call":
                _, fn, args = cmd
                fn(rank_engine, *args)
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - die loudly: the peers' collectives then fail instead of hanging
        sys.stderr.write(f"[specrt tp rank {rank}] {traceback.format_exc()}")
        sys.stderr.flush()
        os._exit(1)
    conn.close()


class TPEngine:
    """LLMEngine interface over ``tensor_parallel_size`` ranks (see the module docstring).

    add_request / abort_request act on rank 0 immediately (validation errors raise here,
    nothing is queued) and are replayed on the workers at the next ``step()``; ``step()``
    returns rank 0's outputs. Every other attribute (tokenizer, kv, spec, max_model_len,
    eos_token_ids, vocab_size, speculative, draft_kind, metrics, ...) is rank 0's engine's.
    """

    def __init__(self, target, draft=None, spec: SpecConfig | None = None, device=None, dtype=None,
                 seed: int | None = None, tensor_parallel_size: int = 2, timeout_s: float = 300.0,
                 num_threads: int | None = None):
        N = tensor_parallel_size
        if not isinstance(N, int) or N < 2:
            raise ValueError(f"TPEngine needs tensor_parallel_size >= 2, got {N!r} (use LLMEngine for 1)")
        target_path = resolve_model_path(target, "target")
        check_tp_divisible(ModelConfig.from_json(target_path / "config.json"), N)   # before spawning anything
        dev = _rank_device(device, 0)
        if dev.type == "cuda" and torch.cuda.device_count() < (dev.index or 0) + N:
            raise ValueError(f"tensor_parallel_size={N} needs {N} CUDA devices from {dev}, "
                             f"found {torch.cuda.device_count()}")
        if dist.is_initialized():
            raise RuntimeError("a torch.distributed process group already exists in this process: "
                               "one TPEngine per process (close() the previous one)")
        self.tensor_parallel_size = N
        self._lock = threading.RLock()
        self._ops: list = []
        self._digest = None
        self._closed = False
        self._broken: str | None = None
        self._workers: list = []
        self._conns: list = []
        self._engine = None
        backend = "nccl" if dev.type == "cuda" else "gloo"
        if backend == "gloo":
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")   # loopback only
        # rank 0's rendezvous store listens before any worker exists, on a port the OS picks as it
        # binds (a port probed free and bound later could be taken in between: EADDRINUSE)
        self._store = dist.TCPStore("127.0.0.1", 0, N, True, timeout=datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        init_method = f"tcp://127.0.0.1:{self._store.port}"
        threads = num_threads or torch.get_num_threads()
        engine_args = (target, draft, spec, device, dtype, seed)
        ctx = torch.multiprocessing.get_context("spawn")
        try:
            for rank in range(1, N):
                parent_conn, child_conn = ctx.Pipe(duplex=False)
                p = ctx.Process(target=_worker_main, name=f"specrt-tp-rank{rank}", daemon=True,
                                args=(rank, N, init_method, backend, timeout_s, engine_args, threads,
                                      os.getpid(), child_conn))
                p.start()
                child_conn.close()
                self._workers.append(p)
                self._conns.append(parent_conn)
            atexit.register(self.close)
            self._expect("alive", timeout_s)   # a worker that cannot even import fails fast, not at the timeout
            dist.init_process_group(backend, store=self._store, rank=0, world_size=N,
                                    timeout=datetime.timedelta(seconds=timeout_s))
            self._ctrl = dist.new_group(backend="gloo", timeout=_IDLE_TIMEOUT)
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            self._rank = RankEngine.build(target, draft, spec, dev, dtype, seed, tp_rank=0, tp_size=N,
                                          ctrl_group=self._ctrl)
            self._engine = self._rank.engine
            self._expect("ready", timeout_s)
            self._rank.agree_num_blocks()
        except BaseException:
            self._broken = "start-up failed"
            self.close()
            raise

    def _expect(self, want: str, timeout_s: float) -> None:
        """Wait for every worker's start-up message ``want``; RuntimeError with its traceback on failure."""
        deadline = time.monotonic() + timeout_s
        for rank, (p, conn) in enumerate(zip(self._workers, self._conns), start=1):
            while not conn.poll(0.1):
                if not p.is_alive() or time.monotonic() > deadline:
                    hint = (" — spawned workers re-import the __main__ module: a script must create the engine "
                            "under `if __name__ == '__main__':`") if want == "alive" else ""
                    raise RuntimeError(f"tensor-parallel rank {rank} did not start "
                                       f"({'exit code ' + str(p.exitcode) if not p.is_alive() else 'timed out'})"
                                       f"{hint}")
            kind, info = conn.recv()
            if kind != want:
                raise RuntimeError(f"tensor-parallel rank {rank} failed to start:\n{info}")

    # ------------------------------------------------------------------ plumbing
    def _check(self) -> None:
        if self._closed:
            raise RuntimeError("this TPEngine is closed")
        if self._broken:
            raise RuntimeError(f"this TPEngine is unusable: {self._broken}")

    def _broadcast(self, cmd) -> None:
        try:
            dist.broadcast_object_list([cmd], src=0, group=self._ctrl)
        except BaseException as e:
            self._fail(e)
            raise

    def _fail(self, e: BaseException) -> None:
        dead = [f"rank {i} (exit code {p.exitcode})" for i, p in enumerate(self._workers, 1) if not p.is_alive()]
        self._broken = f"{type(e).__name__}: {e}" + (f"; dead workers: {', '.join(dead)}" if dead else "")
        self._kill_workers()

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        for p in self._workers:
            p.join(grace_s)
            if p.is_alive():
                p.terminate()
                p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)

    # ------------------------------------------------------------------ LLMEngine interface
    def add_request(self, prompt, params=None, request_id: str | None = None, tag: str = "default",
                    tenant: str | None = None) -> str:
        return self.add_requests([prompt], [params], [tag], [request_id], [tenant])[0]

    def add_requests(self, prompts, params, tags=None, request_ids=None, tenants=None) -> list[str]:
        """LLMEngine.add_requests: all validated on rank 0 before any is queued, then replayed
        (the tenant only matters to rank 0's drafter)."""
        with self._lock:
            self._check()
            rids = self._engine.add_requests(prompts, params, tags, request_ids, tenants)
            for rid in rids:
                req = self._engine.scheduler.requests[rid]
                self._ops.append(("add", req.prompt if req.prompt is not None else req.prompt_token_ids,
                                  dataclasses.replace(req.params, seed=req.seed), rid, req.tag))
            return rids

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._check()
            self._engine.abort_request(request_id)
            self._ops.append(("abort", request_id))

    def step(self):
        with self._lock:
            self._check()
            ops, self._ops = self._ops, []
            self._broadcast(("step", ops, self._digest))
            try:
                outs = self._engine.step()
            except BaseException as e:
                self._fail(e)
                raise
            self._digest = _digest(outs)
            return outs

    def has_unfinished(self) -> bool:
        return self._engine.has_unfinished()

    def num_free_blocks(self) -> int:
        return self._engine.num_free_blocks()

    @property
    def metrics(self):
        return self._engine.metrics

    @metrics.setter
    def metrics(self, value) -> None:
        self._engine.metrics = value

    def __getattr__(self, name: str):
        engine = self.__dict__.get("_engine")
        if engine is None:
            raise AttributeError(name)
        return getattr(engine, name)

    # ------------------------------------------------------------------ extras
    def run_on_all_ranks(self, fn, *args):
        """Run the picklable ``fn(rank: RankEngine, *args)`` on every rank (it may use collectives);
        returns rank 0's result."""
        with self._lock:
            self._check()
            self._broadcast(("call", fn, args))
            try:
                return fn(self._rank, *args)
            except BaseException as e:
                self._fail(e)
                raise

    def calibrate(self, *args, **kwargs) -> None:
        """LLMEngine.calibrate on every rank in lockstep (its steps run the sharded forwards'
        collectives; rank 0 alone would hang)."""
        self.run_on_all_ranks(_calibrate, args, kwargs)

    def forward_logits(self, token_ids: list[int], model_path=None) -> torch.Tensor:
        """Full-vocabulary logits [T, V] of one prefill of ``token_ids`` through the sharded target
        (or through the model at ``model_path``, loaded and sharded on every rank for this call)."""
        return self.run_on_all_ranks(_probe_forward, list(token_ids),
                                     None if model_path is None else str(model_path))

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._workers]

    def close(self) -> None:
        """Stop the workers (gracefully if possible) and tear down the process group. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                atexit.unregister(self.close)
            except Exception:  # noqa: BLE001
                pass
            graceful = self._broken is None and self._engine is not None and all(p.is_alive() for p in self._workers)
            if graceful:
                try:
                    dist.broadcast_object_list([("stop",)], src=0, group=self._ctrl)
                except BaseException:  # noqa: BLE001 - fall through to terminate
                    graceful = False
            self._kill_workers(grace_s=10.0 if graceful else 0.0)
            for c in self._conns:
                c.close()
            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except BaseException:  # noqa: BLE001
                    pass
            self._store = None                 # its listening socket closes with it

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
