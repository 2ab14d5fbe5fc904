"""gpuio.serve: the ops (and a model) in Triton Inference Server, through PyTriton.

In-process tests check ``serve.Pipeline`` and the batcher against the offline ``Loader``
(torch models included, where torch is). The server tests start the real server with
``gpuio serve`` under the Python 3.12 environment of ``tests/serve_env.py`` (PyTriton's
Triton loads models only under 3.12), on 127.0.0.1 with free ports, and send requests
with tritonclient over HTTP and gRPC from concurrent clients.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import gpuio
from gpuio import formats, serve
from gpuio.errors import ConfigError, DataError, DependencyError, FormatError
from gpuio.sample import make_image_tree

from serve_env import ensure, free_ports

OPS = "decode_image(), resize(40), center_crop(32), normalize([123.7, 116.3, 103.5], [58.4, 57.1, 57.4])"
CORRUPT = b"\xff\xd8\xff\xe0" + b"\x00" * 200  # a JPEG start, then nothing a decoder can use

MODEL_PY = '''
import numpy as np

def classify(x):  # exact in any NumPy: per-channel max and min, [N, 6]; refuses an all-white image
    x = np.asarray(x)
    if (x.reshape(len(x), -1).min(axis=1) > 2.0).any():
        raise ValueError("/srv/models/classify.py: an all-white image")
    return np.concatenate([x.max(axis=(2, 3)), x.min(axis=(2, 3))], axis=1)
'''


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """24 JPEGs from the sample writer (gray, progressive, CMYK, EXIF-rotated ones too),
    and the offline pipeline's output for each (a Loader with the same ops)."""
    root = make_image_tree(tmp_path_factory.mktemp("serve-images"), count=24, classes=2, progress=False)
    index = formats.filetree(root)
    loader = gpuio.Loader(index, 24, ops=serve.parse_ops(OPS), output="numpy")
    (batch,) = list(loader)
    encoded = [open(index.extent(i).file, "rb").read() for i in range(len(index))]
    return encoded, np.asarray(batch["image"])


def classify(x):
    namespace: dict = {}
    exec(MODEL_PY, namespace)
    return namespace["classify"](x)


# ---- in process ------------------------------------------------------------------------


def test_pipeline_equals_the_loader_and_rejects_only_the_bad_image(images):
    encoded, offline = images
    pipe = serve.Pipeline(serve.parse_ops(OPS))
    out = pipe(encoded[:5] + [CORRUPT] + encoded[5:])
    assert isinstance(out[5], FormatError) and "image 5" in str(out[5]) and "cannot decode" in str(out[5])
    got = np.stack(out[:5] + out[6:])
    assert got.dtype == np.float32 and np.array_equal(got, offline)


def submit_concurrently(batcher, requests, error):
    """Each request (a list of encoded images) from 8 threads at once; its result, or the
    ``error`` it raised. Closes the batcher."""
    def request(rows):
        try:
            return batcher.submit([np.frombuffer(r, np.uint8) for r in rows])
        except error as exc:
            return exc

    try:
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(request, requests))
    finally:
        batcher.close()


def test_batcher_merges_concurrent_requests_and_isolates_errors(images):
    encoded, offline = images
    batcher = serve.Batcher(serve.Pipeline(serve.parse_ops(OPS)), max_batch=64, workers=1)
    requests = [[CORRUPT] if i == 7 else [encoded[i], CORRUPT] if i == 9 else [encoded[i]] for i in range(24)]
    results = submit_concurrently(batcher, requests, FormatError)
    # each bad request's error names the image by its place in that request
    assert isinstance(results[7], FormatError) and "image 0: cannot decode image" in str(results[7])
    assert isinstance(results[9], FormatError) and "image 1: cannot decode image" in str(results[9])
    for i, r in enumerate(results):
        if i not in (7, 9):
            assert r.shape == (1, 3, 32, 32) and np.array_equal(r[0], offline[i]), i
    assert batcher.images == 25 and batcher.batches < 24  # requests in flight were merged


def test_a_model_error_fails_only_its_own_request(images):
    import simplejpeg

    encoded, offline = images
    white = simplejpeg.encode_jpeg(np.full((48, 48, 3), 255, np.uint8))

    def model(x):  # refuses a batch holding a white image
        if (x.reshape(len(x), -1).min(axis=1) > 2.0).any():
            raise ValueError("a white image")
        return classify(x)

    batcher = serve.Batcher(serve.Pipeline(serve.parse_ops(OPS), model=model), workers=1)
    results = submit_concurrently(batcher, [[white if i == 5 else encoded[i]] for i in range(24)], ValueError)
    assert isinstance(results[5], ValueError) and "a white image" in str(results[5])
    expected = classify(offline)
    assert all(np.array_equal(r[0], expected[i]) for i, r in enumerate(results) if i != 5)


def test_outputs_of_different_shapes_for_a_model_or_one_response_name_the_fix():
    import simplejpeg

    small, large = (simplejpeg.encode_jpeg(np.full((h, 40, 3), 9, np.uint8)) for h in (24, 32))
    with pytest.raises(ConfigError, match=r"the model's inputs have different shapes \(\[\(24, 40, 3\), "
                                          r"\(32, 40, 3\)\]\): end the ops with a resize or crop"):
        serve.Pipeline([gpuio.ops.decode_image()], model=classify)([small, large])
    batcher = serve.Batcher(serve.Pipeline([gpuio.ops.decode_image()]))
    try:
        with pytest.raises(ConfigError, match="the outputs of one request's images have different shapes"):
            batcher.submit([np.frombuffer(small, np.uint8), np.frombuffer(large, np.uint8)])
        assert batcher.submit([np.frombuffer(large, np.uint8)]).shape == (1, 32, 40, 3)  # the batcher goes on
    finally:
        batcher.close()


def test_pipeline_with_a_callable_model(images):
    encoded, offline = images
    out = serve.Pipeline(serve.parse_ops(OPS), model=classify)(encoded)
    assert np.array_equal(np.stack(out), classify(offline))


@pytest.mark.filterwarnings("ignore:`torch.jit:DeprecationWarning")
@pytest.mark.parametrize("kind", ["torchscript", "export"])
def test_pipeline_with_a_torch_model_file(images, tmp_path, kind):
    import torch
    encoded, offline = images

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.conv = torch.nn.Conv2d(3, 4, 3)
            self.fc = torch.nn.Linear(4, 10)

        def forward(self, x):
            return self.fc(self.conv(x).mean(dim=(2, 3)))

    net = Net().eval()
    example = torch.from_numpy(offline[:2])
    if kind == "torchscript":
        path = str(tmp_path / "net.pt")
        torch.jit.save(torch.jit.trace(net, example), path)
    else:
        path = str(tmp_path / "net.pt2")
        batch = torch.export.Dim("batch", min=1, max=1024)
        torch.export.save(torch.export.export(net, (example,), dynamic_shapes=({0: batch},)), path)
    pipe = serve.Pipeline(serve.parse_ops(OPS), model=path)
    assert isinstance(pipe.model, torch.nn.Module)
    out = pipe(encoded)
    with torch.inference_mode():
        expected = net(torch.from_numpy(offline)).numpy()
    assert all(isinstance(r, np.ndarray) and r.shape == (10,) for r in out)
    np.testing.assert_allclose(np.stack(out), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_pipeline_on_the_gpu_agrees_with_the_cpu(images):
    import torch
    encoded, offline = images
    seen = []

    def model(x):  # gets a CUDA tensor over the ops' output (DLPack, no host copy)
        seen.append((x.device.type, x.shape))
        return x.mean(dim=(2, 3))

    net = torch.nn.Module()
    net.forward = model
    out = serve.Pipeline(serve.parse_ops(OPS), model=net, device="cuda")(encoded + [CORRUPT])
    assert seen == [("cuda", torch.Size([24, 3, 32, 32]))]
    assert isinstance(out[-1], FormatError)
    # decoders differ within JPEG's tolerances (see ops.decode): means agree closely
    np.testing.assert_allclose(np.stack(out[:-1]), offline.mean(axis=(2, 3)), atol=0.05)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="NameError"):
        serve.parse_ops("decode_image(), no_such_op(3)")
    with pytest.raises(ConfigError, match="no ops"):
        serve.parse_ops("")
    with pytest.raises(ConfigError, match="no such file"):
        serve.load_model(str(tmp_path / "missing.pt2"))
    (tmp_path / "m.py").write_text(MODEL_PY)
    with pytest.raises(ConfigError, match="no callable 'nope'"):
        serve.load_model(f"{tmp_path / 'm.py'}:nope")
    assert serve.load_model(f"{tmp_path / 'm.py'}:classify")(np.ones((1, 3, 2, 2))).shape == (1, 6)
    (tmp_path / "m.onnx").write_bytes(b"")
    with pytest.raises(ConfigError, match="use a .pt2"):
        serve.load_model(str(tmp_path / "m.onnx"))
    with pytest.raises(ConfigError, match="instances"):
        serve.Server(serve.parse_ops(OPS), instances=0)
    batcher = serve.Batcher(serve.Pipeline(serve.parse_ops(OPS)))
    try:  # an empty request is the client's error (DataError), and the message says what to send
        for shape in ((0, 16), (1, 0)):
            with pytest.raises(DataError, match=rf"a request of shape \[{shape[0]}, {shape[1]}\] holds no image: send "
                                                r"uint8 \[n, L\] with n >= 1 images of L >= 1 bytes"):
                batcher.submit(np.zeros(shape, np.uint8))
    finally:
        batcher.close()


@pytest.mark.skipif(sys.version_info[:2] == (3, 12), reason="checks the message given under other Pythons")
def test_server_outside_python_312_says_why():
    with pytest.raises(DependencyError, match="Python 3.12"):
        serve.Server(serve.parse_ops(OPS)).start()


def test_a_port_in_use_is_refused_before_triton_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ConfigError, match=f"grpc port {port} on 127.0.0.1 cannot be used"):
            serve.Server(serve.parse_ops(OPS), address="127.0.0.1", http_port=0, grpc_port=port,
                         metrics_port=0).start()


def test_import_gpuio_does_not_import_pytriton():
    code = "import sys, gpuio, gpuio.serve, gpuio.cli; print(sorted(m for m in sys.modules if 'triton' in m))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


# ---- the real server ---------------------------------------------------------------------


def _descendants(pid):
    """Pids of every process under ``pid`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def _segments(pids):
    """The /dev/shm files the processes ``pids`` have mapped."""
    found = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                found |= {line.split(None, 5)[5].strip().removesuffix(" (deleted)") for line in f
                          if "/dev/shm/" in line}
        except OSError:
            continue
    return found


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


class _Served:
    """``gpuio serve`` running under the 3.12 environment."""

    def __init__(self, python, tmp_path, extra=()):
        import tritonclient.http as http

        self.http, self.grpc, metrics = free_ports(3)
        self.log = open(tmp_path / "server.log", "w+")
        cmd = [python, "-m", "gpuio.cli", "serve", "--ops", OPS, "--address", "127.0.0.1",
               "--http-port", str(self.http), "--grpc-port", str(self.grpc), "--metrics-port", str(metrics),
               "--instances", "2", *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(tmp_path),
                                     start_new_session=True)
        client = http.InferenceServerClient(f"127.0.0.1:{self.http}")
        deadline = time.monotonic() + 240
        try:
            while True:
                if self.proc.poll() is not None:
                    raise AssertionError(f"gpuio serve exited with {self.proc.returncode}:\n{self.output()}")
                if time.monotonic() > deadline:
                    raise AssertionError(f"gpuio serve not ready after 240 s:\n{self.output()}")
                try:
                    if client.is_model_ready("gpuio"):
                        break
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
                time.sleep(0.5)
        except BaseException:
            self.kill()
            raise
        finally:
            client.close()
        self.processes = _descendants(self.proc.pid)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()[-6000:]

    def stop(self, timeout=120):
        """SIGTERM, as a service manager stops it; its exit status. Records first every process
        under the server and the /dev/shm segments they have mapped."""
        self.processes = sorted(set(self.processes) | set(_descendants(self.proc.pid)))
        self.commands = {p: _cmdline(p) for p in self.processes}
        self.segments = _segments([self.proc.pid, *self.processes])
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)  # a timeout raises; the test's finally kills what is left

    def kill(self):
        """SIGKILL the server and every process it started (Triton's stubs are not in
        its process group), a recorded one only while it still is a Triton process."""
        alive = self.proc.poll() is None
        started = [p for p in getattr(self, "processes", []) if "triton" in _cmdline(p)]
        for pid in (_descendants(self.proc.pid) if alive else []) + started + ([self.proc.pid] if alive else []):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if alive:
            self.proc.wait()
            for leftover in glob.glob(f"/dev/shm/pytrtion{self.proc.pid}-*"):  # a killed Triton's shared memory
                os.unlink(leftover)


@pytest.fixture(scope="module")
def serve_python():
    return ensure()  # makes the 3.12 environment once (minutes); a failure is an error, not a skip


def _infer(protocol, port, rows, output):
    """One request (rows padded to one length) from a client of its own."""
    width = max(len(r) for r in rows)
    data = np.zeros((len(rows), width), np.uint8)
    for i, r in enumerate(rows):
        data[i, :len(r)] = np.frombuffer(r, np.uint8)
    return _infer_array(protocol, port, data, output)


def _infer_array(protocol, port, data, output):
    import tritonclient.grpc as grpc
    import tritonclient.http as http

    mod = http if protocol == "http" else grpc
    client = mod.InferenceServerClient(f"127.0.0.1:{port}")
    try:
        inp = mod.InferInput("images", list(data.shape), "UINT8")
        inp.set_data_from_numpy(data)
        return client.infer("gpuio", [inp]).as_numpy(output)
    finally:
        client.close()


def _send_all(served, images, output):
    """Concurrent clients, HTTP and gRPC alternating: each image alone, one request of
    two images, and a corrupt image (over gRPC, then HTTP) among them."""
    encoded, _ = images
    requests = [[e] for e in encoded] + [[encoded[0], encoded[1]], [CORRUPT], [CORRUPT]]
    order = list(range(len(requests)))
    order[3:3] = [order.pop(), order.pop()]  # the corrupt requests go out among the first, with others in flight
    barrier = threading.Barrier(8)

    def send(pos):
        k = order[pos]
        protocol = "http" if k % 2 == 0 else "grpc"
        if pos < 8:
            barrier.wait()  # the first eight leave together
        try:
            return k, _infer(protocol, served.http if protocol == "http" else served.grpc, requests[k], output)
        except Exception as exc:  # noqa: BLE001 - tritonclient's InferenceServerException, kept for the asserts
            return k, exc

    with ThreadPoolExecutor(8) as pool:
        results = dict(pool.map(send, range(len(order))))
    return [results[k] for k in range(len(requests))]


def _check_stopped(served):
    """SIGTERM exits 0 and leaves no process that ran under the server and none of the shared
    memory segments they had mapped (PyTriton's own are named after the server's pid)."""
    assert served.stop() == 0, served.output()
    # what was checked: the stubs and helpers, and Triton's and PyTriton's shared memory
    assert any("triton_python_backend_stub" in c for c in served.commands.values()), served.commands
    assert any("resource_tracker" in c for c in served.commands.values()), served.commands
    assert any(f"/pytrtion{served.proc.pid}-" in s for s in served.segments), served.segments
    # a resource tracker serving the server's own process sees its pipe close only when the
    # server has exited, then removes what was left and ends: a moment after the server
    deadline = time.monotonic() + 5
    while True:
        left = [p for p in served.processes if _alive(p)]
        left += [p for p in _descendants(1) if f"--http-port={served.http}" in _cmdline(p) and _alive(p)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert not left, f"processes left behind: {[(p, _cmdline(p)) for p in left]}"
    shm = [s for s in served.segments if os.path.exists(s)] + glob.glob(f"/dev/shm/pytrtion{served.proc.pid}-*")
    assert not shm, f"shared memory left behind: {shm}"


def _refused(error, protocol, code, message):
    """``error`` is the server's answer with status ``code`` (``"invalid"``: HTTP 400 / gRPC
    INVALID_ARGUMENT; ``"internal"``: 500 / INTERNAL) and exactly the one line ``message``."""
    from tritonclient.utils import InferenceServerException

    assert isinstance(error, InferenceServerException), error
    status = {("http", "invalid"): "400", ("grpc", "invalid"): "StatusCode.INVALID_ARGUMENT",
              ("http", "internal"): "500", ("grpc", "internal"): "StatusCode.INTERNAL"}[protocol, code]
    assert str(error.status()) == status, (error.status(), str(error))
    assert error.message() == message, error.message()


def _ask(protocol, port, data):
    """The error a request of ``data`` (uint8) gets."""
    try:
        _infer_array(protocol, port, data, "image")
    except Exception as exc:  # noqa: BLE001 - tritonclient's InferenceServerException, checked by the caller
        return exc
    raise AssertionError(f"a request of shape {list(data.shape)} was answered")


@pytest.mark.parametrize("chained", [False, True], ids=["ops", "ops+model"])
def test_server_over_http_and_grpc(serve_python, images, tmp_path, chained):
    """Outputs equal the offline pipeline's (and the model's on them) exactly; the corrupt
    requests fail alone; SIGTERM stops the server and every process under it."""
    import simplejpeg

    (tmp_path / "model.py").write_text(MODEL_PY)
    served = _Served(serve_python, tmp_path, ["--model", f"{tmp_path / 'model.py'}:classify"] if chained else [])
    encoded, offline = images
    expected = classify(offline) if chained else offline
    try:
        assert any("tritonserver" in _cmdline(p) for p in served.processes)
        results = _send_all(served, images, "scores" if chained else "image")
        undecodable = ("image 0: cannot decode image (204 bytes): not an image format Pillow reads (the bytes start "
                       "b'\\xff\\xd8\\xff\\xe0\\x00\\x00\\x00\\x00')")
        for error, protocol in zip(results[-2:], ("grpc", "http")):  # a client error, one line, no traceback
            _refused(error, protocol, "invalid", undecodable)
        for i in range(len(encoded)):
            assert isinstance(results[i], np.ndarray), (i, results[i])
            assert results[i].shape == (1, *expected.shape[1:]), (i, results[i].shape)
            assert np.array_equal(results[i][0], expected[i]), (i, np.abs(results[i][0] - expected[i]).max())
        assert np.array_equal(results[-3], expected[:2])
        bomb = bytearray(simplejpeg.encode_jpeg(np.full((16, 16, 3), 90, np.uint8)))
        sof = bomb.index(b"\xff\xc0")
        bomb[sof + 5: sof + 9] = (60000).to_bytes(2, "big") * 2  # its frame header declares 60000x60000
        for protocol in ("http", "grpc"):
            port = served.http if protocol == "http" else served.grpc
            try:
                _infer(protocol, port, [encoded[2], bytes(bomb)], "image")
            except Exception as exc:  # noqa: BLE001 - checked below
                _refused(exc, protocol, "invalid", f"image 1: image of {len(bomb)} bytes declares 60000x60000 pixels, "
                                                   f"more than gpuio.ops.decode.MAX_PIXELS (178,956,970); raise it "
                                                   f"for such images")
            else:
                raise AssertionError("a request with a 60000x60000 image was answered")
            empty = _ask(protocol, port, np.zeros((1, 0), np.uint8))  # refused by gpuio before PyTriton
            _refused(empty, protocol, "invalid", "a request of shape [1, 0] holds no image: send uint8 [n, L] with "
                                                 "n >= 1 images of L >= 1 bytes, one encoded image per row")
            no_rows = _ask(protocol, port, np.zeros((0, 16), np.uint8))  # refused by Triton before the model
            assert str(no_rows.status()) in ("400", "StatusCode.INVALID_ARGUMENT"), no_rows
            if chained:  # the model's own error: internal, one line, no server path
                white = _ask(protocol, port, np.frombuffer(simplejpeg.encode_jpeg(np.full((48, 48, 3), 255, np.uint8)),
                                                           np.uint8)[None])
                _refused(white, protocol, "internal", "the server failed on this request (ValueError); its log "
                                                      "has the details")
        if chained:
            assert "/srv/models/classify.py: an all-white image" in served.output()  # the log has the traceback
        _check_stopped(served)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nserver log:\n{served.output()}") from None
    finally:
        served.kill()  # after a clean stop there is nothing left to kill


def test_sigterm_as_soon_as_the_model_is_ready_stops_cleanly(serve_python, tmp_path):
    """SIGTERM the moment the model reports ready (the server may still be finishing its start):
    exit status 0 and nothing left behind, with four instances, more than Triton unloads within
    its exit timeout (so gpuio ends the stubs Triton leaves)."""
    served = _Served(serve_python, tmp_path, ["--instances", "4"])
    try:
        _check_stopped(served)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nserver log:\n{served.output()}") from None
    finally:
        served.kill()


def test_serve_help_says_where_it_listens():
    done = subprocess.run([sys.executable, "-m", "gpuio.cli", "serve", "--help"], capture_output=True, text=True,
                          check=True)
    text = " ".join(done.stdout.split())
    assert "(default: 0.0.0.0, all interfaces" in text and "--address 127.0.0.1 serves this machine only" in text


def test_stop_ends_only_tritons_processes(serve_python, tmp_path):
    """Server.stop in an application's own process ends what Triton left, not the
    application's other child processes."""
    script = tmp_path / "app.py"
    script.write_text(f'''
import subprocess, sys
from gpuio import serve
from serve_env import free_ports

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
http, grpc, metrics = free_ports(3)
server = serve.Server(serve.parse_ops({OPS!r}), address="127.0.0.1", http_port=http, grpc_port=grpc,
                      metrics_port=metrics, instances=3)
with server:
    pass
print("child running" if child.poll() is None else f"child ended: {{child.returncode}}")
child.kill()
''')
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    done = subprocess.run([serve_python, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env=env)
    assert done.returncode == 0 and done.stdout.strip().endswith("child running"), done.stdout + done.stderr[-3000:]
