"""What the gateway costs: added latency in front of an instant engine, and the RPS one worker sustains.

Set-up (all real processes, started here): a private Postgres and Redis (``tollgate.local_services``,
fsync off), the synthetic engine with zero delay (``ttft_s = token_interval_s = 0``: every token is
ready at once, so what is measured is HTTP + gateway work), and ``tollgate gateway --workers 1`` with
auth, admission (the tenant has RPM and TPM limits, so the whole Lua script runs) and metering (usage
record to the Redis outbox) on. Each request is a chat completion of 16 tokens from a ~20-token prompt.

Method: an open-loop load generator (requests start on a fixed schedule whatever the answers do, so a
slow server cannot slow the offered load down) in a *separate process*, so the generator's CPU is not
the gateway's. The generator is a lean HTTP/1.1 client on asyncio (uvloop when installed): keep-alive
connections (a new one whenever none is idle, so nothing queues client-side), each request one
pre-encoded write, responses parsed by httptools (chunked or not). Until 2026-11-22 it was an asyncio
``httpx`` client, which itself used ~2 ms of CPU per request: on this 2-core box that starved the gateway
and the engine it was measuring (the JSON's ``generator_cpu_ms_per_request`` says what it costs now,
~0.15-0.25 ms). Latency is measured per request from its send (its task starts at its scheduled time;
``max_lag_s`` reports lateness) to its last byte (a stream: the chunked terminator after
``data: [DONE]``), connection set-up included.
1. Added latency at ``--rate`` (100 RPS): the same schedule against the engine's ``/generate`` directly
   (the same prompt tokens) and through the gateway; the difference of the p50s and of the p99s.
2. Highest sustained RPS: rates stepped up until errors reach 1% or p99 exceeds 1 s (or the generator
   falls behind its schedule by more than 10%), non-streamed and streamed.
Both for chat completions non-streamed and streamed, and for ``/v1/responses`` streamed (typed events,
stored at its end as by default, and with ``store: false``), against the same engine-direct baseline.

3. ``--tracing``: instead, the gateway's CPU per request and latency with OpenTelemetry off and on
   (traces and the GenAI metrics, which the same OTLP endpoint turns on), side by side in one run (chat
   non-streamed and streamed at ``--rate``): two platforms, the second with ``OTEL_EXPORTER_OTLP_ENDPOINT``
   on the gateway and the engine pointing at an OTLP/HTTP sink in this process (every batch really sent
   and answered 200).

``python benchmarks/gateway_overhead.py --out benchmarks/out/gateway_overhead.json`` prints a table and
writes JSON. ``--profile`` runs py-spy on the gateway worker during the 100 RPS step and prints where
the time goes. ``Platform`` is reused by ``benchmarks/noisy_neighbor.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import format_table, write_json  # noqa: E402

MODEL = "synthetic"
MAX_TOKENS = 16
MESSAGES = [{"role": "user", "content": "Benchmark the gateway with this short prompt, please."}]
ERROR_LIMIT = 0.01
P99_LIMIT_S = 1.0


# ----------------------------------------------------------------------------- the platform


@dataclass
class Platform:
    """Postgres, Redis, engine replicas and a gateway, started by ``platform()``."""

    root: Path
    database_url: str
    redis_url: str
    engine_urls: list[str]
    gateway_url: str
    gateway_pid: int
    tokenizer_dir: Path
    tenant_ids: dict[str, int] = field(default_factory=dict)  # API key -> tenant id

    @property
    def engine_url(self) -> str:
        return self.engine_urls[0]

    def create_tenant_key(self, **tenant_columns: Any) -> str:
        """A committed tenant (with these columns) and an API key for it."""
        from tests.factories import create_api_key, create_tenant
        from tollgate.db import Database

        async def main() -> str:
            db = Database(self.database_url, pool_size=1)
            try:
                async with db.session() as session:
                    tenant = await create_tenant(session, **tenant_columns)
                    key = (await create_api_key(session, tenant))[1]
                    self.tenant_ids[key] = tenant.id
                    return key
            finally:
                await db.dispose()

        return asyncio.run(main())

    def engine_counters(self, name: str) -> list[float]:
        """One counter of each replica's ``/metrics`` (0 where it has none yet)."""
        import httpx

        values = []
        for url in self.engine_urls:
            text = httpx.get(f"{url}/metrics", timeout=10).text
            match = re.search(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE)
            values.append(float(match.group(1)) if match else 0.0)
        return values

    def usage_records(self) -> list[Any]:
        """Every usage record in the outbox (nothing flushes it here)."""
        import redis

        from billing.outbox import RECORD_FIELD, USAGE_STREAM, UsageRecord

        client = redis.Redis.from_url(self.redis_url)
        try:
            return [UsageRecord.from_json(f[RECORD_FIELD]) for _, f in client.xrange(USAGE_STREAM)]
        finally:
            client.close()

    def prompt_token_ids(self) -> list[int]:
        from engine.tokenizer import Tokenizer

        return Tokenizer.from_pretrained(self.tokenizer_dir).encode_chat(MESSAGES)


@contextlib.contextmanager
def platform(*, real_engine_args: list[str] | None = None, engine_extra: dict[str, float] | None = None,
             model: str = MODEL, gateway_env: dict[str, str] | None = None,
             engine_env: dict[str, str] | None = None, replicas: int = 1,
             gateway_workers: int = 1, checkpoint: Callable[[Path], Path] | None = None
             ) -> Iterator[Platform]:
    """Start everything in a temporary directory; stop everything at exit.

    The engine is the synthetic one with ``engine_extra`` timings, unless ``real_engine_args`` is given:
    then ``tollgate engine --model <tiny checkpoint> <real_engine_args>`` (the real CPU engine), as
    ``replicas`` replicas of the interactive pool (``{root}`` in an argument is the platform's directory,
    ``{replica}`` the replica's number). ``checkpoint`` writes the model into the directory it is given
    (default: the tiny random-weight Llama)."""
    from engine.tiny import create_tiny_checkpoint
    from tests.factories import create_price
    from tollgate import schema
    from tollgate.db import Database
    from tollgate.local_services import (
        POSTGRES_STOP_SIGNAL,
        LocalPostgres,
        LocalRedis,
        find_server_binaries,
        free_port,
    )
    from tollgate.processes import spawn, stop, wait_http_ok
    from tollgate.settings import Settings

    root = Path(tempfile.mkdtemp(prefix="tollgate-bench-"))
    os.chmod(root, 0o755)  # the postgres user must reach its directory
    procs: list[tuple[subprocess.Popen[bytes], int]] = []
    try:
        binaries = find_server_binaries(Settings())
        pg = LocalPostgres(root / "pg", binaries.postgres_bin_dir, port=free_port(),
                           password=secrets.token_hex(8), durable=False)
        pg.prepare()
        rd = LocalRedis(root / "redis", binaries.redis_server, port=free_port(),
                        password=secrets.token_hex(8), durable=False)
        rd.prepare()
        pg_proc = spawn(pg.argv(), log_path=pg.log_path, user=pg.user, cwd=pg.root)
        procs.append((pg_proc, POSTGRES_STOP_SIGNAL))
        rd_proc = spawn(rd.argv(), log_path=rd.log_path)
        procs.append((rd_proc, 15))
        pg.wait_ready(pg_proc, 60)
        rd.wait_ready(rd_proc, 60)
        pg.create_database("tollgate")
        database_url = pg.url("tollgate")
        schema.upgrade(database_url)

        async def price() -> None:
            db = Database(database_url, pool_size=1)
            try:
                async with db.session() as session:
                    await create_price(session, model=model)
            finally:
                await db.dispose()

        asyncio.run(price())
        tiny = (checkpoint or (lambda d: create_tiny_checkpoint(d, arch="llama", seed=0)))(root / "tiny")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TOLLGATE_", "PROMETHEUS_"))}
        env["PYTHONUNBUFFERED"] = "1"
        engine_urls = []
        for number in range(replicas):
            engine_port = free_port()
            if real_engine_args is None:
                extra = engine_extra or {"token_interval_s": 0.0, "ttft_s": 0.0}
                code = (f"from engine.server import serve; serve('synthetic', port={engine_port}, "
                        f"model_name={model!r}, extra={extra!r})")
                argv = [sys.executable, "-c", code]
            else:
                args = [a.format(root=root, replica=number) for a in real_engine_args]
                argv = [sys.executable, "-m", "tollgate", "engine", "--model", str(tiny),
                        "--model-name", model, "--port", str(engine_port), *args]
            engine_log = root / f"engine{number}.log"
            engine = spawn(argv, log_path=engine_log, env={**env, **(engine_env or {})})
            procs.append((engine, 15))
            engine_urls.append(f"http://127.0.0.1:{engine_port}")
            wait_http_ok(f"{engine_urls[-1]}/health", engine, engine_log, 120.0)

        tiers = {name: {"engine_priority": prio, "ttft_slo_ms": 600_000, "tpot_slo_ms": 60_000, "rank": rank}
                 for name, prio, rank in (("priority", 0, 3), ("default", 1, 2), ("flex", 2, 1))}
        gw_port = free_port()
        gw_env = {**env, "TOLLGATE_ENVIRONMENT": "test", "TOLLGATE_DATABASE_URL": database_url,
                  "TOLLGATE_REDIS_URL": rd.url(0), "TOLLGATE_TIERS": json.dumps(tiers),
                  "TOLLGATE_MODELS": json.dumps([{"name": model, "path": str(tiny)}]),
                  "TOLLGATE_POOLS": json.dumps({"interactive": {"replicas": engine_urls}}),
                  "TOLLGATE_KEY_CACHE_TTL_S": "60", **(gateway_env or {})}
        gw_log = root / "gateway.log"
        gateway = spawn([sys.executable, "-m", "tollgate", "gateway", "--port", str(gw_port),
                         "--workers", str(gateway_workers)], log_path=gw_log, env=gw_env)
        procs.append((gateway, 15))
        gateway_url = f"http://127.0.0.1:{gw_port}"
        wait_http_ok(f"{gateway_url}/health", gateway, gw_log, 120.0)
        yield Platform(root, database_url, rd.url(0), engine_urls, gateway_url, gateway.pid, tiny)
    finally:
        for proc, sig in reversed(procs):
            stop(proc, sig=sig, timeout=20)
        shutil.rmtree(root, ignore_errors=True)


# ----------------------------------------------------------------------------- the load generator


@dataclass
class LoadSpec:
    url: str
    body: dict[str, Any]
    headers: dict[str, str]
    rate: float
    duration_s: float
    stream: bool
    engine_direct: bool = False


def _load_process(spec: LoadSpec, out: Any) -> None:
    """Child process: run the open-loop schedule, send back (latencies, errors, lag)."""
    try:
        import uvloop

        result = uvloop.run(_load(spec))
    except ImportError:
        result = asyncio.run(_load(spec))
    out.send(result)
    out.close()


class _ClientConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection of the load generator: a request is one pre-encoded write;
    the response is parsed by httptools (chunked or not) and ends at its last byte."""

    def __init__(self, idle: list[_ClientConnection]) -> None:
        import httptools

        self.idle = idle
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[int] | None = None
        self.closed = False

    @classmethod
    async def checkout(cls, idle: list[_ClientConnection], host: str, port: int) -> _ClientConnection:
        """An open idle connection from ``idle`` (the pool it returns to), else a new one of ``cls``."""
        while idle:
            conn = idle.pop()
            if not conn.closed:
                return conn
        conn = cls(idle)
        await asyncio.get_running_loop().create_connection(lambda: conn, host, port)
        return conn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except Exception as exc:  # a broken response: the request failed
            self._finish(exc)
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._finish(exc or ConnectionResetError("closed by the server"))

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        keep = self.parser.should_keep_alive()
        done = self.done
        self.done = None
        if keep and not self.closed:
            self.idle.append(self)
        else:
            self.close()
        if done is not None and not done.done():
            done.set_result(status)

    def _finish(self, exc: BaseException) -> None:
        done, self.done = self.done, None
        if done is not None and not done.done():
            done.set_exception(exc)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def request(self, data: bytes) -> asyncio.Future[int]:
        assert self.transport is not None
        self.done = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.done


def _encode_request(url: str, body: dict[str, Any], headers: dict[str, str]) -> tuple[str, int, bytes]:
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    payload = json.dumps(body).encode()
    head = [f"POST {parts.path} HTTP/1.1", f"host: {parts.hostname}:{parts.port}",
            "content-type: application/json", f"content-length: {len(payload)}",
            *(f"{k}: {v}" for k, v in headers.items())]
    data = ("\r\n".join(head) + "\r\n\r\n").encode() + payload
    return parts.hostname or "127.0.0.1", parts.port or 80, data


async def _load(spec: LoadSpec) -> dict[str, Any]:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    lags: list[float] = []
    idle: list[_ClientConnection] = []
    host, port, template = _encode_request(spec.url, spec.body, spec.headers)
    if spec.engine_direct:  # every engine request needs its own request id: encode those up front
        requests = [_encode_request(spec.url, {**spec.body, "request_id": uuid.uuid4().hex}, spec.headers)[2]
                    for _ in range(int(spec.rate * spec.duration_s))]
    cpu_started = time.process_time()

    async def one(i: int) -> None:
        data = requests[i] if spec.engine_direct else template
        started = time.perf_counter()
        try:
            conn = await _ClientConnection.checkout(idle, host, port)
            status = await asyncio.wait_for(conn.request(data), 30.0)
            if status != 200:
                errors[str(status)] = errors.get(str(status), 0) + 1
                return
        except (OSError, TimeoutError, ValueError) as exc:
            errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            return
        latencies.append(time.perf_counter() - started)

    total = int(spec.rate * spec.duration_s)
    start = time.perf_counter() + 0.2
    tasks = []
    for i in range(total):
        due = start + i / spec.rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        else:
            lags.append(-delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    for conn in idle:
        conn.close()
    return {"latencies": latencies, "errors": errors, "sent": total,
            "max_lag_s": max(lags, default=0.0), "late_fraction": len(lags) / max(1, total),
            "generator_cpu_ms_per_request": 1000 * (time.process_time() - cpu_started) / max(1, total)}


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds a process has used (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_load(spec: LoadSpec, measured_pid: int | None = None) -> dict[str, Any]:
    """Run one step in a separate process; with ``measured_pid``, also the CPU that process spent per
    successful request (steady on a shared machine, unlike latencies)."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_load_process, args=(spec, child))
    cpu_before = process_cpu_s(measured_pid) if measured_pid else 0.0
    proc.start()
    result = parent.recv()
    proc.join()
    if measured_pid:
        result["cpu_ms_per_request"] = 1000 * (process_cpu_s(measured_pid) - cpu_before) / max(
            1, len(result["latencies"]))
    lat = sorted(result["latencies"])
    failed = sum(result["errors"].values())
    result.update(
        ok=len(lat), error_rate=failed / max(1, result["sent"]),
        p50_ms=1000 * statistics.median(lat) if lat else float("nan"),
        p99_ms=1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan"),
    )
    del result["latencies"]
    return result


def sustained(result: dict[str, Any]) -> bool:
    return (result["error_rate"] < ERROR_LIMIT and result["p99_ms"] <= 1000 * P99_LIMIT_S
            and result["late_fraction"] < 0.1)  # the generator kept its schedule


# ----------------------------------------------------------------------------- main


@contextlib.contextmanager
def otlp_sink() -> Iterator[tuple[str, list[int]]]:
    """An OTLP/HTTP endpoint that accepts every export (200, an empty protobuf answer) and counts the bytes
    of each; yields its base URL and that list."""
    import http.server
    import threading

    received: list[int] = []

    class Sink(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            received.append(len(self.rfile.read(int(self.headers.get("Content-Length", 0)))))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", received
    finally:
        server.shutdown()


def tracing_comparison(args: argparse.Namespace) -> None:
    """The gateway with tracing off and on, side by side (see the module docstring, 3)."""
    rows, results = [], {}
    with otlp_sink() as (endpoint, received):
        traced = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_BSP_SCHEDULE_DELAY": "500"}
        for label, env in (("off", None), ("on", traced)):
            with platform(gateway_env=env, engine_env=env) as p:
                key = p.create_tenant_key(rpm_limit=10**9, tpm_limit=10**12)
                headers = {"Authorization": f"Bearer {key}"}
                chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
                run_load(LoadSpec(f"{p.gateway_url}/v1/chat/completions", chat, headers, 50, 2, False))
                modes = (("non-stream", chat, False), ("stream", {**chat, "stream": True}, True))
                for mode, body, stream in modes:
                    step = run_load(LoadSpec(f"{p.gateway_url}/v1/chat/completions", body, headers, args.rate,
                                             args.duration, stream), measured_pid=p.gateway_pid)
                    results[f"{mode}, tracing {label}"] = step
                    rows.append([mode, label, f"{step['p50_ms']:.2f} / {step['p99_ms']:.2f}",
                                 f"{step['error_rate']:.1%}", f"{step['cpu_ms_per_request']:.3f}"])
        results["exported_batches"], results["exported_bytes"] = len(received), sum(received)
    print(format_table(["mode", "tracing", f"p50/p99 ms @{args.rate:.0f} RPS", "errors",
                        "gateway CPU ms/req"], rows))
    print(f"exported: {results['exported_batches']} OTLP batches, {results['exported_bytes']} bytes")
    if args.out:
        results.update(rate=args.rate, duration_s=args.duration, machine=f"{os.cpu_count()}-core CPU",
                       load_average=os.getloadavg(), date=datetime.now(UTC).isoformat(timespec="seconds"))
        write_json(args.out, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0, help="RPS of the added-latency comparison")
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per load step")
    parser.add_argument("--rates", default="100,200,300,400,500,600,800,1000",
                        help="RPS steps of the sustained-throughput search")
    parser.add_argument("--profile", action="store_true", help="py-spy the gateway during the --rate step")
    parser.add_argument("--tracing", action="store_true",
                        help="compare the gateway with OpenTelemetry tracing off and on instead")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.tracing:
        tracing_comparison(args)
        return
    rates = [float(r) for r in args.rates.split(",")]

    with platform() as p:
        key = p.create_tenant_key(rpm_limit=10**9, tpm_limit=10**12)
        headers = {"Authorization": f"Bearer {key}"}
        chat = {"model": MODEL, "messages": MESSAGES, "max_tokens": MAX_TOKENS}
        direct = {"prompt_token_ids": p.prompt_token_ids(), "max_tokens": MAX_TOKENS, "tenant": "bench"}
        # Warm up both paths (connections, caches, the price book).
        run_load(LoadSpec(f"{p.gateway_url}/v1/chat/completions", chat, headers, 50, 2, False))
        results: dict[str, Any] = {"rate": args.rate, "duration_s": args.duration, "latency": {},
                                   "search": {}}
        rows = []
        responses = {"model": MODEL, "input": MESSAGES[0]["content"], "max_output_tokens": MAX_TOKENS,
                     "stream": True}
        # (mode, path, body, streamed): chat both ways, and the Responses API streamed (stored, as by
        # default: its row is written when it ends).
        modes = [("non-stream", "/v1/chat/completions", chat, False),
                 ("stream", "/v1/chat/completions", {**chat, "stream": True}, True),
                 ("responses-stream", "/v1/responses", responses, True),
                 ("responses-stream, store=false", "/v1/responses", {**responses, "store": False}, True)]
        run_load(LoadSpec(f"{p.gateway_url}/v1/responses", responses, headers, 50, 2, True))  # warm up
        for mode, path, body, stream in modes:
            base = run_load(LoadSpec(f"{p.engine_url}/generate", direct, {}, args.rate, args.duration, stream,
                                     engine_direct=True))
            profiler = _start_profile(p, args, mode) if args.profile else None
            through = run_load(LoadSpec(f"{p.gateway_url}{path}", body, headers, args.rate,
                                        args.duration, stream), measured_pid=p.gateway_pid)
            if profiler is not None:
                _finish_profile(profiler)
            results["latency"][mode] = {"engine_direct": base, "gateway": through,
                                        "added_p50_ms": through["p50_ms"] - base["p50_ms"],
                                        "added_p99_ms": through["p99_ms"] - base["p99_ms"]}
            best, steps = 0.0, []
            for rate in rates:
                step = run_load(LoadSpec(f"{p.gateway_url}{path}", body, headers, rate,
                                         min(args.duration, 5.0), stream))
                steps.append({"rate": rate, **step})
                if not sustained(step):
                    break
                best = rate
            results["search"][mode] = {"sustained_rps": best, "steps": steps}
            litellm = 15 if stream else 45
            rows.append([mode, f"{base['p50_ms']:.2f} / {base['p99_ms']:.2f}",
                         f"{through['p50_ms']:.2f} / {through['p99_ms']:.2f}",
                         f"{results['latency'][mode]['added_p50_ms']:.2f} / "
                         f"{results['latency'][mode]['added_p99_ms']:.2f}",
                         f"{through['error_rate']:.1%}", f"{through['cpu_ms_per_request']:.2f}",
                         f"{1000 / through['cpu_ms_per_request']:.0f}", f"{best:.0f}",
                         f"{best / litellm:.1f}x"])
    print(format_table(["mode", f"engine direct p50/p99 ms @{args.rate:.0f} RPS",
                        "through gateway p50/p99 ms", "added p50/p99 ms", "errors", "gateway CPU ms/req",
                        "RPS per core (CPU bound)", "sustained RPS (1 worker)", "vs LiteLLM (45 / 15 RPS)"],
                       rows))
    for mode, search in results["search"].items():
        print(f"{mode} steps: " + ", ".join(
            f"{s['rate']:.0f} RPS -> p99 {s['p99_ms']:.0f} ms, err {s['error_rate']:.1%}, "
            f"lag {s['max_lag_s']:.2f}s" for s in search["steps"]))
    if args.out:
        results.update(machine=f"{os.cpu_count()}-core CPU", load_average=os.getloadavg(),
                       date=datetime.now(UTC).isoformat(timespec="seconds"))
        write_json(args.out, results)


def _start_profile(p: Platform, args: argparse.Namespace, mode: str) -> subprocess.Popen[bytes] | None:
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        print("py-spy is not installed (pip install py-spy): no profile", file=sys.stderr)
        return None
    out = (args.out.parent if args.out else Path(".")) / f"gateway_profile_{mode}.txt"
    return subprocess.Popen([py_spy, "record", "--pid", str(p.gateway_pid), "--format", "raw", "--output",
                             str(out), "--duration", str(int(args.duration) + 1), "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _finish_profile(proc: subprocess.Popen[bytes]) -> None:
    proc.wait(timeout=120)


if __name__ == "__main__":
    main()
