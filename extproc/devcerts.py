"""Credentials for a local stack (``ai-quota up`` / ``scripts/run``) and the tests: a private CA,
the processor's server certificate, Envoy's client certificate, the caller token file and the
admin token file, made with the ``openssl`` command line tool.

For one machine's development stack only: production credentials come from the operator's
PKI or cert-manager and a secret store (docs/security.md).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The DNS name in the processor's certificate that Envoy checks (``--extproc-server-name``).
SERVER_NAME = "ai-quota"
#: The DNS SAN of Envoy's client certificate (the processors' ``AIQ_GRPC_ALLOWED_SANS``).
CLIENT_NAME = "envoy"


class CertError(RuntimeError):
    """openssl is missing or failed; the message says which step."""


@dataclass(frozen=True)
class DevCredentials:
    """Paths of everything :func:`make` wrote (and the tokens it put in the token files)."""

    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    token_file: Path
    token: str
    admin_token_file: Path
    admin_token: str

    def describe(self) -> dict[str, str]:
        """What ``stack.json`` records (paths only: local tools read the files)."""
        return {
            "ca": str(self.ca),
            "server_cert": str(self.server_cert),
            "server_key": str(self.server_key),
            "client_cert": str(self.client_cert),
            "client_key": str(self.client_key),
            "token_file": str(self.token_file),
            "admin_token_file": str(self.admin_token_file),
            "server_name": SERVER_NAME,
        }


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    if binary is None:
        raise CertError("'openssl' not found: install it (apt-get install openssl)")
    done = subprocess.run(  # noqa: S603 - our own arguments
        [binary, *args], cwd=str(cwd), capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise CertError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def _leaf(d: Path, name: str, sans: str, usage: str, days: int) -> tuple[Path, Path]:
    key, csr, pem = d / f"{name}.key", d / f"{name}.csr", d / f"{name}.pem"
    ext = d / f"{name}.ext"
    ext.write_text(
        f"subjectAltName={sans}\nextendedKeyUsage={usage}\n"
        "keyUsage=digitalSignature,keyEncipherment\nbasicConstraints=CA:FALSE\n"
    )
    _openssl(
        "req",
        "-new",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        key.name,
        "-out",
        csr.name,
        "-subj",
        f"/CN={name}",
        cwd=d,
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        csr.name,
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        str(days),
        "-out",
        pem.name,
        "-extfile",
        ext.name,
        cwd=d,
    )
    csr.unlink()
    ext.unlink()
    os.chmod(key, 0o600)
    return pem, key


def _valid_for_a_day(*certs: Path) -> bool:
    """Whether every certificate is still valid 24 hours from now (``openssl -checkend``)."""
    binary = shutil.which("openssl")
    if binary is None:
        return True  # nothing to check with; make() would fail the same way
    for cert in certs:
        done = subprocess.run(  # noqa: S603 - our own arguments
            [binary, "x509", "-checkend", "86400", "-noout", "-in", str(cert)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            return False
    return True


def _token_file(path: Path, token: str) -> None:
    path.write_text(token + "\n")
    os.chmod(path, 0o600)


def make(
    directory: Path,
    *,
    client_name: str = CLIENT_NAME,
    days: int = 30,
    reuse: bool = True,
    shared: bool = False,
) -> DevCredentials:
    """Write a CA, server and client certificates and two token files under ``directory``
    (kept when they are already there and ``reuse``).  ``shared``: readable by every user (a
    volume that containers running as different users mount, and nothing else does)."""
    d = directory
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o755 if shared else 0o700)
    token_file, admin_file = d / "grpc-token", d / "admin-token"
    wanted = [
        d / n for n in ("ca.pem", "server.pem", "server.key", f"{client_name}.pem", "grpc-token")
    ]
    kept = reuse and all(p.is_file() for p in wanted) and admin_file.is_file()
    if kept and not _valid_for_a_day(d / "server.pem", d / f"{client_name}.pem"):
        kept = False  # expired or about to: make a new set
    if not kept:
        _openssl(
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            str(days),
            "-subj",
            "/CN=ai-quota local CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            cwd=d,
        )
        os.chmod(d / "ca.key", 0o600)
        _leaf(d, "server", f"DNS:{SERVER_NAME},DNS:localhost,IP:127.0.0.1", "serverAuth", days)
        _leaf(d, client_name, f"DNS:{client_name}", "clientAuth", days)
        _token_file(token_file, secrets.token_urlsafe(32))
        _token_file(admin_file, secrets.token_urlsafe(32))
    if shared:
        for f in d.iterdir():
            os.chmod(f, 0o644)
    return DevCredentials(
        dir=d,
        ca=d / "ca.pem",
        server_cert=d / "server.pem",
        server_key=d / "server.key",
        client_cert=d / f"{client_name}.pem",
        client_key=d / f"{client_name}.key",
        token_file=token_file,
        token=token_file.read_text().strip(),
        admin_token_file=admin_file,
        admin_token=admin_file.read_text().strip(),
    )


def client_cert(directory: Path, name: str, *, days: int = 30) -> tuple[Path, Path]:
    """One more client certificate (DNS SAN ``name``) from the CA :func:`make` wrote there."""
    return _leaf(directory, name, f"DNS:{name}", "clientAuth", days)


def main(argv: list[str] | None = None) -> int:
    """``python -m extproc.devcerts DIR [--shared] [--days N]``: make (or keep) the credentials
    in DIR, e.g. compose's one-shot ``credentials`` service."""
    import argparse
    import sys

    parser = argparse.ArgumentParser(prog="python -m extproc.devcerts", description=main.__doc__)
    parser.add_argument("directory")
    parser.add_argument("--shared", action="store_true", help="readable by every user")
    parser.add_argument("--days", type=int, default=365)
    args = parser.parse_args(argv)
    try:
        made = make(Path(args.directory), days=args.days, shared=args.shared)
    except CertError as exc:
        print(f"devcerts: {exc}", file=sys.stderr)
        return 1
    for name, path in made.describe().items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
