"""Schemathesis hooks of scripts/api-check (loaded with SCHEMATHESIS_HOOKS=<this file>).

- Auth: the user token on the app's routes, the admin token on /v1/admin/..., nothing on the
  public ones (each operation's `security` in docs/openapi.yaml says which).
- Positive cases are made meaningful where JSON Schema cannot say what the server needs:
  `receiptData` becomes a real receipt, `signedTransaction` (and `signedAppTransaction`) a real signed transaction
  (minted by the script at the fake App Store), `signedPayload` a notification the fake signed,
  `productId` a product of the live catalog (an auto-renewable one for a mass extension), the user the token's subject, and an admin
  action's `actor` a plain ASCII staff name when it is not one (an actor mixing scripts, which
  a random string of the schema's pattern usually does, an app user's `user:<id>` copied from
  the audit log, or a service's name, is rightly refused as `invalid_field`). Without this,
  every "valid" upload would be a random base64 string, rightly refused as
  `receipt_malformed`, and the success paths would never be exercised.
- Every request must stay on the intake under test, on a documented path.

Settings come from the environment: IAP_CHECK_BASE_URL, IAP_CHECK_USER_TOKEN,
IAP_CHECK_USER_ID, IAP_CHECK_ADMIN_TOKEN, IAP_CHECK_RECEIPT, IAP_CHECK_SIGNED_TRANSACTION,
IAP_CHECK_SIGNED_NOTIFICATION, IAP_CHECK_PRODUCTS, IAP_CHECK_SUBSCRIPTION_PRODUCTS.
"""

import os
from urllib.parse import urlsplit

import schemathesis

BASE_URL = os.environ["IAP_CHECK_BASE_URL"].rstrip("/")
USER_TOKEN = os.environ["IAP_CHECK_USER_TOKEN"]
USER_ID = os.environ["IAP_CHECK_USER_ID"]
ADMIN_TOKEN = os.environ["IAP_CHECK_ADMIN_TOKEN"]
RECEIPT = os.environ["IAP_CHECK_RECEIPT"]
SIGNED_TRANSACTION = os.environ["IAP_CHECK_SIGNED_TRANSACTION"]
# A notification the fake App Store signed: the intake checks the signature before it
# stores anything, so only a genuine one is accepted (the same one again is harmless).
SIGNED_NOTIFICATION = os.environ["IAP_CHECK_SIGNED_NOTIFICATION"]
PRODUCTS = [p for p in os.environ.get("IAP_CHECK_PRODUCTS", "").split(",") if p]
SUBSCRIPTION_PRODUCTS = [p for p in os.environ.get("IAP_CHECK_SUBSCRIPTION_PRODUCTS", "").split(",") if p]


def _schemes(operation) -> set[str]:
    """The security schemes an operation requires, from its own `security` in the document."""
    security = operation.definition.raw.get("security", [])
    return {name for requirement in security for name in requirement}


# No caching: the token depends on the operation.
@schemathesis.auth(refresh_interval=None)
class IntakeTokens:
    def get(self, case, context):
        schemes = _schemes(context.operation)
        if "adminToken" in schemes:
            return ADMIN_TOKEN
        if "userToken" in schemes:
            return USER_TOKEN
        return None

    def set(self, case, data, context):
        case.headers = case.headers or {}
        case.headers["Authorization"] = f"Bearer {data}"


@schemathesis.hook
def filter_path_parameters(context, path_parameters):
    # "." and ".." would be resolved by the HTTP client into another path.
    return not any(str(value) in (".", "..") for value in (path_parameters or {}).values())


# The services' own names and Apple's (IdentifierText.reservedActors and applesNames), which no
# person may sign as.
_RESERVED_ACTORS = {
    "apple", "system", "reconciliation", "transfer", "intake", "verifier", "finisher", "console",
    "appleinc", "applecomputer", "applecomputerinc", "appstore", "appleappstore", "itunes",
    "itunesstore", "applecare", "applesupport", "storekit",
}


def _actor_refused(actor: str) -> bool:
    """Whether the intake rightly refuses `actor` as a staff name (IdentifierText.actorProblem),
    in the ASCII cases a generated or linked value reaches: any letters outside ASCII (a random
    string of the pattern mixes scripts), an app user's entry (`user:<id>`, which stateful
    links copy from the audit log's actors), or a service's or Apple's name."""
    if not actor.isascii():
        return True
    letters = "".join(c for c in actor.lower() if c.isalnum())
    return (letters.startswith("user") and ":" in actor) or letters in _RESERVED_ACTORS


def _is_positive(case) -> bool:
    meta = case.meta
    return meta is not None and meta.generation.mode.is_positive


@schemathesis.hook
def before_call(context, case, kwargs):
    path = case.operation.path
    if _is_positive(case):
        body = case.body if isinstance(case.body, dict) else None
        if path in ("/v1/receipts", "/v1/orders") and body is not None:
            body["userId"] = USER_ID
        if path == "/v1/receipts" and body is not None:
            if "receiptData" in body:
                body["receiptData"] = RECEIPT
            if "signedTransaction" in body:
                body["signedTransaction"] = SIGNED_TRANSACTION
            if "signedAppTransaction" in body:
                # A compact JWS the fake signed: the intake checks its shape before it takes the upload.
                body["signedAppTransaction"] = SIGNED_TRANSACTION
        if path == "/v1/notifications/appstore" and body is not None:
            body["signedPayload"] = SIGNED_NOTIFICATION
        if path in ("/v1/orders", "/v1/admin/grants") and body is not None and PRODUCTS:
            if body.get("productId") not in PRODUCTS:
                body["productId"] = PRODUCTS[len(str(body.get("productId"))) % len(PRODUCTS)]
        if path == "/v1/admin/renewal-extensions" and body is not None and SUBSCRIPTION_PRODUCTS:
            if body.get("productId") not in SUBSCRIPTION_PRODUCTS:
                body["productId"] = SUBSCRIPTION_PRODUCTS[len(str(body.get("productId"))) % len(SUBSCRIPTION_PRODUCTS)]
        if path.startswith("/v1/admin/") and body is not None and isinstance(body.get("actor"), str):
            if _actor_refused(body["actor"]):
                body["actor"] = f"cs-{len(body['actor'])}"
        if path in ("/v1/users/{userId}/grants", "/v1/users/{userId}/subscriptions", "/v1/users/{userId}/entitlements"):
            case.path_parameters["userId"] = USER_ID
    target = urlsplit(BASE_URL + case.formatted_path)
    segments = target.path.split("/")
    if urlsplit(BASE_URL).netloc != target.netloc or "." in segments or ".." in segments:
        raise RuntimeError(f"refusing to send a request off the intake: {target.geturl()}")
