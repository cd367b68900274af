#!/usr/bin/env python3
"""One demo purchase through the running `iap dev` (python3 stdlib only).

usage: demo_purchase.py API_URL FAKE_APPSTORE_URL [TIMEOUT_SECONDS]

1. POST {FAKE}/fake/purchases            -> {transactionId, originalTransactionId, receiptData}
2. POST {API}/v1/receipts                -> 202 {submissionId, state: "pending"}
3. GET  {API}/v1/receipts/{submissionId} until state is "credited" (bounded)
Prints the final submission JSON on stdout; exits non-zero with a message otherwise.
"""
import base64
import hashlib
import hmac
import json
import os
import sys
import time
import urllib.error
import urllib.request

BUNDLE_ID = "com.example.demo"
PRODUCT_ID = "com.example.coins.60"
USER_ID = "demo-user"


def user_token(secret: str, user_id: str, lifetime: int = 3600) -> str:
    """An HS256 JWT for `user_id`, as the app's login backend would issue."""
    def b64(raw: bytes) -> str:
        return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()
    now = int(time.time())
    header = b64(json.dumps({"alg": "HS256", "typ": "JWT"}).encode())
    claims = b64(json.dumps({"sub": user_id, "iat": now, "exp": now + lifetime}).encode())
    signature = hmac.new(secret.encode(), f"{header}.{claims}".encode(), hashlib.sha256).digest()
    return f"{header}.{claims}.{b64(signature)}"


# With IAP_AUTH_HS256_SECRET set (an intake with IAP_AUTH=jwt), requests carry a user token.
SECRET = os.environ.get("IAP_AUTH_HS256_SECRET", "")
TOKEN = user_token(SECRET, USER_ID) if SECRET else None


def request(method: str, url: str, body: object = None) -> tuple[int, object]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Accept", "application/json")
    if TOKEN and "/v1/" in url:
        req.add_header("Authorization", f"Bearer {TOKEN}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as err:
        status, raw = err.code, err.read()
    except (urllib.error.URLError, OSError) as err:
        sys.exit(f"error: {method} {url} failed: {err}")
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        sys.exit(f"error: {method} {url} answered {status} with non-JSON body: {raw[:300]!r}")


def expect(cond: bool, what: str, status: int, body: object) -> None:
    if not cond:
        sys.exit(f"error: {what}: HTTP {status}, body {json.dumps(body)}")


def main() -> None:
    if len(sys.argv) not in (3, 4):
        sys.exit(__doc__)
    api, fake = sys.argv[1].rstrip("/"), sys.argv[2].rstrip("/")
    timeout = float(sys.argv[3]) if len(sys.argv) == 4 else 30.0

    status, purchase = request("POST", f"{fake}/fake/purchases",
                               {"bundleId": BUNDLE_ID, "productId": PRODUCT_ID, "environment": "Production"})
    expect(status in (200, 201) and isinstance(purchase, dict) and "receiptData" in purchase,
           "fake App Store purchase", status, purchase)
    print(f"==> fake purchase: transactionId={purchase.get('transactionId')} "
          f"originalTransactionId={purchase.get('originalTransactionId')}", file=sys.stderr)

    status, submission = request("POST", f"{api}/v1/receipts",
                                 {"userId": USER_ID, "receiptData": purchase["receiptData"],
                                  # The StoreKit transaction the app is about to finish.
                                  "transactionId": purchase["transactionId"]})
    expect(status == 202 and isinstance(submission, dict) and submission.get("submissionId"),
           "receipt submission", status, submission)
    submission_id = submission["submissionId"]
    print(f"==> submitted receipt: submissionId={submission_id} state={submission.get('state')}", file=sys.stderr)

    deadline = time.monotonic() + timeout
    state = submission.get("state")
    while True:
        # With authentication off the app names its user; with it on, the token does.
        query = "" if TOKEN else f"?userId={USER_ID}"
        status, submission = request("GET", f"{api}/v1/receipts/{submission_id}{query}")
        expect(status == 200 and isinstance(submission, dict), "submission lookup", status, submission)
        if submission.get("state") != state:
            state = submission.get("state")
            print(f"==> state: {state}", file=sys.stderr)
        if state == "credited":
            expect(submission.get("finishTransaction") is True,
                   "a credited upload naming its transaction is finishable", status, submission)
            break
        if time.monotonic() >= deadline:
            sys.exit(f"error: submission {submission_id} not credited after {timeout:g}s "
                     f"(last state {state!r}): {json.dumps(submission)}")
        time.sleep(0.25)

    print(json.dumps(submission, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
