#!/usr/bin/env python3
"""Floods a running order service from one address, 1,000 requests per class of docs/security.md's
third round (python3 stdlib only), and prints what each class was answered.

  edge_flood.py [CLASS...]    every class, or those whose name holds one of the words

Environment: IAP_FLOOD_PUBLIC_PORT and IAP_FLOOD_ADMIN_PORT (the intake's and the admin
listener's ports on 127.0.0.1; 18480 and 18481), IAP_AUTH_HS256_SECRET and IAP_ADMIN_TOKEN (the
service's). Start the service with IAP_BUNDLE_IDS=com.example.tests, then grep its log for lines
at error level.
"""
import os
import socket, json, base64, hmac, hashlib, time, sys, collections
PUB = int(os.environ.get("IAP_FLOOD_PUBLIC_PORT", "18480"))
ADM = int(os.environ.get("IAP_FLOOD_ADMIN_PORT", "18481"))
SECRET = os.environ["IAP_AUTH_HS256_SECRET"].encode()
ADMIN = os.environ["IAP_ADMIN_TOKEN"]
def b64u(b): return base64.urlsafe_b64encode(b).rstrip(b"=").decode()
def jwt(sub):
    now = int(time.time())
    h = b64u(json.dumps({"alg": "HS256", "typ": "JWT"}).encode()); p = b64u(json.dumps({"sub": sub, "iat": now, "exp": now + 3600}).encode())
    s = b64u(hmac.new(SECRET, f"{h}.{p}".encode(), hashlib.sha256).digest()); return f"{h}.{p}.{s}"
def raw(port, head, body=b"", timeout=10):
    s = socket.create_connection(("127.0.0.1", port)); s.settimeout(timeout)
    s.sendall(head.encode() + body); data = b""
    try:
        while True:
            chunk = s.recv(65536)
            if not chunk: break
            data += chunk
            if b"\r\n\r\n" in data:
                hdr, _, rest = data.partition(b"\r\n\r\n")
                cl = [l for l in hdr.split(b"\r\n") if l.lower().startswith(b"content-length:")]
                if cl and len(rest) >= int(cl[0].split(b":")[1]): break
    except socket.timeout: pass
    s.close()
    return int(data.split(b" ")[1]) if data else 0
def req(port, method, path, headers, body=b""):
    head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    if body and "Transfer-Encoding" not in headers: head += f"Content-Length: {len(body)}\r\n"
    return raw(port, head + "\r\n", body)
def der(tag, content):
    n = len(content)
    l = bytes([n]) if n < 128 else (lambda b: bytes([0x80 | len(b)]) + b)(n.to_bytes((n.bit_length() + 7) // 8, "big"))
    return bytes([tag]) + l + content
def attr(t, v): return der(0x30, der(0x02, bytes([t >> 8, t & 255]) if t > 127 else bytes([t])) + der(0x02, b"\x01") + der(0x04, v))
payload = der(0x31, attr(2, der(0x0C, b"com.example.tests")) + attr(3, der(0x0C, b"1")) + attr(99, b"A" * 200_000))
p7 = bytes([0x2A, 0x86, 0x48, 0x86, 0xF7, 0x0D, 0x01, 0x07])
enc = der(0x30, der(0x06, p7 + b"\x01") + der(0xA0, der(0x04, payload)))
shell = der(0x30, der(0x06, p7 + b"\x02") + der(0xA0, der(0x30, der(0x02, b"\x01") + der(0x31, b"") + enc + der(0x31, b""))))
token = jwt("mallory")
classes = {
 "unknown transfer coding, notifications": lambda i: req(PUB, "POST", "/v1/notifications/appstore", {"Content-Type": "application/json", "Transfer-Encoding": "gzip"}, b"{}"),
 "unknown transfer coding, /v1/receipts": lambda i: req(PUB, "POST", "/v1/receipts", {"Content-Type": "application/json", "Transfer-Encoding": "xchunked"}, b"{}"),
 "unknown transfer coding, admin listener": lambda i: req(ADM, "POST", "/v1/admin/grants", {"Content-Type": "application/json", "Transfer-Encoding": "gzip"}, b"{}"),
 "admin token guesses": lambda i: req(ADM, "GET", "/v1/admin/audit", {"Authorization": f"Bearer guess-{i}-0123456789abcdefghijklmnopqrstuv"}),
 "console sign-in guesses": lambda i: req(ADM, "POST", "/admin/login", {"Content-Type": "application/x-www-form-urlencoded"}, f"token=guess-{i}".encode()),
 "unsigned containers": lambda i: req(PUB, "POST", "/v1/receipts", {"Content-Type": "application/json", "Authorization": f"Bearer {token}"}, json.dumps({"receiptData": base64.b64encode(shell).decode()}).encode()),
 "confusable actors": lambda i: req(ADM, "POST", "/v1/admin/grants", {"Content-Type": "application/json", "Authorization": f"Bearer {ADMIN}"}, json.dumps({"userId": "ana", "productId": "com.example.coins.60", "reason": "r", "actor": ["\u0430pple", "\uff41\uff50\uff50\uff4c\uff45", "Apple Inc.", "syst\u0435m"][i % 4]}).encode()),
 "body-less notifications": lambda i: req(PUB, "POST", "/v1/notifications/appstore", {"Content-Type": "application/json"}),
}
only = sys.argv[1:] 
for name, send in classes.items():
    if only and not any(o in name for o in only): continue
    counts = collections.Counter(); first429 = None; start = time.time()
    for i in range(1000):
        st = send(i); counts[st] += 1
        if st == 429 and first429 is None: first429 = i + 1
    print(f"{name}: {dict(sorted(counts.items()))}; first 429 at request {first429}; {time.time() - start:.1f} s", flush=True)
# Held-back notification bodies: 200 at once from one address.
socks = []; statuses = collections.Counter()
for i in range(200):
    s = socket.create_connection(("127.0.0.1", PUB)); s.settimeout(0.5)
    s.sendall(b"POST /v1/notifications/appstore HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4000\r\n\r\n{\"signedPayload\": \"eyJ")
    socks.append(s)
time.sleep(1)
for s in socks:
    try:
        d = s.recv(200); statuses[int(d.split(b" ")[1]) if d else "held"] += 1
    except socket.timeout: statuses["held"] += 1
print(f"held-back notifications (200 at once): {dict(statuses)}", flush=True)
for s in socks: s.close()
