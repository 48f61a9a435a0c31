"""The certificates and keys of a one-machine cluster, and the kubeconfigs that carry them.

The layout is upstream's `hack/local-up-cluster.sh`: one CA that signs the API server's serving certificate, one
that signs the client certificates (a component is known to the API server by its certificate's common name and
organisations), one that signs the aggregation proxy's client certificate, and one RSA key that both signs and
verifies service-account tokens. Everything names loopback only: the serving certificate is valid for 127.0.0.1,
localhost and the in-cluster names of the `kubernetes` Service.
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Pki", "write_kubeconfig"]

_VALIDITY = datetime.timedelta(days=365)


@dataclass(frozen=True)
class Pair:
    """A certificate and its private key, as PEM files."""

    cert: Path
    key: Path


def _key() -> ec.EllipticCurvePrivateKey:
    """A key for a CA or a leaf: P-256 takes a millisecond where an RSA key takes most of a second on a busy
    machine, and every component of the cluster accepts it."""
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(common_name: str, organisations: Sequence[str] = ()) -> x509.Name:
    parts = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, o) for o in organisations]
    return x509.Name([*parts, x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class _Authority:
    """A self-signed CA that signs leaf certificates into a folder."""

    def __init__(self, folder: Path, name: str) -> None:
        self.folder = folder
        self.key = _key()
        now = datetime.datetime.now(datetime.UTC)
        self.subject = _name(f"{name}-ca")
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(self.subject).issuer_name(self.subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False),
                           critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pair = Pair(folder / f"{name}-ca.crt", folder / f"{name}-ca.key")
        self.pair.cert.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        _write_key(self.key, self.pair.key)

    def sign(self, file_name: str, subject: x509.Name, *, server: bool, dns: Sequence[str] = (),
             ips: Sequence[str] = ()) -> Pair:
        key = _key()
        now = datetime.datetime.now(datetime.UTC)
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject).issuer_name(self.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + _VALIDITY)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if dns or ips:
            names: list[x509.GeneralName] = [x509.DNSName(d) for d in dns]
            names += [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        pair = Pair(self.folder / f"{file_name}.crt", self.folder / f"{file_name}.key")
        pair.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, pair.key)
        return pair


@dataclass(frozen=True)
class Pki:
    """Every file the control plane and its clients need, in one folder."""

    folder: Path
    server_ca: Pair
    client_ca: Pair
    request_header_ca: Pair
    serving: Pair
    service_account_key: Path
    clients: dict[str, Pair]
    kubelet_serving: dict[str, Pair] = field(default_factory=dict)
    """Per node, its kubelet's serving pair, signed by the server CA (the API server checks it against that CA)."""

    @classmethod
    def create(cls, folder: Path, *, service_ip: str, nodes: Sequence[str] = ()) -> Pki:
        """Make the CAs, the API server's serving pair, one client pair per control-plane identity (and for each
        node in `nodes` the client and serving pairs its kubelet holds), and the service-account key."""
        folder.mkdir(parents=True, exist_ok=True)
        server = _Authority(folder, "server")
        client = _Authority(folder, "client")
        request_header = _Authority(folder, "request-header")
        serving = server.sign(
            "serving-kube-apiserver", _name("kube-apiserver"), server=True,
            dns=["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local",
                 "localhost"],
            ips=["127.0.0.1", service_ip])
        identities: dict[str, tuple[str, tuple[str, ...]]] = {
            "admin": ("system:admin", ("system:masters",)),
            "controller": ("system:kube-controller-manager", ()),
            "scheduler": ("system:kube-scheduler", ()),
            # The API server's identity towards kubelets (logs, exec).
            "kube-apiserver": ("kube-apiserver", ()),
        }
        for node in nodes:
            identities[f"kubelet-{node}"] = (f"system:node:{node}", ("system:nodes",))
        clients = {id_: client.sign(f"client-{id_}", _name(cn, orgs), server=False)
                   for id_, (cn, orgs) in identities.items()}
        clients["auth-proxy"] = request_header.sign("client-auth-proxy", _name("system:auth-proxy"), server=False)
        kubelet_serving = {node: server.sign(f"serving-kubelet-{node}", _name(f"system:node:{node}"), server=True,
                                             **_subject_names(node))
                           for node in nodes}
        # RSA, as upstream's script makes it: tokens are signed RS256, which every client library verifies.
        service_account_key = folder / "service-account.key"
        _write_key(rsa.generate_private_key(public_exponent=65537, key_size=2048), service_account_key)
        return cls(folder, server.pair, client.pair, request_header.pair, serving, service_account_key, clients,
                   kubelet_serving)


def _subject_names(host: str) -> dict[str, list[str]]:
    """A serving certificate's names for a host: its address when the name is one, else the name."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return {"dns": [host]}
    return {"ips": [host]}


def write_kubeconfig(path: Path, server: str, ca: Path, *, client: Pair | None = None, token: str | None = None,
                     user: str = "user") -> Path:
    """A kubeconfig for `server` that trusts `ca` and authenticates with a client certificate or a bearer
    token; files are named by absolute paths, so the kubeconfig works from any directory."""
    credentials: dict[str, str] = {}
    if client is not None:
        credentials = {"client-certificate": str(client.cert), "client-key": str(client.key)}
    if token is not None:
        credentials["token"] = token
    config = {
        "apiVersion": "v1", "kind": "Config",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
        "current-context": "local",
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    path.chmod(0o600)
    return path
