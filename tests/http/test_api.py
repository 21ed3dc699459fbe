"""Drives Tessera's HTTP API with the official `openai` client (and plain HTTP where the
client hides what is checked).  Run by tests/integration/test_w_http_api.sh, which starts
a coordinator with http_endpoint and an API keys file, and workers for three deployments:
  text   tp=1, the model's tokenizer and chat template (model-init's), max_seq_len 400
  tight  the same model with max_batch 1 and max_queue 0 (a second request finds it full)
  slow   a larger model (about 10 ms a token), max_seq_len 1000
  sp     a model with a SentencePiece-style tokenizer (Metaspace, byte fallback) built by
         tests/tokenizer/build_tokenizers.py, and its [INST] chat template
  wide   a model of 4,096 ids beside the 1,024-id shipped tokenizer: refused at load
Environment: TSR_HTTP (base URL), TSR_KEY, TSR_BIN, TSR_CEP, TSR_MODEL, TSR_SP_MODEL,
TSR_YAML.
Prints one line per check and exits non-zero on the first failure."""
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import openai
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

BASE, KEY, BIN = os.environ["TSR_HTTP"], os.environ["TSR_KEY"], os.environ["TSR_BIN"]
CEP, MODEL, YAML = os.environ["TSR_CEP"], os.environ["TSR_MODEL"], os.environ["TSR_YAML"]
SP_MODEL = os.environ["TSR_SP_MODEL"]
PROMPT = "Tessera serves sharded models: ça marche, 日本語も."
client = OpenAI(base_url=BASE + "/v1", api_key=KEY, max_retries=0, timeout=120)


def ok(cond, what):
    if not cond:
        print("FAIL: " + what)
        sys.exit(1)
    print("ok: " + what)


def run(*args):
    p = subprocess.run([BIN + "/tessera", *args], capture_output=True, text=True, timeout=120)
    if p.returncode != 0:
        print("FAIL: tessera %s: %s" % (" ".join(args), p.stderr))
        sys.exit(1)
    return p.stdout


def cli_ids(prompt, n, dep="text"):
    return [int(x) for x in run("--coordinator", CEP, "generate", dep, "--prompt", prompt,
                                "--max-tokens", str(n), "--ids").split()]


def decode(ids):
    return run("tokenize", MODEL, "--decode", ",".join(map(str, ids)))[:-1]  # its newline


def prompt_ids(text):
    return [int(x) for x in run("tokenize", MODEL, text).strip().split(",")]


def http(method, path, body=None, key=KEY, raw=None):
    req = urllib.request.Request(BASE + path, method=method, data=raw if raw is not None else
                                 (json.dumps(body).encode() if body is not None else None))
    if key:
        req.add_header("Authorization", "Bearer " + key)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def metrics():
    """The metrics as they are now: the server answers every scrape from one text up to
    250 ms old, so this waits that long first."""
    time.sleep(0.26)
    st, _, text = http("GET", "/metrics", key=None)
    if st != 200:
        ok(False, "/metrics answers 200, not %d" % st)
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(m, name, **labels):
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def ended(m, dep):
    return sum(metric(m, "tessera_requests_total", deployment=dep, outcome=o)
               for o in ("stop", "length"))


# ---- models and health ------------------------------------------------------------
ok(sorted(m.id for m in client.models.list()) == ["slow", "sp", "text", "tight", "wide"], "/v1/models lists the deployments")
st, _, body = http("GET", "/health", key=None)
ok(st == 200 and json.loads(body)["status"] == "ok", "/health is 200 while every deployment is ready")

# ---- completions: the CLI's tokens, as text; streamed = whole ------------------------
ids = cli_ids(PROMPT, 40)
want = decode(ids)
r = client.completions.create(model="text", prompt=PROMPT, max_tokens=40, temperature=0)
ok(r.choices[0].text == want, "completion text = decoded `tessera generate --ids` tokens")
ok(r.usage.completion_tokens == len(ids) and r.usage.prompt_tokens == len(prompt_ids(PROMPT)),
   "usage counts the prompt and completion tokens (%d, %d)" % (r.usage.prompt_tokens,
                                                              r.usage.completion_tokens))
ok(r.choices[0].finish_reason == ("length" if len(ids) == 40 else "stop"), "finish_reason")
chunks = list(client.completions.create(model="text", prompt=PROMPT, max_tokens=40,
                                        temperature=0, stream=True))
ok("".join(c.choices[0].text for c in chunks) == want, "streamed deltas concatenate to the text")
ok(chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason, "the last chunk says why")
r2 = client.completions.create(model="text", prompt=prompt_ids(PROMPT), max_tokens=40,
                               temperature=0)
ok(r2.choices[0].text == want, "a prompt of token ids gives the same text")
s1 = client.completions.create(model="text", prompt=PROMPT, max_tokens=20, temperature=0.9,
                               top_p=0.9, seed=11)
s2 = client.completions.create(model="text", prompt=PROMPT, max_tokens=20, temperature=0.9,
                               top_p=0.9, seed=11, stream=True)
ok(s1.choices[0].text == "".join(c.choices[0].text for c in s2), "a seeded sample repeats")
# A top_p above 0 keeps at least the top token, however small (1e-300 is 0 as a float).
tiny = client.completions.create(model="text", prompt=PROMPT, max_tokens=40, temperature=1,
                                 top_p=1e-300, seed=5)
ok(tiny.choices[0].text == want, "top_p 1e-300 keeps the top token alone: the greedy text")

# ---- chat -----------------------------------------------------------------------------
msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
rendered = ("<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n")
cids = cli_ids(rendered, 30)
c = client.chat.completions.create(model="text", messages=msgs, max_tokens=30, temperature=0)
ok(c.choices[0].message.content == decode(cids) and c.choices[0].message.role == "assistant",
   "chat renders the model's template (llama3 layout) and answers its tokens")
cs = list(client.chat.completions.create(model="text", messages=msgs, max_tokens=30,
                                         temperature=0, stream=True))
ok(cs[0].choices[0].delta.role == "assistant" and
   "".join(x.choices[0].delta.content or "" for x in cs) == c.choices[0].message.content,
   "streamed chat deltas concatenate to the answer")

# ---- the completion continues the prompt (SentencePiece: the first word's space) ----------
# The reference library's decode of the prompt's ids and the completion's together is the
# prompt followed by the completion's text: for /v1/completions (text or ids, streamed or
# not) and `tessera generate --prompt`.  A chat's answer is what its ids add to the
# decode of the rendered conversation, the same rule.
def continues_the_prompt():
    sp = Tokenizer.from_file(SP_MODEL + "/tokenizer.json")
    alone_differs = 0
    for p in ("Once upon a time", "The coordinator plans", "ça marche", "Tessera serves text",
              "one two three"):
        pids = sp.encode(p).ids
        ok(sp.decode(pids, skip_special_tokens=True) == p, "sp: %r encodes and decodes back" % p)
        ids = cli_ids(p, 12, "sp")
        want = sp.decode(pids + ids, skip_special_tokens=True)
        alone_differs += sp.decode(ids, skip_special_tokens=True) != want[len(p):]
        r = client.completions.create(model="sp", prompt=p, max_tokens=12, temperature=0)
        ok(p + r.choices[0].text == want,
           "sp: prompt + completion text = the reference decode of all the ids (%r + %r, want %r; "
           "ids %s)" % (p, r.choices[0].text, want, pids + ids))
        chunks = list(client.completions.create(model="sp", prompt=p, max_tokens=12, temperature=0,
                                                stream=True))
        ok(p + "".join(c.choices[0].text for c in chunks) == want, "sp: streamed, too")
        r = client.completions.create(model="sp", prompt=pids, max_tokens=12, temperature=0)
        ok(p + r.choices[0].text == want, "sp: a prompt of ids, too")
        out = subprocess.run([BIN + "/tessera", "--coordinator", CEP, "generate", "sp", "--prompt",
                              p, "--max-tokens", "12"], capture_output=True, timeout=120,
                             check=True).stdout.decode()   # bytes: a "\r\n" stays one
        ok(out.endswith("\n") and p + out[:-1] == want,
           "sp: `tessera generate --prompt` prints the same text (%r)" % out)
    ok(alone_differs > 0, "sp: some completions read differently decoded on their own (%d of 5): "
       "the case checked here" % alone_differs)
    msgs = [{"role": "user", "content": "Tell me a story"}]
    rendered = "[INST] Tell me a story [/INST]"   # mistral's layout, from the [INST] template
    rids, cids = sp.encode(rendered).ids, cli_ids(rendered, 12, "sp")
    head, whole = (sp.decode(x, skip_special_tokens=True) for x in (rids, rids + cids))
    ok(whole.startswith(head), "sp: the rendered chat's text begins the decode with the answer")
    c = client.chat.completions.create(model="sp", messages=msgs, max_tokens=12, temperature=0)
    ok(c.choices[0].message.content == whole[len(head):],
       "sp: the chat answer is what its ids add to the conversation's text (%r)"
       % c.choices[0].message.content)
    cs = list(client.chat.completions.create(model="sp", messages=msgs, max_tokens=12,
                                             temperature=0, stream=True))
    ok("".join(x.choices[0].delta.content or "" for x in cs) == c.choices[0].message.content,
       "sp: streamed chat deltas concatenate to it")


continues_the_prompt()

# ---- a tokenizer that does not cover the model: no text, with the reason --------------
for fn in (lambda: client.completions.create(model="wide", prompt="hello", max_tokens=4),
           lambda: client.completions.create(model="wide", prompt=[1, 2, 3], max_tokens=4),
           lambda: client.chat.completions.create(model="wide", max_tokens=4, messages=[
               {"role": "user", "content": "hello"}])):
    try:
        fn()
        ok(False, "wide: a tokenizer of 1,024 ids answers for a model of 4,096")
    except openai.APIStatusError as e:
        ok(400 <= e.status_code < 600 and "tokens for 1024 of the model's 4096 ids" in e.message,
           "wide: refused with the reason (%d %s)" % (e.status_code, e.message))

# ---- stop strings ------------------------------------------------------------------------
text = want
cut = next((text[i:i + 3] for i in range(8, len(text) - 3) if text[i:i + 3].strip()), None)
ok(cut is not None, "the text has a stop candidate")
expect = text[:text.find(cut)]
m_before = metrics()
r3 = client.completions.create(model="text", prompt=PROMPT, max_tokens=40, temperature=0,
                               stop=["\x01never", cut])
ok(r3.choices[0].text == expect and r3.choices[0].finish_reason == "stop",
   "a stop string cuts exactly (%r)" % cut)
st3 = list(client.completions.create(model="text", prompt=PROMPT, max_tokens=40,
                                     temperature=0, stop=cut, stream=True))
ok("".join(x.choices[0].text for x in st3) == expect and
   st3[-1].choices[0].finish_reason == "stop", "streamed, too: nothing of the stop is sent")
# The cancel that a stop string sends may reach the loop after the client's next request,
# or after the replica's last token (then the request ended as length): never cancelled.
t0 = time.time()
while True:
    m_after = metrics()
    ends = ended(m_after, "text") - ended(m_before, "text")
    if ends >= 2 or time.time() - t0 > 5:
        break
    time.sleep(0.05)
ok(ends >= 2 and
   metric(m_after, "tessera_requests_total", deployment="text", outcome="cancelled") ==
   metric(m_before, "tessera_requests_total", deployment="text", outcome="cancelled"),
   "a stop string counts as a finished request (outcome stop or length), not a cancelled one (%d ended, cancelled %d -> %d)" % (ends, metric(m_before, "tessera_requests_total", deployment="text", outcome="cancelled"), metric(m_after, "tessera_requests_total", deployment="text", outcome="cancelled")))

# ---- errors ------------------------------------------------------------------------------
def status_of(fn):
    try:
        fn()
    except openai.APIStatusError as e:
        return e.status_code, e.body if isinstance(e.body, dict) else {}, e.response.headers
    return 200, {}, {}


code, body, _ = status_of(lambda: client.completions.create(model="text", prompt="x",
                                                            temperature=5))
ok(code == 400 and body.get("param") == "temperature", "400 names the bad field")
code, body, _ = status_of(lambda: client.completions.create(model="text", prompt="x",
                                                            extra_body={"stream_options": "x"}))
ok(code == 400 and body.get("param") == "stream_options", "400 for stream_options not an object")
code, body, _ = status_of(lambda: client.completions.create(model="text", prompt=["a", "b"]))
ok(code == 400 and body.get("param") == "prompt", "a list of two strings: 400 naming the prompt")
code, body, _ = status_of(lambda: client.completions.create(model="text", prompt="x",
                                                            max_tokens=0))
ok(code == 400 and body.get("param") == "max_tokens", "400 for max_tokens 0")
code, body, _ = status_of(lambda: client.chat.completions.create(model="text", messages=[
    {"role": "wizard", "content": "x"}]))
ok(code == 400 and "messages[0].role" in body.get("message", ""), "400 names the bad message")
code, body, _ = status_of(lambda: client.completions.create(model="nope", prompt="x"))
ok(code == 404 and body.get("code") == "model_not_found", "404 for an unknown model")
st, _, body = http("POST", "/v1/completions", raw=b'{"model": "text", "prompt": "' +
                   b"x" * (2 << 20) + b'"}')
ok(st == 413 and "error" in json.loads(body), "413 for an oversized body")
st, _, body = http("POST", "/v1/completions", raw=b"{not json")
ok(st == 400 and "error" in json.loads(body), "400 for a body that is not JSON")
bad = OpenAI(base_url=BASE + "/v1", api_key="wrong-key-0123456789", max_retries=0)
code, _, _ = status_of(lambda: bad.completions.create(model="text", prompt="x"))
ok(code == 401, "401 for a wrong API key")
st, _, _ = http("GET", "/v1/models", key=None)
ok(st == 401, "401 without a key")
st, _, _ = http("GET", "/nowhere")
ok(st == 404, "404 for an unknown path")
code, body, _ = status_of(lambda: client.completions.create(model="text", prompt="tessera " * 2000))
ok(code == 400 and body.get("param") == "prompt" and "more than 400 tokens" in body.get("message", ""),
   "400 naming the prompt for a text of more tokens than max_seq_len (16 KB of it)")
# A stranger's body is not read: 401 comes before it.
s = socket.create_connection((BASE.split("//")[1].split(":")[0], int(BASE.rsplit(":", 1)[1])))
s.settimeout(10)
s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
ok(s.recv(64).startswith(b"HTTP/1.1 401"), "401 before the body of a request without a key")
s.close()


def raw(request):
    """Sends raw bytes; returns the status line's code."""
    s = socket.create_connection((BASE.split("//")[1].split(":")[0], int(BASE.rsplit(":", 1)[1])))
    s.settimeout(10)
    s.sendall(request)
    got = s.recv(256)
    s.close()
    return int(got.split(b" ")[1]) if got.startswith(b"HTTP/") else 0


auth = b"Authorization: Bearer " + KEY.encode() + b"\r\n"
ok(raw(b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n\r\n") == 401 and
   raw(b"GET /v1/nope HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n") == 404,
   "/v1/ paths are not told apart without a key (401), 404 with one")
ok(raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 2\r\n"
       b"Content-Length: 40\r\n\r\n{}") == 400, "two Content-Lengths: 400, no smuggling")
ok(raw(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Length: 5000000\r\n"
       b"Expect: 100-continue\r\n\r\n") == 413, "Expect: 100-continue with 5 MB: 413 at once")
body = json.dumps({"model": "text", "prompt": "x", "max_tokens": 1}).encode()
post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth
ok(raw(post + b"Transfer-Encoding : chunked\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
   == 400, "a header name with white space before its colon: 400 (a proxy may read it as "
   "Transfer-Encoding)")
ok(raw(post + b"Transfer-Encoding: gzip\r\n\r\n") == 501 and
   raw(post + b"Transfer-Encoding: gzip, chunked\r\n\r\n1\r\nx\r\n0\r\n\r\n") == 501,
   "a Transfer-Encoding other than chunked: 501 at once")
ok(raw(post + b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
   == 400, "two Transfer-Encoding headers: 400")
ok(raw(b"GET /health HTTP/1.1\r\n\r\n") == 400 and
   raw(b"GET /health HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n") == 400 and
   raw(b"GET /health HTTP/1.0\r\n\r\n") == 200,
   "HTTP/1.1 without a Host, or with two: 400 (HTTP/1.0 needs none)")
ok(raw(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n") == 200, "HEAD /health works for probes")
ok(raw(b"GET /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth + b"\r\n") == 405 and
   raw(b"POST /health HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n") == 405,
   "405 for a method an endpoint does not take")
t0 = time.time()
code, body, _ = status_of(lambda: client.completions.create(model="text", prompt=" " * 1000000))
ok(code == 400 and time.time() - t0 < 5, "1 MB of spaces is refused as too many tokens (%.0f ms)"
   % ((time.time() - t0) * 1000))

# A full queue: tight has max_batch 1 and max_queue 0.
first = client.completions.create(model="tight", prompt=PROMPT, max_tokens=300, temperature=0,
                                  stream=True)
next(iter(first))  # it holds the only slot now
code, body, headers = status_of(lambda: client.completions.create(model="tight", prompt="x"))
ok(code == 503 and headers.get("retry-after") == "1", "503 with Retry-After when the queue is full")
first.close()

# ---- a client that goes away cancels its request ------------------------------------------
def raw_completion(model, stream, n, version=b"1.1", half_close=False):
    """A completion of n tokens sent on a raw socket, which the caller closes; half_close:
    the socket's writing side is shut down once the request is sent."""
    s = socket.create_connection((BASE.split("//")[1].split(":")[0], int(BASE.rsplit(":", 1)[1])))
    req = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": n, "stream": stream,
                      "temperature": 0}).encode()
    s.sendall(b"POST /v1/completions HTTP/" + version + b"\r\nHost: x\r\n" +
              (b"Connection: close\r\n" if half_close else b"") +
              b"Content-Type: application/json\r\n"
              b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: " +
              str(len(req)).encode() + b"\r\n\r\n" + req)
    if half_close:
        s.shutdown(socket.SHUT_WR)
    return s


def read_until(s, marker):
    """What s sends until marker has come or the connection ends (marker None: until it
    ends)."""
    got = b""
    while marker is None or marker not in got:
        part = s.recv(4096)
        if not part:
            break
        got += part
    return got


m0 = metrics()
s = raw_completion("text", True, 350)
s.settimeout(30)
got = read_until(s, b"data:")
ok(b"data:" in got, "a raw stream started")
s.close()
t0 = time.time()
while time.time() - t0 < 10 and metric(metrics(), "tessera_requests_total", deployment="text",
                                       outcome="cancelled") <= metric(m0, "tessera_requests_total",
                                                                      deployment="text",
                                                                      outcome="cancelled"):
    time.sleep(0.05)
ok(time.time() - t0 < 10, "closing the connection cancelled the request (%.0f ms)" %
   ((time.time() - t0) * 1000))

# The same without streaming: nothing is written to the client before the end, so the server
# must look at its connection while the tokens come, not only when they stop.
m0 = metrics()
s = raw_completion("slow", False, 900)
t0 = time.time()
while time.time() - t0 < 10 and metric(metrics(), "tessera_generated_tokens_total",
                                       deployment="slow") == \
        metric(m0, "tessera_generated_tokens_total", deployment="slow"):
    time.sleep(0.005)
s.close()  # tokens are coming
t0 = time.time()
cancelled = lambda m: metric(m, "tessera_requests_total", deployment="slow", outcome="cancelled")
while time.time() - t0 < 10 and cancelled(metrics()) <= cancelled(m0):
    time.sleep(0.05)
m1 = metrics()
ok(cancelled(m1) == cancelled(m0) + 1 and ended(m1, "slow") == ended(m0, "slow"),
   "closing the connection cancelled a request that is not streamed, while its tokens came "
   "(%.0f ms, %d of its 900 tokens made)" % ((time.time() - t0) * 1000,
   metric(m1, "tessera_generated_tokens_total", deployment="slow") -
   metric(m0, "tessera_generated_tokens_total", deployment="slow")))

# ---- a client that half-closes still gets its answer ------------------------------------------
# A client may send its request, shut down its writing side (shutdown(SHUT_WR)) and still
# read: that end of its request stream is not a client gone.
def read_all(s):
    """What s sends until the server closes; closes s."""
    got = read_until(s, None)
    s.close()
    return got


def answer_of(raw):
    """(status, text, finish_reason, [DONE] seen) of a raw response, its 1xx skipped."""
    while raw.startswith(b"HTTP/1.1 1"):
        raw = raw.split(b"\r\n\r\n", 1)[1]
    if not raw.startswith(b"HTTP/"):
        return 0, None, None, False
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        plain = b""
        while True:
            size, _, rest = body.partition(b"\r\n")
            n = int(size.split(b";")[0], 16)
            if n == 0:
                break
            plain, body = plain + rest[:n], rest[n + 2:]
        body = plain
    status = int(head.split(b" ")[1])
    if status != 200:
        return status, None, None, False
    if b"text/event-stream" not in head:
        c = json.loads(body)["choices"][0]
        return status, c["text"], c["finish_reason"], True
    text, finish, done = "", None, False
    for line in body.decode().split("\n"):
        if line == "data: [DONE]":
            done = True
        elif line.startswith("data: "):
            c = json.loads(line[6:])["choices"][0]
            text, finish = text + c["text"], c["finish_reason"] or finish
    return status, text, finish, done


r = client.completions.create(model="text", prompt=PROMPT, max_tokens=200, temperature=0)
whole = (200, r.choices[0].text, r.choices[0].finish_reason, True)
for stream in (False, True):
    for version in (b"1.1", b"1.0"):
        s = raw_completion("text", stream, 200, version, half_close=True)
        s.settimeout(60)
        raw = read_all(s)
        ok(answer_of(raw) == whole,
           "HTTP/%s, half-closed after its request: the whole %s answer, got %r" %
           (version.decode(), "streamed" if stream else "non-streamed", raw[:200]))

# One that half-closes, reads the interim 102 that tells an HTTP/1.1 client its answer is
# being made, and then closes: nothing is left unread, so its close sends nothing; the
# server's next write to it finds it gone.
m0 = metrics()
s = raw_completion("slow", False, 900, half_close=True)
s.settimeout(30)
got = read_until(s, b"\r\n\r\n")
ok(got.startswith(b"HTTP/1.1 102 "), "a half-closed HTTP/1.1 client waiting for a whole answer "
   "is sent 102 Processing, got %r" % got[:100])
s.close()
t0 = time.time()
while time.time() - t0 < 10 and cancelled(metrics()) <= cancelled(m0):
    time.sleep(0.05)
m1 = metrics()
ok(cancelled(m1) == cancelled(m0) + 1 and ended(m1, "slow") == ended(m0, "slow"),
   "a client that half-closed and then closed is noticed: its request cancelled (%.0f ms)" %
   ((time.time() - t0) * 1000))

# ---- 32 concurrent streams ----------------------------------------------------------------------
results = [None] * 32


def one(i):
    try:
        results[i] = "".join(x.choices[0].text for x in client.completions.create(
            model="text", prompt=PROMPT, max_tokens=40, temperature=0, stream=True))
    except Exception as e:  # noqa: BLE001 (reported below)
        results[i] = "error: %s" % e


threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
for t in threads:
    t.start()
for t in threads:
    t.join()
ok(all(x == want for x in results), "32 concurrent streaming clients all get the text (%d differ)"
   % sum(x != want for x in results))

# ---- metrics count what was sent -----------------------------------------------------------------
m0 = metrics()
sent = [client.completions.create(model="text", prompt=PROMPT[:k], max_tokens=5 + k,
                                  temperature=0) for k in (5, 10, 15, 20, 25)]
m1 = metrics()
d = lambda name, **l: metric(m1, name, **l) - metric(m0, name, **l)  # noqa: E731
ok(ended(m1, "text") - ended(m0, "text") == 5, "tessera_requests_total counts the 5 requests")
ok(d("tessera_generated_tokens_total", deployment="text") ==
   sum(x.usage.completion_tokens for x in sent), "generated tokens match the usage")
ok(d("tessera_prompt_tokens_total", deployment="text") == sum(x.usage.prompt_tokens for x in sent),
   "prompt tokens match the usage")
ok(d("tessera_time_to_first_token_seconds_count", deployment="text") == 5 and
   d("tessera_request_duration_seconds_count", deployment="text") == 5 and
   d("tessera_inter_token_latency_seconds_count", deployment="text") ==
   sum(x.usage.completion_tokens - 1 for x in sent), "the histograms saw every request and token")
ok(metric(m1, "tessera_deployment_state", deployment="text", state="ready") == 1 and
   metric(m1, "tessera_workers", state="ready") == 5 and metric(m1, "tessera_plan_epoch") >= 1,
   "deployment states, workers by state and the plan epoch")

# A flood of scrapes costs the coordinator's loop one metrics text every 250 ms: for a
# second of back-to-back scrapes, the heartbeats counter (three workers, ten a second each)
# takes at most 5 values, and more than one.
seen, t0 = set(), time.time()
while time.time() - t0 < 1.0:
    for line in http("GET", "/metrics", key=None)[2].splitlines():
        if line.startswith("tessera_heartbeats_total"):
            seen.add(line)
ok(2 <= len(seen) <= 5, "scrapes share one metrics text for 250 ms (%d heartbeat counts in 1 s)"
   % len(seen))

# ---- health: a deployment with no ready replica ----------------------------------------------------
orig = open(YAML).read()
with open(YAML, "a") as f:
    f.write("  - name: ghost\n    model: %s\n    parallel: {tensor: 1, pipeline: 1, replicas: 1}\n"
            "    max_seq_len: 64\n" % MODEL)
run("--coordinator", CEP, "reload")


def health_until(status, secs=3):
    """/health is answered from a snapshot up to 250 ms old: poll until it says status."""
    t0 = time.time()
    while True:
        st, headers, body = http("GET", "/health", key=None)
        if st == status or time.time() - t0 > secs:
            return st, headers, body
        time.sleep(0.05)


st, headers, body = health_until(503)
ok(st == 503 and any("ghost" in x for x in json.loads(body)["reasons"]) and
   headers.get("Retry-After") == "1", "/health is 503 naming the deployment without a replica")
code, body, headers = status_of(lambda: client.completions.create(model="ghost", prompt="x"))
ok(code == 503 and headers.get("retry-after") == "1", "503 with Retry-After for a deployment "
   "that is not ready")
open(YAML, "w").write(orig)
run("--coordinator", CEP, "reload")
st, _, _ = health_until(200)
ok(st == 200, "/health is 200 again once it is gone")
