"""``tollgate fetch-model SOURCE DEST``: a checkpoint from where it is published into a directory that
several processes share (a node's model cache), fetched once however many of them ask at the same time.

SOURCE is one of:

- ``hf://ORG/NAME[@REVISION]``: a Hugging Face Hub repository (``main`` by default; pin a commit for a
  reproducible deployment). ``HF_TOKEN`` for private and gated repositories, ``HF_ENDPOINT`` for a
  mirror (the variables huggingface_hub reads). Files are listed once, then every one is read at the
  commit the listing resolved, so a push during the fetch cannot mix two revisions.
- ``s3://BUCKET/PREFIX``: the objects under PREFIX in AWS S3 or any S3-compatible store
  (``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL``, path-style, for MinIO, Ceph, R2, ...). With
  ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY`` (and ``AWS_SESSION_TOKEN``) each request is signed
  (Signature Version 4, region ``AWS_REGION``, default us-east-1); without them it is anonymous (a
  public bucket).
- a directory (``/models/NAME`` or ``file:///models/NAME``): a pre-populated volume, copied.

Only files matching ``--include`` (checkpoint, configuration, tokenizer) are fetched.

Invariants:

- DEST is complete or as it was: files land in a staging directory beside DEST (``.DEST.partial``), each
  written as ``<file>.part`` and renamed once its size is the listing's; DEST appears by one rename, with
  a marker (``.tollgate-fetched.json``) naming SOURCE. A killed fetch leaves DEST untouched, and the next
  one keeps the staged files already complete.
- One fetch per DEST at a time: an exclusive ``flock`` on ``.DEST.lock``, held from the cache check to the
  rename. Processes sharing the directory (pods on one node, through one host directory) wait for the
  holder, then find DEST done. The kernel drops the lock of a killed holder.
- DEST is fetched again only when SOURCE changes (a new revision): the new copy replaces the old one by
  rename, so a process that opened the old files keeps reading them.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import fnmatch
import hashlib
import hmac
import json
import os
import shutil
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from urllib.parse import quote, unquote, urlsplit

import click
import httpx

MARKER = ".tollgate-fetched.json"
# A checkpoint's weights, configuration, tokenizer and chat template; not the .bin/.pth/.gguf copies
# some repositories also publish.
DEFAULT_INCLUDE = ("*.safetensors", "*.json", "*.jinja", "*.model", "*.tiktoken", "*.txt")
HF_DEFAULT_ENDPOINT = "https://huggingface.co"
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_CHUNK = 1 << 20
_S3_NS = "{http://s3.amazonaws.com/doc/2006-03-01/}"


class FetchError(Exception):
    """A fetch that cannot succeed as asked (bad source, refused credentials, missing files, no room)."""


class _ShortRead(FetchError):
    """A file that arrived with another size than the listing's (a cut connection): worth a retry."""


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative to DEST, '/'-separated
    size: int
    url: str


@dataclass
class Listing:
    files: list[RemoteFile]
    revision: str | None = None  # the commit a Hugging Face revision resolved to
    headers: Callable[[str], dict[str, str]] = field(default=lambda url: {})


@dataclass(frozen=True)
class FetchResult:
    fetched: bool  # False: DEST already held SOURCE
    files: int
    bytes: int
    revision: str | None


# --- Sources ---------------------------------------------------------------------------------------


def _safe_relative(path: str) -> str:
    parts = PurePosixPath(path).parts
    if not parts or path.startswith("/") or any(p in ("..", ".", "") for p in parts):
        raise FetchError(f"refusing a file outside the destination: {path!r}")
    return "/".join(parts)


def _included(path: str, include: Sequence[str]) -> bool:
    return any(fnmatch.fnmatch(path, pattern) or fnmatch.fnmatch(PurePosixPath(path).name, pattern)
               for pattern in include)


def _raise_for(response: httpx.Response, what: str) -> None:
    if response.status_code in (401, 403):
        raise FetchError(f"{what}: {response.status_code} (missing or refused credentials: HF_TOKEN for a "
                         "private or gated repository, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY for a bucket)")
    if response.status_code == 404:
        raise FetchError(f"{what}: not found (404)")
    if 400 <= response.status_code < 500 and response.status_code != 429:
        raise FetchError(f"{what}: {response.status_code}")
    response.raise_for_status()


def _hf_listing(spec: str, env: Mapping[str, str], client: httpx.Client) -> Listing:
    repo, _, revision = spec.partition("@")
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise FetchError(f"hf://{spec}: expected hf://ORG/NAME[@REVISION]")
    revision = revision or "main"
    endpoint = env.get("HF_ENDPOINT", HF_DEFAULT_ENDPOINT).rstrip("/")
    token = env.get("HF_TOKEN")
    auth = {"Authorization": f"Bearer {token}"} if token else {}
    url = f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
    response = client.get(url, params={"blobs": "true"}, headers=auth)
    _raise_for(response, f"hf://{repo}@{revision}")
    info = response.json()
    commit = info.get("sha") or revision
    files = []
    for sibling in info.get("siblings", []):
        path = _safe_relative(sibling["rfilename"])
        size = sibling.get("lfs", {}).get("size", sibling.get("size"))
        if size is None:
            raise FetchError(f"hf://{repo}: the listing gives no size for {path}")
        files.append(RemoteFile(path, int(size), f"{endpoint}/{repo}/resolve/{commit}/{quote(path)}"))
    origin = urlsplit(endpoint).netloc
    # The token goes to the Hub only (httpx also drops it on a redirect to another host, e.g. a CDN).
    return Listing(files, commit, lambda u: auth if urlsplit(u).netloc == origin else {})


def sigv4_headers(method: str, url: str, *, access_key: str, secret_key: str, region: str,
                  session_token: str | None = None, now: dt.datetime | None = None,
                  extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers that sign a body-less S3 request (AWS Signature Version 4): ``url`` as it is sent
    (path and query already percent-encoded), ``extra`` headers signed too."""
    moment = (now or dt.datetime.now(dt.UTC)).strftime("%Y%m%dT%H%M%SZ")
    parts = urlsplit(url)
    headers = {"host": parts.netloc, "x-amz-content-sha256": EMPTY_SHA256, "x-amz-date": moment,
               **{k.lower(): v.strip() for k, v in (extra or {}).items()}}
    if session_token:
        headers["x-amz-security-token"] = session_token
    query = sorted((quote(unquote(k), safe="-_.~"), quote(unquote(v), safe="-_.~"))
                   for k, _, v in (pair.partition("=") for pair in parts.query.split("&") if pair))
    signed = ";".join(sorted(headers))
    canonical = "\n".join([method, parts.path or "/", "&".join(f"{k}={v}" for k, v in query),
                           *(f"{k}:{headers[k]}" for k in sorted(headers)), "", signed, EMPTY_SHA256])
    scope = f"{moment[:8]}/{region}/s3/aws4_request"
    to_sign = "\n".join(["AWS4-HMAC-SHA256", moment, scope, hashlib.sha256(canonical.encode()).hexdigest()])
    key = f"AWS4{secret_key}".encode()
    for part in (moment[:8], region, "s3", "aws4_request"):
        key = hmac.new(key, part.encode(), hashlib.sha256).digest()
    signature = hmac.new(key, to_sign.encode(), hashlib.sha256).hexdigest()
    headers["authorization"] = (f"AWS4-HMAC-SHA256 Credential={access_key}/{scope},SignedHeaders={signed},"
                                f"Signature={signature}")
    del headers["host"]  # the client sends it
    return headers


def _s3_listing(spec: str, env: Mapping[str, str], client: httpx.Client) -> Listing:
    bucket, _, prefix = spec.partition("/")
    if not bucket:
        raise FetchError(f"s3://{spec}: expected s3://BUCKET/PREFIX")
    prefix = prefix.strip("/") + "/" if prefix.strip("/") else ""
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or "us-east-1"
    endpoint = (env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") or "").rstrip("/")
    base = f"{endpoint}/{quote(bucket)}" if endpoint else f"https://{bucket}.s3.{region}.amazonaws.com"
    access, secret = env.get("AWS_ACCESS_KEY_ID"), env.get("AWS_SECRET_ACCESS_KEY")

    def headers(url: str) -> dict[str, str]:
        if not (access and secret):
            return {}
        return sigv4_headers("GET", url, access_key=access, secret_key=secret, region=region,
                             session_token=env.get("AWS_SESSION_TOKEN"))

    files: list[RemoteFile] = []
    token: str | None = None
    while True:
        query = {"list-type": "2", "prefix": prefix, **({"continuation-token": token} if token else {})}
        # Path-style lists at /BUCKET, virtual-hosted style at the host's root.
        url = f"{base}{'' if endpoint else '/'}?" + "&".join(
            f"{k}={quote(v, safe='-_.~')}" for k, v in sorted(query.items()))
        response = client.get(url, headers=headers(url))
        _raise_for(response, f"s3://{bucket}/{prefix}")
        root = ET.fromstring(response.content)
        for item in root.iter(f"{_S3_NS}Contents"):
            key = item.findtext(f"{_S3_NS}Key", "")
            if key.endswith("/"):
                continue  # a "directory" placeholder object
            path = _safe_relative(key[len(prefix):])
            files.append(RemoteFile(path, int(item.findtext(f"{_S3_NS}Size", "0")),
                                    f"{base}/{quote(key, safe='/-_.~')}"))
        if root.findtext(f"{_S3_NS}IsTruncated") != "true":
            break
        token = root.findtext(f"{_S3_NS}NextContinuationToken")
    return Listing(files, None, headers)


def _directory_listing(root: Path) -> Listing:
    if not root.is_dir():
        raise FetchError(f"{root} is not a directory")
    files = [RemoteFile(p.relative_to(root).as_posix(), p.stat().st_size, p.as_uri())
             for p in sorted(root.rglob("*")) if p.is_file() and not p.name.startswith(".")]
    return Listing(files)


def list_source(source: str, env: Mapping[str, str], client: httpx.Client) -> Listing:
    if source.startswith("hf://"):
        return _hf_listing(source[len("hf://"):], env, client)
    if source.startswith("s3://"):
        return _s3_listing(source[len("s3://"):], env, client)
    if source.startswith("file://"):
        return _directory_listing(Path(unquote(urlsplit(source).path)))
    if source.startswith("/"):
        return _directory_listing(Path(source))
    raise FetchError(f"{source}: not hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or a directory")


# --- Fetching into the cache -------------------------------------------------------------------------


@contextlib.contextmanager
def _exclusive(lock_path: Path, on_wait: Callable[[], None]) -> Iterator[None]:
    try:
        lock_file = lock_path.open("a")
    except PermissionError as exc:
        raise FetchError(f"{lock_path.parent} is not writable by uid {os.getuid()}: the cache directory "
                         "must belong to the user the fetch runs as") from exc
    with lock_file as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            on_wait()
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _cached(dest: Path, source: str) -> dict | None:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if marker.get("source") != source:
        return None
    for path, size in marker.get("files", {}).items():
        if not (dest / path).is_file() or (dest / path).stat().st_size != size:
            return None  # removed or truncated since: fetch again
    return marker


def _download(client: httpx.Client, listing: Listing, item: RemoteFile, target: Path, attempts: int,
              backoff_s: float) -> None:
    partial = target.with_name(target.name + ".part")
    for attempt in range(1, attempts + 1):
        try:
            if item.url.startswith("file://"):
                shutil.copyfile(unquote(urlsplit(item.url).path), partial)
            else:
                with client.stream("GET", item.url, headers=listing.headers(item.url)) as response:
                    _raise_for(response, item.path)
                    with partial.open("wb") as out:
                        for chunk in response.iter_bytes(_CHUNK):
                            out.write(chunk)
            if partial.stat().st_size != item.size:
                raise _ShortRead(f"{partial.stat().st_size} bytes read, the listing says {item.size}")
            partial.replace(target)
            return
        except (httpx.TransportError, httpx.HTTPStatusError, _ShortRead) as exc:
            # 4xx other than 429 are FetchErrors (_raise_for): no retry mends them.
            if attempt == attempts:
                raise FetchError(f"{item.path}: {exc} ({attempts} attempts)") from exc
            time.sleep(backoff_s * 2 ** (attempt - 1))


def fetch(source: str, dest: Path, *, include: Sequence[str] = DEFAULT_INCLUDE,
          env: Mapping[str, str] | None = None, client: httpx.Client | None = None,
          attempts: int = 5, backoff_s: float = 2.0,
          log: Callable[[str], None] = lambda message: None) -> FetchResult:
    """Make ``dest`` hold the files of ``source`` matching ``include`` (module docstring)."""
    env = os.environ if env is None else env
    dest = Path(dest).absolute()
    dest.parent.mkdir(parents=True, exist_ok=True)
    own_client = client is None
    http = client or httpx.Client(follow_redirects=True, timeout=httpx.Timeout(60.0, connect=15.0))
    try:
        with _exclusive(dest.parent / f".{dest.name}.lock",
                        lambda: log(f"another process is fetching into {dest}: waiting for it")):
            if (marker := _cached(dest, source)) is not None:
                files = marker["files"]
                return FetchResult(False, len(files), sum(files.values()), marker.get("revision"))
            listing = list_source(source, env, http)
            wanted = [f for f in listing.files if _included(f.path, include)]
            if "*.safetensors" in include and not any(f.path.endswith(".safetensors") for f in wanted):
                raise FetchError(f"{source}: no *.safetensors file among {len(listing.files)} listed")
            staging = dest.parent / f".{dest.name}.partial"
            staging.mkdir(exist_ok=True)
            todo = [f for f in wanted if not ((staging / f.path).is_file()
                                              and (staging / f.path).stat().st_size == f.size)]
            needed = sum(f.size for f in todo)
            free = shutil.disk_usage(staging).free
            if needed > free:
                raise FetchError(f"{needed / 2**30:.1f} GiB to fetch into {dest.parent}, "
                                 f"{free / 2**30:.1f} GiB free")
            log(f"fetching {len(todo)} of {len(wanted)} files ({needed / 2**30:.2f} GiB) from {source}")
            for item in todo:
                target = staging / item.path
                target.parent.mkdir(parents=True, exist_ok=True)
                _download(http, listing, item, target, attempts, backoff_s)
                log(f"  {item.path} ({item.size} bytes)")
            files = {f.path: f.size for f in wanted}
            (staging / MARKER).write_text(json.dumps(
                {"source": source, "revision": listing.revision, "files": files}, indent=1))
            old = dest.parent / f".{dest.name}.old"
            if dest.exists():
                shutil.rmtree(old, ignore_errors=True)
                dest.rename(old)
            staging.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
            return FetchResult(True, len(files), sum(files.values()), listing.revision)
    finally:
        if own_client:
            http.close()


@click.command("fetch-model")
@click.argument("source")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--include", multiple=True, default=DEFAULT_INCLUDE, show_default=True,
              help="Glob of the files to fetch (repeat it); matched against the path and the file name.")
def fetch_model(source: str, dest: Path, include: tuple[str, ...]) -> None:
    """Fetch a checkpoint from SOURCE (hf://ORG/NAME[@REVISION], s3://BUCKET/PREFIX or a directory) into
    DEST, unless DEST already holds it; concurrent fetches into one DEST run once."""
    try:
        result = fetch(source, dest, include=include, log=click.echo)
    except (FetchError, httpx.HTTPError, OSError) as exc:
        raise click.ClickException(str(exc)) from exc
    at = f" at {result.revision}" if result.revision else ""
    verb = "fetched" if result.fetched else "already held"
    click.echo(f"{dest}: {verb} {result.files} files ({result.bytes / 2**30:.2f} GiB) of {source}{at}")
