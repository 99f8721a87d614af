"""``tollgate up`` end to end: real Postgres, Redis, engine, gateway, Celery worker and beat.

One platform is started (in a temporary data dir, on free ports) and taken through its life in one test,
step by step (subtests): health of every process, the env file, restarts of killed stateless children,
SIGTERM leaving nothing behind, then a second start at once, on the same ports, reusing the data and the
key: the connections the stopped servers closed first are still in TIME_WAIT then, and must not stop it.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import redis

from tests.e2e.platform_harness import read_env_file
from tests.polling import wait_until
from tollgate.commands.up import Endpoints, LocalPlatform
from tollgate.local_services import free_port
from tollgate.platform_children import PYTHON_M, engine_specs, service_specs
from tollgate.processes import pid_alive
from tollgate.settings import Settings
from tollgate.worker import beat_name, read_heartbeat, worker_name

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STARTUP_TIMEOUT_S = 240.0
UP_ENV = {
    "TOLLGATE_ENVIRONMENT": "test",
    "TOLLGATE_HEALTH_POLL_INTERVAL_S": "0.2",
    "TOLLGATE_HEARTBEAT_INTERVAL_S": "0.5",
    "TOLLGATE_BEAT_MAX_LOOP_INTERVAL_S": "0.5",
    "TOLLGATE_RESTART_BACKOFF_S": "0.2",
    "TOLLGATE_RESTART_BACKOFF_MAX_S": "1.0",
    "TOLLGATE_STOP_TIMEOUT_S": "10",
    "TOLLGATE_STARTUP_TIMEOUT_S": "180",
    "TOLLGATE_WORKER_CONCURRENCY": "1",
}
ENV_VARS = ("OPENAI_BASE_URL", "OPENAI_API_KEY", "TOLLGATE_DATABASE_URL", "TOLLGATE_REDIS_URL")


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    return {**env, **UP_ENV, **extra}


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


class UpProcess:
    def __init__(self, data_dir: Path, port: int, engine_port: int, *extra_args: str) -> None:
        self.data_dir, self.port, self.engine_port = data_dir, port, engine_port
        self.out = data_dir.parent / f"up-{time.monotonic_ns()}.out"
        with self.out.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tollgate",
                    "up",
                    "--data-dir",
                    str(data_dir),
                    "--port",
                    str(port),
                    "--engine-port",
                    str(engine_port),
                    *extra_args,
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                cwd=data_dir.parent,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def status(self) -> dict:
        try:
            return json.loads((self.data_dir / "run" / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def wait_for(self, condition, what: str, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Wait until ``condition()`` holds; fails at once if ``tollgate up`` exits meanwhile."""

        def reached() -> bool:
            if condition():
                return True
            if self.proc.poll() is not None:
                pytest.fail(
                    f"tollgate up exited ({self.proc.returncode}) waiting for {what}:\n{self.output()}"
                )
            return False

        try:
            wait_until(reached, what, timeout_s=timeout, interval_s=0.1)
        except AssertionError as exc:
            pytest.fail(f"{exc}:\n{self.output()}")

    def wait_ready(self) -> None:
        self.wait_for(
            lambda: (
                self.status().get("ready")
                and self.status().get("pid") == self.proc.pid
                and "tollgate is up" in self.output()
            ),
            "readiness",
        )

    def process(self, name: str) -> dict:
        return self.status()["processes"][name]

    def terminate(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


@pytest.fixture
def data_dir() -> Iterator[Path]:
    # Not under pytest's basetemp: every pytest session resets /tmp/pytest-of-<user> to 0700, which
    # would cut the postgres user off from a running cluster (see docs/operations.md).
    root = Path(tempfile.mkdtemp(prefix="tollgate-up-test-"))
    try:
        yield root / "data"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def check_every_process_answers_its_health_check(platform: UpProcess) -> None:
    processes = platform.status()["processes"]
    assert set(processes) == {"postgres", "redis", "engine", "gateway", "worker", "beat"}
    assert {p["state"] for p in processes.values()} == {"healthy"}
    gateway = httpx.get(f"http://127.0.0.1:{platform.port}/health", timeout=5)
    assert gateway.status_code == 200 and gateway.json()["status"] == "ok"
    assert httpx.get(f"http://127.0.0.1:{platform.engine_port}/health", timeout=5).status_code == 200
    env = read_env_file(platform.data_dir / "env")
    with psycopg.connect(env["TOLLGATE_DATABASE_URL"]) as conn:
        assert conn.execute("SELECT count(*) FROM tenants WHERE name = 'demo'").fetchone() == (1,)
    client = redis.Redis.from_url(env["TOLLGATE_REDIS_URL"])
    try:
        assert read_heartbeat(client, "worker", worker_name()) == processes["worker"]["pid"]
        assert read_heartbeat(client, "beat", beat_name()) == processes["beat"]["pid"]
        config = client.config_get("appendonly") | client.config_get("maxmemory-policy")
        assert config == {"appendonly": "yes", "maxmemory-policy": "noeviction"}
    finally:
        client.close()


def check_env_file_has_the_four_variables_and_a_working_key(platform: UpProcess) -> None:
    env_file = platform.data_dir / "env"
    assert env_file.stat().st_mode & 0o777 == 0o600
    env = read_env_file(env_file)
    assert set(ENV_VARS) <= env.keys()
    assert env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{platform.port}/v1"
    assert env["OPENAI_API_KEY"].startswith("sk-tg-")
    for line in env_file.read_text().splitlines()[1:]:
        assert line in platform.output()  # printed as well
    models = httpx.get(
        f"{env['OPENAI_BASE_URL']}/models",
        timeout=10,
        headers={"Authorization": f"Bearer {env['OPENAI_API_KEY']}"},
    )
    assert models.status_code == 200, models.text
    assert httpx.get(f"{env['OPENAI_BASE_URL']}/models", timeout=10).status_code == 401


def check_engine_demands_the_generated_internal_token(platform: UpProcess) -> None:
    state_file = platform.data_dir / "state.json"
    assert state_file.stat().st_mode & 0o777 == 0o600
    token = json.loads(state_file.read_text())["internal_token"]
    engine = f"http://127.0.0.1:{platform.engine_port}"
    assert len(token) >= 32 and token not in platform.output()
    assert httpx.get(f"{engine}/load", timeout=5).status_code == 401
    authorized = httpx.get(f"{engine}/load", timeout=5, headers={"Authorization": f"Bearer {token}"})
    assert authorized.status_code == 200
    env = read_env_file(platform.data_dir / "env")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    answer = httpx.post(f"{env['OPENAI_BASE_URL']}/chat/completions", json=body, timeout=60,
                        headers={"Authorization": f"Bearer {env['OPENAI_API_KEY']}"})
    assert answer.status_code == 200, answer.text  # the gateway holds the engine's token


def check_killed_stateless_child_is_reported_and_restarted(platform: UpProcess, name: str) -> None:
    before = platform.process(name)
    os.kill(before["pid"], signal.SIGKILL)
    platform.wait_for(
        lambda: (
            platform.process(name)["restarts"] == before["restarts"] + 1
            and platform.process(name)["state"] == "healthy"
        ),
        f"{name} to restart",
        timeout=120,
    )
    assert platform.process(name)["pid"] != before["pid"]
    assert f"{name} (pid {before['pid']}) was killed by SIGKILL" in platform.output()
    if name == "gateway":
        assert httpx.get(f"http://127.0.0.1:{platform.port}/health", timeout=5).status_code == 200


def time_wait_local_ports() -> set[int]:
    """The local ports of this machine's IPv4 and IPv6 TCP connections in TIME_WAIT (Linux's /proc)."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "06":  # TCP_TIME_WAIT
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def check_sigterm_stops_every_process(platform: UpProcess) -> None:
    tree = descendants(platform.proc.pid)
    assert len(tree) >= 6
    # A client holding a kept-alive connection when the platform stops, as an SDK does: the gateway closes
    # it first, which leaves it in TIME_WAIT on the gateway's port (the gateway's pooled connections to
    # the engine do the same on the engine's port).
    env = read_env_file(platform.data_dir / "env")
    with httpx.Client(base_url=env["OPENAI_BASE_URL"], timeout=10,
                      headers={"Authorization": f"Bearer {env['OPENAI_API_KEY']}"}) as client:
        assert client.get("/models").status_code == 200
        assert platform.terminate() == 0
    wait_until(lambda: not any(pid_alive(pid) for pid in tree), "every process of the platform to be gone",
               interval_s=0.1)
    for port in (platform.port, platform.engine_port):
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    assert "tollgate up: stopped" in platform.output()


def check_second_up_at_once_on_the_same_ports_reuses_the_data_and_the_key(first: UpProcess) -> None:
    data_dir = first.data_dir
    first_key = read_env_file(data_dir / "env")["OPENAI_API_KEY"]
    state = json.loads((data_dir / "state.json").read_text())
    # What made this restart fail for a minute: the stopped servers' connections linger in TIME_WAIT.
    assert time_wait_local_ports() & {first.port, first.engine_port}
    again = UpProcess(data_dir, first.port, first.engine_port)
    try:
        again.wait_ready()
        env = read_env_file(data_dir / "env")
        assert env["OPENAI_API_KEY"] == first_key
        assert env["OPENAI_BASE_URL"] == f"http://127.0.0.1:{first.port}/v1"
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi again"}], "max_tokens": 2}
        answer = httpx.post(f"{env['OPENAI_BASE_URL']}/chat/completions", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {first_key}"})
        assert answer.status_code == 200, answer.text
        again_state = json.loads((data_dir / "state.json").read_text())
        assert again_state["postgres"]["password"] == state["postgres"]["password"]
        assert again_state["internal_token"] == state["internal_token"]
        assert "created the demo tenant" not in again.output()
        with psycopg.connect(env["TOLLGATE_DATABASE_URL"]) as conn:
            assert conn.execute("SELECT count(*) FROM api_keys").fetchone() == (1,)
    finally:
        assert again.terminate() == 0


def test_up_runs_supervises_and_stops_the_platform(data_dir, subtests):
    # One platform for every step, in order, inside one test: each start costs tens of seconds, and no
    # test distribution (xdist) can split the steps or reorder them. Two gateway workers, as production
    # runs it: every one of their processes must be stopped too.
    up = UpProcess(data_dir, free_port(), free_port(), "--workers", "2")
    try:
        up.wait_ready()
        with subtests.test(msg="every process answers its health check"):
            check_every_process_answers_its_health_check(up)
        with subtests.test(msg="the env file has the four variables and a working key"):
            check_env_file_has_the_four_variables_and_a_working_key(up)
        with subtests.test(msg="the engine demands the internal token that up generated"):
            check_engine_demands_the_generated_internal_token(up)
        for name in ("worker", "gateway"):
            with subtests.test(msg=f"a killed {name} is reported and restarted"):
                check_killed_stateless_child_is_reported_and_restarted(up, name)
        with subtests.test(msg="SIGTERM stops every process"):
            check_sigterm_stops_every_process(up)
    finally:
        if up.proc.poll() is None:
            up.terminate()
    with subtests.test(msg="a second start at once on the same ports reuses the data and the key"):
        check_second_up_at_once_on_the_same_ports_reuses_the_data_and_the_key(up)


def run_refused_up(tmp_path: Path, *args: str, env: dict[str, str] | None = None
                   ) -> subprocess.CompletedProcess[str]:
    """``tollgate up --data-dir tmp_path/d ARGS`` in ``tmp_path``, for an up that must exit at once."""
    return subprocess.run(
        [sys.executable, "-m", "tollgate", "up", "--data-dir", str(tmp_path / "d"), *args],
        capture_output=True,
        text=True,
        env=clean_env() if env is None else env,
        cwd=tmp_path,
        timeout=60,
    )


def test_missing_server_binaries_give_an_install_command(tmp_path):
    env = clean_env(
        TOLLGATE_POSTGRES_BIN_DIR=str(tmp_path / "no-pg"),
        TOLLGATE_REDIS_SERVER_BIN=str(tmp_path / "no-redis-server"),
    )
    result = run_refused_up(tmp_path, env=env)
    assert result.returncode != 0
    assert "apt-get install postgresql redis-server" in result.stderr
    assert not (tmp_path / "d" / "postgres").exists()


def test_busy_gateway_port_is_refused_before_starting_anything(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = run_refused_up(tmp_path, "--port", str(port))
    assert result.returncode == 1
    assert f"port {port} for the gateway is in use" in result.stderr
    assert not (tmp_path / "d" / "postgres").exists()


def test_a_second_up_on_a_busy_data_dir_is_refused(tmp_path):
    run_dir = tmp_path / "d" / "run"
    run_dir.mkdir(parents=True)
    with open(run_dir / "up.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write("4242")
        held.flush()
        result = run_refused_up(tmp_path, "--port", str(free_port()))
    assert result.returncode == 1
    assert "another `tollgate up` (pid 4242) is running" in result.stderr


def test_several_engine_replicas_get_their_own_ports_logs_and_disk_tiers(tmp_path):
    platform = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=None,
                             with_engine=True, gateway_workers=1, engine_replicas=2)
    data = (tmp_path / "data").resolve()
    assert platform._engines() == [("engine-0", 9100, data / "kv"), ("engine-1", 9101, data / "kv-1")]
    env = platform._child_env(Endpoints("postgresql://db", "redis://r"), "t" * 32)
    assert json.loads(env["TOLLGATE_POOLS"]) == {
        "interactive": {"replicas": ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]}}
    one = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=None,
                        with_engine=True, gateway_workers=1)
    assert one._engines() == [("engine", 9100, data / "kv")]


def test_engine_replicas_split_the_model_over_the_configured_ranks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    settings = Settings(engine_tensor_parallel_size=2)
    platform = LocalPlatform(settings, tmp_path / "data", port=8000, engine_port=9100, model=model,
                             with_engine=True, gateway_workers=1, engine_replicas=2)
    specs = engine_specs(platform._layout(), platform._model_dir()[1], {})
    assert [spec.name for spec in specs] == ["engine-0", "engine-1"]
    for spec in specs:
        argv = spec.argv
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
        assert argv[argv.index("--model") + 1] == str(model.resolve())


def test_prefill_and_decode_replicas_split_the_model_over_the_configured_ranks(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    platform = LocalPlatform(Settings(engine_tensor_parallel_size=2), tmp_path / "data", port=8000,
                             engine_port=9100, model=model, with_engine=True, gateway_workers=1,
                             engine_replicas=1, prefill_replicas=1)
    specs = {spec.name: spec.argv for spec in engine_specs(platform._layout(), model, {})}
    assert {name: (argv[argv.index("--role") + 1], argv[argv.index("--tensor-parallel-size") + 1])
            for name, argv in specs.items()} == {"engine": ("decode", "2"), "prefill-0": ("prefill", "2")}


def test_children_ignore_a_folder_named_like_their_package_where_up_started(tmp_path):
    """``tollgate up`` started beside a folder named ``tollgate`` (the parent of a clone, a data directory)
    must not run its children from it: ``python -m`` would put the current directory first on ``sys.path``
    and import the folder as the package. Every child runs its module with ``-P``."""
    for name in ("tollgate", "celery"):  # e.g. another checkout, or a data directory
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("raise ImportError('not the installed package')\n")
    shadowed = subprocess.run([sys.executable, "-m", "tollgate", "--help"], cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)
    assert shadowed.returncode != 0  # what a child without -P met
    platform = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=tmp_path,
                             with_engine=True, gateway_workers=1)
    layout = platform._layout()
    children = [*engine_specs(layout, tmp_path, {}), *service_specs(layout, {}, heartbeat_client=None)]
    assert {spec.name for spec in children} >= {"engine", "gateway", "worker", "beat"}
    for spec in children:
        assert spec.argv[:3] == [*PYTHON_M] == [sys.executable, "-P", "-m"], spec.argv
        assert spec.name not in ("worker", "beat") or spec.cwd == layout.run_dir
    ran = subprocess.run([*PYTHON_M, "tollgate", "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert ran.returncode == 0, ran.stderr


def test_prefill_replicas_start_beside_decode_replicas_and_form_the_prefill_pool(tmp_path):
    """``tollgate up --prefill-replicas 2 --decode-replicas 1``: the engine replica decodes, the prefill
    replicas prefill, on the ports after it, and the gateway's pools say which is which."""
    model = tmp_path / "model"
    model.mkdir()
    platform = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=model,
                             with_engine=True, gateway_workers=1, engine_replicas=1, prefill_replicas=2)
    layout = platform._layout()
    specs = {spec.name: spec.argv for spec in engine_specs(layout, model, {})}
    assert list(specs) == ["engine", "prefill-0", "prefill-1"]
    roles = {name: argv[argv.index("--role") + 1] for name, argv in specs.items()}
    assert roles == {"engine": "decode", "prefill-0": "prefill", "prefill-1": "prefill"}
    ports = {name: argv[argv.index("--port") + 1] for name, argv in specs.items()}
    assert ports == {"engine": "9100", "prefill-0": "9101", "prefill-1": "9102"}
    assert len({argv[argv.index("--kv-disk-dir") + 1] for argv in specs.values()}) == 3
    assert layout.pools() == {"interactive": {"replicas": ["http://127.0.0.1:9100"]},
                              "prefill": {"replicas": ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]}}
    colocated = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=model,
                              with_engine=True, gateway_workers=1)
    assert all("--role" not in spec.argv for spec in engine_specs(colocated._layout(), model, {}))


def test_engines_read_the_adapter_store_of_the_data_dir_up_was_given(tmp_path):
    """``tollgate up --data-dir D``: the gateway child stores adapters under D (its TOLLGATE_DATA_DIR), so
    the engines read them there, not under the settings' default data dir."""
    model = tmp_path / "model"
    model.mkdir()
    platform = LocalPlatform(Settings(), tmp_path / "data", port=8000, engine_port=9100, model=model,
                             with_engine=True, gateway_workers=1)
    [spec] = engine_specs(platform._layout(), model, {})
    assert spec.argv[spec.argv.index("--lora-dir") + 1] == str((tmp_path / "data" / "adapters").resolve())
