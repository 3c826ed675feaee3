"""Per-launch TLS: a fresh CA, a server certificate signed by it, and a bearer token.

The launcher (laptop) makes these for every launch; the server gets the certificate, key and token; the
client trusts that CA alone. `cryptography` is imported inside the functions to keep `import artcloud` light.
"""

from __future__ import annotations

import datetime as _dt
import ipaddress
import os
import secrets
import ssl
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from artcloud.errors import ArtcloudError


@dataclass(frozen=True)
class LaunchSecrets:
    """PEM strings and the token for one launch. Never printed: the repr hides everything secret."""

    ca_cert: str
    server_cert: str
    server_key: str = field(repr=False)
    token: str = field(repr=False)

    def write(self, folder: Path) -> "SecretPaths":
        """Write the four files into `folder` (private_folder); key and token are 0600."""
        private_folder(folder)
        paths = SecretPaths(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "token")
        for path, text, mode in ((paths.ca_cert, self.ca_cert, 0o644), (paths.server_cert, self.server_cert, 0o644),
                                 (paths.server_key, self.server_key, 0o600), (paths.token, self.token, 0o600)):
            write_file(path, text, mode)
        return paths


class UnsafeFolder(ArtcloudError):
    """A folder for keys and tokens that others could read or change: the message says how to fix it."""

    code = "unsafe_folder"


def private_folder(folder: Path) -> Path:
    """`folder` for keys and tokens: made 0700, or, if it is there, a real folder (no link) of this user's that
    nobody else may read or write; UnsafeFolder otherwise (a key written there would be exposed)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError:  # a file there: said below
        pass
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFolder(f"{folder} is a link or not a folder: remove it, and a private one is made")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise UnsafeFolder(f"{folder} is open to others (mode {stat.S_IMODE(st.st_mode):o}, owner uid {st.st_uid}): "
                           f"`chmod 700 {folder}` if it is yours, else remove it")
    return folder


def write_file(path: Path, text: str, mode: int) -> None:
    """`text` into `path` with `mode` from its first byte: a fresh private temporary file beside it, renamed over
    it (a link at `path` is replaced, never followed)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@dataclass(frozen=True)
class SecretPaths:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    token: Path


def new_token() -> str:
    return secrets.token_urlsafe(32)


def make_launch_secrets(hosts: list[str] | None = None, days: int = 30) -> LaunchSecrets:
    """A new CA and a server certificate for `hosts` (DNS names or IPs; loopback is always included)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = _dt.datetime.now(_dt.timezone.utc)
    start, end = now - _dt.timedelta(minutes=5), now + _dt.timedelta(days=days)

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "artcloud launch CA")])

    def certificate(subject: str | None, public_key: ec.EllipticCurvePublicKey) -> x509.CertificateBuilder:
        """A certificate issued by the CA (subject None: the CA itself) for `public_key`, valid `days`."""
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]) if subject else ca_name
        return (x509.CertificateBuilder().subject_name(name).issuer_name(ca_name).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end))

    usage = x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                          key_encipherment=False, data_encipherment=False, key_agreement=False, encipher_only=False,
                          decipher_only=False)
    ca_cert = (certificate(None, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
               .add_extension(usage, critical=True)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
               .sign(ca_key, hashes.SHA256()))

    names: list[x509.GeneralName] = []
    for host in ["localhost", "127.0.0.1", "::1", *(hosts or [])]:
        try:
            entry: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            entry = x509.DNSName(host)
        if entry not in names:
            names.append(entry)

    cert = (certificate("artcloud server", key.public_key())
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
            .sign(ca_key, hashes.SHA256()))
    pem = serialization.Encoding.PEM
    private = key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    return LaunchSecrets(ca_cert=ca_cert.public_bytes(pem).decode(), server_cert=cert.public_bytes(pem).decode(),
                         server_key=private.decode(), token=new_token())


def client_ssl_context(ca_cert: str | Path | None, *, check_hostname: bool = True) -> ssl.SSLContext:
    """An SSL context that trusts `ca_cert` (PEM text or a path) and nothing else. `check_hostname=False`
    is for a launch CA only (one certificate signed, key discarded), where the CA is the identity.
    `ca_cert=None`: the public web's CAs (certifi's bundle, or $SSL_CERT_FILE), for a provider's own TLS
    edge (Modal's tunnels)."""
    if ca_cert is None:
        import certifi

        # SSL_CERT_FILE, OpenSSL's own variable, wins (a company proxy's CA bundle, say).
        ctx = ssl.create_default_context(cafile=os.environ.get("SSL_CERT_FILE") or certifi.where())
    else:
        # A bare PROTOCOL_TLS_CLIENT context starts with an empty trust store (create_default_context
        # would add the system CAs): only the launch's CA can vouch for the server.
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = check_hostname
        ctx.verify_mode = ssl.CERT_REQUIRED
        text = str(ca_cert)
        if "-----BEGIN CERTIFICATE-----" in text:
            ctx.load_verify_locations(cadata=text)
        else:
            ctx.load_verify_locations(cafile=text)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx
