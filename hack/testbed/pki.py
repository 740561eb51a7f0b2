"""The test bed's certificates and keys: one CA, the API server's serving certificate, an
admin client certificate, the API server's kubelet client certificate, the process node's
kubelet serving certificate, and the service-account signing pair. Made once per state dir."""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from .layout import GATEWAY_IP, PROCESS_NODE_NAME, SERVICE_FIRST_IP

_VALIDITY = dt.timedelta(days=365)
_API_DNS_NAMES = [
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
]
_API_IPS = ["127.0.0.1", GATEWAY_IP, SERVICE_FIRST_IP]
KUBELET_CLIENT_USER = "kube-apiserver-kubelet-client"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def _write_cert(cert: x509.Certificate, path: Path) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str, organization: str | None = None) -> x509.Name:
    attrs = [x509.NameAttribute(NameOID.COMMON_NAME, common_name)]
    if organization:
        attrs.append(x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization))
    return x509.Name(attrs)


def _issue(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    *,
    serves: tuple[list[str], list[str]] | None,
) -> x509.Certificate:
    """A leaf certificate: a server's for `serves` = (DNS names, IPs), else a client's."""
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
    )
    if serves:
        dns_names, ips = serves
        sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ips]
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        usage = [ExtendedKeyUsageOID.SERVER_AUTH]
    else:
        usage = [ExtendedKeyUsageOID.CLIENT_AUTH]
    builder = builder.add_extension(x509.ExtendedKeyUsage(usage), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def _new_ca(pki: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    ca_key = _new_key()
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(_name("dynamo-testbed-ca"))
        .issuer_name(_name("dynamo-testbed-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + _VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(ca_key, pki / "ca.key")
    _write_cert(ca_cert, pki / "ca.crt")


def ensure_pki(pki: Path) -> None:
    """Create the CA, the serving and client certificates and the SA key pair; each only
    when missing (a state dir from before a certificate was added gets just that one)."""
    pki.mkdir(parents=True, exist_ok=True)
    if not (pki / "ca.key").exists():
        _new_ca(pki)
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise SystemExit(f"{pki / 'ca.key'} is not the test bed's EC key; remove {pki}")
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    leaves: list[tuple[str, x509.Name, tuple[list[str], list[str]] | None]] = [
        ("apiserver", _name("kube-apiserver"), (_API_DNS_NAMES, _API_IPS)),
        # system:masters: the admin identity used by kubectl, the controllers and the agents.
        ("admin", _name("testbed-admin", "system:masters"), None),
        # The API server's identity towards kubelets; the process node's kubelet API lets in
        # this client alone.
        ("apiserver-kubelet-client", _name(KUBELET_CLIENT_USER), None),
        (
            "kubelet",
            _name(f"system:node:{PROCESS_NODE_NAME}", "system:nodes"),
            ([PROCESS_NODE_NAME], [GATEWAY_IP]),
        ),
    ]
    for stem, subject, serves in leaves:
        if (pki / f"{stem}.crt").exists():
            continue
        key = _new_key()
        _write_key(key, pki / f"{stem}.key")
        _write_cert(_issue(subject, key, ca_cert, ca_key, serves=serves), pki / f"{stem}.crt")
    if not (pki / "sa.pub").exists():
        sa_key = _new_key()
        _write_key(sa_key, pki / "sa.key")
        (pki / "sa.pub").write_bytes(
            sa_key.public_key().public_bytes(
                serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
            )
        )


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def issue_leaf(
    pki: Path,
    stem: Path,
    common_name: str,
    organization: str | None,
    *,
    serves: tuple[list[str], list[str]] | None = None,
) -> None:
    """`stem`.crt and `stem`.key signed by the test bed's CA (made by `ensure_pki`), unless
    they exist: a client certificate, or a server's for `serves` = (DNS names, IPs)."""
    if stem.with_suffix(".crt").exists():
        return
    ca_key = serialization.load_pem_private_key((pki / "ca.key").read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca_cert = x509.load_pem_x509_certificate((pki / "ca.crt").read_bytes())
    key = _new_key()
    _write_key(key, stem.with_suffix(".key"))
    cert = _issue(_name(common_name, organization), key, ca_cert, ca_key, serves=serves)
    _write_cert(cert, stem.with_suffix(".crt"))


def write_admin_kubeconfig(pki: Path, server: str, path: Path) -> None:
    """A kubeconfig for the admin client certificate (what `hack/cluster env` exports)."""
    kubeconfig_for(pki, server, pki / "admin", path)


def kubeconfig_for(pki: Path, server: str, client: Path, path: Path) -> None:
    """A kubeconfig for the client certificate `client`.crt/.key."""
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: dynamo-testbed
  cluster:
    server: {server}
    certificate-authority-data: {_b64(pki / "ca.crt")}
users:
- name: {client.name}
  user:
    client-certificate-data: {_b64(client.with_suffix(".crt"))}
    client-key-data: {_b64(client.with_suffix(".key"))}
contexts:
- name: dynamo-testbed
  context:
    cluster: dynamo-testbed
    user: {client.name}
current-context: dynamo-testbed
"""
    )
    path.chmod(0o600)
