"""Google Cloud Storage and Azure Blob Storage for ``gpuio.storage.remote``: where a
URL's object lives, how a request for it is addressed and signed, and how a listing's
answer reads. The requests themselves (retries, ranges, checks) are remote's.

- ``gs://bucket/key``: GCS's JSON API (``storage/v1``; the one gcp-storage-emulator and
  GCS both serve). The endpoint is ``STORAGE_EMULATOR_HOST`` where set (as the Google
  Cloud SDKs read it: no credentials then), else ``https://storage.googleapis.com``; the
  credentials are google-auth's application default credentials
  (``GOOGLE_APPLICATION_CREDENTIALS``, ``gcloud auth application-default login``, a
  metadata server). An object's version is its generation (``ifGenerationMatch``,
  ``x-goog-generation``).
- ``az://container/key``, ``abfs[s]://container[@account.dfs.core.windows.net]/key``,
  ``https://account.blob.core.windows.net/container/key``: the Blob service. The account,
  its key or a SAS token and the endpoint come from ``AZURE_STORAGE_CONNECTION_STRING``
  (``AccountName``, ``AccountKey``, ``SharedAccessSignature``, ``BlobEndpoint``,
  ``UseDevelopmentStorage=true``), else ``AZURE_STORAGE_ACCOUNT`` (or
  ``AZURE_STORAGE_ACCOUNT_NAME``), ``AZURE_STORAGE_KEY`` (or ``AZURE_STORAGE_ACCOUNT_KEY``)
  and ``AZURE_STORAGE_SAS_TOKEN``, as the Azure CLI and SDKs read them; an account named
  by the URL is that account. Requests are signed with the account key (Shared Key) or
  carry the SAS token; neither (or ``remote_unsigned``): anonymous, a public container.
"""

from __future__ import annotations

import json
import os
import re
import threading
import urllib.parse
from typing import Any, NamedTuple

from gpuio.errors import ConfigError, DependencyError, StorageError

__all__: list[str] = []

CLOUD_SCHEMES = ("gs://", "az://", "abfs://", "abfss://")
_AZURE_HOST = re.compile(r"^([a-z0-9]+)\.(?:blob|dfs)\.core\.windows\.net$")
_GCS_BASE = "https://storage.googleapis.com"
_GCS_SCOPE = "https://www.googleapis.com/auth/devstorage.read_only"
_AZURE_VERSION = "2021-08-06"  # the Blob service's API version the requests name
# the storage emulator's well-known account (UseDevelopmentStorage=true), as the Azure SDKs hold it
_DEV_ACCOUNT = "devstoreaccount1"
_DEV_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
_DEV_ENDPOINT = "http://127.0.0.1:10000/devstoreaccount1"
# the headers Shared Key signs by position (the Blob service's string-to-sign)
_SIGNED = ("content-encoding", "content-language", "content-length", "content-md5", "content-type", "date",
           "if-modified-since", "if-match", "if-none-match", "if-unmodified-since", "range")


class Location(NamedTuple):
    """A GCS or Azure object or prefix: ``kind`` (``"gs"``, ``"az"``), the Azure account
    the URL names (else ``""``), the bucket or container, the key (unquoted) and the
    URL's text before the key (a listed object's URL is that plus its key)."""

    kind: str
    account: str
    bucket: str
    key: str
    head: str


def locate(url: str) -> Location | None:
    """The location of a GCS or Azure URL; None for any other URL (an https URL with a
    query, such as one signed with a SAS token, is a plain HTTP object)."""
    if url.startswith("gs://"):
        bucket, _, key = url[5:].partition("/")
        if not bucket:
            raise ConfigError(f"{url!r}: a gs URL names a bucket, gs://bucket/key")
        return Location("gs", "", bucket, key, f"gs://{bucket}/")
    if url.startswith(("az://", "abfs://", "abfss://")):
        scheme, _, rest = url.partition("://")
        where, _, key = rest.partition("/")
        container, _, host = where.partition("@")
        m = _AZURE_HOST.match(host)
        if not container or (host and m is None):
            raise ConfigError(f"{url!r}: an Azure URL names a container, az://container/key or "
                              f"abfs://container@account.dfs.core.windows.net/key")
        return Location("az", m.group(1) if m else "", container, key, f"{scheme}://{where}/")
    if url.startswith("https://") and "?" not in url:
        parts = urllib.parse.urlsplit(url)
        m = _AZURE_HOST.match(parts.netloc)
        if m is None:
            return None
        container, _, key = parts.path.lstrip("/").partition("/")
        if not container:
            raise ConfigError(f"{url!r}: an Azure blob URL names a container, "
                              f"https://account.blob.core.windows.net/container/key")
        return Location("az", m.group(1), container, urllib.parse.unquote(key),
                        f"https://{parts.netloc}/{container}/")
    return None


def listed_url(loc: Location, key: str) -> str:
    """The URL of the object ``key`` listed under ``loc``, in the style of ``loc``'s URL."""
    return loc.head + (urllib.parse.quote(key) if loc.head.startswith("https://") else key)


class GCS:
    """GCS's JSON API: its endpoint, the request URLs and the bearer token."""

    def __init__(self, unsigned: bool, pool: Any) -> None:
        emulator = os.environ.get("STORAGE_EMULATOR_HOST", "").rstrip("/")
        if emulator and "://" not in emulator:
            emulator = f"http://{emulator}"
        self.base = emulator or _GCS_BASE
        self.anonymous = unsigned or bool(emulator)
        self._pool = pool
        self._credentials: Any = None
        self._lock = threading.Lock()

    def _object(self, loc: Location) -> str:
        return (f"{self.base}/storage/v1/b/{urllib.parse.quote(loc.bucket, safe='')}/o/"
                f"{urllib.parse.quote(loc.key, safe='')}")

    def address(self, loc: Location, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """The media GET of ``loc`` (a Range in ``headers`` kept; an If-Match, the
        generation the index recorded, as ``ifGenerationMatch``), with the credentials."""
        headers = dict(headers)
        url = f"{self._object(loc)}?alt=media"
        generation = headers.pop("If-Match", "")
        if generation:
            url += f"&ifGenerationMatch={urllib.parse.quote(generation)}"
        return url, self.sign(headers)

    def metadata(self, loc: Location) -> tuple[str, dict[str, str]]:
        """The request of ``loc``'s metadata (JSON: size, generation)."""
        return self._object(loc), self.sign({})

    def listing(self, loc: Location, marker: str) -> tuple[str, dict[str, str]]:
        """The request of one page of the objects under ``loc``'s key (``marker``: the
        page token the last page gave, else ``""``)."""
        query = {"prefix": loc.key, **({"pageToken": marker} if marker else {})}
        return (f"{self.base}/storage/v1/b/{urllib.parse.quote(loc.bucket, safe='')}/o?"
                f"{urllib.parse.urlencode(query)}", self.sign({}))

    @staticmethod
    def page(loc: Location, body: bytes, url: str) -> tuple[list[tuple[str, int, str]], str]:
        """``([(url, size, generation)], next marker)`` of a listing page."""
        try:
            doc = json.loads(body)
            items = [(listed_url(loc, i["name"]), int(i["size"]), str(i["generation"]))
                     for i in doc.get("items", ())]
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"a listing answer GCS's JSON API does not give: {exc}", path=url) from exc
        return items, doc.get("nextPageToken", "")

    @staticmethod
    def info(body: bytes, url: str) -> tuple[int, str]:
        """(size, generation) of an object's metadata."""
        try:
            doc = json.loads(body)
            return int(doc["size"]), str(doc["generation"])
        except (ValueError, KeyError, TypeError) as exc:
            raise StorageError(f"object metadata GCS's JSON API does not give: {exc}", path=url) from exc

    def sign(self, headers: dict[str, str]) -> dict[str, str]:
        """``headers`` with the bearer token of the application default credentials
        (google-auth; refreshed when it expires); as they are for the emulator or unsigned."""
        if self.anonymous:
            return headers
        with self._lock:
            if self._credentials is None:
                try:
                    import google.auth
                    import google.auth.exceptions
                except ImportError as exc:
                    raise DependencyError(f"reading gs:// URLs needs the gpuio[remote] extra "
                                          f"(pip install 'gpuio[remote]'): {exc}") from exc
                try:
                    self._credentials, _ = google.auth.default(scopes=[_GCS_SCOPE])
                except google.auth.exceptions.DefaultCredentialsError as exc:
                    raise StorageError(f"no Google credentials found (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth "
                                       f"application-default login, a metadata server); for a public bucket set "
                                       f"GPUIO_REMOTE_UNSIGNED=1: {exc}", path="gs://") from exc
            if not self._credentials.valid:
                import google.auth.exceptions
                import google.auth.transport.urllib3

                try:
                    self._credentials.refresh(google.auth.transport.urllib3.Request(self._pool))
                except google.auth.exceptions.GoogleAuthError as exc:
                    raise StorageError(f"cannot get a Google access token: {exc}", path="gs://") from exc
            return {**headers, "Authorization": f"Bearer {self._credentials.token}"}


class Azure:
    """The Blob service of the account of the environment (or of a URL): endpoints,
    request URLs, Shared Key signatures and SAS tokens."""

    def __init__(self, unsigned: bool) -> None:
        env = os.environ
        conn = env.get("AZURE_STORAGE_CONNECTION_STRING", "")
        fields = dict(p.split("=", 1) for p in conn.split(";") if "=" in p)
        if fields.get("UseDevelopmentStorage", "").lower() == "true":
            fields = {"AccountName": _DEV_ACCOUNT, "AccountKey": _DEV_KEY, "BlobEndpoint": _DEV_ENDPOINT, **fields}
        self._endpoint = fields.get("BlobEndpoint", "").rstrip("/")
        self.account = fields.get("AccountName") or _endpoint_account(self._endpoint) or env.get(
            "AZURE_STORAGE_ACCOUNT") or env.get("AZURE_STORAGE_ACCOUNT_NAME", "")
        self.key = "" if unsigned else fields.get("AccountKey") or env.get("AZURE_STORAGE_KEY") or env.get(
            "AZURE_STORAGE_ACCOUNT_KEY", "")
        self.sas = "" if unsigned else (fields.get("SharedAccessSignature") or env.get("AZURE_STORAGE_SAS_TOKEN", "")
                                        ).lstrip("?")
        self._protocol = fields.get("DefaultEndpointsProtocol", "https")
        self._suffix = fields.get("EndpointSuffix", "core.windows.net")
        self.described = "AZURE_STORAGE_CONNECTION_STRING" if conn else "AZURE_STORAGE_ACCOUNT"

    def account_of(self, loc: Location) -> str:
        account = loc.account or self.account
        if not account:
            raise ConfigError(f"{loc.head}: no Azure storage account: set AZURE_STORAGE_CONNECTION_STRING or "
                              f"AZURE_STORAGE_ACCOUNT, or name it in the URL "
                              f"(https://account.blob.core.windows.net/container/key)")
        return account

    def endpoint(self, loc: Location) -> str:
        """The Blob service endpoint of ``loc``'s account (may end in a path: the emulator's)."""
        account = self.account_of(loc)
        if self._endpoint and account == self.account:
            return self._endpoint
        return f"{self._protocol}://{account}.blob.{self._suffix}"

    def credentials(self, loc: Location) -> tuple[str, str]:
        """(account key, SAS token) for ``loc``'s account: the environment's where the
        account is the environment's; none for another."""
        return (self.key, self.sas) if self.account_of(loc) == self.account else ("", "")

    def address(self, loc: Location, headers: dict[str, str], method: str = "GET") -> tuple[str, dict[str, str]]:
        """The signed request of the blob ``loc`` (``headers``: Range, If-Match)."""
        url = f"{self.endpoint(loc)}/{urllib.parse.quote(loc.bucket)}/{urllib.parse.quote(loc.key)}"
        return self.sign(method, url, loc, headers)

    def listing(self, loc: Location, marker: str) -> tuple[str, dict[str, str]]:
        """The request of one page of the blobs under ``loc``'s key (``marker``: the
        NextMarker the last page gave, else ``""``)."""
        query = {"restype": "container", "comp": "list", "prefix": loc.key, **({"marker": marker} if marker else {})}
        url = f"{self.endpoint(loc)}/{urllib.parse.quote(loc.bucket)}?{urllib.parse.urlencode(query)}"
        return self.sign("GET", url, loc, {})

    @staticmethod
    def page(loc: Location, body: bytes, url: str) -> tuple[list[tuple[str, int, str]], str]:
        """``([(url, size, ETag)], next marker)`` of a listing page; ETags quoted, as
        the Blob service's headers give them."""
        import xml.etree.ElementTree as ElementTree  # here: import gpuio stays quick

        try:
            root = ElementTree.fromstring(body)
            items = []
            for blob in root.iter("Blob"):
                props = blob.find("Properties")
                etag = props.findtext("Etag", "").strip('"')
                items.append((listed_url(loc, blob.findtext("Name", "")), int(props.findtext("Content-Length", "")),
                              f'"{etag}"' if etag else ""))
        except (ElementTree.ParseError, AttributeError, ValueError) as exc:
            raise StorageError(f"a listing answer the Blob service does not give: {exc}", path=url) from exc
        return items, root.findtext("NextMarker", "") or ""

    def sign(self, method: str, url: str, loc: Location, headers: dict[str, str]) -> tuple[str, dict[str, str]]:
        """``(url, headers)`` authorized: Shared Key with the account key, else the SAS
        token in the query, else as they are (anonymous)."""
        key, sas = self.credentials(loc)
        headers = {**headers, "x-ms-version": _AZURE_VERSION}
        if key:
            import email.utils  # here, as ElementTree: import gpuio stays quick

            headers["x-ms-date"] = email.utils.formatdate(usegmt=True)
            signature = _shared_key(key, self.account, method, url, headers)
            headers["Authorization"] = f"SharedKey {self.account}:{signature}"
        elif sas:
            url += ("&" if "?" in url else "?") + sas
        return url, headers


def _endpoint_account(endpoint: str) -> str:
    """The account a Blob endpoint names, as the Azure SDKs read it: its host's first
    label (``account.blob.core.windows.net``), or the first segment of its path where the
    host is an address (an emulator's ``http://127.0.0.1:10000/account``); ``""`` if none."""
    parts = urllib.parse.urlsplit(endpoint)
    m = _AZURE_HOST.match(parts.hostname or "")
    if m is not None:
        return m.group(1)
    return parts.path.strip("/").split("/")[0] if parts.hostname else ""


def _shared_key(key: str, account: str, method: str, url: str, headers: dict[str, str]) -> str:
    """The Shared Key signature of a Blob service request (its string-to-sign: the verb,
    the standard headers by position, the ``x-ms-`` headers sorted, the account and the
    URL's path, the query parameters sorted)."""
    import base64  # here, as the others: import gpuio stays quick
    import hashlib
    import hmac

    lower = {k.lower(): v.strip() for k, v in headers.items()}
    parts = urllib.parse.urlsplit(url)
    resource = f"/{account}{parts.path or '/'}"
    query = urllib.parse.parse_qs(parts.query, keep_blank_values=True)
    for name in sorted(query, key=str.lower):
        resource += f"\n{name.lower()}:{','.join(sorted(query[name]))}"
    lines = [method, *(lower.get(h, "") for h in _SIGNED),
             *(f"{k}:{v}" for k, v in sorted(lower.items()) if k.startswith("x-ms-")), resource]
    try:
        secret = base64.b64decode(key, validate=True)
    except ValueError as exc:
        raise ConfigError(f"the Azure account key of {account!r} is not base64: {exc}") from exc
    return base64.b64encode(hmac.new(secret, "\n".join(lines).encode(), hashlib.sha256).digest()).decode()
