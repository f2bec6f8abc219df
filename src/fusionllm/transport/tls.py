"""Mutual TLS for every connection (gRPC control calls and the TCP data plane), from PEM files.

Every process gets a certificate and key signed by the run's own CA and the CA certificate; each end
checks the other's certificate against that CA (both directions), and the certificate must name
``TLS_NAME`` (subjectAltName ``DNS:fusionllm``) rather than a host, so the same files work whatever
addresses the machines have. The shared token is still checked on top (``auth.py``): TLS keeps
strangers from reading or changing the traffic, the token keeps them from joining.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from fusionllm.core.errors import ConfigError

TLS_NAME = "fusionllm"


@dataclass(frozen=True)
class TlsFiles:
    cert: bytes
    key: bytes
    ca: bytes
    paths: tuple[str, str, str]

    @staticmethod
    def load(cert: str | Path | None, key: str | Path | None, ca: str | Path | None) -> TlsFiles | None:
        """All three files, or none (no TLS); anything else is a ConfigError naming what is missing."""
        given = {"--tls-cert": cert, "--tls-key": key, "--tls-ca": ca}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise ConfigError(f"TLS needs --tls-cert, --tls-key and --tls-ca together; missing {', '.join(missing)}")
        data = {}
        for flag, path in given.items():
            try:
                text = Path(str(path)).read_bytes()
            except OSError as exc:
                raise ConfigError(f"{flag} {path}: cannot read it ({exc.strerror})") from None
            if b"-----BEGIN" not in text:
                raise ConfigError(f"{flag} {path}: not a PEM file")
            data[flag] = text
        files = TlsFiles(data["--tls-cert"], data["--tls-key"], data["--tls-ca"], (str(cert), str(key), str(ca)))
        files.server_context()  # a key that does not match its certificate fails here, not at the first call
        return files

    def server_credentials(self) -> object:
        import grpc

        return grpc.ssl_server_credentials([(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> object:
        import grpc

        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)

    def _context(self, purpose: ssl.Purpose) -> ssl.SSLContext:
        ctx = ssl.create_default_context(purpose, cadata=self.ca.decode())
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(*self._pem_paths())
        except ssl.SSLError as exc:
            raise ConfigError(f"--tls-cert / --tls-key {self.paths[0]}, {self.paths[1]}: {exc.reason or exc}") from None
        return ctx

    def _pem_paths(self) -> tuple[str, str]:
        return self.paths[0], self.paths[1]

    def server_context(self) -> ssl.SSLContext:
        return self._context(ssl.Purpose.CLIENT_AUTH)

    def client_context(self) -> ssl.SSLContext:
        ctx = self._context(ssl.Purpose.SERVER_AUTH)
        ctx.check_hostname = True  # against TLS_NAME, passed as server_hostname
        return ctx
