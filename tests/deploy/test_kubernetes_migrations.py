"""Migrations in the Kubernetes deployment: every gateway and worker pod brings the schema to its image's
head before it starts (``deploy/kubernetes/base/migrate.sh`` in its ``migrate`` init container), and a
restart does not wait for Postgres: while Postgres does not answer, a pod starts if the schema is known
(recorded on the shared files volume) to be at its image's head, and a pod of a newer release waits.

The script is run here as the pods run it, from the rendered ConfigMap, with the repository's Python (its
Alembic head) and a stand-in ``tollgate`` that records whether it was asked to migrate.
"""

from __future__ import annotations

import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from alembic.script import ScriptDirectory

from tests.deploy.manifests import ROOT, container, containers, pod_spec
from tollgate.schema import alembic_config

MIGRATING = ("gateway", "worker")
HEAD = ScriptDirectory.from_config(alembic_config()).get_current_head()


def _script_path(workload) -> tuple[str, str]:
    """(the ConfigMap the migrate container's script comes from, the script's key in it)."""
    migrate = container(workload, "migrate")
    assert migrate["command"][0] == "sh"
    mounted = Path(migrate["command"][1])
    (mount,) = [m for m in migrate["volumeMounts"] if m["mountPath"] == str(mounted.parent)]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    return volume["configMap"]["name"], mounted.name


def test_gateway_and_worker_pods_migrate_before_they_start(manifests):
    for name in MIGRATING:
        workload = manifests.workload(name)
        spec = pod_spec(workload)
        migrate, main = container(workload, "migrate"), spec["containers"][0]
        assert migrate["image"] == main["image"]  # the schema of the code that is about to run
        assert migrate.get("envFrom") == main.get("envFrom") and migrate.get("env") == main.get("env")
        config_map, key = _script_path(workload)
        script = manifests.get("ConfigMap", config_map)["data"][key]
        assert script == (ROOT / "deploy" / "kubernetes" / "base" / "migrate.sh").read_text()
        assert "tollgate migrate" in script
        # The record lives on the volume every gateway and worker pod shares.
        record_dir = "/var/lib/tollgate/files"
        (mount,) = [m for m in migrate["volumeMounts"] if m["mountPath"] == record_dir]
        (main_mount,) = [m for m in main["volumeMounts"] if m["mountPath"] == record_dir]
        assert mount["name"] == main_mount["name"] == "files"
    claim = [v for v in pod_spec(manifests.workload("gateway"))["volumes"] if v["name"] == "files"]
    assert claim[0]["persistentVolumeClaim"]["claimName"] == "tollgate-files"
    assert "pg_advisory_xact_lock" in (ROOT / "migrations" / "env.py").read_text()  # concurrent pods


def test_beat_and_the_engines_never_wait_for_the_database(manifests):
    assert "initContainers" not in pod_spec(manifests.workload("beat"))  # it only sends tasks, via Redis
    for engine in manifests.component("engine"):
        assert all(c["name"] != "migrate" for c in containers(engine)), "engines never touch the database"


# --- The script, as the pods run it -------------------------------------------------------------------


@pytest.fixture
def run(rendered, tmp_path):
    """Runs the rendered migrate.sh against a database address, with a stand-in ``tollgate`` that
    records its arguments and exits with the given status; returns (exit status, output, argv seen)."""
    config_map, key = _script_path(rendered["minimal"].workload("gateway"))
    script = tmp_path / "migrate.sh"
    script.write_text(rendered["minimal"].get("ConfigMap", config_map)["data"][key])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    fake = bin_dir / "tollgate"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexit "${{FAKE_STATUS:-0}}"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    python = bin_dir / "python"  # the repository's interpreter, as the image's `python`
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    record = tmp_path / "files" / ".schema-revision"
    record.parent.mkdir()

    def _run(database_port: int, migrate_status: int = 0) -> tuple[int, str, list[str]]:
        calls.unlink(missing_ok=True)
        env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
               "TOLLGATE_DATABASE_URL": f"postgresql://tollgate:pw@127.0.0.1:{database_port}/tollgate",
               "TOLLGATE_SCHEMA_RECORD": str(record), "FAKE_STATUS": str(migrate_status)}
        result = subprocess.run(["sh", str(script)], env=env, capture_output=True, text=True, timeout=60,
                                cwd=tmp_path)
        seen = calls.read_text().splitlines() if calls.exists() else []
        return result.returncode, result.stdout + result.stderr, seen

    _run.record = record  # type: ignore[attr-defined]
    return _run


@pytest.fixture
def listening_port():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def closed_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]  # nothing listens once the socket is closed


def test_with_postgres_up_it_migrates_and_records_the_head(run, listening_port):
    status, output, seen = run(listening_port)
    assert status == 0, output
    assert seen == ["migrate"] and run.record.read_text() == f"{HEAD}\n"


def test_a_failed_migration_fails_the_pod_and_records_nothing(run, listening_port):
    status, _, seen = run(listening_port, migrate_status=1)
    assert status != 0 and seen == ["migrate"] and not run.record.exists()


def test_a_restart_during_an_outage_starts_without_postgres(run, listening_port, closed_port):
    assert run(listening_port)[0] == 0  # the release migrated when it rolled out
    status, output, seen = run(closed_port)
    assert status == 0 and seen == [] and HEAD in output


def test_a_new_release_during_an_outage_waits_for_postgres(run, closed_port):
    status, output, seen = run(closed_port)  # nothing recorded: never migrated to this head
    assert status == 1 and seen == [] and "not starting" in output
    run.record.write_text("0000_an_older_head\n")  # the previous release's head
    status, _, seen = run(closed_port)
    assert status == 1 and seen == []
