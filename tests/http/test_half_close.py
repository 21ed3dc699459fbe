"""A client that sends its request and then shuts down its writing side (a half-close,
shutdown(SHUT_WR)) still reads: it must get its whole answer, streamed or not, over
HTTP/1.1 and HTTP/1.0.  Run by tests/integration/test_w2_half_closed_http_client_gets_its_answer.sh,
which starts a coordinator with http_endpoint and one worker for deployment tiny.
Environment: TSR_HTTP (host:port).  Plain sockets only: the point is what the client does
with its end of the connection.  Prints one line per check; exits non-zero on the first
failure."""
import json
import os
import socket
import sys

HOST, PORT = os.environ["TSR_HTTP"].rsplit(":", 1)
TOKENS = 200


def ok(cond, what):
    if not cond:
        print("FAIL: " + what)
        sys.exit(1)
    print("ok: " + what)


def ask(stream, version, half_close):
    """Sends a completion of TOKENS tokens; reads until the server closes.  Returns the raw
    bytes, with any interim (1xx) responses left in."""
    s = socket.create_connection((HOST, int(PORT)))
    s.settimeout(60)
    body = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": TOKENS,
                       "temperature": 0, "stream": stream}).encode()
    s.sendall(b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    if half_close:
        s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        part = s.recv(65536)
        if not part:
            break
        got += part
    s.close()
    return got


def unchunk(b):
    out = b""
    while True:
        size, _, rest = b.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            return out
        out += rest[:n]
        b = rest[n + 2:]


def answer(raw):
    """(status, text, finish_reason, done) of a response, streamed or not."""
    while raw.startswith(b"HTTP/1.1 1"):  # interim responses come before the answer
        raw = raw.split(b"\r\n\r\n", 1)[1]
    if not raw.startswith(b"HTTP/"):
        return 0, None, None, False
    head, _, body = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    if b"transfer-encoding: chunked" in head.lower():
        body = unchunk(body)
    if b"text/event-stream" not in head:
        doc = json.loads(body)
        if status != 200:
            return status, None, None, False
        return status, doc["choices"][0]["text"], doc["choices"][0]["finish_reason"], True
    text, finish, done = "", None, False
    for line in body.decode().split("\n"):
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            c = json.loads(line[6:])["choices"][0]
            text += c["text"]
            finish = c["finish_reason"] or finish
    return status, text, finish, done


for stream in (False, True):
    kind = "streamed" if stream else "non-streamed"
    raw = ask(stream, b"1.1", False)
    want = answer(raw)
    ok(want[0] == 200 and want[1] and want[3], "a %s answer on an open connection, got %r" %
       (kind, raw[:300]))
    for version in (b"1.1", b"1.0"):
        raw = ask(stream, version, True)
        got = answer(raw)
        ok(got == want, "HTTP/%s, half-closed after the request: the whole %s answer (%d "
           "bytes of text, finish %s), got %r" % (version.decode(), kind, len(want[1]),
                                                  want[2], raw[:300]))
