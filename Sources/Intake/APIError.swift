import AppStore
import Foundation
public import Hummingbird
import Logging
import NIOConcurrencyHelpers
import NIOCore
import NIOHTTP1
import OrderStore

/// An error answer of the intake: `{"error": {"code": "...", "message": "..."}}` with a
/// stable `code` from `APIErrorCode`, which also fixes the HTTP status.
public struct APIError: Error, HTTPResponseError, Sendable {
    /// The stable, machine-readable code.
    public var code: APIErrorCode
    /// A human-readable explanation.
    public var message: String
    /// Headers sent with the answer (`Retry-After`, `WWW-Authenticate`, `Allow`).
    public var headers: HTTPFields = [:]

    /// The HTTP status, the code's.
    public var status: HTTPResponse.Status { code.status }

    /// Creates an error answer; the message defaults to the code's meaning.
    public init(_ code: APIErrorCode, _ message: String? = nil) {
        self.code = code
        self.message = message ?? code.meaning
    }

    public func response(from request: Request, context: some RequestContext) throws -> Response {
        makeResponse()
    }

    func makeResponse() -> Response {
        struct Body: Encodable {
            struct Detail: Encodable {
                var code: String
                var message: String
            }
            var error: Detail
        }
        let data = (try? JSONEncoder().encode(Body(error: .init(code: code.rawValue, message: message)))) ?? Data()
        var headers = headers
        headers[.contentType] = "application/json"
        return Response(status: status, headers: headers, body: .init(byteBuffer: ByteBuffer(bytes: data)))
    }

    static func invalidJSON(_ message: String) -> APIError {
        APIError(.invalidJSON, message)
    }

    static func missingField(_ field: String) -> APIError {
        APIError(.missingField, "the field '\(field)' is required")
    }

    static func invalidField(_ field: String, _ message: String) -> APIError {
        APIError(.invalidField, "'\(field)' \(message)")
    }

    /// 401 with `WWW-Authenticate` (RFC 6750): no token, or why the token was refused.
    static func unauthenticated(_ failure: AuthenticationFailure?) -> APIError {
        guard let failure else {
            var error = APIError(.unauthenticated, "send Authorization: Bearer <token>")
            error.headers[.wwwAuthenticate] = "Bearer"
            return error
        }
        var error = APIError(failure.code, failure.code.meaning)
        error.headers[.wwwAuthenticate] = "Bearer error=\"invalid_token\", error_description=\"\(failure.code.rawValue)\""
        return error
    }

    /// A notification that is not Apple's, or not for this app: 400 `jws_malformed` when it
    /// cannot be read, else 403 with the verifier's code (`jws_untrusted_chain`, …).
    static func notificationRefused(_ error: JWSVerificationError) -> APIError {
        APIError(APIErrorCode(error.code), error.message)
    }

    static func bodyTooLarge(limit: Int) -> APIError {
        APIError(.bodyTooLarge, "the body is larger than \(limit) bytes")
    }
}

/// Renders every error as the intake's JSON error shape, so no answer is ever a bare 500
/// page or a framework-specific body. A path or query holding an encoded NUL (`%00`) is
/// refused before any route reads it: no id the intake keeps can hold one.
struct APIErrorMiddleware<Context: RequestContext>: RouterMiddleware {
    /// The router's routes, to tell "no such path" (404) from "not with this method" (405).
    let routes: RouteTable

    func handle(
        _ request: Request, context: Context, next: (Request, Context) async throws -> Response
    ) async throws -> Response {
        do {
            guard !Self.holdsEncodedNUL(request.uri.string) else {
                throw APIError(.invalidField, "the path or query holds a NUL character (%00)")
            }
            return try await next(request, context)
        } catch let error as HTTPError where error.status == .notFound {
            let allowed = routes.methods(serving: request.uri.path)
            guard !allowed.isEmpty else {
                return APIError(.notFound, "no such path").makeResponse()
            }
            var response = APIError(.methodNotAllowed, "\(request.method) is not served here").makeResponse()
            response.headers[.allow] = allowed.joined(separator: ", ")
            return response
        } catch let error as APIError {
            return error.makeResponse()
        } catch is NIOTooManyBytesError {
            return APIError(.bodyTooLarge, "the body is larger than this route accepts").makeResponse()
        } catch is HTTPParserError {
            // The client's bytes, not our fault: a 4xx, and no error-level line a stranger could fill the log with.
            context.logger.info("request unreadable", metadata: ["iap.error.code": "\(APIErrorCode.badRequest.rawValue)"])
            return APIError(.badRequest, "the request's bytes cannot be read as HTTP/1.1").makeResponse()
        } catch let error as OrderStoreError where error.code == .unavailable {
            // Nothing was accepted: the app keeps its transaction and tries again.
            context.logger.error("order store unavailable", metadata: ["error": "\(error.message)"])
            var response = APIError(.storeUnavailable, "the upload could not be stored; try again").makeResponse()
            response.headers[.retryAfter] = "1"
            return response
        } catch let error as HTTPError {
            // The framework's own refusals, in the catalogue's words.
            let code: APIErrorCode
            switch error.status {
            case .notFound: code = .notFound
            case .methodNotAllowed: code = .methodNotAllowed
            case .contentTooLarge: code = .bodyTooLarge
            case .requestTimeout: code = .requestTimeout
            default: code = error.status.code < 500 ? .badRequest : .internalError
            }
            return APIError(code, error.body ?? error.status.reasonPhrase).makeResponse()
        } catch {
            context.logger.error("request failed", metadata: ["error": "\(String(reflecting: error))"])
            return APIError(.internalError, "the request could not be handled").makeResponse()
        }
    }
}

extension APIErrorMiddleware {
    /// Whether a request target (still percent-encoded) holds `%00`.
    static func holdsEncodedNUL(_ target: String) -> Bool {
        var utf8 = target.utf8[...]
        while let percent = utf8.firstIndex(of: UInt8(ascii: "%")) {
            utf8 = utf8[utf8.index(after: percent)...]
            if utf8.starts(with: "00".utf8) { return true }
        }
        return false
    }
}

/// The method and path template of every route, filled in once the routes are added.
final class RouteTable: Sendable {
    private let templates = NIOLockedValueBox([(method: String, segments: [Substring])]())

    func record<Context>(_ router: Router<Context>) {
        let routes = router.routes.map { (method: $0.method.rawValue, segments: Self.segments("\($0.path)")) }
        templates.withLockedValue { $0 = routes }
    }

    /// The methods of the routes whose template matches `path` (`{name}` matches any segment).
    func methods(serving path: String) -> [String] {
        let segments = Self.segments(path)
        return templates.withLockedValue { templates in
            templates.filter { template in
                template.segments.count == segments.count
                    && zip(template.segments, segments).allSatisfy { $0.hasPrefix("{") || $0 == $1 }
            }.map(\.method)
        }.sorted()
    }

    private static func segments(_ path: String) -> [Substring] {
        path.split(separator: "/", omittingEmptySubsequences: true)
    }
}
