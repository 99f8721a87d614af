"""Private Postgres and Redis servers run from the installed binaries (``tollgate up`` and the tests).

Invariants:
- Binaries are found in this order: the configured path (``TOLLGATE_POSTGRES_BIN_DIR``,
  ``TOLLGATE_REDIS_SERVER_BIN``), the newest ``/usr/lib/postgresql/*/bin``, then ``PATH``. When one is
  missing, ``MissingServerBinaries`` says exactly what to install.
- Servers listen on 127.0.0.1 only, on TCP (Unix sockets are off, so deep data dirs cannot exceed the
  socket path limit), with a generated password: Postgres uses SCRAM for its superuser ``tollgate``,
  Redis ``requirepass``.
- As root, Postgres runs as the ``postgres`` system user: its directory is owned by that user (0700)
  and every parent folder is made traversable for it, by an ACL entry (``setfacl -m u:postgres:x``)
  where ``setfacl`` exists and the file system supports it, otherwise by adding the search bit for
  others (``chmod o+x``; no read permission is added, so the folders still cannot be listed). Access is
  checked as that user, so ACLs count. ``grant_traversal`` returns what it changed so the caller can
  say so.
- Redis runs with ``appendonly yes`` and ``maxmemory-policy noeviction``.
- ``durable=False`` (tests only) turns off fsync in both servers: faster, unsafe on a crash.
"""

from __future__ import annotations

import glob
import os
import pwd
import random
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from tollgate.settings import Settings

INSTALL_HINT = "apt-get install postgresql redis-server"
POSTGRES_SUPERUSER = "tollgate"
POSTGRES_SYSTEM_USER = "postgres"
POSTGRES_STOP_SIGNAL = signal.SIGINT  # "fast" shutdown: roll back open transactions, checkpoint, exit
REDIS_STOP_SIGNAL = signal.SIGTERM  # flushes the append-only file, then exits


class MissingServerBinaries(RuntimeError):
    """The Postgres or Redis server binaries are not installed (the message names the packages)."""


class ServerStartError(RuntimeError):
    """A server exited or did not accept connections in time (the message ends with its log's tail)."""


@dataclass(frozen=True, slots=True)
class ServerBinaries:
    postgres_bin_dir: Path
    redis_server: Path


def _is_postgres_bin_dir(path: Path) -> bool:
    return all(os.access(path / name, os.X_OK) for name in ("initdb", "postgres"))


def find_postgres_bin_dir(configured: Path | None = None) -> Path | None:
    if configured is not None:
        return configured if _is_postgres_bin_dir(configured) else None
    candidates = sorted(
        (Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else -1,
        reverse=True,
    )
    for candidate in candidates:
        if _is_postgres_bin_dir(candidate):
            return candidate
    initdb = shutil.which("initdb")
    if initdb:
        # /usr/local/bin/initdb may be a symlink into the real bin dir, next to `postgres`.
        for directory in (Path(initdb).parent, Path(initdb).resolve().parent):
            if _is_postgres_bin_dir(directory):
                return directory
    return None


def find_redis_server(configured: Path | None = None) -> Path | None:
    if configured is not None:
        return configured if os.access(configured, os.X_OK) and configured.is_file() else None
    found = shutil.which("redis-server")
    return Path(found) if found else None


def find_server_binaries(settings: Settings) -> ServerBinaries:
    """Both servers' binaries, or ``MissingServerBinaries`` naming what is missing and how to install it."""
    pg = find_postgres_bin_dir(settings.postgres_bin_dir)
    redis_server = find_redis_server(settings.redis_server_bin)
    missing = []
    if pg is None:
        where = settings.postgres_bin_dir or "/usr/lib/postgresql/*/bin or PATH"
        missing.append(f"the PostgreSQL server (initdb, postgres) was not found in {where}")
    if redis_server is None:
        where = settings.redis_server_bin or "PATH"
        missing.append(f"redis-server was not found in {where}")
    if pg is None or redis_server is None:
        raise MissingServerBinaries(
            "; ".join(missing)
            + f".\nInstall them with: {INSTALL_HINT}  (Debian/Ubuntu, as root or with sudo),"
            " or set TOLLGATE_DATABASE_URL and TOLLGATE_REDIS_URL to use existing servers."
        )
    return ServerBinaries(pg, redis_server)


_LOWEST_LISTEN_PORT = 10_000


def _ephemeral_floor() -> int:
    """The lowest port the kernel hands to outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the caller binds it soon after), chosen at random below
    the kernel's ephemeral range: a port from that range can be taken meanwhile as the source port of
    any outgoing connection on the machine, so the caller's later bind would fail."""
    floor = _ephemeral_floor()
    if floor > _LOWEST_LISTEN_PORT + 1000:
        for _ in range(50):
            port = random.randrange(_LOWEST_LISTEN_PORT, floor)
            if port_is_free(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int) -> bool:
    """Whether a server may listen on ``port`` of 127.0.0.1 now.

    The probe binds with ``SO_REUSEADDR``, as every server Tollgate starts does (uvicorn, Postgres,
    Redis): on Linux that bind fails while any process listens on the port, or holds it in a live
    connection, but succeeds over the TIME_WAIT leftovers of connections that a stopped server closed
    first. Those last a minute after a drain and shutdown, and would otherwise make a ``tollgate up``
    right after Ctrl-C refuse ports that its servers could bind."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def service_user() -> str | None:
    """The user Postgres must run as: ``postgres`` when we are root, else ourselves (None)."""
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam(POSTGRES_SYSTEM_USER)
    except KeyError:
        raise MissingServerBinaries(
            f"running as root, Postgres needs the '{POSTGRES_SYSTEM_USER}' system user, which does not"
            f" exist. Install it with: {INSTALL_HINT}"
        ) from None
    return POSTGRES_SYSTEM_USER


def _can_search(directory: Path, username: str) -> bool:
    """Whether ``username`` may pass through ``directory`` (mode bits and ACLs, as the kernel decides)."""
    entry = pwd.getpwnam(username)
    return subprocess.run(["test", "-x", str(directory)], user=entry.pw_uid, group=entry.pw_gid,
                          extra_groups=[], capture_output=True).returncode == 0


def _set_acl(setfacl: str, directory: Path, username: str) -> bool:
    result = subprocess.run([setfacl, "-m", f"u:{username}:x", str(directory)], capture_output=True)
    return result.returncode == 0


def grant_traversal(path: Path, username: str) -> list[str]:
    """Make every ancestor of ``path`` searchable by ``username`` (root only); one line per change made."""
    resolved = path.resolve()
    if _can_search(resolved.parent, username):  # reaching the parent proves every ancestor is searchable
        return []
    setfacl = shutil.which("setfacl")
    changes = []
    for ancestor in reversed(resolved.parents):
        if _can_search(ancestor, username):
            continue
        if setfacl and _set_acl(setfacl, ancestor, username) and _can_search(ancestor, username):
            changes.append(f"granted {username} search permission on {ancestor} (ACL u:{username}:x)")
            continue
        os.chmod(ancestor, ancestor.stat().st_mode | stat.S_IXOTH)
        changes.append(f"added search permission for others on {ancestor} (chmod o+x) so {username} "
                       "can reach the Postgres data directory")
    return changes


def _log_tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


class LocalPostgres:
    """A Postgres cluster in ``root`` (``root/data``; log ``root/postgres.log``)."""

    def __init__(self, root: Path, bin_dir: Path, *, port: int, password: str, durable: bool = True) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if not password:
            raise ValueError("password must not be empty")
        self.root = root.resolve()
        self.bin_dir = bin_dir
        self.port = port
        self.password = password
        self.durable = durable
        self.user = service_user()
        self.data_dir = self.root / "data"
        self.log_path = self.root / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return (f"postgresql://{POSTGRES_SUPERUSER}:{quote(self.password, safe='')}"
                f"@127.0.0.1:{self.port}/{database}")

    def prepare(self) -> list[str]:
        """Create the directory (owned by the service user) and the cluster on first use.

        Returns the permission changes made so the postgres user can reach ``root``.
        """
        changes: list[str] = []
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.user is not None:
            changes = grant_traversal(self.root, self.user)
            entry = pwd.getpwnam(self.user)
            os.chown(self.root, entry.pw_uid, entry.pw_gid)
            os.chmod(self.root, 0o700)
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        return changes

    def _initdb(self) -> None:
        if self.data_dir.exists():
            shutil.rmtree(self.data_dir)  # a half-written cluster from an interrupted first start
        pwfile = self.root / ".initdb-password"
        pwfile.write_text(self.password + "\n")
        os.chmod(pwfile, 0o600)
        if self.user is not None:
            entry = pwd.getpwnam(self.user)
            os.chown(pwfile, entry.pw_uid, entry.pw_gid)
        argv = [str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "-U", POSTGRES_SUPERUSER,
                "--auth=scram-sha-256", f"--pwfile={pwfile}", "--encoding=UTF8", "--locale=C"]
        if not self.durable:
            argv.append("--no-sync")
        try:
            result = subprocess.run(argv, capture_output=True, text=True, cwd=self.root,
                                    user=self.user, group=self._group(), extra_groups=self._extra_groups())
        finally:
            pwfile.unlink(missing_ok=True)
        if result.returncode != 0:
            raise ServerStartError(f"initdb failed ({result.returncode}):\n{result.stdout}{result.stderr}")

    def _group(self) -> int | None:
        return pwd.getpwnam(self.user).pw_gid if self.user else None

    def _extra_groups(self) -> list[int] | None:
        return [] if self.user else None

    def argv(self) -> list[str]:
        argv = [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                "-c", "listen_addresses=127.0.0.1", "-c", "unix_socket_directories=",
                "-c", "max_connections=200", "-c", "log_min_messages=warning"]
        if not self.durable:
            argv += ["-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off"]
        return argv

    def is_ready(self) -> bool:
        """One connection attempt: True when the server accepts connections."""
        import psycopg

        try:
            with psycopg.connect(self.url(), connect_timeout=2):
                return True
        except psycopg.OperationalError:
            return False

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        """Wait until the server accepts connections; ``ServerStartError`` if it exits or times out."""
        _wait_ready("postgres", self.is_ready, proc, timeout, self.log_path)

    def create_database(self, name: str, *, recreate: bool = False) -> None:
        """Create database ``name`` unless it exists (``recreate``: drop it first)."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            if recreate:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
            exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
            if not exists:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))

    def drop_database(self, name: str) -> None:
        import psycopg
        from psycopg import sql

        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


class LocalRedis:
    """A Redis server whose append-only files live in ``root`` (log ``root/redis.log``)."""

    def __init__(self, root: Path, server_bin: Path, *, port: int, password: str, databases: int = 16,
                 durable: bool = True) -> None:
        if not 0 < port < 65536:
            raise ValueError(f"port must be in 1..65535, got {port}")
        if not password:
            raise ValueError("password must not be empty")
        if databases < 1:
            raise ValueError(f"databases must be >= 1, got {databases}")
        self.root = root.resolve()
        self.server_bin = server_bin
        self.port = port
        self.password = password
        self.databases = databases
        self.durable = durable
        self.log_path = self.root / "redis.log"

    def url(self, db: int = 0) -> str:
        if not 0 <= db < self.databases:
            raise ValueError(f"db must be in 0..{self.databases - 1}, got {db}")
        return f"redis://:{quote(self.password, safe='')}@127.0.0.1:{self.port}/{db}"

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)

    def argv(self) -> list[str]:
        return [
            str(self.server_bin), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.root),
            "--daemonize", "no", "--requirepass", self.password, "--databases", str(self.databases),
            "--appendonly", "yes", "--appendfsync", "everysec" if self.durable else "no",
            "--maxmemory-policy", "noeviction", "--save", "",
        ]

    def is_ready(self) -> bool:
        """One PING: True when the server answers (and has loaded its data)."""
        import redis

        client = redis.Redis.from_url(self.url(), socket_connect_timeout=1, socket_timeout=2)
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def wait_ready(self, proc: subprocess.Popen[bytes], timeout: float) -> None:
        _wait_ready("redis-server", self.is_ready, proc, timeout, self.log_path)


def _wait_ready(name: str, is_ready: Callable[[], bool], proc: subprocess.Popen[bytes], timeout: float,
                log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while not is_ready():
        if proc.poll() is not None:
            raise ServerStartError(f"{name} exited with {proc.returncode}:\n{_log_tail(log_path)}")
        if time.monotonic() > deadline:
            raise ServerStartError(f"{name} did not accept connections within {timeout:.0f}s:\n"
                                   f"{_log_tail(log_path)}")
        time.sleep(0.05)
