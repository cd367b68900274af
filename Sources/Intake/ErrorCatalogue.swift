import AppStore
public import HTTPTypes
import IAPCore

/// Every error code the intake (app routes, admin routes, App Store notifications) can
/// answer, declared once with its HTTP status and what it means. The README's error table and
/// `docs/openapi.yaml` are checked against this list; a route never spells a code itself.
public enum APIErrorCode: String, CaseIterable, Sendable {
    // 400: the request is not acceptable as it is.
    case invalidJSON = "invalid_json"
    case missingField = "missing_field"
    case invalidField = "invalid_field"
    case receiptNotBase64 = "receipt_not_base64"
    case receiptEmpty = "receipt_empty"
    case receiptMalformed = "receipt_malformed"
    case receiptOtherApp = "receipt_other_app"
    case receiptUntrusted = "receipt_untrusted"
    case jwsMalformed = "jws_malformed"
    case unknownProduct = "unknown_product"
    case badRequest = "bad_request"
    // 401: who is asking is not established.
    case unauthenticated = "unauthenticated"
    case tokenExpired = "token_expired"
    case tokenNotYetValid = "token_not_yet_valid"
    case tokenSignatureInvalid = "token_signature_invalid"
    case tokenMalformed = "token_malformed"
    case tokenAlgorithmRefused = "token_algorithm_refused"
    case tokenAudienceMismatch = "token_audience_mismatch"
    case tokenIssuerMismatch = "token_issuer_mismatch"
    // 403: known, but not allowed; App Store notifications that are not Apple's for this app.
    case userMismatch = "user_mismatch"
    case forbidden = "forbidden"
    case jwsUnsupportedAlgorithm = "jws_unsupported_algorithm"
    case jwsInvalidChainLength = "jws_invalid_chain_length"
    case jwsInvalidCertificate = "jws_invalid_certificate"
    case jwsMissingAppleExtension = "jws_missing_apple_extension"
    case jwsCertificateExpired = "jws_certificate_expired"
    case jwsUntrustedChain = "jws_untrusted_chain"
    case jwsInvalidSignature = "jws_invalid_signature"
    case bundleIdMismatch = "bundle_id_mismatch"
    case environmentMismatch = "environment_mismatch"
    case appAppleIdMismatch = "app_apple_id_mismatch"
    // 404: nothing here for this caller.
    case notFound = "not_found"
    case submissionNotFound = "submission_not_found"
    case orderNotFound = "order_not_found"
    case purchaseNotFound = "purchase_not_found"
    case userNotFound = "user_not_found"
    case groupNotFound = "group_not_found"
    case extensionNotFound = "extension_not_found"
    // Other 4xx.
    case methodNotAllowed = "method_not_allowed"
    case requestTimeout = "request_timeout"
    case conflict = "conflict"
    case bodyTooLarge = "body_too_large"
    case rateLimited = "rate_limited"
    // 5xx: a fault or a limit of ours; nothing was accepted.
    case internalError = "internal_error"
    case overloaded = "overloaded"
    case storeUnavailable = "store_unavailable"
    case adminDisabled = "admin_disabled"
    case notificationsUnavailable = "notifications_unavailable"
    case notificationsBusy = "notifications_busy"
    case appleRefused = "apple_refused"
    case appleUnavailable = "apple_unavailable"

    /// The HTTP status every answer with this code has.
    public var status: HTTPResponse.Status {
        switch self {
        case .invalidJSON, .missingField, .invalidField, .receiptNotBase64, .receiptEmpty, .receiptMalformed, .receiptOtherApp, .receiptUntrusted, .jwsMalformed,
            .unknownProduct, .badRequest:
            .badRequest
        case .unauthenticated, .tokenExpired, .tokenNotYetValid, .tokenSignatureInvalid, .tokenMalformed,
            .tokenAlgorithmRefused, .tokenAudienceMismatch, .tokenIssuerMismatch:
            .unauthorized
        case .userMismatch, .forbidden, .jwsUnsupportedAlgorithm, .jwsInvalidChainLength, .jwsInvalidCertificate,
            .jwsMissingAppleExtension, .jwsCertificateExpired, .jwsUntrustedChain, .jwsInvalidSignature, .bundleIdMismatch,
            .environmentMismatch, .appAppleIdMismatch:
            .forbidden
        case .notFound, .submissionNotFound, .orderNotFound, .purchaseNotFound, .userNotFound, .groupNotFound, .extensionNotFound:
            .notFound
        case .methodNotAllowed: .methodNotAllowed
        case .requestTimeout: .requestTimeout
        case .conflict, .appleRefused: .conflict
        case .bodyTooLarge: .contentTooLarge
        case .rateLimited: .tooManyRequests
        case .internalError: .internalServerError
        case .overloaded, .storeUnavailable, .adminDisabled, .notificationsUnavailable, .notificationsBusy, .appleUnavailable:
            .serviceUnavailable
        }
    }

    /// The status as a number (400, 401, …).
    public var httpStatus: Int { status.code }

    /// What the code means, in one line (the README's error table says the same).
    public var meaning: String {
        switch self {
        case .invalidJSON: "the body is not JSON, or not a JSON object"
        case .missingField: "a required field is missing or empty"
        case .invalidField: "a field has the wrong type, is too long (ids: 256 characters) or holds a NUL character (also `%00` in the path or query)"
        case .receiptNotBase64: "`receiptData` is not base64"
        case .receiptEmpty: "`receiptData` decodes to nothing"
        case .receiptMalformed: "`receiptData` is not an app receipt: not a PKCS#7 container, one without Apple's certificates and signer, or its signed content is no receipt payload (or is padded with filler attributes)"
        case .receiptUntrusted: "`receiptData` is signed by certificates that lead to no trusted root at any time (a self-signed shell, someone else's chain): no App Store receipt is"
        case .receiptOtherApp: "`receiptData` is an app receipt of another app: its bundle id is not one of `\(Setting.bundleIds.variable)`"
        case .jwsMalformed: "a `signedTransaction` or `signedPayload` is not a readable compact JWS"
        case .unknownProduct: "the product is not in the catalog"
        case .badRequest: "the request cannot be read at all (a malformed request line, header or chunked body, or a `Transfer-Encoding` other than `chunked`)"
        case .unauthenticated: "no bearer token (user and admin routes alike)"
        case .tokenExpired: "the user token's `exp` has passed (30 s of leeway)"
        case .tokenNotYetValid: "the user token's `nbf` is still ahead (30 s of leeway)"
        case .tokenSignatureInvalid: "the user token's signature does not verify with the configured key"
        case .tokenMalformed: "the user token is not a JWT, lacks `sub` or `exp`, has an `iat` that is no number, names `crit` extensions, or lives longer than `\(Setting.authMaxLifetime.variable)` (\(Setting.authMaxLifetime.defaultText))"
        case .tokenAlgorithmRefused: "the user token's `alg` is not the configured key's (`none` included)"
        case .tokenAudienceMismatch: "the user token's `aud` lacks `\(Setting.authAudience.variable)`"
        case .tokenIssuerMismatch: "the user token's `iss` is not `\(Setting.authIssuer.variable)`"
        case .userMismatch: "the body's `userId` is not the token's user"
        case .forbidden: "an admin route with a token that is not an admin token (a user token included)"
        case .jwsUnsupportedAlgorithm: "an App Store notification not signed with ES256"
        case .jwsInvalidChainLength: "an App Store notification whose `x5c` is not leaf, intermediate and root"
        case .jwsInvalidCertificate: "an App Store notification with a certificate that cannot be read"
        case .jwsMissingAppleExtension: "an App Store notification whose certificates lack Apple's marker extensions"
        case .jwsCertificateExpired: "an App Store notification signed when a certificate was not valid"
        case .jwsUntrustedChain: "an App Store notification whose chain does not lead to a trusted root"
        case .jwsInvalidSignature: "an App Store notification whose signature does not verify"
        case .bundleIdMismatch: "an App Store notification for another app"
        case .environmentMismatch: "an App Store notification for an environment this deployment does not take"
        case .appAppleIdMismatch: "a production App Store notification for another App Store app id"
        case .notFound: "no such path"
        case .submissionNotFound: "no such upload, or another user's"
        case .orderNotFound: "no such order, or another user's"
        case .purchaseNotFound: "no purchase with this transaction id in the store"
        case .groupNotFound: "Apple knows no group with this id in that environment (Get Group Members)"
        case .extensionNotFound: "Apple knows no renewal-date extension of this product with this request identifier in that environment"
        case .userNotFound: "another user's grants, subscriptions or entitlements"
        case .methodNotAllowed: "the path does not serve this method (`Allow` lists those it does)"
        case .requestTimeout: "the body took longer than `\(Setting.bodyTimeoutSeconds.variable)` (\(Setting.bodyTimeoutSeconds.defaultText)) to arrive"
        case .conflict: "the change contradicts the store (another user's purchase, granted or revoked already)"
        case .bodyTooLarge: "the body exceeds `\(Setting.maxBodyBytes.variable)` (\(Setting.maxBodyBytes.defaultBytes); notifications: `\(Setting.notificationMaxBytes.variable)`, \(Setting.notificationMaxBytes.defaultBytes))"
        case .rateLimited: "over `\(Setting.rateLimitPerUser.variable)` (\(Setting.rateLimitPerUser.defaultText)/s) or `\(Setting.rateLimitPerIP.variable)` (\(Setting.rateLimitPerIP.defaultText)/s), bursts of twice that, or past 20 App Store notifications failing their checks from one address (then 5/s), or past 20 requests from one address refused for what they carried (400, 408, 413; then `\(Setting.refusalsPerIP.variable)`, 10/s); wait `Retry-After` seconds"
        case .internalError: "a fault of ours; the process keeps serving"
        case .overloaded: "more than `\(Setting.maxInFlightRequests.variable)` (\(Setting.maxInFlightRequests.defaultText)) requests in progress; retry after `Retry-After`"
        case .storeUnavailable: "the store could not be written or read (disk full, file locked); nothing was accepted"
        case .adminDisabled: "the admin routes are off: `\(Setting.adminToken.variable)` is not set"
        case .notificationsUnavailable: "this intake cannot check App Store notification signatures now"
        case .appleRefused: "Apple refused the change (Set App Account Token: not an original transaction id, a Family Sharing or an assigned purchase; a renewal-date extension: a free offer period, an expired or billing-retry subscription, two extensions within 365 days, a family member's access, an assigned seat); nothing was changed"
        case .appleUnavailable: "Apple could not be asked now, or the App Store Server API key is not configured; nothing was changed"
        case .notificationsBusy: "more verified App Store notifications than `\(Setting.notificationRate.variable)` (\(Setting.notificationRate.defaultText)/s for the whole deployment) allows; Apple retries after `Retry-After`"
        }
    }

    /// The code of a notification the signed-data verifier refused.
    init(_ code: JWSVerificationError.Code) {
        switch code {
        case .malformed: self = .jwsMalformed
        case .unsupportedAlgorithm: self = .jwsUnsupportedAlgorithm
        case .invalidChainLength: self = .jwsInvalidChainLength
        case .invalidCertificate: self = .jwsInvalidCertificate
        case .missingAppleExtension: self = .jwsMissingAppleExtension
        case .certificateExpired: self = .jwsCertificateExpired
        case .untrustedChain: self = .jwsUntrustedChain
        case .invalidSignature: self = .jwsInvalidSignature
        case .bundleIdMismatch: self = .bundleIdMismatch
        case .environmentMismatch: self = .environmentMismatch
        case .appAppleIdMismatch: self = .appAppleIdMismatch
        }
    }
}
