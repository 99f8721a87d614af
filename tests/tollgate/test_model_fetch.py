"""``tollgate fetch-model``: a checkpoint from a Hugging Face repository, an S3 bucket or a directory into a
shared cache directory, once, against a local HTTP server that plays the Hub's and S3's APIs (the
listing and file routes the command uses, S3's Signature Version 4 checked on every request).

What a node's engines rely on: the files arrive whole (or DEST stays as it was), concurrent fetches into
one DEST download each file once, a fetch cut short resumes, a new revision replaces the old copy, and
the credentials go where they belong.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import os
import random
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit
from xml.sax.saxutils import escape

import httpx
import pytest
from click.testing import CliRunner

from tests.polling import wait_until
from tollgate.cli import main
from tollgate.commands.model_fetch import EMPTY_SHA256, MARKER, FetchError, fetch, sigv4_headers

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "hf_secret_token"
ACCESS, SECRET, REGION = "AKIDTOLLGATE", "tollgate/secret+key", "eu-west-1"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Repo:
    files: dict[str, bytes]
    gated: bool = False


@dataclass
class FakeStore:
    """The Hub's ``/api/models/{repo}/revision/{rev}`` and ``/{repo}/resolve/{rev}/{file}`` (redirected
    to a blob route, as the Hub redirects large files to its CDN), and S3's ListObjectsV2 (two keys a
    page) and GetObject, path-style."""

    repos: dict[str, Repo] = field(default_factory=dict)
    buckets: dict[str, dict[str, bytes]] = field(default_factory=dict)
    public_buckets: set[str] = field(default_factory=set)
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # (path, query, auth)
    fail_next: dict[str, int] = field(default_factory=dict)  # file path -> 500s to answer first
    truncate_next: set[str] = field(default_factory=set)  # file paths to cut short once
    hold: dict[str, threading.Event] = field(default_factory=dict)  # file path -> sent once set

    def downloads(self, name: str) -> int:
        """GETs of a file's bytes (the Hub's blob route after its redirect, or an S3 object)."""
        return sum(1 for path, query, _ in self.requests if unquote(path).endswith("/" + name)
                   and "/resolve/" not in path and "list-type" not in query)


def _serve(store: FakeStore):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/octet-stream",
                  length: int | None = None, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body) if length is None else length))
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(body)

        def _file(self, name: str, body: bytes) -> None:
            if name in store.hold:
                store.hold[name].wait(30)
            if store.fail_next.get(name, 0) > 0:
                store.fail_next[name] -= 1
                return self._send(500, b"try again")
            if name in store.truncate_next:
                store.truncate_next.discard(name)
                self._send(200, body[: len(body) // 2], length=len(body))
                self.close_connection = True
                return None
            return self._send(200, body)

        def do_GET(self):  # noqa: N802 (http.server's name)
            parts = urlsplit(self.path)
            store.requests.append((parts.path, parts.query, self.headers.get("Authorization")))
            segments = [unquote(s) for s in parts.path.strip("/").split("/")]
            if segments[:2] == ["api", "models"]:
                return self._hub_info(segments[2:])
            if len(segments) >= 4 and segments[2] == "resolve":
                repo = store.repos["/".join(segments[:2])]
                if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    return self._send(401, b"gated")
                assert segments[3] == COMMIT, "files are read at the commit the listing resolved"
                name = "/".join(segments[4:])
                return self._send(302, b"", headers={"Location": f"/cdn/{'/'.join(segments[:2])}/{name}"})
            if segments[0] == "cdn":
                name = "/".join(segments[3:])
                return self._file(name, store.repos["/".join(segments[1:3])].files[name])
            return self._s3(segments, parts.query)

        def _hub_info(self, rest: list[str]) -> None:
            repo_id = "/".join(rest[:2])
            repo = store.repos.get(repo_id)
            if repo is None:
                return self._send(404, b"{}")
            if repo.gated and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                return self._send(401, b'{"error": "gated"}')
            siblings = [{"rfilename": n, "size": len(b)} if not n.endswith(".safetensors") else
                        {"rfilename": n, "size": len(b), "lfs": {"size": len(b), "sha256": "x"}}
                        for n, b in repo.files.items()]
            return self._send(200, json.dumps({"id": repo_id, "sha": COMMIT, "siblings": siblings}).encode(),
                              "application/json")

        def _s3(self, segments: list[str], query: str) -> None:
            bucket = segments[0]
            if bucket not in store.buckets:
                return self._send(404, b"NoSuchBucket")
            if bucket not in store.public_buckets and not self._signed():
                return self._send(403, b"SignatureDoesNotMatch")
            objects = store.buckets[bucket]
            if len(segments) == 1 or segments[1:] == [""]:
                return self._list(objects, dict(parse_qsl(query)))
            key = "/".join(segments[1:])
            return self._file(key.rsplit("/", 1)[-1], objects[key])

        def _list(self, objects: dict[str, bytes], q: dict[str, str]) -> None:
            assert q["list-type"] == "2"
            keys = sorted(k for k in objects if k.startswith(q.get("prefix", "")))
            start = int(q.get("continuation-token", "0"))
            page = keys[start:start + 2]
            more = start + 2 < len(keys)
            items = "".join(f"<Contents><Key>{escape(k)}</Key><Size>{len(objects[k])}</Size></Contents>"
                            for k in page)
            tail = f"<NextContinuationToken>{start + 2}</NextContinuationToken>" if more else ""
            truncated = "true" if more else "false"
            body = ('<?xml version="1.0" encoding="UTF-8"?>'
                    '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
                    f"{items}<IsTruncated>{truncated}</IsTruncated>{tail}</ListBucketResult>")
            return self._send(200, body.encode(), "application/xml")

        def _signed(self) -> bool:
            """S3's check, from the request as received: its canonical form, signed with the secret."""
            auth = self.headers.get("Authorization", "")
            if not auth.startswith("AWS4-HMAC-SHA256 "):
                return False
            fields = dict(part.split("=", 1) for part in auth[len("AWS4-HMAC-SHA256 "):].split(","))
            access, date, region, service, _ = fields["Credential"].split("/")
            signed = fields["SignedHeaders"].split(";")
            parts = urlsplit(self.path)
            query = "&".join(sorted(
                f"{quote(k, safe='-_.~')}={quote(v, safe='-_.~')}"
                for k, v in parse_qsl(parts.query, keep_blank_values=True)))
            canonical = "\n".join([
                "GET", parts.path, query, *(f"{h}:{self.headers[h].strip()}" for h in signed), "",
                ";".join(signed), self.headers["x-amz-content-sha256"]])
            scope = f"{date}/{region}/{service}/aws4_request"
            to_sign = "\n".join(["AWS4-HMAC-SHA256", self.headers["x-amz-date"], scope,
                                 hashlib.sha256(canonical.encode()).hexdigest()])
            key = f"AWS4{SECRET}".encode()
            for part in (date, region, service, "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            expected = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
            return access == ACCESS and region == REGION and "host" in signed and hmac.compare_digest(
                expected, fields["Signature"])

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread


@pytest.fixture
def store() -> Iterator[tuple[FakeStore, str]]:
    fake = FakeStore()
    server, thread = _serve(fake)
    try:
        yield fake, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        for event in fake.hold.values():
            event.set()
        server.shutdown()
        thread.join()


def _tree(seed: int = 0) -> dict[str, bytes]:
    rng = random.Random(seed)
    return {"config.json": json.dumps({"seed": seed}).encode(), "tokenizer.json": b'{"vocab": {}}',
            "model-00001-of-00002.safetensors": rng.randbytes(300_000),
            "model-00002-of-00002.safetensors": rng.randbytes(200_001),
            "model.safetensors.index.json": b"{}", "chat_template.jinja": b"{{ messages }}",
            "pytorch_model.bin": b"not wanted", "original/consolidated.00.pth": b"not wanted either"}


def _wanted(files: dict[str, bytes]) -> dict[str, bytes]:
    return {k: v for k, v in files.items() if not k.endswith((".bin", ".pth"))}


def _on_disk(dest: Path) -> dict[str, bytes]:
    return {p.relative_to(dest).as_posix(): p.read_bytes() for p in dest.rglob("*")
            if p.is_file() and p.name != MARKER}


def _client() -> httpx.Client:
    return httpx.Client(follow_redirects=True, timeout=10)


# --- Hugging Face -----------------------------------------------------------------------------------


def test_a_hub_repository_is_fetched_once_at_the_resolved_commit(store, tmp_path):
    fake, url = store
    fake.repos["acme/tiny-chat"] = Repo(_tree(), gated=True)
    env = {"HF_ENDPOINT": url, "HF_TOKEN": TOKEN}
    dest = tmp_path / "cache" / "tiny-chat"
    with _client() as client:
        result = fetch("hf://acme/tiny-chat", dest, env=env, client=client)
    assert result.fetched and result.revision == COMMIT
    assert _on_disk(dest) == _wanted(fake.repos["acme/tiny-chat"].files)
    assert json.loads((dest / MARKER).read_text())["revision"] == COMMIT
    assert all(auth == f"Bearer {TOKEN}" for path, _, auth in fake.requests if not path.startswith("/cdn/"))
    assert sorted(p.name for p in dest.parent.iterdir()) == [".tiny-chat.lock", "tiny-chat"]  # no staging

    seen = len(fake.requests)
    with _client() as client:
        again = fetch("hf://acme/tiny-chat", dest, env=env, client=client)
    assert not again.fetched and again.files == result.files and len(fake.requests) == seen  # no request


def test_a_gated_repository_without_the_token_fails_and_says_which_variable(store, tmp_path):
    fake, url = store
    fake.repos["acme/gated"] = Repo(_tree(), gated=True)
    result = CliRunner().invoke(main, ["fetch-model", "hf://acme/gated", str(tmp_path / "gated")],
                                env={"HF_ENDPOINT": url, "HF_TOKEN": ""})
    assert result.exit_code == 1 and "401" in result.output and "HF_TOKEN" in result.output
    assert not (tmp_path / "gated").exists()


def test_a_new_revision_replaces_the_copy_and_open_files_stay_readable(store, tmp_path):
    fake, url = store
    fake.repos["acme/m"] = Repo(_tree(seed=1))
    dest = tmp_path / "m"
    with _client() as client:
        fetch("hf://acme/m@v1", dest, env={"HF_ENDPOINT": url}, client=client)
        opened = (dest / "config.json").open("rb")
        fake.repos["acme/m"] = Repo(_tree(seed=2))
        result = fetch("hf://acme/m@v2", dest, env={"HF_ENDPOINT": url}, client=client)
    assert result.fetched and _on_disk(dest) == _wanted(fake.repos["acme/m"].files)
    assert json.loads(opened.read()) == {"seed": 1}  # an engine still loading the old copy keeps it
    opened.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".m.lock", "m"]


def test_a_cut_download_is_retried_and_a_failed_fetch_resumes_where_it_stopped(store, tmp_path):
    fake, url = store
    fake.repos["acme/big"] = Repo(_tree())
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    fake.truncate_next.add(first)  # a connection cut mid-file: retried
    fake.fail_next[second] = 5  # down for longer than the attempts: the fetch fails
    dest = tmp_path / "big"
    with _client() as client, pytest.raises(FetchError, match=second):
        fetch("hf://acme/big", dest, env={"HF_ENDPOINT": url}, client=client, attempts=3, backoff_s=0)
    assert not dest.exists()
    assert fake.downloads(first) == 2 and fake.downloads(second) == 3
    fake.fail_next.clear()
    with _client() as client:
        fetch("hf://acme/big", dest, env={"HF_ENDPOINT": url}, client=client, backoff_s=0)
    assert fake.downloads(first) == 2  # kept from the failed run
    assert _on_disk(dest) == _wanted(fake.repos["acme/big"].files)


def test_concurrent_fetches_into_one_directory_download_each_file_once(store, tmp_path):
    """Two engine pods starting together on one node: the second waits for the first's fetch."""
    fake, url = store
    fake.repos["acme/shared"] = Repo(_tree())
    gate = fake.hold["config.json"] = threading.Event()
    dest = tmp_path / "node-cache" / "shared"
    env = {**os.environ, "HF_ENDPOINT": url, "PYTHONUNBUFFERED": "1"}
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    command = [sys.executable, "-m", "tollgate", "fetch-model", "hf://acme/shared", str(dest)]
    with logs[0].open("w") as out:
        first = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_until(lambda: fake.downloads("config.json") == 1, "the first fetch to be downloading")
    with logs[1].open("w") as out:
        second = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wait_until(lambda: "waiting for it" in logs[1].read_text(), "the second fetch to wait for the lock")
    gate.set()
    assert first.wait(60) == 0 and second.wait(60) == 0, [p.read_text() for p in logs]
    for name in _wanted(fake.repos["acme/shared"].files):
        assert fake.downloads(name.rsplit("/", 1)[-1]) == 1, name
    assert ": fetched 6 files" in logs[0].read_text() and ": already held 6 files" in logs[1].read_text()
    assert _on_disk(dest) == _wanted(fake.repos["acme/shared"].files)


def test_a_listing_that_points_outside_the_destination_is_refused(store, tmp_path):
    fake, url = store
    fake.repos["evil/repo"] = Repo({"../../escape.safetensors": b"x", "config.json": b"{}"})
    with _client() as client, pytest.raises(FetchError, match="outside the destination"):
        fetch("hf://evil/repo", tmp_path / "d", env={"HF_ENDPOINT": url}, client=client)
    assert not (tmp_path.parent / "escape.safetensors").exists()


def test_the_fetched_checkpoint_is_one_the_engine_reads(store, tmp_path):
    from safetensors import safe_open

    from engine.models.config import ModelArgs
    from engine.tiny import create_tiny_checkpoint

    source = create_tiny_checkpoint(tmp_path / "published", seed=3)
    fake, url = store
    fake.repos["acme/tiny"] = Repo({p.relative_to(source).as_posix(): p.read_bytes()
                                    for p in source.rglob("*") if p.is_file()})
    dest = tmp_path / "cache" / "tiny"
    with _client() as client:
        fetch("hf://acme/tiny", dest, env={"HF_ENDPOINT": url}, client=client)
    assert ModelArgs.from_pretrained(dest) == ModelArgs.from_pretrained(source)
    with safe_open(str(dest / "model.safetensors"), "pt") as fetched, \
            safe_open(str(source / "model.safetensors"), "pt") as published:
        assert sorted(fetched.keys()) == sorted(published.keys())


# --- S3 and compatible stores -----------------------------------------------------------------------


def test_signature_v4_matches_aws_published_example():
    """The GetObject example of Amazon S3's Signature Version 4 documentation (a Range header signed)."""
    headers = sigv4_headers("GET", "https://examplebucket.s3.amazonaws.com/test.txt",
                            access_key="AKIAIOSFODNN7EXAMPLE",
                            secret_key="wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY", region="us-east-1",
                            now=dt.datetime(2013, 5, 24, tzinfo=dt.UTC), extra={"Range": "bytes=0-9"})
    assert headers["x-amz-content-sha256"] == EMPTY_SHA256
    assert headers["authorization"] == (
        "AWS4-HMAC-SHA256 Credential=AKIAIOSFODNN7EXAMPLE/20130524/us-east-1/s3/aws4_request,"
        "SignedHeaders=host;range;x-amz-content-sha256;x-amz-date,"
        "Signature=f0e8bdb87c964420e857bd35b5d6ed310bd44f0170aba48dd91039c6036bdb41")


def test_a_bucket_prefix_is_fetched_with_signed_requests_over_listing_pages(store, tmp_path):
    fake, url = store
    tree = _tree()
    fake.buckets["weights"] = {f"llama/8b instruct/{k}": v for k, v in tree.items()}
    fake.buckets["weights"]["llama/other/config.json"] = b"{}"  # beside the prefix: not fetched
    env = {"AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": ACCESS, "AWS_SECRET_ACCESS_KEY": SECRET,
           "AWS_REGION": REGION}
    dest = tmp_path / "llama"
    with _client() as client:
        result = fetch("s3://weights/llama/8b instruct", dest, env=env, client=client)
    assert result.fetched and _on_disk(dest) == _wanted(tree)
    assert sum(1 for _, query, _ in fake.requests if "list-type" in query) == 4  # 8 keys, 2 a page

    with _client() as client, pytest.raises(FetchError, match="403"):
        fetch("s3://weights/llama/8b instruct", tmp_path / "refused",
              env={**env, "AWS_SECRET_ACCESS_KEY": "wrong"}, client=client)


def test_a_public_bucket_is_read_anonymously(store, tmp_path):
    fake, url = store
    fake.buckets["open"] = {f"m/{k}": v for k, v in _tree().items()}
    fake.public_buckets.add("open")
    with _client() as client:
        fetch("s3://open/m/", tmp_path / "m", env={"AWS_ENDPOINT_URL": url}, client=client)
    assert _on_disk(tmp_path / "m") == _wanted(_tree())
    assert all(auth is None for _, _, auth in fake.requests)


# --- A pre-populated volume ---------------------------------------------------------------------------


def test_a_directory_is_copied_into_the_cache(tmp_path):
    volume = tmp_path / "volume" / "m"
    for name, body in _tree().items():
        (volume / name).parent.mkdir(parents=True, exist_ok=True)
        (volume / name).write_bytes(body)
    result = CliRunner().invoke(main, ["fetch-model", volume.as_uri(), str(tmp_path / "cache" / "m")])
    assert result.exit_code == 0, result.output
    assert _on_disk(tmp_path / "cache" / "m") == _wanted(_tree())
    again = CliRunner().invoke(main, ["fetch-model", volume.as_uri(), str(tmp_path / "cache" / "m")])
    assert "already held" in again.output
    (tmp_path / "cache" / "m" / "config.json").unlink()  # damaged since: fetched again
    third = CliRunner().invoke(main, ["fetch-model", volume.as_uri(), str(tmp_path / "cache" / "m")])
    assert ": fetched 6 files" in third.output
    assert third.exit_code == 0 and (tmp_path / "cache" / "m" / "config.json").read_bytes() == b'{"seed": 0}'


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: nothing to refuse")
def test_a_cache_directory_the_user_cannot_write_is_named_with_the_uid(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    cache.chmod(0o555)
    try:
        with pytest.raises(FetchError, match=f"not writable by uid {os.getuid()}"):
            fetch(str(tmp_path), cache / "m")
    finally:
        cache.chmod(0o755)
