"""A client that sends its request and then shuts down its writing side (a half-close,
shutdown(SHUT_WR)) still reads: it must get its whole answer, streamed or not, over
HTTP/1.1 and HTTP/1.0; and one that half-closes and later closes is still noticed: its
request is cancelled.  Run by tests/integration/test_w2_half_closed_http_client_gets_its_answer.sh,
which starts a coordinator with http_endpoint and workers for deployments tiny and slow
(about 10 ms a token).
Environment: TSR_HTTP (host:port).  Plain sockets only: the point is what the client does
with its end of the connection.  Prints one line per check; exits non-zero on the first
failure."""
import json
import os
import socket
import re
import sys
import time

HOST, PORT = os.environ["TSR_HTTP"].rsplit(":", 1)
TOKENS = 200


def ok(cond, what):
    if not cond:
        print("FAIL: " + what)
        sys.exit(1)
    print("ok: " + what)


def send(model, tokens, stream, version, prompt=(1, 2, 3)):
    s = socket.create_connection((HOST, int(PORT)))
    s.settimeout(60)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": tokens,
                       "temperature": 0, "stream": stream}).encode()
    s.sendall(b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
    return s


def ask(stream, version, half_close):
    """Sends a completion of TOKENS tokens; reads until the server closes.  Returns the raw
    bytes, with any interim (1xx) responses left in."""
    s = send("tiny", TOKENS, stream, version)
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


def outcomes(dep):
    """tessera_requests_total by outcome for deployment dep (the server shares one /metrics
    text for 250 ms: this may see one that old)."""
    s = socket.create_connection((HOST, int(PORT)))
    s.settimeout(10)
    s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    got = b""
    while True:
        part = s.recv(65536)
        if not part:
            break
        got += part
    s.close()
    out = {}
    for m in re.finditer(r'^tessera_requests_total\{([^}]*)\} (\S+)$', got.decode(), re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
        if labels.get("deployment") == dep:
            out[labels.get("outcome")] = float(m.group(2))
    return out


# Half-closed, then closed once the interim answer was read: nothing is left unread, so the
# close sends nothing; only the next write to it finds that it is gone.
before = outcomes("slow")
# (a prompt on which slow makes no eos for a while)
s = send("slow", 900, False, b"1.1", "Tessera serves sharded models: ça marche, 日本語も.")
s.shutdown(socket.SHUT_WR)
got = b""
while b"\r\n\r\n" not in got:
    part = s.recv(4096)
    if not part:
        break
    got += part
ok(got.startswith(b"HTTP/1.1 102 "), "a half-closed HTTP/1.1 client waiting for a whole answer "
   "is told it is being made (102), got %r" % got[:100])
s.close()
t0 = time.time()
while time.time() - t0 < 10 and outcomes("slow").get("cancelled", 0) <= before.get("cancelled", 0):
    time.sleep(0.05)
after = outcomes("slow")
ok(after.get("cancelled", 0) == before.get("cancelled", 0) + 1 and
   after.get("length", 0) == before.get("length", 0),
   "a client that half-closed and then closed is noticed: its request cancelled in %.0f ms "
   "(requests of slow by outcome: %s before, %s after)" % ((time.time() - t0) * 1000, before,
                                                          after))
