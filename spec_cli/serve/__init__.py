"""`spec serve`: an OpenAI-compatible server over the Engine and `complete()`, on FastAPI and uvicorn.

api.py turns HTTP requests into jobs and their results into OpenAI's objects and stream chunks;
worker.py runs the jobs in its slots, their forwards shared; text.py turns a job's tokens into the text handed out.
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import signal
import socket
import sys
import threading
import time

from spec_cli.core.errors import SpecError
from spec_cli.core.settings import Decoding, Profile

LOOPBACK = ("localhost",)
PARALLEL = 16  # slots: requests decoded at once, their forwards shared (`spec serve --parallel`)


def need_packages():
    """fastapi, uvicorn and greenlet, or one line saying how to get them."""
    try:
        import fastapi  # noqa: F401
        import greenlet  # noqa: F401 - (the slots' requests, decoded in one thread: exec.cohort)
        import uvicorn
    except ImportError as e:
        raise SpecError(f"spec serve needs {e.name}: pip install 'spec-cli[serve]' (fastapi, uvicorn and "
                        "greenlet)") from None
    return uvicorn


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the models load, so a busy port is one line at once."""
    if not 0 <= port <= 65535:
        raise SpecError(f"--port must be between 0 and 65535, not {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise SpecError(f"--host {host}: {e.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise SpecError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


LOADING_BODY = b'{"error": {"message": "spec serve is loading its models; try again shortly", "type": ' \
    b'"unavailable_error", "param": null, "code": "loading"}}'
RETRY_AFTER = 5  # seconds a client told the models are loading waits before it asks again


@contextlib.contextmanager
def answering_loading(sock: socket.socket):
    """While the models load (minutes, a file's first read): every request on `sock` is answered at once with
    503, Retry-After and a JSON error, as llama-server does, so an editor polling /health is told to wait
    instead of hanging on a connection nobody reads. The socket then goes to the server as it is."""
    stop = threading.Event()
    head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: {RETRY_AFTER}"
            f"\r\nConnection: close\r\nContent-Length: {len(LOADING_BODY)}\r\n\r\n").encode()

    def answer() -> None:
        import select

        while not stop.is_set():
            if not select.select([sock], [], [], 0.1)[0]:
                continue
            try:
                connection, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            with connection:
                try:
                    connection.settimeout(2.0)
                    request = b""
                    while b"\r\n\r\n" not in request and len(request) < 65536:
                        chunk = connection.recv(4096)
                        if not chunk:
                            break
                        request += chunk
                    headers, _, body = request.partition(b"\r\n\r\n")
                    length = re.search(rb"(?im)^content-length:\s*(\d+)", headers)
                    left = min(int(length.group(1)), 1 << 20) - len(body) if length else 0
                    while left > 0:  # (read whole: a socket closed on unread bytes resets, losing the answer)
                        chunk = connection.recv(min(left, 65536))
                        if not chunk:
                            break
                        left -= len(chunk)
                    connection.sendall(head + (b"" if request.startswith(b"HEAD ") else LOADING_BODY))
                except OSError:
                    pass

    thread = threading.Thread(target=answer, name="spec-serve-loading", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def build(engine, profiles: dict[bool, Profile], overrides: dict, *, draft2: str | None, template,
          api_key: str | None, max_queue: int, log, debug: bool = False, parallel: int = 1, name: str | None = None):
    """The app and its worker for a loaded engine. `profiles[sampling]`: the profile (with what `spec tune`
    found for greedy or sampling decoding) a request starts from; `overrides`: the command line's settings;
    `name`: the model's name in the API (else the profile's)."""
    from spec_cli.serve.api import Service, create_app, model_aliases
    from spec_cli.serve.worker import Worker

    default_temperature = overrides.get("temperature")
    if default_temperature is None:
        default_temperature = profiles[False].decoding.temperature
    settings_cache: dict[bool, Decoding] = {}

    def defaults(temperature: float | None) -> Decoding:
        sampling = (default_temperature if temperature is None else temperature) > 0
        if sampling not in settings_cache:
            settings_cache[sampling] = profiles[sampling].decoding.replace(**overrides)
        return settings_cache[sampling]

    def plan_for(settings: Decoding):
        return engine.plan(settings, draft2, profile=profiles[settings.temperature > 0])

    worker = Worker(engine, plan_for, log, max_queue=max_queue, debug=debug, parallel=parallel)
    from spec_cli.serve.infill import fim_of

    service = Service(name=name or profiles[False].name, worker=worker, tokenizer=engine.tokenizer,
                      context=engine.oracle.context, defaults=defaults, template=template, encode=engine.encode,
                      log=log, api_key=api_key, created=int(time.time()), debug=debug,
                      fim=fim_of(engine.tokenizer), prefixes=engine.prefix_caches,
                      aliases=model_aliases(profiles[False].oracle.model))
    return create_app(service), worker


def server_class():
    """uvicorn's Server, stopping generations at the first Ctrl-C or SIGTERM and exiting 0 after it."""
    uvicorn = need_packages()

    class Server(uvicorn.Server):
        on_exit = None  # called at the first signal: the worker's stop

        def handle_exit(self, sig, frame) -> None:
            if self.on_exit is not None:
                self.on_exit()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn's own re-raises the signal once it has shut down (the process then dies of it);
            # a server stopped on purpose exits 0
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            handled = (signal.SIGINT, signal.SIGTERM)
            original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
            try:
                yield
            finally:
                for sig, handler in original.items():
                    signal.signal(sig, handler)

    return Server


def make_server(app, worker, debug: bool = False):
    """The uvicorn server for `app`; its first Ctrl-C or SIGTERM (or handle_exit) stops the worker's
    generation at its next step, and uvicorn then waits for the responses to end."""
    uvicorn = need_packages()
    config = uvicorn.Config(app, log_level="info" if debug else "warning", access_log=False,
                            timeout_graceful_shutdown=10, lifespan="off")
    server = server_class()(config)
    server.on_exit = worker.stop
    return server


def serve(server, worker, sock: socket.socket) -> None:
    """Serve until Ctrl-C or SIGTERM: in-flight generations stop at their next step, their responses end
    cleanly, waiting requests get 503; then the worker finishes and this returns."""
    worker.start()
    try:
        server.run(sockets=[sock])
    finally:
        worker.stop()
        worker.join(timeout=10)


def start(profiles: dict[bool, Profile], overrides: dict, *, host: str, port: int, api_key: str | None,
          draft2: str | None, template: str | None, device: str | None, dtype: str | None, max_queue: int,
          debug: bool, compile: bool | None = None, prefix_cache: int = 0, parallel: int | None = None,
          name: str | None = None) -> int:
    """`spec serve`: bind, load the models, serve (called by the CLI); the exit code."""
    need_packages()
    from spec_cli.chat.templates import choose_template, read_template_option
    from spec_cli.core.process import settle
    from spec_cli.decoding.methods import DRAFTED
    from spec_cli.engine import Engine
    from spec_cli.serve.worker import WARM_TEXT
    from spec_cli.view import loading, make_console

    err = make_console(stderr=True)
    option = read_template_option(template)
    if max_queue < 1:
        raise SpecError(f"--queue must be at least 1, not {max_queue}")
    if parallel is not None and parallel < 1:
        raise SpecError(f"--parallel must be at least 1, not {parallel}")
    sock = listen(host, port)
    profile = profiles[False]
    settings = profile.decoding.replace(**overrides)
    with loading(err, profile.name), answering_loading(sock):
        engine = Engine(profile, device=device, dtype=dtype, need_draft=settings.method in DRAFTED,
                        compile=compile, fit_draft2=settings.method == "staged", prefix_cache=prefix_cache)
        plan = engine.plan(settings, draft2)
        engine.warm_up(plan)
        chat_template = choose_template(profile, engine.tokenizer, option)
    if engine.note:
        print(engine.note, file=sys.stderr, flush=True)
    if not engine.shares_forwards():
        if parallel is not None and parallel > 1:  # (asked for: say why not)
            print(f"spec serve: this model's forwards cannot be shared here ({engine.device.type}"
                  f"{', compiled' if engine.compile else ''}): one request decodes at a time", file=sys.stderr,
                  flush=True)
        parallel = 1
    elif parallel is None:
        parallel = PARALLEL

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    app, worker = build(engine, profiles, overrides, draft2=draft2, template=chat_template, api_key=api_key,
                        max_queue=max_queue, log=log, debug=debug, parallel=parallel, name=name)
    settle()
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    if not is_loopback(host) and not api_key:
        err.print(f"warning: serving on {host} without an API key: anyone who can reach this machine can use "
                  "it (set --api-key or SPEC_API_KEY)", style="bold yellow", markup=False)
    err.print(f"spec serve · {profile.name} · {settings.method} · {engine.device.type} "
              f"{str(engine.dtype).removeprefix('torch.')} · template {chat_template.label} · loaded in "
              f"{engine.load_seconds:.1f} s · {parallel} slot{'s' if parallel > 1 else ''}", style="dim", markup=False)
    err.print(f"serving {name or profile.name} at http://{shown}:{bound_port}/v1"
              + (" (API key required)" if api_key else "") + " · Ctrl-C to stop", markup=False, highlight=False)
    worker.warm(engine.encode(WARM_TEXT), plan)  # (its slots start serving once warm: a request ends it)
    serve(make_server(app, worker, debug), worker, sock)
    err.print("stopped", style="dim")
    return 0
