"""``chassis serve`` over HTTPS (``--ssl-certfile``/``--ssl-keyfile``, client certificates
with ``--ssl-ca-certs``/``--ssl-cert-reqs``) and on a Unix domain socket (``--uds``).

Certificates are made with the ``openssl`` command (a self-signed CA that signs a server and
a client certificate), so the tests skip where it is missing.
"""

from __future__ import annotations

import errno
import shutil
import socket
import ssl
import subprocess
from pathlib import Path

import httpx
import pytest
from server_process import start_server

from chassis.serve.server import bind_unix_socket, listen_address
from chassis.serve.settings import ServerSettings
from chassis.serve.tls import check_tls

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _signed(name: str, subject: str, ca: Path, cwd: Path, extension: str) -> None:
    """``name.key`` and ``name.pem``, signed by ``ca``.pem/.key, with ``extension`` lines."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
             f"{name}.csr", "-subj", subject, cwd=cwd)  # fmt: skip
    (cwd / f"{name}.ext").write_text(extension)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=cwd)  # fmt: skip


#: the password of ``server-encrypted.key``
KEY_PASSWORD = "s3cret pass"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA (ca.pem/ca.key), a server certificate for 127.0.0.1 (server.pem/server.key, the
    key also encrypted with :data:`KEY_PASSWORD` in server-encrypted.key) and a client
    certificate (client.pem/client.key) it signed."""
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
             "ca.pem", "-days", "2", "-subj", "/CN=chassis test CA", cwd=d)  # fmt: skip
    _signed("server", "/CN=127.0.0.1", Path("ca"), d,
            "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")  # fmt: skip
    _signed("client", "/CN=chassis client", Path("ca"), d, "extendedKeyUsage=clientAuth\n")
    # the server's key again, encrypted with a password (--ssl-keyfile-password)
    _openssl("pkey", "-in", "server.key", "-aes256", "-passout", f"pass:{KEY_PASSWORD}",
             "-out", "server-encrypted.key", cwd=d)  # fmt: skip
    return d


# -- settings and start-up checks ---------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"ssl_keyfile": "k.pem"}, "--ssl-keyfile needs --ssl-certfile"),
        ({"ssl_ca_certs": "ca.pem"}, "need --ssl-certfile"),
        ({"ssl_keyfile_password": "pw"}, "--ssl-keyfile-password needs --ssl-certfile"),
        ({"ssl_certfile": "c.pem", "ssl_cert_reqs": 2}, "give --ssl-ca-certs"),
        ({"ssl_certfile": "c.pem", "ssl_cert_reqs": 3}, "--ssl-cert-reqs must be"),
        ({"uds": ""}, "--uds must be a socket path"),
    ],
)
def test_invalid_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServerSettings(**kwargs)


def test_check_tls_loads_the_files_or_names_the_flag(certs: Path, tmp_path: Path) -> None:
    assert check_tls(ServerSettings()) is None
    context = check_tls(
        ServerSettings(
            ssl_certfile=str(certs / "server.pem"),
            ssl_keyfile=str(certs / "server.key"),
            ssl_ca_certs=str(certs / "ca.pem"),
            ssl_cert_reqs=2,
        )
    )
    assert context is not None and context.verify_mode == ssl.CERT_REQUIRED
    with pytest.raises(ValueError, match=r"--ssl-certfile .*cannot load"):
        check_tls(ServerSettings(ssl_certfile=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError, match="cannot load the certificate"):  # another key
        check_tls(
            ServerSettings(
                ssl_certfile=str(certs / "server.pem"), ssl_keyfile=str(certs / "client.key")
            )
        )
    (tmp_path / "junk.pem").write_text("not a certificate")
    with pytest.raises(ValueError, match=r"--ssl-ca-certs .*cannot load"):
        check_tls(
            ServerSettings(
                ssl_certfile=str(certs / "server.pem"),
                ssl_keyfile=str(certs / "server.key"),
                ssl_ca_certs=str(tmp_path / "junk.pem"),
            )
        )


def test_certfile_without_keyfile_names_the_missing_key(certs: Path, tmp_path: Path) -> None:
    """OpenSSL's "PEM lib" error said nothing about the key; the message names --ssl-keyfile
    (a certificate file holding the key too still works, as with uvicorn)."""
    with pytest.raises(ValueError, match=r"--ssl-certfile .*pass the key with --ssl-keyfile"):
        check_tls(ServerSettings(ssl_certfile=str(certs / "server.pem")))
    # a certificate file that holds the key needs no --ssl-keyfile
    both = tmp_path / "both.pem"
    both.write_text((certs / "server.pem").read_text() + (certs / "server.key").read_text())
    assert check_tls(ServerSettings(ssl_certfile=str(both))) is not None
    context = check_tls(
        ServerSettings(
            ssl_certfile=str(certs / "server.pem"), ssl_keyfile=str(certs / "server.key")
        )
    )
    assert context is not None


def test_an_encrypted_key_loads_with_its_password_only(certs: Path) -> None:
    """Never a terminal prompt: without the password start-up fails naming the flag."""
    encrypted = {
        "ssl_certfile": str(certs / "server.pem"),
        "ssl_keyfile": str(certs / "server-encrypted.key"),
    }
    assert (certs / "server-encrypted.key").read_text().startswith("-----BEGIN ENCRYPTED")
    context = check_tls(ServerSettings(**encrypted, ssl_keyfile_password=KEY_PASSWORD))
    assert context is not None
    with pytest.raises(ValueError, match="is encrypted; give its password with --ssl-keyfile-pa"):
        check_tls(ServerSettings(**encrypted))
    with pytest.raises(ValueError, match=r"cannot load .*is --ssl-keyfile-password right\?"):
        check_tls(ServerSettings(**encrypted, ssl_keyfile_password="wrong"))
    # a key that is not encrypted ignores a password, as OpenSSL does
    plain = {"ssl_certfile": str(certs / "server.pem"), "ssl_keyfile": str(certs / "server.key")}
    assert check_tls(ServerSettings(**plain, ssl_keyfile_password="unused")) is not None
    assert KEY_PASSWORD not in repr(ServerSettings(**encrypted, ssl_keyfile_password=KEY_PASSWORD))


def test_the_password_flag_reaches_uvicorn(certs: Path) -> None:
    from chassis.serve.cli import build_parser
    from chassis.serve.cli_serve import settings_from_args
    from chassis.serve.server import uvicorn_config

    args = build_parser().parse_args(
        ["serve", "m", "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile",
         str(certs / "server-encrypted.key"), "--ssl-keyfile-password", KEY_PASSWORD]
    )  # fmt: skip
    settings = settings_from_args(args)
    assert settings.ssl_keyfile_password == KEY_PASSWORD
    config = uvicorn_config(None, settings)  # type: ignore[arg-type]
    assert config.ssl_keyfile_password == KEY_PASSWORD
    config.load()  # uvicorn builds its own context from the encrypted key
    assert config.ssl is not None


def test_listen_address() -> None:
    assert listen_address(ServerSettings(port=8000)) == "http://127.0.0.1:8000"
    assert listen_address(ServerSettings(host="::1", ssl_certfile="c.pem"), 9) == "https://[::1]:9"
    assert listen_address(ServerSettings(uds="/tmp/x.sock")) == "unix:/tmp/x.sock"


def test_bind_unix_socket_replaces_a_stale_file_only(tmp_path: Path) -> None:
    path = str(tmp_path / "api.sock")
    first = bind_unix_socket(path)
    try:
        with pytest.raises(OSError) as in_use:  # a server listens there
            bind_unix_socket(path)
        assert in_use.value.errno == errno.EADDRINUSE
    finally:
        first.close()
    # the closed socket's file is left behind, as by a killed server: it is replaced
    second = bind_unix_socket(path)
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(path)
    second.close()
    (tmp_path / "plain").write_text("data")
    with pytest.raises(OSError, match="not a socket"):
        bind_unix_socket(str(tmp_path / "plain"))
    assert (tmp_path / "plain").read_text() == "data"


def test_serve_exits_2_on_an_unreadable_certificate(tmp_path: Path) -> None:
    """The check runs before the model loads: the exit is immediate, the flag named."""
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "chassis.serve.cli", "serve", str(tmp_path / "no-model"),
         "--ssl-certfile", str(tmp_path / "missing.pem"), "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr
    assert "--ssl-certfile" in result.stderr


# -- real servers -------------------------------------------------------------------------


def test_https_with_client_certificates(
    tiny_llama_dir: Path,
    certs: Path,
    tmp_path: Path,
) -> None:
    """mTLS, the server's key encrypted (``--ssl-keyfile-password``): a client with a
    certificate the CA signed completes; plain HTTP and a client without a certificate are
    refused at the TLS layer."""
    import openai

    def client(cert: bool) -> httpx.Client:
        kwargs = {"cert": (str(certs / "client.pem"), str(certs / "client.key"))} if cert else {}
        return httpx.Client(verify=ssl.create_default_context(cafile=str(certs / "ca.pem")),
                            **kwargs)  # fmt: skip

    tls_args = ["--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile",
                str(certs / "server-encrypted.key"), "--ssl-keyfile-password", KEY_PASSWORD,
                "--ssl-ca-certs", str(certs / "ca.pem"),
                "--ssl-cert-reqs", "2"]  # fmt: skip
    with client(cert=True) as http:
        server = start_server(
            tiny_llama_dir, tmp_path, tls_args, scheme="https", health_client=http
        )
        try:
            api = openai.OpenAI(
                base_url=server.base + "/v1", api_key=server.api_key, http_client=http,
                max_retries=0,
            )  # fmt: skip
            done = api.completions.create(
                model=server.model, prompt="Hello", max_tokens=5, temperature=0
            )
            assert done.usage.completion_tokens == 5
            with pytest.raises(httpx.TransportError):  # plain HTTP on the TLS port
                httpx.get(server.base.replace("https", "http") + "/health", timeout=5)
            with client(cert=False) as anonymous, pytest.raises(httpx.TransportError):
                anonymous.get(server.base + "/health", timeout=5)
        finally:
            # Close the idle keep-alive TLS connection first: the server's graceful shutdown
            # otherwise waits its --shutdown-timeout (10 s) for the TLS close to complete.
            http.close()
            server.stop()


def test_unix_domain_socket(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """--uds: the API answers on the socket (streams included), not on TCP, and the socket
    file is removed at exit."""
    path = tmp_path / "chassis.sock"
    http = httpx.Client(transport=httpx.HTTPTransport(uds=str(path)))
    server = start_server(
        tiny_llama_dir, tmp_path, ["--uds", str(path)], health_client=http, listen=f"unix:{path}"
    )
    try:
        models = http.get(server.base + "/v1/models", headers=server.headers).json()
        assert [card["id"] for card in models["data"]] == [server.model]
        body = {"model": server.model, "prompt": "Hello", "max_tokens": 4, "stream": True}
        with http.stream(
            "POST", server.base + "/v1/completions", json=body, headers=server.headers
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert response.status_code == 200 and lines[-1] == "data: [DONE]"
        with pytest.raises(httpx.TransportError):  # nothing on the TCP port
            httpx.get(server.base + "/health", timeout=2)
    finally:
        server.stop()
        http.close()
    assert not path.exists()
