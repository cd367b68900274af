#!/usr/bin/env python3
"""Helpers of scripts/api-check (python3 stdlib only).

  api_check.py token SUB                      print an HS256 JWT for user SUB, valid 1 h
                                              (key: the UTF-8 bytes of $IAP_AUTH_HS256_SECRET)
  api_check.py mint-receipt FAKE_URL BUNDLE   print the base64 receipt of a new purchase minted
                                              at the fake App Store of `iap dev`
  api_check.py mint-signed-notification FAKE_URL BUNDLE INTAKE_NOTIFICATION_URL
                                              print the signedPayload of a REFUND notification
                                              the fake App Store signed (caught on a loopback
                                              port, then the fake points at the intake again)
  api_check.py products INTAKE_URL [TYPE]     print the catalog's product ids (of TYPE), comma-separated
  api_check.py auth-enforced INTAKE_URL       exit 0 if a user route refuses a request without
                                              a token with 401, 1 if it serves it
  api_check.py summary JUNIT_XML LOG          print the run's counts on one line; exit 1 when
                                              an operation failed
"""
import base64
import hashlib
import hmac
import http.server
import json
import threading
import os
import re
import sys
import time
import urllib.error
import urllib.request
import xml.etree.ElementTree as ElementTree


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def token(subject: str, secret: str, lifetime: int = 3600) -> str:
    """A compact JWS: header.claims.signature, HMAC-SHA256 over the first two parts."""
    now = int(time.time())
    header = b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    claims = b64url(json.dumps({"sub": subject, "iat": now, "exp": now + lifetime}, separators=(",", ":")).encode())
    signing_input = f"{header}.{claims}".encode()
    signature = hmac.new(secret.encode(), signing_input, hashlib.sha256).digest()
    return f"{header}.{claims}.{b64url(signature)}"


def request(url: str, body: dict | None = None) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def mint(fake_url: str, bundle_id: str, field: str) -> str:
    """A purchase minted at the fake App Store: its `receiptData` or `signedTransaction`."""
    status, body = request(
        f"{fake_url}/fake/purchases",
        {"bundleId": bundle_id, "productId": "com.example.coins.60", "environment": "Production"},
    )
    if status // 100 != 2:
        sys.exit(f"the fake App Store answered {status}: {body[:200]!r}")
    return json.loads(body)[field]


def signed_notification(fake_url: str, bundle_id: str, intake_notification_url: str) -> str:
    """A genuine notification: the fake refunds a new purchase and sends its REFUND here."""
    caught: list[bytes] = []

    class Catch(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            caught.append(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Catch)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        request(f"{fake_url}/fake/config", {"notificationURL": f"http://127.0.0.1:{server.server_port}/"})
        transaction = mint(fake_url, bundle_id, "transactionId")
        status, body = request(f"{fake_url}/fake/purchases/{transaction}/refund", {})
        if status != 200:
            sys.exit(f"the fake App Store answered {status} to a refund: {body[:200]!r}")
        deadline = time.time() + 10
        while not caught and time.time() < deadline:
            time.sleep(0.05)
    finally:
        request(f"{fake_url}/fake/config", {"notificationURL": intake_notification_url})
        server.shutdown()
    if not caught:
        sys.exit("the fake App Store sent no notification")
    return json.loads(caught[0])["signedPayload"]


def products(intake_url: str, only_type: str | None = None) -> str:
    """The catalog's product ids, comma-separated; only those of `only_type` when given."""
    status, body = request(f"{intake_url}/v1/products")
    if status != 200:
        sys.exit(f"GET /v1/products answered {status}")
    return ",".join(
        product["productId"]
        for product in json.loads(body)["products"]
        if only_type is None or product["type"] == only_type
    )


def auth_enforced(intake_url: str) -> bool:
    status, _ = request(f"{intake_url}/v1/users/api-check/grants")
    return status == 401


def summary(junit_path: str, log_path: str) -> bool:
    """One line from schemathesis' JUnit report (one test case per operation, plus the
    stateful run) and the number of generated cases from its output."""
    failed, total = [], 0
    for case in ElementTree.parse(junit_path).getroot().iter("testcase"):
        total += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed.append(case.get("name", "?"))
    generated = re.findall(r"(\d+) generated", open(log_path, errors="replace").read())
    cases = f"{generated[-1]} cases, " if generated else ""
    line = f"{cases}{total - len(failed)} of {total} operations passed"
    print(line + (f"; failed: {', '.join(failed)}" if failed else ""))
    return not failed


def main() -> None:
    args = sys.argv[1:]
    if len(args) == 2 and args[0] == "token":
        secret = os.environ.get("IAP_AUTH_HS256_SECRET") or sys.exit("IAP_AUTH_HS256_SECRET is not set")
        print(token(args[1], secret))
    elif len(args) == 3 and args[0] == "mint-receipt":
        print(mint(args[1], args[2], "receiptData"))
    elif len(args) == 3 and args[0] == "mint-signed-transaction":
        print(mint(args[1], args[2], "signedTransaction"))
    elif len(args) == 4 and args[0] == "mint-signed-notification":
        print(signed_notification(args[1], args[2], args[3]))
    elif len(args) == 2 and args[0] == "products":
        print(products(args[1]))
    elif len(args) == 3 and args[0] == "products":
        print(products(args[1], args[2]))
    elif len(args) == 2 and args[0] == "auth-enforced":
        sys.exit(0 if auth_enforced(args[1]) else 1)
    elif len(args) == 3 and args[0] == "summary":
        sys.exit(0 if summary(args[1], args[2]) else 1)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
