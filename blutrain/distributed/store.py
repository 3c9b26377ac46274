"""A small key-value store over TCP that admits only the job's ranks, for the rendezvous of a process group.

Rank 0 serves it on MASTER_ADDR:MASTER_PORT, listening on that address only (never on every interface). A peer is
admitted after answering a challenge: the server sends a random nonce and the peer returns HMAC-SHA256(secret, nonce),
where the secret is the one the launcher generated for the job (`BLUTRAIN_JOB_SECRET`). PyTorch's TCPStore admits
anyone who can reach the port; here a process without the secret is refused before it can read or write a key.

Wire format, after the handshake: a request is an op byte, a 4-byte key length, the key, a 4-byte value length and the
value; a reply is a status byte and a length-prefixed value. `get` blocks on the server until the key is set or the
client's timeout passes.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time

SECRET_ENV = "BLUTRAIN_JOB_SECRET"
_SET, _GET, _ADD, _CHECK = b"S", b"G", b"A", b"C"
_OK, _MISSING, _DENIED = b"\x00", b"\x01", b"\x02"
_NONCE = 32


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
  buf = bytearray()
  while len(buf) < n:
    chunk = sock.recv(n - len(buf))
    if not chunk: raise ConnectionError("the store's peer closed the connection")
    buf += chunk
  return bytes(buf)


def _send_blob(sock: socket.socket, *parts: bytes) -> None:
  sock.sendall(b"".join(struct.pack("!I", len(p)) + p for p in parts))


def _recv_blob(sock: socket.socket) -> bytes:
  return _recv_exactly(sock, struct.unpack("!I", _recv_exactly(sock, 4))[0])


def _digest(secret: bytes, nonce: bytes) -> bytes:
  return hmac.new(secret, nonce, hashlib.sha256).digest()


def new_secret() -> str:
  """A fresh job secret (64 hex digits), which a launcher passes to its ranks in BLUTRAIN_JOB_SECRET."""
  return secrets.token_hex(32)


class _Server:
  """The store's data and the thread that accepts peers (one thread per admitted connection)."""

  def __init__(self, host: str, port: int, secret: bytes):
    self.secret, self.data, self.cond = secret, {}, threading.Condition()
    self.sock = socket.create_server((host, port), reuse_port=False)
    self.port = self.sock.getsockname()[1]
    threading.Thread(target=self._accept, daemon=True, name="blutrain-store").start()

  def _accept(self) -> None:
    while True:
      try: conn, _ = self.sock.accept()
      except OSError: return  # closed
      threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

  def _serve(self, conn: socket.socket) -> None:
    with conn:
      try:
        nonce = secrets.token_bytes(_NONCE)
        conn.sendall(nonce)
        if not hmac.compare_digest(_recv_exactly(conn, 32), _digest(self.secret, nonce)):
          conn.sendall(_DENIED)
          return
        conn.sendall(_OK)
        while True:
          op = _recv_exactly(conn, 1)
          key, value = _recv_blob(conn), _recv_blob(conn)
          conn.sendall(self._handle(op, key, value))
      except (ConnectionError, OSError):
        return

  def _handle(self, op: bytes, key: bytes, value: bytes) -> bytes:
    with self.cond:
      if op == _SET:
        self.data[key] = value
        self.cond.notify_all()
        return _OK + struct.pack("!I", 0)
      if op == _ADD:
        self.data[key] = n = str(int(self.data.get(key, b"0")) + int(value)).encode()
        self.cond.notify_all()
        return _OK + struct.pack("!I", len(n)) + n
      if op == _CHECK:
        got = self.data.get(key)
        return (_MISSING + struct.pack("!I", 0)) if got is None else _OK + struct.pack("!I", len(got)) + got
      deadline = time.monotonic() + float(value)
      while key not in self.data:
        left = deadline - time.monotonic()
        if left <= 0: return _MISSING + struct.pack("!I", 0)
        self.cond.wait(left)
      got = self.data[key]
      return _OK + struct.pack("!I", len(got)) + got


class TCPStore:
  """A key-value store shared by the ranks of a job, as torch.distributed.TCPStore, admitting only holders of the
  job secret.

  Args:
    host_name: the address the server listens on (only there) and clients connect to.
    port: its port (0 on the server: any free port, see `port`).
    is_master: serve the store from this process.
    secret: the job secret (default: the BLUTRAIN_JOB_SECRET environment variable).
    timeout: seconds a `get` waits for its key and a client retries connecting.
  """

  def __init__(self, host_name: str, port: int, is_master: bool = False, secret: str | bytes | None = None,
               timeout: float = 300.0):
    secret = os.environ.get(SECRET_ENV) if secret is None else secret
    if not secret:
      raise RuntimeError(f"TCPStore: no job secret; set {SECRET_ENV} to the same value on every rank (`blutrain launch` "
                         "does), or initialize with backend='mpi' / an MPI-launched job")
    self.secret = secret.encode() if isinstance(secret, str) else secret
    self.host, self.timeout = host_name, timeout
    self._server = _Server(host_name, port, self.secret) if is_master else None
    self.port = self._server.port if self._server else port
    self._lock = threading.Lock()
    self._sock = self._connect()

  def _connect(self) -> socket.socket:
    deadline = time.monotonic() + self.timeout
    while True:
      try:
        sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        break
      except OSError as e:
        if time.monotonic() > deadline:
          raise RuntimeError(f"TCPStore: cannot reach {self.host}:{self.port} within {self.timeout:.0f} s ({e}); is "
                             "rank 0 running, and are MASTER_ADDR/MASTER_PORT the same on every rank?") from e
        time.sleep(0.05)
    sock.settimeout(None)
    sock.sendall(_digest(self.secret, _recv_exactly(sock, _NONCE)))
    if _recv_exactly(sock, 1) != _OK:
      sock.close()
      raise PermissionError(f"TCPStore: {self.host}:{self.port} refused this process: its job secret ({SECRET_ENV}) "
                            "differs from the server's")
    return sock

  def _call(self, op: bytes, key: str, value: bytes) -> tuple[bytes, bytes]:
    with self._lock:
      self._sock.sendall(op)
      _send_blob(self._sock, key.encode(), value)
      status = _recv_exactly(self._sock, 1)
      return status, _recv_blob(self._sock)

  def set(self, key: str, value: bytes | str) -> None:
    """Set `key` to `value`, waking every `get` waiting for it."""
    self._call(_SET, key, value.encode() if isinstance(value, str) else bytes(value))

  def get(self, key: str, timeout: float | None = None) -> bytes:
    """The value of `key`, waiting up to `timeout` seconds (default: the store's) for a rank to set it."""
    timeout = self.timeout if timeout is None else timeout
    status, value = self._call(_GET, key, str(timeout).encode())
    if status != _OK: raise RuntimeError(f"TCPStore.get: key {key!r} was not set within {timeout:.1f} s")
    return value

  def check(self, key: str) -> bytes | None:
    """The value of `key`, or None when no rank has set it (no waiting)."""
    status, value = self._call(_CHECK, key, b"")
    return value if status == _OK else None

  def add(self, key: str, amount: int) -> int:
    """Add `amount` to the integer at `key` (0 when unset) and return the sum."""
    return int(self._call(_ADD, key, str(int(amount)).encode())[1])

  def close(self) -> None:
    self._sock.close()
    if self._server: self._server.sock.close()
