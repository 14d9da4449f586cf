"""Throwaway TLS for programs the e2e tests run beside the control plane (webhooks, extension API
servers, their gRPC links): a CA and one certificate it signs, made with openssl."""

from __future__ import annotations

import subprocess
from pathlib import Path


def serving_cert(certs: Path, sans: list[str], name: str = "kvscale-e2e") -> bytes:
    """A CA (ca.crt, ca.key) and a certificate for `sans` ("IP:127.0.0.1", "DNS:x.svc") in
    certs/ (tls.crt, tls.key), good for serving and for client authentication (mutual TLS);
    returns the CA's PEM."""
    certs.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=certs, check=True, capture_output=True)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}-ca",
        "-keyout", "ca.key", "-out", "ca.crt",
    )  # fmt: skip
    openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        "tls.key",
        "-out",
        "tls.csr",
    )
    (certs / "san.cnf").write_text(
        f"subjectAltName={','.join(sans)}\nextendedKeyUsage=serverAuth,clientAuth\n"
    )
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "1", "-extfile", "san.cnf", "-out", "tls.crt",
    )  # fmt: skip
    return (certs / "ca.crt").read_bytes()
