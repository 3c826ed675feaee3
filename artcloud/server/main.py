"""Run the server: check the path and port, set up TLS and the token, hand over to uvicorn.

What ends it (the lease, --max-duration, the parent's death, a preemption notice, POST /artcloud/shutdown,
a signal) is lifecycle.py's: uvicorn's graceful path, whose lifespan exit pushes the final checkpoints to
S3. The process then exits with status 0, or 1 if that exit failed (uvicorn's startup failure: 3).

Every failure a user can cause (a taken port, an unwritable path, a missing certificate) raises
ServeError with one line that says what to do; the CLI prints it and exits with status 2.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from artcloud._version import __version__
from artcloud.errors import ArtcloudError
from artcloud.tls import LaunchSecrets, make_launch_secrets, private_folder, write_file

log = logging.getLogger("artcloud.server")

ENV_TOKEN = "ARTCLOUD_TOKEN"
ENV_CERT = "ARTCLOUD_TLS_CERT"
ENV_REPLICA_TOKEN = "ARTCLOUD_REPLICA_TOKEN"  # the token the head calls its replicas with, where they have their own
ENV_KEY = "ARTCLOUD_TLS_KEY"
ENV_S3 = "ARTCLOUD_S3"
# A peer that stops acknowledging (a laptop that slept, a cut network) is dropped after this long
# instead of TCP's ~15 minutes of retransmissions; idle connections are probed by keep-alives.
TCP_USER_TIMEOUT_MS = 60_000
TCP_KEEPALIVE = (30, 10, 3)  # idle seconds before the first probe, seconds between probes, probes
# How long uvicorn's graceful exit waits for open connections (then the final pushes run): a response still
# being sent, or one whose peer stopped reading, holds the exit up to this long. An idle connection does not
# (tls_only._TLS closes the socket once its close_notify is sent, without waiting for the peer's).
GRACEFUL_SHUTDOWN_S = 10


class ServeError(ArtcloudError):
    """A problem with how the server was started; the message is one line saying what to do."""

    code = "serve_failed"


@dataclass
class TLSFiles:
    cert: Path
    key: Path
    ca: Path | None  # only when the server made its own CA
    token: str
    token_file: Path | None


def check_path(path: Path) -> Path:
    path = path.expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as e:
        raise ServeError(f"--path {path} is not writable ({e.strerror}): pick a folder you can write to") from e
    return path


def s3_store(uri: str | None):
    """The S3 checkpoint store, checked now (credentials, bucket, write access): a wrong setting fails at
    start-up, not at step 50."""
    if not uri:
        return None
    from artcloud.storage.s3 import CheckpointStore, S3Config, StorageError

    try:
        store = CheckpointStore(S3Config.from_uri(uri))
        store.check()
    except StorageError as e:
        raise ServeError(str(e)) from e
    except ImportError as e:
        raise ServeError("--s3 needs boto3: pip install 'artcloud[s3]'") from e
    return store


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP explicitly: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose protocol
    # number says TCP; with 0, every response body waited ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    _dead_peer_detection(sock)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ServeError(
                f"port {port} on {host} is already in use: pick another with --port (0 picks a free one), "
                "or stop what listens there"
            ) from e
        raise ServeError(f"cannot listen on {host}:{port} ({e.strerror}): check --host and --port") from e
    sock.listen(256)  # not more: out of descriptors, asyncio retries (and logs) once per waiting connection
    sock.set_inheritable(True)
    return sock


def _dead_peer_detection(sock: socket.socket) -> None:
    """Set on the listening socket; Linux copies these options to every accepted connection."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, interval, count = TCP_KEEPALIVE
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count),
                        ("TCP_USER_TIMEOUT", TCP_USER_TIMEOUT_MS)):
        option = getattr(socket, name, None)
        if option is not None:  # Linux has them all; elsewhere the OS defaults stay
            sock.setsockopt(socket.IPPROTO_TCP, option, value)


def _pem_or_path(value: str, what: str, tls_dir: Path, name: str) -> Path:
    """A PEM given inline (environment) goes into a 0600 file; a path is checked and used as it is."""
    if "-----BEGIN" in value:
        target = private_folder(tls_dir) / name
        write_file(target, value, 0o600)
        return target
    path = Path(value).expanduser()
    if not path.is_file():
        raise ServeError(f"{what} {path} does not exist: give the PEM file the launcher wrote")
    return path


def tls_setup(path: Path, host: str, cert: str | None, key: str | None, token: str | None, token_file: str | None) -> TLSFiles:
    """Use the launcher's certificate, key and token, or make a CA, certificate and token of our own."""
    cert = cert or os.environ.get(ENV_CERT)
    key = key or os.environ.get(ENV_KEY)
    token = _given_token(token, token_file)
    tls_dir = path / ".tls"
    if bool(cert) != bool(key):
        raise ServeError("give both --tls-cert and --tls-key (or neither, and the server makes its own)")
    if cert and key:
        if token is None:
            raise ServeError(f"a launcher-made certificate needs its token too: pass --token-file or set {ENV_TOKEN}")
        return TLSFiles(_pem_or_path(cert, "--tls-cert", tls_dir, "server.pem"), _pem_or_path(key, "--tls-key", tls_dir, "server.key"), None, token, None)
    reused = _reuse_own(tls_dir, token)
    if reused is not None:
        return reused
    made: LaunchSecrets = make_launch_secrets(hosts=[host] if host not in ("0.0.0.0", "::") else [socket.gethostname()])
    if token is not None:
        made = LaunchSecrets(made.ca_cert, made.server_cert, made.server_key, token)
    paths = made.write(tls_dir)
    return TLSFiles(paths.server_cert, paths.server_key, paths.ca_cert, made.token, paths.token)


def _given_token(token: str | None, token_file: str | None) -> str | None:
    """The launcher's token (--token-file, else the argument, else $ARTCLOUD_TOKEN), or None."""
    if token_file:
        try:
            token = Path(token_file).expanduser().read_text().strip()
        except OSError as e:
            raise ServeError(f"--token-file {token_file} cannot be read ({e.strerror})") from e
    token = token or os.environ.get(ENV_TOKEN)
    if token is not None and len(token) < 16:
        raise ServeError("the bearer token must have at least 16 characters: make one with `python -c 'import secrets; print(secrets.token_urlsafe(32))'`")
    return token


def _reuse_own(tls_dir: Path, token: str | None) -> TLSFiles | None:
    """A restarted `artcloud serve --path P` keeps the CA and token it made before, while the
    certificate has more than a day left, so clients that trust it keep working."""
    import datetime as dt

    from cryptography import x509

    names = ("ca.pem", "server.pem", "server.key", "token")
    if token is not None or not all((tls_dir / n).is_file() for n in names):
        return None
    private_folder(tls_dir)  # files another user could have put there are never trusted
    try:
        cert = x509.load_pem_x509_certificate((tls_dir / "server.pem").read_bytes())
    except ValueError:
        return None
    if cert.not_valid_after_utc < dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1):
        return None
    saved = (tls_dir / "token").read_text().strip()
    return TLSFiles(tls_dir / "server.pem", tls_dir / "server.key", tls_dir / "ca.pem", saved, tls_dir / "token")


def _replica_links(urls: list[str], ca: str | None, tls: TLSFiles | None, token: str | None):
    """--replica URL... with the launch's token and CA (--replica-ca, else the CA this server made)."""
    if not urls:
        return None
    from artcloud.server.engines.choose import ReplicaLinks

    bad = [u for u in urls if not u.startswith("https://")]
    if bad:
        raise ServeError(f"--replica {bad[0]}: a replica is reached over HTTPS only (https://NODE_IP:PORT)")
    ca_path = Path(ca).expanduser() if ca else (tls.ca if tls is not None else None)
    if ca_path is None or not ca_path.is_file():
        raise ServeError("--replica needs the CA that signed the replicas' certificate: pass --replica-ca FILE (the "
                         "launch's ca.pem)")
    # The replicas' own token where the launch gave them one (security review 3, N5), else this server's.
    own = os.environ.get(ENV_REPLICA_TOKEN) or (tls.token if tls is not None else str(token))
    return ReplicaLinks(tuple(urls), own, ca_path)


def _rendezvous(nodes: int, master: str | None):
    """--trainer-nodes N --trainer-master HOST:PORT."""
    if nodes <= 1:
        if master:
            raise ServeError("--trainer-master is for --trainer-nodes 2 or more")
        return None
    from artcloud.server.engines.children import KEY_ENV, Rendezvous

    try:
        return Rendezvous(nodes, master or "", os.environ.get(KEY_ENV, ""))
    except ValueError as e:
        if getattr(e, "field", None) == KEY_ENV:
            raise ServeError(str(e)) from None
        raise ServeError(f"--trainer-nodes {nodes} needs --trainer-master HOST:PORT: where this node's torchrun waits "
                         "for the other trainer nodes (this node's private IP and a free port, e.g. 10.0.0.1:29500)") from None


def run(
    *, host: str, port: int, path: Path, tls_cert: str | None = None, tls_key: str | None = None,
    token: str | None = None, token_file: str | None = None, engine: str = "cpu", engine_args: dict | None = None,
    vllm_python: str | None = None, log_level: str = "info", parent_pid: int | None = None, s3: str | None = None,
    keep_last: int = 0, keep_best: str = "reward_mean", lease_s: float | None = None,
    max_duration_s: float | None = None, behind_https_proxy: bool = False, limits=None,
    claim_timeout_s: float | None = None, watch_preemption: bool = False, preload: str | None = None,
    replicas: list[str] | None = None, replica_ca: str | None = None, trainer_nodes: int = 1,
    trainer_master: str | None = None, announce=print,
) -> None:
    began = time.monotonic()  # --max-duration counts from here (loading a model is paid-for time too), /health's phases too
    import uvicorn

    from artcloud.server.app import create_app
    from artcloud.server.lease import Lease
    from artcloud.server.limits import Limits
    from artcloud.server.pusher import CLAIM_TIMEOUT_S
    from artcloud.server.registry import Registry
    from artcloud.server.startup import ENV_INSTALL_RECORD, Startup, read_install_record
    from artcloud.server.tls_only import Connections, server_context, wrap_uvicorn_protocol
    from artcloud.server.training import Retention

    limits = limits or Limits()
    limits.check()

    path = check_path(path)
    store = s3_store(s3 or os.environ.get(ENV_S3))
    if behind_https_proxy:
        # Modal's encrypted tunnel ends TLS at Modal's edge and forwards plain TCP into the sandbox: the
        # server speaks plain HTTP to that proxy only, and the token still guards every route.
        if tls_cert or tls_key:
            raise ServeError("--behind-https-proxy serves plain HTTP to the proxy: drop --tls-cert / --tls-key")
        tls = None
        token = _given_token(token, token_file)  # behind a proxy the server never makes its own token
        if token is None:
            raise ServeError(f"--behind-https-proxy needs the launcher's bearer token: set {ENV_TOKEN} or pass --token-file")
    else:
        tls = tls_setup(path, host, tls_cert, tls_key, token, token_file)
    links = _replica_links(replicas or [], replica_ca, tls, token)
    rendezvous = _rendezvous(trainer_nodes, trainer_master)
    # Before binding: an unknown --engine fails here, with nothing printed and nothing listening.
    lease = Lease(lease_s, max_duration_s, started_at=began)
    registry = Registry(path, engine=engine, store=store, retention=Retention(keep_last=keep_last, metric=keep_best),
                        limits=limits, lease=lease, claim_timeout_s=claim_timeout_s or CLAIM_TIMEOUT_S,
                        engine_args=engine_args, vllm_python=vllm_python, preload=preload or None, replicas=links,
                        rendezvous=rendezvous,
                        startup=Startup(started_at=began, install_s=read_install_record(os.environ.get(ENV_INSTALL_RECORD))))
    sock = bind(host, port)
    actual_port = sock.getsockname()[1]
    shown_host = "localhost" if host in ("127.0.0.1", "0.0.0.0", "::", "::1") else host
    if tls is None:
        url = f"http://{shown_host}:{actual_port}"
        announce(f"artcloud {__version__} serving plain HTTP on {url} behind an HTTPS proxy (--behind-https-proxy), "
                 f"checkpoints under {path}")
    else:
        url = f"https://{shown_host}:{actual_port}"
        announce(f"artcloud {__version__} serving on {url} (HTTPS only), checkpoints under {path}")
    if tls is not None and tls.ca is not None:
        announce(f"  CA certificate: {tls.ca}")
        announce(f"  bearer token:   {tls.token_file}  (0600; never printed)")
        announce(f"  try: curl --cacert {tls.ca} -H \"Authorization: Bearer $(cat {tls.token_file})\" {url}/v1/models")

    if store is not None:
        announce(f"  checkpoints are pushed to {store.config.uri}")
    if lease_s is not None or max_duration_s is not None:
        announce(f"  lease: {lease.line()}")
    if preload:
        announce(f"  preloading {preload}: GET /health says ready once it is loaded")
    app = create_app(registry, tls.token if tls is not None else token)
    # A bad cert/key pair fails here, before serving.
    context = server_context(str(tls.cert), str(tls.key)) if tls is not None else None
    # TLS is done by TLSOnlyProtocol (so plain HTTP gets a readable 400), on asyncio's own loop; behind a
    # proxy, ProxiedProtocol keeps the same deadlines and the cap in all.
    config = uvicorn.Config(app, loop="asyncio", log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            timeout_keep_alive=30)
    config.load()
    wrap_uvicorn_protocol(config, context, hint=url, connections=Connections(by_peer=context is not None))
    server = uvicorn.Server(config)
    lifecycle = registry.lifecycle
    lifecycle.server, lifecycle.parent_pid = server, parent_pid
    if watch_preemption:  # a spot machine: its cloud's notice takes the same way out as the lease
        from artcloud.server.preemption import Watch

        lifecycle.preemption = Watch()
    status = 1
    try:
        server.run(sockets=[sock])
        status = 1 if server.lifespan.should_exit else 0  # uvicorn: "Application shutdown failed"
    except SystemExit as e:  # uvicorn: the lifespan startup failed
        status = e.code if isinstance(e.code, int) else 1
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again once it has shut down
        status = 130
    except BaseException:
        log.exception("the server failed")
    finally:
        # An engine thread may still be inside a training step that will never be committed; the interpreter
        # would wait for it at exit (minutes, on a big model). Leave now: nothing on disk is half-written.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
