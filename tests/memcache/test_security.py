"""TLS and authentication seen from Python: the standard library's `ssl` module negotiates TLS 1.3
with the native port and speaks the protocol from docs/protocol.md by hand; stock pymemcache logs
in over TLS with memcached's convention (a first `set` of "user password"), or by a client
certificate."""

import socket
import ssl
import struct
import subprocess

import pytest
from conftest import PETREL, Server
from pymemcache.client.base import Client
from pymemcache.exceptions import MemcacheClientError, MemcacheServerError

HELLO, AUTH, QUEUE_LIST = 0x0001, 0x0003, 0x0102
OK, UNAUTHORIZED = 0, 9
AUTH_REQUIRED = 1


def petrel(*args, stdin=None):
    subprocess.run([PETREL, *args], input=stdin, check=True, capture_output=True, text=True)


def secured(tmp_path, extra=""):
    """A server with users tom and max (admin), TLS from `petrel cert dev`, client
    certificates verified (the dev client certificate names tom)."""
    certs = tmp_path / "certs"
    petrel("cert", "dev", str(certs), "--client-name", "tom")
    users = tmp_path / "users.toml"
    petrel("user", "add", str(users), "tom", stdin="3-kio\n")
    petrel("user", "add", str(users), "max", "--admin", stdin="zu*67\n")
    config = (
        "[security]\n"
        f'users_file = "{users}"\n'
        f'tls_cert = "{certs / "server.pem"}"\n'
        f'tls_key = "{certs / "server.key"}"\n'
        f'tls_client_ca = "{certs / "ca.pem"}"\n'
        f"{extra}\n"
    )
    return Server(tmp_path / "data", config=config), certs


@pytest.fixture
def started():
    servers = []
    yield servers
    for s in servers:
        s.stop()


def frame(opcode, request_id, body=b""):
    return struct.pack(">IBBHQ", 12 + len(body), 1, 0, opcode, request_id) + body


def string(s):
    b = s.encode()
    return struct.pack(">H", len(b)) + b


def recv_exact(sock, n):
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "connection closed"
        data += chunk
    return data


def read_frame(sock):
    (length,) = struct.unpack(">I", recv_exact(sock, 4))
    rest = recv_exact(sock, length)
    _version, _kind, opcode, request_id = struct.unpack(">BBHQ", rest[:12])
    return opcode, request_id, rest[12:]


def test_python_ssl_negotiates_tls_13_and_authenticates_on_the_native_port(tmp_path, started):
    server, certs = secured(tmp_path)
    started.append(server)
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    host, port = server.native.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            assert tls.version() == "TLSv1.3"
            tls.sendall(frame(HELLO, 1, string("python-ssl") + struct.pack(">I", 0)))
            opcode, request_id, body = read_frame(tls)
            assert (opcode, request_id, body[0]) == (HELLO, 1, OK)
            (features,) = struct.unpack(">I", body[-4:])
            assert features & AUTH_REQUIRED
            tls.sendall(frame(QUEUE_LIST, 2))
            assert read_frame(tls)[2][0] == UNAUTHORIZED
            tls.sendall(frame(AUTH, 3, string("tom") + string("wrong")))
            assert read_frame(tls)[2][0] == UNAUTHORIZED
            tls.sendall(frame(AUTH, 4, string("tom") + string("3-kio")))
            assert read_frame(tls)[1:] == (4, bytes([OK]))
            tls.sendall(frame(QUEUE_LIST, 5))
            assert read_frame(tls)[2][0] == OK


def test_pymemcache_logs_in_over_tls(tmp_path, started):
    server, certs = secured(tmp_path)
    started.append(server)
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    anonymous = server.client(tls_context=context)
    with pytest.raises((MemcacheClientError, MemcacheServerError)):
        anonymous.get("jobs")
    c = server.client(tls_context=context)
    assert c.set("login", b"tom 3-kio") is True
    assert c.set("jobs", b"hello") is True
    assert c.get("jobs") == b"hello"
    with pytest.raises(MemcacheClientError):
        c.delete("jobs")  # only admins remove queues


def test_pymemcache_with_a_client_certificate_needs_no_login(tmp_path, started):
    server, certs = secured(tmp_path)
    started.append(server)
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    c = server.client(tls_context=context)
    assert c.set("jobs", b"by certificate") is True
    assert c.get("jobs") == b"by certificate"


def test_plaintext_is_refused_when_tls_is_required(tmp_path, started):
    server, _ = secured(tmp_path, "require_tls = true")
    started.append(server)
    with socket.create_connection(server.memcache, timeout=5) as s:
        s.sendall(b"version\r\n")
        assert s.recv(200).startswith(b"SERVER_ERROR this server requires TLS")
