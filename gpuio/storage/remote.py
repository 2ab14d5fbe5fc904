"""Objects in S3 (and S3-compatible stores), Google Cloud Storage, Azure Blob Storage and
on HTTP(S) servers, read by byte range.

A dataset path may be a URL: ``s3://bucket/key-or-prefix``, ``gs://bucket/...``,
``az://container/...`` (also ``abfs[s]://`` and ``https://<account>.blob.core.windows.net/...``),
``http://host/path`` or ``https://...``. This module holds everything that talks to such a
store (GCS and Azure addressing, credentials and listings: ``gpuio.storage._clouds``):

- ``is_url``/``is_remote``: whether a path or an index's file table is remote;
- ``client()``: the process's client for the settings in effect where it is called
  (one per combination of ``remote_retries``, ``remote_timeout``, ``remote_unsigned``
  and ``remote_client`` in use; made anew in a forked child). S3 endpoint,
  region and credentials come from botocore, the AWS SDK for Python, so they are read
  exactly as the AWS SDKs read them (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``,
  ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_PROFILE`` and
  the config/credentials files); botocore lists prefixes. HEADs and ranged GETs are
  obstore's (Rust; the GIL is released while a request runs), with the credentials
  botocore found: bench/remote.py measured it fastest of obstore, urllib3 on presigned
  URLs and boto3's ``get_object`` (bench/RESULTS.md); a GET of 1 MiB or more is read by
  http.client straight from the socket into its buffer (``_Urllib3``: obstore collects a
  body into a buffer of its own, copied after), which costs less CPU per byte.
  obstore's runtime does not survive
  ``fork()``, so a forked child of a process that used it (a DataLoader worker) does its
  GETs with urllib3 on presigned URLs instead (``remote_client``). Azure blobs are read the
  same way (obstore, urllib3 in such a child); GCS objects by urllib3 on GCS's JSON API
  (obstore's GCS store speaks the XML API, which gcp-storage-emulator does not serve);
  GCS and Azure listings by urllib3;
- ``RemoteBackend``: executes a read plan on remote objects: through the node-local
  cache tier (``gpuio.storage.cache``, on by default) or with coalesced ranged GETs
  straight into the batch buffer;
- ``RemoteFile``: an object opened for the formats' indexing (headers, index files).

Every GET is retried on HTTP 5xx, 429, a dropped connection or a short body, with
exponential backoff, ``remote_retries`` tries in all; the final error is a
``StorageError`` naming the URL, the byte range and the HTTP status. Each GET names the
ETag the index recorded (``If-Match``, where it is a strong one) and checks the one it
gets: an object replaced after indexing is an error naming it, never mixed bytes.

botocore, obstore and urllib3 are the ``gpuio[remote]`` extra, imported only when a URL is used.
"""

from __future__ import annotations

import io
import os
import random
import re
import select
import threading
import time
import urllib.parse
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone
from typing import Any, NamedTuple

import numpy as np

from gpuio import config
from gpuio._fork import RenewedLock, renew_after_fork
from gpuio.errors import ConfigError, DataError, DependencyError, StorageError
from gpuio.index import PathTable
from gpuio.storage import _clouds
from gpuio.storage.buffers import Lease
from gpuio.storage.plan import ReadPlan, build_plan

__all__ = ["SCHEMES", "SETTINGS", "ClientSettings", "ObjectInfo", "RemoteBackend", "RemoteFile", "client",
           "client_settings", "is_remote", "is_url", "is_http", "object_versions", "reset_client", "url_path"]

SCHEMES = ("s3://", *_clouds.CLOUD_SCHEMES, "http://", "https://")
# the settings of remote reads (gpuio.config); a Reader takes them when it is made
SETTINGS = ("remote_client", "remote_unsigned", "remote_cache", "remote_cache_dir", "remote_cache_budget", "remote_block", "remote_pack_below", "remote_requests",
            "remote_readahead", "remote_gap", "remote_part", "remote_retries", "remote_timeout", "cache_dir")
_PRESIGN_S = 3600  # lifetime of a presigned URL (urllib3 client)
_RESIGN_S = 1800  # a presigned URL older than this is signed again before use
# retries wait about 0.1, 0.2, 0.4 ... s, at most 5 s (so the default tries span some 11 s
# of throttling), each drawn from 0.5-1.5x that: ranks throttled together retry apart
_BACKOFF_S = 0.1
_BACKOFF_MAX_S = 5.0
_REDIRECTS = 10  # redirects a GET follows (urllib3; obstore follows its client's default)
# a GET of at least this many bytes is read by http.client straight into the caller's buffer (urllib3's
# transport; obstore collects a body into a buffer of its own, which is then copied); smaller ones by the
# client's transport, obstore's requests costing less CPU each. Not where the environment names a proxy:
# obstore's client goes through it, http.client knows none
_READINTO_FROM = 1 << 20
_INDEXES_KEPT = 8  # indexes whose objects a RemoteBackend's cache keeps in view


def is_url(path: object) -> bool:
    """Whether ``path`` names a remote object or prefix (``s3://``, ``gs://``, ``az://``,
    ``abfs[s]://``, ``http(s)://``)."""
    return isinstance(path, str) and path.startswith(SCHEMES)


def is_http(url: str) -> bool:
    """Whether ``url`` is an http(s) URL: one object, no listing, a query of its own (an
    Azure blob URL without a query is a container's object or prefix instead)."""
    return url.startswith(("http://", "https://")) and _clouds.locate(url) is None


def url_path(url: str) -> str:
    """An http(s) URL without its query and fragment (where a name's suffix is read;
    a presigned URL's signature is its query); an ``s3://`` URL (whose keys may hold
    ``?`` and ``#``) or a local path as it is."""
    if not is_http(url):
        return url
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


def is_remote(paths: PathTable) -> bool:
    """Whether an index's files are remote objects."""
    if paths.root:
        return paths.root.startswith(tuple(s.encode() for s in SCHEMES))
    return len(paths) > 0 and is_url(paths[0])


class ObjectInfo(NamedTuple):
    """One remote object: its URL, size in bytes and ETag (quotes kept)."""

    url: str
    size: int
    etag: str


def _split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url[len("s3://"):].partition("/")
    if not bucket:
        raise ConfigError(f"{url!r}: an s3 URL names a bucket, s3://bucket/key")
    return bucket, key


_watchers: tuple[weakref.ref, ...] = ()  # see watch_fetches


def watch_fetches(watcher: Any) -> None:
    """From now on, and while ``watcher`` lives, call ``watcher.fetched(seconds, nbytes)``
    after every ranged GET of this process (retries included): a loader's statistics."""
    global _watchers
    _watchers = tuple(w for w in _watchers if w() is not None) + (weakref.ref(watcher),)


def _fetched(t0: float, nbytes: int) -> None:
    seconds = time.perf_counter() - t0
    for ref in _watchers:
        watcher = ref()
        if watcher is not None:
            watcher.fetched(seconds, nbytes)


class ClientSettings(NamedTuple):
    """The settings a client takes when it is made."""

    retries: int
    timeout: int
    unsigned: bool
    transport: str  # remote_client: auto, obstore or urllib3


def client_settings() -> ClientSettings:
    """The client settings in effect here (a ``config.override`` of the caller's included)."""
    # a public bucket: requests go unsigned, as the AWS CLI's --no-sign-request sends them
    unsigned = config.get("remote_unsigned") or os.environ.get("AWS_NO_SIGN_REQUEST", "").lower() in (
        "1", "true", "yes")
    return ClientSettings(max(1, config.get("remote_retries")), max(1, config.get("remote_timeout")), unsigned,
                          config.get("remote_client"))


class Client:
    """Metadata calls (HEAD, listing) and ranged GETs for one process and ``settings``.

    botocore (the AWS SDK) gives S3's endpoint, region and credentials and does its
    listings; ``cloud()`` gives GCS's and Azure's (``_clouds``), whose listings urllib3
    does; a transport does the HEADs and the ranged GETs: ``_Obstore``, or ``_Urllib3``
    in a forked child of a process that used obstore (``remote_client``) and for GCS.
    ``seen`` holds the versions of the objects this process listed or asked about (shared
    by the process's clients)."""

    def __init__(self, settings: ClientSettings, seen: dict[str, ObjectInfo]) -> None:
        try:
            import botocore.session
        except ImportError as exc:
            raise DependencyError(f"reading s3://, gs://, az:// and http(s):// URLs needs the gpuio[remote] extra "
                                  f"(pip install 'gpuio[remote]'): {exc}") from exc
        self.retries, self.timeout, self.unsigned = settings.retries, settings.timeout, settings.unsigned
        self._session = botocore.session.Session()
        self._s3: Any = None
        self._lock = threading.Lock()
        self.seen = seen  # objects listed, opened or read by this process
        # the certificate authorities (AWS_CA_BUNDLE, or ca_bundle in ~/.aws/config) as the
        # AWS SDKs take them: urllib3's; obstore takes none of its own
        self.ca_bundle: str | None = self._session.get_config_variable("ca_bundle")
        self._obstore_untrusted = False  # obstore met a certificate it does not trust: urllib3 reads on
        choice = settings.transport
        if choice == "auto":
            # obstore's runtime threads do not survive fork(): a child of a process that
            # used it (a DataLoader worker) would wait on them for ever
            choice = "urllib3" if _obstore_inherited else "obstore"
        self.transport: Any = _Obstore(self) if choice == "obstore" else _Urllib3(self)
        self._plain: _Urllib3 | None = None  # http(s) URLs with a query (presigned): obstore drops it
        self._proxied = _proxy_named()  # GETs stay obstore's, which goes through the proxy
        self._clouds: dict[str, Any] = {}  # "gs", "az" -> _clouds.GCS, _clouds.Azure

    def _for(self, url: str, n: int = 0) -> Any:
        """The transport of ``url`` (a GET of ``n`` bytes): urllib3's for a GET of at least
        ``_READINTO_FROM`` bytes (read straight into the caller's buffer; unless the
        environment names a proxy), for an http(s)
        URL with a query string (a presigned URL, a token), which obstore's paths cannot
        carry, for a ``gs://`` URL and after obstore met a certificate it does not trust;
        else ``transport``."""
        if isinstance(self.transport, _Obstore) and (
                (n >= _READINTO_FROM and not self._proxied) or self._obstore_untrusted
                or ("?" in url and is_http(url)) or url.startswith("gs://")):
            return self.plain()
        return self.transport

    def plain(self) -> _Urllib3:
        """The urllib3 transport (``transport`` where it is urllib3's)."""
        if isinstance(self.transport, _Urllib3):
            return self.transport
        with self._lock:
            if self._plain is None:
                self._plain = _Urllib3(self)
            return self._plain

    def cloud(self, kind: str) -> Any:
        """The GCS (``"gs"``) or Azure (``"az"``) service as the environment describes it."""
        with self._lock:
            service = self._clouds.get(kind)
        if service is None:
            service = _clouds.GCS(self.unsigned, self.plain().http) if kind == "gs" else _clouds.Azure(self.unsigned)
            with self._lock:
                service = self._clouds.setdefault(kind, service)
        return service

    def _call(self, url: str, request: Callable[[Any], Any], n: int = 0) -> Any:
        """``request(transport)`` by the transport of ``url`` (a GET of ``n`` bytes); where
        obstore does not trust the server's certificate and AWS_CA_BUNDLE names
        authorities, again by urllib3 with them (and urllib3 from then on). A precondition
        failed (HTTP 412) is the error of an object replaced, unless the object, asked
        again, is gone (its 404)."""
        transport = self._for(url, n)
        try:
            return request(transport)
        except _PreconditionFailed:
            self.head(url)  # the 404 error of an object deleted
            raise
        except _Untrusted:
            if not isinstance(transport, _Obstore) or not self.ca_bundle:
                raise
            self._obstore_untrusted = True
            return request(self._for(url, n))

    def s3(self) -> Any:
        """The botocore S3 client (endpoint, region and credentials as the AWS SDKs find them)."""
        with self._lock:
            if self._s3 is None:
                from botocore import UNSIGNED
                from botocore.config import Config

                settings = dict(connect_timeout=self.timeout, read_timeout=self.timeout,
                                retries={"max_attempts": self.retries, "mode": "standard"})
                if self.unsigned:
                    settings["signature_version"] = UNSIGNED
                s3 = self._session.create_client("s3", config=Config(**settings))
                if "amazonaws.com" not in s3.meta.endpoint_url:
                    # a custom endpoint (AWS_ENDPOINT_URL: an S3-compatible store) is often an
                    # IP address or a host without per-bucket DNS names
                    s3 = self._session.create_client("s3", config=Config(**settings,
                                                                         s3={"addressing_style": "path"}))
                self._s3 = s3
            return self._s3

    def head(self, url: str) -> ObjectInfo:
        """Size and ETag of the object ``url``, asked of the store now."""
        info = self._call(url, lambda transport: transport.head(url))
        self.seen[url] = info
        return info

    def known(self, url: str) -> ObjectInfo:
        """Size and ETag of ``url`` as this process last saw it (listed, opened), else ``head``."""
        info = self.seen.get(url)
        return info if info is not None else self.head(url)

    def list(self, url: str) -> list[ObjectInfo]:
        """The objects under the prefix ``url`` (``s3://``, ``gs://``, Azure), in key order."""
        if is_http(url):
            raise DataError("an http(s) URL names one object and has no listing; use s3://, gs:// or az:// for "
                            "a prefix, or give the objects one by one", path=url)
        if not url.startswith("s3://"):
            out = [ObjectInfo(*item) for item in self.plain().list(url)]
            self.seen.update((info.url, info) for info in out)
            return out
        bucket, prefix = _split_s3(url)
        out: list[ObjectInfo] = []
        try:
            pages = self.s3().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            for page in pages:
                for obj in page.get("Contents", ()):
                    info = ObjectInfo(f"s3://{bucket}/{obj['Key']}", int(obj["Size"]), obj.get("ETag", ""))
                    self.seen[info.url] = info
                    out.append(info)
        except Exception as exc:  # botocore's ClientError, EndpointConnectionError, NoCredentialsError ...
            raise StorageError(f"cannot list objects: {_botocore_reason(exc)}", path=url) from exc
        return out

    def get_into(self, url: str, start: int, out: memoryview, etag: str | None) -> tuple[str, int]:
        """Fill ``out`` with the object's bytes from ``start``; returns the object's
        (ETag, size). ``etag``: the version the index recorded, or None. Retried on
        5xx, 429, a dropped connection or a short body, ``remote_retries`` tries in all."""
        t0 = time.perf_counter()
        got = self._call(url, lambda transport: transport.get_into(url, start, out, etag), len(out))
        _fetched(t0, len(out))
        return got

    def get(self, url: str, start: int, n: int, etag: str | None) -> Any:
        """The object's ``n`` bytes from ``start`` as a buffer (bytes-like), checked and
        retried as ``get_into``: the one the transport received them in (obstore's), so
        that a caller that keeps them (the cache) makes no copy."""
        t0 = time.perf_counter()
        got = self._call(url, lambda transport: transport.get(url, start, n, etag), n)
        _fetched(t0, n)
        return got

    def backoff(self, attempt: int) -> None:
        """Wait before try ``attempt`` (0: the first, no wait)."""
        if attempt:
            time.sleep(min(_BACKOFF_MAX_S, _BACKOFF_S * (1 << (attempt - 1))) * random.uniform(0.5, 1.5))


class _Obstore:
    """HEADs and ranged GETs by obstore (Rust; the GIL released while a request runs),
    with the credentials botocore finds (asked again every few minutes, so that
    temporary ones refresh). obstore's own retries are off: the loop here retries, so
    that the last error names the URL, the range and the status."""

    def __init__(self, owner: Client) -> None:
        try:
            import obstore
            import obstore.exceptions
            import obstore.store
        except ImportError as exc:
            raise DependencyError(f"reading s3://, gs://, az:// and http(s):// URLs needs the gpuio[remote] extra "
                                  f"(pip install 'gpuio[remote]'): {exc}") from exc
        global _obstore_used
        _obstore_used = True
        self.owner = owner
        self._obstore = obstore
        self._errors = obstore.exceptions
        self._stores_mod = obstore.store
        self._stores: dict[str, Any] = {}  # bucket or origin -> obstore store
        self._lock = threading.Lock()

    def _credentials(self) -> dict[str, Any]:
        """The credentials botocore finds, for obstore; asked again after a few minutes."""
        creds = self.owner._session.get_credentials()
        if creds is None:
            raise PermissionError("no AWS credentials found (AWS_ACCESS_KEY_ID, AWS_PROFILE, ~/.aws/credentials, "
                                  "an instance role)")
        frozen = creds.get_frozen_credentials()
        return {"access_key_id": frozen.access_key, "secret_access_key": frozen.secret_key, "token": frozen.token,
                "expires_at": datetime.now(timezone.utc) + timedelta(seconds=_CREDENTIALS_S)}

    def _store(self, url: str) -> tuple[Any, str]:
        """The obstore store of ``url`` (one per bucket, Azure container or HTTP origin) and
        the path in it."""
        cloud = _clouds.locate(url)
        if url.startswith("s3://"):
            where, path = _split_s3(url)
        elif cloud is not None:  # an Azure blob (gs:// is urllib3's)
            azure = self.owner.cloud("az")
            where, path = f"{azure.endpoint(cloud)}/{cloud.bucket}", cloud.key
        else:  # obstore quotes the path itself: it takes the URL's path unquoted, without a fragment
            parts = urllib.parse.urlsplit(url)
            where, path = f"{parts.scheme}://{parts.netloc}", urllib.parse.unquote(parts.path.lstrip("/"))
        with self._lock:
            store = self._stores.get(where)
        if store is not None:
            return store, path
        options = {"allow_http": True, "connect_timeout": f"{self.owner.timeout}s", "timeout": f"{self.owner.timeout}s"}
        no_retries = {"max_retries": 0, "retry_timeout": timedelta(seconds=self.owner.timeout)}
        if url.startswith("s3://"):
            s3 = self.owner.s3()
            custom = "amazonaws.com" not in s3.meta.endpoint_url
            signing: dict[str, Any] = ({"skip_signature": True} if self.owner.unsigned
                                       else {"credential_provider": self._credentials})
            store = self._stores_mod.S3Store(where, endpoint=s3.meta.endpoint_url if custom else None,
                                             region=s3.meta.region_name or "us-east-1",
                                             virtual_hosted_style_request=not custom, client_options=options,
                                             retry_config=no_retries, **signing)
        elif cloud is not None:
            key, sas = azure.credentials(cloud)
            signing = ({"account_key": key} if key else {"sas_key": sas} if sas else {"skip_signature": True})
            store = self._stores_mod.AzureStore(cloud.bucket, account_name=azure.account_of(cloud),
                                                endpoint=azure.endpoint(cloud), client_options=options,
                                                retry_config=no_retries, **signing)
        else:
            store = self._stores_mod.HTTPStore.from_url(where, client_options=options, retry_config=no_retries)
        with self._lock:
            store = self._stores.setdefault(where, store)
        return store, path

    def head(self, url: str) -> ObjectInfo:
        """Size and ETag of the object ``url``: a HEAD for ``s3://``; for http(s) a GET of
        its first byte, which every server that serves the object answers (a URL signed
        for GETs, where a dataset host redirects its downloads, refuses a HEAD)."""
        if is_http(url):
            try:
                _, etag, total = self._get(url, 0, 1, None)
                return ObjectInfo(url, total, etag)
            except StorageError as exc:
                if "HTTP 416" not in str(exc):
                    raise
                # an empty object has no byte 0: its HEAD below
        store, path = self._store(url)
        last = ""
        for attempt in range(self.owner.retries):
            self.owner.backoff(attempt)
            try:
                meta = self._obstore.head(store, path)
            except Exception as exc:  # obstore's errors, mapped below
                last = self._fatal_or_reason(exc, url, "HEAD", 0, None)
                continue
            return ObjectInfo(url, int(meta["size"]), meta.get("e_tag") or "")
        raise StorageError(f"HEAD: {last} after {self.owner.retries} tries", path=url)

    def _fatal_or_reason(self, exc: Exception, url: str, what: str, start: int, etag: str | None) -> str:
        """Raise the gpuio error of a failure no retry mends (404, 403, 412, 416); else
        return its reason for the retry loop (5xx, 429, a dropped connection, a short body)."""
        text = str(exc).split("\n", 1)[0]
        m = _STATUS.search(text)
        status = int(m.group(1)) if m else None
        if isinstance(exc, self._errors.PreconditionError) or status == 412:
            raise _replaced(url, etag or "?", "another") from exc
        if isinstance(exc, FileNotFoundError) or status == 404:
            raise StorageError(f"{what}: HTTP 404: object not found (moved or deleted after indexing?)", path=url,
                               offset=start) from exc
        if isinstance(exc, PermissionError) or status in (401, 403):
            raise StorageError(f"{what}: HTTP {status or 403}: {_denied(url)}: {text[:200]}", path=url,
                               offset=start) from exc
        if status == 416:
            raise StorageError(f"{what}: HTTP 416: the object ends before this range (truncated or replaced "
                               f"after indexing?)", path=url, offset=start) from exc
        if isinstance(exc, self._errors.NotSupportedError) and "Range" in text:
            raise _no_ranges(url, what, start) from exc
        bad_certificate = re.search(r"InvalidCertificate\(\s*(\w+)", str(exc))
        if bad_certificate:
            raise _untrusted(url, what, start, bad_certificate.group(1)) from exc
        if status is not None and status < 500 and status != 429:
            raise StorageError(f"{what}: HTTP {status} {m.group(2)}", path=url, offset=start) from exc
        if status is not None:
            return f"HTTP {status} {m.group(2)}".rstrip()
        return f"connection failed or body cut short ({text[:160]})"

    def get_into(self, url: str, start: int, out: memoryview, etag: str | None) -> tuple[str, int]:
        """Fill ``out`` with the object's bytes from ``start``; returns the object's
        (ETag, size). ``etag``: the version the index recorded, or None."""
        data, got_etag, total = self._get(url, start, len(out), etag)
        out[:] = memoryview(data)
        return got_etag, total

    def get(self, url: str, start: int, n: int, etag: str | None) -> Any:
        """The object's ``n`` bytes from ``start``, in the buffer obstore received them in."""
        return self._get(url, start, n, etag)[0]

    def _get(self, url: str, start: int, n: int, etag: str | None) -> tuple[Any, str, int]:
        """(the bytes, the object's ETag, its size) of a ranged GET, with the retries and checks."""
        end = start + n - 1
        what = f"GET bytes {start}-{end}"
        store, path = self._store(url)
        options: dict[str, Any] = {"range": (start, start + n)}
        if _strong(etag):
            options["if_match"] = etag
        last = ""
        for attempt in range(self.owner.retries):
            self.owner.backoff(attempt)
            try:
                got = self._obstore.get(store, path, options=options)
                # a server without range requests: the object's first n bytes, from a whole GET
                data = got.bytes() if "range" in options else _first_bytes(got.stream(), n)
            except self._errors.NotSupportedError as exc:
                if start == 0 and "range" in options and "Range" in str(exc):
                    options.pop("range")
                    last = "the server does not take range requests"
                    continue
                last = self._fatal_or_reason(exc, url, what, start, etag)
                continue
            except Exception as exc:  # obstore's errors, mapped by _fatal_or_reason
                last = self._fatal_or_reason(exc, url, what, start, etag)
                continue
            meta = got.meta
            got_etag, total = meta.get("e_tag") or "", int(meta["size"])
            if etag and got_etag and not _same_version(got_etag, etag):
                raise _replaced(url, etag, got_etag)
            if len(data) != n:
                if start + n > total:
                    raise StorageError(f"{what}: the object has {total} bytes (shorter than indexed: replaced "
                                       f"after indexing?)", path=url, offset=start)
                last = f"body of {len(data)} bytes, {n} asked for"
                continue
            return data, got_etag, total
        raise StorageError(f"{what}: {last} after {self.owner.retries} tries", path=url, offset=start)


class _Urllib3:
    """HEADs and ranged GETs on presigned URLs (botocore signs), GCS's JSON API and signed
    Azure requests (``_clouds``): the client of a forked child whose parent used obstore,
    of every ``gs://`` URL and of every GET of ``_READINTO_FROM`` bytes or more. A GET's
    body is read by http.client straight into the caller's buffer (urllib3 reads a body
    into bytes of its own, then copies them), on kept-alive connections of its own; the
    GCS and Azure listings, metadata and an empty object's GET by urllib3."""

    def __init__(self, owner: Client) -> None:
        try:
            import urllib3
        except ImportError as exc:
            raise DependencyError(f"reading s3://, gs://, az:// and http(s):// URLs needs the gpuio[remote] extra "
                                  f"(pip install 'gpuio[remote]'): {exc}") from exc
        import http.client  # here, as urllib3: import gpuio stays quick
        import ssl

        self.owner = owner
        self._urllib3 = urllib3
        self._http = http.client
        self._ssl = ssl
        self.timeout = urllib3.Timeout(connect=owner.timeout, read=owner.timeout)
        conns = max(4, config.get("remote_requests"))
        # redirects followed (a dataset host's URL that sends the GET on to its CDN); every
        # other retry is the loop's own (_request), which names the URL, range and status
        follow = urllib3.Retry(total=None, connect=0, read=0, status=0, other=0, redirect=_REDIRECTS)
        trust = {"ca_certs": owner.ca_bundle} if owner.ca_bundle else {}
        self.http = urllib3.PoolManager(num_pools=64, maxsize=conns, retries=follow, timeout=self.timeout, **trust)
        self._signed: dict[str, tuple[str, float]] = {}  # s3 URL -> (presigned URL, when signed)
        self._kept = conns  # idle connections kept per origin (GETs)
        self._idle: dict[tuple[str, str], list[Any]] = {}  # (scheme, host:port) -> idle http.client connections
        self._idle_lock = threading.Lock()
        self._tls: Any = None  # the TLS context of https GETs (made on first use)

    def http_url(self, url: str) -> str:
        """The URL a GET goes to: presigned for ``s3://``, as given for ``http(s)://``."""
        if not url.startswith("s3://"):
            return url
        now = time.monotonic()
        got = self._signed.get(url)
        if got is not None and now - got[1] < _RESIGN_S:
            return got[0]
        bucket, key = _split_s3(url)
        try:
            signed = self.owner.s3().generate_presigned_url("get_object", Params={"Bucket": bucket, "Key": key},
                                                            ExpiresIn=_PRESIGN_S)
        except Exception as exc:  # botocore's errors (no credentials, bad config) have no common base
            raise StorageError(f"cannot sign a request: {exc}", path=url) from exc
        self._signed[url] = (signed, now)
        return signed

    def _address(self, url: str, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The HTTP URL and headers of a GET of the object ``url``: presigned for ``s3://``,
        addressed and signed by its service for GCS and Azure, as given for ``http(s)://``."""
        cloud = _clouds.locate(url)
        if cloud is not None:
            return self.owner.cloud(cloud.kind).address(cloud, headers)
        return self.http_url(url), headers

    def _version(self, url: str, resp: Any) -> str:
        """The object's version in an answer: its ETag; a GCS object's generation."""
        return resp.headers.get("x-goog-generation" if url.startswith("gs://") else "ETag", "")

    def _body(self, url: str, address: Callable[[str, dict[str, str]], tuple[str, dict[str, str]]],
              what: str) -> bytes:
        """The whole body of a metadata request of ``url`` (a listing page, a GCS object's
        metadata), which must answer HTTP 200."""
        resp = self._request("GET", url, {}, 0, -1, address, what)
        try:
            body = resp.read()
        finally:
            resp.release_conn()
        if resp.status != 200:
            raise _status_error(url, 0, -1, resp.status, resp.reason, None, what)
        return body

    def list(self, url: str) -> list[tuple[str, int, str]]:
        """``[(url, size, version)]`` of the GCS or Azure objects under the prefix ``url``."""
        cloud = _clouds.locate(url)
        service = self.owner.cloud(cloud.kind)
        out: list[tuple[str, int, str]] = []
        marker = ""
        while True:
            body = self._body(url, lambda _url, _headers: service.listing(cloud, marker), "cannot list objects")
            items, marker = service.page(cloud, body, url)
            out += items
            if not marker:
                return out

    def head(self, url: str) -> ObjectInfo:
        """Size and ETag (a GCS object's generation) of the object ``url``."""
        if url.startswith("gs://"):
            cloud, service = _clouds.locate(url), self.owner.cloud("gs")
            size, generation = service.info(
                self._body(url, lambda _url, _headers: service.metadata(cloud), "HEAD"), url)
            return ObjectInfo(url, size, generation)
        # one-byte GET instead of HEAD: the same signed URL, and Content-Range gives the size
        buf = bytearray(1)
        try:
            etag, total = self.get_into(url, 0, memoryview(buf), None)
        except StorageError as exc:
            if "HTTP 416" not in str(exc):
                raise
            return ObjectInfo(url, 0, self._empty_etag(url))  # an empty object has no byte 0
        return ObjectInfo(url, total, etag)

    def get(self, url: str, start: int, n: int, etag: str | None) -> Any:
        """The object's ``n`` bytes from ``start``, read from the socket into a new array."""
        buf = np.empty(n, dtype=np.uint8)
        self.get_into(url, start, memoryview(buf), etag)
        return buf

    def _empty_etag(self, url: str) -> str:
        resp = self._request("GET", url, {}, 0, 0)
        try:
            resp.read()
            return self._version(url, resp)
        finally:
            resp.release_conn()

    def _request(self, method: str, url: str, headers: dict[str, str], start: int, end: int,
                 address: Callable[[str, dict[str, str]], tuple[str, dict[str, str]]] | None = None,
                 what: str | None = None) -> Any:
        """One request for ``url`` (sent where ``address``, by default the object's GET,
        says) with retries on 5xx, 429 and dropped connections; the response (body not
        read) of the first try that is none of those. ``what`` names it in errors."""
        errors = self._urllib3.exceptions
        what = what or f"GET bytes {start}-{end}"
        last = ""
        for attempt in range(self.owner.retries):
            self.owner.backoff(attempt)
            try:
                sent_url, sent_headers = (address or self._address)(url, headers)  # signed anew each try
                resp = self.http.request(method, sent_url, headers=sent_headers, preload_content=False,
                                         redirect=True, timeout=self.timeout)
            except errors.HTTPError as exc:
                if isinstance(getattr(exc, "reason", exc), errors.SSLError):
                    raise _untrusted(url, what, start, str(getattr(exc, "reason", exc))) from exc
                last = f"connection failed ({type(exc).__name__}: {exc})"
                continue
            if resp.status == 429 or resp.status >= 500:
                last = f"HTTP {resp.status} {resp.reason or ''}".rstrip()
                resp.drain_conn()
                resp.release_conn()
                continue
            return resp
        raise StorageError(f"{what}: {last} after {self.owner.retries} tries", path=url, offset=start)

    def get_into(self, url: str, start: int, out: memoryview, etag: str | None) -> tuple[str, int]:
        """Fill ``out`` with the object's bytes from ``start``; returns the object's
        (ETag, size). ``etag``: the version the index recorded, or None."""
        n = len(out)
        end = start + n - 1
        headers = {"Range": f"bytes={start}-{end}"}
        if _strong(etag):
            headers["If-Match"] = etag
        last = ""
        for attempt in range(self.owner.retries):
            self.owner.backoff(attempt)
            conn, resp, origin = self._send(url, headers, start, end)
            status, got, total = resp.status, -1, None
            try:
                if status not in (200, 206):
                    raise _status_error(url, start, end, status, resp.reason, etag)
                got_etag = self._version(url, resp)
                if etag and got_etag and not _same_version(got_etag, etag):
                    raise _replaced(url, etag, got_etag)
                total = _total_size(resp, status)
                if status == 200 and start != 0:
                    raise _no_ranges(url, f"GET bytes {start}-{end}", start)
                got = 0
                try:
                    while got < n:  # the socket's bytes land in ``out``: no buffer between
                        k = resp.readinto(out[got:])
                        if not k:
                            break
                        got += k
                except (self._http.HTTPException, OSError) as exc:
                    last = f"connection dropped after {got} of {n} bytes ({type(exc).__name__})"
                    continue
                if got < n:
                    if total is not None and start + n > total:
                        raise StorageError(f"GET bytes {start}-{end}: the object has {total} bytes "
                                           f"(shorter than indexed: replaced after indexing?)", path=url, offset=start)
                    last = f"body ended after {got} of {n} bytes (HTTP {status})"
                    continue
                return got_etag, total if total is not None else start + n
            finally:  # a connection is kept only with its answer read to the end
                self._done(conn, resp, origin, got >= n)
        raise StorageError(f"GET bytes {start}-{end}: {last} after {self.owner.retries} tries", path=url, offset=start)

    def _send(self, url: str, headers: dict[str, str], start: int, end: int) -> tuple[Any, Any, tuple[str, str]]:
        """The GET of bytes ``start``-``end`` of ``url`` (``headers``: its Range and
        If-Match) by http.client, redirects followed, with retries on 5xx, 429 and dropped
        connections: (the connection, the response, its body not read, and its origin) of
        the first try that is none of those."""
        what = f"GET bytes {start}-{end}"
        last = ""
        for attempt in range(self.owner.retries):
            self.owner.backoff(attempt)
            sent_url, sent_headers = self._address(url, headers)  # signed anew each try
            try:
                conn, resp, origin = self._follow(sent_url, sent_headers)
            except self._ssl.SSLCertVerificationError as exc:
                raise _untrusted(url, what, start, str(exc)) from exc
            except (self._http.HTTPException, OSError) as exc:
                last = f"connection failed ({type(exc).__name__}: {exc})"
                continue
            if resp.status == 429 or resp.status >= 500:
                last = f"HTTP {resp.status} {resp.reason or ''}".rstrip()
                conn.close()
                continue
            return conn, resp, origin
        raise StorageError(f"{what}: {last} after {self.owner.retries} tries", path=url, offset=start)

    def _follow(self, sent_url: str, headers: dict[str, str]) -> tuple[Any, Any, tuple[str, str]]:
        """Send a GET to ``sent_url`` on a kept connection of its origin (a new one where
        none is idle), following up to ``_REDIRECTS`` redirects (credentials are not sent
        on to another host): the connection, the response (body not read) and the origin
        (scheme, host and port) it came from."""
        for _ in range(_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(sent_url)
            origin = (parts.scheme, parts.netloc)
            conn = self._connection(origin)
            try:
                conn.request("GET", (parts.path or "/") + (f"?{parts.query}" if parts.query else ""), headers=headers)
                resp = conn.getresponse()
            except BaseException:
                conn.close()
                raise
            location = resp.getheader("Location")
            if resp.status not in (301, 302, 303, 307, 308) or not location:
                return conn, resp, origin
            conn.close()
            sent_url = urllib.parse.urljoin(sent_url, location)
            if urllib.parse.urlsplit(sent_url).netloc != parts.netloc:
                headers = {k: v for k, v in headers.items() if k.lower() not in _CREDENTIAL_HEADERS}
        raise self._http.HTTPException(f"more than {_REDIRECTS} redirects")

    def _connection(self, origin: tuple[str, str]) -> Any:
        """An idle kept-alive connection to ``origin`` (scheme, host and port; one its
        server has not closed meanwhile), else a new one."""
        scheme, netloc = origin
        with self._idle_lock:
            idle = self._idle.get(origin)
            while idle:
                conn = idle.pop()
                if conn.sock is not None and not _readable(conn.sock):  # closed or sent bytes unasked: not reused
                    return conn
                conn.close()
        if scheme == "https":
            if self._tls is None:
                self._tls = self._ssl.create_default_context(cafile=self.owner.ca_bundle)
            return self._http.HTTPSConnection(netloc, timeout=self.owner.timeout, context=self._tls)
        return self._http.HTTPConnection(netloc, timeout=self.owner.timeout)

    def _done(self, conn: Any, resp: Any, origin: tuple[str, str], whole: bool) -> None:
        """Keep ``conn`` for the next GET to ``origin`` where its answer was read to the
        end (``whole``, and the response closed itself); else close it."""
        if not (whole and resp.isclosed() and conn.sock is not None):
            conn.close()
            return
        with self._idle_lock:
            idle = self._idle.setdefault(origin, [])
            if len(idle) < self._kept:
                idle.append(conn)
                return
        conn.close()


_CREDENTIAL_HEADERS = ("authorization", "cookie", "proxy-authorization")


def _readable(sock: Any) -> bool:
    """Whether an idle connection's socket has something to read: its server closed it
    (or sent bytes no request asked for)."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _no_ranges(url: str, what: str, start: int) -> StorageError:
    """The error of a server that answers a range request with the whole object: gpuio
    reads objects by byte range (only an object's first bytes can come from such a server)."""
    return StorageError(f"{what}: the server does not take range requests (it sends the whole object, HTTP 200), "
                        f"and gpuio reads objects by byte range: serve them from a server that does (nginx, "
                        f"Apache, an S3 store), or copy them to local disk", path=url, offset=start)


class _Untrusted(StorageError):
    """A TLS certificate the client does not trust (never retried)."""


def _untrusted(url: str, what: str, start: int, why: str) -> StorageError:
    """The error of a TLS certificate the client does not trust (never retried)."""
    return _Untrusted(f"{what}: the server's TLS certificate is not trusted ({why[:200]}); for a private "
                        f"certificate authority set AWS_CA_BUNDLE (or ca_bundle in ~/.aws/config) to its PEM "
                        f"file", path=url, offset=start)


def _proxy_named() -> bool:
    """Whether the environment names a proxy for http(s) requests (``HTTP_PROXY``,
    ``HTTPS_PROXY``, ``ALL_PROXY``, in either case), which obstore's client goes through."""
    import urllib.request  # here: import gpuio stays quick

    return any(k in ("http", "https", "all") for k in urllib.request.getproxies_environment())


def _first_bytes(chunks: Iterator[Any], n: int) -> bytearray:
    """The first ``n`` bytes of a streamed body (the rest is not read: the stream closes
    its connection when dropped); fewer where the body is shorter."""
    out = bytearray(n)
    got = 0
    for chunk in chunks:
        take = min(len(chunk), n - got)
        out[got: got + take] = memoryview(chunk)[:take]
        got += take
        if got >= n:
            break
    del out[got:]
    return out


def _total_size(resp: Any, status: int) -> int | None:
    if status == 200:
        length = resp.headers.get("Content-Length")
        return int(length) if length and length.isdigit() else None
    rng = resp.headers.get("Content-Range", "")
    tail = rng.rpartition("/")[2]
    return int(tail) if tail.isdigit() else None


def _denied(url: str) -> str:
    """Why a store refuses a request (HTTP 401/403), as far as the URL tells."""
    if is_http(url) and "?" in url:
        return "access denied (a signed URL: expired, or signed for another request? sign it again)"
    if url.startswith("gs://"):
        return "access denied (check GOOGLE_APPLICATION_CREDENTIALS or gcloud auth application-default login)"
    if _clouds.locate(url) is not None:
        return "access denied (check AZURE_STORAGE_CONNECTION_STRING / AZURE_STORAGE_KEY / AZURE_STORAGE_SAS_TOKEN)"
    return "access denied (check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_PROFILE)"


def _status_error(url: str, start: int, end: int, status: int, reason: str | None, etag: str | None,
                  request: str | None = None) -> StorageError:
    """The error of an answer no retry mends; ``request`` names it (by default the GET of bytes start-end)."""
    what = {401: _denied(url), 403: _denied(url), 404: "object not found (moved or deleted after indexing?)",
            416: "the object ends before this range (truncated or replaced after indexing?)"}.get(status, "")
    if status == 412 and etag:
        return _replaced(url, etag, "another")
    msg = f"{request or f'GET bytes {start}-{end}'}: HTTP {status} {reason or ''}".rstrip()
    return StorageError(f"{msg}: {what}" if what else msg, path=url, offset=start)


_STATUS = re.compile(r"status code: (\d{3})\s*([^:]*)")
_CREDENTIALS_S = 300  # obstore asks botocore for the credentials again after this long


def _strong(etag: str | None) -> bool:
    """Whether a GET can name ``etag`` in If-Match: a strong one (``If-Match`` compares
    strongly, so a weak ``W/"..."`` never matches; those are compared on the answer)."""
    return bool(etag) and not etag.startswith("W/")


def _same_version(got: str, recorded: str) -> bool:
    """The weak comparison of two ETags (their opaque tags equal, ``W/`` aside)."""
    return got.removeprefix("W/") == recorded.removeprefix("W/")


class _PreconditionFailed(StorageError):
    """HTTP 412 to a GET that named the indexed version: the object was replaced, or (as
    Azurite answers) deleted."""


def _replaced(url: str, etag: str, now: str) -> StorageError:
    """The error of an object whose version ``now`` is not the indexed ``etag`` (``now``
    ``"another"``: a precondition failed, and the answer does not say which)."""
    kind = _PreconditionFailed if now == "another" else StorageError
    return kind(f"object replaced after indexing: ETag was {etag}, is now {now}; index it again", path=url)


def _botocore_reason(exc: Exception) -> str:
    resp = getattr(exc, "response", None)
    if isinstance(resp, dict):
        status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
        code = resp.get("Error", {}).get("Code", "")
        return f"HTTP {status} {code}".strip()
    return f"{type(exc).__name__}: {exc}"


# the process's clients, one per settings in use, the most recent few kept; and the
# versions of the objects they listed or asked about
_clients: OrderedDict[ClientSettings, Client] = OrderedDict()
_seen: dict[str, ObjectInfo] = {}
_client_lock = RenewedLock()
_CLIENTS_KEPT = 8


def reset_client() -> None:
    """Forget this process's clients and the objects they saw, so that the next URL read
    makes a new one: after the endpoint or the credentials in the environment changed."""
    with _client_lock:
        _forget_clients()


def _forget_clients() -> None:
    global _clients, _seen
    _clients, _seen = OrderedDict(), {}


_obstore_used = False  # whether this process made an obstore client
_obstore_inherited = False  # whether a process this one was forked from had


class _ForkHook:
    def _after_fork(self) -> None:
        global _obstore_inherited
        _obstore_inherited = _obstore_inherited or _obstore_used
        # a parent's connections and locks are not this child's (nor is _client_lock, which
        # may be renewed after this: not taken here)
        _forget_clients()


_fork_hook = _ForkHook()
renew_after_fork(_fork_hook)


def client(settings: ClientSettings | None = None) -> Client:
    """This process's client for ``settings``, by default those in effect here (botocore
    and obstore are imported here, on first use). Code that reads on worker threads,
    whose settings are not the caller's, takes ``client_settings()`` in the caller's
    context and passes them."""
    if settings is None:
        settings = client_settings()
    with _client_lock:
        got = _clients.get(settings)
        if got is None:
            got = _clients[settings] = Client(settings, _seen)
            while len(_clients) > _CLIENTS_KEPT:
                _clients.popitem(last=False)
        _clients.move_to_end(settings)
        return got


def object_versions(paths: Sequence[str]) -> dict[str, Any]:
    """``{"remote": {"etags": [...], "sizes": [...]}}`` for an index's meta when
    ``paths`` are URLs (their versions as seen at indexing), else ``{}``."""
    if not paths or not is_url(paths[0]):
        return {}
    c = client()
    infos = [c.known(p) for p in paths]
    return {"remote": {"etags": [i.etag for i in infos], "sizes": [i.size for i in infos]}}


class RemoteFile:
    """A remote object opened for indexing: ``pread``/``read``/``seek`` by ranged GETs
    through a read-ahead window of ``window`` bytes. ``size`` and ``etag`` are the
    object's."""

    def __init__(self, url: str, window: int = 1 << 20) -> None:
        self.url = url
        self._client = client()
        info = self._client.head(url)
        self.size, self.etag = info.size, info.etag
        self._window = window
        self._at, self._buf = 0, b""
        self._pos = 0

    def pread(self, n: int, offset: int) -> bytes:
        """Up to ``n`` bytes from byte ``offset`` (fewer at the end of the object)."""
        n = max(0, min(n, self.size - offset))
        if not n:
            return b""
        if not (self._at <= offset and offset + n <= self._at + len(self._buf)):
            length = min(max(n, self._window), self.size - offset)
            buf = bytearray(length)
            self._client.get_into(self.url, offset, memoryview(buf), self.etag)
            self._at, self._buf = offset, bytes(buf)
        return self._buf[offset - self._at: offset - self._at + n]

    def read(self, n: int = -1) -> bytes:
        n = self.size - self._pos if n < 0 else n
        data = self.pread(n, self._pos)
        self._pos += len(data)
        return data

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else (self._pos + pos if whence == 1 else self.size + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __iter__(self) -> Iterator[bytes]:
        """The lines from the current position (the rest is read whole: for small files)."""
        return iter(io.BytesIO(self.read()))

    def close(self) -> None:
        self._buf = b""

    def __enter__(self) -> RemoteFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteBackend:
    """Executes read plans on remote objects into host buffers.

    With the cache tier on (``remote_cache``), each task's blocks are made present in
    the node-local cache (downloaded once per node, many in flight) and the plan is
    then read from the cache files by the posix backend. Without it, each task is one
    ranged GET straight into the buffer; the Reader plans those with ``remote_gap``
    (near extents merged) and ``remote_part`` (long reads split).
    """

    name = "remote"
    align = 1

    def __init__(self, threads: int | None = None) -> None:
        self.threads = max(1, config.get("remote_requests") if threads is None else threads)
        self.use_cache = config.get("remote_cache")
        # the client settings of this backend's GETs, which run on its threads
        self._settings = settings = client_settings()
        self._cache: Any = None
        if self.use_cache:
            from gpuio.storage.cache import BlockCache

            self._cache = BlockCache(lambda *args: client(settings).get(*args))
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        # per index file table, the cache's view of its objects: (the table, its versions, Objects)
        self._objects: OrderedDict[int, tuple[Any, Any, Any]] = OrderedDict()
        # the plans' settings in force where the backend is made (a Reader's, as it takes its own)
        self._plan_settings = {name: config.get(name) for name in ("merge_gap", "task_size", "read_parts", "remote_gap",
                                                                   "remote_part")}
        renew_after_fork(self)

    def _after_fork(self) -> None:
        self._pool = None
        self._lock = threading.Lock()

    def _executor(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="gpuio-remote")
            return self._pool

    def plan(self, file: np.ndarray, offset: np.ndarray, length: np.ndarray) -> ReadPlan:
        """The plan of one batch's extents: through the cache, as for local files (the
        reads are local); without it, extents within ``remote_gap`` of each other are
        one GET and GETs longer than ``remote_part`` are split into parts of that size."""
        given = self._plan_settings
        if self.use_cache:
            return build_plan(file, offset, length, gap=given["merge_gap"], task_size=given["task_size"],
                              parts=given["read_parts"])
        part = max(1, given["remote_part"])
        return build_plan(file, offset, length, gap=given["remote_gap"], task_size=part,
                          parts=int(length.sum()) // part + 1)

    def read(self, plan: ReadPlan, paths: PathTable, lease: Lease, versions: dict[str, Any] | None) -> None:
        """Fill the host buffer ``lease`` as the plan says; ``versions``: the index's
        ``meta["remote"]`` (ETags and sizes at indexing), or None."""
        if len(plan) == 0:
            return
        if self._cache is not None:
            self._cache.read(plan, self._objects_of(paths, versions), lease, self._executor())
            return
        unique, inverse = np.unique(plan.task_file, return_inverse=True)
        urls = paths.many(unique)
        c = client(self._settings)
        infos = [self._info(c, urls[k], int(unique[k]), versions) for k in range(len(unique))]
        view = memoryview(lease.array)
        files, offsets = inverse.tolist(), plan.task_offset.tolist()
        lengths, dests, needs = plan.task_length.tolist(), plan.task_dest.tolist(), plan.task_need.tolist()

        def get(k: int) -> None:
            info = infos[files[k]]
            n = min(lengths[k], max(needs[k], info.size - offsets[k]))  # merge gaps never run past the end
            c.get_into(info.url, offsets[k], view[dests[k]: dests[k] + n], info.etag)

        futures = [self._executor().submit(get, k) for k in range(len(plan))]
        _first_error(futures)

    def prefetch(self, file: np.ndarray, offset: np.ndarray, length: np.ndarray, paths: PathTable,
                 versions: dict[str, Any] | None) -> int:
        """Fetch the blocks of these extents into the cache in the background (see
        ``BlockCache.prefetch``); returns the bytes started (0 with the cache off)."""
        if self._cache is None or not len(file):
            return 0
        return self._cache.prefetch(self._objects_of(paths, versions), file, offset, length)

    def _objects_of(self, paths: PathTable, versions: dict[str, Any] | None) -> Any:
        """The cache's view of the objects of ``paths`` (``cache.Objects``), made once per
        index: sizes and ETags as the index recorded them, else as this process knows them."""
        with self._lock:
            got = self._objects.get(id(paths))
            if got is not None and got[0]() is paths and got[1] is versions:
                self._objects.move_to_end(id(paths))
                return got[2]
        from gpuio.storage.cache import Objects

        n = len(paths)
        if versions is not None and len(versions.get("etags", ())) == n:
            sizes, etags = versions["sizes"], versions["etags"]
        else:  # an index made without its objects' versions: as listed, opened or asked now
            c = client(self._settings)
            infos = [c.known(url) for url in paths]
            sizes, etags = [i.size for i in infos], [i.etag for i in infos]
        objects = Objects(paths, sizes, etags, self._cache.block)
        with self._lock:
            self._objects[id(paths)] = (weakref.ref(paths), versions, objects)
            while len(self._objects) > _INDEXES_KEPT:
                self._objects.popitem(last=False)
        return objects

    @staticmethod
    def _info(c: Client, url: str, file_id: int, versions: dict[str, Any] | None) -> ObjectInfo:
        if versions is not None and file_id < len(versions.get("etags", ())):
            return ObjectInfo(url, int(versions["sizes"][file_id]), versions["etags"][file_id])
        return c.known(url)

    def close(self) -> None:
        if self._cache is not None:
            self._cache.close()
        with self._lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None


def _first_error(futures: list[Any]) -> None:
    """Wait for every future; raise the first one's error, in submission order."""
    first: BaseException | None = None
    for fut in futures:
        exc = fut.exception()
        if exc is not None and first is None:
            first = exc
    if first is not None:
        raise first
